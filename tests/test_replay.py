"""av_lab.replay: recorded streams through the decision, priced by a deployment's tables."""

import jax.numpy as jnp
import numpy as np
import pytest

from av_jax import policy as P
from av_lab import record
from av_lab import replay as R


def _pool(accepted, K=4, steps=40, streams=3):
  rows = steps * streams
  return R.Pool(features=jnp.full((rows, K), 3.0), accepted=jnp.full((rows,), accepted, jnp.int32),
                accept_probs=jnp.ones((rows, K)), starts=np.arange(streams) * steps,
                steps=np.full(streams, steps), groups=np.zeros(streams, int))


def _flat_cost(B, K):
  depth = np.zeros((B + 1, K), np.float32)
  depth[1:, :] = 0.1
  return P.StepCost(jnp.asarray(depth), jnp.ones((B * (K + 1) + 1,), jnp.float32))


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_static_arms_emit_what_the_stream_accepts(k):
  # Every step accepts 2 drafts under full verification: fixed:k emits min(2, k) + 1 a
  # step, so a request of 30 tokens takes ceil(30 / (min(2, k) + 1)) steps.
  B, K, L = 1, 4, 30
  pool = _pool(2, K)
  requests = R.make_requests(pool, num=3, length=L, seed=0)
  cost = _flat_cost(B, K)
  tot, _ = R._run(pool.features, pool.accepted, pool.accept_probs, requests, cost, k,
                  jnp.zeros(()), arm="static", num_slots=B, kind="autoregressive", policy=None)
  per = min(2, k) + 1
  assert float(tot.tokens) == 3 * L
  assert int(tot.steps) == 3 * -(-L // per)
  np.testing.assert_allclose(float(tot.ms), int(tot.steps) * (1.0 + 0.1 * k), rtol=1e-5)


def test_requests_never_run_out_of_recorded_steps():
  pool = R.load_pool("block", "math")
  req = R.make_requests(pool, num=200, length=64, seed=3)
  start, length = np.asarray(req.start), np.asarray(req.length)
  ends = pool.starts + pool.steps
  stream = np.searchsorted(pool.starts, start, side="right") - 1
  assert np.all(start + length <= ends[stream])  # >= 1 token a step: never past the end
  assert np.all(length >= 1) and np.mean(length == 64) > 0.9


def test_oracle_and_av_on_recorded_streams():
  pool = R.load_pool("eagle", "mixed")
  arms = list(R.static_arms(8)) + ["av", "oracle"]
  res = R.replay_point(R.Point("eagle", "mixed", "h200", 16), arms=arms, pool=pool,
                       num_requests=48, length=48, warm=False)
  best = max(res[a]["tokens_per_s"] for a in R.static_arms(8))
  assert res["oracle"]["tokens_per_s"] >= best
  # Every arm emits the same tokens; AV within a wide band of the best static arm (the
  # replay grid in BENCHMARKS.md holds the measured ratios).
  assert len({round(r["tokens"]) for r in res.values()}) == 1
  assert 0.8 < res["av"]["tokens_per_s"] / best < 1.2
  assert 0.0 < res["av"]["explore_share"] <= 0.011 + 1e-6
  assert abs(res["av"]["calibration"] - 1.0) < 0.25


def test_recorded_streams_are_consistent():
  s = record.load("draft_lm", "code")
  probs, acc = s.accept_probs.astype(np.float32), s.accepted.astype(int)
  assert s.features.shape == probs.shape and s.offsets[-1] == len(acc)
  # A position accepted under full verification had a positive acceptance probability.
  K = s.max_draft
  reached = np.arange(K)[None, :] < acc[:, None]
  assert np.all(probs[reached] > 0)
  # The mean true probability at depth 1 matches the accept rate there (many samples).
  np.testing.assert_allclose(probs[:, 0].mean(), (acc > 0).mean(), atol=0.03)


def test_depth_cap_arm_runs_av_on_the_chosen_engine():
  """`av-depth-cap` at a point where the best static arm is shallow (block mixed h200
  B = 64: fixed:2-3) picks a small cap (its warm-up requests, not the replayed ones),
  emits the same tokens as every arm, and beats AV on the K = 8 engine there; the
  cap's run is the `av` arm replayed on the truncated streams with that cap's tables
  (the negative control: with the drafting priced double it is not the same run)."""
  pool = R.load_pool("block", "mixed")
  point = R.Point("block", "mixed", "h200", 64)
  res = R.replay_point(point, arms=["fixed:2", "av", "av-depth-cap"], pool=pool,
                       num_requests=192, length=64)
  cap = res["av-depth-cap"]["depth_cap"]
  assert 1 <= cap <= 4
  assert len({round(r["tokens"]) for r in res.values()}) == 1
  assert res["av-depth-cap"]["tokens_per_s"] > res["av"]["tokens_per_s"]
  sub = R._truncated(pool, cap)
  again = R.replay_point(point, arms=["av"], pool=sub, num_requests=192, length=64,
                         cost_fn=lambda k: R.deployment_cost("h200", "block", 64, k, cap))
  assert again["av"]["tokens_per_s"] == pytest.approx(res["av-depth-cap"]["tokens_per_s"],
                                                      rel=1e-5)
  base = R.deployment_cost("h200", "block", 64, cap, cap)
  dearer = R.replay_point(point, arms=["av"], pool=sub, num_requests=192, length=64,
                          cost_fn=lambda k: base._replace(
                              draft_depth_ms=2.0 * base.draft_depth_ms))
  assert dearer["av"]["tokens_per_s"] != pytest.approx(again["av"]["tokens_per_s"], rel=1e-3)


def test_the_depth_cap_predicts_each_warm_up_run_with_its_own_coefficients():
  """Eagle math, h200, B = 1024: the warm-up takes several runs (~2 refits a run) and the
  position-0 intercept swings between refits. The cap's curves predict every run's
  requests with the coefficients that run ended with, and keep a deep cap (fixed:5-8 are
  the best static arms there). Negative control: the last refit's coefficients alone
  (its slope 0) halve the predicted survival and pick cap 2. The warm-up drafts to the
  planned depths (`av-planned`) under the plan of the drafts' own estimator (`av-unlagged`),
  whose labelling swings the intercept most."""
  pool = R.load_pool("eagle", "math")
  B, K = 1024, 8
  policy = R._policy("av-unlagged", K, "autoregressive", 16)
  caps = [R.deployment_cost("h200", "eagle", B, k, k) for k in range(1, K + 1)]
  runs = []
  last = R._warm(policy, pool, caps[-1], B=B, kind="autoregressive", length=64, seed=0,
                 runs=runs, arm="av-planned")
  assert len(runs) >= 3 and runs[-1][1] is last
  pick = lambda survival: P.depth_cap(survival, caps, num_slots=B).cap
  over_runs = np.concatenate([R._request_curves(policy, state, pool, requests)
                              for requests, state in runs])
  assert pick(over_runs) >= 4
  one_refit = R._request_curves(policy, last, pool, runs[0][0])
  assert pick(one_refit) <= 2


def test_warm_estimator_has_been_refitted_where_requests_are_short():
  """Eagle math requests finish in a few steps (most drafts are accepted): one warm-up
  run of 32 requests at B = 16 is ~24 steps, one refit at 16 steps a round; the warm-up
  repeats until the estimator has been refitted `WARM_REFITS` times, and the warm AV's
  predictions are then calibrated on the replayed requests (predicted / accepted over the
  verified drafts)."""
  pool = R.load_pool("eagle", "math")
  B, K = 16, 8
  policy = R._policy("av", K, "autoregressive", 16)
  cost = R.deployment_cost("h100", "eagle", B, K, K)
  one = R.warmup_requests(pool, B=B, length=64, seed=0)
  _, once = R._run(pool.features, pool.accepted, pool.accept_probs, one, cost, 0,
                   policy.init(B), arm="av", num_slots=B, kind="autoregressive", policy=policy)
  assert int(once.estimator.num_refits) < R.WARM_REFITS  # the case the repeat is for
  warm = R._warm(policy, pool, cost, B=B, kind="autoregressive", length=64, seed=0)
  assert int(warm.estimator.num_refits) >= R.WARM_REFITS
  point = R.Point("eagle", "math", "h100", B)
  warmed = R.replay_point(point, arms=["av"], pool=pool, num_requests=96, length=64)
  assert abs(warmed["av"]["calibration"] - 1.0) < 0.1


def test_a_cost_table_file_prices_the_replay(tmp_path):
  # A table saved from the roofline's K = 8 eagle tables prices a K = 8 engine exactly as
  # the roofline does; a K = 2 engine pays the file's first two depth columns; target-only
  # pays no drafting; more slots than the table's drafter rows is an error naming devices.
  from av_jax import costs
  B, K = 4, 8
  tables = costs.roofline_costs("llama3-8b", R.SHAPES["eagle"], "h100",
                                drafter_kind="autoregressive", num_slots=B, max_draft=K,
                                context_len=2048)
  path = str(tmp_path / "h100.json")
  costs.save_cost_table(path, tables)
  from_file = R.deployment_cost(path, "eagle", B, K, K)
  modelled = R.deployment_cost("h100", "eagle", B, K, K)
  np.testing.assert_allclose(np.asarray(from_file.draft_depth_ms),
                             np.asarray(modelled.draft_depth_ms), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(from_file.verify_ms),
                             np.asarray(modelled.verify_ms), rtol=1e-6)
  two = np.asarray(R.table_cost(path, B, 2, K).draft_depth_ms)
  np.testing.assert_allclose(two[:, :2], np.asarray(tables.draft_depth_ms)[:, :2], rtol=1e-6)
  assert not two[:, 2:].any() and two[B, 1] > 0
  assert not np.asarray(R.table_cost(path, B, 0, K).draft_depth_ms).any()
  with pytest.raises(ValueError, match="devices: .*up to 4 drafting requests"):
    R.table_cost(path, B + 1, 2, K)
