"""Exact-enumeration harness for early stop of autoregressive drafting (float64 NumPy).

A toy is B requests, each with an autoregressive drafter given as tables
q1, q2(x1), q3(x1, x2) (lazily random, keyed by the request, its context and the tokens
drafted this step), a target table p(prefix), an estimator with fixed coefficients
(`pi = sigmoid(w * logit(q_max) + beta_i)`, spec section 3) and a step-shaped cost
`step_cost[n]` for n verified drafts.

One step is enumerated exactly:

* every joint draft outcome of all K depths is listed with its probability (depths a
  request does not draft are marginalised out: the stopping rule never reads them);
* the drafted depth and the verified count come from the shipped `av_jax.stopping`
  functions, evaluated for all outcomes at once with `jax.vmap` (`decide`);
* verification is analytic (spec section 6): accept x_i with min(1, p/q), at the first
  rejection one token from norm(max(0, p - q)), after m accepted one token from p;
* the state the step leaves (the next lagged budget, the optimal budget over the drafted
  prefixes, and the next threshold `stopping.threshold`) is used at the next step,
  enumerated from the new context (`emitted_law`, one request), or the missing tokens
  are filled from the target (`step_laws`, several requests sharing the budget: this
  checks every position a step emits).

Arms (`arm=`): "stop" (survival stop, tau and the batch depth cap from earlier steps),
"confstop" (vLLM's DraftConfidenceStop, fixed verification of what was drafted), and two
negative controls: "tau_now" (tau from THIS step's budget and survivals: the step drafts
all K, then keeps the prefix whose survival clears margin x the smallest survival this
step's own budget admits; draw-dependent, hence biased) and "cap_now" (pass pricing's
depth cap from THIS step: draft all K, then cut every request at the depth
`stopping.optimal_depth` finds for this step's own survivals).

Pass pricing (`price=True`): the step's depth cap is `StepState.cap` and the next state's
cap is `stopping.next_depth_cap` of the step, priced with `cost_model(toy)` (the toy's
step cost split into a drafter part, `draft_share` of `step_cost[0]`, and the rest);
`explore_cap` bounds how deep an exploring request drafts (0: all K).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from av_jax import stopping
from av_jax.selection import CostModel

ALL = 2**30   # a lagged budget that admits everything (the first step)


class Table:
  """A conditional table: key -> distribution over V, explicit entries or lazily random."""

  def __init__(self, V, *, seed, table=None, concentration=1.0):
    self.V = V
    self.table = {k: np.asarray(v, np.float64) for k, v in (table or {}).items()}
    self.rng = np.random.default_rng(seed)
    self.concentration = concentration

  def __call__(self, key):
    if key not in self.table:
      self.table[key] = self.rng.dirichlet(np.full(self.V, self.concentration))
    return self.table[key]


@dataclasses.dataclass
class Toy:
  V: int
  K: int
  B: int
  draft: Table          # (b, context, drafted) -> q [V]
  target: Table         # (b, prefix) -> p [V]
  slope: float          # estimator w
  intercepts: np.ndarray  # [K] estimator beta_i
  step_cost: np.ndarray   # [B*K + 1] step cost with n verified drafts (R = B requests)
  fills: dict = dataclasses.field(default_factory=dict, repr=False)  # memo of `_fill`


class StepState(NamedTuple):
  tau: float      # survival threshold from earlier steps (0 = none)
  budget: int     # lagged budget from the previous step
  step: int       # step counter (drives round-robin exploration)
  cap: int = 0    # batch depth cap from earlier steps (pass pricing; 0 = none)


def cost_model(toy, draft_share: float = 0.4) -> tuple[np.ndarray, np.ndarray]:
  """(draft_ms [B + 1], verify_ms [B (K + 1) + 1]) with draft_ms[R] + verify_ms[R + n] =
  step_cost[n]: the drafter costs `draft_share` of a step that verifies nothing."""
  draft = draft_share * toy.step_cost[0]
  verify = np.concatenate([np.full(toy.B, toy.step_cost[0] - draft), toy.step_cost - draft])
  return np.full(toy.B + 1, draft), verify


FIRST = StepState(tau=0.0, budget=ALL, step=1)


def exploring_slots(B: int, step: int, explore_every: int) -> np.ndarray:
  """[B] bool: the planner's round-robin exploration, from the step counter only."""
  if explore_every <= 0 or step % explore_every:
    return np.zeros(B, bool)
  return np.arange(B) == (step // explore_every) % B


def estimator_probs(toy: Toy, q: np.ndarray) -> np.ndarray:
  """pi = sigmoid(w * logit(q_max) + beta): [..., K, V] -> [..., K] (float64)."""
  qmax = np.clip(q.max(-1), 1e-12, 1 - 1e-12)
  return 1.0 / (1.0 + np.exp(-(toy.slope * np.log(qmax / (1 - qmax)) + toy.intercepts)))


def request_outcomes(toy: Toy, b: int, context: tuple):
  """All V^K draft outcomes of request b: drafts [N, K], probs [N], q [N, K, V]."""
  drafts = np.array(list(itertools.product(range(toy.V), repeat=toy.K)), np.int64)
  probs, qs = [], []
  for d in drafts:
    q = np.stack([toy.draft((b, context, tuple(d[:i]))) for i in range(toy.K)])
    qs.append(q)
    probs.append(np.prod(q[np.arange(toy.K), d]))
  return drafts, np.array(probs), np.array(qs)


def joint_outcomes(toy: Toy, contexts):
  """Joint outcomes of all B requests: drafts [N, B, K], probs [N], q [N, B, K, V]."""
  per = [request_outcomes(toy, b, c) for b, c in enumerate(contexts)]
  index = np.array(list(itertools.product(*[range(len(p[1])) for p in per])))
  drafts = np.stack([per[b][0][index[:, b]] for b in range(toy.B)], 1)
  probs = np.prod([per[b][1][index[:, b]] for b in range(toy.B)], 0)
  qs = np.stack([per[b][2][index[:, b]] for b in range(toy.B)], 1)
  return drafts, probs, qs


def _optimal_budget(ranked: jax.Array, step_cost: jax.Array, R: int) -> jax.Array:
  """argmax_n (R + s_(1..n)) / step_cost[n] over the drafted survivals (-1 = not drafted)."""
  s = jnp.sort(ranked.reshape(-1))[::-1]
  n = jnp.arange(s.shape[0] + 1)
  expected = R + jnp.concatenate([jnp.zeros(1), jnp.cumsum(jnp.maximum(s, 0.0))])
  valid = n <= jnp.sum(ranked >= 0)
  return jnp.argmax(jnp.where(valid, expected / step_cost, -jnp.inf)).astype(jnp.int32)


def _ranked(surv, depth):
  K = surv.shape[1]
  return jnp.where(jnp.arange(K)[None] < depth[:, None], surv, -1.0)


ARMS = ("stop", "confstop", "tau_now", "cap_now")


@functools.partial(jax.jit, static_argnames=("min_depth", "price", "fill"))
def decide(surv, top1, tau, budget, exploring, step_cost, arm, margin, prune, conf, cap,
           cost, explore_cap, *, min_depth=1, price=False, fill=True):
  """Drafted depth [N, B], verified count [N, B], next tau [N] and budget [N] per outcome.

  surv: [N, B, K] survivals of all K depths; top1: [N, B, K] q_max; tau, budget: the
  state from earlier steps; exploring: [B] bool; arm: index into ARMS. Everything but
  `min_depth`, `price` and `fill` is traced, so one program per shape serves every arm and option (the
  prune is off by giving `outranked` a budget that admits everything, which stops
  nothing).
  """
  N, B, K = surv.shape

  def one(s, t1):
    full = jnp.full((B,), K)
    # survival stop: tau from earlier steps.
    depth_stop = stopping.drafted_depth(s, tau, exploring, min_depth=min_depth,
                                        budget=jnp.where(prune, budget, ALL), cap=cap,
                                        explore_cap=explore_cap)
    # Negative control: this step's own budget over all K depths, then its threshold.
    own = _optimal_budget(_ranked(s, full), step_cost, B)
    tau_now = stopping.threshold(s, jnp.ones((B, K), bool), own, margin=margin)
    depth_now = stopping.drafted_depth(s, tau_now, exploring, min_depth=min_depth)
    depth = jnp.where(arm == 0, depth_stop, depth_now)
    # Negative control: the depth cap this step's own survivals call for.
    cap_now = stopping.optimal_depth(s, jnp.ones((B, K), bool), cost)
    depth = jnp.where(arm == 3, stopping.drafted_depth(s, 0.0, exploring, cap=cap_now), depth)
    verified = stopping.verified_count(s, depth, budget, exploring=exploring)
    # confstop: fixed verification of what the round drafted.
    conf_out = stopping.confidence_stop(t1, conf)
    depth = jnp.where(arm == 1, conf_out.depths_run, depth)
    verified = jnp.where(arm == 1, conf_out.num_verified, verified)
    drafted = jnp.arange(K)[None] < depth[:, None]
    # The next state, as the planner computes it (`stopping.plan_next`: undrafted depths
    # extrapolated unless `fill` is off, the cap priced with `price`).
    nxt = stopping.plan_next(stopping.StopState(tau=tau, cap=cap), s, drafted, cost,
                             margin=margin, num_drafting=B, price=price, fill=fill)
    return depth, verified, nxt.stop.tau, nxt.budget, nxt.stop.cap

  return jax.vmap(one)(surv, top1)


def verification_outcomes(toy: Toy, b: int, context: tuple, drafts, qs, m):
  """[(emitted tokens, probability)] of verifying the first m drafts (spec section 6)."""
  out, reach = [], 1.0
  for i in range(m):
    p = toy.target((b, context + tuple(drafts[:i])))
    x, q = int(drafts[i]), qs[i]
    alpha = min(1.0, p[x] / q[x])
    if alpha < 1.0:
      residual = np.maximum(p - q, 0.0)
      residual = residual / residual.sum()
      for y in range(toy.V):
        if residual[y] > 0:
          out.append((tuple(int(t) for t in drafts[:i]) + (y,), reach * (1 - alpha) * residual[y]))
    reach *= alpha
  p = toy.target((b, context + tuple(int(t) for t in drafts[:m])))
  for y in range(toy.V):
    out.append((tuple(int(t) for t in drafts[:m]) + (y,), reach * p[y]))
  return out


def step(toy: Toy, contexts, state: StepState, *, arm, explore_every=0, margin=0.5,
         prune=False, conf=0.5, min_depth=1, price=False, draft_share=0.4, explore_cap=0,
         fill=True):
  """Enumerated outcomes of one step: per outcome (probability, depth [B], verified [B],
  next state) and the draft arrays. With `price`, the step drafts under `state.cap` and
  the next caps are priced; without, no cap (the next caps returned are 0)."""
  drafts, probs, qs = joint_outcomes(toy, contexts)
  surv = np.cumprod(estimator_probs(toy, qs), axis=-1)
  exploring = exploring_slots(toy.B, state.step, explore_every)
  draft_ms, verify_ms = cost_model(toy, draft_share)
  cost = CostModel(jnp.asarray(draft_ms, jnp.float32), jnp.asarray(verify_ms, jnp.float32))
  depth, verified, next_tau, next_budget, next_cap = map(np.asarray, decide(
      jnp.asarray(surv, jnp.float32), jnp.asarray(qs.max(-1), jnp.float32),
      jnp.float32(state.tau), jnp.int32(min(state.budget, ALL)), jnp.asarray(exploring),
      jnp.asarray(toy.step_cost, jnp.float32), jnp.int32(ARMS.index(arm)),
      jnp.float32(margin), jnp.asarray(prune), jnp.float32(conf),
      jnp.int32(state.cap if price else 0), cost, jnp.int32(explore_cap),
      min_depth=min_depth, price=price, fill=fill))
  return drafts, probs, qs, depth, verified, next_tau, next_budget, next_cap


def _fill(toy: Toy, b: int, tokens: tuple, L: int) -> np.ndarray:
  """Law [V]*L of the first L tokens when `tokens` were emitted and the rest follows p."""
  key = (b, tokens, L)
  if key not in toy.fills:
    toy.fills[key] = _fill_uncached(toy, b, tokens, L)
  return toy.fills[key]


def _fill_uncached(toy: Toy, b: int, tokens: tuple, L: int) -> np.ndarray:
  law = np.zeros((toy.V,) * L)
  if len(tokens) >= L:
    law[tokens[:L]] = 1.0
    return law
  for rest in itertools.product(range(toy.V), repeat=L - len(tokens)):
    prob, prefix = 1.0, tuple(tokens)
    for y in rest:
      prob *= toy.target((b, prefix))[y]
      prefix += (y,)
    law[prefix] = prob
  return law


def step_laws(toy: Toy, state: StepState, L: int, *, arm, explore_every=0, joint=False,
              **options):
  """Per-request law [V]*L of the first L tokens after one enumerated step from the empty
  context, with tokens the step does not emit filled from the target; with `joint`, also
  the joint law [V]*(L*B) of all requests. Returns (laws [B, V..], joint or None, info)."""
  contexts = [()] * toy.B
  drafts, probs, qs, depth, verified, _, _, _ = step(toy, contexts, state, arm=arm,
                                                     explore_every=explore_every, **options)
  laws = np.zeros((toy.B,) + (toy.V,) * L)
  joint_law = np.zeros((toy.V,) * (L * toy.B)) if joint else None
  for n in range(len(probs)):
    per = []
    for b in range(toy.B):
      law_b = np.zeros((toy.V,) * L)
      for tokens, prob in verification_outcomes(toy, b, (), drafts[n, b], qs[n, b],
                                                int(verified[n, b])):
        law_b += prob * _fill(toy, b, tokens, L)
      laws[b] += probs[n] * law_b
      per.append(law_b)
    if joint:
      outer = per[0]
      for law_b in per[1:]:
        outer = np.multiply.outer(outer, law_b)
      joint_law += probs[n] * outer
  return laws, joint_law, dict(depth=depth, verified=verified, probs=probs, drafts=drafts)


def emitted_law(toy: Toy, L: int, state: StepState = FIRST, *, arm, explore_every=0,
                context: tuple = (), _memo=None, **options) -> np.ndarray:
  """Exact law [V]*L of the first L tokens one request (B = 1) emits, over as many steps
  as it takes: each step's state (tau, lagged budget) is the previous step's output."""
  assert toy.B == 1
  memo = {} if _memo is None else _memo
  key = (context, L, float(state.tau), int(state.budget), state.step, int(state.cap))
  if key in memo:
    return memo[key]
  drafts, probs, qs, depth, verified, next_tau, next_budget, next_cap = step(
      toy, [context], state, arm=arm, explore_every=explore_every, **options)
  law = np.zeros((toy.V,) * L)
  for n in range(len(probs)):
    nxt = StepState(tau=float(next_tau[n]), budget=int(next_budget[n]), step=state.step + 1,
                    cap=int(next_cap[n]))
    for tokens, prob in verification_outcomes(toy, 0, context, drafts[n, 0], qs[n, 0],
                                              int(verified[n, 0])):
      if len(tokens) >= L:
        law[tokens[:L]] += probs[n] * prob
      else:
        rest = emitted_law(toy, L - len(tokens), nxt, arm=arm, explore_every=explore_every,
                           context=context + tokens, _memo=memo, **options)
        law[tokens] += probs[n] * prob * rest
  memo[key] = law
  return law


def target_law(toy: Toy, b: int, L: int) -> np.ndarray:
  """Exact law [V]*L of the first L tokens of request b's target alone (empty context)."""
  return _fill(toy, b, (), L)
