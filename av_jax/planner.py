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

Skip-drafting gate (`skip_unprofitable_drafts`, docs/algorithm.md section 8): per slot.
`draft_slots(state, active)` says which slots draft this step: those whose drafts pay (a
smoothed margin over their drafting steps, `pay_smoothing`), plus, on a re-check step, a
round-robin group of `recheck_slots` slots; `plan` then re-evaluates every slot that
drafted.
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
                              allocate, check_cost_table, check_probabilities, survival)

POLICIES = ("current", "lagged", "fixed", "none")
# Drafting stops (docs/algorithm.md section 10): "none" drafts all K; "survival" is
# survival stop (`av_jax.stopping`, adaptive policies); "confidence" is `confstop:T`.
STOPS = ("none", "survival", "confidence")
# The gate's relative pay margin is clipped to [-1, _MAX_MARGIN] before smoothing.
_MAX_MARGIN = 4.0
DRAFTER_KINDS = ("autoregressive", "parallel")

# `PlannerState.pay_margin` of a slot gated off at admission on the batch's view and not
# yet judged on its own drafts (below the clip range, so no judgement produces it): it
# reopens as soon as some slot's drafts are found to pay (`_gate_update`).
WAITING = -2.0

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
  recheck_every: int | None = None  # re-check slots whose drafts did not pay every this
                                    # many steps (a multiple of explore_every); None:
                                    # 4 x explore_every
  max_recheck_every: int | None = None  # re-checks that find nothing back off (doubling)
                                        # up to this interval; None: 8 x recheck_every
  recheck_slots: int | None = None  # slots a re-check step re-checks (round-robin);
                                    # None: max(1, ceil(B / 8))
  pay_smoothing: float = 0.3  # weight of the newest step in a drafting slot's smoothed
                              # pay margin (1: the last step alone decides)
  outcome_check: bool = False  # a slot judged closed on its predicted gain reopens where
                               # its labelled drafts say drafting pays (`observe`); off by
                               # default: 0.96-1.01x wall on this CPU (BENCHMARKS.md)
  draft_stop: str = "none"       # one of STOPS: when an autoregressive drafter stops
  stop_margin: float = 0.5       # survival stop: tau = margin * smallest admitted survival
  stop_min_depth: int = 1        # survival stop: every drafting request drafts this many
  stop_price_passes: bool = True  # survival stop: cap the batch's depth at the depth whose
                                  # passes paid at the previous step (pass pricing)
  stop_tau: bool = True          # survival stop: requests below tau stop (False: only the
                                 # depth cap of pass pricing and min_depth stop drafting)
  stop_extrapolate: bool = True  # survival stop: the next step's budget, tau and cap count
                                 # undrafted depths at their extrapolated survivals
                                 # (`stopping.extrapolate`); False: as not drafted
  stop_deep_explore_every: int = 4  # pass pricing: an exploring slot drafts all K on every
                                    # this many exploration steps, one past the cap on
                                    # the others
  confidence_threshold: float = 0.5  # confstop: T on the drafts' top-1 probability

  def __post_init__(self):
    if self.explore_every < 0:
      raise ValueError(f"explore_every: expected >= 0, got {self.explore_every}")
    for name in ("recheck_every", "max_recheck_every", "recheck_slots"):
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                or value < 1):
        raise ValueError(f"{name}: expected None or an integer >= 1, got {value!r}")
    a = self.pay_smoothing
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 < a <= 1.0:
      raise ValueError(f"pay_smoothing: expected a number in (0, 1], got {a!r}")
    if self.draft_stop not in STOPS:
      raise ValueError(f"draft_stop: expected one of {STOPS}, got {self.draft_stop!r}")
    stopping.check_params(stopping.StopParams(self.stop_margin, self.stop_min_depth))
    if not isinstance(self.stop_tau, bool):
      raise ValueError(f"stop_tau: expected a bool, got {self.stop_tau!r}")
    if not isinstance(self.stop_extrapolate, bool):
      raise ValueError(f"stop_extrapolate: expected a bool, got {self.stop_extrapolate!r}")
    if not isinstance(self.stop_price_passes, bool):
      raise ValueError(f"stop_price_passes: expected a bool, got {self.stop_price_passes!r}")
    d = self.stop_deep_explore_every
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
      raise ValueError(f"stop_deep_explore_every: expected an integer >= 1, got {d!r}")
    t = self.confidence_threshold
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0:
      raise ValueError(f"confidence_threshold: expected a number in [0, 1], got {t!r}")


