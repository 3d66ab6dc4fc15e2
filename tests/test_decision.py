"""The jitted per-step decision equals the independent NumPy host reference, step by step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from av_jax.decision import decision_step, make_decider
from av_lab.decision_reference import DecisionConfig, NumpyDecision, flatten_state
from av_jax.estimator import EstimatorConfig
from av_jax.planner import PlannerConfig

B, K, V = 6, 3, 50


def _config(policy: str, max_step: float = 2.0) -> DecisionConfig:
  tokens = np.arange(B * (K + 1) + 1)
  return DecisionConfig(num_positions=K, draft_ms=(1.0,) * (B + 1),
                        verify_ms=tuple(2.0 + 1.5 / B * tokens), policy=policy,
                        estimator=EstimatorConfig(refit_interval=2, max_step=max_step),
                        planner=PlannerConfig(explore_every=3))


def _steps(num_steps: int, seed: int = 0):
  """Logits with within-row ties (bf16-rounded), banned (-inf) tokens, random labels."""
  rng = np.random.default_rng(seed)
  for t in range(num_steps):
    logits = rng.standard_normal((B, K, V)) * rng.uniform(0.5, 6.0, (B, K, 1))
    logits = np.array(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32))
    logits[rng.random((B, K, V)) < 0.1] = -np.inf
    accepted_len = rng.integers(0, K + 1, B)
    pos = np.arange(K)[None]
    yield dict(logits=logits, accepted=pos < accepted_len[:, None],
               labeled=(pos <= accepted_len[:, None]) & (t > 0),
               active=rng.random(B) < 0.8)


@pytest.mark.parametrize("policy,max_step", [("current", 2.0), ("lagged", 2.0),
                                             ("fixed", 2.0), ("current", 0.05)])
def test_jitted_decision_matches_numpy_reference(policy, max_step):
  config = _config(policy, max_step)  # max_step 0.05 makes the trust region bind
  decide, reference = config.jax_decision(), NumpyDecision(config)
  state, ref_state = decide.init(B), reference.init(B)
  for inputs in _steps(7):
    plan, state = decide.step(state, *(jnp.asarray(inputs[k]) for k in
                                       ("logits", "accepted", "labeled", "active")),
                              config.cost())
    num_verified, mask, budget, ref_state = reference.step(
        ref_state, inputs["logits"], inputs["accepted"], inputs["labeled"], inputs["active"])
    np.testing.assert_array_equal(plan.num_verified, num_verified)
    np.testing.assert_array_equal(plan.mask, mask)
    assert int(plan.budget) == int(budget)
    got = flatten_state(state)
    assert got.keys() == ref_state.keys()
    for key, want in ref_state.items():
      np.testing.assert_allclose(got[key], want, rtol=1e-4, atol=1e-5, err_msg=key)
  assert int(ref_state["estimator.num_refits"]) == 3  # refits happened and were compared
  assert decide.num_traces() == 1  # new values every step, never a retrace


def test_unjitted_step_equals_jitted():
  config = _config("current")
  decide = config.jax_decision(donate=False)
  # The decider make_decision closes over, rebuilt to call decision_step eagerly.
  decider = make_decider(K, policy=config.policy, estimator=config.estimator,
                         planner=config.planner)
  state = eager_state = decide.init(B)
  for inputs in _steps(3, seed=1):
    args = [jnp.asarray(inputs[k]) for k in ("logits", "accepted", "labeled", "active")]
    args.append(config.cost())
    plan, state = decide.step(state, *args)
    eager_plan, eager_state = decision_step(eager_state, *args, decider=decider)
    np.testing.assert_array_equal(plan.num_verified, eager_plan.num_verified)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 state, eager_state)


def test_rejects_wrong_draft_length():
  decide = _config("current").jax_decision()
  with pytest.raises(ValueError, match="K=3"):
    decide.step(decide.init(B), jnp.zeros((B, K + 1, V)), jnp.zeros((B, K), bool),
                jnp.zeros((B, K), bool), jnp.ones((B,), bool), _config("current").cost())
