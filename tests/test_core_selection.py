"""Survival, budget and allocation against brute force; planner policies and exploration."""

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import av_jax


def _random_case(rng, B, K, inactive_rate=0.3, tie_rate=0.3):
  probs = rng.uniform(0.05, 1.0, size=(B, K)).astype(np.float32)
  # Coarse values create ties across slots and positions.
  probs = np.where(rng.uniform(size=(B, K)) < tie_rate, np.round(probs, 1).clip(0.1, 1), probs)
  active = rng.uniform(size=B) >= inactive_rate
  return np.cumprod(probs, axis=1).astype(np.float32), active


def _random_cost(rng, B, K):
  draft = np.sort(rng.uniform(0.0, 3.0, size=B + 1))
  verify = np.maximum.accumulate(rng.uniform(0.5, 2.0) + np.cumsum(rng.uniform(0, 0.3, size=B * (K + 1) + 1)))
  return av_jax.make_cost_model(draft, verify)


def _brute_budget(surv, active, cost):
  R = int(active.sum())
  s = np.sort(surv[active].reshape(-1))[::-1].astype(np.float64)
  best, best_n = -np.inf, 0
  draft = np.asarray(cost.draft_ms, np.float64)
  verify = np.asarray(cost.verify_ms, np.float64)
  for n in range(len(s) + 1):
    if R + n >= len(verify):
      break
    value = (R + s[:n].sum()) / (draft[min(R, len(draft) - 1)] + verify[R + n])
    if n == 0 or value > best + 1e-9 * abs(best):
      best, best_n = value, n
  return best_n


def _brute_allocate(surv, budget, active):
  B, K = surv.shape
  entries = sorted((-surv[b, i], i, b) for b in range(B) for i in range(K) if active[b])
  mask = np.zeros((B, K), bool)
  for _, i, b in entries[:budget]:
    mask[b, i] = True
  return mask


