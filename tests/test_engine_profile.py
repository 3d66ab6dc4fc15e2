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
                                        programs=E.Programs(num_buckets=2)), cfg, drafter)
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
  text = prof.format_profile(fresh)
  assert "bucket T" in text
  B, T = engine.config.num_slots, engine.buckets[-1]
  skip = fresh["step_ms"]["skip"]
  assert f"verify priced at whole steps: T = {B}: {skip:.3f} ms" in text


def test_whole_steps_price_the_tables_at_what_steps_cost():
  """The whole-step calibration (docs/algorithm.md 8.2): the three regimes run what they
  say (a gated-off step drafts no row, the one-slot step verifies K drafts, a full step
  all B K), and the tables then price each at its measured cost."""
  cfg, drafter, params = fx.pair("block")
  engine = E.make_engine(E.EngineConfig(num_slots=2, max_draft=2, max_len=32, mode="av",
                                        programs=E.Programs(buckets=(2, 4, 6), steps_per_chunk=2)),
                         cfg, drafter)
  profile = prof.measure(engine, params, repeats=2)
  steps = profile["step_ms"]
  assert steps["skip_rows"] == 0 and steps["full_verified"] == 2 * 2
  assert steps["one_verified"] == 2 and steps["one_rows"] == 1 and steps["full_rows"] == 2
  assert steps["skip"] > 0 and steps["one"] > 0 and steps["full"] > 0
  B, K, T = 2, 2, 2 * 3
  assert profile["buckets"] == [2, 4, 6]  # one bucket per regime: no anchors merged
  cost = prof.cost_model_from_profile(profile, num_slots=B, max_tokens=T)
  draft = lambda r: float(cost.draft_cost(r))
  verify = lambda t: float(cost.verify_cost(t))
  one, full = draft(1) + verify(B + K), draft(B) + verify(T)
  # Each regime at what it measured, unless load made a larger regime cheaper than a
  # smaller one (the table stays monotone): then at least the smaller one's verify cost.
  assert verify(B) == pytest.approx(steps["skip"], rel=1e-5)
  if prof.subset_overhead(profile, num_slots=B, max_tokens=T) > 0:
    # The one-slot anchor lay above the full step's: it is dropped and its excess charged
    # to the one-row draft bucket, at most what drafting both rows costs (`draft_tables`).
    programs, _ = prof._program_tables(profile, num_slots=B)
    assert one == pytest.approx(min(steps["one"], float(programs[B]) + verify(B + K)),
                                rel=1e-5)
  else:
    assert one == pytest.approx(max(steps["one"], draft(1) + steps["skip"]), rel=1e-5)
  assert verify(T) == pytest.approx(max(steps["full"] - profile["draft_ms"], verify(B + K)),
                                    rel=1e-5)
  assert full >= one - draft(1) + draft(B) - 1e-6


