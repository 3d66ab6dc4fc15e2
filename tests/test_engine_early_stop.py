"""Early stop of autoregressive drafting in the engine: exactness and wiring.

`av` (survival stop, docs/algorithm.md section 10) and `confstop:T` end the drafting loop
per request and for the batch; `av-no-stop` drafts all K like the `av` of before.

* greedy identity with target-only decoding (eagle, draft_lm; `av`, `confstop:0.5`);
* `av-no-stop` reproduces the golden `av` run recorded before survival stop, bit for bit
  (`tests/golden/av_no_stop.json`);
* the emitted token's distribution in the sensitive regime (B = 1, K = 3, step-shaped
  verify cost so the budget splits on x1, frozen estimator, no exploration) against the
  exact target marginal, with the negative control (budget and tau from THIS step's
  drafted survivals) caught; the harness compiles once;
* a drafter whose depth-2 logits are NaN in one slot still verifies position 1 exactly as
  a clean run does (issue 12, item 6);
* idle slots draft nothing and change nothing.
"""

import dataclasses
import functools
import json
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sps

import av_jax
from av_jax import engine as E
from av_jax.decision import make_decider
from av_jax.estimator import EstimatorConfig
from av_jax.models.drafters import Drafter
from av_jax.planner import PlannerConfig
from tests import _engine_fixtures as fx
from tests.golden import make_golden as golden

AR_KINDS = ("eagle", "draft_lm")


# ------------------------------------------------------------------ greedy identity


@pytest.mark.parametrize("mode", ["av", "av-gate", "confstop:0.5"])
def test_greedy_identity_with_target_only(mode):
  prompts, max_new = [[1, 2, 3], [4], [5, 6, 7, 8, 9]], [9, 11, 7]
  want = [fx.greedy_reference(False, p, n) for p, n in zip(prompts, max_new)]
  passes = {}
  for kind in AR_KINDS:
    cfg, drafter, params = fx.pair(kind)
    engine = E.make_engine(E.EngineConfig(num_slots=3, max_draft=3, max_len=40, mode=mode,
                                          temperature=0.0, num_buckets=1, steps_per_chunk=4,
                                          explore_every=3), cfg, drafter)
    assert engine.decider.planner.stop == {"av": "policy", "av-gate": "survival"}.get(
        mode, "confidence")
    result = E.generate(engine, params, prompts, max_new_tokens=max_new, key=fx.key(0),
                        keep_infos=True)
    assert [c.tokens for c in result.completions] == want, kind
    p = np.concatenate([np.asarray(i.draft_passes) for i in result.infos])
    d = np.concatenate([np.asarray(i.drafted_depth) for i in result.infos])
    on = np.concatenate([np.asarray(i.slot_active) for i in result.infos])
    if mode == "av":  # the priced plan: any depth 0..K per request, no more than planned
      assert (p <= 3).all() and (p >= 1).any()
    else:
      assert ((p >= 1) & (p <= 3))[on.any(axis=1)].all()
      assert (d[on] >= 1).all()  # every active slot drafts depth 1
    # No slot drafts deeper than the passes run; idle slots draft nothing.
    assert (d <= p[:, None]).all() and (d[~on] == 0).all()
    passes[kind] = p
  # Random tiny drafters are poor: the stop must have ended drafting early somewhere.
  assert all((p < 3).any() for p in passes.values()), passes


# ------------------------------------------------------- av-no-stop is the old av


def test_av_no_stop_reproduces_recorded_av():
  name = "eagle/av/t1"  # sampled drafts of an autoregressive drafter: the lagged policy
  case = dict(golden.TINY_CASES[name])
  kind = case.pop("kind")
  cfg, drafter, params = fx.pair(kind)
  # The gate off: EAGLE always drafted when this was recorded (it skips drafting since
  # it gained `absorb`, issue 14).
  config = golden.engine_config(**{**golden.BASE, **case, "mode": "av-no-stop",
                                   "skip_unprofitable_drafts": False})
  engine = E.make_engine(config, cfg, drafter)
  assert engine.decider.planner.stop == "none"
  got = golden._record(engine, params, cost=golden._cost(None, config),
                       seed=zlib.crc32(name.encode()) % 1000, prompts=golden.PROMPTS,
                       max_new=golden.MAX_NEW)
  # `av` of `eagle/av/t1` as recorded before survival stop shipped (tiny.json now holds
  # the survival-stop run of the case).
  want = golden.load(os.path.join(golden.HERE, "av_no_stop.json"))[name]
  # Decisions, tokens and counts exact; floats to 1e-5 (EAGLE's drafting program changed
  # shape with `absorb`, moving features by float reassociation, ~1e-6).
  assert golden.differences(want, got, rtol=1e-5) == []
  bad = json.loads(json.dumps(got))
  bad["tokens"][0][0] += 1
  assert golden.differences(want, bad, rtol=1e-5)  # a changed token is still caught
  assert all(p == 3 for p in got["steps"]["draft_passes"] if p)  # all K depths


