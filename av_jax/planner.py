"""Verification planner: acceptance probabilities -> `num_verified [B]`, losslessly.

The budget rule of the design note, for callers that have this step's drafts and want
only "what to verify" (`av_jax.decision.decision_step`, the `av_head` arm, the static
arms): the planner composes `survival`, `choose_budget` and `allocate` under an explicit
policy that decides where the budget comes from (docs/algorithm.md section 5):

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

`exact_policy(drafter_kind=..., greedy=...)` returns the exact policy for a drafter:
``"current"`` where that is exact, ``"lagged"`` otherwise.

Exploration: every `explore_every` steps one active slot, chosen round-robin by the
step counter (so independently of every draw), verifies all K positions. A pessimistic
estimator that would verify nothing still receives labels at every depth and recovers.

Example: B = 2, K = 2, survivals [[0.9, 0.8], [0.2, 0.1]] under the current policy and a
cost table where a verified token costs a tenth of the step: the budget is 2, both of
slot 0's positions, so `Plan.num_verified = [2, 0]`.

The decision that also chooses who drafts and how deep is `av_jax.policy`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from av_jax import _checks
# The private ranking helpers serve the allocation over drafted positions only (a
# position never drafted must neither be verified nor take budget: ranked -1).
from av_jax.selection import (CostModel, _allocation, _budget, _rank, _ranked_survival,
                              allocate, check_cost_table, check_probabilities, survival)

POLICIES = ("current", "lagged", "fixed", "none")
# Drafting stops of the arms this planner serves: "none" drafts all K; "confidence" is
# `confstop:T` (vLLM's DraftConfidenceStop).
STOPS = ("none", "confidence")
DRAFTER_KINDS = ("autoregressive", "parallel")

# The lagged policy's first step verifies everything: a budget above any B * K. It stays
# in the state; `Plan.budget` reports it clamped to B * K.
_ALL = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlannerConfig:
  """The planner's hyper-parameters (the budget policy is chosen per arm and drafter)."""
  explore_every: int = 4         # one slot verifies all K every this many steps; 0: never
  initial_budget: int | None = None  # lagged policy's first budget; None: everything
  draft_stop: str = "none"       # one of STOPS: when an autoregressive drafter stops
  confidence_threshold: float = 0.5  # confstop: T on the drafts' top-1 probability

  def __post_init__(self):
    if isinstance(self.explore_every, bool) or not isinstance(self.explore_every, int) \
        or self.explore_every < 0:
      raise ValueError(f"explore_every: expected an integer >= 0, got {self.explore_every!r}")
    if self.draft_stop not in STOPS:
      raise ValueError(f"draft_stop: expected one of {STOPS}, got {self.draft_stop!r}")
    t = self.confidence_threshold
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0:
      raise ValueError(f"confidence_threshold: expected a number in [0, 1], got {t!r}")


class PlannerState(NamedTuple):
  """The planner's state (a pytree)."""
  budget: jax.Array  # [] int32, budget for the next step (used by the lagged policy)
  step: jax.Array    # [] int32, steps planned so far (drives round-robin exploration)


class Plan(NamedTuple):
  num_verified: jax.Array  # [B] int32, verified positions per slot (a prefix)
  mask: jax.Array          # [B, K] bool, verified positions
  budget: jax.Array        # [] int32, budget the allocation used (before exploration),
                           # at most B * K
  explored: jax.Array      # [B] bool, slot verified all K for exploration this step
  drafting: jax.Array | None = None  # [B] bool, active slots that drafted this step


class Planner(NamedTuple):
  init: Callable[..., PlannerState]  # (num_slots=None) -> PlannerState
  plan: Callable[..., tuple[Plan, PlannerState]]
  policy: str
  config: PlannerConfig
  # (state, probs [B,K], drafted [B,K], depth, *, active, top1, slots) -> [B] bool: whether
  # each request drafts depth `depth + 1` (reads depths 1..depth only); see `make_planner`.
  keep_drafting: Callable[..., jax.Array]
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