def test_whole_step_anchors_from_a_recorded_profile():
  """The verify table from recorded times: the programs' table mapped piecewise linearly
  through the measured regimes (numbers checked by hand)."""
  # B = 2, K = 2: buckets of 2, 4 and 6 tokens; draft buckets of 1 and 2 rows.
  profile = dict(buckets=[2, 4, 6], bucket_ms=[2.0, 3.0, 6.0], draft_ms=0.8,
                 draft_buckets=[1, 2], draft_bucket_ms=[0.5, 0.8],
                 step_ms=dict(skip=1.5, one=3.0, full=4.0))
  anchors = prof.step_anchors(profile, num_slots=2, max_tokens=6)
  assert [t for t, _ in anchors] == [2, 4, 6]
  assert [ms for _, ms in anchors] == pytest.approx([1.5, 2.5, 3.2])
  cost = prof.cost_model_from_profile(profile, num_slots=2, max_tokens=6)
  v = np.asarray(cost.verify_ms)
  # T <= 2: skip (below B scaled by skip / V(B)); 3, 4: bucket 4 -> 2.5; 5, 6: 3.2.
  np.testing.assert_allclose(v, [1.5, 1.5, 1.5, 2.5, 2.5, 3.2, 3.2], rtol=1e-6)
  assert float(cost.draft_cost(1) + cost.verify_cost(4)) == pytest.approx(3.0)
  assert float(cost.draft_cost(2) + cost.verify_cost(6)) == pytest.approx(4.0)
  # A gated-off step cheaper than the smallest program is priced at what it cost: the
  # programs' table alone (negative control) prices drafting against a dearer base.
  plain = prof.cost_model_from_profile({k: v for k, v in profile.items() if k != "step_ms"},
                                       num_slots=2, max_tokens=6)
  assert float(plain.verify_cost(2)) == pytest.approx(2.0)
  assert float(cost.verify_cost(2)) == pytest.approx(1.5)
  # A drafting step verifies at least what one draft at full batch costs (T = B + 1 = 3).
  assert float(cost.drafting_floor_ms) == pytest.approx(2.5)
  # Regimes out of order under load: kept monotone (running maximum).
  noisy = dict(profile, step_ms=dict(skip=1.5, one=1.0, full=4.0))
  v = np.asarray(prof.verify_table(noisy, num_slots=2, max_tokens=6))
  np.testing.assert_allclose(v[[2, 4, 6]], [1.5, 1.5, 3.2], rtol=1e-6)
  assert np.all(np.diff(v) >= 0)


def test_depth_one_programs_price_the_drafters_fixed_part():
  """The drafter's depth-1 programs give the fixed part of each draft bucket
  ((K first - full) / (K - 1), so 1 and K passes cost what the programs did); the
  one-slot regime subtracts the bucket of the rows each step ran (numbers checked by
  hand). Negative control: the profile without them prices depth 1 at 1 / K of the
  drafter."""
  # B = 2, K = 4: buckets of 2, 6 and 10 tokens; draft buckets of 1 and 2 rows.
  base = dict(buckets=[2, 6, 10], bucket_ms=[2.0, 3.0, 6.0], draft_ms=2.6,
              draft_buckets=[1, 2], draft_bucket_ms=[1.4, 2.6],
              step_ms=dict(skip=1.5, one=4.5, full=7.0))
  profile = dict(base, draft_first_ms=[0.5, 0.8],
                 step_ms=dict(base["step_ms"], one_row_steps=[1, 1, 2, 1]))
  draft, fixed = prof.draft_tables(profile, num_slots=2)
  np.testing.assert_allclose(draft, [1.4, 1.4, 2.6])
  np.testing.assert_allclose(fixed, [0.2, 0.2, 0.2])  # (4 * 0.5 - 1.4) / 3, (3.2 - 2.6) / 3
  cost = prof.cost_model_from_profile(profile, num_slots=2, max_tokens=10)
  for r, first in ((1, 0.5), (2, 0.8)):
    assert float(cost.draft_share_cost(r, 1 / 4)) == pytest.approx(first, rel=1e-5)
    assert float(cost.draft_share_cost(r, 1.0)) == pytest.approx(draft[r], rel=1e-5)
  anchors = prof.step_anchors(profile, num_slots=2, max_tokens=10)
  # one: 4.5 - mean(1.4, 1.4, 2.6, 1.4) = 2.8 at 2 + 4; full: 7.0 - 2.6 at 10.
  assert anchors == [(2, 1.5), (6, pytest.approx(2.8)), (10, pytest.approx(4.4))]
  old = prof.cost_model_from_profile(base, num_slots=2, max_tokens=10)
  np.testing.assert_array_equal(old.draft_fixed_ms, np.zeros(3))
  assert float(old.draft_share_cost(2, 1 / 4)) == pytest.approx(2.6 / 4)