# ----------------------------------------------- sensitive regime, large sample

K3 = 3
N_SAMPLES = 2048
# A frozen estimator (no refit within the run) whose acceptance depends strongly on the
# feature, so S[1, 2] spreads over the values of x1.
FROZEN = EstimatorConfig(refit_interval=10**9, init_slope=1.5, init_intercept=0.5)


def _sensitive_engine(kind: str, variant: str) -> E.Engine:
  cfg, drafter, _ = fx.pair(kind)
  mode = "av-no-stop" if variant == "no_stop" else "av-gate"
  # min_depth 2: without exploration a budget of 0 sets tau = +inf, and a batch drafting
  # depth 1 only could then never see a budget above 0 again in this regime.
  config = E.EngineConfig(num_slots=1, max_draft=K3, max_len=24, mode=mode, temperature=1.0,
                          num_buckets=1, estimator=FROZEN,
                          planner=PlannerConfig(explore_every=0, stop_min_depth=2))
  engine = E.make_engine(config, cfg, drafter)
  if variant == "this_step":  # negative control: budget and tau from this step's drafts
    decider = make_decider(K3, policy="current", estimator=FROZEN,
                           planner=dataclasses.replace(engine.decider.planner.config,
                                                       draft_stop="survival"))
    engine = engine._replace(decider=decider)
  return engine


def _step_cost(threshold: float) -> av_jax.CostModel:
  """B = 1, K = 3: verifying 1..3 drafts costs the same step c, verifying none costs 1.

  Verifying every drafted position beats fewer (same cost, more gain); it beats none iff
  (1 + s1 + ... + s_d) / (d + c) > 1 / (d + 1), i.e. iff s1 + ... + s_d > threshold.
  """
  d = 0.1
  c = (1.0 + threshold) * (d + 1.0) - d
  return av_jax.CostModel(draft_ms=jnp.full((2,), d, jnp.float32),
                          verify_ms=jnp.asarray([0.0, 1.0, c, c, c], jnp.float32))


@functools.lru_cache(maxsize=None)
def _start(kind: str):
  """A one-slot state after prefilling a fixed prompt (its first token drawn)."""
  cfg, _, params = fx.pair(kind)
  engine = _sensitive_engine(kind, "exact")
  state = E.init_state(engine, params, fx.key(11), _step_cost(1.0))
  state = E.prefill(engine, params, state, prompt=jnp.asarray([3, 1, 4, 1], jnp.int32),
                    prompt_len=jnp.int32(4), slot=jnp.int32(0), max_new=jnp.int32(20))
  return state


@functools.partial(jax.jit, static_argnames=("engine", "num"))
def _repeat(engine, params, state0, cost, planner, key, *, num):
  """`num` steps, each from the same context with a fresh key; the planner state (lagged
  budget, tau) carries over as in a run. Returns the first emitted token per step and
  the step records."""
  def body(carry, k):
    s = state0._replace(planner=carry, key=k, cost=cost)
    s2, info = E.step(engine, params, s)
    return s2.planner, (s2.tokens[0, state0.length[0]], info.num_verified[0],
                        info.draft_passes)
  planner, out = jax.lax.scan(body, planner, jax.random.split(key, num))
  return planner, out


def _run(kind, variant, cost, seed):
  _, _, params = fx.pair(kind)
  engine = _sensitive_engine(kind, variant)
  state0 = _start(kind)
  planner = engine.decider.planner.init()
  _, (tokens, verified, passes) = _repeat(engine, params, state0, cost, planner,
                                          fx.key(seed), num=N_SAMPLES)
  return np.asarray(tokens), np.asarray(verified), np.asarray(passes)


