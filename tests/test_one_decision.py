"""One budget rule: an engine running `av_jax.decision`'s verbs decides what replaying
its records through the verbs decides, step by step.

The static arms and `av_head` run a `Decider` in the engine (the `av` arm runs the priced
plan, `av_jax.decider`); `decision_step`, the overhead benchmark and the simulator run
the same verbs. Here an engine holds the budget rule's decider (`_engine`); replaying its
recorded features and labels through the verbs gives the engine's scores, plans and
estimator, step by step; and `decision_step` is the verbs composed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import av_jax
from av_jax import engine as E
from av_jax.decision import make_decider, make_decision
from av_jax.estimator import EstimatorConfig
from av_jax.planner import PlannerConfig
from av_jax.sampling import Sampling
from tests import _engine_fixtures as fx

PROMPTS = [[1, 2, 3], [4], list(range(5, 15)), [7, 7, 7, 7]]
MAX_NEW = [9, 12, 6, 10]


def _engine(kind, *, temperature):
  """An engine whose decision is the budget rule under the drafter's exact policy."""
  cfg, drafter, params = fx.pair(kind)
  config = E.EngineConfig(num_slots=3, max_draft=3, max_len=40, mode="av",
                          sampling=Sampling(temperature=temperature),
                          estimator=EstimatorConfig(refit_interval=3),
                          programs=E.Programs(steps_per_chunk=4))
  engine = E.make_engine(config, cfg, drafter)
  decider = make_decider(engine.config.max_draft, policy=engine.policy,
                         estimator=engine.config.estimator,
                         planner=PlannerConfig(explore_every=2))
  return engine._replace(decider=decider), params


@pytest.mark.parametrize("kind,temperature,policy", [("eagle", 1.0, "lagged"),
                                                     ("block", 0.0, "current")])
def test_engine_decisions_equal_the_verbs_replayed(kind, temperature, policy):
  """Replays the features, labels and active slots the engine recorded through the
  decider's verbs, jitted on their own: every step's scores, per-slot verified counts
  and budget are the engine's, and so are the final coefficients. (`decision_step` is
  these verbs composed, learn -> score -> plan; tests/test_decision.py checks it
  against the NumPy reference.)"""
  engine, params = _engine(kind, temperature=temperature)
  decider = engine.decider
  assert decider.planner.policy == policy
  result = E.generate(engine, params, PROMPTS, max_new_tokens=MAX_NEW, key=fx.key(3),
                      keep_infos=True)
  info = jax.tree.map(lambda *x: np.concatenate(x), *result.infos)
  assert info.verified.sum() > 0 and int(result.state.estimator.num_refits) >= 2
  score, learn = jax.jit(decider.score), jax.jit(decider.learn)
  plan_fn = jax.jit(lambda state, probs, cost, active, drafted: decider.plan(
      state, probs, cost, active=active, drafted=drafted))
  cost = E.default_cost(engine.config)
  state = decider.init(engine.config.num_slots)
  for t in range(info.budget.shape[0]):
    probs = score(state, info.features[t])
    np.testing.assert_allclose(probs, info.probs[t], rtol=1e-6, atol=1e-7, err_msg=f"step {t}")
    # The positions the engine drafted (a non-finite draft ends a slot's drafting).
    drafted = np.arange(info.probs.shape[-1])[None] < info.drafted_depth[t][:, None]
    plan, state = plan_fn(state, info.probs[t], cost, info.slot_active[t], drafted)
    np.testing.assert_array_equal(plan.num_verified, info.num_verified[t], err_msg=f"step {t}")
    assert int(plan.budget) == int(info.budget[t]), t
    state = learn(state, info.features[t], info.accepted[t], info.labeled[t])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6),
               state.estimator, result.state.estimator)
  jax.tree.map(np.testing.assert_array_equal, state.planner, result.state.planner)


def test_decision_step_is_learn_score_plan():
  """`decision_step` on logits equals the verbs called in its order on the same inputs
  (the feature computed once, outside)."""
  engine, _ = _engine("block", temperature=1.0)
  decider, cost = engine.decider, E.default_cost(engine.config)
  decide = make_decision(decider, donate=False)
  B, K, V = engine.config.num_slots, engine.config.max_draft, 11
  rng = np.random.default_rng(0)
  state = decide.init(B)
  verbs = decider.init()
  features = jnp.zeros((B, K))
  accepted = labeled = np.zeros((B, K), bool)
  for t in range(7):
    logits = jnp.asarray(rng.standard_normal((B, K, V)) * 3, jnp.float32)
    active = rng.random(B) < 0.8
    plan, state = decide.step(state, logits, accepted, labeled, active, cost)
    verbs = decider.learn(verbs, features, accepted, labeled)
    features = jax.jit(av_jax.logit_qmax)(logits)
    want, verbs = decider.plan(verbs, decider.score(verbs, features), cost, active=active)
    np.testing.assert_array_equal(plan.num_verified, want.num_verified, err_msg=f"step {t}")
    np.testing.assert_allclose(state.features, features, rtol=1e-6)
    n = jnp.arange(K)[None] < want.num_verified[:, None]
    accepted, labeled = n & (rng.random((B, K)) < 0.6), n
  assert int(state.estimator.num_refits) >= 2
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               state.estimator, verbs.estimator)