def test_an_autoregressive_profile_times_depth_one():
  """EAGLE under `av`: the profile times the drafter's depth-1 program per draft bucket
  and the whole-step regimes of the priced plan. A parallel drafter (block) drafts its
  block in one pass: no depth-1 program to time."""
  cfg, drafter, params = fx.pair("eagle")
  B, K = 2, 3
  engine = E.make_engine(E.EngineConfig(num_slots=B, max_draft=K, max_len=48, mode="av",
                                        programs=E.Programs(steps_per_chunk=4)), cfg, drafter)
  profile = prof.measure(engine, params, repeats=1)
  assert len(profile["draft_first_ms"]) == len(profile["draft_buckets"])
  assert all(ms > 0 for ms in profile["draft_first_ms"])
  steps = profile["step_ms"]
  assert steps["skip"] > 0 and steps["full"] > 0 and steps["full_rows"] == B
  cost = prof.cost_model_from_profile(profile, num_slots=B, max_tokens=B * (K + 1))
  assert np.all(np.asarray(cost.draft_fixed_ms) <= np.asarray(cost.draft_ms))
  cfg, block, params = fx.pair("block")
  engine = E.make_engine(E.EngineConfig(num_slots=B, max_draft=K, max_len=48, mode="av",
                                        programs=E.Programs(steps_per_chunk=4)), cfg, block)
  assert not E.core._stepwise(engine)  # what `measure` times the depth-1 programs under


def test_a_one_slot_step_dearer_than_a_full_one_is_its_drafting_path():
  """B = 2 on this CPU: slot 0 drafting alone (rows gathered into a 1-row bucket and
  scattered back) cost about what both slots drafting in place did. Its verify anchor
  would lie above the full step's, and the running maximum would price the full step
  above its cost (the negative control: 7.0 ms against 6.0 measured). The excess is
  charged to the buckets E < B instead, and both regimes are priced at what they cost
  (numbers checked by hand)."""
  profile = dict(buckets=[2, 4, 6], bucket_ms=[2.0, 3.0, 6.0], draft_ms=3.0,
                 draft_buckets=[1, 2], draft_bucket_ms=[0.5, 3.0],
                 step_ms=dict(skip=1.5, one=4.5, full=6.0))
  B, K, T = 2, 2, 6
  assert prof.step_anchors(profile, num_slots=B, max_tokens=T) == [
      (2, 1.5), (6, pytest.approx(3.0))]
  # V'(4) = 1.5 + (3 - 2) / (6 - 2) (3.0 - 1.5) = 1.875; the one-slot anchor 4.5 - 0.5 = 4.0.
  assert prof.subset_overhead(profile, num_slots=B, max_tokens=T) == pytest.approx(2.125)
  cost = prof.cost_model_from_profile(profile, num_slots=B, max_tokens=T)
  np.testing.assert_allclose(cost.draft_ms, [2.625, 2.625, 3.0], rtol=1e-6)
  np.testing.assert_allclose(cost.draft_fixed_ms, [2.125, 2.125, 0.0], rtol=1e-5)
  assert float(cost.draft_cost(1) + cost.verify_cost(B + K)) == pytest.approx(4.5)
  assert float(cost.draft_cost(2) + cost.verify_cost(T)) == pytest.approx(6.0)
  kept = 3.0 + max(4.5 - 0.5, 6.0 - 3.0)  # the one-slot anchor kept: the running maximum
  assert kept == pytest.approx(7.0)
  # In order (one-slot anchor below the full step's): no overhead, as before.
  normal = dict(profile, step_ms=dict(skip=1.5, one=3.5, full=6.0))
  assert prof.subset_overhead(normal, num_slots=B, max_tokens=T) == 0.0
  assert [t for t, _ in prof.step_anchors(normal, num_slots=B, max_tokens=T)] == [2, 4, 6]