def _target_marginal(kind, state0):
  cfg, _, params = fx.pair(kind)
  n = int(state0.length[0])
  logits = fx.target_logits(cfg, params.target, np.asarray(state0.tokens[:1, :n]))[0]
  p = np.exp(logits - logits.max())
  return p / p.sum()


def _chi2_pvalue(tokens, p):
  counts = np.bincount(tokens, minlength=p.size)
  expected = p * tokens.size
  big = expected >= 5  # pool the rare tokens into one bin
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  keep = exp > 0
  return sps.chisquare(obs[keep], exp[keep]).pvalue


def _adversarial_threshold(kind):
  """The s1 + s2 at which the budget splits the draws of x1 about in half (by q1 mass):
  from a run drafting all K, its features and the frozen estimator."""
  _, _, params = fx.pair(kind)
  engine = _sensitive_engine(kind, "no_stop")
  state0 = _start(kind)
  k = fx.key(5)

  @jax.jit
  def once(k):
    _, info = E.step(engine, params, state0._replace(key=k))
    return info.probs[0]
  probs = np.asarray(jax.vmap(once)(jax.random.split(k, 256)))
  s = np.cumprod(probs, axis=1).sum(axis=1)
  return float(np.median(s))


@pytest.mark.parametrize("kind", ["eagle"])
def test_emitted_token_is_target_distributed_in_the_sensitive_regime(kind):
  """Chi-square of the first emitted token over N_SAMPLES steps from one context.

  Tolerance: the exact arms must give p >= 1e-3 (a false alarm 1 time in 1000 per
  arm); the negative control, whose budget for x1 depends on x1 through S[2], must give
  p < 1e-3. Seeds are fixed, so the outcome is reproducible.
  """
  threshold = _adversarial_threshold(kind)
  cost = _step_cost(threshold)
  state0 = _start(kind)
  p = _target_marginal(kind, state0)
  pvalues, verified = {}, {}
  for variant in ("exact", "no_stop", "this_step"):
    tokens, ver, passes = _run(kind, variant, cost, seed=21)
    pvalues[variant], verified[variant] = _chi2_pvalue(tokens, p), ver
    if variant == "exact":
      assert set(np.unique(passes)) <= {2, 3}
  # The regime is the sensitive one: the budget does split between 0 and 2.
  for variant in verified:
    assert 0.1 < np.mean(verified[variant] == 0) < 0.9, (variant, np.bincount(verified[variant]))
  assert pvalues["exact"] >= 1e-3 and pvalues["no_stop"] >= 1e-3, pvalues
  assert pvalues["this_step"] < 1e-3, pvalues


def test_drafting_harness_compiles_once():
  kind = "eagle"
  _, _, params = fx.pair(kind)
  engine = _sensitive_engine(kind, "exact")
  state0 = _start(kind)
  before = _repeat._cache_size()
  planner = engine.decider.planner.init()
  for seed, t in ((1, 0.5), (2, 1.5)):  # new keys, a new cost table, a carried planner
    planner, _ = _repeat(engine, params, state0, _step_cost(t), planner, fx.key(seed),
                         num=8)
  assert _repeat._cache_size() - before <= 1


# ------------------------------------------- issue 12 item 6: finite prefix verified


@functools.lru_cache(maxsize=None)
def _nan_at_depth_2() -> Drafter:
  """The copy-target draft LM whose depth-2 logits are NaN in slots where `poison`."""
  inner = fx.pair("draft_lm", copy_target=True)[1]

  def init_state(params, target_params, **kwargs):
    return inner.init_state(params[0], target_params, **kwargs)

  def draft(params, target_params, state, key, **kwargs):
    out = inner.draft(params[0], target_params, state, key, **kwargs)
    bad = params[1][:, None] & (jnp.arange(out.logits.shape[1]) == 1)[None]   # [B, K]
    hit = lambda x: jnp.where(bad[..., None], jnp.nan, x)
    return out._replace(logits=hit(out.logits), log_probs=hit(out.log_probs))

  return Drafter(inner.kind, inner.drafting, init_state, draft, inner.commit)


