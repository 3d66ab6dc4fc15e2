"""Measured cost tables for any target and drafter (spec section 8), engine or not.

The planner chooses the verification budget against a `CostModel`: what a drafting step
and a verification step of T packed tokens cost on the device in use. A serving stack
verifies in a few padded sizes (buckets), so the verify table is a step function of the
bucket: T tokens cost what the smallest bucket >= T costs. Every program is timed the
same way the engine profiles its own (`av_jax.engine.profile`): two warm-up calls
(compile, then caches), then the median of `repeats` timed calls, each waited on with
`jax.block_until_ready`. A table that falls as work grows (timing noise) is repaired to
its running maximum by `make_cost_model`, with a warning.

Only the shapes the caller runs are timed: a step packs at most `max_tokens` tokens
(default `num_slots * (max_draft + 1)`, every slot verifying all its drafts; for a
serving stack `max_num_seqs * (1 + K)` at most), so the buckets past the first one that
holds `max_tokens` are never run and not timed. A bound the planner can exceed is
refused: the planner prices verifications of up to `num_slots * (max_draft + 1)` tokens,
and a table that stops short would price the rest at its last entry. E.g. buckets
(8, 16, 32, 64, 128), 4 slots, K = 7: T <= 32, so 8, 16 and 32 are timed, 64 and 128 not.

Example (a user's own jitted target forward and drafter):

  >>> cost = profile_costs(
  ...     verify_fn, draft_fn,
  ...     verify_args=lambda T: (params, jnp.zeros((T,), jnp.int32)),  # a bucket's inputs
  ...     draft_args=(draft_params, last_tokens, key),
  ...     buckets=(8, 16, 32), num_slots=4, max_draft=7)
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from av_jax.selection import CostModel, make_cost_model


def median_ms(fn: Callable[..., Any], *args: Any, repeats: int = 5) -> float:
  """Median wall time of `fn(*args)` in milliseconds, after two warm-up calls.

  Args:
    fn: the program to time, typically jitted; its outputs are waited on.
    *args: its arguments, built once outside the timed calls.
    repeats: timed calls after the warm-up (>= 1).

  Returns:
    The median of the `repeats` timings, in milliseconds.
  """
  if repeats < 1:
    raise ValueError(f"repeats: expected >= 1, got {repeats}")
  jax.block_until_ready(fn(*args))  # compile + warm-up
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) * 1e3)
  return float(np.median(times))


def step_cost_model(buckets: Sequence[int], bucket_ms: Sequence[float], draft_ms: float, *,
                    num_slots: int, max_tokens: int) -> CostModel:
  """`CostModel` whose verify table is a step function of the buckets' measured times.

  T tokens cost what the smallest bucket >= T costs (T past the last bucket: the last
  bucket's). Drafting is flat in the number of active requests R: a batched drafter
  drafts for all `num_slots` slots whatever R is. The tables go through
  `make_cost_model` unrepaired, so a non-monotone profile is repaired there with a
  warning naming the entries.

  Args:
    buckets: increasing packed sizes T the verify program was timed at.
    bucket_ms: `[len(buckets)]` measured verify time of each bucket.
    draft_ms: measured time of one drafting step for all slots.
    num_slots: B, the batch size (the draft table has B + 1 entries).
    max_tokens: T_max, the most tokens one verification step packs (B (K + 1)).

  Returns:
    A `CostModel` with `draft_ms [B + 1]` and `verify_ms [T_max + 1]`.
  """
  buckets = np.asarray(buckets)
  bucket_ms = np.asarray(bucket_ms, np.float64)
  if buckets.ndim != 1 or buckets.size == 0 or bucket_ms.shape != buckets.shape:
    raise ValueError(f"bucket_ms: expected one time per bucket ({buckets.shape}), got "
                     f"shape {bucket_ms.shape}")
  t = np.arange(max_tokens + 1)
  index = np.minimum(np.searchsorted(buckets, t, side="left"), len(buckets) - 1)
  return make_cost_model(np.full(num_slots + 1, float(draft_ms)), bucket_ms[index])


def bounded_buckets(buckets: Sequence[int], max_tokens: int) -> tuple[int, ...]:
  """The buckets a caller whose steps pack at most `max_tokens` tokens runs: every one up
  to the first that holds `max_tokens`. E.g. (8, 16, 32, 64), 20 -> (8, 16, 32).

  Raises:
    ValueError: naming `buckets`, when they are not strictly increasing positive sizes
      or none holds `max_tokens` (the sizes left without a bucket are named).
  """
  buckets = tuple(int(b) for b in buckets)
  if not buckets or any(b < 1 for b in buckets) or any(
      a >= b for a, b in zip(buckets, buckets[1:])):
    raise ValueError(f"buckets: expected strictly increasing positive sizes, got {buckets}")
  if buckets[-1] < max_tokens:
    raise ValueError(f"buckets: no bucket holds the {max_tokens} tokens a step packs at "
                     f"most; the largest is {buckets[-1]}, so T = {buckets[-1] + 1}.."
                     f"{max_tokens} are missing (add a bucket >= {max_tokens})")
  first = next(i for i, b in enumerate(buckets) if b >= max_tokens)
  return buckets[:first + 1]


def _check_bound(max_tokens: int | None, *, num_slots: int, max_draft: int) -> int:
  """`max_tokens` (default B (K + 1)), refused when the planner would query past it."""
  planner_max = num_slots * (max_draft + 1)
  if max_tokens is None:
    return planner_max
  if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)):
    raise ValueError(f"max_tokens: expected an int, got {max_tokens!r}")
  if max_tokens < planner_max:
    raise ValueError(
        f"max_tokens: the planner prices verifications of up to num_slots * (max_draft + 1) "
        f"= {planner_max} tokens (every slot verifying all its drafts); a table bounded at "
        f"{max_tokens} misses T = {max_tokens + 1}..{planner_max}")
  return int(max_tokens)


def check_cost_covers(cost: CostModel, *, num_slots: int, max_draft: int) -> None:
  """Refuses a `CostModel` that does not cover the shapes the planner queries.

  The planner reads `draft_ms[R]` for R <= B drafting requests and `verify_ms[T]` for
  T <= B (K + 1) packed tokens; under jit an index past a table is clamped to its last
  entry, pricing the missing shapes silently. E.g. B = 4, K = 7 needs `draft_ms [5]` and
  `verify_ms [33]`.

  Raises:
    ValueError: naming the table and the sizes it misses.
  """
  need = {"cost.draft_ms": num_slots + 1, "cost.verify_ms": num_slots * (max_draft + 1) + 1}
  for name, size in need.items():
    have = np.shape(getattr(cost, name.split(".")[1]))[-1]
    if have < size:
      raise ValueError(f"{name}: covers {have - 1} at most, the planner of num_slots="
                       f"{num_slots}, max_draft={max_draft} queries up to {size - 1}: "
                       f"{have}..{size - 1} are missing")


def measure_costs(
    verify_fn: Callable[..., Any],
    draft_fn: Callable[..., Any] | None,
    *,
    verify_args: Callable[[int], Sequence[Any]],
    draft_args: Sequence[Any] = (),
    buckets: Sequence[int],
    num_slots: int,
    max_draft: int,
    repeats: int = 5,
    max_tokens: int | None = None,
) -> dict:
  """Times the user's verify program at every bucket the caller runs and their drafter once.

  Args:
    verify_fn: the target's verification program (jitted), called as
      `verify_fn(*verify_args(T))` for every bucket size T.
    draft_fn: one drafting step for all `num_slots` slots (K tokens each, with its
      sampling), called as `draft_fn(*draft_args)`; None for a drafter that costs
      nothing (e.g. prompt lookup).
    verify_args: bucket size T -> the arguments of one verification of T packed tokens.
      Build realistic inputs (positions mid-cache, all rows valid): they are what the
      timed program reads.
    draft_args: the drafter's arguments.
    buckets: strictly increasing packed sizes; one must hold `max_tokens` tokens.
    num_slots: B, the batch size the drafter and planner see.
    max_draft: K, the most draft tokens per slot.
    repeats: timed calls per program after the warm-up (median taken).
    max_tokens: the most tokens one of the caller's verification steps packs (default
      and least B (K + 1)); buckets past the first that holds it are not timed.

  Returns:
    A JSON-able profile: `buckets` (those timed), `bucket_ms`, `skipped_buckets` (never
    run, not timed), `max_tokens`, `draft_ms`, `repeats`, `device_kind`, `num_slots`,
    `max_draft`.

  Raises:
    ValueError: naming the argument: `max_tokens` below B (K + 1), `buckets` none of
      which holds `max_tokens` (the missing sizes named), bad counts.
  """
  if num_slots < 1 or max_draft < 1:
    raise ValueError(f"num_slots and max_draft: expected >= 1, got {num_slots}, {max_draft}")
  if repeats < 1:
    raise ValueError(f"repeats: expected >= 1, got {repeats}")
  max_tokens = _check_bound(max_tokens, num_slots=num_slots, max_draft=max_draft)
  timed = bounded_buckets(buckets, max_tokens)
  bucket_ms = [median_ms(verify_fn, *verify_args(size), repeats=repeats) for size in timed]
  draft_ms = 0.0 if draft_fn is None else median_ms(draft_fn, *draft_args, repeats=repeats)
  return dict(device_kind=jax.devices()[0].device_kind, buckets=list(timed),
              bucket_ms=bucket_ms, skipped_buckets=[int(b) for b in buckets][len(timed):],
              max_tokens=max_tokens, draft_ms=draft_ms, repeats=repeats,
              num_slots=num_slots, max_draft=max_draft)


def profile_costs(
    verify_fn: Callable[..., Any],
    draft_fn: Callable[..., Any] | None,
    *,
    verify_args: Callable[[int], Sequence[Any]],
    draft_args: Sequence[Any] = (),
    buckets: Sequence[int],
    num_slots: int,
    max_draft: int,
    repeats: int = 5,
    max_tokens: int | None = None,
) -> CostModel:
  """Measured `CostModel` for the user's own target and drafter.

  `measure_costs` (same arguments), then `step_cost_model`: the verify table is a step
  function of the buckets, the draft table flat, a non-monotone profile repaired with a
  `UserWarning`. Profile once per device kind and batch configuration, on the devices
  and sharding the server runs with, and pass the result to the planner's `plan`. Only
  the buckets up to the first that holds `max_tokens` are timed (module docstring).

  Returns:
    A `CostModel` with `draft_ms [num_slots + 1]` and `verify_ms [max_tokens + 1]`
    (`max_tokens` default `num_slots * (max_draft + 1)`).

  Raises:
    ValueError: as `measure_costs`, naming what the table would miss.

  Example:
    >>> cost = profile_costs(verify, draft, verify_args=lambda T: (params, tokens[:T]),
    ...                      draft_args=(dparams, last, key), buckets=(8, 16, 32),
    ...                      num_slots=4, max_draft=7)
    >>> planner = make_planner(policy="lagged")
  """
  profile = measure_costs(verify_fn, draft_fn, verify_args=verify_args,
                          draft_args=draft_args, buckets=buckets, num_slots=num_slots,
                          max_draft=max_draft, repeats=repeats, max_tokens=max_tokens)
  cost = step_cost_model(profile["buckets"], profile["bucket_ms"], profile["draft_ms"],
                         num_slots=num_slots, max_tokens=profile["max_tokens"])
  check_cost_covers(cost, num_slots=num_slots, max_draft=max_draft)
  return cost
