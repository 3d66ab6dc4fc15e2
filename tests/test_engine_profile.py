"""Cost profiling: tables are step functions of the bucket, monotone, cached on disk."""

import numpy as np
import pytest

from av_jax import engine as E
from av_jax.engine import profile as prof
from tests import _engine_fixtures as fx


def test_cost_model_from_profile_is_monotone_step_function():
  profile = dict(buckets=[4, 10, 20], bucket_ms=[2.0, 1.5, 5.0], draft_ms=0.7)
  with pytest.warns(UserWarning, match="verify_ms: not monotone"):  # repaired, not silently
    cost = prof.cost_model_from_profile(profile, num_slots=4, max_tokens=20)
  verify = np.asarray(cost.verify_ms)
  assert verify.shape == (21,)
  np.testing.assert_allclose(verify[:5], 2.0)      # T <= 4 costs the first bucket
  np.testing.assert_allclose(verify[5:11], 2.0)    # 1.5 repaired to the running max
  np.testing.assert_allclose(verify[11:], 5.0)
  np.testing.assert_allclose(cost.draft_ms, np.full(5, 0.7))


def test_profile_measures_every_bucket_and_caches(tmp_path):
  cfg, drafter, params = fx.pair("block")
  engine = E.make_engine(E.EngineConfig(num_slots=2, max_draft=2, max_len=32, mode="av",
                                        num_buckets=2), cfg, drafter)
  cost, profile = prof.profile_costs(engine, params, repeats=2, cache_dir=str(tmp_path))
  assert not profile["cached"] and profile["buckets"] == list(engine.buckets)
  assert all(ms > 0 for ms in profile["bucket_ms"]) and profile["draft_ms"] > 0
  assert np.all(np.diff(np.asarray(cost.verify_ms)) >= 0)
  again, cached = prof.profile_costs(engine, params, cache_dir=str(tmp_path))
  assert cached["cached"] and cached["bucket_ms"] == profile["bucket_ms"]
  np.testing.assert_array_equal(again.verify_ms, cost.verify_ms)
  # A corrupt cache entry is re-measured, not trusted.
  (path,) = tmp_path.iterdir()
  path.write_text("{not json")
  _, fresh = prof.profile_costs(engine, params, repeats=1, cache_dir=str(tmp_path))
  assert not fresh["cached"]
  assert "bucket T" in prof.format_profile(fresh)


def test_whole_steps_price_the_tables_at_what_steps_cost():
  """The whole-step calibration (docs/algorithm.md 8.2): the two regimes run what they
  say (a gated-off step drafts no row, a full step verifies all B K drafts), and the
  tables then price those two steps at their measured cost."""
  cfg, drafter, params = fx.pair("block")
  engine = E.make_engine(E.EngineConfig(num_slots=2, max_draft=2, max_len=32, mode="av",
                                        num_buckets=2, steps_per_chunk=2), cfg, drafter)
  profile = prof.measure(engine, params, repeats=2)
  steps = profile["step_ms"]
  assert steps["skip_rows"] == 0 and steps["full_verified"] == 2 * 2
  assert steps["one_verified"] == 2 and steps["one_rows"] == 1 and steps["full_rows"] == 2
  assert steps["skip"] > 0 and steps["one"] > 0 and steps["full"] > 0
  B, T = 2, 2 * 3
  cost = prof.cost_model_from_profile(profile, num_slots=B, max_tokens=T)
  plain = prof.cost_model_from_profile({k: v for k, v in profile.items() if k != "step_ms"},
                                       num_slots=B, max_tokens=T)
  extra_verify, extra_draft = prof.step_overheads(profile, num_slots=B, max_tokens=T)
  assert extra_verify >= 0 and extra_draft >= 0
  scale = prof.verify_scale(profile, num_slots=B, max_tokens=T)
  assert 0.1 <= scale <= 1.0
  base = np.asarray(plain.verify_ms)[B]
  grown = np.where(np.arange(T + 1) > B, base + scale * (np.asarray(plain.verify_ms) - base),
                   np.asarray(plain.verify_ms))
  np.testing.assert_allclose(np.asarray(cost.verify_ms)[1:], grown[1:] + extra_verify,
                             rtol=1e-6)
  np.testing.assert_allclose(cost.draft_ms, np.asarray(plain.draft_ms) + extra_draft,
                             rtol=1e-6)
  # Where an overhead is positive, the table prices its regime at the measured step.
  if extra_verify > 0:
    np.testing.assert_allclose(cost.verify_cost(B), steps["skip"], rtol=1e-5)
  if extra_verify > 0 and 0.1 < scale < 1.0:  # a full step is priced at what it measured
    np.testing.assert_allclose(profile["draft_ms"] + cost.verify_cost(T), steps["full"],
                               rtol=1e-5)
  if extra_draft > 0:  # one drafting slot verifying its K = 2: R + K = 4 tokens
    np.testing.assert_allclose(cost.draft_cost(1) + cost.verify_cost(B + 2), steps["one"],
                               rtol=1e-5)


