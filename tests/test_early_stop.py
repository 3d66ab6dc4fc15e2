"""Drafting decisions of autoregressive drafters, exact by enumeration
(tests/_toy_stop.py), and the confidence stop's pure functions (av_jax.stopping).

A toy autoregressive drafter q1, q2(x1), q3(x1, x2); the drafted depth and verified count
decided by the shipped functions (`av_jax.policy.choose` for AV's plan,
`av_jax.stopping.confidence_stop` for `confstop:T`) for every draft outcome; analytic
rejection sampling; and the next step from the new context with the plan the step left.
The emitted law must equal the target's to 1e-9; the negative control (the post-draft
choice from this step's own survivals, with sampled autoregressive drafts) must be
visibly biased.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from av_jax import stopping
from tests import _toy_stop as T

A, B_ = 0, 1      # tokens of the two-token vocabularies
EXACT = 1e-9      # tolerance of exact laws (float64 sums)
BIASED = 1e-3     # a negative control must exceed this total variation


def _tv(law, target):
  return 0.5 * np.abs(law - target).sum()


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


def _adversarial_toy(step_cost=(1.0, 3.3, 3.3, 3.3)):
  """One request, V = {a, b}, K = 3, w = 1, beta = 0 (pi = q_max), step cost
  [1, 3.3, 3.3, 3.3]. S = 0.9, then 0.81 after x1 = a or 0.54 after b, so tau = 0.7 splits
  a choice made after drafting from this step's survivals verifies x2 depending on x2
  itself (through q3)."""
  table = {(0, (), ()): [0.9, 0.1], (0, (), (A,)): [0.9, 0.1], (0, (), (B_,)): [0.6, 0.4]}
  for x1 in (A, B_):
    table[(0, (), (x1, A))] = [0.99, 0.01]
    table[(0, (), (x1, B_))] = [0.5, 0.5]
  target = T.Table(2, seed=6, table={(0, ()): [0.6, 0.4], (0, (A,)): [0.5, 0.5],
                                     (0, (B_,)): [0.3, 0.7]})
  return T.Toy(V=2, K=3, B=1, draft=T.Table(2, seed=5, table=table), target=target,
               slope=1.0, intercepts=np.zeros(3), step_cost=np.array(step_cost))


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


# Prices under which the next plan is 1, 2 or 3 depending on this step's draws.
VARIED = (1.0, 1.3, 1.6, 1.9)


def test_the_policy_plan_reads_earlier_steps_and_varies_with_them():
  """The next plan depends on this step's draws (so the exactness below is not of a
  constant plan), and the step drafts and verifies exactly the plan it was given."""
  toy = _adversarial_toy(VARIED)
  for plan in (0, 1, 2, 3):
    _, _, _, depth, verified, next_plan = T.step(toy, [()], T.StepState(plan=(plan,)),
                                                 arm="policy")
    np.testing.assert_array_equal(depth, plan)
    np.testing.assert_array_equal(verified, plan)
  _, _, _, _, _, next_plan = T.step(toy, [()], T.first(toy), arm="policy")
  assert len(np.unique(next_plan)) > 1


def test_the_policy_is_exact_over_several_steps():
  toy = _adversarial_toy(VARIED)
  for L in (2, 3):
    target = T.target_law(toy, 0, L)
    for plan in (0, 1, 2, 3):
      law = T.emitted_law(toy, L, T.StepState(plan=(plan,)), arm="policy")
      assert _tv(law, target) < EXACT, (L, plan)


def test_negative_control_choosing_after_sampled_drafting_is_biased():
  toy = _adversarial_toy()
  for L in (2, 3):
    law = T.emitted_law(toy, L, arm="choose_now")
    assert _tv(law, T.target_law(toy, 0, L)) > BIASED, L


def test_staged_drafting_reads_this_steps_draws_and_is_exact():
  """Drafting on after a pass by the choice made again with the drafted depths (the
  engine's sampled autoregressive drafting) is a stopping rule: how deep a request
  drafts depends on this step's draws (so the check is not of a fixed depth), and the
  emitted law is the target's over several steps. The negative control above shows the
  enumeration catches a rule that reads a draft before deciding to verify it."""
  toy = _adversarial_toy(VARIED)
  # Depth 3 predicted at 0.9, a cheap drafter: after x1 = a (q2 = 0.9) depth 3 pays,
  # after x1 = b (q2 = 0.6) it does not.
  options = dict(predicted=0.9, draft_share=0.1)
  for plan in (1, 2, 3):
    _, probs, _, depth, verified, _ = T.step(toy, [()], T.StepState(plan=(plan,)),
                                             arm="staged", **options)
    np.testing.assert_array_equal(depth, verified)
    assert set(np.unique(depth[probs > 0])) == {2, 3}, plan
  for L in (2, 3):
    target = T.target_law(toy, 0, L)
    for plan in (0, 1, 2, 3):
      law = T.emitted_law(toy, L, T.StepState(plan=(plan,)), arm="staged", **options)
      assert _tv(law, target) < EXACT, (L, plan)


def test_confstop_is_exact():
  toy = _adversarial_toy()
  for L in (2, 3):
    for conf in (0.6, 0.85, 0.95):
      law = T.emitted_law(toy, L, arm="confstop", conf=conf)
      assert _tv(law, T.target_law(toy, 0, L)) < EXACT, (L, conf)


def test_two_requests_planned_together():
  toy = _two_request_toy()
  L = toy.K + 1      # every position one step can emit
  targets = [T.target_law(toy, b, L) for b in range(2)]
  for plan in ((3, 3), (1, 2), (0, 3), (2, 0)):
    for arm, options in (("policy", {}), ("confstop", dict(conf=0.8)), ("staged", {})):
      laws, joint, _ = T.step_laws(toy, T.StepState(plan=plan), L, arm=arm, joint=True,
                                   **options)
      for b in range(2):
        assert _tv(laws[b], targets[b]) < EXACT, (plan, arm, b)
      # The joint law of both requests is the product of the targets'.
      assert _tv(joint, np.multiply.outer(*targets)) < EXACT, (plan, arm)
  laws, _, _ = T.step_laws(toy, T.first(toy), L, arm="choose_now")
  assert max(_tv(laws[b], targets[b]) for b in range(2)) > BIASED


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
    for state in (T.first(toy), T.StepState(plan=(int(rng.integers(0, 4)),))):
      for arm, options in (("policy", {}), ("confstop", dict(conf=0.5)), ("staged", {})):
        law = T.emitted_law(toy, 3, state, arm=arm, **options)
        assert _tv(law, target) < EXACT, (seed, state, arm, options)


def test_random_two_request_instances_are_exact():
  for seed in range(4):
    toy, rng = _random_toy(100 * seed + 13, B=2, V=2)
    L = toy.K + 1
    state = T.StepState(plan=tuple(int(n) for n in rng.integers(0, 4, size=2)))
    for arm in ("policy", "staged"):
      laws, _, _ = T.step_laws(toy, state, L, arm=arm)
      for b in range(2):
        assert _tv(laws[b], T.target_law(toy, b, L)) < EXACT, (seed, state, b, arm)
