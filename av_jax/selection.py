"""Survival ranking, the throughput-optimal budget, and allocation (docs/algorithm.md section 4).

`survival` turns per-token acceptance probabilities into the probability that a draft
position is reached and accepted. `choose_budget` picks how many draft tokens the whole
batch verifies by maximising expected emitted tokens over measured step cost, and
`allocate` gives those tokens to the largest survivals, a prefix of each request.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from av_jax import _checks


class CostModel(NamedTuple):
  """Measured step-cost tables (any time unit; milliseconds by convention).

  A pytree, so it can be passed into jitted functions as data (no recompile when
  re-profiled). Build it with `make_cost_model` to validate and repair measured tables.
  """
  draft_ms: jax.Array   # [R_max + 1] float32, drafting cost with R active requests
  verify_ms: jax.Array  # [T_max + 1] float32, target cost to verify T tokens
  # [R_max + 1] float32 or None (zero), the part of `draft_ms` an autoregressive drafter
  # pays whatever depth it drafts to (its first pass consumes the pending block, a
  # drafting step gathers and scatters its rows): drafting c of K passes costs
  # `fixed + (c / K) (draft - fixed)` (`draft_share_cost`). Unused by parallel drafters.
  draft_fixed_ms: jax.Array | None = None
  # [] float32 or None (zero), the least a step that drafts pays to verify, whatever it
  # verifies: an engine of static shapes runs its drafting step's verification (the
  # target's distributions at every slot's K + 1 positions, rejection) over all B slots,
  # so a drafting step at the tail of a batch costs what one at full batch does. A
  # step that drafts nothing runs the target-only step, priced by `verify_ms` alone.
  drafting_floor_ms: jax.Array | None = None

  def draft_cost(self, num_requests: jax.typing.ArrayLike) -> jax.Array:
    """Drafting cost with `num_requests` active requests (any shape); beyond the table,
    its last entry."""
    return self.draft_ms[jnp.minimum(num_requests, self.draft_ms.shape[0] - 1)]

  def draft_share_cost(self, num_requests: jax.typing.ArrayLike,
                       share: jax.typing.ArrayLike) -> jax.Array:
    """Drafting cost of `share` (c / K, in [0, 1]) of an autoregressive drafter's K
    passes with `num_requests` requests: `fixed + share (draft - fixed)`, shapes
    broadcast. Without a fixed part (None), `share * draft_cost` (the passes priced
    alike)."""
    full = self.draft_cost(num_requests)
    if self.draft_fixed_ms is None:
      return share * full
    index = jnp.minimum(num_requests, self.draft_fixed_ms.shape[0] - 1)
    fixed = jnp.minimum(self.draft_fixed_ms[index], full)
    return fixed + share * (full - fixed)

  def verify_cost(self, num_tokens: jax.typing.ArrayLike) -> jax.Array:
    """Target cost to verify `num_tokens` tokens (any shape); beyond the table, its last
    entry (`choose_budget` never picks such a count)."""
    return self.verify_ms[jnp.minimum(num_tokens, self.verify_ms.shape[0] - 1)]


def make_cost_model(draft_ms, verify_ms, *, min_cost: float = 1e-6,
                    draft_fixed_ms=None, drafting_floor_ms: float = 0.0) -> CostModel:
  """Validates measured cost tables and makes them monotone (host-side, once).

  Repairs are made with a `UserWarning` saying what was changed, so a broken profile is
  visible instead of silently steering the budget:

  * a table that falls somewhere (cost dropping as work grows, e.g. timing noise between
    buckets) is replaced by its running maximum;
  * a `verify_ms` entry for one or more tokens below `min_cost` is floored to it: a target
    pass is never free, so a zero there is a failed or missing measurement.

  Entries that may legitimately be zero are floored silently: `verify_ms[0]` (verifying
  nothing) and `draft_ms` (a drafter can be free, e.g. prompt lookup). The floor keeps
  every step cost positive, so the budget's throughput ratio never divides by zero.
  Tables that are already monotone and positive pass unchanged and without a warning.

  Args:
    draft_ms: `[R_max + 1]` drafting cost for 0..R_max active requests.
    verify_ms: `[T_max + 1]` verification cost for 0..T_max verified tokens.
    min_cost: floor applied to every entry so no ratio divides by zero.
    draft_fixed_ms: optional `[R_max + 1]`, the part of each `draft_ms` entry an
      autoregressive drafter pays whatever depth it drafts to (`CostModel.draft_share_cost`);
      default zeros (c of K passes cost c / K of the entry). Entries above their
      `draft_ms` entry are clipped to it (with a `UserWarning`).
    drafting_floor_ms: the least a drafting step's verification costs
      (`CostModel.drafting_floor_ms`), >= 0.

  Returns:
    A `CostModel` whose tables are running maxima (cost never falls as work grows) and
    whose `draft_fixed_ms` is an array (zeros when not given).

  Raises:
    ValueError: naming the table, if it is missing (None), empty, not 1-D, or holds
      non-finite or negative entries.

  Example:
    >>> cost = make_cost_model(np.full(5, 0.7), [0.0, 2.0, 2.1, 2.1, 3.0])  # no warning
  """
  draft = _repaired_table("draft_ms", draft_ms, min_cost)
  verify = _repaired_table("verify_ms", verify_ms, min_cost)
  # The fixed part is compared host-side with the float32 table the model holds.
  fixed = _draft_fixed_part(draft_fixed_ms, draft.astype(np.float32).astype(np.float64))
  floor = float(drafting_floor_ms)
  if not (np.isfinite(floor) and floor >= 0.0):
    raise ValueError(f"drafting_floor_ms: expected a finite number >= 0, got {drafting_floor_ms!r}")
  return CostModel(draft_ms=jnp.asarray(draft, jnp.float32),
                   verify_ms=jnp.asarray(verify, jnp.float32),
                   draft_fixed_ms=jnp.asarray(fixed, jnp.float32),
                   drafting_floor_ms=jnp.asarray(floor, jnp.float32))


def _repaired_table(name: str, table, min_cost: float) -> np.ndarray:
  """`table` checked, floored to `min_cost` and made its running maximum, with a
  `UserWarning` for each repair (`make_cost_model`)."""
  if table is None:
    raise ValueError(f"{name}: expected a non-empty 1-D cost table, got None")
  table = np.asarray(table, dtype=np.float64)
  if table.ndim != 1 or table.size == 0:
    raise ValueError(f"{name}: expected a non-empty 1-D table, got shape {table.shape}")
  if not np.all(np.isfinite(table)) or np.any(table < 0):
    raise ValueError(f"{name}: expected finite, non-negative costs, got {table}")
  if name == "verify_ms":
    low = np.flatnonzero(table[1:] < min_cost) + 1
    if low.size:
      warnings.warn(
          f"{name}: {low.size} entries for >= 1 verified tokens are below "
          f"min_cost={min_cost:g} (at T = {_some(low)}); floored to {min_cost:g}. A target "
          f"pass is never free: re-profile the costs.", stacklevel=3)
  floored = np.maximum(table, min_cost)
  repaired = np.maximum.accumulate(floored)
  fallen = np.flatnonzero(repaired > floored)
  if fallen.size:
    worst = int(fallen[np.argmax(repaired[fallen] - floored[fallen])])
    warnings.warn(
        f"{name}: not monotone, the cost falls as work grows at {fallen.size} entries "
        f"{_some(fallen)} (worst: entry {worst} is {floored[worst]:g}, below an earlier "
        f"{repaired[worst]:g}); repaired to the running maximum.", stacklevel=3)
  return repaired


def _draft_fixed_part(draft_fixed_ms, draft: np.ndarray) -> np.ndarray:
  """`draft_fixed_ms` checked against `draft` and clipped to it (zeros when None)."""
  if draft_fixed_ms is None:
    return np.zeros_like(draft)
  fixed = np.asarray(draft_fixed_ms, np.float64)
  if fixed.shape != draft.shape:
    raise ValueError(f"draft_fixed_ms: expected shape {draft.shape} (that of draft_ms), "
                     f"got {fixed.shape}")
  if not np.all(np.isfinite(fixed)) or np.any(fixed < 0):
    raise ValueError(f"draft_fixed_ms: expected finite, non-negative costs, got {fixed}")
  above = np.flatnonzero(fixed > draft * (1 + 1e-6))
  if above.size:
    warnings.warn(
        f"draft_fixed_ms: {above.size} entries exceed their draft_ms entry (at R = "
        f"{_some(above)}); clipped to it.", stacklevel=3)
  return np.minimum(fixed, draft)


def _some(indices: np.ndarray, limit: int = 5) -> str:
  """`[i, j, ...]` of the first `limit` indices, for a warning message."""
  shown = ", ".join(str(int(i)) for i in indices[:limit])
  return f"[{shown}{', ...' if indices.size > limit else ''}]"


def linear_cost_model(max_requests: int, max_tokens: int, *, draft_fixed: float = 1.0,
                      draft_per_request: float = 0.0, verify_fixed: float = 1.0,
                      verify_per_token: float = 0.05) -> CostModel:
  """A synthetic affine cost model (for demos and tests, not measurements)."""
  r = np.arange(max_requests + 1)
  t = np.arange(max_tokens + 1)
  return make_cost_model(draft_fixed + draft_per_request * r, verify_fixed + verify_per_token * t)


def check_probabilities(name: str, x: jax.typing.ArrayLike) -> None:
  """Raises a `ValueError` naming `x` if a concrete `x` holds a value outside [0, 1].

  NaN is allowed (ranked as 0: never verified). Under `jax.jit` the values are not known
  and nothing is checked: `survival` clips probabilities to [0, 1] (above 1 counts as
  certain acceptance of that position only, below 0 as rejection), survivals given
  directly are clipped to [0, 1], and NaN ranks as 0.
  """
  if isinstance(x, jax.core.Tracer):
    return
  values = np.asarray(x, dtype=np.float64)
  bad = (values < 0) | (values > 1)  # NaN compares False
  if bad.any():
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"{name}: expected probabilities in [0, 1], got {values[first]:g} at "
                     f"index {first} ({int(bad.sum())} entries outside [0, 1])")


def check_cost_table(cost, num_slots: int, num_positions: int) -> None:
  """Checks that `cost` is a `CostModel` whose `verify_ms` covers `B (K + 1)` tokens.

  Table lengths are static, so this runs at trace time. A `verify_ms` with fewer than
  `B (K + 1) + 1` entries is allowed but warned about (by name): token counts beyond it
  are never chosen, so the budget is silently capped (at 0 for a table of length R + 1).
  """
  if not isinstance(cost, CostModel):
    raise ValueError(f"cost: expected a CostModel (av_jax.make_cost_model), got "
                     f"{type(cost).__name__} {cost!r:.80}")
  need = num_slots * (num_positions + 1) + 1
  have = int(np.shape(cost.verify_ms)[0])
  if have < need:
    warnings.warn(
        f"cost.verify_ms: {have} entries, fewer than B * (K + 1) + 1 = {need} for B = "
        f"{num_slots}, K = {num_positions}; budgets that verify more than {have - 1} "
        f"tokens in all are never chosen. Profile (or build) the table up to "
        f"{need - 1} tokens.", stacklevel=3)


def survival(probs: jax.typing.ArrayLike) -> jax.Array:
  """`S[b, i] = prod_{j <= i} probs[b, j]`: probability that positions 1..i are accepted.

  Args:
    probs: `[..., K]` per-token acceptance probabilities in [0, 1] (checked when
      concrete; see `check_probabilities` for what happens under jit).

  Returns:
    `[..., K]` float32 cumulative products along the last axis.
  """
  check_probabilities("probs", probs)
  probs = jnp.asarray(probs, jnp.float32)
  _checks.rank_at_least("probs", probs, 1)
  # Traced values escape the check: clipped here, so one probability above 1 cannot lift
  # the survivals of the positions after it (NaN stays NaN and ranks as 0).
  return jnp.cumprod(jnp.clip(probs, 0.0, 1.0), axis=-1)


def _ranked_survival(survival: jax.Array, active: jax.Array | None) -> jax.Array:
  """Survivals as ranked: NaN -> 0, made non-increasing per request, inactive -> -1."""
  s = jnp.clip(jnp.nan_to_num(survival, nan=0.0), 0.0, 1.0)
  # A running minimum makes every ranking prefix-closed even for inputs that are not
  # products of probabilities; for true survivals it changes nothing.
  s = jax.lax.cummin(s, axis=s.ndim - 1)
  if active is not None:
    s = jnp.where(active[:, None], s, -1.0)
  return s


def _check_survival(survival, active):
  check_probabilities("survival", survival)
  survival = jnp.asarray(survival, jnp.float32)
  _checks.rank("survival", survival, 2, "BK")
  if active is not None:
    active = jnp.asarray(active)
    _checks.shape("active", active, survival.shape[:1], "B")
    _checks.boolean("active", active)
  return survival, active


class _Ranking(NamedTuple):
  """One stable sort of the flattened survivals, shared by budget and allocation."""
  flat: jax.Array        # [K*B] ranked survivals, position-major (index i * B + b)
  sorted_desc: jax.Array  # [K*B] the same values, descending
  rank: jax.Array        # [K*B] int32 place of each entry in the tie-broken order


def _rank(ranked: jax.Array) -> _Ranking:
  B, K = ranked.shape
  # Position-major flattening (index i * B + b) plus a stable sort on -survival gives
  # exactly the tie order: larger survival, then lower position, then lower slot.
  flat = ranked.T.reshape(-1)
  order = jnp.argsort(-flat, stable=True)
  rank = jnp.zeros((B * K,), jnp.int32).at[order].set(jnp.arange(B * K, dtype=jnp.int32))
  return _Ranking(flat=flat, sorted_desc=flat[order], rank=rank)


def _budget(ranking: _Ranking, cost: CostModel, num_active: jax.Array, K: int, *,
            num_drafting: jax.Array | None = None) -> jax.Array:
  # `num_drafting`: slots that drafted (the planner's per-slot gate), which set the
  # drafting cost; every active slot still verifies one token. None: all active drafted.
  n = jnp.arange(ranking.flat.shape[0] + 1)
  gains = jnp.cumsum(jnp.maximum(ranking.sorted_desc, 0.0))
  expected = num_active + jnp.concatenate([jnp.zeros((1,)), gains])
  draft = cost.draft_cost(num_active if num_drafting is None else num_drafting)
  tokens = num_active + n
  verify = cost.verify_cost(tokens)
  throughput = expected / jnp.maximum(draft + verify, 1e-12)
  valid = (n <= num_active * K) & (tokens < cost.verify_ms.shape[0])
  valid = valid.at[0].set(True)
  return jnp.argmax(jnp.where(valid, throughput, -jnp.inf)).astype(jnp.int32)


def _allocation(ranking: _Ranking, budget: jax.Array, B: int, K: int) -> jax.Array:
  chosen = (ranking.rank < budget) & (ranking.flat >= 0)
  return chosen.reshape(K, B).T


def _num_active(active, B):
  return jnp.int32(B) if active is None else jnp.sum(active, dtype=jnp.int32)


def choose_budget(survival: jax.typing.ArrayLike, cost: CostModel, *,
                  active: jax.typing.ArrayLike | None = None) -> jax.Array:
  """Number of draft tokens to verify this step, maximising expected throughput.

  With R active requests and their survivals sorted descending s_(1) >= ... >= s_(M):
  `budget = argmax_n (R + s_(1) + ... + s_(n)) / (draft_ms[R] + verify_ms[R + n])`,
  n = 0..M (docs/algorithm.md section 4); ties go to the smaller n. Values of n whose token count
  R + n lies beyond `verify_ms` are never chosen; R beyond `draft_ms` uses its last
  entry. With no active request the budget is 0.

  Args:
    survival: `[B, K]` survivals.
    cost: a `CostModel`.
    active: optional `[B]` bool; inactive slots contribute neither R nor drafts.

  Returns:
    int32 scalar budget.
  """
  survival, active = _check_survival(survival, active)
  B, K = survival.shape
  check_cost_table(cost, B, K)
  ranking = _rank(_ranked_survival(survival, active))
  return _budget(ranking, cost, _num_active(active, B), K)


def allocate(survival: jax.typing.ArrayLike, budget: jax.typing.ArrayLike, *,
             active: jax.typing.ArrayLike | None = None) -> jax.Array:
  """Marks the `budget` draft tokens with the largest survival for verification.

  Ties go to the lower position, then the lower slot, so the chosen set is a prefix of
  every request, and whether (b, i) is chosen never depends on b's deeper positions.
  Exactly `min(budget, number of active drafts)` entries are chosen; never an inactive
  slot.

  Args:
    survival: `[B, K]` survivals.
    budget: int scalar (traced is fine).
    active: optional `[B]` bool.

  Returns:
    `[B, K]` bool; `mask.sum(-1)` is the per-slot `num_verified`.
  """
  survival, active = _check_survival(survival, active)
  budget = jnp.asarray(budget)
  _checks.rank("budget", budget, 0)
  _checks.integer("budget", budget)
  B, K = survival.shape
  return _allocation(_rank(_ranked_survival(survival, active)), budget, B, K)


def budget_and_allocation(survival: jax.typing.ArrayLike, cost: CostModel, *,
                          active: jax.typing.ArrayLike | None = None,
                          budget: jax.typing.ArrayLike | None = None
                          ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`choose_budget` and `allocate` from one shared sort (the planner's hot path).

  Args:
    survival: `[B, K]` survivals.
    cost: a `CostModel`.
    active: optional `[B]` bool.
    budget: the budget to allocate; None allocates this step's own optimal budget.

  Returns:
    `(optimal_budget [] int32, used_budget [] int32, mask [B, K] bool)`: the budget these
    survivals call for, the budget the mask was allocated with, and the mask.
  """
  survival, active = _check_survival(survival, active)
  B, K = survival.shape
  check_cost_table(cost, B, K)
  ranking = _rank(_ranked_survival(survival, active))
  optimal = _budget(ranking, cost, _num_active(active, B), K)
  used = optimal if budget is None else jnp.asarray(budget, jnp.int32)
  return optimal, used, _allocation(ranking, used, B, K)

