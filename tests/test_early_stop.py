"""Early stop of autoregressive drafting (av_jax.stopping, docs/algorithm.md section 10).

Unit tests of the pure functions (jitted and not), and exactness by exhaustive float64
enumeration (tests/_toy_stop.py): a toy autoregressive drafter q1, q2(x1), q3(x1, x2),
the drafted depth and verified count decided by the shipped `av_jax.stopping` functions
for every draft outcome, analytic rejection sampling, and the next step from the new
context with the state the step produced. The emitted law must equal the target's to
1e-9; the negative control (tau from this step's own budget) must be visibly biased.
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import av_jax
from av_jax import stopping
from tests import _toy_stop as T

A, B_ = 0, 1      # tokens of the two-token vocabularies
EXACT = 1e-9      # tolerance of exact laws (float64 sums)
BIASED = 1e-3     # a negative control must exceed this total variation


def _tv(law, target):
  return 0.5 * np.abs(law - target).sum()


# ----------------------------------------------------------------------------------------
# Hyper-parameters.


@pytest.mark.parametrize("kwargs,name", [
    (dict(margin=0.0), "margin"), (dict(margin=1.5), "margin"),
    (dict(margin=float("nan")), "margin"), (dict(margin=True), "margin"),
    (dict(margin="0.5"), "margin"), (dict(min_depth=0), "min_depth"),
    (dict(min_depth=1.5), "min_depth"), (dict(min_depth=True), "min_depth"),
    (dict(prune_outranked=1), "prune_outranked"),
])
def test_bad_hyper_parameters_are_refused_by_name(kwargs, name):
  with pytest.raises(ValueError, match=f"^{name}:"):
    stopping.make_early_stop(**kwargs)
  with pytest.raises(ValueError, match=f"^{name}:"):
    stopping.check_params(stopping.StopParams()._replace(**kwargs))


def test_good_hyper_parameters_are_kept():
  stop = stopping.make_early_stop(margin=1, min_depth=2, prune_outranked=True)
  assert stop.params == stopping.StopParams(1.0, 2, True)
  assert isinstance(stop.params.margin, float)


# ----------------------------------------------------------------------------------------
# threshold, keep_drafting, any_drafting.


def test_threshold_is_margin_times_smallest_admitted_survival(maybe_jit):
  fn = maybe_jit(stopping.threshold, static_argnames="margin")
  surv = jnp.array([[0.9, 0.6, 0.2], [0.7, 0.65, 0.1]])
  everything = jnp.ones((2, 3), bool)
  # Drafted survivals descending: 0.9, 0.7, 0.65, 0.6, 0.2, 0.1.
  np.testing.assert_allclose(fn(surv, everything, 2, margin=0.5), 0.35, rtol=1e-6)
  np.testing.assert_allclose(fn(surv, everything, 4, margin=1.0), 0.6, rtol=1e-6)
  np.testing.assert_allclose(fn(surv, everything, 100, margin=0.5), 0.05, rtol=1e-6)
  assert fn(surv, everything, 0, margin=0.5) == jnp.inf       # nothing admitted
  # Only drafted positions of active slots count.
  prefix = jnp.array([[True, False, False], [True, True, False]])
  np.testing.assert_allclose(fn(surv, prefix, 3, margin=1.0), 0.65, rtol=1e-6)
  np.testing.assert_allclose(fn(surv, everything, 3, margin=1.0,
                                active=jnp.array([True, False])), 0.2, rtol=1e-6)
  assert jnp.isnan(fn(surv, jnp.zeros((2, 3), bool), 3, margin=1.0))   # no step data
  assert fn(surv, everything, 2, margin=0.5).dtype == jnp.float32


def test_threshold_checks_shapes_by_name():
  with pytest.raises(ValueError, match="^drafted:"):
    stopping.threshold(jnp.ones((2, 3)), jnp.ones((2, 2), bool), 1, margin=0.5)
  with pytest.raises(ValueError, match="^budget:"):
    stopping.threshold(jnp.ones((2, 3)), jnp.ones((2, 3), bool), 1.5, margin=0.5)
  with pytest.raises(ValueError, match="^survival:"):
    stopping.threshold(jnp.ones((3,)), jnp.ones((3,), bool), 1, margin=0.5)


def test_keep_drafting_rule(maybe_jit):
  fn = maybe_jit(stopping.keep_drafting, static_argnames="min_depth")
  surv = jnp.array([0.8, 0.3, 0.0, jnp.nan])
  none = jnp.zeros((4,), bool)
  out = fn(surv, 1, 0.5, none)
  assert out.shape == (4,) and out.dtype == jnp.bool_
  np.testing.assert_array_equal(out, [True, False, False, False])
  # No previous step (tau = 0): everyone continues, even at survival 0 or NaN.
  np.testing.assert_array_equal(fn(surv, 1, 0.0, none), [True] * 4)
  # Exploring slots always continue, even under tau = +inf.
  exploring = jnp.array([False, True, False, True])
  np.testing.assert_array_equal(fn(surv, 2, jnp.inf, exploring), [False, True, False, True])
  # The depth floor, and stopping is absorbing.
  np.testing.assert_array_equal(fn(surv, 1, jnp.inf, none, min_depth=2), [True] * 4)
  np.testing.assert_array_equal(fn(surv, 2, jnp.inf, none, min_depth=2), [False] * 4)
  drafting = jnp.array([False, True, True, True])
  np.testing.assert_array_equal(fn(surv, 1, 0.0, exploring, drafting=drafting),
                                [False, True, True, True])


def test_keep_drafting_compiles_once_for_every_depth_and_tau():
  @jax.jit
  @chex.assert_max_traces(n=1)
  def fn(surv, depth, tau, exploring):
    return stopping.keep_drafting(surv, depth, tau, exploring)

  exploring = jnp.zeros((3,), bool)
  for depth, tau in ((1, 0.0), (2, 0.5), (3, jnp.inf)):
    fn(jnp.array([0.9, 0.5, 0.1]), jnp.int32(depth), jnp.float32(tau), exploring)


def test_any_drafting(maybe_jit):
  fn = maybe_jit(stopping.any_drafting, static_argnames="max_depth")
  assert fn(jnp.array([False, True]), 1, max_depth=3)
  assert not fn(jnp.array([False, False]), 1, max_depth=3)
  assert not fn(jnp.array([True, True]), 3, max_depth=3)


# ----------------------------------------------------------------------------------------
# drafted_depth, verified_count, outranked.


# Functions built of many ops or a scan are tested jitted only (eager dispatch of each op
# costs seconds on this shared CPU); keep_drafting and threshold run both ways.
_drafted_depth = jax.jit(stopping.drafted_depth, static_argnames="min_depth")
_verified_count = jax.jit(stopping.verified_count)


def test_drafted_depth_hand_cases():
  fn = _drafted_depth
  surv = jnp.array([[0.9, 0.5, 0.2], [0.8, 0.7, 0.6], [0.4, 0.3, 0.2]])
  none = jnp.zeros((3,), bool)
  np.testing.assert_array_equal(fn(surv, 0.55, none), [2, 3, 1])
  np.testing.assert_array_equal(fn(surv, 0.0, none), [3, 3, 3])      # no previous step
  np.testing.assert_array_equal(fn(surv, jnp.inf, jnp.array([False, False, True])),
                                [1, 1, 3])                           # exploring: all K
  np.testing.assert_array_equal(fn(surv, jnp.inf, none, min_depth=2), [2, 2, 2])
  np.testing.assert_array_equal(fn(surv, 0.0, none, active=jnp.array([True, False, True])),
                                [3, 0, 3])


def test_drafted_depth_never_reads_beyond_the_depth_it_stops_at():
  rng = np.random.default_rng(0)
  fn = _drafted_depth
  for _ in range(20):
    surv = np.cumprod(rng.uniform(0.3, 1.0, size=(4, 5)), axis=1).astype(np.float32)
    tau = np.float32(rng.uniform(0.2, 0.8))
    exploring = rng.uniform(size=4) < 0.2
    depth = np.asarray(fn(surv, tau, exploring))
    other = surv.copy()
    for b in range(4):   # what the passes not run would have produced: anything
      other[b, depth[b]:] = rng.uniform(size=5 - depth[b])
    np.testing.assert_array_equal(fn(other, tau, exploring), depth)
    assert np.all(depth[exploring] == 5)


_allocate = jax.jit(av_jax.allocate)


def test_verified_count_without_stopping_equals_allocate():
  rng = np.random.default_rng(1)
  full = jnp.full((5,), 4)
  for budget in range(0, 22, 3):
    surv = jnp.asarray(np.cumprod(rng.uniform(0.2, 1.0, size=(5, 4)), axis=1), jnp.float32)
    active = jnp.asarray(rng.uniform(size=5) < 0.8)
    expected = np.asarray(_allocate(surv, jnp.int32(budget), active=active)).sum(-1)
    np.testing.assert_array_equal(
        _verified_count(surv, full, jnp.int32(budget), active=active), expected)


def test_verified_count_over_drafted_prefixes_only():
  fn = _verified_count
  surv = jnp.array([[0.9, 0.8, 0.7], [0.6, 0.5, 0.4]])
  # Slot 0 drafted one depth: its undrafted 0.8, 0.7 take no budget; slot 1 gets 2.
  np.testing.assert_array_equal(fn(surv, jnp.array([1, 3]), 3), [1, 2])
  np.testing.assert_array_equal(fn(surv, jnp.array([3, 3]), 3), [3, 0])
  np.testing.assert_array_equal(fn(surv, jnp.array([1, 3]), 100), [1, 3])
  # Ties go to the lower position, then the lower slot.
  flat = jnp.full((2, 3), 0.5)
  np.testing.assert_array_equal(fn(flat, jnp.array([3, 3]), 3), [2, 1])
  # Exploring slots verify their whole drafted depth on top of the budget.
  np.testing.assert_array_equal(fn(surv, jnp.array([3, 2]), 0,
                                   exploring=jnp.array([False, True])), [0, 2])


def test_outranked_hand_case():
  outranked = jax.jit(stopping.outranked)
  surv = jnp.array([[0.9, 0.5, 0.2], [0.8, 0.7, 0.6]])
  np.testing.assert_array_equal(outranked(surv, jnp.ones((2, 3), bool), 3),
                                [True, True])
  drafted = jnp.array([[True, True, False], [True, True, False]])
  # Ranked: 0.9, 0.8, 0.7, 0.5: slot 0's deepest (0.5) is 4th, slot 1's (0.7) 3rd.
  np.testing.assert_array_equal(outranked(surv, drafted, 3), [True, False])
  np.testing.assert_array_equal(outranked(surv, drafted, 4), [False, False])
  np.testing.assert_array_equal(outranked(surv, jnp.zeros((2, 3), bool), 0),
                                [False, False])


def test_outranked_prune_verifies_the_same_positions_draw_by_draw():
  """The prune only removes positions the lagged top-budget could never take."""
  rng = np.random.default_rng(2)
  saved = 0
  prune = jax.jit(lambda s, t, e, n: stopping.drafted_depth(s, t, e, budget=n))
  plain, count = _drafted_depth, _verified_count
  for _ in range(40):
    surv = jnp.asarray(np.cumprod(rng.uniform(0.3, 1.0, size=(4, 5)), axis=1), jnp.float32)
    tau = jnp.float32(rng.choice([0.0, rng.uniform(0.1, 0.6)]))
    exploring = jnp.asarray(rng.uniform(size=4) < 0.15)
    budget = jnp.int32(rng.integers(0, 21))
    d_prune, d_plain = prune(surv, tau, exploring, budget), plain(surv, tau, exploring)
    assert np.all(np.asarray(d_prune) <= np.asarray(d_plain))
    np.testing.assert_array_equal(count(surv, d_prune, budget, exploring=exploring),
                                  count(surv, d_plain, budget, exploring=exploring))
    saved += int(np.sum(np.asarray(d_plain) - np.asarray(d_prune)))
  assert saved > 0


def test_make_early_stop_state_and_per_depth_rule():
  stop = stopping.make_early_stop(margin=0.5)
  state = stop.init()
  assert state.tau == 0.0                          # no stopping without a previous step
  surv = jnp.array([[0.9, 0.6, 0.2], [0.7, 0.65, 0.1]])
  drafted = jnp.array([[True, True, False], [True, True, True]])
  state = jax.jit(stop.update)(state, surv, drafted, 2)
  np.testing.assert_allclose(state.tau, 0.35, rtol=1e-6)
  kept = jax.jit(stop.update)(state, surv, jnp.zeros((2, 3), bool), 2)  # no draft: keep
  np.testing.assert_allclose(kept.tau, 0.35, rtol=1e-6)
  exploring = jnp.array([False, False])
  keep = jax.jit(stop.keep_drafting)(state, surv, drafted, 2, exploring)
  np.testing.assert_array_equal(keep, stopping.keep_drafting(surv[:, 1], 2, state.tau,
                                                             exploring))
  np.testing.assert_array_equal(keep, [True, True])
  pruning = stopping.make_early_stop(margin=0.5, prune_outranked=True)
  with pytest.raises(ValueError, match="^budget:"):
    pruning.keep_drafting(state, surv, drafted, 2, exploring)
  # Ranked drafted: 0.9, 0.7, 0.65, 0.6: at budget 3 slot 0's 0.6 is out, slot 1 not.
  np.testing.assert_array_equal(
      pruning.keep_drafting(state, surv, drafted & jnp.array([[1, 1, 0]], bool), 2,
                            exploring, budget=3), [False, True])


# ----------------------------------------------------------------------------------------
# Pass pricing: the batch's depth cap (docs/algorithm.md 10.7).


def _optimal_depth_brute(surv, drafted, draft, verify, R, d):
  """float64: for every cap c and budget n over the drafted positions at depths <= c,
  (R + top-n survivals) / (c / K draft[d] + verify[R + n]); the best c, ties to smaller."""
  B, K = surv.shape
  ranked = np.minimum.accumulate(np.clip(surv, 0, 1), axis=1)
  best, best_c = -np.inf, None
  for c in range(1, K + 1):
    vals = np.sort(ranked[:, :c][drafted[:, :c]])[::-1]
    for n in range(len(vals) + 1):
      if R + n >= len(verify):
        break
      r = (R + vals[:n].sum()) / (c / K * draft[d] + verify[R + n])
      if r > best * (1 + 1e-6):
        best, best_c = r, c
  return best_c


def test_optimal_depth_equals_brute_force():
  rng = np.random.default_rng(3)
  fn = jax.jit(stopping.optimal_depth)
  for trial in range(40):
    B, K = int(rng.integers(1, 5)), int(rng.integers(1, 6))
    surv = np.cumprod(rng.uniform(0.2, 1.0, size=(B, K)), axis=1).astype(np.float32)
    depth = rng.integers(0, K + 1, size=B)
    drafted = np.arange(K)[None] < depth[:, None]
    draft = np.full(B + 1, rng.uniform(0.1, 3.0))
    verify = 1.0 + np.cumsum(rng.uniform(0.0, 0.5, size=B * (K + 1) + 1))
    cost = av_jax.make_cost_model(draft, verify)
    got = int(fn(surv, drafted, cost))
    want = _optimal_depth_brute(surv.astype(np.float64), drafted, np.asarray(cost.draft_ms),
                                np.asarray(cost.verify_ms), B, B)
    assert got == want, (trial, surv, drafted, got, want)
    assert got <= max(1, depth.max())        # never deeper than anything drafted


def test_optimal_depth_prices_passes():
  surv = jnp.array([[0.9, 0.8, 0.7, 0.6]])
  flat = av_jax.make_cost_model(np.zeros(2), np.ones(6))       # passes free: all K
  assert int(stopping.optimal_depth(surv, jnp.ones((1, 4), bool), flat)) == 4
  dear = av_jax.make_cost_model(np.full(2, 8.0), np.ones(6))   # a pass costs 2 = 2 tokens
  assert int(stopping.optimal_depth(surv, jnp.ones((1, 4), bool), dear)) == 1
  # Only what was drafted counts: with depths 1-2 drafted the answer is at most 2.
  assert int(stopping.optimal_depth(surv, jnp.array([[1, 1, 0, 0]], bool), flat)) == 2


def test_next_depth_cap_shrinks_to_what_paid_and_probes_one_deeper():
  surv = jnp.array([[0.9, 0.8, 0.7, 0.6], [0.9, 0.2, 0.1, 0.05]])
  every = jnp.ones((2, 4), bool)
  cost = av_jax.make_cost_model(np.full(3, 2.0), np.ones(11))  # a pass: 0.5
  best = int(stopping.optimal_depth(surv, every, cost))
  assert 1 <= best < 4
  assert int(stopping.next_depth_cap(surv, every, cost, 0)) == best        # 0: no cap yet
  assert int(stopping.next_depth_cap(surv, every, cost, 4)) == best        # shrinks
  assert int(stopping.next_depth_cap(surv, every, cost, best)) == best + 1  # probes deeper
  assert int(stopping.next_depth_cap(surv, every, cost, best, probe=False)) == best  # stays
  assert int(stopping.next_depth_cap(surv, every, cost, 4, probe=False)) == best   # shrinks
  free = av_jax.make_cost_model(np.zeros(3), np.ones(11))
  assert int(stopping.next_depth_cap(surv, every, free, 4)) == 4            # at most K
  stop = stopping.make_early_stop()
  state = stop.update(stop.init(), surv, every, 3, cost=cost)
  assert int(state.cap) == best
  kept = stop.update(state, surv, jnp.zeros((2, 4), bool), 3, cost=cost)   # nothing drafted
  assert int(kept.cap) == best and float(kept.tau) == float(state.tau)
  assert int(stop.update(stop.init(), surv, every, 3).cap) == 0             # not priced


def test_keep_drafting_under_a_depth_cap():
  surv = jnp.array([0.9, 0.9, 0.9])
  exploring = jnp.array([False, True, False])
  for cap, want in ((0, [True, True, True]), (3, [True, True, True]),
                    (2, [False, True, False])):
    np.testing.assert_array_equal(stopping.keep_drafting(surv, 2, 0.5, exploring, cap=cap),
                                  want)
  # min_depth is a floor under the cap; exploring slots draft all K.
  np.testing.assert_array_equal(
      stopping.keep_drafting(surv, 1, 0.5, exploring, cap=1, min_depth=2), [True] * 3)
  full = jnp.tile(jnp.array([[0.9, 0.8, 0.7, 0.6]]), (3, 1))
  np.testing.assert_array_equal(_drafted_depth(full, 0.0, exploring, cap=2), [2, 4, 2])
  np.testing.assert_array_equal(_drafted_depth(full, 0.75, exploring, cap=3), [3, 4, 3])
  np.testing.assert_array_equal(_drafted_depth(full, 0.85, exploring, cap=3), [2, 4, 2])


def _cap_toy():
  """`_adversarial_toy` with step cost [1, 1.35, 2, 2] and the drafter at 0.3 of a step
  (`T.cost_model(toy, 0.3)`): the depth cap its own survivals call for is 3 after
  (a, a) and 1 after (a, b), so a cap taken from THIS step decides on x2 whether x2 is
  verified, and a cap carried to the next step differs by outcome."""
  return dataclasses.replace(_adversarial_toy(), step_cost=np.array([1.0, 1.35, 2.0, 2.0]))


def test_depth_cap_from_earlier_steps_is_exact():
  toy = _cap_toy()
  drafts, _, _, depth, _, _, _, next_cap = T.step(toy, [()], T.StepState(0.0, 3, 1, 3),
                                                  arm="stop", price=True, draft_share=0.3)
  # The next cap differs by outcome (3 after (a, a), 1 otherwise): the multi-step laws
  # below run under caps the earlier steps' draws chose.
  np.testing.assert_array_equal(next_cap, np.where((drafts[:, 0, :2] == A).all(1), 3, 1))
  for L in (2, 3):
    target = T.target_law(toy, 0, L)
    for cap in (0, 1, 2, 3):
      for explore_every in (0, 2):
        law = T.emitted_law(toy, L, T.StepState(0.0, 3, 1, cap), arm="stop", price=True,
                            draft_share=0.3, explore_every=explore_every)
        assert _tv(law, target) < EXACT, (L, cap, explore_every)


def test_extrapolate_fills_undrafted_depths_from_the_last_conditional_acceptance():
  surv = jnp.array([[0.9, 0.6, jnp.nan, 5.0], [0.8, 0.4, 0.2, 0.1], [0.5, 0.5, 0.5, 0.5]])
  drafted = jnp.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], bool)
  got = np.asarray(stopping.extrapolate(surv, drafted))
  r = 0.6 / 0.9  # row 0's last conditional acceptance
  np.testing.assert_allclose(got, [[0.9, 0.6, 0.6 * r, 0.6 * r * r], [0.8, 0.4, 0.2, 0.1],
                                   [-1, -1, -1, -1]], rtol=1e-6)
  # Undrafted entries are never read: any values there give the same result.
  other = surv.at[0, 2:].set(jnp.array([0.0, 1.0]))
  np.testing.assert_array_equal(np.asarray(stopping.extrapolate(other, drafted)), got)
  # A request that drafted one depth extrapolates from S_1 itself (S_0 = 1).
  one = stopping.extrapolate(jnp.array([[0.5, 0.9, 0.9]]), jnp.array([[1, 0, 0]], bool))
  np.testing.assert_allclose(np.asarray(one), [[0.5, 0.25, 0.125]], rtol=1e-6)
  # Inactive rows count for nothing.
  np.testing.assert_array_equal(
      np.asarray(stopping.extrapolate(surv, drafted, active=jnp.array([False, True, True])))[0],
      [-1, -1, -1, -1])


def test_plan_next_budgets_past_the_depth_a_step_stopped_at():
  """B = 1, a step that stopped after 2 of K = 4 depths with survivals 0.9, 0.81, and
  verification that costs the same whatever it verifies: filled, the next budget is all
  K and tau half the extrapolated S_4 (0.9^4); not filled, the budget is the 2 drafted
  positions and tau half of S_2, so the next step could verify no more than this one."""
  surv = jnp.array([[0.9, 0.81, 0.0, 0.0]])
  drafted = jnp.array([[True, True, False, False]])
  flat = av_jax.make_cost_model(np.array([0.0, 1.0]), np.full(1 + 4 + 1, 10.0))
  state = stopping.StopState(tau=jnp.float32(0.2), cap=jnp.int32(0))
  filled = stopping.plan_next(state, surv, drafted, flat, margin=0.5, price=False)
  assert int(filled.budget) == 4 and int(filled.stop.cap) == 0
  np.testing.assert_allclose(float(filled.stop.tau), 0.5 * 0.9 ** 4, rtol=1e-5)
  bare = stopping.plan_next(state, surv, drafted, flat, margin=0.5, price=False, fill=False)
  assert int(bare.budget) == 2
  np.testing.assert_allclose(float(bare.stop.tau), 0.5 * 0.81, rtol=1e-6)
  # Priced: free passes, so every depth pays and the cap is K at once.
  priced = stopping.plan_next(state._replace(cap=jnp.int32(2)), surv, drafted, flat,
                              margin=0.5, probe=False)
  assert int(priced.stop.cap) == 4 and int(priced.budget) == 4
  # Nothing drafted: tau is kept.
  none = stopping.plan_next(state, surv, jnp.zeros((1, 4), bool), flat, margin=0.5)
  assert float(none.stop.tau) == pytest.approx(0.2)


@pytest.mark.parametrize("fill", [False, True])
def test_the_next_state_with_and_without_extrapolation_is_exact(fill):
  """Multi-step laws under pass pricing, the next step's budget, tau and cap from
  `plan_next` with and without extrapolated depths: both functions of earlier steps."""
  toy = _cap_toy()
  target = T.target_law(toy, 0, 3)
  for cap in (0, 2):
    law = T.emitted_law(toy, 3, T.StepState(0.0, 3, 1, cap), arm="stop", price=True,
                        draft_share=0.3, fill=fill)
    assert _tv(law, target) < EXACT, cap


def test_exploring_under_a_cap_draws_only_to_its_explore_cap_and_stays_exact():
  surv = jnp.tile(jnp.array([[0.9, 0.8, 0.7, 0.6]]), (3, 1))
  exploring = jnp.array([False, True, False])
  np.testing.assert_array_equal(_drafted_depth(surv, 0.0, exploring, cap=1, explore_cap=2),
                                [1, 2, 1])
  np.testing.assert_array_equal(_drafted_depth(surv, 0.0, exploring, cap=1, explore_cap=0),
                                [1, 4, 1])
  toy = _cap_toy()
  for L in (2, 3):
    target = T.target_law(toy, 0, L)
    for cap, explore_cap in ((1, 2), (2, 3), (1, 0)):
      law = T.emitted_law(toy, L, T.StepState(0.0, 3, 1, cap), arm="stop", price=True,
                          draft_share=0.3, explore_every=1, explore_cap=explore_cap)
      assert _tv(law, target) < EXACT, (L, cap, explore_cap)


def test_negative_control_depth_cap_from_this_step_is_biased():
  toy = _cap_toy()
  drafts, _, _, depth, _, _, _, _ = T.step(toy, [()], T.StepState(0.0, 3, 1), arm="cap_now",
                                           draft_share=0.3)
  np.testing.assert_array_equal(depth[:, 0], np.where((drafts[:, 0, :2] == A).all(1), 3, 1))
  for L in (2, 3):
    law = T.emitted_law(toy, L, T.StepState(0.0, 3, 1), arm="cap_now", draft_share=0.3)
    assert _tv(law, T.target_law(toy, 0, L)) > BIASED, L


def test_depth_cap_with_two_requests_sharing_the_budget_is_exact():
  toy = _two_request_toy()
  L = toy.K + 1
  targets = [T.target_law(toy, b, L) for b in range(2)]
  for state in (T.StepState(0.7, 3, 1, 2), T.StepState(0.0, 4, 1, 1),
                T.StepState(0.0, 6, 2, 2)):
    for share in (0.3, 0.8):
      laws, _, info = T.step_laws(toy, state, L, arm="stop", explore_every=2, price=True,
                                  draft_share=share)
      for b in range(2):
        assert _tv(laws[b], targets[b]) < EXACT, (state, share, b)
      explored = T.exploring_slots(2, state.step, 2)
      assert np.all(info["depth"][:, ~explored] <= state.cap)


# ----------------------------------------------------------------------------------------
# confstop:T (vLLM's DraftConfidenceStop).


_confidence_stop = jax.jit(stopping.confidence_stop)   # shared: compiles once per shape


@pytest.mark.parametrize("top1,active,num_verified,depths_run", [
    # vLLM's tests (threshold 0.6, 4 steps): slot 0 clears depths 1-2, slot 1 none.
    ([[0.9, 0.7, 0.4, 0.99], [0.3, 0.99, 0.99, 0.99]], None, [2, 2], 3),
    ([[0.1, 0.9, 0.9, 0.9]], None, [1], 1),          # nothing survives: first draft kept
    ([[0.9, 0.1, 0.9, 0.9]], None, [1], 2),
    ([[0.9, 0.9, 0.9, 0.9]], None, [4], 4),
    ([[0.9, 0.9, 0.9, 0.1]], None, [3], 4),
    # A dead chain stays dead when the drafter becomes confident again.
    ([[0.9, 0.3, 0.99, 0.99]], None, [1], 2),
    # An inactive (padded) row never keeps the batch drafting and verifies nothing.
    ([[0.1, 0.9, 0.9, 0.9], [0.99, 0.99, 0.99, 0.99]], [True, False], [1, 0], 1),
])
def test_confidence_stop_hand_cases(top1, active, num_verified, depths_run):
  active = None if active is None else jnp.asarray(active)
  out = _confidence_stop(jnp.asarray(top1), 0.6, active=active)
  np.testing.assert_array_equal(out.num_verified, num_verified)
  assert int(out.depths_run) == depths_run


def test_confidence_stop_closed_form():
  """num_verified = clip(L, 1, K), depths_run = min(K, L + 1), L = max leading run."""
  rng = np.random.default_rng(3)
  for _ in range(50):
    top1 = rng.uniform(size=(2, 4)).astype(np.float32)
    out = _confidence_stop(top1, 0.4)
    L = max(int(np.argmin(np.append(row >= 0.4, False))) for row in top1)
    np.testing.assert_array_equal(out.num_verified, [min(max(L, 1), 4)] * 2)
    assert int(out.depths_run) == min(4, L + 1)


def test_confidence_alive_and_num_verified():
  alive = stopping.confidence_alive(jnp.array([0.7, 0.5, 0.9]), jnp.array([True, True, False]),
                                    0.6)
  np.testing.assert_array_equal(alive, [True, False, False])
  np.testing.assert_array_equal(
      stopping.confidence_num_verified(3, jnp.asarray(False), jnp.array([True, False])), [2, 0])
  np.testing.assert_array_equal(
      stopping.confidence_num_verified(4, jnp.asarray(True), jnp.array([True])), [4])


# ----------------------------------------------------------------------------------------
# Exactness by enumeration.


def _adversarial_toy():
  """One request, V = {a, b}, K = 3, w = 1, beta = 0 (pi = q_max), step cost
  [1, 3.3, 3.3, 3.3]. S = 0.9, then 0.81 after x1 = a or 0.54 after b, so tau = 0.7 splits
  the decision to draft depth 3 on x1; q3 makes this step's own budget 3 after (a, a)
  and 0 otherwise, so a tau taken from it decides on x2 whether position 2 is verified."""
  table = {(0, (), ()): [0.9, 0.1], (0, (), (A,)): [0.9, 0.1], (0, (), (B_,)): [0.6, 0.4]}
  for x1 in (A, B_):
    table[(0, (), (x1, A))] = [0.99, 0.01]
    table[(0, (), (x1, B_))] = [0.5, 0.5]
  target = T.Table(2, seed=6, table={(0, ()): [0.6, 0.4], (0, (A,)): [0.5, 0.5],
                                     (0, (B_,)): [0.3, 0.7]})
  return T.Toy(V=2, K=3, B=1, draft=T.Table(2, seed=5, table=table), target=target,
               slope=1.0, intercepts=np.zeros(3), step_cost=np.array([1.0, 3.3, 3.3, 3.3]))


def _two_request_toy():
  """Request 0 as in `_adversarial_toy`; request 1 a flat drafter (pi = 0.5) whose
  positions compete for the shared budget. Step cost [1, 2.2, 2.2, 2.2, 5, 5, 5]: this
  step's own budget is 3 after request 0 drafts (a, a), else 0."""
  toy = _adversarial_toy()
  for key, q in list(toy.draft.table.items()):
    if key[0] == 0:
      toy.draft.table[(1,) + key[1:]] = np.array([0.5, 0.5])
  return T.Toy(V=2, K=3, B=2, draft=toy.draft, target=T.Table(2, seed=7), slope=1.0,
               intercepts=np.zeros(3), step_cost=np.array([1.0, 2.2, 2.2, 2.2, 5, 5, 5]))


