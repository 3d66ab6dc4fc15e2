"""`DrafterState` and its rows: the slots of a state (take, put, insert, keep), its
pending block's width (`widen` / `narrow`), windows of its `KVCache` cache, and `commit`,
which every kind shares. See the `av_jax.models.drafters` docstring."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from av_jax import _checks
from av_jax.models import transformer


class DrafterState(NamedTuple):
  """Per-slot drafter state (a pytree)."""
  cache: transformer.KVCache | None  # [L, B, H, M, Dh] own KV cache; None for parallel kinds
  tokens: jax.Array       # [B, K+1] int32 pending committed tokens (entries >= num_pending junk)
  hidden: jax.Array       # [B, K+1, D] target hidden state that predicted each pending token
  num_pending: jax.Array  # [B] int32 >= 1, valid entries of tokens / hidden
  position: jax.Array     # [B] int32 sequence position of tokens[:, 0]


def _pick(x: jax.Array, idx: jax.Array) -> jax.Array:
  """x[b, idx[b]] for x [B, P, ...]."""
  return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 1)), 1)[:, 0]


def _set_row(batched: jax.Array, single: jax.Array, slot: jax.Array, axis: int) -> jax.Array:
  start = [0] * batched.ndim
  start[axis] = slot
  return jax.lax.dynamic_update_slice(batched, single.astype(batched.dtype), start)


def insert_slot(batched: DrafterState, single: DrafterState, slot: jax.Array) -> DrafterState:
  """`batched` with slot `slot` replaced by the one-slot state `single` (prefill).

  Caches have the slot on axis 1 (`[L, B, H, M, Dh]`), every other field on axis 0.
  """
  return _insert_row(batched, single, _state_axes(batched), slot)


def keep_inactive(new: DrafterState, old: DrafterState, active: jax.Array) -> DrafterState:
  """`new` for the `active [B]` slots, `old` for the others, in every per-slot field.

  The cache is taken from `new` whole: entries above a slot's consumed prefix are never
  read (see the package docstring), so an inactive slot's cache needs no merge.
  """
  def keep(n, o):
    if n is None:  # a field left out (the engine's gated step sets it after its switch)
      return None
    return jnp.where(active.reshape(active.shape + (1,) * (n.ndim - 1)), n, o)
  return DrafterState(**{name: getattr(new, name) if name == "cache"
                         else keep(getattr(new, name), getattr(old, name))
                         for name in DrafterState._fields})


def widen(state: DrafterState, width: int) -> DrafterState:
  """`state` whose pending block holds up to `width` entries (zeros appended to `tokens`
  and `hidden`): `catch_up` then absorbs only when `width` entries are pending (see the
  package docstring, "Lazy catch-up").

  Raises:
    ValueError: `width` below the state's own pending columns.
  """
  have = state.tokens.shape[1]
  if isinstance(width, bool) or not isinstance(width, int) or width < have:
    raise ValueError(f"width: expected an int >= the state's {have} pending columns, got "
                     f"{width!r}")
  if width == have:
    return state
  pad = width - have
  return state._replace(tokens=jnp.pad(state.tokens, [(0, 0), (0, pad)]),
                        hidden=jnp.pad(state.hidden, [(0, 0), (0, pad), (0, 0)]))


def narrow(state: DrafterState, width: int) -> DrafterState:
  """The first `width` pending columns of `state` (what `draft` and `commit` take); the
  rows with more than `width` entries pending need `settle` first."""
  if width > state.tokens.shape[1]:
    raise ValueError(f"width: expected <= the state's {state.tokens.shape[1]} pending "
                     f"columns, got {width}")
  return state._replace(tokens=state.tokens[:, :width], hidden=state.hidden[:, :width])


class CacheWindow(NamedTuple):
  """Entries of a `KVCache` drafter cache at W consecutive positions of E rows: what a
  branch of the engine's gated step returns instead of the cache (`read_window`), written
  after the branch (`write_window`), so the cache is never a conditional's output (XLA
  copied such a cache whole on every step, also on steps that did not draft)."""
  k: jax.Array      # [L, E, W, H, Dh] (entry-major, whatever the cache's layout)
  v: jax.Array      # [L, E, W, H, Dh]
  slot: jax.Array   # [E] int32, the slot each row writes
  start: jax.Array  # [E] int32, the position of entry 0; >= M: the row writes nothing


def window_shape(cache: transformer.KVCache, *, rows: int, width: int) -> tuple[int, ...]:
  """`[L, E, W, H, Dh]`: the shape of a `CacheWindow` of `rows` rows and `width` entries."""
  L, _, H, _, Dh = cache.k.shape
  return (L, rows, width, H, Dh)


def window_start(position: jax.Array) -> jax.Array:
  """The first cache position a slot's pending block of `P` entries at sequence `position`
  writes, for every `KVCache` drafter: `draft_lm` writes positions `position + j`, the
  EAGLE head `position - 1 + j` (see `_make_eagle`), so a window of `P + 1` entries from
  here holds either."""
  return jnp.maximum(jnp.asarray(position, jnp.int32) - 1, 0)


def read_window(cache: transformer.KVCache, *, slot: jax.Array, start: jax.Array,
                width: int) -> CacheWindow:
  """The entries of `cache` rows `[E]` (its own row order) at positions `start + j`,
  `j < width`, to be written to slots `slot [E]` (rows with `start >= M` write none)."""
  M = transformer.cache_len(cache)
  rows = jnp.arange(start.shape[0])[:, None]
  pos = jnp.clip(start[:, None] + jnp.arange(width)[None], 0, M - 1)
  return CacheWindow(transformer.take_entries(cache.k, rows, pos),
                     transformer.take_entries(cache.v, rows, pos),
                     jnp.asarray(slot, jnp.int32), jnp.asarray(start, jnp.int32))


def write_window(cache: transformer.KVCache, window: CacheWindow) -> transformer.KVCache:
  """`cache` with `window`'s entries written (positions >= M dropped)."""
  M, W = transformer.cache_len(cache), window.k.shape[2]
  pos = window.start[:, None] + jnp.arange(W)[None]
  pos = jnp.where(pos < M, pos, M)
  slot = window.slot[:, None]
  return transformer.KVCache(transformer.put_entries(cache.k, window.k, slot, pos),
                             transformer.put_entries(cache.v, window.v, slot, pos))


