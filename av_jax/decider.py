"""The priced decision (`av_jax.policy`) behind the verbs an engine step calls.

One step, in the engine's order:

    decision = decider.prepare(decision, active, cost)   # the plan: who drafts, how deep
    slots = decider.draft_slots(decision, active)          # [B] bool, rows that draft
    keep = decider.keep_drafting(decision, probs, drafted, depth, active=..., slots=...)
    probs = decider.score(decision, features)              # [B, K] acceptance
    plan, decision = decider.plan(decision, probs, cost, active=active, drafted=usable)
    decision = decider.learn(decision, features, accepted, labeled)

`prepare` reads nothing drawn this step (rule 2): the plan comes from every request's
predicted survival curve. `keep_drafting`, after each pass of a sampled autoregressive
drafter that stops between passes (`Drafter.stepwise`), makes the choice again with the
depths drafted so far (`Policy.keep_drafting`); for other drafters it stops a request at
its planned depth. `plan` verifies, for a parallel drafter or greedy drafting, the best
candidate among the drafted positions with their own survivals (the drafting now sunk);
with sampled autoregressive drafting, every drafted position (a stepwise drafter) or the
planned ones. `learn` feeds the labels, the priced step time and the drafted features to
the policy's parts.

The engine carries the state as `DecisionState(estimator=..., planner=PolicyCarry)`.

Example: a step of a B = 2, K = 3 parallel drafter whose plan drafts row 0 only
(`draft_slots -> [True, False]`) verifies, after drafting, row 0's positions whose
survival pays, e.g. `plan.num_verified = [2, 0]`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from av_jax import policy as P
from av_jax.decision import DecisionState
from av_jax.estimator import EstimatorConfig, online_estimator
from av_jax.planner import Plan
from av_jax.selection import CostModel


class Pending(NamedTuple):
  """What `plan` fixed for `learn` of the same step."""
  drafted: jax.Array   # [B, K] bool, positions drafted
  step_ms: jax.Array   # [] float32, priced time of the step
  explore_ms: jax.Array  # [] float32, priced exploration of the step (0: none)
  active: jax.Array    # [B] bool, requests decoding this step


class PolicyCarry(NamedTuple):
  """The policy's state but the estimator's, with this step's plan (a pytree)."""
  memory: P.MemoryState
  explore: P.ExploreState
  plan: P.Plan        # this step's plan (`prepare`)
  pending: Pending    # set by `plan`, read by `learn`


class PolicyPlanner(NamedTuple):
  """What the engine reads of a decider's planner (static)."""
  gated: bool           # rows may be left out of drafting (subset drafting)
  policy: str           # "current" or "lagged"
  stop: str = "policy"  # requests stop drafting where the policy says (see `staged`)
  config: Any = None
  # Sampled autoregressive drafting, pass by pass: after each pass the choice is made
  # again with the drafted features (`Policy.keep_drafting`) and every drafted position
  # is verified; False: requests stop at their planned depth and verify the plan's.
  staged: bool = False


def step_cost(cost: CostModel, K: int, *, parallel: bool) -> P.StepCost:
  """`policy.StepCost` of an engine's `CostModel`: a parallel drafter pays its whole
  pass at depth 1; an autoregressive one `fixed + (full - fixed) / K` at depth 1 and
  `(full - fixed) / K` at each later depth (`CostModel.draft_share_cost`)."""
  full = jnp.asarray(cost.draft_ms, jnp.float32)
  if parallel:
    depth = jnp.zeros((full.shape[0], K), jnp.float32).at[:, 0].set(full)
  else:
    fixed = (jnp.zeros_like(full) if cost.draft_fixed_ms is None
             else jnp.minimum(jnp.asarray(cost.draft_fixed_ms, jnp.float32), full))
    each = (full - fixed) / K
    depth = jnp.broadcast_to(each[:, None], (full.shape[0], K)).at[:, 0].add(fixed)
  floor = getattr(cost, "drafting_floor_ms", None)
  return P.StepCost(depth, jnp.asarray(cost.verify_ms, jnp.float32),
                    jnp.zeros((), jnp.float32) if floor is None
                    else jnp.asarray(floor, jnp.float32))