STATES = [T.FIRST] + [T.StepState(tau, budget, 1) for tau in (0.0, 0.7, np.inf)
                      for budget in (0, 2, 3)]


def test_adversarial_threshold_splits_on_the_first_draft():
  toy = _adversarial_toy()
  drafts, _, _, depth, verified, _, _, _ = T.step(toy, [()], T.StepState(0.7, 3, 1), arm="stop")
  np.testing.assert_array_equal(depth[:, 0], np.where(drafts[:, 0, 0] == A, 3, 2))
  np.testing.assert_array_equal(verified[:, 0], np.where(drafts[:, 0, 0] == A, 3, 2))
  # The negative control's depth depends on x2 itself.
  drafts, _, _, depth, _, _, _, _ = T.step(toy, [()], T.StepState(0.7, 3, 1), arm="tau_now",
                                        margin=1.0)
  np.testing.assert_array_equal(depth[:, 0], np.where((drafts[:, 0, :2] == A).all(1), 3, 1))


@pytest.mark.parametrize("prune", [False, True])
@pytest.mark.parametrize("explore_every", [0, 2])
def test_adversarial_single_request_is_exact(prune, explore_every):
  toy = _adversarial_toy()
  target = T.target_law(toy, 0, 3)
  for state in STATES:
    margin = 1.0 if explore_every else 0.5
    law = T.emitted_law(toy, 3, state, arm="stop", explore_every=explore_every,
                        margin=margin, prune=prune)
    assert _tv(law, target) < EXACT, state


