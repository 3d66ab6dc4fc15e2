"""Losslessness end to end (docs/algorithm.md section 5): exact enumeration and a large-sample check.

The exact tests enumerate every draft and verification outcome of tiny toys (tests/_toy.py)
in float64, with the number of verified tokens decided by the real av_jax features,
estimator and planner; the emitted law must equal the target's to 1e-6 (a rounding-level
tolerance: the enumeration is exact up to float64 sums). The statistical test runs the
real jitted pipeline over 2**18 keys and compares frequencies within 5 standard errors.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import av_jax
from tests import _toy

A, B_ = 0, 1      # the vocabulary {a, b} of the spec's counterexample
EXACT = 1e-6      # tolerance of exact laws


def _counterexample(*, parallel=False, greedy=False):
  """Spec section 5, rule 2: one request, K = 2, V = {a, b}, w = 1, beta = 0,
  cost [1.0, 1.85, 2.3] for n = 0, 1, 2 verified draft tokens."""
  q = {(): [0.2, 0.8], (A,): [0.95, 0.05], (B_,): [0.55, 0.45]}
  if parallel:   # depth 2 does not depend on x1: q2 = [0.95, 0.05] after either token
    draft = _toy.parallel_drafter(2, seed=1, table={((), 0): q[()], ((), 1): q[(A,)]})
  else:
    draft = _toy.autoregressive_drafter(2, seed=1, table=q)
  # The target's later positions are arbitrary fixed tables (filled lazily, seeded).
  target = _toy.sequence_target(2, seed=2, table={(): [0.5, 0.5], (A,): [0.7, 0.3],
                                                  (B_,): [0.2, 0.8]})
  return _toy.Toy(V=2, K=2, draft=draft, target=target, slope=1.0, intercepts=np.zeros(2),
                  cost=_toy.cost_for_one_request([1.0, 1.85, 2.3]), greedy=greedy)


def test_cost_mapping_for_one_request():
  """choose_budget's cost is draft_ms[R] + verify_ms[R + n]; with R = 1 the toy's tables
  give exactly the spec's cost[n], checked through the budget it picks."""
  cost = _toy.cost_for_one_request([1.0, 1.85, 2.3])
  np.testing.assert_allclose(cost.verify_ms[1:], [1.0, 1.85, 2.3], rtol=1e-6)
  np.testing.assert_allclose(cost.draft_ms, 0.0, atol=1e-5)  # floored at min_cost
  # Survivals [0.8, 0.76]: throughputs 1/1, 1.8/1.85, 2.56/2.3 -> 2.
  assert int(av_jax.choose_budget(jnp.array([[0.8, 0.76]]), cost)) == 2
  # Survivals [0.8, 0.44]: throughputs 1/1, 1.8/1.85, 2.24/2.3 -> 0.
  assert int(av_jax.choose_budget(jnp.array([[0.8, 0.44]]), cost)) == 0


def test_counterexample_current_budget_depends_on_first_draft():
  toy = _counterexample()
  outcomes = _toy.plan_outcomes(toy, (), _toy.lagged_state(0, step=1), policy="current")
  assert len(outcomes) == 4
  for drafts, _, _, num_verified, _, budget in outcomes:
    expected = 2 if drafts[0] == A else 0
    assert budget == expected, (drafts, budget)
    assert num_verified == expected, (drafts, num_verified)


def test_counterexample_current_policy_is_biased():
  toy = _counterexample()
  law = _toy.emitted_law(toy, 1, policy="current")
  # P(a) = P(x1 = a) * 1 (verified, p/q = 2.5 >= 1) + P(x1 = b) * p1(a) = 0.2 + 0.8 * 0.5.
  np.testing.assert_allclose(law, [0.6, 0.4], atol=EXACT)
  law2 = _toy.emitted_law(toy, 2, policy="current")
  assert np.abs(law2 - _toy.target_law(toy, 2)).sum() > 0.1
  assert not av_jax.is_exact("current", drafter_kind="autoregressive", greedy=False)


@pytest.mark.parametrize("explore_every", [0, 1, 4])
def test_counterexample_lagged_policy_is_exact_for_every_lagged_budget(explore_every):
  toy = _counterexample()
  policy = av_jax.exact_policy(drafter_kind="autoregressive", greedy=False)
  assert policy == "lagged"
  for num_tokens in (1, 2):
    target = _toy.target_law(toy, num_tokens)
    for budget in range(toy.K + 1):
      for step in (0, 1):   # step 0 is an exploration step when explore_every > 0
        law = _toy.emitted_law(toy, num_tokens, policy=policy, explore_every=explore_every,
                               pstate=_toy.lagged_state(budget, step))
        np.testing.assert_allclose(law, target, atol=EXACT,
                                   err_msg=f"lagged budget {budget}, step {step}")
    # The planner's own first state (verify everything).
    law = _toy.emitted_law(toy, num_tokens, policy=policy, explore_every=explore_every)
    np.testing.assert_allclose(law, target, atol=EXACT)
  np.testing.assert_allclose(_toy.emitted_law(toy, 1, policy=policy), [0.5, 0.5], atol=EXACT)


