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
from av_jax.selection import (CostModel, allocate, budget_and_allocation, check_probabilities,
                              survival)

POLICIES = ("current", "lagged", "fixed", "none")
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

  def __post_init__(self):
    if self.explore_every < 0:
      raise ValueError(f"explore_every: expected >= 0, got {self.explore_every}")


class PlannerState(NamedTuple):
  budget: jax.Array  # [] int32, budget for the next step (used by the lagged policy)
  step: jax.Array    # [] int32, steps planned so far (drives round-robin exploration)
  # [] bool, whether drafting paid at the last step that drafted (see `should_draft`);
  # always True unless the planner was built with `skip_unprofitable_drafts=True`.
  drafting_pays: jax.Array | bool = True


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

  def init() -> PlannerState:
    initial = config.initial_budget
    budget = _ALL if initial is None else int(initial)
    return PlannerState(budget=jnp.asarray(budget, jnp.int32), step=jnp.zeros((), jnp.int32),
                        drafting_pays=jnp.asarray(True))

  def exploring(state: PlannerState) -> jax.Array:
    if explore_every > 0 and adaptive:
      return state.step % explore_every == 0
    return jnp.asarray(False)

  def should_draft(state: PlannerState) -> jax.Array:
    """Whether this step should draft: always, unless drafting did not pay at the last
    step that drafted and this is not a re-check step."""
    if not gated:
      return jnp.asarray(True)
    return jnp.asarray(state.drafting_pays) | (state.step % recheck_every == 0)

  def plan(state: PlannerState, probs: jax.typing.ArrayLike, cost: CostModel, *,
           active: jax.typing.ArrayLike | None = None,
           drafting: jax.typing.ArrayLike = True) -> tuple[Plan, PlannerState]:
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
    if policy in ("current", "lagged"):
      # One sort serves both the budget and the allocation.
      optimal, budget, mask = budget_and_allocation(
          surv, cost, active=active, budget=state.budget if policy == "lagged" else None)
      if policy == "lagged":  # a step that did not draft has nothing to plan from
        next_budget = jnp.where(jnp.asarray(drafting), optimal, state.budget)
    else:
      budget = jnp.asarray(B * K if policy == "fixed" else 0, jnp.int32)
      mask = allocate(surv, budget, active=active)
    if explore_every > 0 and adaptive:
      slot = (state.step // explore_every) % B
      explored = (jnp.arange(B) == slot) & exploring(state) & active
    else:
      explored = jnp.zeros((B,), bool)
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
    explored = explored & drafting
    new_state = PlannerState(budget=next_budget, step=state.step + 1, drafting_pays=pays_next)
    plan_ = Plan(num_verified=jnp.sum(mask, axis=-1, dtype=jnp.int32), mask=mask,
                 budget=jnp.minimum(budget, B * K), explored=explored)
    return plan_, new_state

  return Planner(init=init, plan=plan, policy=policy, should_draft=should_draft,
                 config=config, gated=gated)