def test_negative_control_tau_from_this_step_is_biased():
  toy = _adversarial_toy()
  for L in (2, 3):
    law = T.emitted_law(toy, L, T.StepState(0.0, 3, 1), arm="tau_now", margin=1.0)
    assert _tv(law, T.target_law(toy, 0, L)) > BIASED, L
  # By hand: the first token is a when x1 = a (0.9) is accepted (p/q = 2/3): 0.6, exact.
  # Then x2 = a (0.9) is verified (this step's budget is 3) and accepted with p/q = 5/9,
  # else the residual gives b; x2 = b (0.1) is not verified (budget 0) and p2 gives a
  # with 0.5. P(a, a) = 0.6 * (0.9 * 5/9 + 0.1 * 0.5) = 0.33 instead of 0.6 * 0.5.
  law = T.emitted_law(toy, 2, T.StepState(0.0, 3, 1), arm="tau_now", margin=1.0)
  np.testing.assert_allclose(law[A], [0.33, 0.27], atol=EXACT)
  np.testing.assert_allclose(T.target_law(toy, 0, 2)[A], [0.3, 0.3], atol=EXACT)


def test_confstop_is_exact():
  toy = _adversarial_toy()
  for L in (2, 3):
    for conf in (0.6, 0.85, 0.95):
      law = T.emitted_law(toy, L, arm="confstop", conf=conf)
      assert _tv(law, T.target_law(toy, 0, L)) < EXACT, (L, conf)