def test_counterexample_parallel_drafter_current_policy_is_exact():
  toy = _counterexample(parallel=True)
  assert av_jax.exact_policy(drafter_kind="parallel", greedy=False) == "current"
  outcomes = _toy.plan_outcomes(toy, (), _toy.lagged_state(0, step=1), policy="current")
  assert {o[5] for o in outcomes} == {2}   # the budget no longer depends on the draws
  for num_tokens in (1, 2):
    law = _toy.emitted_law(toy, num_tokens, policy="current")
    np.testing.assert_allclose(law, _toy.target_law(toy, num_tokens), atol=EXACT)


def test_counterexample_greedy_drafting_current_policy_is_exact():
  toy = _counterexample(greedy=True)
  assert av_jax.exact_policy(drafter_kind="autoregressive", greedy=True) == "current"
  for num_tokens in (1, 2):
    law = _toy.emitted_law(toy, num_tokens, policy="current")
    np.testing.assert_allclose(law, _toy.target_law(toy, num_tokens), atol=EXACT)


def _random_toy(seed, *, kind, greedy=False):
  rng = np.random.default_rng(seed)
  V, K = int(rng.integers(2, 4)), int(rng.integers(2, 4))
  make_draft = _toy.parallel_drafter if kind == "parallel" else _toy.autoregressive_drafter
  conc = float(rng.choice([0.3, 1.0]))   # peaked or flat tables
  # Concave step costs (a large first increment, smaller later ones), as with a fixed
  # overhead per verification: there the current budget most often depends on the draws.
  increments = np.sort(rng.uniform(0.02, 1.0, size=K))[::-1]
  step_cost = 1.0 + np.concatenate([[0.0], np.cumsum(increments)])
  return _toy.Toy(V=V, K=K, draft=make_draft(V, seed=seed + 1, concentration=conc),
                  target=_toy.sequence_target(V, seed=seed + 2, concentration=conc),
                  slope=float(rng.uniform(0.2, 2.0)),
                  intercepts=rng.normal(0.5, 1.5, size=K),
                  cost=_toy.cost_for_one_request(step_cost), greedy=greedy)


NUM_RANDOM = 24   # instances per drafter kind for the exactness test
NUM_BIAS = 60     # autoregressive instances for the bias test (about 15% are biased)


def _tv(law, toy, num_tokens):
  return 0.5 * np.abs(law - _toy.target_law(toy, num_tokens)).sum()


def test_random_instances_exact_policies_are_exact():
  for seed in range(NUM_RANDOM):
    for kind, greedy in (("autoregressive", False), ("parallel", False),
                         ("autoregressive", True)):
      toy = _random_toy(1000 * seed + 7, kind=kind, greedy=greedy)
      policy = av_jax.exact_policy(drafter_kind=kind, greedy=greedy)
      assert av_jax.is_exact(policy, drafter_kind=kind, greedy=greedy)
      what = f"seed {seed}, {kind}, greedy={greedy}, policy {policy}"
      assert _tv(_toy.emitted_law(toy, 2, policy=policy), toy, 2) < EXACT, what
      if policy == "lagged":
        for budget in range(toy.K + 1):
          law = _toy.emitted_law(toy, 2, policy=policy, pstate=_toy.lagged_state(budget))
          assert _tv(law, toy, 2) < EXACT, f"{what}, lagged budget {budget}"
      for other in ("fixed", "none"):   # plain speculative and target-only decoding
        assert _tv(_toy.emitted_law(toy, 1, policy=other), toy, 1) < EXACT, (what, other)


def test_random_instances_current_policy_is_biased_for_some_autoregressive_drafters():
  """The enumeration can detect bias: the current budget biases some random instances."""
  biased = 0
  for seed in range(NUM_BIAS):
    toy = _random_toy(1000 * seed + 7, kind="autoregressive")
    tv = _tv(_toy.emitted_law(toy, 2, policy="current"), toy, 2)
    biased += tv > 1e-3
  assert biased >= 3, f"only {biased} of {NUM_BIAS} instances biased"


# ----------------------------------------------------------------------------------------
# The engine-style path, by sampling: features, estimator, planner, rejection sampling.


N = 2**18


def _stationary_counterexample_step(key, pstate, *, planner, cost, K=2):
  """One decode step of the counterexample's tables (the same tables at every step)."""
  q1 = jnp.array([0.2, 0.8])
  q2 = jnp.array([[0.95, 0.05], [0.55, 0.45]])            # row = x1
  p1 = jnp.array([0.5, 0.5])
  p2 = jnp.array([[0.7, 0.3], [0.2, 0.8]])                # row = x1 (arbitrary)
  p3 = jnp.array([0.4, 0.6])                              # bonus row (arbitrary)
  k1, k2, k3 = jax.random.split(key, 3)
  x1 = jax.random.categorical(k1, jnp.log(q1))
  x2 = jax.random.categorical(k2, jnp.log(q2[x1]))
  draft_logits = jnp.log(jnp.stack([q1, q2[x1]]))[None]  # [B=1, K, V]
  est = av_jax.online_estimator(K)
  estate = est.init()._replace(slope=jnp.float32(1.0), intercepts=jnp.zeros((K,)))
  probs = est.predict(estate, av_jax.logit_qmax(draft_logits))
  plan, pstate = planner.plan(pstate, probs, cost)
  out = av_jax.rejection_sample(
      k3, draft_probs=jax.nn.softmax(draft_logits, -1), draft_tokens=jnp.stack([x1, x2])[None],
      target_probs=jnp.stack([p1, p2[x1], p3])[None], num_verified=plan.num_verified)
  return out, plan, pstate