def _slot_axis(field) -> int:
  return 1 if isinstance(field, transformer.KVCache) else 0


def _state_axes(state: DrafterState) -> DrafterState:
  """The slot axis of every leaf of a `DrafterState` (a pytree of ints of its structure):
  a `KVCache` cache's leaves on axis 1, every other leaf on axis 0."""
  return DrafterState(**{name: None if (f := getattr(state, name)) is None
                         else jax.tree.map(lambda _, a=_slot_axis(f): a, f)
                         for name in DrafterState._fields})


def _take_rows(state, axes, idx: jax.Array):
  """Rows `idx [E]` of every leaf of `state`, each on its slot axis (`axes`, a pytree of
  ints of the state's structure)."""
  return jax.tree.map(lambda x, a: jnp.take(x, idx, axis=a), state, axes)


def _put_rows(batched, sub, axes, idx: jax.Array, keep: jax.Array):
  """`batched` with rows `idx [E]` replaced by `sub`'s where `keep [E]`, leaf by leaf."""
  def put(b, s, axis):
    # Rows that do not keep scatter their slot's own values back (a no-op write).
    old = jnp.take(b, idx, axis=axis)
    mask = keep.reshape((1,) * axis + keep.shape + (1,) * (b.ndim - axis - 1))
    new = jnp.where(mask, s.astype(b.dtype), old)
    index = (slice(None),) * axis + (idx,)
    return b.at[index].set(new)
  return jax.tree.map(put, batched, sub, axes)


def _insert_row(batched, single, axes, slot: jax.Array):
  """`batched` with row `slot` replaced by the one-row `single`, leaf by leaf."""
  return jax.tree.map(lambda b, s, a: _set_row(b, s, slot, a), batched, single, axes)


def _where_rows(new, old, axes, mask: jax.Array):
  """`new` in the rows where `mask [B]`, `old` in the others, in every leaf."""
  def where(n, o, a):
    return jnp.where(mask.reshape((1,) * a + mask.shape + (1,) * (n.ndim - a - 1)), n, o)
  return jax.tree.map(where, new, old, axes)


def take_slots(state: DrafterState, idx: jax.typing.ArrayLike) -> DrafterState:
  """The rows `idx [E]` of `state`, in that order: a drafter state of E slots.

  A `KVCache` cache has the slot on axis 1, every other cache and field on axis 0 (as
  `insert_slot` documents). `Drafter.take_rows` of a `DrafterState` drafter.
  """
  idx = jnp.asarray(idx, jnp.int32)
  _checks.rank("idx", idx, 1, "E")
  return _take_rows(state, _state_axes(state), idx)


def put_slots(batched: DrafterState, sub: DrafterState, idx: jax.typing.ArrayLike,
              keep: jax.typing.ArrayLike) -> DrafterState:
  """`batched` with rows `idx [E]` replaced by the E-slot state `sub` where `keep [E]`.

  The inverse of `take_slots` for the rows that keep; rows that do not (padding rows of
  a draft bucket) leave their slot untouched, cache included. `idx` must be distinct.
  """
  idx = jnp.asarray(idx, jnp.int32)
  keep = jnp.asarray(keep, bool)
  _checks.shape("keep", keep, idx.shape, "E")
  return _put_rows(batched, sub, _state_axes(batched), idx, keep)


def commit(state: DrafterState, *, emitted_tokens: jax.typing.ArrayLike,
           num_emitted: jax.typing.ArrayLike,
           target_hidden: jax.typing.ArrayLike) -> DrafterState:
  """Advances the state past a verification step (the same for every kind).

  Args:
    state: the state returned by `draft`.
    emitted_tokens: `[B, K+1]` tokens emitted by verification (-1 after the last).
    num_emitted: `[B]` int number emitted (>= 1).
    target_hidden: `[B, K+1, D]` target hidden states of the verification inputs
      `[x_n, d_1..d_K]`; entry j predicted emitted token j.

  Returns:
    The state whose pending block is the emitted tokens.
  """
  emitted_tokens = jnp.asarray(emitted_tokens)
  num_emitted = jnp.asarray(num_emitted, jnp.int32)
  target_hidden = jnp.asarray(target_hidden)
  _checks.shape("emitted_tokens", emitted_tokens, state.tokens.shape, "BK")
  _checks.shape("target_hidden", target_hidden, state.hidden.shape, "BKD")
  _checks.shape("num_emitted", num_emitted, state.num_pending.shape, "B")
  return state._replace(tokens=jnp.maximum(emitted_tokens, 0).astype(jnp.int32),
                        hidden=target_hidden.astype(state.hidden.dtype),
                        num_pending=num_emitted,
                        position=state.position + state.num_pending)