def test_regimes_out_of_order_are_retimed():
  """A gated-off step timed above the drafting regimes (a load spike) is re-timed and
  keeps the smaller time; regimes in order are timed once (negative control)."""
  profile = dict(buckets=[2, 4, 6], bucket_ms=[2.0, 3.0, 6.0], draft_ms=0.8,
                 draft_buckets=[1, 2], draft_bucket_ms=[0.5, 0.8])
  rows = dict(skip_rows=0, one_rows=1, full_rows=2)
  times = [dict(rows, skip=9.0, one=3.0, full=4.0), dict(rows, skip=1.5, one=3.2, full=3.9)]
  calls = []
  timer = lambda: calls.append(1) or times[len(calls) - 1]
  steps = prof.retime_regimes(profile, timer, num_slots=2, max_tokens=6)
  assert len(calls) == 2
  assert (steps["skip"], steps["one"], steps["full"]) == (1.5, 3.0, 3.9)
  assert steps["one_rows"] == 1
  calls.clear()
  times[0] = dict(rows, skip=1.5, one=3.0, full=4.0)
  assert prof.retime_regimes(profile, timer, num_slots=2, max_tokens=6)["skip"] == 1.5
  assert len(calls) == 1
  # A spike that persists: at most `rounds` re-timings.
  calls.clear()
  times[:] = [dict(rows, skip=9.0, one=3.0, full=4.0)] * 3
  prof.retime_regimes(profile, timer, num_slots=2, max_tokens=6)
  assert len(calls) == 3


def test_a_spike_in_order_is_dropped_by_the_rounds():
  """A spike that leaves the regimes in order (drafting steps timed 1.6x, the gated-off
  step 1.1x: the eagle B = 2 profile that priced drafting out) passes the order check;
  `min_rounds` times every regime again and keeps its smallest time. Negative control:
  one round keeps the spike."""
  profile = dict(buckets=[2, 4, 6], bucket_ms=[2.0, 3.0, 6.0], draft_ms=0.8,
                 draft_buckets=[1, 2], draft_bucket_ms=[0.5, 0.8])
  rows = dict(skip_rows=0, one_rows=1, full_rows=2)
  spiked = dict(rows, skip=1.65, one=5.6, full=6.4)
  clean = dict(rows, skip=1.5, one=3.5, full=4.0)
  for min_rounds, expected in ((1, spiked), (3, clean)):
    calls = []
    times = [spiked, clean, dict(rows, skip=1.6, one=3.6, full=4.1)]
    timer = lambda: calls.append(1) or times[len(calls) - 1]
    steps = prof.retime_regimes(profile, timer, num_slots=2, max_tokens=6,
                                min_rounds=min_rounds)
    assert len(calls) == min_rounds  # in order: no re-timing beyond the rounds
    assert {k: steps[k] for k in ("skip", "one", "full")} == {
        k: expected[k] for k in ("skip", "one", "full")}
    assert steps["one_rows"] == 1
  # The programs' tables: every entry timed `min_rounds` times, its smallest kept.
  seq = {0: [1.0, 1.2], 1: [3.1, 2.0], 2: [4.8, 3.0]}  # entry 1, 2 spiked in order
  calls = {i: 0 for i in seq}

  def timer(i):
    def run():
      calls[i] += 1
      return seq[i][calls[i] - 1]
    return run

  assert prof.retime_falls([timer(i) for i in seq], min_rounds=2) == [1.0, 2.0, 3.0]
  assert calls == {0: 2, 1: 2, 2: 2}
  calls.update({i: 0 for i in seq})
  assert prof.retime_falls([timer(i) for i in seq]) == [1.0, 3.1, 4.8]  # one round


def test_regimes_on_one_bucket_are_averaged():
  """B = 1: the one-slot and the full step are the same regime (one bucket of K + 1
  tokens); its anchor is their mean, and a regime between two buckets interpolates."""
  profile = dict(buckets=[1, 3], bucket_ms=[1.0, 2.0], draft_ms=0.5,
                 step_ms=dict(skip=1.2, one=2.5, full=2.7))
  v = np.asarray(prof.verify_table(profile, num_slots=1, max_tokens=3))
  np.testing.assert_allclose(v, [1.2, 1.2, 2.1, 2.1], rtol=1e-6)
  # Three buckets for two anchors: the middle bucket's program time is interpolated.
  three = dict(profile, buckets=[1, 2, 3], bucket_ms=[1.0, 1.5, 2.0])
  v = np.asarray(prof.verify_table(three, num_slots=1, max_tokens=3))
  np.testing.assert_allclose(v, [1.2, 1.2, 1.65, 2.1], rtol=1e-6)


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
