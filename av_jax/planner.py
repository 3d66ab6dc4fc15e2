"""Verification planner: acceptance probabilities -> `num_verified [B]`, losslessly.

The planner composes `survival`, `choose_budget` and `allocate` under an explicit policy
that decides where the budget comes from (docs/algorithm.md section 5):

* ``"current"``: the budget is computed from this step's survivals. Exact for parallel
  (block) drafters and for greedy drafting, whose K distributions do not depend on this
  step's draws. BIASED for autoregressive drafters with probabilistic drafting: q[b, i+1]
  depends on the drawn x[b, i], so the budget, and with it the decision to verify
  x[b, i], would depend on x[b, i] (the counterexample of docs/algorithm.md section 5).
* ``"lagged"``: the budget used at step t was computed from step t-1's survivals (as
  vLLM does). It depends on nothing drawn at step t, and allocation with a fixed budget
  is safe (whether (b, i) is chosen never depends on b's deeper positions), so it is
  exact for every drafter kind.
* ``"fixed"``: verify all K positions of every active request (plain speculative
  decoding). ``"none"``: verify nothing (target-only decoding).

`exact_policy(drafter_kind=..., greedy=...)` returns the policy the engine uses by
default: ``"current"`` where that is exact, ``"lagged"`` otherwise.

Exploration: every `explore_every` steps one active slot, chosen round-robin by the
step counter (so independently of every draw), verifies all K positions. A pessimistic
estimator that would verify nothing still receives labels at every depth and recovers.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from av_jax import _checks
from av_jax import stopping
# The private ranking helpers serve the allocation over drafted positions only (a
# position never drafted must neither be verified nor take budget: ranked -1).
from av_jax.selection import (CostModel, _allocation, _budget, _rank, _ranked_survival,
                              allocate, budget_and_allocation, check_probabilities,
                              survival)

POLICIES = ("current", "lagged", "fixed", "none")
# Drafting stops (docs/algorithm.md section 10): "none" drafts all K; "survival" is
# survival stop (`av_jax.stopping`, adaptive policies); "confidence" is `confstop:T`.
STOPS = ("none", "survival", "confidence")
DRAFTER_KINDS = ("autoregressive", "parallel")

# The lagged policy's first step verifies everything: a budget above any B * K. It stays
# in the state; `Plan.budget` reports it clamped to B * K.
_ALL = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlannerConfig:
  """The planner's hyper-parameters (the budget policy is chosen per arm and drafter)."""
  explore_every: int = 4         # one slot verifies all K every this many steps; 0: never
  initial_budget: int | None = None  # lagged policy's first budget; None: everything
  skip_unprofitable_drafts: bool = False  # gate drafting on whether it paid (see
                                          # `make_planner`)
  recheck_every: int | None = None  # while drafting does not pay, draft only every this
                                    # many steps; None: 4 x explore_every
  draft_stop: str = "none"       # one of STOPS: when an autoregressive drafter stops
  stop_margin: float = 0.5       # survival stop: tau = margin * smallest admitted survival
  stop_min_depth: int = 1        # survival stop: every drafting request drafts this many
  confidence_threshold: float = 0.5  # confstop: T on the drafts' top-1 probability

  def __post_init__(self):
    if self.explore_every < 0:
      raise ValueError(f"explore_every: expected >= 0, got {self.explore_every}")
    if self.draft_stop not in STOPS:
      raise ValueError(f"draft_stop: expected one of {STOPS}, got {self.draft_stop!r}")
    stopping.check_params(stopping.StopParams(self.stop_margin, self.stop_min_depth))
    t = self.confidence_threshold
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0:
      raise ValueError(f"confidence_threshold: expected a number in [0, 1], got {t!r}")


class PlannerState(NamedTuple):
  budget: jax.Array  # [] int32, budget for the next step (used by the lagged policy)
  step: jax.Array    # [] int32, steps planned so far (drives round-robin exploration)
  # [] bool, whether drafting paid at the last step that drafted (see `should_draft`);
  # always True unless the planner was built with `skip_unprofitable_drafts=True`.
  drafting_pays: jax.Array | bool = True
  # [] float32, survival stop's threshold for this step, from earlier steps only
  # (`av_jax.stopping`); 0 (nothing stops) until a step has planned.
  tau: jax.Array | float = 0.0