def test_nonfinite_depth_2_still_verifies_position_1():
  cfg = fx.pair("draft_lm", copy_target=True)[0]
  target = fx.pair("draft_lm", copy_target=True)[2].target
  B, K = 2, 3
  engine = E.make_engine(E.EngineConfig(num_slots=B, max_draft=K, max_len=32,
                                        mode="av-no-stop", temperature=1.0, num_buckets=1,
                                        explore_every=0), cfg, _nan_at_depth_2())
  # Verification always gets cheaper: the budget is everything in both runs.
  cost = av_jax.CostModel(draft_ms=jnp.ones((B + 1,), jnp.float32),
                          verify_ms=jnp.linspace(2.0, 1.0, B * (K + 1) + 1,
                                                 dtype=jnp.float32))
  infos, tokens = {}, {}
  for poisoned in (False, True):
    params = E.Params(target=target, drafter=(target, jnp.asarray([poisoned, False])))
    state = E.init_state(engine, params, fx.key(3), cost)
    for slot, prompt in enumerate(([2, 7, 1], [5, 5])):
      padded = jnp.zeros((8,), jnp.int32).at[:len(prompt)].set(jnp.asarray(prompt))
      state = E.prefill(engine, params, state, prompt=padded, prompt_len=jnp.int32(len(prompt)),
                        slot=jnp.int32(slot), max_new=jnp.int32(10))
    new, info = jax.jit(E.step, static_argnums=0)(engine, params, state)
    infos[poisoned], tokens[poisoned] = jax.device_get(info), np.asarray(new.tokens)
  clean, bad = infos[False], infos[True]
  assert clean.num_verified.tolist() == [K, K]          # a copy of the target: all verified
  assert bad.num_verified.tolist() == [1, K]            # the finite prefix of slot 0
  # Position 1 of slot 0: the same draft, verified and accepted as in the clean run, and
  # the same token emitted; the clean slot is untouched by the other's fault.
  assert bad.accepted[0, 0] == clean.accepted[0, 0] == True
  assert bad.labeled[0].tolist() == [True, False, False]
  np.testing.assert_array_equal(tokens[True][0, :5], tokens[False][0, :5])
  np.testing.assert_array_equal(tokens[True][1], tokens[False][1])
  np.testing.assert_array_equal(bad.accepted[1], clean.accepted[1])


# ------------------------------------------- features kept from the drafting stop


@pytest.mark.parametrize("kind", AR_KINDS)
def test_drafts_carry_the_features_the_stop_computed(kind):
  """With a stop, `_draft` takes each drafted depth's feature from the stop's own
  per-depth computation (`DraftOutput.keep_aux`) instead of recomputing `logit_qmax` over
  `[B, K, V]`: the features must equal that recomputation, the uniform row's feature at
  the positions not drafted, and the early stop must have left some undrafted."""
  from av_jax import features as F
  from av_jax.engine import core
  cfg, drafter, params = fx.pair(kind)
  B, K = 3, 4
  engine = E.make_engine(E.EngineConfig(num_slots=B, max_draft=K, max_len=40, mode="av-gate",
                                        temperature=1.0, num_buckets=1), cfg, drafter)
  # Dear passes and verification: the stop ends drafting early (positions not drafted).
  cost = av_jax.make_cost_model(np.full(B + 1, 5.0), 1.0 + 0.5 * np.arange(B * (K + 1) + 1))
  state = E.init_state(engine, params, fx.key(5), cost)
  for slot, prompt in enumerate(([1, 2, 3], [4, 9], [5, 6, 7, 8])):
    padded = jnp.zeros((8,), jnp.int32).at[:len(prompt)].set(jnp.asarray(prompt))
    state = E.prefill(engine, params, state, prompt=padded, prompt_len=jnp.int32(len(prompt)),
                      slot=jnp.int32(slot), max_new=jnp.int32(20))
  V = cfg.target.vocab_size

  @jax.jit
  def both(state, key):
    drafts = core._draft(engine, params, state.drafter, key, state.decision,
                         active=state.active)
    keep_fn, aux0 = core._keep_fn(engine, state.active, state.decision)
    out = engine.drafter.draft(params.drafter, params.target, state.drafter, key, K=K,
                               temperature=1.0, top_p=1.0, keep_fn=keep_fn, keep_init=aux0)
    return drafts, out

  step = jax.jit(E.step, static_argnums=0)
  checked = np.zeros((B, K), bool)
  for seed in range(4):
    drafts, out = both(state, jax.random.PRNGKey(seed))
    assert out.keep_aux is not None
    drafted = np.arange(K)[None] < np.asarray(out.depth)[:, None]
    log_probs = jnp.where(jnp.asarray(drafted)[..., None], out.log_probs, -jnp.log(V * 1.0))
    want = np.asarray(F.logit_qmax(log_probs))
    np.testing.assert_allclose(np.asarray(drafts.features), want, rtol=1e-5, atol=1e-5)
    checked |= ~drafted
    state, _ = step(engine, params, state)
  # Random tiny drafters are poor: the stop ends early, so the uniform branch is covered.
  assert checked.any()


