"""Catch-up of the rows that skip drafting (`catch_up`), the lazy backlog (`settle`), and
the in-place updates of a draft bucket's rows behind `Drafter.draft_rows`,
`settle_rows` and `write_back`. See the `av_jax.models.drafters` docstring ("Catch-up",
"Lazy catch-up")."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from av_jax import _checks
from av_jax.models import transformer
from av_jax.models.drafters.state import (CacheWindow, DrafterState, _pick, keep_inactive,
                                          narrow, put_slots, read_window, take_slots, widen,
                                          window_shape, window_start, write_window)

if TYPE_CHECKING:  # annotations only: protocol imports this module
  from av_jax.models.drafters.protocol import Drafter


def settle(drafter: Drafter, params, target_params, state: DrafterState, *,
           width: int, window: bool = False, whole: bool = False):
  """`state` narrowed to `width` pending columns after absorbing any backlog: every slot
  with more than `width` entries pending absorbs all but the newest (`Drafter.absorb`, run
  only when some slot has a backlog), which becomes its pending block; other slots are
  narrowed as they are. The absorb runs on the fewest columns that hold every backlog
  (`width` x 2^i, or the state's own). The result drafts what the slot would have drafted
  had its drafter absorbed every block as it filled (tested: tests/test_drafter_catchup.py).

  Args:
    drafter: the drafter (with `absorb` when `state` is wider than `width`).
    params: drafter parameters.
    target_params: target parameters.
    state: a `widen`ed state (pending columns >= `width`).
    width: the pending columns `draft` takes (K + 1).
    window: (a `KVCache` cache only) return `(state, CacheWindow)`: the state with its
      cache as it was and the entries the absorb wrote (`write_window` writes them).
    whole: absorb on the state's own columns only (one compiled absorb, not one per
      width): for rows of which some hold a full backlog, whose absorb is that width.
  """
  if window and not isinstance(state.cache, transformer.KVCache):
    raise ValueError(f"window: expected a KVCache drafter cache, got {type(state.cache)}")
  if state.tokens.shape[1] == width:
    if window:
      return state, read_window(state.cache, slot=jnp.arange(state.tokens.shape[0]),
                                start=jnp.full(state.position.shape,
                                                 transformer.cache_len(state.cache)),
                                width=width + 1)
    return state
  if drafter.absorb is None:
    raise ValueError(f"drafter: {drafter.kind!r} has no `absorb`, so its state cannot hold "
                     "a backlog")
  over = state.num_pending > width
  backlog = state._replace(num_pending=jnp.where(over, state.num_pending - 1, 0))
  # The absorb runs on the fewest pending columns that hold every backlog: `width`
  # doubled until the state's own (a slot re-checked after 12 gated-off steps absorbs 16
  # columns, not the whole backlog width); branch 0 absorbs nothing.
  widths, w = [], width
  while w < state.tokens.shape[1] and not whole:
    widths.append(w)
    w *= 2
  widths.append(state.tokens.shape[1])
  need = jnp.max(backlog.num_pending)
  branch = jnp.where(jnp.any(over),
                     1 + jnp.searchsorted(jnp.asarray(widths), need, side="left"), 0)
  absorb = lambda w: lambda: drafter.absorb(params, target_params, narrow(backlog, w)).cache
  if isinstance(state.cache, transformer.KVCache):
    # The branches return the written entries (`read_window`), written after the switch:
    # a cache returned by a branch is copied whole (XLA's copy insertion).
    E, P, M = state.tokens.shape[0], state.tokens.shape[1], transformer.cache_len(state.cache)
    slot = jnp.arange(E, dtype=jnp.int32)
    start = jnp.where(over, window_start(state.position), M)
    entries = lambda w: lambda: read_window(absorb(w)(), slot=slot, start=start,
                                            width=P + 1)
    shape = window_shape(state.cache, rows=E, width=P + 1)
    nothing = lambda: CacheWindow(jnp.zeros(shape, state.cache.k.dtype),
                                  jnp.zeros(shape, state.cache.v.dtype), slot,
                                  jnp.full((E,), M, jnp.int32))
    written = jax.lax.switch(branch, [nothing] + [entries(w) for w in widths])
    cache = state.cache if window else write_window(state.cache, written)
  else:
    cache = jax.lax.switch(branch, [lambda: state.cache] + [absorb(w) for w in widths])
  newest = state.num_pending - 1
  tokens = jnp.where(over[:, None], state.tokens.at[:, 0].set(_pick(state.tokens, newest)),
                     state.tokens)
  hidden = jnp.where(over[:, None, None],
                     state.hidden.at[:, 0].set(_pick(state.hidden, newest)), state.hidden)
  settled = DrafterState(cache=cache, tokens=tokens[:, :width], hidden=hidden[:, :width],
                         num_pending=jnp.where(over, 1, state.num_pending),
                         position=jnp.where(over, state.position + newest, state.position))
  return (settled, written) if window else settled


def can_skip(drafter: Drafter) -> bool:
  """Whether `catch_up` can keep a `DrafterState` drafter current on steps it does not
  draft: a parallel drafter (no cache, by the protocol) or one with `absorb`. The engine
  skips rows of a drafter that also declares `Drafter.skips` (`Drafter.skips_rows`)."""
  return drafter.drafting == "parallel" or drafter.absorb is not None


def catch_up(drafter: Drafter, params, target_params, state: DrafterState, *,
             token: jax.typing.ArrayLike, hidden: jax.typing.ArrayLike,
             mask: jax.typing.ArrayLike, absorb: bool = True) -> DrafterState:
  """The state after a step that emitted one target token without drafting, per slot.

  For the slots in `mask`, the committed `token` and the target `hidden` state that
  predicted it join the pending block; a full block (K+1 entries, or the P of a `widen`ed
  state) is consumed into the
  cache first (`Drafter.absorb`, run only when some masked slot is full; the cache is
  taken whole, as in `keep_inactive`: entries above a slot's consumed prefix are never
  read). A drafter without `absorb` (parallel, no cache) gets the one token as its
  pending block, what `commit` of a one-token step gives. Other slots keep their state.
  See the package docstring ("Catch-up").

  Args:
    drafter: the drafter (`can_skip(drafter)` must hold).
    params: drafter parameters.
    target_params: target parameters (EAGLE reads the tied embedding).
    state: the drafter state after the previous step's commit (or catch-up).
    token: `[B]` int32 token the target emitted.
    hidden: `[B, D]` target hidden state of the base token (the one that predicted
      `token`).
    mask: `[B]` bool, the slots that emitted without drafting.
    absorb: False: the caller guarantees that no slot in `mask` has a full block (the
      engine's lazy catch-up absorbs full backlogs in its draft bucket, `settle`), and no
      absorb is compiled in.

  Returns:
    The caught-up `DrafterState`.

  Raises:
    ValueError: an autoregressive drafter without `absorb`.

  Example:
    >>> state = catch_up(drafter, dp, tp, state, token=tok, hidden=h[:, 0], mask=~drafted)
  """
  if not can_skip(drafter):
    raise ValueError(f"drafter: {drafter.kind!r} keeps a cache and has no `absorb`, so a "
                     "step cannot skip drafting it")
  token = jnp.asarray(token, jnp.int32)
  hidden = jnp.asarray(hidden)
  mask = jnp.asarray(mask, bool)
  B, width = state.tokens.shape
  _checks.shape("token", token, (B,), "B")
  _checks.shape("hidden", hidden, (B, state.hidden.shape[-1]), "BD")
  _checks.shape("mask", mask, (B,), "B")
  if drafter.absorb is None:
    full = jnp.ones((B,), bool)  # no cache: the block restarts at every token
    cache = state.cache
  elif not absorb:
    full = jnp.zeros((B,), bool)
    cache = state.cache
  else:
    full = state.num_pending >= width
    cache = jax.lax.cond(jnp.any(full & mask),
                         lambda: drafter.absorb(params, target_params, state).cache,
                         lambda: state.cache)
  at = jnp.where(full, 0, state.num_pending)
  # Rows outside `mask` write at column `width`, which is dropped: each step writes B
  # entries of the pending block in place, never the whole block.
  column, rows = jnp.where(mask, at, width), jnp.arange(B)
  return DrafterState(
      cache=cache,
      tokens=state.tokens.at[rows, column].set(token, mode="drop"),
      hidden=state.hidden.at[rows, column].set(hidden.astype(state.hidden.dtype),
                                               mode="drop"),
      num_pending=jnp.where(mask, at + 1, state.num_pending),
      position=jnp.where(mask & full, state.position + state.num_pending, state.position))


# ------------------------------------------------- rows of a DrafterState, in place


class _Written(NamedTuple):
  """The update of a `DrafterState` with a `KVCache` cache and a backlog that a draft
  bucket's branch returns (`Drafter.draft_rows`): the cache entries its rows wrote,
  written after the switch (`write_window`), and the rows' pending counts; the pending
  block `[B, P(, D)]` stays out of the switch too (a settled row's newest entry moves to
  column 0, redone after it: `_write_back`)."""
  window: CacheWindow         # B rows (rows that write nothing start at M)
  rows: DrafterState          # num_pending [B] and position [B]; cache, tokens, hidden None
  settled: jax.Array          # [B] bool, the rows that absorbed a backlog


def _windowed(drafter: Drafter, state, K: int) -> bool:
  """A `DrafterState` with a `KVCache` cache and a backlog (wider than K + 1): the
  engine's branches return the entries its rows write, written after the switch."""
  return (drafter.slot_axis is None and isinstance(state.cache, transformer.KVCache)
          and state.tokens.shape[1] > K + 1)


def _pending_counts(state: DrafterState) -> DrafterState:
  return state._replace(cache=None, tokens=None, hidden=None)


def _empty_window(cache: transformer.KVCache, *, rows: int, width: int) -> CacheWindow:
  """A window of `rows` rows that writes nothing."""
  z = jnp.zeros(window_shape(cache, rows=rows, width=width), cache.k.dtype)
  return CacheWindow(z, z, jnp.zeros((rows,), jnp.int32),
                     jnp.full((rows,), transformer.cache_len(cache), jnp.int32))


def _written(state: DrafterState, window: CacheWindow, new: DrafterState,
             rows: jax.Array | None, keep: jax.Array, settled: jax.Array) -> _Written:
  """The update of rows `rows [E]` (None: every row) of `state`: `window` padded to B
  rows, `new`'s pending counts where `keep [E]`, and `settled [E]` as B rows."""
  if rows is None:
    return _Written(window, keep_inactive(_pending_counts(new), _pending_counts(state),
                                          keep), settled)
  B, E = state.tokens.shape[0], rows.shape[0]
  if E < B:  # every branch returns B rows
    pad = _empty_window(state.cache, rows=B - E, width=window.k.shape[2])
    window = CacheWindow(*(jnp.concatenate([a, b], axis=1 if a.ndim > 1 else 0)
                           for a, b in zip(window, pad)))
  return _Written(window, put_slots(_pending_counts(state), _pending_counts(new), rows, keep),
                  jnp.zeros((B,), bool).at[rows].set(settled))


def _draft_rows(drafter: Drafter, params, target_params, state, key: jax.Array, *,
                rows: jax.Array | None, keep: jax.Array, K: int, **kwargs):
  """`Drafter.draft_rows`."""
  sub = state if rows is None else drafter.take_rows(state, rows)
  if drafter.slot_axis is not None:  # a state of the author's layout: no backlog
    out = drafter.draft(params, target_params, sub, key, K=K, **kwargs)
    return out, (drafter.keep_rows(out.state, state, keep) if rows is None
                 else drafter.put_rows(state, out.state, rows, keep))
  width = state.tokens.shape[1]
  start, pending = sub.position, sub.num_pending
  # Lazy catch-up: a row first absorbs its backlog.
  sub = settle(drafter, params, target_params, sub, width=K + 1)
  out = drafter.draft(params, target_params, sub, key, K=K, **kwargs)
  new = widen(out.state, width)
  if not _windowed(drafter, state, K):
    return out, (keep_inactive(new, state, keep) if rows is None
                 else put_slots(state, new, rows, keep))
  # The entries the rows wrote (`width + 1` positions from `window_start`), written after
  # the caller's switch: a cache a branch returns is copied whole (XLA's copy insertion).
  idx = jnp.arange(state.tokens.shape[0], dtype=jnp.int32) if rows is None else rows
  window = read_window(new.cache, slot=idx,
                       start=jnp.where(keep, window_start(start),
                                       transformer.cache_len(state.cache)),
                       width=width + 1)
  return out, _written(state, window, new, rows, keep, keep & (pending > K + 1))


def _settle_rows(drafter: Drafter, params, target_params, state: DrafterState, *,
                 rows: jax.Array | None, keep: jax.Array, K: int) -> _Written:
  """`Drafter.settle_rows`: one absorb over the rows, no drafter pass."""
  sub = state if rows is None else take_slots(state, rows)
  idx = jnp.arange(state.tokens.shape[0], dtype=jnp.int32) if rows is None else rows
  # The engine settles rows of which some hold a full backlog (`Drafter.full_rows`), so
  # only the whole width's absorb is ever taken.
  settled, window = settle(drafter, params, target_params, sub, width=K + 1, window=True,
                           whole=True)
  window = window._replace(slot=idx, start=jnp.where(keep, window.start,
                                                     transformer.cache_len(state.cache)))
  return _written(state, window, settled, rows, keep, keep & (sub.num_pending > K + 1))


def _write_back(state: DrafterState, update: _Written) -> DrafterState:
  """`state` with a `_Written` update: the window written into the cache, the settled
  rows' newest pending entry moved to column 0 (what `settle` did in the branch)."""
  B = state.tokens.shape[0]
  newest, rows = state.num_pending - 1, jnp.arange(B)
  first = lambda x: x.at[rows, 0].set(jnp.where(
      update.settled.reshape((B,) + (1,) * (x.ndim - 2)), x[rows, newest], x[:, 0]))
  return DrafterState(cache=write_window(state.cache, update.window),
                      tokens=first(state.tokens), hidden=first(state.hidden),
                      num_pending=update.rows.num_pending, position=update.rows.position)