class Plan(NamedTuple):
  num_verified: jax.Array  # [B] int32, verified positions per slot (a prefix)
  mask: jax.Array          # [B, K] bool, verified positions
  budget: jax.Array        # [] int32, budget the allocation used (before exploration),
                           # at most B * K
  explored: jax.Array      # [B] bool, slot verified all K for exploration this step


class Planner(NamedTuple):
  init: Callable[[], PlannerState]
  plan: Callable[..., tuple[Plan, PlannerState]]
  policy: str
  should_draft: Callable[[PlannerState], jax.Array]
  config: PlannerConfig
  gated: bool  # `should_draft` can say False (skip_unprofitable_drafts took effect)
  # (state, probs [B,K], drafted [B,K], depth, *, active, top1) -> [B] bool: whether each
  # request drafts depth `depth + 1` (reads depths 1..depth only); see `make_planner`.
  keep_drafting: Callable[..., jax.Array] | None = None
  stop: str = "none"  # the drafting stop in effect (STOPS)


def exact_policy(*, drafter_kind: str, greedy: bool) -> str:
  """The exact budget policy for a drafting style and temperature (docs/algorithm.md
  section 5)."""
  if drafter_kind not in DRAFTER_KINDS:
    raise ValueError(f"drafter_kind: expected one of {DRAFTER_KINDS}, got {drafter_kind!r}")
  return "current" if (drafter_kind == "parallel" or greedy) else "lagged"


def is_exact(policy: str, *, drafter_kind: str, greedy: bool) -> bool:
  """Whether `policy` keeps the output exactly target-distributed for this drafter."""
  if policy not in POLICIES:
    raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
  return policy != "current" or exact_policy(drafter_kind=drafter_kind, greedy=greedy) == "current"