def test_step_overheads_from_a_recorded_profile():
  # B = 2, K = 2: buckets of 2 and 6 tokens.
  profile = dict(buckets=[2, 6], bucket_ms=[1.0, 2.0], draft_ms=0.5,
                 step_ms=dict(skip=1.5, full=4.0))
  # skip: 1.5 - V(2) = 0.5; full: 4.0 - 0.5 - V(6) - 0.5 = 1.0.
  assert prof.step_overheads(profile, num_slots=2, max_tokens=6) == pytest.approx((0.5, 1.0))
  cost = prof.cost_model_from_profile(profile, num_slots=2, max_tokens=6)
  assert float(cost.verify_cost(2)) == pytest.approx(1.5)
  assert float(cost.draft_cost(2) + cost.verify_cost(6)) == pytest.approx(4.0)
  # With the one-slot regime, the draft extra is measured there: 5.0 - 0.5 - V(4) - 0.5.
  one = dict(profile, step_ms=dict(skip=1.5, one=5.0, full=4.0))
  assert prof.step_overheads(one, num_slots=2, max_tokens=6) == pytest.approx((0.5, 2.0))
  # Steps cheaper than their programs (timing noise) add nothing.
  cheap = dict(profile, step_ms=dict(skip=0.1, full=0.1))
  assert prof.step_overheads(cheap, num_slots=2, max_tokens=6) == (0.0, 0.0)


def test_verify_growth_is_scaled_to_what_a_full_step_measured():
  """Programs timed alone can cost more per extra token than the same pass inside the
  decode loop (block B = 8 on this CPU: a full step at 62 ms against 113 ms of programs):
  the verify table's growth above B is scaled so the full step is priced at its
  measured cost, the gated-off step stays at `skip`, and a profile whose full step costs
  its programs or more is left as it was (scale 1, draft extra as before)."""
  B, T = 2, 6  # K = 2: buckets of 2 and 6 tokens
  profile = dict(buckets=[2, 6], bucket_ms=[1.0, 5.0], draft_ms=0.5,
                 step_ms=dict(skip=1.5, one=3.0, full=4.0))
  # (full - draft(B) - skip) / (V(6) - V(2)) = (4.0 - 0.5 - 1.5) / 4.0
  assert prof.verify_scale(profile, num_slots=B, max_tokens=T) == pytest.approx(0.5)
  cost = prof.cost_model_from_profile(profile, num_slots=B, max_tokens=T)
  assert float(cost.verify_cost(B)) == pytest.approx(1.5)
  assert float(cost.verify_cost(T)) == pytest.approx(1.5 + 0.5 * 4.0)
  # one: 3.0 - draft(1) 0.5 - verify(B + K = 4) 3.5 < 0: no draft extra.
  assert prof.step_overheads(profile, num_slots=B, max_tokens=T) == pytest.approx((0.5, 0.0))
  assert float(cost.draft_cost(B) + cost.verify_cost(T)) == pytest.approx(4.0)
  # Negative control: without whole-step times the programs' growth stands.
  plain = prof.cost_model_from_profile({k: v for k, v in profile.items() if k != "step_ms"},
                                       num_slots=B, max_tokens=T)
  assert float(plain.verify_cost(T)) == pytest.approx(5.0)
  # A full step dearer than its programs: scale 1 (its extra goes to the draft entries).
  dear = dict(profile, step_ms=dict(skip=1.5, full=9.0))
  assert prof.verify_scale(dear, num_slots=B, max_tokens=T) == 1.0
  # A full step far cheaper (noise): the scale stops at 0.1.
  cheap = dict(profile, step_ms=dict(skip=1.5, full=0.1))
  assert prof.verify_scale(cheap, num_slots=B, max_tokens=T) == pytest.approx(0.1)


def test_a_spike_above_a_later_entry_is_retimed():
  """An entry timed above a later (larger) one is re-timed and keeps the smaller time; a
  monotone table is timed once per entry (negative control: nothing re-timed)."""
  calls = {i: 0 for i in range(4)}
  first = [1.0, 9.0, 3.0, 4.0]   # entry 1 spiked under load
  again = [1.0, 2.0, 3.0, 4.0]

  def timer(i):
    def run():
      calls[i] += 1
      return first[i] if calls[i] == 1 else again[i]
    return run

  assert prof.retime_falls([timer(i) for i in range(4)]) == [1.0, 2.0, 3.0, 4.0]
  assert calls == {0: 1, 1: 2, 2: 1, 3: 1}
  calls.update({i: 0 for i in range(4)})
  first[1] = 2.5
  assert prof.retime_falls([timer(i) for i in range(4)]) == [1.0, 2.5, 3.0, 4.0]
  assert calls == {0: 1, 1: 1, 2: 1, 3: 1}
  # A spike that persists is kept (make_cost_model repairs it, with its warning).
  assert prof.retime_falls([lambda: 1.0, lambda: 9.0, lambda: 3.0]) == [1.0, 9.0, 3.0]
