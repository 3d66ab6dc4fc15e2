"""A new user's mistakes in the core API raise a ValueError naming the argument (or warn
by name, or behave as documented), never a JAX-internal error or a silent wrong answer.
Fast: no model, a few tiny jitted functions."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import av_jax
from av_lab import simulate
from av_jax.decision import make_decider, make_decision
from av_jax.planner import make_planner


def _cost(B, K):
  return av_jax.linear_cost_model(B, B * (K + 1))


@pytest.mark.parametrize("bad", [4.5, "4", True, None, 0, -1])
def test_online_estimator_wants_an_integer_k(bad):
  with pytest.raises(ValueError, match="num_positions: expected an int K >= 1"):
    av_jax.online_estimator(bad)


def test_online_estimator_takes_numpy_integers():
  est = av_jax.online_estimator(np.int64(3))
  assert est.num_positions == 3 and est.init().intercepts.shape == (3,)


@pytest.mark.parametrize("bad", [None, (np.ones(3), np.ones(7)), {"draft_ms": np.ones(3)}])
def test_plan_wants_a_cost_model(bad):
  planner = make_planner(policy="current")
  with pytest.raises(ValueError, match="cost: expected a CostModel"):
    planner.plan(planner.init(), jnp.full((2, 2), 0.5), bad)


def test_a_short_verify_table_warns_by_name_at_plan_and_choose_budget():
  B, K = 2, 2
  short = av_jax.make_cost_model(np.ones(B + 1), 1.0 + np.arange(B + 1))  # R + 1 entries
  planner = make_planner(policy="current")
  probs = jnp.full((B, K), 0.9)
  with pytest.warns(UserWarning, match=r"cost.verify_ms: 3 entries, fewer than .* = 7"):
    plan, _ = planner.plan(planner.init(), probs, short)
  assert int(plan.budget) == 0  # what the warning says: nothing beyond the table is chosen
  with pytest.warns(UserWarning, match="cost.verify_ms"):
    av_jax.choose_budget(av_jax.survival(probs), short)
  # Under jit the length is static: the warning comes at trace time.
  with pytest.warns(UserWarning, match="cost.verify_ms"):
    jax.jit(lambda p, c: planner.plan(planner.init(), p, c)[0].budget)(probs, short)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # a full table: no warning
    planner.plan(planner.init(), probs, _cost(B, K))


@pytest.mark.parametrize("bad", [1.5, -0.1, np.inf])
def test_concrete_probabilities_outside_unit_interval_raise(bad):
  planner = make_planner(policy="current")
  probs = np.full((2, 3), 0.5)
  probs[1, 2] = bad
  with pytest.raises(ValueError, match=r"probs: expected probabilities in \[0, 1\].*\(1, 2\)"):
    planner.plan(planner.init(), probs, _cost(2, 3))
  with pytest.raises(ValueError, match="probs: expected probabilities"):
    av_jax.survival(probs)
  with pytest.raises(ValueError, match="survival: expected probabilities"):
    av_jax.allocate(probs, jnp.int32(2))
  with pytest.raises(ValueError, match="survival: expected probabilities"):
    av_jax.choose_budget(probs, _cost(2, 3))


def test_under_jit_probabilities_are_clipped_as_documented():
  """Traced values cannot be checked: above 1 plans like 1, below 0 like 0, NaN like 0."""
  planner = make_planner(policy="current")
  cost = _cost(2, 3)
  plan = jax.jit(lambda p: planner.plan(planner.init(), p, cost)[0].mask)
  base = np.array([[0.9, 0.8, 0.3], [0.6, 0.2, 0.1]], np.float32)
  high, low, nan = base.copy(), base.copy(), base.copy()
  high[0, 0] = 7.0
  low[1, 0] = -3.0
  nan[1, 0] = np.nan
  clipped_high, clipped_low = base.copy(), base.copy()
  clipped_high[0, 0] = 1.0
  clipped_low[1, 0] = 0.0
  np.testing.assert_array_equal(plan(high), plan(clipped_high))
  np.testing.assert_array_equal(plan(low), plan(clipped_low))
  np.testing.assert_array_equal(plan(nan), plan(clipped_low))
  assert not np.asarray(plan(low))[1].any()  # a slot whose first draft is hopeless: none


def test_reusing_a_donated_state_fails_with_the_documented_error():
  decide = make_decision(make_decider(2, policy="lagged"))
  state = decide.init(2)
  logits, none = jnp.zeros((2, 2, 8)), jnp.zeros((2, 2), bool)
  args = (logits, none, none, jnp.ones(2, bool), _cost(2, 2))
  _, new_state = decide.step(state, *args)
  with pytest.raises(ValueError, match="Buffer has been deleted or donated"):
    decide.step(state, *args)
  with pytest.raises(RuntimeError, match="Array has been deleted"):
    np.asarray(state.estimator.slope)
  decide.step(new_state, *args)  # the returned state is the one to continue from
  doc = make_decision.__doc__
  assert "Buffer has been deleted or donated" in doc and "Array has been deleted" in doc


def test_simulator_refuses_a_drafting_stop_arm():
  workload = simulate.SyntheticWorkload(num_slots=2, num_positions=2)
  cost = av_jax.linear_cost_model(2, 6)
  with pytest.raises(ValueError, match="mode: .*confstop"):
    simulate.run(jax.random.key(0), workload, cost, mode="confstop", num_steps=2)
