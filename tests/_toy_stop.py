"""Exact-enumeration harness for the drafting decisions of autoregressive drafters
(float64 NumPy with the shipped decision functions).

A toy is B requests, each with an autoregressive drafter given as tables
q1, q2(x1), q3(x1, x2) (lazily random, keyed by the request, its context and the tokens
drafted this step), a target table p(prefix), an estimator with fixed coefficients
(`pi = sigmoid(w * logit(q_max) + beta_i)`, spec section 3) and a step-shaped cost
`step_cost[n]` for n verified drafts.

One step is enumerated exactly:

* every joint draft outcome of all K depths is listed with its probability (depths a
  request does not draft are marginalised out: no rule here reads them);
* the drafted depth and the verified count come from the shipped functions
  (`av_jax.policy.choose`, `av_jax.stopping.confidence_stop`), evaluated for all outcomes
  at once with `jax.vmap` (`decide`);
* verification is analytic (spec section 6): accept x_i with min(1, p/q), at the first
  rejection one token from norm(max(0, p - q)), after m accepted one token from p;
* the plan the step leaves for the next one is used at the next step, enumerated from
  the new context (`emitted_law`, one request), or the missing tokens are filled from the
  target (`step_laws`, several requests: this checks every position a step emits).

Arms (`arm=`):
* "policy": AV's priced plan for a sampled autoregressive drafter. Each request drafts
  and verifies the n positions the plan chose before the step (`StepState.plan`); the
  next step's plan is `policy.choose` (drafting priced, passes shared) over the
  survivals this step drafted (deeper depths at the deepest drafted survival; depth 1's,
  which reads the context only, where nothing was drafted), so it reads this step's
  draws only at the next step.
* "confstop": vLLM's DraftConfidenceStop, fixed verification of what was drafted.
* "staged": AV's priced plan drafted pass by pass (`Policy.keep_drafting`): the planned
  requests draft depth 1, then each drafts on while the choice made again with the
  depths drafted so far says so, and every drafted position is verified.
* "choose_now" (negative control): draft all K, then verify what `policy.choose` picks
  from THIS step's survivals (the post-draft choice, exact for parallel drafters and
  greedy drafting only): whether x_i is verified depends on x_i itself, hence biased.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from av_jax import policy as P
from av_jax import stopping

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
  plan: tuple     # [B] ints, positions each request drafts and verifies this step
  step: int = 1   # step counter


def cost_model(toy, draft_share: float = 0.4) -> tuple[np.ndarray, np.ndarray]:
  """(draft_ms [B + 1], verify_ms [B (K + 1) + 1]) with draft_ms[R] + verify_ms[R + n] =
  step_cost[n]: the drafter costs `draft_share` of a step that verifies nothing."""
  draft = draft_share * toy.step_cost[0]
  verify = np.concatenate([np.full(toy.B, toy.step_cost[0] - draft), toy.step_cost - draft])
  return np.full(toy.B + 1, draft), verify


def step_cost(toy, draft_share: float = 0.4) -> P.StepCost:
  """The toy's prices as `policy.StepCost`: each of the K passes a K-th of the drafter."""
  draft_ms, verify_ms = cost_model(toy, draft_share)
  depth = np.tile((draft_ms / toy.K)[:, None], (1, toy.K))
  return P.StepCost(jnp.asarray(depth, jnp.float32), jnp.asarray(verify_ms, jnp.float32))


def first(toy) -> StepState:
  """The first step's plan: every request drafts and verifies all K."""
  return StepState(plan=(toy.K,) * toy.B)


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


ARMS = ("policy", "confstop", "choose_now", "staged")

def _staged_policy(K: int) -> P.Policy:
  return P.make_policy(K, drafter_kind="autoregressive", estimator=P.identity_estimator(K),
                       memory=P.latest_features(), shared_passes=True)


def staged_depth(probs, plan, cost, predicted):
  """`[B]` depths drafted (and verified) under `Policy.keep_drafting`: the planned rows
  draft depth 1, then each drafts on while the choice made again after the pass says so.
  `probs [B, K]` are this step's acceptance probabilities by depth (the identity
  estimator's features); an undrafted depth is predicted `predicted` (the policy's
  memory, fixed before the step: it reads no draw)."""
  B, K = probs.shape
  policy = _staged_policy(K)
  state = policy.init(B)
  state = state._replace(memory=state.memory._replace(
      latest=jnp.full((B, K), predicted, jnp.float32), known=jnp.ones((B, K), bool)))
  zb, zf = jnp.zeros((B,), bool), jnp.zeros((), jnp.float32)
  planned = P.Plan(draft=plan > 0, depth=plan, num=plan, explore=zb, explore_ms=zf,
                   expected=zf, cost_ms=zf)
  active = jnp.ones((B,), bool)
  going, drafted = plan > 0, jnp.zeros((B, K), bool)
  for j in range(K):
    drafted = drafted.at[:, j].set(going)
    if j + 1 < K:
      going = policy.keep_drafting(state, planned, probs, drafted, j + 1, active=active,
                                   cost=cost)
  return jnp.sum(drafted, axis=1, dtype=jnp.int32)


