"""Lossless early stop of autoregressive drafting (docs/algorithm.md, section 10).

An autoregressive drafter runs depths 1..K one pass at a time. After depth j the
survivals `S[b, 1..j]` of request b are known, and they depend only on `x[b, 1..j-1]`.
The rule of this module, *survival stop*:

    request b drafts depth j+1  iff  it drafted depth j, j < K, and
        exploring[b]  or  j < min_depth  or  S[b, j] >= tau

where `tau` comes from EARLIER steps only: `margin` times the smallest survival that the
previous step's budget admitted (`threshold`; +inf after a budget of 0, 0 = no stopping
before any step). Because `S[b, j+1] <= S[b, j]`, a stop only removes positions whose
survival is below `tau`. Exploring slots (chosen by the step counter) draft past tau, all
K without a cap (under pass pricing, below: one past the cap, and all K on every few
exploration steps), so the estimator keeps receiving labels at every depth. The batch stops drafting when no
request continues (`any_drafting`, a `lax.while_loop` condition or a masked scan).

*Pass pricing* adds a batch-level depth cap, also from earlier steps only: on an
accelerator a drafter pass costs about the same however few rows continue, so a loop that
runs while any of 64 requests clears tau pays for passes whose drafts the budget mostly
trims. After each step `next_depth_cap` finds the depth c* whose passes paid at that step
(`optimal_depth`: the budget rule with the drafter charged c / K of its cost) and the next
step drafts no request but an exploring one beyond it (one pass deeper when c* reached the
cap after an exploration step, so a cap can grow back; the planner lets an exploring
request draft one past the cap, and all K on every few exploration steps:
`StopState.explore_cap`). A decision that reads nothing of the current step is exact for
the same reason as tau (docs/algorithm.md 10.7).

The planner computes the next step's lagged budget, tau and cap in one place,
`plan_next`, after `extrapolate` has filled each request's undrafted depths in from its
last conditional acceptance (docs/algorithm.md 10.8): a step that stopped early then no
longer limits what the next one may verify, and a cap that fell can rise again at once.
`make_early_stop().update` is the same rule without the filled depths, for callers that
bring their own budget.

Verification then allocates the lagged budget over the drafted prefixes only
(`verified_count`): `num_verified[b] = min(allocation of b, drafted depth of b)`, and an
exploring slot verifies its whole drafted depth. Whether position i is drafted and
whether it is verified depend only on `x[b, <i]`, on earlier steps and on other
requests' own draws, so both exactness rules hold (proof in docs/algorithm.md).

Optionally (`prune_outranked`) a request also stops once its deepest drafted position
ranks outside the lagged top-`budget` among the positions drafted so far: its deeper
positions can then never be allocated, so the verified set is, draw by draw, the one
without this prune (lossless for free), at the price that the next budget is computed
from fewer positions.

The competitor rule `confstop:T` (vLLM's `DraftConfidenceStop`) is here too:
`confidence_alive`, `confidence_num_verified`, `confidence_stop`.

Shapes: B slots, K draft depths. Depths are 1-based counts (`depth = j` means positions
1..j have been drafted).
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from av_jax import _checks


class StopParams(NamedTuple):
  """Hyper-parameters of survival stop (validate with `check_params`)."""
  margin: float = 0.5            # tau = margin * smallest admitted survival; in (0, 1]
  min_depth: int = 1             # every drafting request drafts at least this many depths
  prune_outranked: bool = False  # also stop once the deepest draft is outside the budget


class StopState(NamedTuple):
  """State carried between decode steps (optax style: `init` / `update`)."""
  tau: jax.Array  # [] float32, survival threshold for this step, from earlier steps only
  # [] int32, the batch's depth cap for this step (pass pricing, `next_depth_cap`), from
  # earlier steps only; 0: no cap.
  cap: jax.Array | int = 0
  # [] int32, the depth an exploring request drafts to this step (from the step counter
  # and the cap, never from this step's draws); 0: all K.
  explore_cap: jax.Array | int = 0


class EarlyStop(NamedTuple):
  """Survival stop bound to its hyper-parameters (built by `make_early_stop`)."""
  init: Callable[[], StopState]
  update: Callable[..., StopState]
  keep_drafting: Callable[..., jax.Array]
  params: StopParams


class ConfidenceStop(NamedTuple):
  """Outcome of one `confstop:T` draft round."""
  num_verified: jax.Array  # [B] int32, drafts each slot verifies (the same for all active)
  depths_run: jax.Array    # [] int32, drafter passes the round launched


def check_params(params: StopParams) -> StopParams:
  """Validates survival-stop hyper-parameters (host-side, once).

  Args:
    params: a `StopParams`.

  Returns:
    The same `StopParams`, with Python types.

  Raises:
    ValueError: naming the field: `margin` not a finite number in (0, 1], `min_depth`
      not an integer >= 1, `prune_outranked` not a bool.
  """
  margin, min_depth, prune = params
  if isinstance(margin, bool) or not isinstance(margin, numbers.Real) or not (
      math.isfinite(margin) and 0.0 < margin <= 1.0):
    raise ValueError(f"margin: expected a finite number in (0, 1], got {margin!r}")
  if isinstance(min_depth, bool) or not isinstance(min_depth, numbers.Integral) or min_depth < 1:
    raise ValueError(f"min_depth: expected an integer >= 1, got {min_depth!r}")
  if not isinstance(prune, bool):
    raise ValueError(f"prune_outranked: expected a bool, got {prune!r}")
  return StopParams(float(margin), int(min_depth), prune)


def _ranked(survival: jax.Array, drafted: jax.Array) -> jax.Array:
  """Survivals as the allocation ranks them: NaN -> 0, in [0, 1], non-increasing per
  request (running minimum), and -1 where the position was not drafted."""
  s = jnp.clip(jnp.nan_to_num(survival, nan=0.0), 0.0, 1.0)
  s = jax.lax.cummin(s, axis=1)
  return jnp.where(drafted, s, -1.0)


def _check_bk(survival, drafted, active):
  survival = jnp.asarray(survival, jnp.float32)
  _checks.rank("survival", survival, 2, "BK")
  B, K = survival.shape
  drafted = jnp.asarray(drafted)
  _checks.shape("drafted", drafted, (B, K), "BK")
  _checks.boolean("drafted", drafted)
  if active is None:
    active = jnp.ones((B,), bool)
  active = jnp.asarray(active)
  _checks.shape("active", active, (B,), "B")
  _checks.boolean("active", active)
  return survival, drafted & active[:, None], active


def _scalar_int(name, x):
  x = jnp.asarray(x)
  _checks.rank(name, x, 0)
  _checks.integer(name, x)
  return x.astype(jnp.int32)


def threshold(survival: jax.typing.ArrayLike, drafted: jax.typing.ArrayLike,
              budget: jax.typing.ArrayLike, *, margin: float,
              active: jax.typing.ArrayLike | None = None) -> jax.Array:
  """Survival threshold for the NEXT step, from one finished step.

  `tau = margin * s_(n)`, with `s_(n)` the smallest survival the budget `n` admits: the
  n-th largest ranked survival among the drafted positions of active slots (the smallest
  drafted one when `n` exceeds their number). A budget of 0 admits nothing, so the next
  step verifies nothing outside exploration: `tau = +inf` (stop after `min_depth`).

  Pass the budget this step's survivals call for (the planner's optimal budget, which is
  the next step's lagged budget), so that `tau` and the next budget describe the same
  allocation. The result must only ever be used at a LATER step: computed from this
  step's survivals and used for this step's stops it is biased (docs/algorithm.md).

  Args:
    survival: `[B, K]` survivals of the finished step (entries not drafted are ignored).
    drafted: `[B, K]` bool, positions drafted at that step (a prefix per slot).
    budget: int scalar, the budget those survivals call for.
    margin: in (0, 1]; smaller drafts deeper.
    active: optional `[B]` bool.

  Returns:
    `[]` float32 threshold; NaN when nothing was drafted (callers keep the old one).

  Example:
    >>> threshold(jnp.array([[0.9, 0.6, 0.2]]), jnp.ones((1, 3), bool), 2, margin=0.5)
    Array(0.3, dtype=float32)
  """
  survival, drafted, _ = _check_bk(survival, drafted, active)
  budget = _scalar_int("budget", budget)
  flat = jnp.sort(_ranked(survival, drafted).reshape(-1))[::-1]      # descending, -1 last
  num_drafted = jnp.sum(drafted, dtype=jnp.int32)
  smallest = flat[jnp.clip(jnp.minimum(budget, num_drafted) - 1, 0, flat.shape[0] - 1)]
  tau = jnp.where(budget <= 0, jnp.inf, jnp.float32(margin) * smallest)
  return jnp.where(num_drafted > 0, tau, jnp.nan).astype(jnp.float32)


def keep_drafting(survival: jax.typing.ArrayLike, depth: jax.typing.ArrayLike,
                  tau: jax.typing.ArrayLike, exploring: jax.typing.ArrayLike, *,
                  drafting: jax.typing.ArrayLike | None = None,
                  min_depth: int = 1, cap: jax.typing.ArrayLike = 0,
                  explore_cap: jax.typing.ArrayLike = 0) -> jax.Array:
  """Whether each request drafts depth `depth + 1`, given its depth-`depth` survival.

  `keep[b] = drafting[b] & ((exploring[b] & depth < explore_cap) | depth < min_depth |
  (S[b, depth] >= tau & depth < cap))`, a cap or explore cap of 0 meaning none.
  Stopping is absorbing (`drafting` is whether b drafted depth `depth`). NaN survivals
  are read as 0, like the allocation does. With `tau = 0` (no previous step) every
  drafting request continues. The caller also bounds the loop by K (`any_drafting`).

  Args:
    survival: `[B]` survival `S[b, depth]` of each request's drafted prefix.
    depth: int scalar >= 1, depths drafted so far (traced is fine).
    tau: `[]` float threshold from earlier steps (`threshold`, `StopState.tau`).
    exploring: `[B]` bool, slots verifying everything this step; they continue whatever
      tau and the cap say, up to `explore_cap`.
    drafting: optional `[B]` bool, whether b drafted depth `depth` (default all).
    min_depth: every drafting request drafts at least this many depths.
    cap: `[]` int, the batch's depth cap from earlier steps (`next_depth_cap`): no
      request but an exploring one drafts beyond it; 0 (default): no cap.
    explore_cap: `[]` int, how deep an exploring request drafts (from the step counter
      and earlier steps); 0 (default): all K.

  Returns:
    `[B]` bool.

  Example:
    >>> keep_drafting(jnp.array([0.8, 0.1]), 1, 0.3, jnp.array([False, False]))
    Array([ True, False], dtype=bool)
  """
  survival = jnp.asarray(survival, jnp.float32)
  _checks.rank("survival", survival, 1, "B")
  (B,) = survival.shape
  exploring = jnp.asarray(exploring)
  _checks.shape("exploring", exploring, (B,), "B")
  _checks.boolean("exploring", exploring)
  if drafting is None:
    drafting = jnp.ones((B,), bool)
  drafting = jnp.asarray(drafting)
  _checks.shape("drafting", drafting, (B,), "B")
  _checks.boolean("drafting", drafting)
  depth = _scalar_int("depth", depth)
  tau = jnp.asarray(tau, jnp.float32)
  _checks.rank("tau", tau, 0)
  s = jnp.clip(jnp.nan_to_num(survival, nan=0.0), 0.0, 1.0)
  cap = jnp.asarray(cap, jnp.int32)
  under_cap = (cap <= 0) | (depth < cap)
  explore_cap = jnp.asarray(explore_cap, jnp.int32)
  exploring = exploring & ((explore_cap <= 0) | (depth < explore_cap))
  return drafting & (exploring | (depth < min_depth) | ((s >= tau) & under_cap))


def outranked(survival: jax.typing.ArrayLike, drafted: jax.typing.ArrayLike,
              budget: jax.typing.ArrayLike, *,
              active: jax.typing.ArrayLike | None = None) -> jax.Array:
  """Whether each request's deepest drafted position is outside the top-`budget`.

  The order is the allocation's: larger survival, then lower position, then lower slot,
  over the drafted positions of active slots. Positions drafted later can only push an
  entry down, and b's deeper positions rank after its deepest drafted one, so where
  this is True none of them can be allocated at this budget: stopping b changes no
  allocation, draw by draw.

  Args:
    survival: `[B, K]` survivals (entries not drafted are ignored).
    drafted: `[B, K]` bool, positions drafted so far (a prefix per slot).
    budget: int scalar, the budget this step allocates (the lagged one).
    active: optional `[B]` bool.

  Returns:
    `[B]` bool, False for slots that drafted nothing.
  """
  survival, drafted, _ = _check_bk(survival, drafted, active)
  budget = _scalar_int("budget", budget)
  B, K = survival.shape
  s = _ranked(survival, drafted)
  depth = jnp.sum(drafted, axis=1, dtype=jnp.int32)                     # [B]
  last = jnp.maximum(depth - 1, 0)
  s_last = jnp.take_along_axis(s, last[:, None], axis=1)[:, 0]          # [B]
  pos = jnp.arange(K)[None, None, :]                                    # [1, 1, K]
  slot = jnp.arange(B)[None, :, None]                                   # [1, B', 1]
  me_s, me_pos, me_slot = s_last[:, None, None], last[:, None, None], jnp.arange(B)[:, None, None]
  ahead = (s[None] > me_s) | ((s[None] == me_s) & (
      (pos < me_pos) | ((pos == me_pos) & (slot < me_slot))))
  rank = jnp.sum(ahead & drafted[None], axis=(1, 2), dtype=jnp.int32)   # [B]
  return (depth > 0) & (rank >= budget)


def any_drafting(keep: jax.typing.ArrayLike, depth: jax.typing.ArrayLike, *,
                 max_depth: int) -> jax.Array:
  """Whole-batch loop condition: some request drafts depth `depth + 1 <= max_depth`.

  Args:
    keep: `[B]` bool from `keep_drafting`.
    depth: int scalar, depths drafted so far.
    max_depth: K.

  Returns:
    `[]` bool.
  """
  keep = jnp.asarray(keep)
  _checks.rank("keep", keep, 1, "B")
  _checks.boolean("keep", keep)
  return jnp.any(keep) & (_scalar_int("depth", depth) < max_depth)


def drafted_depth(survival: jax.typing.ArrayLike, tau: jax.typing.ArrayLike,
                  exploring: jax.typing.ArrayLike, *, min_depth: int = 1,
                  active: jax.typing.ArrayLike | None = None,
                  budget: jax.typing.ArrayLike | None = None,
                  cap: jax.typing.ArrayLike = 0,
                  explore_cap: jax.typing.ArrayLike = 0) -> jax.Array:
  """Reference drafting loop: the depth survival stop drafts for every request.

  Runs `keep_drafting` depth by depth exactly as an engine loop would, reading at depth
  j only the survivals of depths 1..j (the `[B, K]` input holds what each depth's pass
  would produce; deeper entries are never read for the decision at depth j). Depth 1
  is drafted by every active slot. With `budget` given, `outranked` also stops requests
  (the `prune_outranked` option).

  Args:
    survival: `[B, K]` survivals of all K depths.
    tau: `[]` threshold from earlier steps.
    exploring: `[B]` bool.
    min_depth: as in `keep_drafting`.
    active: optional `[B]` bool; inactive slots draft nothing.
    budget: optional int scalar, the lagged budget, enabling the outranked prune.
    cap: the batch's depth cap from earlier steps (0: none), as in `keep_drafting`.
    explore_cap: how deep exploring requests draft (0: all K), as in `keep_drafting`.

  Returns:
    `[B]` int32 drafted depth (0 for inactive slots).
  """
  survival = jnp.asarray(survival, jnp.float32)
  _checks.rank("survival", survival, 2, "BK")
  B, K = survival.shape
  if active is None:
    active = jnp.ones((B,), bool)
  active = jnp.asarray(active)
  _checks.shape("active", active, (B,), "B")
  _checks.boolean("active", active)
  exploring = jnp.asarray(exploring) & active

  def body(carry, j):                    # decides depth j + 1 from depths 1..j
    drafting, drafted = carry
    seen = jnp.where(jnp.arange(K)[None] < j, survival, 0.0)  # nothing deeper is read
    keep = keep_drafting(seen[:, j - 1], j, tau, exploring, drafting=drafting,
                         min_depth=min_depth, cap=cap, explore_cap=explore_cap)
    if budget is not None:
      keep = keep & (exploring | ~outranked(seen, drafted, budget, active=active))
    drafted = drafted.at[:, j].set(keep)
    return (keep, drafted), None

  drafted0 = jnp.zeros((B, K), bool).at[:, 0].set(active)
  (_, drafted), _ = jax.lax.scan(body, (active, drafted0), jnp.arange(1, K))
  return jnp.sum(drafted, axis=1, dtype=jnp.int32)


def verified_count(survival: jax.typing.ArrayLike, depth: jax.typing.ArrayLike,
                   budget: jax.typing.ArrayLike, *,
                   active: jax.typing.ArrayLike | None = None,
                   exploring: jax.typing.ArrayLike | None = None) -> jax.Array:
  """Verified positions per request: top-`budget` over the drafted prefixes.

  `num_verified[b] = min(allocation of b, depth[b])`, where the allocation gives the
  `budget` largest ranked survivals among drafted positions of active slots (ties:
  lower position, then lower slot); exploring slots verify all `depth[b]` drafted
  positions on top of the budget. Positions never drafted take no part in the ranking,
  so they can neither consume budget nor be verified. Use the lagged budget.

  Args:
    survival: `[B, K]` survivals (entries beyond `depth` are ignored).
    depth: `[B]` int drafted depth per slot.
    budget: int scalar.
    active: optional `[B]` bool.
    exploring: optional `[B]` bool.

  Returns:
    `[B]` int32.
  """
  survival = jnp.asarray(survival, jnp.float32)
  _checks.rank("survival", survival, 2, "BK")
  B, K = survival.shape
  depth = jnp.asarray(depth)
  _checks.shape("depth", depth, (B,), "B")
  _checks.integer("depth", depth)
  drafted = jnp.arange(K)[None] < depth[:, None]
  survival, drafted, active = _check_bk(survival, drafted, active)
  budget = _scalar_int("budget", budget)
  # Position-major flattening (index i * B + b) and a stable sort on -survival give the
  # tie order: larger survival, then lower position, then lower slot.
  flat = _ranked(survival, drafted).T.reshape(-1)
  order = jnp.argsort(-flat, stable=True)
  rank = jnp.zeros((B * K,), jnp.int32).at[order].set(jnp.arange(B * K, dtype=jnp.int32))
  chosen = ((rank < budget) & (flat >= 0)).reshape(K, B).T
  count = jnp.sum(chosen, axis=1, dtype=jnp.int32)
  if exploring is not None:
    exploring = jnp.asarray(exploring)
    _checks.shape("exploring", exploring, (B,), "B")
    _checks.boolean("exploring", exploring)
    count = jnp.where(exploring, K, count)
  return jnp.where(active, jnp.minimum(count, depth), 0).astype(jnp.int32)


def extrapolate(survival: jax.typing.ArrayLike, drafted: jax.typing.ArrayLike, *,
                active: jax.typing.ArrayLike | None = None) -> jax.Array:
  """Survivals of a finished step with every drafting request's undrafted depths filled in.

  A request that drafted depths 1..d (d >= 1) keeps its ranked survivals there; deeper
  positions j > d get `S_d * r ** (j - d)`, r = S_d / S_(d-1) (S_0 = 1) its last
  conditional acceptance: the context is taken to stay as predictable as at its last
  drafted depth. What the NEXT step plans from (its lagged budget, tau and depth cap)
  then covers depths this step did not draft, so a step that stopped early no longer
  limits the next one to its own depth (without it the lagged budget counts at most the
  positions drafted, and a cap that fell can only grow back one pass at a time). Reads
  drafted entries only; the result, like everything computed from a finished step, may
  only be used at later steps (docs/algorithm.md 10.8).

  Args:
    survival: `[B, K]` survivals of the finished step (entries not drafted are ignored).
    drafted: `[B, K]` bool, positions drafted at that step (a prefix per slot).
    active: optional `[B]` bool.

  Returns:
    `[B, K]` float32 ranked survivals in [0, 1] (non-increasing per request); -1 in the
    rows of requests that drafted nothing or are not active.
  """
  survival, drafted, _ = _check_bk(survival, drafted, active)
  B, K = survival.shape
  s = _ranked(survival, drafted)
  depth = jnp.sum(drafted, axis=1, dtype=jnp.int32)
  at = lambda i: jnp.take_along_axis(s, jnp.clip(i, 0, K - 1)[:, None], axis=1)[:, 0]
  last = at(depth - 1)
  prev = jnp.where(depth >= 2, at(depth - 2), 1.0)
  rate = jnp.where(prev > 0, jnp.clip(last / jnp.maximum(prev, 1e-30), 0.0, 1.0), 0.0)
  ahead = jnp.maximum(jnp.arange(1, K + 1)[None] - depth[:, None], 0)
  filled = last[:, None] * rate[:, None] ** ahead
  return jnp.where(drafted, s, jnp.where(depth[:, None] > 0, filled, -1.0)).astype(jnp.float32)


def _depth_table(survival, drafted, cost, *, active, num_drafting):
  """Per cap c = 1..K: the best ratio `(R + s_(1..n)) / (draft_share_cost(d, c/K) + verify(R + n))`
  over the drafted positions at depths <= c, and its n (the budget). `[K]`, `[K]`."""
  survival, drafted, active = _check_bk(survival, drafted, active)
  B, K = survival.shape
  R = jnp.sum(active, dtype=jnp.int32)
  d = R if num_drafting is None else jnp.asarray(num_drafting, jnp.int32)
  flat = _ranked(survival, drafted).T.reshape(-1)           # position-major: i * B + b
  order = jnp.argsort(-flat, stable=True)
  values, depth = flat[order], (order // B) + 1              # [K B], depth of each entry
  caps = jnp.arange(1, K + 1)
  inside = (values[None] >= 0) & (depth[None] <= caps[:, None])            # [K, K B]
  gains = jnp.cumsum(jnp.where(inside, values[None], 0.0), axis=1)
  counts = jnp.cumsum(inside, axis=1, dtype=jnp.int32)
  gains = jnp.concatenate([jnp.zeros((K, 1)), gains], axis=1)               # n = 0 first
  counts = jnp.concatenate([jnp.zeros((K, 1), jnp.int32), counts], axis=1)
  draft = cost.draft_share_cost(d, caps[:, None] / K)
  tokens = R + counts
  ratio = (R + gains) / jnp.maximum(draft + cost.verify_cost(tokens), 1e-12)
  ratio = jnp.where(tokens < cost.verify_ms.shape[0], ratio, -jnp.inf)
  at = jnp.argmax(ratio, axis=1)                                            # ties: smaller n
  return jnp.max(ratio, axis=1), jnp.take_along_axis(counts, at[:, None], axis=1)[:, 0]


def optimal_depth(survival: jax.typing.ArrayLike, drafted: jax.typing.ArrayLike, cost, *,
                  active: jax.typing.ArrayLike | None = None,
                  num_drafting: jax.typing.ArrayLike | None = None) -> jax.Array:
  """The drafting depth c a finished step's survivals call for, pricing drafter passes.

  For every cap c = 1..K: the positions at depths <= c that were drafted, their
  throughput-optimal budget and its ratio
  `(R + s_(1) + ... + s_(n)) / (draft_share_cost(d, c / K) + verify_cost(R + n))` (the budget
  rule of section 4 with the drafter charged for the c of its K passes that ran); the
  answer is the c of the largest ratio, ties to the smaller c. Positions deeper than a
  request's drafted depth are unknown and count for nothing (pass `extrapolate`'s
  survivals, with `drafted` their entries >= 0, to count them as estimated).

  Args:
    survival: `[B, K]` survivals of the finished step (entries not drafted are ignored).
    drafted: `[B, K]` bool, positions drafted at that step (a prefix per slot).
    cost: the `CostModel` the budget is chosen against (`draft_cost` covers all K passes).
    active: optional `[B]` bool; R = its count (every active slot verifies one token).
    num_drafting: slots that drafted (they set the drafting cost); default R.

  Returns:
    `[]` int32 in 1..K (1 when nothing was drafted).
  """
  best, _ = _depth_table(survival, drafted, cost, active=active, num_drafting=num_drafting)
  return (jnp.argmax(best) + 1).astype(jnp.int32)


class NextStep(NamedTuple):
  """What a finished step hands the next one (all from that step: `plan_next`)."""
  stop: StopState     # tau and the depth cap for the next step (explore_cap unchanged)
  budget: jax.Array   # [] int32, the next step's lagged budget


def plan_next(state: StopState, survival: jax.typing.ArrayLike, drafted: jax.typing.ArrayLike,
              cost, *, margin: float, active: jax.typing.ArrayLike | None = None,
              num_drafting: jax.typing.ArrayLike | None = None,
              probe: jax.typing.ArrayLike = True, price: bool = True,
              fill: bool = True) -> NextStep:
  """The next step's lagged budget, tau and depth cap from one finished step.

  With `fill` the survivals are `extrapolate`d first (a request's undrafted depths
  estimated from its last conditional acceptance). With `price` the depth cap is the c*
  of `optimal_depth` over them; a c* below this step's cap lowers it, one at or above it
  raises it to c* (and one pass past the cap after an exploration step when `probe`,
  see `next_depth_cap`); without `price` there is no cap (0) and c* = K. The budget is
  the throughput-optimal n of the positions at depths <= the next cap (the drafter
  charged for that many passes), tau is `margin` times the smallest survival it admits
  among them (`threshold`). A step that drafted nothing keeps tau, cap and budget are
  then meaningless: the planner keeps its own (`any_drafted`).

  Args:
    state: `StopState` this step drafted under (`tau` kept when nothing was drafted).
    survival, drafted, active, num_drafting: as in `optimal_depth`.
    cost: the `CostModel` the budget is chosen against.
    margin: tau's margin, in (0, 1].
    probe: whether a cap that paid may grow by one (the planner: after exploration).
    price: price drafter passes (a depth cap); False: no cap.
    fill: extrapolate undrafted depths (False: they count for nothing).

  Returns:
    `NextStep(stop=StopState(tau, cap, state.explore_cap), budget)`.
  """
  survival, drafted, active = _check_bk(survival, drafted, active)
  B, K = survival.shape
  s = extrapolate(survival, drafted, active=active) if fill else _ranked(survival, drafted)
  known = s >= 0
  ratio, budgets = _depth_table(s, known, cost, active=active, num_drafting=num_drafting)
  if price:
    best = (jnp.argmax(ratio) + 1).astype(jnp.int32)
    cap = jnp.asarray(state.cap, jnp.int32)
    cap = jnp.where(cap <= 0, K, jnp.minimum(cap, K))
    grown = jnp.where(jnp.asarray(probe), jnp.minimum(cap + 1, K), cap)
    horizon = jnp.where(best < cap, best, jnp.maximum(best, grown)).astype(jnp.int32)
    next_cap = horizon
  else:
    horizon, next_cap = jnp.int32(K), jnp.int32(0)
  budget = jnp.take(budgets, horizon - 1).astype(jnp.int32)
  inside = known & (jnp.arange(K)[None] < horizon)
  tau = threshold(s, inside, budget, margin=margin, active=active)
  tau = jnp.where(jnp.isnan(tau), jnp.asarray(state.tau, jnp.float32), tau)
  return NextStep(stop=StopState(tau=tau, cap=next_cap, explore_cap=state.explore_cap),
                  budget=budget)


def next_depth_cap(survival: jax.typing.ArrayLike, drafted: jax.typing.ArrayLike, cost,
                   cap: jax.typing.ArrayLike, *,
                   active: jax.typing.ArrayLike | None = None,
                   num_drafting: jax.typing.ArrayLike | None = None,
                   probe: jax.typing.ArrayLike = True) -> jax.Array:
  """The batch's depth cap for the NEXT step (pass pricing), from one finished step.

  `c* = optimal_depth(...)` of this step; the next cap is c* when c* is below this
  step's cap, and one deeper (at most K) when c* reached it and `probe` is set: a cap
  whose deepest pass still paid is probed one pass deeper, since deeper positions were
  never drafted and cannot speak for themselves (exploring slots, which draft deeper,
  also feed c*). Without `probe` a cap that paid stays. A cap of 0 means no cap (read
  as K). Like tau, the cap is used only at later steps.

  Args:
    survival, drafted, cost, active, num_drafting: as in `optimal_depth`.
    cap: `[]` int, the cap this step drafted under (0: none).
    probe: `[]` bool, whether a cap that paid may grow after this step (the planner
      probes after exploration steps only, from the step counter).

  Returns:
    `[]` int32 in 1..K.
  """
  K = jnp.asarray(survival).shape[1]
  cap = jnp.asarray(cap, jnp.int32)
  cap = jnp.where(cap <= 0, K, jnp.minimum(cap, K))
  best = optimal_depth(survival, drafted, cost, active=active, num_drafting=num_drafting)
  grown = jnp.where(jnp.asarray(probe), jnp.minimum(cap + 1, K), cap)
  return jnp.where(best < cap, best, grown).astype(jnp.int32)


def make_early_stop(*, margin: float = 0.5, min_depth: int = 1,
                    prune_outranked: bool = False) -> EarlyStop:
  """Builds survival stop: `init`, `update` and a per-depth `keep_drafting`.

  Args:
    margin: `tau = margin * smallest survival the previous budget admitted`, in (0, 1].
    min_depth: every drafting request drafts at least this many depths, >= 1.
    prune_outranked: also stop a request whose deepest drafted position is outside the
      lagged top-`budget` (lossless draw by draw; the next budget sees fewer positions).

  Returns:
    `EarlyStop(init, update, keep_drafting, params)` with
    `init() -> StopState` (tau = 0 and no depth cap: no stopping at the first step),
    `update(state, survival [B,K], drafted [B,K], budget, *, active=None, cost=None,
    num_drafting=None, probe=True) -> StopState` (call after the step's budget is known;
    a step that drafted nothing keeps the state; with `cost`, the batch's depth cap is
    priced too: `next_depth_cap`), and
    `keep_drafting(state, survival [B,K], drafted [B,K], depth, exploring [B], *,
    budget=None, active=None) -> [B] bool`: whether each slot drafts depth `depth + 1`,
    from the survivals and drafted mask of depths 1..`depth` (deeper entries are not
    read; `budget` is the lagged budget, needed only with `prune_outranked`).

  Raises:
    ValueError: naming a bad hyper-parameter.

  Example:
    >>> stop = make_early_stop(margin=0.5)
    >>> state = stop.init()
    >>> keep = stop.keep_drafting(state, surv, drafted, 1, exploring)
    >>> state = stop.update(state, surv, drafted, optimal_budget, active=active)
  """
  params = check_params(StopParams(margin, min_depth, prune_outranked))

  def init() -> StopState:
    return StopState(tau=jnp.zeros((), jnp.float32), cap=jnp.zeros((), jnp.int32))

  def update(state: StopState, survival, drafted, budget, *, active=None, cost=None,
             num_drafting=None, probe=True) -> StopState:
    tau = threshold(survival, drafted, budget, margin=params.margin, active=active)
    none = jnp.isnan(tau)  # nothing drafted: keep the state
    cap = jnp.asarray(state.cap, jnp.int32)
    if cost is not None:
      cap = jnp.where(none, cap, next_depth_cap(survival, drafted, cost, cap, active=active,
                                                num_drafting=num_drafting, probe=probe))
    return StopState(tau=jnp.where(none, state.tau, tau), cap=cap,
                     explore_cap=state.explore_cap)

  def keep(state: StopState, survival, drafted, depth, exploring, *, budget=None,
           active=None) -> jax.Array:
    survival, drafted, active = _check_bk(survival, drafted, active)
    K = survival.shape[1]
    depth = _scalar_int("depth", depth)
    column = jnp.clip(depth - 1, 0, K - 1)
    out = keep_drafting(jnp.take(survival, column, axis=1), depth, state.tau, exploring,
                        drafting=jnp.take(drafted, column, axis=1),
                        min_depth=params.min_depth, cap=state.cap,
                        explore_cap=state.explore_cap)
    if params.prune_outranked:
      if budget is None:
        raise ValueError("budget: required with prune_outranked=True (the lagged budget)")
      out = out & (jnp.asarray(exploring) | ~outranked(survival, drafted, budget,
                                                       active=active))
    return out

  return EarlyStop(init=init, update=update, keep_drafting=keep, params=params)


def confidence_alive(top1_probs: jax.typing.ArrayLike, alive: jax.typing.ArrayLike,
                     threshold: jax.typing.ArrayLike) -> jax.Array:
  """One depth of `confstop:T`: a chain stays alive while every draft has top-1 >= T.

  vLLM's `DraftConfidenceStop` (vllm/v1/worker/gpu/spec_decode/confidence_stop.py)
  keeps per-request chain state: after depth j, `alive[b]` iff the drafter's top-1
  probability was >= T at every depth 1..j. A dead chain stays dead even if the drafter
  becomes confident again. Padded / inactive rows enter dead and never keep the batch
  drafting. Pass `alive = active` at depth 1.

  Args:
    top1_probs: `[B]` top-1 probability of each request's depth-j draft distribution.
    alive: `[B]` bool, chains alive after depth j - 1 (`active` at j = 1).
    threshold: scalar T.

  Returns:
    `[B]` bool, chains alive after depth j.
  """
  top1_probs = jnp.asarray(top1_probs, jnp.float32)
  _checks.rank("top1_probs", top1_probs, 1, "B")
  alive = jnp.asarray(alive)
  _checks.shape("alive", alive, top1_probs.shape, "B")
  _checks.boolean("alive", alive)
  return alive & (top1_probs >= jnp.asarray(threshold, jnp.float32))


def confidence_num_verified(depths_run: jax.typing.ArrayLike, any_alive: jax.typing.ArrayLike,
                            active: jax.typing.ArrayLike) -> jax.Array:
  """Drafts every active request verifies after a `confstop:T` round.

  The round launches depth j + 1 while some chain is alive after depth j (j < K). All
  rows run every launched depth, so every active request verifies the same count: with
  no chain alive after the last launched depth `d`, `max(1, d - 1)` (that depth's drafts
  were all below T, except that the first draft is always kept); with a chain still
  alive (only possible at d = K), K. Equivalently, with `L = max_b` (number of leading
  drafts of b with top-1 >= T): `depths_run = min(K, L + 1)` and
  `num_verified = clip(L, 1, K)`. Verification is fixed: no budget, no allocation.

  Args:
    depths_run: int scalar, depths the round launched (>= 1).
    any_alive: `[]` bool, whether a chain is alive after the last launched depth.
    active: `[B]` bool.

  Returns:
    `[B]` int32 (0 for inactive slots).
  """
  depths_run = _scalar_int("depths_run", depths_run)
  active = jnp.asarray(active)
  _checks.rank("active", active, 1, "B")
  _checks.boolean("active", active)
  count = jnp.where(jnp.asarray(any_alive), depths_run, jnp.maximum(depths_run - 1, 1))
  return jnp.where(active, count, 0).astype(jnp.int32)


def confidence_stop(top1_probs: jax.typing.ArrayLike, threshold: jax.typing.ArrayLike, *,
                    active: jax.typing.ArrayLike | None = None) -> ConfidenceStop:
  """A whole `confstop:T` round (vLLM's `DraftConfidenceStop`), batch level.

  Composes `confidence_alive` depth by depth (depth j + 1 is launched only while some
  chain is alive after depth j; top-1 probabilities of depths not launched are never
  read) and `confidence_num_verified`. Lossless: the count reads draft distributions
  of depths 1..i only to decide whether position i is verified, never drawn tokens.

  Args:
    top1_probs: `[B, K]` top-1 probability of each depth's draft distribution.
    threshold: scalar T.
    active: optional `[B]` bool.

  Returns:
    `ConfidenceStop(num_verified [B] int32, depths_run [] int32)`.

  Example:
    >>> confidence_stop(jnp.array([[0.9, 0.7, 0.4, 0.9], [0.3, 0.99, 0.99, 0.99]]), 0.6)
    ConfidenceStop(num_verified=Array([2, 2], ...), depths_run=Array(3, ...))
  """
  top1_probs = jnp.asarray(top1_probs, jnp.float32)
  _checks.rank("top1_probs", top1_probs, 2, "BK")
  B, K = top1_probs.shape
  if active is None:
    active = jnp.ones((B,), bool)
  active = jnp.asarray(active)
  _checks.shape("active", active, (B,), "B")
  _checks.boolean("active", active)

  def body(carry, probs_j):
    alive, depths_run, launched = carry
    new_alive = jnp.where(launched, confidence_alive(probs_j, alive, threshold), alive)
    depths_run = depths_run + launched.astype(jnp.int32)
    return (new_alive, depths_run, launched & jnp.any(new_alive)), None

  init = (active, jnp.zeros((), jnp.int32), jnp.asarray(True))
  (alive, depths_run, _), _ = jax.lax.scan(body, init, top1_probs.T)
  return ConfidenceStop(num_verified=confidence_num_verified(depths_run, jnp.any(alive), active),
                        depths_run=depths_run)