@dataclasses.dataclass(frozen=True)
class PolicyDecider:
  """The engine's decider for the `av` arm (hashable, jit-static)."""
  policy: P.Policy
  planner: PolicyPlanner
  head: bool = False

  @property
  def gated(self) -> bool:
    """Rows may be left out of drafting (the engine gathers the drafting rows)."""
    return self.planner.gated

  @property
  def stop(self) -> str:
    """The drafting stop the engine's loop calls between passes ("policy":
    `keep_drafting`)."""
    return self.planner.stop

  @property
  def estimator(self):
    return self.policy.estimator

  @property
  def num_positions(self) -> int:
    return self.policy.num_positions

  def _parallel(self) -> bool:
    return self.policy.drafter_kind == "parallel"

  def _state(self, decision: DecisionState) -> P.PolicyState:
    c = decision.planner
    return P.PolicyState(estimator=decision.estimator, memory=c.memory, explore=c.explore)

  def init(self, batch_size: int | None = None) -> DecisionState:
    B, K = batch_size or 1, self.num_positions
    s = self.policy.init(B)
    zb, zf = jnp.zeros((B,), jnp.int32), jnp.zeros((), jnp.float32)
    plan = P.Plan(draft=jnp.zeros((B,), bool), depth=zb, num=zb, explore=jnp.zeros((B,), bool),
                  explore_ms=zf, expected=zf, cost_ms=zf)
    pending = Pending(drafted=jnp.zeros((B, K), bool), step_ms=zf, explore_ms=zf,
                      active=jnp.zeros((B,), bool))
    carry = PolicyCarry(memory=s.memory, explore=s.explore, plan=plan, pending=pending)
    return jax.tree.map(jnp.copy, DecisionState(estimator=s.estimator, planner=carry))

  def admit(self, carry: PolicyCarry, slot: jax.Array) -> PolicyCarry:
    """A new request in `slot`: its memory starts empty."""
    B = carry.memory.known.shape[0]
    s = self.policy.admit(P.PolicyState(estimator=None, memory=carry.memory,
                                        explore=carry.explore), jnp.arange(B) == slot)
    return carry._replace(memory=s.memory)

  def prepare(self, decision: DecisionState, active: jax.Array,
              cost: CostModel) -> DecisionState:
    """This step's plan, from earlier steps only."""
    sc = step_cost(cost, self.num_positions, parallel=self._parallel())
    plan = self.policy.plan(self._state(decision), active, sc)
    if self._parallel():  # the engine's block drafter drafts its whole block
      plan = plan._replace(depth=jnp.where(plan.draft, self.num_positions, 0).astype(jnp.int32))
    return decision._replace(planner=decision.planner._replace(plan=plan))

  def predicted_survival(self, decision: DecisionState) -> jax.Array:
    """`[B, K]`: each slot's predicted survival curve for its next step (its latest
    features under the current coefficients; what `policy.depth_cap` takes)."""
    return self.policy.predicted_survival(self._state(decision))

  def draft_slots(self, decision: DecisionState, active: jax.typing.ArrayLike) -> jax.Array:
    return decision.planner.plan.draft & jnp.asarray(active, bool)

  def drafts(self, decision: DecisionState) -> jax.Array:
    return jnp.any(decision.planner.plan.draft)

  def score(self, decision: DecisionState, features, *, conf=None) -> jax.Array:
    del conf
    return self.policy.estimator.predict(decision.estimator, features)

  def keep_drafting(self, decision: DecisionState, probs, drafted, depth, *, active,
                    top1=None, slots=None, cost: CostModel | None = None,
                    num_active=None) -> jax.Array:
    """`[E]` bool, the rows that draft depth + 1: under `staged` (and a `cost`) the
    policy's choice made again after the pass (`Policy.keep_drafting`); else the rows
    whose planned depth is deeper. `slots [E]`: the slot of each row (None: all B in
    order); `num_active`: the step's active requests (rows may be a subset)."""
    del top1
    active = jnp.asarray(active, bool)
    plan = decision.planner.plan
    pick = (lambda x: x) if slots is None else (lambda x: x[slots])
    if not (self.planner.staged and cost is not None):
      return active & (depth < pick(plan.depth))
    state = self._state(decision)
    memory = state.memory._replace(latest=pick(state.memory.latest),
                                   known=pick(state.memory.known), age=pick(state.memory.age))
    sc = step_cost(cost, self.num_positions, parallel=False)
    return self.policy.keep_drafting(
        state._replace(memory=memory), plan._replace(explore=pick(plan.explore)),
        jnp.asarray(probs, jnp.float32), jnp.asarray(drafted, bool), depth, active=active,
        cost=sc, num_active=num_active)

  def plan(self, decision: DecisionState, probs, cost: CostModel, *, active=None,
           sound=None, drafting=True, drafted=None, top1=None
           ) -> tuple[Plan, DecisionState]:
    del top1
    B, K = jnp.shape(probs)
    active = jnp.ones((B,), bool) if active is None else jnp.asarray(active, bool)
    active_draft = active if sound is None else active & jnp.asarray(sound, bool)
    carry = decision.planner
    planned = carry.plan
    drafting = jnp.broadcast_to(jnp.asarray(drafting, bool), (B,))
    drafted = (jnp.ones((B, K), bool) if drafted is None else jnp.asarray(drafted, bool))
    drafted = drafted & (active_draft & drafting)[:, None]
    sc = step_cost(cost, K, parallel=self._parallel())
    draft_ms = sc.draft(jnp.sum(drafted, axis=0, dtype=jnp.int32))
    if self.policy.current:
      survival = P.survival_of(probs)
      choice = P.choose(survival, eligible=drafted, forced=drafted & planned.explore[:, None],
                        active=active, cost=sc, sunk_ms=draft_ms, price_drafting=False)
      num = choice.num
    elif self.planner.staged:  # every drafted position (`keep_drafting`)
      num = jnp.sum(jnp.cumprod(drafted, axis=1), axis=1)
    else:
      num = jnp.minimum(planned.num, jnp.sum(jnp.cumprod(drafted, axis=1), axis=1))
    num = jnp.where(active, num, 0).astype(jnp.int32)
    explored = planned.explore & (num > 0)
    step_ms = draft_ms + sc.verify(jnp.sum(active, dtype=jnp.int32) + jnp.sum(num))
    pending = Pending(drafted=drafted, step_ms=step_ms,
                      explore_ms=jnp.where(jnp.any(explored), planned.explore_ms, 0.0),
                      active=active)
    out = Plan(num_verified=num, mask=jnp.arange(K)[None, :] < num[:, None],
               budget=jnp.sum(num), explored=explored, drafting=drafting & active)
    return out, decision._replace(planner=carry._replace(pending=pending))

  def learn(self, decision: DecisionState, features, accepted, labeled, *,
            axis_name: str | None = None, learn=None) -> DecisionState:
    """Feeds the step's outcome to the policy's parts. `learn`: `[B]` bool, requests
    whose labels the estimator learns from (None: all); a request with a target-only
    transform (a penalty, banned ids) passes False, and its positions reach the
    estimator unlabelled. Its drafted features still feed the memory (they are the
    drafter's, untouched by the transform)."""
    p = decision.planner.pending
    labeled = jnp.asarray(labeled, bool)
    if learn is not None:
      learn = jnp.asarray(learn)
      if learn.shape != labeled.shape[:1] or learn.dtype != jnp.bool_:
        raise ValueError(f"learn: expected a [B={labeled.shape[0]}] bool mask of the "
                         f"requests whose labels count, got {learn.dtype}{list(learn.shape)}")
      labeled = labeled & learn[:, None]
    state = self.policy.learn(self._state(decision), P.StepOutcome(
        features=jnp.asarray(features, jnp.float32), drafted=p.drafted,
        accepted=jnp.asarray(accepted, bool), labeled=labeled,
        step_ms=p.step_ms, explore_ms=p.explore_ms), axis_name=axis_name)
    carry = decision.planner._replace(memory=state.memory, explore=state.explore)
    return DecisionState(estimator=state.estimator, planner=carry)

  def regime(self, carry: PolicyCarry, name: str) -> PolicyCarry:
    """A state whose plans draft nothing ("skip"), slot 0 alone to depth K ("one") or
    every slot to depth K ("full"): the profiler's whole-step regimes."""
    B, K = carry.memory.known.shape
    high = {"skip": jnp.zeros((B,), bool), "one": jnp.arange(B) == 0,
            "full": jnp.ones((B,), bool)}[name]
    latest = jnp.where(high[:, None], 60.0, -60.0) * jnp.ones((B, K), jnp.float32)
    memory = carry.memory._replace(latest=latest, known=jnp.ones((B, K), bool),
                                   age=jnp.zeros((B, K), jnp.float32))
    if memory.lag is not None:  # the starting coefficients read +-60 as certain
      memory = memory._replace(lag=self.policy.parts[1].init(B, K).lag)
    explore = carry.explore._replace(credit_ms=jnp.full_like(carry.explore.credit_ms, -1e9))
    return carry._replace(memory=memory, explore=explore)


def make_policy_decider(num_positions: int, *, drafter_kind: str, greedy: bool, gated: bool,
                        estimator: EstimatorConfig | None = None,
                        stepwise: bool = False) -> PolicyDecider:
  """The `av` arm's decider for a drafter (`drafter_kind` "parallel" or
  "autoregressive"; `gated`: the engine can leave rows out of drafting; `stepwise`: the
  drafter calls a stop between its passes, so sampled drafting is `staged`)."""
  est = online_estimator(num_positions, estimator)
  # The engine's drafting passes run every drafting row of the step (static shapes).
  policy = P.make_policy(num_positions, drafter_kind=drafter_kind, greedy=greedy,
                         estimator=est, shared_passes=True)
  return PolicyDecider(policy=policy, planner=PolicyPlanner(
      gated=gated, policy="current" if policy.current else "lagged",
      staged=stepwise and drafter_kind == "autoregressive" and not policy.current))