@jax.jit
def decide(surv, top1, plan, arm, conf, cost, predicted):
  """Drafted depth [N, B], verified count [N, B] and the next plan [N, B] per outcome.

  surv: [N, B, K] survivals of all K depths; top1: [N, B, K] q_max; plan: [B] int32, the
  plan from earlier steps; arm: index into ARMS. Everything is traced, so one program
  per shape serves every arm.
  """
  N, B, K = surv.shape
  every = jnp.ones((B, K), bool)
  none = jnp.zeros((B, K), bool)
  active = jnp.ones((B,), bool)

  def one(s, t1):
    # policy: the plan from earlier steps.
    depth, verified = plan, plan
    # confstop: fixed verification of what the round drafted.
    conf_out = stopping.confidence_stop(t1, conf)
    depth = jnp.where(arm == 1, conf_out.depths_run, depth)
    verified = jnp.where(arm == 1, conf_out.num_verified, verified)
    # Negative control: all K drafted, then this step's own choice.
    now = P.choose(s, eligible=every, forced=none, active=active, cost=cost,
                   sunk_ms=cost.draft(jnp.full((K,), B, jnp.int32)), price_drafting=False)
    depth = jnp.where(arm == 2, K, depth)
    verified = jnp.where(arm == 2, now.num, verified)
    # staged: the choice made again after every pass; what was drafted is verified.
    probs = s / jnp.concatenate([jnp.ones_like(s[:, :1]), s[:, :-1]], axis=1)
    staged = staged_depth(probs, plan, cost, predicted)
    depth = jnp.where(arm == 3, staged, depth)
    verified = jnp.where(arm == 3, staged, verified)
    # The next plan, from the survivals this step drafted.
    drafted = jnp.arange(K)[None] < depth[:, None]
    deepest = jnp.take_along_axis(s, jnp.clip(depth - 1, 0, K - 1)[:, None], axis=1)
    seen = jnp.where(drafted, s, jnp.where(depth[:, None] > 0, deepest, s[:, :1]))
    nxt = P.choose(seen, eligible=every, forced=none, active=active, cost=cost,
                   shared_passes=True)
    return depth, verified, nxt.num

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


def step(toy: Toy, contexts, state: StepState, *, arm, conf=0.5, draft_share=0.4,
         predicted=0.5):
  """Enumerated outcomes of one step: per outcome the depth [B], verified [B] and next
  plan [B], and the draft arrays."""
  drafts, probs, qs = joint_outcomes(toy, contexts)
  surv = np.cumprod(estimator_probs(toy, qs), axis=-1)
  depth, verified, next_plan = map(np.asarray, decide(
      jnp.asarray(surv, jnp.float32), jnp.asarray(qs.max(-1), jnp.float32),
      jnp.asarray(state.plan, jnp.int32), jnp.int32(ARMS.index(arm)), jnp.float32(conf),
      step_cost(toy, draft_share), jnp.float32(predicted)))
  return drafts, probs, qs, depth, verified, next_plan


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


def step_laws(toy: Toy, state: StepState, L: int, *, arm, joint=False, **options):
  """Per-request law [V]*L of the first L tokens after one enumerated step from the empty
  context, with tokens the step does not emit filled from the target; with `joint`, also
  the joint law [V]*(L*B) of all requests. Returns (laws [B, V..], joint or None, info)."""
  contexts = [()] * toy.B
  drafts, probs, qs, depth, verified, _ = step(toy, contexts, state, arm=arm, **options)
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


def emitted_law(toy: Toy, L: int, state: StepState | None = None, *, arm,
                context: tuple = (), _memo=None, **options) -> np.ndarray:
  """Exact law [V]*L of the first L tokens one request (B = 1) emits, over as many steps
  as it takes: each step's plan is the previous step's output."""
  assert toy.B == 1
  state = first(toy) if state is None else state
  memo = {} if _memo is None else _memo
  key = (context, L, tuple(int(n) for n in state.plan), state.step)
  if key in memo:
    return memo[key]
  drafts, probs, qs, depth, verified, next_plan = step(toy, [context], state, arm=arm,
                                                       **options)
  law = np.zeros((toy.V,) * L)
  for n in range(len(probs)):
    nxt = StepState(plan=tuple(int(x) for x in next_plan[n]), step=state.step + 1)
    for tokens, prob in verification_outcomes(toy, 0, context, drafts[n, 0], qs[n, 0],
                                              int(verified[n, 0])):
      if len(tokens) >= L:
        law[tokens[:L]] += probs[n] * prob
      else:
        rest = emitted_law(toy, L - len(tokens), nxt, arm=arm, context=context + tokens,
                           _memo=memo, **options)
        law[tokens] += probs[n] * prob * rest
  memo[key] = law
  return law


def target_law(toy: Toy, b: int, L: int) -> np.ndarray:
  """Exact law [V]*L of the first L tokens of request b's target alone (empty context)."""
  return _fill(toy, b, (), L)