def test_two_requests_sharing_the_budget():
  toy = _two_request_toy()
  L = toy.K + 1      # every position one step can emit
  targets = [T.target_law(toy, b, L) for b in range(2)]
  for state in (T.FIRST, T.StepState(0.7, 1, 1), T.StepState(0.7, 3, 1),
                T.StepState(0.0, 4, 1)):
    for arm, options in (("stop", dict(margin=1.0)), ("stop", dict(prune=True)),
                         ("confstop", dict(conf=0.8))):
      laws, joint, _ = T.step_laws(toy, state, L, arm=arm, explore_every=2, joint=True,
                                   **options)
      for b in range(2):
        assert _tv(laws[b], targets[b]) < EXACT, (state, arm, options, b)
      # Observed (docs/algorithm.md 10.3 proves only the per-request laws): the joint
      # law of both requests is the product of the targets'.
      assert _tv(joint, np.multiply.outer(*targets)) < EXACT, (state, arm, options)
  laws, _, info = T.step_laws(toy, T.StepState(0.0, 3, 1), L, arm="tau_now", margin=1.0)
  assert _tv(laws[0], targets[0]) > BIASED
  # The shared budget is real: request 1's verified count depends on request 0's drafts.
  assert len(np.unique(info["verified"][:, 1])) > 1