@functools.partial(jax.jit, static_argnames="policy")
def _two_engine_steps(keys, *, policy):
  planner = av_jax.make_planner(policy=policy)
  cost = _toy.cost_for_one_request([1.0, 1.85, 2.3])

  def run(key):
    k0, k1 = jax.random.split(key)
    _, _, pstate = _stationary_counterexample_step(k0, planner.init(), planner=planner,
                                                   cost=cost)
    out, plan, _ = _stationary_counterexample_step(k1, pstate, planner=planner, cost=cost)
    return out.tokens[0, 0], plan.num_verified[0], plan.explored[0]

  return jax.vmap(run)(keys)


@pytest.mark.parametrize("policy,p_a", [("lagged", 0.5), ("current", 0.6)])
def test_engine_path_first_token_frequency(policy, p_a):
  """Step 2 of a stationary stream: lagged gives P(a) = 0.5 within 5 SE; current 0.6."""
  keys = jax.random.split(jax.random.key(17, impl="rbg"), N)
  first, num_verified, explored = map(np.asarray, _two_engine_steps(keys, policy=policy))
  assert not explored.any()                     # step 2 is not an exploration step
  assert set(np.unique(num_verified)) == {0, 2}  # budgets 0 and 2 both occur
  freq = np.mean(first == A)
  se = np.sqrt(0.25 / N)
  assert abs(freq - p_a) < 5 * se, f"{policy}: P(a) = {freq:.4f}, expected {p_a} (se {se:.2g})"
  assert abs(freq - 0.5) > 5 * se or policy != "current"   # the bias is detectable


# ----------------------------------------------------------------------------------------
# Exploration rescues a pessimistic estimator (docs/algorithm.md section 7, failure modes).


@functools.partial(jax.jit, static_argnames=("explore_every", "num_steps"))
def _stream(key, *, explore_every, num_steps, B=8, K=3, V=8):
  est = av_jax.online_estimator(K, refit_interval=20, init_intercept=-5.0)
  cost = av_jax.linear_cost_model(B, B * (K + 1), verify_per_token=0.02)
  planner = av_jax.make_planner(policy=av_jax.exact_policy(drafter_kind="parallel",
                                                            greedy=False),
                                explore_every=explore_every)

  def step(carry, key):
    estate, pstate = carry
    kd, kt, kx, kr = jax.random.split(key, 4)
    draft_logits = jax.random.normal(kd, (B, K, V))             # parallel drafter
    # The target agrees with the drafter up to noise: acceptance is high but not 1.
    target_logits = draft_logits + 0.7 * jax.random.normal(kt, (B, K + 1, V))[:, :K]
    target_probs = jax.nn.softmax(
        jnp.concatenate([target_logits, jnp.zeros((B, 1, V))], axis=1), -1)
    draft_probs = jax.nn.softmax(draft_logits, -1)
    drafts = jax.random.categorical(kx, draft_logits, axis=-1)
    features = av_jax.logit_qmax(draft_logits)
    plan, pstate = planner.plan(pstate, est.predict(estate, features), cost)
    out = av_jax.rejection_sample(kr, draft_probs=draft_probs, draft_tokens=drafts,
                                  target_probs=target_probs, num_verified=plan.num_verified)
    estate = est.update(estate, features, out.accepted, out.labeled)
    return (estate, pstate), (plan.budget, plan.num_verified.sum())

  (estate, _), (budgets, verified) = jax.lax.scan(
      step, (est.init(), planner.init()), jax.random.split(key, num_steps))
  return estate, budgets, verified


def test_exploration_recovers_a_pessimistic_estimator():
  key = jax.random.key(3, impl="rbg")
  estate, budgets, verified = jax.tree.map(
      np.asarray, _stream(key, explore_every=4, num_steps=400))
  assert np.all(estate.intercepts > -2.0), estate.intercepts   # started at -5
  assert budgets[0] == 0                                       # pessimistic at the start
  assert np.all(budgets[-50:] > 0), budgets[-50:]              # verifies without exploring
  # Same start, no exploration: the budget stays 0, nothing is verified, nothing learnt.
  estate, budgets, verified = jax.tree.map(
      np.asarray, _stream(key, explore_every=0, num_steps=400))
  assert verified.sum() == 0 and np.all(budgets == 0)
  np.testing.assert_array_equal(estate.intercepts, -5.0)