def make_planner(
    config: PlannerConfig | None = None,
    *,
    policy: str = "lagged",
    **overrides,
) -> Planner:
  """Builds a verification planner; it closes over hyper-parameters only.

  The step-cost tables are an argument of `plan` (data, so a re-profiled table needs no
  new planner and no recompile).

  Args:
    config: the hyper-parameters (`PlannerConfig()` when None):
      * `explore_every`: one slot verifies all K every this many steps; 0 disables.
      * `initial_budget`: lagged policy's budget at the first step (default: everything).
      * `skip_unprofitable_drafts`: after a step whose best plan earns fewer tokens per
        unit cost than a target-only step without drafting, `should_draft` says False
        until a re-check step (every `recheck_every` steps, also an exploration step)
        drafts, explores and re-evaluates (policies "current" and "lagged" with
        exploration only). The decision uses only earlier steps, so it is as exact as the
        lagged budget; the caller skips drafting and passes `drafting=False` to `plan`.
      * `recheck_every`: while drafting does not pay, draft (and explore) only every this
        many steps; a multiple of `explore_every`, default 4 x `explore_every`.
    policy: one of `POLICIES` (see the module docstring); use `exact_policy` to pick.
    **overrides: `PlannerConfig` fields replacing those of `config`.

  Returns:
    `Planner(init, plan, policy, should_draft, config, gated)` with `plan(state, probs [B,K],
    cost, *, active=None, drafting=True) -> (Plan, state)` and `should_draft(state) ->
    [] bool`.

  Input checks of `plan`: `cost` must be a `CostModel` (ValueError otherwise); a
  `cost.verify_ms` shorter than `B (K + 1) + 1` entries warns at trace time (budgets
  needing more tokens are never chosen); concrete `probs` outside [0, 1] raise a
  ValueError. Under `jax.jit` the values of `probs` are unknown: they are clipped to
  [0, 1] (a probability above 1 counts as certain acceptance of that position) and NaN
  ranks as 0 (never verified, nor anything after it).

  Example:
    >>> planner = make_planner(policy=exact_policy(drafter_kind="parallel", greedy=False))
    >>> plan, pstate = planner.plan(pstate, est.predict(estate, features), cost,
    ...                             active=active)
  """
  config = dataclasses.replace(config or PlannerConfig(), **overrides)
  if policy not in POLICIES:
    raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
  explore_every = config.explore_every
  recheck_every = config.recheck_every
  adaptive = policy in ("current", "lagged")
  gated = config.skip_unprofitable_drafts and adaptive and explore_every > 0
  if recheck_every is None:
    recheck_every = 4 * max(explore_every, 1)
  if gated and (recheck_every < 1 or recheck_every % explore_every):
    raise ValueError(f"recheck_every: expected a positive multiple of explore_every="
                     f"{explore_every}, got {recheck_every}")
  stop = config.draft_stop
  if stop == "survival" and not adaptive:
    raise ValueError(f"draft_stop: 'survival' needs an adaptive policy, got {policy!r}")
  early = stopping.make_early_stop(margin=config.stop_margin,
                                   min_depth=config.stop_min_depth)

  def init() -> PlannerState:
    initial = config.initial_budget
    budget = _ALL if initial is None else int(initial)
    return PlannerState(budget=jnp.asarray(budget, jnp.int32), step=jnp.zeros((), jnp.int32),
                        drafting_pays=jnp.asarray(True), tau=jnp.zeros((), jnp.float32))

  def exploring(state: PlannerState) -> jax.Array:
    if explore_every > 0 and adaptive:
      return state.step % explore_every == 0
    return jnp.asarray(False)

  def explored_slots(state: PlannerState, B: int, active: jax.Array) -> jax.Array:
    """`[B]` bool, the slot that verifies all K this step (round-robin by step count)."""
    if explore_every > 0 and adaptive:
      slot = (state.step // explore_every) % B
      return (jnp.arange(B) == slot) & exploring(state) & active
    return jnp.zeros((B,), bool)

  def confident_prefix(top1, drafted):
    """`[B]` int32, leading drafted positions whose top-1 probability is >= T."""
    ok = drafted & (jnp.asarray(top1, jnp.float32) >= config.confidence_threshold)
    return jnp.sum(jnp.cumprod(ok, axis=1), axis=1, dtype=jnp.int32)

  def keep_drafting(state: PlannerState, probs, drafted, depth, *, active,
                    top1=None) -> jax.Array:
    """Whether each request drafts depth `depth + 1`, from depths 1..`depth` only.

    "survival": survival stop with this step's `tau` (from earlier steps) and the
    exploring slot always continuing. "confidence": batch level, every active request
    continues while some request's drafts so far all have top-1 >= T (`top1 [B, K]`
    required). "none": every drafting request continues.
    """
    probs = jnp.asarray(probs, jnp.float32)
    B, K = probs.shape
    drafted = jnp.asarray(drafted) & (jnp.arange(K)[None] < depth)  # nothing deeper read
    active = jnp.asarray(active)
    column = jnp.take(drafted, jnp.clip(depth - 1, 0, K - 1), axis=1)
    if stop == "survival":
      surv = jnp.where(drafted, survival(probs), 0.0)
      return early.keep_drafting(stopping.StopState(tau=jnp.asarray(state.tau, jnp.float32)),
                                 surv, drafted, depth, explored_slots(state, B, active),
                                 active=active)
    if stop == "confidence":
      if top1 is None:
        raise ValueError("top1: required by the confidence stop, got None")
      alive = active & (confident_prefix(jnp.where(drafted, top1, 0.0), drafted) >= depth)
      return active & column & jnp.any(alive)
    return active & column

  def should_draft(state: PlannerState) -> jax.Array:
    """Whether this step should draft: always, unless drafting did not pay at the last
    step that drafted and this is not a re-check step."""
    if not gated:
      return jnp.asarray(True)
    return jnp.asarray(state.drafting_pays) | (state.step % recheck_every == 0)

  def plan(state: PlannerState, probs: jax.typing.ArrayLike, cost: CostModel, *,
           active: jax.typing.ArrayLike | None = None,
           drafting: jax.typing.ArrayLike = True,
           drafted: jax.typing.ArrayLike | None = None,
           top1: jax.typing.ArrayLike | None = None) -> tuple[Plan, PlannerState]:
    if not isinstance(cost, CostModel):
      raise ValueError(f"cost: expected a CostModel (av_jax.make_cost_model), the third "
                       f"argument of plan, got {type(cost).__name__}")
    check_probabilities("probs", probs)
    probs = jnp.asarray(probs, jnp.float32)
    _checks.rank("probs", probs, 2, "BK")
    B, K = probs.shape
    if active is None:
      active = jnp.ones((B,), bool)
    active = jnp.asarray(active)
    _checks.shape("active", active, (B,), "B")
    _checks.boolean("active", active)
    surv = survival(probs)
    next_budget = state.budget
    tau = state.tau
    if drafted is not None:
      drafted = jnp.asarray(drafted)
      _checks.shape("drafted", drafted, (B, K), "BK")
      _checks.boolean("drafted", drafted)
    if drafted is not None and policy in ("current", "lagged"):
      # Positions never drafted are ranked -1: no budget, no verification, and the next
      # budget (and tau) describe the drafted positions only (docs/algorithm.md 10).
      ranking = _rank(jnp.where(drafted, _ranked_survival(surv, active), -1.0))
      optimal = _budget(ranking, cost, jnp.sum(active, dtype=jnp.int32), K)
      budget = state.budget if policy == "lagged" else optimal
      mask = _allocation(ranking, budget, B, K)
      if policy == "lagged":
        next_budget = jnp.where(jnp.asarray(drafting), optimal, state.budget)
      if stop == "survival":  # tau for the NEXT step, from this step's optimal budget
        new_tau = early.update(stopping.StopState(tau=jnp.asarray(tau, jnp.float32)), surv,
                               drafted, optimal, active=active).tau
        tau = jnp.where(jnp.asarray(drafting), new_tau, tau)
    elif policy in ("current", "lagged"):
      # One sort serves both the budget and the allocation.
      optimal, budget, mask = budget_and_allocation(
          surv, cost, active=active, budget=state.budget if policy == "lagged" else None)
      if policy == "lagged":  # a step that did not draft has nothing to plan from
        next_budget = jnp.where(jnp.asarray(drafting), optimal, state.budget)
    else:
      budget = jnp.asarray(B * K if policy == "fixed" else 0, jnp.int32)
      mask = allocate(surv, budget, active=active)
      if stop == "confidence" and policy == "fixed":
        # confstop: every active request verifies clip(L, 1, K) drafts, L the longest
        # confident prefix in the batch (`stopping.confidence_num_verified`).
        if top1 is None:
          raise ValueError("top1: required by the confidence stop, got None")
        seen = jnp.ones((B, K), bool) if drafted is None else drafted
        longest = jnp.max(jnp.where(active, confident_prefix(top1, seen), 0))
        count = jnp.clip(longest, 1, K)
        mask = active[:, None] & (jnp.arange(K)[None] < count)
        budget = jnp.sum(mask & seen, dtype=jnp.int32)
    explored = explored_slots(state, B, active)
    pays_next = jnp.asarray(state.drafting_pays)
    drafting = jnp.asarray(drafting)
    if gated:
      # Tokens per unit cost of the chosen plan against a step that does not draft.
      R = jnp.sum(active, dtype=jnp.int32)
      n = jnp.sum(mask, dtype=jnp.int32)
      gain = R + jnp.sum(jnp.where(mask, surv, 0.0))
      pays = gain * cost.verify_cost(R) > R * (cost.draft_cost(R) + cost.verify_cost(R + n))
      pays_next = jnp.where(drafting, pays | (R == 0), pays_next)
    mask = (mask | explored[:, None]) & drafting
    if drafted is not None:  # verify only what was drafted (a prefix per slot)
      mask = mask & drafted
    explored = explored & drafting
    new_state = PlannerState(budget=next_budget, step=state.step + 1, drafting_pays=pays_next,
                             tau=tau)
    plan_ = Plan(num_verified=jnp.sum(mask, axis=-1, dtype=jnp.int32), mask=mask,
                 budget=jnp.minimum(budget, B * K), explored=explored)
    return plan_, new_state

  return Planner(init=init, plan=plan, policy=policy, should_draft=should_draft,
                 config=config, gated=gated, keep_drafting=keep_drafting, stop=stop)
