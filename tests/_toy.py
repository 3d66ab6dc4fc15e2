"""Exact-enumeration harness for losslessness: toy drafter/target tables, real av_jax planner.

A toy is a drafter and a target given as conditional tables over a sequence (a function
from the prefix of tokens to a distribution over V tokens), an estimator with fixed
coefficients, and a cost table. `emitted_law` computes, exactly and in float64, the
distribution of the first L tokens a speculative decoder emits:

* every draft outcome of a step (x_1..x_K) is enumerated with its probability;
* the number of verified tokens comes from the real av_jax functions (features by
  `av_jax.logit_qmax` on log q, `est.predict`, `make_planner(...).plan` on a batch of one
  request), evaluated for all draft outcomes at once by `jax.vmap`;
* verification is enumerated analytically (docs/algorithm.md section 6): position i is accepted with
  probability min(1, p(x_i)/q(x_i)); at the first rejection a token comes from
  norm(max(0, p - q)); after m accepted the token comes from p given the accepted prefix;
* when a step emits fewer than L tokens, the next step is enumerated from the new context
  with the planner state the step produced (the lagged policy's budget).

The drafter is autoregressive when q depends on the tokens drafted in the same step, and
parallel when it depends only on the context and the depth. With greedy drafting each
position drafts the arg-max of q (features still from the soft q, docs/algorithm.md section 2) and is
verified as a point mass.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import av_jax

Prefix = tuple[int, ...]


@dataclasses.dataclass
class Toy:
  V: int
  K: int
  draft: Callable[[Prefix, Prefix], np.ndarray]  # (context, drafted) -> q [V]
  target: Callable[[Prefix], np.ndarray]         # prefix -> p [V]
  slope: float                                   # estimator w
  intercepts: np.ndarray                         # [K] estimator beta_i
  cost: av_jax.CostModel                         # for R = 1 active request
  greedy: bool = False                           # greedy drafting


def cost_for_one_request(step_cost) -> av_jax.CostModel:
  """Cost model whose step cost with R = 1 request and n verified drafts is step_cost[n].

  choose_budget's cost is draft_ms[R] + verify_ms[R + n]; with draft_ms = 0 and R = 1,
  verify_ms[1 + n] = step_cost[n] (entry 0, T = 0 tokens, is never used with R = 1).
  """
  step_cost = np.asarray(step_cost, np.float64)
  return av_jax.make_cost_model(np.zeros(2), np.concatenate([[0.0], step_cost]))


class TableFn:
  """A conditional table: prefix -> distribution, explicit entries or lazily random."""

  def __init__(self, V, *, table=None, seed=0, concentration=1.0, key_fn=None):
    self.V = V
    self.table = dict(table or {})
    self.rng = np.random.default_rng(seed)
    self.concentration = concentration
    self.key_fn = key_fn or (lambda *a: a)

  def __call__(self, *args):
    key = self.key_fn(*args)
    if key not in self.table:
      self.table[key] = self.rng.dirichlet(np.full(self.V, self.concentration))
    return np.asarray(self.table[key], np.float64)


def autoregressive_drafter(V, *, seed, table=None, concentration=1.0) -> TableFn:
  """q(. | context + drafted): depends on every token drafted earlier in the step."""
  return TableFn(V, table=table, seed=seed, concentration=concentration,
                 key_fn=lambda c, d: tuple(c) + tuple(d))


def parallel_drafter(V, *, seed, table=None, concentration=1.0) -> TableFn:
  """q(. | context, depth): all K distributions are fixed before any draw."""
  return TableFn(V, table=table, seed=seed, concentration=concentration,
                 key_fn=lambda c, d: (tuple(c), len(d)))


def sequence_target(V, *, seed, table=None, concentration=1.0) -> TableFn:
  """p(. | prefix)."""
  return TableFn(V, table=table, seed=seed, concentration=concentration,
                 key_fn=lambda prefix: tuple(prefix))


PAD_V, PAD_N = 3, 27   # outcomes are padded to one shape per K, so each policy compiles once


@functools.partial(jax.jit, static_argnames=("policy", "explore_every"))
def _plan_all(log_q, slope, intercepts, cost, pstate, *, policy, explore_every):
  """num_verified, next planner state and budget for every draft outcome [N, K, V]."""
  K = log_q.shape[1]
  est = av_jax.online_estimator(K)
  estate = est.init()._replace(slope=jnp.asarray(slope, jnp.float32),
                               intercepts=jnp.asarray(intercepts, jnp.float32))
  probs = est.predict(estate, av_jax.logit_qmax(log_q))                # [N, K]
  planner = av_jax.make_planner(policy=policy, explore_every=explore_every)

  def one(p):
    plan, new_state = planner.plan(pstate, p[None, :], cost)           # batch of one
    return plan.num_verified[0], new_state, plan.budget

  return jax.vmap(one)(probs)


def draft_outcomes(toy: Toy, context: Prefix):
  """[(drafts, probability, [q_1..q_K] the distributions they were drawn from)]."""
  out = []
  if toy.greedy:
    drafted, qs = (), []
    for _ in range(toy.K):
      q = toy.draft(context, drafted)
      qs.append(q)
      drafted += (int(np.argmax(q)),)
    return [(drafted, 1.0, qs)]
  for drafts in itertools.product(range(toy.V), repeat=toy.K):
    prob, qs = 1.0, []
    for i in range(toy.K):
      q = toy.draft(context, drafts[:i])
      qs.append(q)
      prob *= q[drafts[i]]
    if prob > 0:
      out.append((drafts, prob, qs))
  return out


def plan_outcomes(toy: Toy, context: Prefix, pstate, *, policy, explore_every=0):
  """Draft outcomes of one step with the planner's decision for each."""
  outcomes = draft_outcomes(toy, context)
  n = len(outcomes)
  with np.errstate(divide="ignore"):
    log_q = np.log(np.array([qs for _, _, qs in outcomes]))             # [N, K, V]
  # Padding: extra vocabulary entries of probability 0 (log q = -inf) leave logit_qmax
  # unchanged; extra outcomes repeat the first one and are dropped.
  assert toy.V <= PAD_V and n <= PAD_N
  log_q = np.pad(log_q, ((0, PAD_N - n), (0, 0), (0, PAD_V - toy.V)), constant_values=-np.inf)
  log_q[n:] = log_q[0]
  nv, states, budgets = _plan_all(jnp.asarray(log_q, jnp.float32), toy.slope,
                                  np.asarray(toy.intercepts), toy.cost, pstate,
                                  policy=policy, explore_every=explore_every)
  nv, budgets = np.asarray(nv)[:n], np.asarray(budgets)[:n]
  states = jax.tree.map(np.asarray, states)
  states = [jax.tree.map(lambda x, i=i: x[i], states) for i in range(n)]
  return [(d, w, qs, int(m), s, int(b))
          for (d, w, qs), m, s, b in zip(outcomes, nv, states, budgets)]