def _random_toy(seed, *, B, V):
  rng = np.random.default_rng(seed)
  K = 3
  conc = float(rng.choice([0.3, 1.0]))
  increments = np.sort(rng.uniform(0.02, 1.0, size=B * K))[::-1]
  step_cost = 1.0 + np.concatenate([[0.0], np.cumsum(increments)])
  step_cost = np.round(step_cost * 2) / 2            # step-shaped: plateaus of 0.5
  return T.Toy(V=V, K=K, B=B, draft=T.Table(V, seed=seed + 1, concentration=conc),
               target=T.Table(V, seed=seed + 2, concentration=conc),
               slope=float(rng.uniform(0.2, 2.0)), intercepts=rng.normal(0.5, 1.5, size=K),
               step_cost=step_cost), rng


def test_random_single_request_instances_are_exact_over_three_tokens():
  for seed in range(3):
    toy, rng = _random_toy(100 * seed + 11, B=1, V=3)
    target = T.target_law(toy, 0, 3)
    # A threshold that splits on x1 when one exists: between two depth-2 survivals.
    drafts, _, qs = T.request_outcomes(toy, 0, ())
    s2 = np.unique(np.cumprod(T.estimator_probs(toy, qs), axis=-1)[:, 1])
    split = float(s2[len(s2) // 2 - 1:len(s2) // 2 + 1].mean()) if len(s2) > 1 else 0.5
    for state in (T.FIRST, T.StepState(split, int(rng.integers(0, 4)), 1)):
      for arm, options in (("stop", dict(margin=float(rng.choice([0.5, 1.0])),
                                         prune=bool(rng.integers(2)))),
                           ("confstop", dict(conf=0.5))):
        law = T.emitted_law(toy, 3, state, arm=arm, explore_every=3, **options)
        assert _tv(law, target) < EXACT, (seed, state, arm, options)


def test_random_two_request_instances_are_exact():
  for seed in range(4):
    toy, rng = _random_toy(100 * seed + 13, B=2, V=2)
    L = toy.K + 1
    state = T.StepState(float(rng.uniform(0.1, 0.8)), int(rng.integers(0, 7)), 1)
    laws, _, _ = T.step_laws(toy, state, L, arm="stop", explore_every=2, margin=0.5)
    for b in range(2):
      assert _tv(laws[b], T.target_law(toy, b, L)) < EXACT, (seed, state, b)


def test_planner_explores_one_past_the_cap_and_all_k_on_deep_steps():
  """The planner's survival stop under a depth cap of 2 (K = 4, explore_every 4, B = 4):
  the exploring slot drafts to 3 on ordinary exploration steps and to K on every
  `stop_deep_explore_every`-th one; the other slots stop at the cap."""
  planner = av_jax.make_planner(policy="lagged", draft_stop="survival", explore_every=4,
                                stop_deep_explore_every=4)
  probs = jnp.full((4, 4), 0.95)
  active = jnp.ones((4,), bool)

  def keep(step, depth):
    state = planner.init(4)._replace(depth_cap=jnp.int32(2), step=jnp.int32(step))
    drafted = jnp.arange(4)[None] < depth
    return np.asarray(planner.keep_drafting(state, probs, jnp.broadcast_to(drafted, (4, 4)),
                                            depth, active=active))
  # step 4: exploration of slot 1, not deep ((4 // 4) % 4 = 1).
  np.testing.assert_array_equal(keep(4, 2), [False, True, False, False])
  np.testing.assert_array_equal(keep(4, 3), [False, False, False, False])
  # step 16: exploration of slot 0, deep ((16 // 4) % 4 = 0): all K.
  np.testing.assert_array_equal(keep(16, 3), [True, False, False, False])
  # a step that does not explore: everyone stops at the cap.
  np.testing.assert_array_equal(keep(5, 2), [False] * 4)
  np.testing.assert_array_equal(keep(5, 1), [True] * 4)
  with pytest.raises(ValueError, match="^stop_deep_explore_every"):
    av_jax.make_planner(policy="lagged", draft_stop="survival", stop_deep_explore_every=0)


def test_planner_probes_a_deeper_cap_only_after_exploration_steps():
  B, K = 4, 4
  probs = jnp.full((B, K), 0.95)
  drafted = jnp.broadcast_to(jnp.arange(K)[None] < 2, (B, K))      # every slot drafted 2
  free = av_jax.make_cost_model(np.zeros(B + 1), np.ones(B * (K + 1) + 1))

  def next_cap(step, fill):
    planner = av_jax.make_planner(policy="lagged", draft_stop="survival", explore_every=4,
                                  stop_extrapolate=fill)
    state = planner.init(B)._replace(depth_cap=jnp.int32(2), step=jnp.int32(step))
    _, new = planner.plan(state, probs, free, active=jnp.ones((B,), bool), drafted=drafted)
    return int(new.depth_cap)
  # Without extrapolation depths 3, 4 count for nothing: the paying cap is probed one
  # deeper after an exploration step, and stays otherwise.
  assert next_cap(4, fill=False) == 3
  assert next_cap(5, fill=False) == 2
  # Extrapolated (survival 0.95 per depth, free passes), depths 3 and 4 pay: the cap
  # goes to K at once, exploration step or not.
  assert next_cap(4, fill=True) == next_cap(5, fill=True) == K
  unpriced = av_jax.make_planner(policy="lagged", draft_stop="survival",
                                 stop_price_passes=False)
  _, new = unpriced.plan(unpriced.init(B), probs, free, active=jnp.ones((B,), bool),
                         drafted=drafted)
  assert int(new.depth_cap) == 0  # av-no-price keeps no cap


def test_planner_without_tau_stops_at_the_cap_only():
  probs = jnp.array([[0.9, 0.1, 0.1, 0.1], [0.9, 0.9, 0.9, 0.9]])
  drafted = jnp.broadcast_to(jnp.arange(4)[None] < 2, (2, 4))
  active = jnp.ones((2,), bool)
  for stop_tau, want in ((True, [False, True]), (False, [True, True])):
    planner = av_jax.make_planner(policy="lagged", draft_stop="survival", explore_every=0,
                                  stop_tau=stop_tau)
    state = planner.init(2)._replace(tau=jnp.float32(0.5), depth_cap=jnp.int32(3))
    np.testing.assert_array_equal(planner.keep_drafting(state, probs, drafted, 2,
                                                        active=active), want)
    deeper = jnp.broadcast_to(jnp.arange(4)[None] < 3, (2, 4))   # the cap (3) stops both
    np.testing.assert_array_equal(planner.keep_drafting(state, probs, deeper, 3,
                                                        active=active), [False, False])
  with pytest.raises(ValueError, match="^stop_tau"):
    av_jax.make_planner(policy="lagged", draft_stop="survival", stop_tau=1)