def _init(config: PlannerConfig, num_slots: int | None = None) -> PlannerState:
  if num_slots is not None and (isinstance(num_slots, bool)
                                or not isinstance(num_slots, int) or num_slots < 1):
    raise ValueError(f"num_slots: expected None or an integer >= 1, got {num_slots!r}")
  initial = config.initial_budget
  budget = _ALL if initial is None else int(initial)
  return PlannerState(budget=jnp.asarray(budget, jnp.int32), step=jnp.asarray(0, jnp.int32))


def _explored_slots(config: PlannerConfig, policy: str, state: PlannerState,
                    candidates: jax.Array) -> jax.Array:
  """`[B]` bool: slot `(step // explore_every) % B` on an exploration step, if it is a
  candidate (active)."""
  B = candidates.shape[0]
  explore_every = config.explore_every
  if not (explore_every > 0 and policy in ("current", "lagged")):
    return jnp.zeros((B,), bool)
  first = (state.step // explore_every) % B
  return (jnp.arange(B) == first) & (state.step % explore_every == 0) & candidates


def _confident_prefix(config: PlannerConfig, top1, drafted):
  """`[B]` int32, leading drafted positions whose top-1 probability is >= T."""
  ok = drafted & (jnp.asarray(top1, jnp.float32) >= config.confidence_threshold)
  return jnp.sum(jnp.cumprod(ok, axis=1), axis=1, dtype=jnp.int32)


def _keep_drafting(config: PlannerConfig, state: PlannerState, probs, drafted, depth, *,
                   active, top1=None, slots=None) -> jax.Array:
  del state, slots
  K = jnp.shape(probs)[1]
  drafted = jnp.asarray(drafted) & (jnp.arange(K)[None] < depth)  # nothing deeper read
  active = jnp.asarray(active)
  column = jnp.take(drafted, jnp.clip(depth - 1, 0, K - 1), axis=1)
  if config.draft_stop == "confidence":
    if top1 is None:
      raise ValueError("top1: required by the confidence stop, got None")
    alive = active & (_confident_prefix(config, jnp.where(drafted, top1, 0.0), drafted) >= depth)
    return active & column & jnp.any(alive)
  return active & column


def _plan(config: PlannerConfig, policy: str, state: PlannerState,
          probs: jax.typing.ArrayLike, cost: CostModel, *,
          active: jax.typing.ArrayLike | None = None,
          sound: jax.typing.ArrayLike | None = None,
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
  active = jnp.ones((B,), bool) if active is None else jnp.asarray(active)
  _checks.shape("active", active, (B,), "B")
  _checks.boolean("active", active)
  drafting = jnp.asarray(drafting)
  if drafting.ndim:
    _checks.shape("drafting", drafting, (B,), "B")
  _checks.boolean("drafting", drafting)
  drafting = jnp.broadcast_to(drafting, (B,))
  explored = _explored_slots(config, policy, state, active)
  if sound is not None:
    sound = jnp.asarray(sound)
    _checks.shape("sound", sound, (B,), "B")
    _checks.boolean("sound", sound)
    explored = explored & sound
  drafted_slots = active & drafting  # reported in the plan (before `sound`)
  # R counts every active slot: each verifies its own token, whether it drafted or not.
  R = jnp.sum(active, dtype=jnp.int32)
  if sound is not None:
    active = active & sound  # an unsound slot is a target-only slot this step
  planned = active & drafting  # the active slots whose drafts the plan may verify
  d = jnp.sum(planned, dtype=jnp.int32)
  surv = survival(probs)
  next_budget = state.budget
  if drafted is not None:
    drafted = jnp.asarray(drafted)
    _checks.shape("drafted", drafted, (B, K), "BK")
    _checks.boolean("drafted", drafted)
  if policy in ("current", "lagged"):
    if drafted is None:
      check_cost_table(cost, B, K)
    usable = planned[:, None] if drafted is None else planned[:, None] & drafted
    # Positions never drafted, and slots that did not draft, are ranked -1: no budget,
    # no verification. Every active slot still verifies its one token.
    ranking = _rank(jnp.where(usable, _ranked_survival(surv, active), -1.0))
    optimal = _budget(ranking, cost, R, K, num_drafting=d)
    budget = state.budget if policy == "lagged" else optimal
    mask = _allocation(ranking, budget, B, K)
    if policy == "lagged":  # a step that did not draft has nothing to plan from
      next_budget = jnp.where(jnp.any(drafting), optimal, state.budget)
  else:
    budget = jnp.asarray(B * K if policy == "fixed" else 0, jnp.int32)
    mask = allocate(surv, budget, active=active)
    if config.draft_stop == "confidence" and policy == "fixed":
      # confstop: every active request verifies clip(L, 1, K) drafts, L the longest
      # confident prefix in the batch.
      if top1 is None:
        raise ValueError("top1: required by the confidence stop, got None")
      seen = jnp.ones((B, K), bool) if drafted is None else drafted
      longest = jnp.max(jnp.where(active, _confident_prefix(config, top1, seen), 0))
      count = jnp.clip(longest, 1, K)
      mask = active[:, None] & (jnp.arange(K)[None] < count)
      budget = jnp.sum(mask & seen, dtype=jnp.int32)
  explored = explored & active & drafting
  mask = (mask | explored[:, None]) & drafting[:, None]
  if drafted is not None:  # verify only what was drafted (a prefix per slot)
    mask = mask & drafted
  plan_ = Plan(num_verified=jnp.sum(mask, axis=-1, dtype=jnp.int32), mask=mask,
               budget=jnp.minimum(budget, B * K), explored=explored,
               drafting=drafted_slots)
  return plan_, state._replace(budget=next_budget, step=state.step + 1)


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
    config: the hyper-parameters (`PlannerConfig()` when None).
    policy: one of `POLICIES` (see the module docstring); use `exact_policy` to pick.
    **overrides: `PlannerConfig` fields replacing those of `config`.

  Returns:
    `Planner(init, plan, policy, config, keep_drafting, stop)` with
    * `init(num_slots=None) -> state`.
    * `plan(state, probs [B,K], cost, *, active=None, sound=None, drafting=True,
      drafted=None, top1=None) -> (Plan, state)`; `drafting` is `[]` (every slot) or
      `[B]` bool (the slots that drafted).
    * `keep_drafting(state, probs, drafted, depth, *, active, top1=None, slots=None)
      -> [B] bool`: "confidence": every active request continues while some request's
      drafts so far all have top-1 >= T (`top1 [B, K]` required); "none": every drafting
      request continues.

  Input checks of `plan`: `cost` must be a `CostModel` (ValueError otherwise); a
  `cost.verify_ms` shorter than `B (K + 1) + 1` entries warns at trace time (budgets
  needing more tokens are never chosen); concrete `probs` outside [0, 1] raise a
  ValueError. Under `jax.jit` the values of `probs` are unknown: they are clipped to
  [0, 1] (a probability above 1 counts as certain acceptance of that position) and NaN
  ranks as 0 (never verified, nor anything after it).

  Example:
    >>> planner = make_planner(policy=exact_policy(drafter_kind="parallel", greedy=False))
    >>> pstate = planner.init()
    >>> plan, pstate = planner.plan(pstate, est.predict(estate, features), cost,
    ...                             active=active)
  """
  config = dataclasses.replace(config or PlannerConfig(), **overrides)
  if policy not in POLICIES:
    raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
  return Planner(init=functools.partial(_init, config),
                 plan=functools.partial(_plan, config, policy), policy=policy,
                 config=config, keep_drafting=functools.partial(_keep_drafting, config),
                 stop=config.draft_stop)