def verification_outcomes(toy: Toy, context: Prefix, drafts, qs, m):
  """[(emitted tokens, probability)] of verifying the first m drafts (docs/algorithm.md section 6)."""
  out = []
  reach = 1.0
  for i in range(m):
    p = toy.target(context + tuple(drafts[:i]))
    q = np.eye(toy.V)[drafts[i]] if toy.greedy else qs[i]
    x = drafts[i]
    alpha = min(1.0, p[x] / q[x])
    residual = np.maximum(p - q, 0.0)
    if alpha < 1.0:
      residual = residual / residual.sum()
      for y in range(toy.V):
        if residual[y] > 0:
          out.append((tuple(drafts[:i]) + (y,), reach * (1 - alpha) * residual[y]))
    reach *= alpha
    if reach == 0:
      return out
  p = toy.target(context + tuple(drafts[:m]))
  for y in range(toy.V):
    if p[y] > 0:
      out.append((tuple(drafts[:m]) + (y,), reach * p[y]))
  return out


def emitted_law(toy: Toy, num_tokens: int, *, policy: str, pstate=None, explore_every=0,
                context: Prefix = (), _memo=None) -> np.ndarray:
  """Exact law `[V] * num_tokens` of the first `num_tokens` tokens emitted after `context`.

  `pstate` is the planner state at the first step (default: `init()` of the planner).
  """
  if pstate is None:
    pstate = av_jax.make_planner(policy=policy).init()
  memo = {} if _memo is None else _memo
  key = (context, num_tokens, int(pstate.budget), int(pstate.step))
  if key in memo:
    return memo[key]
  law = np.zeros((toy.V,) * num_tokens)
  for drafts, weight, qs, m, next_state, _ in plan_outcomes(
      toy, context, pstate, policy=policy, explore_every=explore_every):
    for tokens, prob in verification_outcomes(toy, context, drafts, qs, m):
      if len(tokens) >= num_tokens:
        law[tokens[:num_tokens]] += weight * prob
      else:
        rest = emitted_law(toy, num_tokens - len(tokens), policy=policy, pstate=next_state,
                           explore_every=explore_every, context=context + tokens, _memo=memo)
        law[tokens] += weight * prob * rest
  memo[key] = law
  return law


def target_law(toy: Toy, num_tokens: int, context: Prefix = ()) -> np.ndarray:
  """Exact law of the first `num_tokens` tokens of the target alone."""
  law = np.zeros((toy.V,) * num_tokens)
  for tokens in itertools.product(range(toy.V), repeat=num_tokens):
    prob = 1.0
    for i in range(num_tokens):
      prob *= toy.target(context + tokens[:i])[tokens[i]]
    law[tokens] = prob
  return law


def lagged_state(budget: int, step: int = 1) -> av_jax.PlannerState:
  """Planner state whose lagged budget is `budget` (a number fixed before this step)."""
  return av_jax.PlannerState(budget=jnp.asarray(budget, jnp.int32),
                             step=jnp.asarray(step, jnp.int32))