def test_survival_is_cumprod(maybe_jit):
  probs = np.random.default_rng(0).uniform(size=(5, 6)).astype(np.float32)
  np.testing.assert_allclose(maybe_jit(av_jax.survival)(probs), np.cumprod(probs, 1), rtol=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_choose_budget_equals_brute_force(maybe_jit, seed):
  rng = np.random.default_rng(seed)
  B, K = int(rng.integers(1, 9)), int(rng.integers(1, 6))
  surv, active = _random_case(rng, B, K)
  cost = _random_cost(rng, B, K)
  got = maybe_jit(lambda s, c, a: av_jax.choose_budget(s, c, active=a))(surv, cost, active)
  assert got.dtype == jnp.int32 and got.shape == ()
  assert int(got) == _brute_budget(surv, active, cost)


def test_choose_budget_edges():
  cost = av_jax.linear_cost_model(4, 20)
  surv = jnp.ones((4, 3)) * 0.9
  assert int(av_jax.choose_budget(surv, cost, active=jnp.zeros(4, bool))) == 0
  # Free verification: verify every active draft. Prohibitive: verify none.
  free = av_jax.make_cost_model(np.ones(5), np.ones(21))
  assert int(av_jax.choose_budget(surv, free, active=jnp.array([1, 0, 1, 1], bool))) == 9
  dear = av_jax.make_cost_model(np.ones(5), np.r_[1.0, 1.0, 1.0, 1.0, 1.0, np.full(16, 1e6)])
  assert int(av_jax.choose_budget(surv, dear)) == 0
  # A verify table too short for every draft caps the budget by its length.
  short = av_jax.make_cost_model(np.ones(5), np.ones(7))
  assert int(av_jax.choose_budget(surv, short)) == 2


@pytest.mark.parametrize("seed", range(8))
def test_allocate_equals_brute_force_and_is_prefix_closed(maybe_jit, seed):
  rng = np.random.default_rng(100 + seed)
  B, K = int(rng.integers(1, 9)), int(rng.integers(1, 6))
  surv, active = _random_case(rng, B, K)
  alloc = maybe_jit(lambda s, b, a: av_jax.allocate(s, b, active=a))
  for budget in range(0, B * K + 2):
    mask = np.asarray(alloc(surv, jnp.int32(budget), active))
    np.testing.assert_array_equal(mask, _brute_allocate(surv, budget, active))
    assert mask.sum() == min(budget, active.sum() * K)
    assert not mask[~active].any()
    # Prefix-closed: a verified position implies every earlier one is verified.
    assert np.all(mask[:, 1:] <= mask[:, :-1])


def test_allocate_choice_does_not_depend_on_deeper_survivals():
  rng = np.random.default_rng(7)
  for _ in range(50):
    B, K = 5, 4
    surv, active = _random_case(rng, B, K, tie_rate=0.5)
    budget = jnp.int32(rng.integers(0, B * K + 1))
    base = np.asarray(av_jax.allocate(surv, budget, active=active))
    b, i = int(rng.integers(B)), int(rng.integers(K - 1))
    changed = surv.copy()
    changed[b, i + 1:] = surv[b, i] * rng.uniform(0, 1, size=K - i - 1) ** np.arange(1, K - i)
    changed[b, i + 1:] = np.minimum.accumulate(changed[b, i + 1:])
    other = np.asarray(av_jax.allocate(changed, budget, active=active))
    assert base[b, i] == other[b, i]


def test_allocate_ties_lower_position_then_lower_slot():
  surv = jnp.array([[0.5, 0.5], [0.5, 0.25]])
  np.testing.assert_array_equal(av_jax.allocate(surv, jnp.int32(1)), [[1, 0], [0, 0]])
  np.testing.assert_array_equal(av_jax.allocate(surv, jnp.int32(2)), [[1, 0], [1, 0]])
  np.testing.assert_array_equal(av_jax.allocate(surv, jnp.int32(3)), [[1, 1], [1, 0]])


def test_allocate_repairs_non_monotone_and_nan_survivals():
  surv = jnp.array([[0.2, 0.9, jnp.nan], [0.5, 0.4, 0.3]])
  mask = np.asarray(av_jax.allocate(surv, jnp.int32(3)))
  assert np.all(mask[:, 1:] <= mask[:, :-1])
  assert mask.sum() == 3


def test_selection_small_shapes_and_bad_input():
  one = jnp.array([[0.7]])
  cost = av_jax.linear_cost_model(1, 2)
  assert int(av_jax.choose_budget(one, cost)) in (0, 1)
  np.testing.assert_array_equal(av_jax.allocate(one, jnp.int32(0)), [[False]])
  with pytest.raises(ValueError, match="survival"):
    av_jax.allocate(jnp.ones(3), jnp.int32(1))
  with pytest.raises(ValueError, match="active"):
    av_jax.allocate(jnp.ones((2, 3)), jnp.int32(1), active=jnp.ones(3, bool))
  with pytest.raises(ValueError, match="budget"):
    av_jax.allocate(jnp.ones((2, 3)), 1.5)
  with pytest.raises(ValueError, match="verify_ms"):
    av_jax.make_cost_model([1.0], [1.0, np.nan])
  with pytest.raises(ValueError, match="draft_ms"):
    av_jax.make_cost_model([], [1.0])
  with pytest.raises(ValueError, match="drafting_floor_ms: expected a finite number >= 0"):
    av_jax.make_cost_model([1.0], [1.0, 2.0], drafting_floor_ms=-1.0)
  assert float(av_jax.make_cost_model([1.0], [1.0, 2.0],
                                      drafting_floor_ms=1.5).drafting_floor_ms) == 1.5


def test_make_cost_model_repairs_non_monotone_and_zero():
  with pytest.warns(UserWarning, match="not monotone") as record:
    cost = av_jax.make_cost_model([0.0, 2.0, 1.0], [3.0, 1.0, 4.0, 2.0])
  assert {str(w.message).split(":")[0] for w in record} == {"draft_ms", "verify_ms"}
  np.testing.assert_allclose(cost.draft_ms, [1e-6, 2.0, 2.0])
  np.testing.assert_allclose(cost.verify_ms, [3.0, 3.0, 4.0, 4.0])


def test_draft_fixed_part_prices_passes_affinely_and_is_checked():
  """`draft_fixed_ms`: c of K passes cost fixed + (c / K)(draft - fixed); default zeros
  (the passes priced alike, as a `CostModel` built without it); bad tables named."""
  cost = av_jax.make_cost_model([1.0, 4.0, 8.0], [1.0, 2.0], draft_fixed_ms=[0.0, 2.0, 2.0])
  share = jnp.asarray([0.25, 0.5, 1.0])
  np.testing.assert_allclose(cost.draft_share_cost(2, share), [3.5, 5.0, 8.0], rtol=1e-6)
  np.testing.assert_allclose(cost.draft_share_cost(jnp.arange(3), 0.5), [0.5, 3.0, 5.0],
                             rtol=1e-6)
  alike = av_jax.make_cost_model([1.0, 4.0, 8.0], [1.0, 2.0])
  np.testing.assert_array_equal(alike.draft_fixed_ms, np.zeros(3))
  assert float(alike.draft_share_cost(2, 0.25)) == pytest.approx(2.0)
  raw = av_jax.CostModel(draft_ms=jnp.asarray([1.0, 8.0]), verify_ms=jnp.asarray([1.0, 2.0]))
  assert float(raw.draft_share_cost(1, 0.25)) == pytest.approx(2.0)  # None: no fixed part
  with pytest.raises(ValueError, match="draft_fixed_ms: expected shape"):
    av_jax.make_cost_model([1.0, 2.0], [1.0], draft_fixed_ms=[0.0])
  with pytest.raises(ValueError, match="draft_fixed_ms: expected finite"):
    av_jax.make_cost_model([1.0, 2.0], [1.0], draft_fixed_ms=[0.0, -1.0])
  with pytest.warns(UserWarning, match="draft_fixed_ms: 1 entries exceed"):
    over = av_jax.make_cost_model([1.0, 2.0], [1.0], draft_fixed_ms=[0.5, 3.0])
  np.testing.assert_allclose(over.draft_fixed_ms, [0.5, 2.0])


def test_planner_policies():
  B, K = 4, 3
  probs = jnp.full((B, K), 0.9)
  active = jnp.array([True, True, False, True])
  cost = av_jax.linear_cost_model(B, B * (K + 1), verify_per_token=1.0)
  surv = av_jax.survival(probs)
  want_budget = int(av_jax.choose_budget(surv, cost, active=active))
  assert 0 < want_budget < 3 * K

  fixed = av_jax.make_planner(policy="fixed")
  plan, _ = fixed.plan(fixed.init(), probs, cost, active=active)
  np.testing.assert_array_equal(plan.num_verified, [K, K, 0, K])
  none = av_jax.make_planner(policy="none")
  plan, _ = none.plan(none.init(), probs, cost, active=active)
  np.testing.assert_array_equal(plan.num_verified, [0, 0, 0, 0])

  current = av_jax.make_planner(policy="current", explore_every=0)
  plan, _ = current.plan(current.init(), probs, cost, active=active)
  assert int(plan.budget) == want_budget == int(plan.num_verified.sum())

  lagged = av_jax.make_planner(policy="lagged", explore_every=0, initial_budget=1)
  state = lagged.init()
  plan, state = jax.jit(lagged.plan)(state, probs, cost, active=active)
  assert int(plan.num_verified.sum()) == 1           # the initial budget
  plan, state = jax.jit(lagged.plan)(state, jnp.full((B, K), 0.1), cost, active=active)
  assert int(plan.num_verified.sum()) == want_budget  # last step's survivals decide
  assert int(state.step) == 2


def test_planner_exploration_round_robin_is_draw_independent():
  B, K = 3, 4
  cost = av_jax.linear_cost_model(B, B * (K + 1), verify_fixed=0.0, verify_per_token=100.0)
  planner = av_jax.make_planner(policy="current", explore_every=2)
  state = planner.init()
  explored = []
  for t in range(12):
    probs = jax.random.uniform(jax.random.PRNGKey(t), (B, K), minval=0.001, maxval=0.01)
    plan, state = planner.plan(state, probs, cost)
    assert int(plan.budget) == 0  # verification is prohibitively dear
    explored.append(np.asarray(plan.explored))
    np.testing.assert_array_equal(plan.num_verified, np.where(plan.explored, K, 0))
  explored = np.array(explored)
  assert explored[1::2].sum() == 0
  np.testing.assert_array_equal(np.argmax(explored[::2], 1), [0, 1, 2, 0, 1, 2])


def test_exact_policy_table():
  assert av_jax.exact_policy(drafter_kind="autoregressive", greedy=False) == "lagged"
  assert av_jax.exact_policy(drafter_kind="autoregressive", greedy=True) == "current"
  assert av_jax.exact_policy(drafter_kind="parallel", greedy=False) == "current"
  assert not av_jax.is_exact("current", drafter_kind="autoregressive", greedy=False)
  for kind, greedy in itertools.product(("autoregressive", "parallel"), (False, True)):
    assert av_jax.is_exact("lagged", drafter_kind=kind, greedy=greedy)
  with pytest.raises(ValueError, match="drafter_kind"):
    av_jax.exact_policy(drafter_kind="tree", greedy=False)
  with pytest.raises(ValueError, match="policy"):
    av_jax.make_planner(policy="bogus")


def test_planner_does_not_retrace():
  B, K = 8, 4
  cost = av_jax.linear_cost_model(B, B * (K + 1))
  planner = av_jax.make_planner(policy="lagged")

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(state, probs, active):
    return planner.plan(state, probs, cost, active=active)

  state = planner.init()
  for t in range(5):
    probs = jax.random.uniform(jax.random.PRNGKey(t), (B, K))
    plan, state = step(state, probs, jnp.arange(B) < 8 - t)


def test_selection_and_planner_under_vmap():
  """A batch of independent decisions (e.g. one per replica group) maps cleanly."""
  rng = np.random.default_rng(11)
  G, B, K = 4, 5, 3
  cases = [_random_case(rng, B, K) for _ in range(G)]
  surv = jnp.stack([c[0] for c in cases])
  active = jnp.stack([c[1] for c in cases])
  cost = _random_cost(rng, B, K)
  budgets = jax.vmap(lambda s, a: av_jax.choose_budget(s, cost, active=a))(surv, active)
  masks = jax.vmap(lambda s, b, a: av_jax.allocate(s, b, active=a))(surv, budgets, active)
  for g in range(G):
    assert int(budgets[g]) == _brute_budget(np.asarray(surv[g]), np.asarray(active[g]), cost)
    np.testing.assert_array_equal(masks[g], _brute_allocate(np.asarray(surv[g]), int(budgets[g]),
                                                            np.asarray(active[g])))
  planner = av_jax.make_planner(policy="current", explore_every=0)
  probs = jnp.concatenate([surv[:, :, :1], surv[:, :, 1:] / surv[:, :, :-1]], axis=-1)
  plans, _ = jax.vmap(lambda p, a: planner.plan(planner.init(), p, cost, active=a))(probs, active)
  np.testing.assert_array_equal(plans.mask, masks)


def test_planner_refuses_bad_settings_by_name():
  with pytest.raises(ValueError, match="explore_every"):
    av_jax.make_planner(policy="current", explore_every=-1)
  with pytest.raises(ValueError, match="draft_stop"):
    av_jax.make_planner(policy="current", draft_stop="survival")
  with pytest.raises(ValueError, match="confidence_threshold"):
    av_jax.make_planner(policy="fixed", draft_stop="confidence", confidence_threshold=1.5)