# ------------------------------------------------------------- idle slots inert


@pytest.mark.parametrize("mode", ["av", "confstop:0.5"])
def test_idle_slots_draft_nothing_and_change_nothing(mode):
  cfg, drafter, params = fx.pair("eagle")
  B, K = 3, 3
  engine = E.make_engine(E.EngineConfig(num_slots=B, max_draft=K, max_len=32, mode=mode,
                                        temperature=1.0, num_buckets=1), cfg, drafter)
  state = E.init_state(engine, params, fx.key(4))
  padded = jnp.zeros((8,), jnp.int32).at[:3].set(jnp.asarray([1, 2, 3]))
  state = E.prefill(engine, params, state, prompt=padded, prompt_len=jnp.int32(3),
                    slot=jnp.int32(1), max_new=jnp.int32(12))
  run = jax.jit(E.run_chunk, static_argnums=(0, 3))
  new, info = run(engine, params, state, 4)
  info = jax.device_get(info)
  idle = np.array([True, False, True])
  assert (info.drafted_depth[:, idle] == 0).all() and (info.num_verified[:, idle] == 0).all()
  assert (info.drafted_depth[:, 1] >= 1).all()
  for name in ("tokens", "length", "active"):
    np.testing.assert_array_equal(np.asarray(getattr(new, name))[idle],
                                  np.asarray(getattr(state, name))[idle])
  for old, upd in zip(jax.tree.leaves(state.drafter._replace(cache=None)),
                      jax.tree.leaves(new.drafter._replace(cache=None))):
    np.testing.assert_array_equal(np.asarray(old)[idle], np.asarray(upd)[idle])
  # An all-idle batch drafts no pass at all.
  empty = E.init_state(engine, params, fx.key(4))
  _, info0 = run(engine, params, empty, 4)
  assert (np.asarray(info0.draft_passes) == 0).all()


# ------------------------------------------------------- pass pricing (depth cap)


@pytest.mark.parametrize("draft_ms,want_cap", [(40.0, 1), (0.0, 4)])
def test_depth_cap_bounds_the_drafting_loop(draft_ms, want_cap):
  """`av` drafts no slot but the exploring one beyond the cap the earlier steps chose
  (docs/algorithm.md 10.7): with dear passes the cap falls to 1 and the loop runs one
  pass on non-exploring steps; with free passes it stays at K."""
  cfg, drafter, params = fx.pair("eagle")
  B, K, every = 3, 4, 4
  engine = E.make_engine(E.EngineConfig(num_slots=B, max_draft=K, max_len=48, mode="av-gate",
                                        temperature=1.0, num_buckets=1, explore_every=every),
                         cfg, drafter)
  cost = av_jax.make_cost_model(np.full(B + 1, draft_ms), 1.0 + 0.01 * np.arange(B * (K + 1) + 1))
  state = E.init_state(engine, params, fx.key(7), cost)
  for slot in range(B):
    state = E.prefill(engine, params, state, prompt=jnp.asarray([1 + slot, 2, 3, 4], jnp.int32),
                      prompt_len=jnp.int32(4), slot=jnp.int32(slot), max_new=jnp.int32(30))
  step = jax.jit(E.step, static_argnums=0)
  caps = []
  for _ in range(10):
    cap = int(state.planner.depth_cap)
    exploring_step = int(state.planner.step) % every == 0
    state, info = step(engine, params, state)
    depth = np.asarray(info.drafted_depth)
    caps.append(cap)
    if cap > 0:
      over = depth > cap
      assert over.sum() <= (1 if exploring_step else 0), (cap, depth)
      if not over.any():
        assert int(info.draft_passes) <= cap
  assert caps[0] == 0                       # no cap before any step
  assert caps[-1] == want_cap, caps