class PlannerState(NamedTuple):
  """The planner's state; fields after `tau` left None (a hand-built state) read as
  `init()`'s values."""
  budget: jax.Array  # [] int32, budget for the next step (used by the lagged policy)
  step: jax.Array    # [] int32, steps planned so far (drives round-robin exploration)
  # [] bool, whether drafting paid for some slot at its last drafting step (the batch
  # view of `slot_pays`); always True unless the planner is gated.
  drafting_pays: jax.Array | bool = True
  # [] float32, survival stop's threshold for this step, from earlier steps only
  # (`av_jax.stopping`); 0 (nothing stops) until a step has planned.
  tau: jax.Array | float = 0.0
  # [B] bool, whether drafting paid for the slot at its last drafting step (True
  # initially); [1] for a state built by `init()` without `num_slots`: one verdict for
  # the whole batch (the batch gate). Always True unless the planner is gated.
  slot_pays: jax.Array | None = None
  # [] int32, current re-check interval: `recheck_every`, doubled (up to
  # `max_recheck_every`) after each re-check step on which no slot's drafts paid.
  recheck_interval: jax.Array | None = None
  # [] int32, step count of the next re-check step (the first exploration step at or
  # after it re-checks).
  next_recheck: jax.Array | None = None
  # [] int32, re-check steps so far (advances the round-robin re-check group).
  recheck_count: jax.Array | None = None
  # [B] (or [1]) float32, each slot's smoothed relative pay margin (> 0: its drafts pay;
  # `slot_pays` is its sign); +inf until the slot is first judged, `WAITING` for a slot
  # gated off at admission and not judged since (never NaN).
  pay_margin: jax.Array | None = None
  # [] int32, survival stop's batch depth cap for this step (pass pricing,
  # `stopping.next_depth_cap`), from earlier steps only; 0: no cap.
  depth_cap: jax.Array | None = None
  # The outcome check (`observe`), [B] (or [1]): for a slot the gate judged on this
  # step's plan and left closed, the drafted positions (within the depth cap) that
  # verification labels, and the extra cost of drafting and verifying that many for every
  # active slot, in target-only steps' token units; 0 where nothing is pending. Set by
  # `plan`, read and cleared by `observe` once the step's labels are known.
  check_depth: jax.Array | None = None
  check_extra: jax.Array | None = None


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
  should_draft: Callable[[PlannerState], jax.Array]  # batch view: [] bool, any slot drafts
  config: PlannerConfig
  gated: bool  # `draft_slots` can leave a slot out (skip_unprofitable_drafts took effect)
  # (state, probs [B,K], drafted [B,K], depth, *, active, top1, slots) -> [B] bool: whether
  # each request drafts depth `depth + 1` (reads depths 1..depth only); see `make_planner`.
  keep_drafting: Callable[..., jax.Array] | None = None
  stop: str = "none"  # the drafting stop in effect (STOPS)
  # (state, active [B] bool) -> [B] bool: which slots draft this step.
  draft_slots: Callable[..., jax.Array] | None = None
  # (state, accepted [B,K], labeled [B,K]) -> state: the gate's outcome check (`plan`'s
  # pending judgements against the labels verification produced); identity when not gated.
  observe: Callable[..., PlannerState] | None = None


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
      * `skip_unprofitable_drafts`: gate drafting per slot (policies "current" and
        "lagged" with exploration only; docs/algorithm.md section 8). A slot drafts while
        its drafts pay (`PlannerState.slot_pays`, True initially): its smoothed pay
        margin (`PlannerState.pay_margin`, see `pay_smoothing`) is positive, i.e. its
        expected accepted drafts outweigh its share of the extra cost of drafting,
        measured in tokens of a target-only step. A slot whose drafts did
        not pay drafts again on a re-check step, when it is in that step's round-robin
        group of `recheck_slots` slots. Re-check steps are exploration steps at least
        `recheck_interval` steps apart; the interval doubles (up to
        `max_recheck_every`) after a re-check on which no drafting slot paid and resets
        to `recheck_every` when one did. Every decision reads earlier steps and the step
        counter only, so it is as exact as the lagged budget. The caller drafts the
        slots `draft_slots` names and passes them to `plan` as `drafting`.
      * `recheck_every`: the re-check interval; a multiple of `explore_every`, default
        4 x `explore_every`. `max_recheck_every`: its cap under back-off, a multiple of
        `explore_every` >= `recheck_every`, default 8 x `recheck_every`.
      * `pay_smoothing`: weight a in (0, 1] of the newest step in a drafting slot's
        margin, `(1 - a) margin + a m`; a slot judged first, or re-checked after its
        drafts did not pay, takes the step's margin m alone; 1 is the single-step rule.
      * `recheck_slots`: slots per re-check (E), default max(1, ceil(B / 8)); the groups
        are consecutive windows of E active slots (in slot order), so all R active slots
        are re-checked within ceil(R / E) re-checks.
    policy: one of `POLICIES` (see the module docstring); use `exact_policy` to pick.
    **overrides: `PlannerConfig` fields replacing those of `config`.

  Returns:
    `Planner(init, plan, policy, should_draft, config, gated, keep_drafting, stop,
    draft_slots)` with
    * `init(num_slots=None) -> state`: with `num_slots` B, `slot_pays` is `[B]` (one
      verdict per slot); without it `[1]`, one verdict for the whole batch (the batch
      gate: every slot drafts or none does, and a re-check re-checks every slot).
    * `draft_slots(state, active [B] bool) -> [B] bool`: the slots that draft this step
      (`active` when not gated).
    * `should_draft(state) -> [] bool`: the batch view, whether any slot drafts (it
      ignores which slots are active).
    * `plan(state, probs [B,K], cost, *, active=None, sound=None, drafting=True,
      drafted=None, top1=None) -> (Plan, state)`; `drafting` is `[]` (every slot) or
      `[B]` bool (the slots that drafted, normally `draft_slots`'s answer).

  Input checks of `plan`: `cost` must be a `CostModel` (ValueError otherwise); a
  `cost.verify_ms` shorter than `B (K + 1) + 1` entries warns at trace time (budgets
  needing more tokens are never chosen); concrete `probs` outside [0, 1] raise a
  ValueError. Under `jax.jit` the values of `probs` are unknown: they are clipped to
  [0, 1] (a probability above 1 counts as certain acceptance of that position) and NaN
  ranks as 0 (never verified, nor anything after it).

  Example:
    >>> planner = make_planner(policy=exact_policy(drafter_kind="parallel", greedy=False))
    >>> pstate = planner.init(B)
    >>> drafting = planner.draft_slots(pstate, active)      # before drafting
    >>> plan, pstate = planner.plan(pstate, est.predict(estate, features), cost,
    ...                             active=active, drafting=drafting)
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
  max_recheck_every = config.max_recheck_every
  if max_recheck_every is None:
    max_recheck_every = 8 * recheck_every
  if gated and recheck_every % explore_every:
    raise ValueError(f"recheck_every: expected a positive multiple of explore_every="
                     f"{explore_every}, got {recheck_every}")
  if gated and (max_recheck_every < recheck_every or max_recheck_every % explore_every):
    raise ValueError(f"max_recheck_every: expected a multiple of explore_every="
                     f"{explore_every} and >= recheck_every={recheck_every}, got "
                     f"{max_recheck_every}")
  stop = config.draft_stop
  if stop == "survival" and not adaptive:
    raise ValueError(f"draft_stop: 'survival' needs an adaptive policy, got {policy!r}")
  early = stopping.make_early_stop(margin=config.stop_margin,
                                   min_depth=config.stop_min_depth)

  def init(num_slots: int | None = None) -> PlannerState:
    if num_slots is not None and (isinstance(num_slots, bool)
                                  or not isinstance(num_slots, int) or num_slots < 1):
      raise ValueError(f"num_slots: expected None or an integer >= 1, got {num_slots!r}")
    initial = config.initial_budget
    budget = _ALL if initial is None else int(initial)
    int32 = lambda x: jnp.asarray(x, jnp.int32)
    return PlannerState(budget=int32(budget), step=int32(0), drafting_pays=jnp.asarray(True),
                        tau=jnp.zeros((), jnp.float32),
                        slot_pays=jnp.ones((1 if num_slots is None else num_slots,), bool),
                        recheck_interval=int32(recheck_every),
                        next_recheck=int32(recheck_every), recheck_count=int32(0),
                        pay_margin=jnp.full((1 if num_slots is None else num_slots,),
                                            jnp.inf, jnp.float32),
                        depth_cap=int32(0),
                        check_depth=jnp.zeros((1 if num_slots is None else num_slots,),
                                              jnp.int32),
                        check_extra=jnp.zeros((1 if num_slots is None else num_slots,),
                                              jnp.float32))

  def complete(state: PlannerState) -> PlannerState:
    """`state` with None fields (a hand-built state) as `init()` sets them."""
    fresh = init()
    state = state._replace(**{k: getattr(fresh, k) for k in state._fields
                              if getattr(state, k) is None})
    pays = jnp.reshape(jnp.asarray(state.slot_pays, bool), (-1,))
    margin = jnp.reshape(jnp.asarray(state.pay_margin, jnp.float32), (-1,))
    if margin.shape != pays.shape:  # a hand-built verdict without a margin: no evidence
      margin = jnp.full(pays.shape, jnp.inf, jnp.float32)
    depth = jnp.reshape(jnp.asarray(state.check_depth, jnp.int32), (-1,))
    extra = jnp.reshape(jnp.asarray(state.check_extra, jnp.float32), (-1,))
    if depth.shape != pays.shape or extra.shape != pays.shape:  # nothing pending
      depth, extra = jnp.zeros(pays.shape, jnp.int32), jnp.zeros(pays.shape, jnp.float32)
    return state._replace(slot_pays=pays, pay_margin=margin, check_depth=depth,
                          check_extra=extra)

  def verdicts(state: PlannerState, B: int) -> jax.Array:
    """`[B]` or `[1]` bool, `state.slot_pays` checked against B."""
    pays = state.slot_pays
    if pays.shape[0] not in (1, B):
      raise ValueError(f"state.slot_pays: expected shape (1,) or (B,) = ({B},), got "
                       f"{pays.shape}; build the state with init(num_slots=B)")
    return pays

  def rechecking(state: PlannerState) -> jax.Array:
    """`[] bool`: whether this step is a re-check step (an exploration step)."""
    if not gated:
      return jnp.asarray(False)
    return (state.step >= state.next_recheck) & (state.step % explore_every == 0)

  def recheck_group(state: PlannerState, active: jax.Array) -> jax.Array:
    """`[B] bool`, the active slots this step re-checks: on a re-check step, window
    number `recheck_count` of E consecutive active slots (cyclically, in slot order);
    every active slot with a `[1]` state."""
    B = active.shape[0]
    group = active & rechecking(state)
    if verdicts(state, B).shape[0] == 1 and B > 1:
      return group
    E = config.recheck_slots or max(1, -(-B // 8))
    rank = jnp.cumsum(active, dtype=jnp.int32) - 1  # among active slots
    R = jnp.maximum(jnp.sum(active, dtype=jnp.int32), 1)
    start = (state.recheck_count * E) % R
    return group & ((rank - start) % R < E)

  def draft_slots(state: PlannerState, active: jax.typing.ArrayLike) -> jax.Array:
    """`[B] bool`: which slots draft this step, from earlier steps and the step counter.

    Not gated: `active`. Gated: `active & (slot_pays | re-checked)`.
    """
    active = jnp.asarray(active)
    _checks.rank("active", active, 1, "B")
    _checks.boolean("active", active)
    if not gated:
      return active
    state = complete(state)
    return active & (verdicts(state, active.shape[0]) | recheck_group(state, active))

  def exploring(state: PlannerState) -> jax.Array:
    if explore_every > 0 and adaptive:
      return state.step % explore_every == 0
    return jnp.asarray(False)

  def explored_slots(state: PlannerState, candidates: jax.Array,
                     slots: jax.Array | None = None) -> jax.Array:
    """`[rows]` bool, the slot that verifies all K this step.

    Ungated: slot `(step // explore_every) % B` if it is a candidate (active). Gated:
    the first candidate (a drafting slot) at or after that slot, cyclically, so that
    whenever some slot drafts on an exploration step one of them explores. `slots`
    names each row's slot (rows are slots 0..B-1 when None).
    """
    rows = candidates.shape[0]
    if not (explore_every > 0 and adaptive):
      return jnp.zeros((rows,), bool)
    if slots is None:
      B, ids = rows, jnp.arange(rows)
    else:
      B, ids = int(state.slot_pays.shape[0]), jnp.asarray(slots)
      if B == 1 and rows > 1:
        raise ValueError("slots: the slot count is unknown to a state built without "
                         "num_slots; build it with init(num_slots=B)")
    first = (state.step // explore_every) % B
    if not gated:
      return (ids == first) & exploring(state) & candidates
    key = jnp.where(candidates, (ids - first) % B, B)
    return candidates & (key == jnp.min(key)) & exploring(state)

  def confident_prefix(top1, drafted):
    """`[B]` int32, leading drafted positions whose top-1 probability is >= T."""
    ok = drafted & (jnp.asarray(top1, jnp.float32) >= config.confidence_threshold)
    return jnp.sum(jnp.cumprod(ok, axis=1), axis=1, dtype=jnp.int32)

  def keep_drafting(state: PlannerState, probs, drafted, depth, *, active,
                    top1=None, slots=None) -> jax.Array:
    """Whether each request drafts depth `depth + 1`, from depths 1..`depth` only.

    "survival": survival stop with this step's `tau` (from earlier steps) and the
    exploring slot always continuing. "confidence": batch level, every active request
    continues while some request's drafts so far all have top-1 >= T (`top1 [B, K]`
    required). "none": every drafting request continues.

    Rows may be a gathered subset of the slots: `slots [E] int32` names each row's slot
    (the exploring slot is then found by slot identity); with a gated planner `active`
    must then be the rows that draft. None: row b is slot b.
    """
    probs = jnp.asarray(probs, jnp.float32)
    B, K = probs.shape
    drafted = jnp.asarray(drafted) & (jnp.arange(K)[None] < depth)  # nothing deeper read
    active = jnp.asarray(active)
    if slots is not None:
      slots = jnp.asarray(slots)
      _checks.shape("slots", slots, (B,), "E")
      _checks.integer("slots", slots)
    column = jnp.take(drafted, jnp.clip(depth - 1, 0, K - 1), axis=1)
    if stop == "survival":
      surv = jnp.where(drafted, survival(probs), 0.0)
      state = complete(state)
      explored = explored_slots(state, active, slots)
      cap = jnp.asarray(state.depth_cap if config.stop_price_passes else 0, jnp.int32)
      # Exploration under a cap: all K on every `stop_deep_explore_every`-th exploration
      # step (labels at every depth), one past the cap on the others (labels where the
      # next pass would be priced); from the step counter and the cap only.
      deep = (state.step // max(explore_every, 1)) % config.stop_deep_explore_every == 0
      explore_cap = jnp.where((cap > 0) & ~deep, cap + 1, 0).astype(jnp.int32)
      tau = jnp.asarray(state.tau if config.stop_tau else 0.0, jnp.float32)
      return early.keep_drafting(stopping.StopState(tau=tau, cap=cap, explore_cap=explore_cap),
                                 surv, drafted, depth, explored, active=active)
    if stop == "confidence":
      if top1 is None:
        raise ValueError("top1: required by the confidence stop, got None")
      alive = active & (confident_prefix(jnp.where(drafted, top1, 0.0), drafted) >= depth)
      return active & column & jnp.any(alive)
    return active & column

  def should_draft(state: PlannerState) -> jax.Array:
    """The batch view of `draft_slots`: whether any slot drafts this step (always,
    unless the planner is gated, no slot's drafts paid at its last drafting step, and
    this is not a re-check step). It ignores which slots are active."""
    if not gated:
      return jnp.asarray(True)
    state = complete(state)
    return jnp.any(state.slot_pays) | rechecking(state)

  def plan(state: PlannerState, probs: jax.typing.ArrayLike, cost: CostModel, *,
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
    state = complete(state)
    pays_before = verdicts(state, B)
    if active is None:
      active = jnp.ones((B,), bool)
    active = jnp.asarray(active)
    _checks.shape("active", active, (B,), "B")
    _checks.boolean("active", active)
    drafting = jnp.asarray(drafting)
    if drafting.ndim:
      _checks.shape("drafting", drafting, (B,), "B")
    _checks.boolean("drafting", drafting)
    drafting = jnp.broadcast_to(drafting, (B,))
    # Exploration candidates use `active` before `sound` (this step's draft logits), as
    # `keep_drafting` sees them while drafting.
    explored = explored_slots(state, active & drafting if gated else active)
    if sound is not None:
      sound = jnp.asarray(sound)
      _checks.shape("sound", sound, (B,), "B")
      _checks.boolean("sound", sound)
      explored = explored & sound
    drafted_slots = active & drafting  # reported in the plan (before `sound`)
    # R counts every active slot: each verifies its own token, whether it drafted or not
    # (a slot that did not draft, or whose drafts are unsound, is a target-only slot this
    # step and its token still takes a place in the target pass).
    live = active
    R = jnp.sum(live, dtype=jnp.int32)
    if sound is not None:
      active = active & sound  # an unsound slot is a target-only slot this step
    planned = active & drafting  # D: active slots whose drafts the plan may verify
    # Whether this step drafted at all: the lagged budget and tau learn only from those.
    any_drafted = jnp.any(drafting)
    d = jnp.sum(planned, dtype=jnp.int32)
    surv = survival(probs)
    next_budget = state.budget
    tau = state.tau
    depth_cap = state.depth_cap
    if drafted is not None:
      drafted = jnp.asarray(drafted)
      _checks.shape("drafted", drafted, (B, K), "BK")
      _checks.boolean("drafted", drafted)
    if policy in ("current", "lagged"):
      if drafted is None:
        check_cost_table(cost, B, K)
      usable = planned[:, None] if drafted is None else planned[:, None] & drafted
      # Positions never drafted, and slots that did not draft, are ranked -1: no budget,
      # no verification; the next budget (and tau) describe the drafted positions only
      # (docs/algorithm.md 10). Every active slot still verifies its one token.
      ranking = _rank(jnp.where(usable, _ranked_survival(surv, active), -1.0))
      optimal = _budget(ranking, cost, R, K, num_drafting=d)
      budget = state.budget if policy == "lagged" else optimal
      mask = _allocation(ranking, budget, B, K)
      # The gate judges each slot on the positions the best plan for this step's drafts
      # verifies, not the lagged budget's: a budget from a step on which fewer slots
      # drafted starves some slots of this one (0 positions), and a slot judged on no
      # verified position reads as not paying (margin -1) and closes although its drafts
      # are good (modelled H200 EAGLE B = 8: a re-check of all 8 slots with the budget of
      # a lone-slot step closed 3 of them).
      judge = mask if policy == "current" else _allocation(ranking, optimal, B, K)
      if policy == "lagged":  # a step that did not draft has nothing to plan from
        next_budget = jnp.where(any_drafted, optimal, state.budget)
      if stop == "survival" and drafted is not None:
        # The NEXT step's budget, tau and depth cap, from this step only (survivals of
        # undrafted depths extrapolated: `stopping.plan_next`, docs/algorithm.md 10.8).
        nxt = stopping.plan_next(
            stopping.StopState(tau=jnp.asarray(tau, jnp.float32), cap=state.depth_cap), surv,
            drafted & planned[:, None], cost, margin=config.stop_margin, active=live,
            num_drafting=d, probe=exploring(state) | (explore_every <= 0),
            price=config.stop_price_passes, fill=config.stop_extrapolate)
        if policy == "lagged":
          next_budget = jnp.where(any_drafted, nxt.budget, state.budget)
        tau = jnp.where(any_drafted, nxt.stop.tau, tau)
        depth_cap = jnp.where(any_drafted, nxt.stop.cap, depth_cap)
    else:
      budget = jnp.asarray(B * K if policy == "fixed" else 0, jnp.int32)
      mask = allocate(surv, budget, active=active)
      judge = mask
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
    explored = explored & active
    new_state = state._replace(budget=next_budget, step=state.step + 1, tau=tau,
                               drafting_pays=jnp.asarray(state.drafting_pays),
                               depth_cap=jnp.asarray(depth_cap, jnp.int32))
    if gated:
      new_state = _gate_update(state, new_state, pays_before, planned, judge, surv, cost,
                               R=R, d=d, drafted=drafted, live=live)
    mask = (mask | explored[:, None]) & drafting[:, None]
    if drafted is not None:  # verify only what was drafted (a prefix per slot)
      mask = mask & drafted
    if gated and config.outcome_check:
      new_state = _check_pending(new_state, planned, mask, drafted, cost, R=R)
    explored = explored & drafting
    plan_ = Plan(num_verified=jnp.sum(mask, axis=-1, dtype=jnp.int32), mask=mask,
                 budget=jnp.minimum(budget, B * K), explored=explored,
                 drafting=drafted_slots)
    return plan_, new_state

  def _check_pending(new_state, planned, mask, drafted, cost, *, R):
    """The outcome check's pending judgements (`observe`): a slot judged on this step's
    plan whose own margin closed it (< 0; not one closed with its group) is judged again
    once its labels are known, on the counterfactual step in which every active slot
    drafts like it and verifies its n drafted positions within the depth cap that
    verification labels (n > 0). Stored: n and that step's extra cost over a target-only
    step in token units, `(draft_share_cost(R, f) + verify_cost(R + R n)) / verify_cost(R)
    - 1`, f its drafted depth share (as `_gate_update` prices it)."""
    B, K = mask.shape
    pays = new_state.slot_pays
    if pays.shape[0] != B:  # the batch gate: one verdict for the batch, nothing per slot
      return new_state._replace(check_depth=jnp.zeros(pays.shape, jnp.int32),
                                check_extra=jnp.zeros(pays.shape, jnp.float32))
    seen = jnp.ones((B, K), bool) if drafted is None else jnp.asarray(drafted)
    own = jnp.float32(1.0)
    if drafted is not None:
      if stop == "survival" and config.stop_price_passes:  # judged at the cap
        cap = new_state.depth_cap
        seen = seen & (jnp.arange(K)[None] < jnp.where(cap > 0, cap, K))
      depth = jnp.sum(seen, axis=1, dtype=jnp.int32)
      own = jnp.where(depth > 0, depth / K, 1.0).astype(jnp.float32)
    n = jnp.sum(mask & seen, axis=1, dtype=jnp.int32)  # verified, drafted, within the cap
    pending = planned & ~pays & (new_state.pay_margin < 0) & (n > 0)
    base = cost.verify_cost(R)
    tokens = jnp.minimum(R + R * n, cost.verify_ms.shape[0] - 1)
    extra = (cost.draft_share_cost(R, own) + cost.verify_cost(tokens)) / jnp.maximum(
        base, 1e-30) - 1.0
    return new_state._replace(check_depth=jnp.where(pending, n, 0).astype(jnp.int32),
                              check_extra=jnp.where(pending, extra, 0.0).astype(jnp.float32))

  def observe(state: PlannerState, accepted: jax.typing.ArrayLike,
              labeled: jax.typing.ArrayLike) -> PlannerState:
    """The gate's outcome check: a slot `plan` judged closed on its predicted gain is
    judged again on what verification found, its accepted drafts among the n positions
    `plan` stored (`_check_pending`): realized margin `a / extra - 1`. Where that is > 0
    the slot reopens with it (it drafts at the next step and is judged there as a
    drafting slot, its margin smoothed from this one). A verdict judged on one step's
    predictions alone (a fresh request's first drafts scored 0.2 and accepted 8 of 8 at
    EAGLE B = 2) otherwise waited out a doubled re-check interval while its drafts paid.
    The labels are this step's outcome, so every decision still reads earlier steps only
    (rule 2). Clears what was pending. Identity for a planner that is not gated, or with
    `PlannerConfig.outcome_check` off."""
    if not (gated and config.outcome_check):
      return state
    state = complete(state)
    accepted = jnp.asarray(accepted, bool)
    labeled = jnp.asarray(labeled, bool)
    _checks.rank("accepted", accepted, 2, "BK")
    _checks.shape("labeled", labeled, accepted.shape, "BK")
    n, extra = state.check_depth, state.check_extra
    if n.shape[0] != accepted.shape[0]:  # the batch gate: nothing per slot is pending
      return state
    got = jnp.sum(jnp.cumprod((accepted & labeled).astype(jnp.int32), axis=1), axis=1)
    got = jnp.minimum(got, n).astype(jnp.float32)
    m = jnp.where(extra > 0, got / jnp.maximum(extra, 1e-30) - 1.0, _MAX_MARGIN)
    m = jnp.clip(m, -1.0, _MAX_MARGIN).astype(jnp.float32)
    reopen = (n > 0) & (m > 0)
    pays = state.slot_pays | reopen
    return state._replace(slot_pays=pays, drafting_pays=jnp.any(pays),
                          pay_margin=jnp.where(reopen, m, state.pay_margin),
                          check_depth=jnp.zeros_like(n), check_extra=jnp.zeros_like(extra))

  def _gate_update(state, new_state, pays_before, planned, mask, surv, cost, *, R, d,
                   drafted=None, live=None):
    """The gate's state after a step: per-slot verdicts and the re-check back-off.

    Slot b of D (active, drafted) is judged on the counterfactual step in which every
    active slot drafts and verifies like b: relative pay margin
    m_b = g_b verify_cost(R) / (C_b - verify_cost(R)) - 1, with g_b the expected accepted
    drafts of b's n_b verified positions, C_b = draft_share_cost(R, f_b) + verify_cost(R + R n_b)
    and f_b = (b's drafted depth) / K the share of the drafter passes that ran (1 unless a
    drafting stop ended b's drafting early); exploration's extra positions are not part
    of n_b and g_b (docs/algorithm.md section 8.1). m_b > 0 iff that step earns more
    tokens per unit cost than a target-only step ((R + R g_b) / C_b > R / verify_cost(R)).
    The slot's smoothed margin is `(1 - a) margin + a m_b` while it was drafting on its
    verdict, and m_b alone when it is judged first or on a re-check after its drafts did
    not pay (a = `pay_smoothing`); it pays while the smoothed margin is > 0, so one
    unlucky step does not close the gate on a slot whose drafts pay on average, and a
    re-check opens it on fresh evidence. A `[1]` state judges D as one slot on the step
    that ran (the batch rule (R + sum_b g_b) / C > rho, C = draft_share_cost(d, f) +
    verify_cost(R + n), f from the deepest drafted depth).
    """
    K = mask.shape[1]
    if drafted is not None and stop == "survival" and config.stop_price_passes:
      # Judged at the depth it drafts at while open: the next step's pass-pricing cap.
      # Depths past it were drafted for labels (an exploring or re-checked slot runs one
      # past the cap, or all K on a deep exploration step); charging those passes and
      # counting their positions judged a re-check on exploration's cost (EAGLE B = 4 on
      # this CPU: lone re-checks at depth 8 under a cap of 2-3 closed at margins -0.3 to
      # -0.9 while drafting at the cap paid).
      cap = new_state.depth_cap
      within = jnp.arange(K)[None] < jnp.where(cap > 0, cap, K)
      mask, drafted = mask & within, jnp.asarray(drafted) & within
    n = jnp.sum(mask, dtype=jnp.int32)  # the plan before exploration
    g = jnp.sum(jnp.where(mask, surv, 0.0), axis=1)  # [B]
    base = cost.verify_cost(R)
    share = own = jnp.float32(1.0)
    if drafted is not None:  # an autoregressive drafter stopped early: fewer passes ran
      depth = jnp.sum(drafted, axis=1)                                    # [B]
      deepest = jnp.max(jnp.where(planned, depth, 0))
      share = jnp.where(deepest > 0, deepest / K, 1.0).astype(jnp.float32)
      own = jnp.where(depth > 0, depth / K, 1.0).astype(jnp.float32)     # [B]
    if pays_before.shape[0] == 1 and planned.shape[0] > 1:
      # The batch rule: this step as it ran, its gain against its extra cost.
      step_cost = cost.draft_share_cost(d, share) + cost.verify_cost(R + n)
      extra = R * (step_cost - base)  # the drafting step's extra, in token-cost units
      value = (jnp.sum(jnp.where(mask, surv, 0.0)) * base)[None]
      judged = (d > 0)[None]
    else:
      # The counterfactual step: every active slot drafts and verifies like b (R drafting
      # rows, R n_b verified positions). Judged against the step that ran instead, a lone
      # re-checked slot would carry a whole drafter pass (for a weight-bound drafter,
      # what all R rows cost) and never reopen.
      n_b = jnp.sum(mask, axis=1, dtype=jnp.int32)                    # [B]
      tokens = jnp.minimum(R + R * n_b, cost.verify_ms.shape[0] - 1)
      step_cost = cost.draft_share_cost(R, own) + cost.verify_cost(tokens)  # [B]
      extra = R * (step_cost - base)
      value = g * R.astype(jnp.float32) * base
      judged = planned
    # Relative margin, clipped so one outlier step cannot dominate the average; a free
    # drafting step (extra <= 0) pays whatever it gains.
    m = jnp.where(extra > 0, value / jnp.maximum(extra, 1e-30) - 1.0, _MAX_MARGIN)
    m = jnp.clip(m, -1.0, _MAX_MARGIN).astype(jnp.float32)
    prior = state.pay_margin
    fresh = jnp.isinf(prior) | ~pays_before  # +inf: never judged
    a = jnp.float32(config.pay_smoothing)
    margin = jnp.where(judged, jnp.where(fresh, m, (1.0 - a) * prior + a * m), prior)
    slot_pays = jnp.where(judged, margin > 0, pays_before)
    if pays_before.shape[0] > 1 or planned.shape[0] == 1:
      # The group check. A slot is judged as if every active slot drafted like it, but
      # only the slots that pay draft: the drafter pass is shared by that group alone.
      # When the group of this step's drafting slots that pay does not pay as a group on
      # the step it would run (its gain against draft_share_cost(|P|, f) + verify_cost(R + n_P),
      # f from its deepest drafted depth), either it cannot grow into a group that pays
      # (it closes) or enough joinable slots (not judged on drafts of their own) try
      # drafting at the next step (judged afresh there), so a group that pays only
      # when more slots join it finds them (a lone re-checked slot under a weight-bound
      # drafter), and one that does not (math requests beside code requests on a
      # compute-bound device) closes.
      P = judged & slot_pays
      own_b = jnp.broadcast_to(own, P.shape)
      group_share = jnp.max(jnp.where(P, own_b, 0.0))
      n_P = jnp.sum(jnp.where(P, n_b, 0), dtype=jnp.int32)
      group_cost = (cost.draft_share_cost(jnp.sum(P, dtype=jnp.int32), group_share)
                    + cost.verify_cost(jnp.minimum(R + n_P, cost.verify_ms.shape[0] - 1)))
      # Each slot's gain as its smoothed margin says (the per-slot rule solved for g_b
      # at this step's costs), so one unlucky step does not close a group whose drafts
      # pay on average; this step's g_b where drafting was free.
      spent = step_cost - base
      g_smooth = jnp.where(spent > 0, (margin + 1.0) * spent / base, g)
      group_pays = (R + jnp.sum(jnp.where(P, g_smooth, 0.0))) * base > R * group_cost
      fails = jnp.any(P) & ~group_pays
      # The slots that could join: active, not drafting now, and without evidence of
      # their own that their drafts do not pay (a margin >= 0: never judged, or closed
      # with its group while its own drafts paid; or waiting since admission). A slot
      # judged not paying on its own drafts of this request (margin < 0) is left to its
      # re-check, so a lone re-checked slot does not make every such slot draft.
      joinable = live & ~planned & ~slot_pays & ((prior >= 0) | (prior == WAITING))
      # The group grows to the smallest size G that would pay if the joining slots drafted
      # like P's average slot (gain g_P / |P| and n_P / |P| positions each): the slots
      # that join are the first G - |P| joinable ones in slot order. Where no size up to
      # |P| + (joinable) pays the group closes now (a compute-bound drafter whose rows
      # cost alike: recruiting the batch costs a whole drafting step and cannot pay).
      size_P = jnp.sum(P, dtype=jnp.int32)
      per_g = jnp.sum(jnp.where(P, g_smooth, 0.0)) / jnp.maximum(size_P, 1)
      per_n = n_P.astype(jnp.float32) / jnp.maximum(size_P, 1).astype(jnp.float32)
      sizes = jnp.arange(1, planned.shape[0] + 1, dtype=jnp.int32)                # [B]
      grown_n = jnp.round(sizes * per_n).astype(jnp.int32)
      grown_cost = (cost.draft_share_cost(sizes, group_share) + cost.verify_cost(
          jnp.minimum(R + grown_n, cost.verify_ms.shape[0] - 1)))
      grown_pays = ((R + sizes * per_g) * base > R * grown_cost) & (sizes > size_P) & (
          sizes <= size_P + jnp.sum(joinable, dtype=jnp.int32))
      grows = jnp.any(grown_pays)
      need = jnp.where(grows, jnp.argmax(grown_pays) + 1, 0) - size_P
      rank = jnp.cumsum(joinable, dtype=jnp.int32) - 1
      joinable = joinable & (rank < need)
      close = fails & ~grows & P
      slot_pays = slot_pays & ~close
      margin = jnp.where(close, jnp.minimum(margin, 0.0), margin)
      retry = fails & joinable
      slot_pays = slot_pays | retry
      margin = jnp.where(retry, jnp.inf, margin)
    else:
      fails = jnp.bool_(False)
    # Found: some judged slot pays and its group pays as it ran. A group that does not
    # pay yet but tries to grow is not a find: the back-off keeps growing until the
    # grown group pays (then the interval resets, at whatever step that is).
    found = jnp.any(judged & slot_pays) & ~fails
    if pays_before.shape[0] > 1 or planned.shape[0] == 1:
      # Slots gated off at admission on the batch's view (no evidence of their own)
      # follow it when it changes: once some slot's drafts pay they try drafting at
      # their next step (judged afresh there) instead of waiting for their re-check
      # group, up to B / E re-checks later (a burst admitted into an idle batch after
      # a stretch where nothing paid).
      waiting = ~judged & (prior == WAITING)
      slot_pays = slot_pays | (found & waiting)
      margin = jnp.where(found & waiting, jnp.inf, margin)
    # Back-off: a re-check step on which some slot drafted either found a slot whose
    # drafts pay (the interval resets) or not (it doubles, capped); one on which no slot
    # drafted does not count (the next exploration step re-checks).
    counted = rechecking(state) & (d > 0)
    interval = jnp.where(found, jnp.int32(recheck_every),
                         jnp.minimum(2 * state.recheck_interval, max_recheck_every))
    interval = jnp.where(counted, interval, state.recheck_interval).astype(jnp.int32)
    next_recheck = jnp.where(counted, state.step + interval, state.next_recheck)
    # A find on another step (a grown group that pays, the step after its re-check)
    # resets the back-off there.
    late = found & ~counted & (d > 0)
    interval = jnp.where(late, jnp.int32(recheck_every), interval).astype(jnp.int32)
    next_recheck = jnp.where(late, jnp.minimum(next_recheck, state.step + recheck_every),
                             next_recheck)
    return new_state._replace(
        slot_pays=slot_pays, drafting_pays=jnp.any(slot_pays), pay_margin=margin,
        recheck_interval=interval,
        next_recheck=next_recheck,
        recheck_count=state.recheck_count + counted.astype(jnp.int32))

  return Planner(init=init, plan=plan, policy=policy, should_draft=should_draft,
                 config=config, gated=gated, keep_drafting=keep_drafting, stop=stop,
                 draft_slots=draft_slots, observe=observe)
