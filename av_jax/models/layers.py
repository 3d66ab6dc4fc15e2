"""Transformer building blocks shared by the target and every drafter.

Attention runs in one of four modes, chosen statically:

* `causal`: no cache; `x [B,S,D]`, token s attends to tokens of the same row with
  position <= its own (training and the uncached reference).
* `dense`: KV cache `[B,H,M,Dh]`; `x [B,S,D]` writes its K/V at `[b, position]` and then
  attends to cache entries of row b with position <= its own.
* `packed`: KV cache `[B,H,M,Dh]`; `x [T,D]` with `slot [T]`: token t writes its K/V at
  `[slot_t, position_t]` and attends to its slot's entries with position <= its own. Since
  all writes happen before the attention reads, earlier packed tokens of the same slot are
  seen exactly like cached ones.
* `packed_read`: as `packed`, but the cache is only read: token t attends to its slot's
  cached entries with position <= its own that no valid token of this pass writes, and
  to the valid tokens of this pass in its slot with position <= its own (their K/V as
  computed here). The same attention as `packed` (up to float rounding); the layer
  returns the tokens' K/V instead of a written cache, for the caller to write
  (`transformer.write_packed`). A cache updated inside a branch of a `lax.cond` /
  `lax.switch` in a decode loop is copied whole by XLA on every step; read here and
  written after the branch, it is updated in place. With `slot_width` W (at most W
  valid tokens per slot) the same attention runs per slot, reading each slot's cache
  once instead of gathering it for every token: every slot's first token from a `[B, 1]`
  layout, the later tokens of the slots holding several from an `[E, W - 1]` one, over
  the live positions only (`_attend_slotted_read`).
* `bidirectional`: no cache, no mask (the block drafter's K query slots).

The cache may store a narrower type than the computation (`ModelsConfig.kv_dtype`): every
mode attends to keys and values as the cache stores them, upcast to the queries' float32
(`_read`), this pass's own entries included, so all modes read the same values.

Writes at position >= M are dropped: callers mark invalid (padding) tokens by writing at
position M. Entries of a slot above the current position are never read, so stale K/V
left by rejected drafts needs no clearing; they are overwritten when that position is
written again.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

_MASKED = -1e30  # finite, so a row with every entry masked gives a uniform, not NaN, softmax


class LayerKV(NamedTuple):
  """KV cache of one attention layer, heads-major (see `transformer.KVCache`)."""
  k: jax.Array  # [B, H, M, Dh] keys (RoPE applied)
  v: jax.Array  # [B, H, M, Dh] values


def rope(x: jax.Array, positions: jax.Array, *, theta: float) -> jax.Array:
  """Rotary position embedding (Su et al. 2021), rotate-half form.

  Args:
    x: `[..., H, Dh]` queries or keys.
    positions: `[...]` integer positions.
    theta: base frequency.

  Returns:
    `[..., H, Dh]` rotated `x`.
  """
  half = x.shape[-1] // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = positions.astype(jnp.float32)[..., None, None] * freq  # [..., 1, Dh/2]
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class RMSNorm(nn.Module):
  """RMSNorm with a zero-initialised (1 + scale) gain."""

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param("scale", nn.initializers.zeros, (x.shape[-1],))
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + 1e-6) * (1.0 + scale)


class GatedMLP(nn.Module):
  """SwiGLU MLP: `down(silu(gate(x)) * up(x))`."""
  mlp_dim: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    d = x.shape[-1]
    gate = nn.Dense(self.mlp_dim, use_bias=False, name="gate")(x)
    up = nn.Dense(self.mlp_dim, use_bias=False, name="up")(x)
    return nn.Dense(d, use_bias=False, name="down")(nn.silu(gate) * up)


def _attend(q, k, v, mask):
  """softmax(q k^T / sqrt(Dh)) v with a boolean mask; einsum letters: h heads, d head dim."""
  scores = jnp.einsum("...qhd,...khd->...hqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
  scores = jnp.where(mask[..., None, :, :], scores, _MASKED)
  weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
  return jnp.einsum("...hqk,...khd->...qhd", weights, v)


def _attend_cache(q, k, v, mask):
  """`_attend` of queries `q [B, S, H, Dh]` to a heads-major cache `k, v [B, H, M, Dh]`
  under `mask [B, S, M]`: batched over (slot, head) with no transpose of the cache. Cache
  entries are read in the queries' dtype (`_read`)."""
  k, v = _read(k, q), _read(v, q)
  scores = jnp.einsum("bqhd,bhkd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
  scores = jnp.where(mask[:, None], scores, _MASKED)
  weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
  return jnp.einsum("bhqk,bhkd->bqhd", weights, v)


def _read(entries, q):
  """Cache `entries` in the dtype of the queries `q`: a cache stored in a narrower type
  (`ModelsConfig.kv_dtype`) is upcast where attention reads it, so the products and the
  softmax run in float32 whatever the cache holds (a no-op for a float32 cache)."""
  return entries.astype(q.dtype)


def _entries(cache_leaf, rows, positions, values):
  """`cache_leaf [B, H, M, Dh]` with `values [*S, H, Dh]` at `(rows, positions)` (index
  arrays broadcasting to S); positions >= M dropped."""
  return cache_leaf.at[rows, :, positions].set(values.astype(cache_leaf.dtype), mode="drop")


def pick_columns(x: jax.Array, pick: jax.Array) -> jax.Array:
  """`x[b, pick[b]]` kept as a column: `[B, S, ...]` -> `[B, 1, ...]`."""
  return jnp.take_along_axis(x, pick.reshape(pick.shape + (1,) * (x.ndim - 1)), 1)


def _attend_packed_read(q, k, v, cache: LayerKV, *, slot, positions, write_positions):
  """`packed` attention without writing the cache (mode `packed_read`, module doc).

  `q, k, v [T, H, Dh]`; `write_positions [T]` is `positions` for valid tokens and M for
  padding. Keys: the slot's cached entries (minus the positions this pass writes) and
  this pass's valid tokens of the same slot; one softmax over both.
  """
  batch, max_len = cache.k.shape[0], cache.k.shape[2]
  valid = write_positions < max_len
  written = jnp.zeros((batch, max_len), bool).at[slot, write_positions].set(True, mode="drop")
  m = jnp.arange(max_len)[None, :]
  old = (m <= positions[:, None]) & ~written[slot]                               # [T, M]
  new = (valid[None, :] & (slot[None, :] == slot[:, None])
         & (positions[None, :] <= positions[:, None]))                          # [T, T]
  scale = jnp.sqrt(q.shape[-1]).astype(q.dtype)
  keys, values = _read(cache.k[slot], q), _read(cache.v[slot], q)                # [T, H, M, Dh]
  s_old = jnp.einsum("thd,thmd->thm", q, keys) / scale
  s_new = jnp.einsum("thd,uhd->thu", q, k) / scale
  scores = jnp.concatenate([jnp.where(old[:, None, :], s_old, _MASKED),
                            jnp.where(new[:, None, :], s_new, _MASKED)], axis=-1)
  weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
  return (jnp.einsum("thm,thmd->thd", weights[..., :max_len], values)
          + jnp.einsum("thu,uhd->thd", weights[..., max_len:], v))


def length_buckets(max_len: int, *, smallest: int = 64, count: int = 2) -> tuple[int, ...]:
  """Static cache lengths attention is bounded by: `max_len` halved, at most `count`
  sizes, none below `smallest` (each is a compiled branch of every layer's attention).

  A pass attends over the smallest bucket that holds every position it reads (its
  tokens' largest position + 1), so its cost follows the live length, not `max_len`.
  E.g. `length_buckets(512)` is `(256, 512)`; `length_buckets(48)` is `(48,)`.
  """
  sizes = [max_len]
  while (len(sizes) < count and sizes[-1] // 2 >= smallest and sizes[-1] % 2 == 0):
    sizes.append(sizes[-1] // 2)
  return tuple(sorted(sizes))


def _bucket(sizes: tuple[int, ...], need: jax.Array) -> jax.Array:
  """Index of the smallest of `sizes` (ascending) >= `need`, the last if none is."""
  return jnp.minimum(jnp.searchsorted(jnp.asarray(sizes), need, side="left"),
                     len(sizes) - 1).astype(jnp.int32)


def draft_rows(batch: int) -> tuple[int, ...]:
  """Static row counts E of the slots verifying drafts in a pass: 1 and B (each is a
  compiled branch of every layer's attention, times the length buckets, times the
  engine's verify buckets: few, to bound compile time). A pass in which no slot holds
  several tokens takes E = 1, whose one row of later tokens is computed and discarded,
  rather than a branch of its own. E.g. `draft_rows(16)` is `(1, 16)`, `draft_rows(1)`
  is `(1,)`."""
  return tuple(sorted({1, batch}))


def _attend_rows(q, p, cache_k, cache_v, written, k, v, valid, positions, scale):
  """Per-row attention of `_attend_slotted_read`, one softmax over two sets of keys: the
  queries `q [R, I, H, Dh]` at positions `p [R, I]` of row r attend to the cache entries
  `cache_k, cache_v [R, H, m, Dh]` of row r with position <= their own that this pass does
  not write (`written [R, m]`), and to row r's tokens of this pass, `k, v [R, J, H, Dh]`
  where `valid [R, J]`, with `positions [R, J]` <= their own. Returns `[R, I, H, Dh]`."""
  m = cache_k.shape[2]
  old = (jnp.arange(m)[None, None, :] <= p[:, :, None]) & ~written[:, None, :]  # [R, I, m]
  new = valid[:, None, :] & (positions[:, None, :] <= p[:, :, None])            # [R, I, J]
  s_old = jnp.einsum("bihd,bhmd->bhim", q, cache_k) / scale
  s_new = jnp.einsum("bihd,bjhd->bhij", q, k) / scale
  scores = jnp.concatenate([jnp.where(old[:, None], s_old, _MASKED),
                            jnp.where(new[:, None], s_new, _MASKED)], axis=-1)
  weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
  return (jnp.einsum("bhim,bhmd->bihd", weights[..., :m], cache_v)
          + jnp.einsum("bhij,bjhd->bihd", weights[..., m:], v))


def _one_layer(x: jax.Array, layer: jax.Array | None, squeezed: bool) -> jax.Array:
  """Layer `layer` (an int or a scalar int array) of a stacked cache leaf
  `[L, B, H, M, Dh]` as `[B, H, M, Dh]` (`x` itself when `layer` is None); `squeezed`:
  `x` is `[L, H, M, Dh]`, the stacked leaf of a one-slot cache without its slot axis,
  which is put back. One-slot caches reach the
  attention branches so: XLA gives a conditional's operand with a size-1 axis a layout of
  its own, and copied the whole stacked cache into every layer's branch."""
  if layer is None:
    return x
  return x[layer][None] if squeezed else x[layer]


def _attend_slotted_read(q, k, v, cache: LayerKV, *, slot, positions, write_positions,
                         width: int, layer: jax.Array | None = None):
  """`_attend_packed_read` computed per slot, reading each slot's cache once.

  Every slot's first token of the pass attends from a `[B, 1]` layout (a plain step's
  attention, whatever the pass holds); the later tokens of the E slots that hold more
  than one (drafts under verification) attend from an `[E, width - 1]` layout over
  those slots' caches only. Two static sizes are picked per pass from the data
  (`lax.switch`, one branch each): E, the smallest of `draft_rows(B)` holding the slots
  with several tokens (0 where `width` is 1: base tokens alone), and the cache length read,
  the smallest of `length_buckets(M)` above every valid token's position (entries above
  a query's position are masked anyway). So verifying one slot's drafts costs a plain
  step's attention plus that slot's, and attention follows the live length, not M.
  E.g. B = 16, one slot verifying 8 drafts at position 200 of M = 512: queries `[16, 1]`
  and `[1, 8]` over 256 positions, where a `[16, 9]` layout over 512 computes 16x as
  many scores.

  Requires at most `width` valid tokens per slot (the engine's K + 1); a valid token
  beyond that would be dropped from the attention. `cache` is a layer's `[B, H, M, Dh]`,
  or with `layer` the stacked `[L, B, H, M, Dh]` (sliced inside the branch: only the
  live positions are copied for the products). Padding tokens' outputs are junk.
  """
  batch, max_len = cache.k.shape[-4], cache.k.shape[-2]
  valid = write_positions < max_len
  mine = valid[:, None] & (slot[:, None] == jnp.arange(batch)[None, :])          # [T, B]
  count = jnp.cumsum(mine, axis=0)
  rank = jnp.take_along_axis(count, slot[:, None], 1)[:, 0] - 1
  row = jnp.where(valid, rank, width)                                # padding -> dropped
  lay = lambda x, fill: jnp.full((batch, width) + x.shape[1:], fill, x.dtype).at[
      slot, row].set(x, mode="drop")
  Q, Kn, Vn = lay(q, 0), lay(k, 0), lay(v, 0)                        # [B, W, H, Dh]
  P = lay(positions, -1)                                             # [B, W]
  W = lay(valid, False)                                              # [B, W]
  written = jnp.zeros((batch, max_len), bool).at[slot, write_positions].set(True, mode="drop")
  scale = jnp.sqrt(q.shape[-1]).astype(q.dtype)
  multi = count[-1] >= 2 if count.shape[0] else jnp.zeros((batch,), bool)  # [B]
  # Slots with several tokens first (in slot order), then the others as padding rows.
  order = jnp.argsort(~multi, stable=True).astype(jnp.int32)        # [B]
  at = jnp.zeros((batch,), jnp.int32).at[order].set(jnp.arange(batch, dtype=jnp.int32))
  rows_e = draft_rows(batch) if width > 1 else (0,)
  lengths = length_buckets(max_len)
  live = jnp.max(jnp.where(valid, positions, 0)) + 1

  squeeze = layer is not None and batch == 1  # `_one_layer`

  def branch(e, m):
    def run(cache_k, cache_v):
      cache_k, cache_v = _one_layer(cache_k, layer, squeeze), _one_layer(cache_v, layer, squeeze)
      ck, cv = _read(cache_k[:, :, :m], q), _read(cache_v[:, :, :m], q)  # [B, H, m, Dh]
      wr = written[:, :m]
      # Part A: each slot's first token, to its cache and itself.
      first = _attend_rows(Q[:, :1], P[:, :1], ck, cv, wr, Kn, Vn, W, P, scale)[:, 0]
      out = first[slot]                                              # [T, H, Dh]
      if e == 0:  # a pass of one token per slot (`width` 1)
        return out
      # Part B: the later tokens of the first e slots of `order`.
      if e == batch:
        idx, ek, ev, ewr = jnp.arange(batch), ck, cv, wr
        pick = lambda x: x
      else:
        idx = order[:e]
        pick = lambda x: x[idx]
        ek, ev, ewr = ck[idx], cv[idx], wr[idx]                      # [e, H, m, Dh]
      pq, qq = pick(P)[:, 1:], pick(Q)[:, 1:]                        # [e, W-1]
      kn, vn, wn, pn = pick(Kn), pick(Vn), pick(W), pick(P)          # [e, W]
      later = _attend_rows(qq, pq, ek, ev, ewr, kn, vn, wn, pn, scale)  # [e, W-1, H, Dh]
      if e == batch:
        rows_t = slot
      else:
        rows_t = jnp.minimum(at[slot], e - 1)
      got = later[rows_t, jnp.clip(row - 1, 0, width - 2)]
      return jnp.where((row >= 1)[:, None, None], got, out)
    return run

  branches = [branch(e, m) for e in rows_e for m in lengths]
  index = (_bucket(rows_e, jnp.sum(multi)) * len(lengths)
           + _bucket(lengths, live)).astype(jnp.int32)
  operands = (cache.k[:, 0], cache.v[:, 0]) if squeeze else (cache.k, cache.v)
  return (branches[0](*operands) if len(branches) == 1
          else jax.lax.switch(index, branches, *operands))


class Attention(nn.Module):
  """Multi-head attention with RoPE and an optional explicit KV cache (see module doc)."""
  num_heads: int
  head_dim: int
  rope_theta: float
  mode: str  # "causal" | "dense" | "packed" | "packed_read" | "bidirectional"
  # packed_read: at most this many valid tokens per slot -> per-slot attention
  # (`_attend_slotted_read`); None: per token (`_attend_packed_read`).
  slot_width: int | None = None

  @nn.compact
  def __call__(self, x, positions, cache: LayerKV | None = None, slot=None,
               write_positions=None, pick=None, layer=None):
    """`pick [B]` (mode "dense" only): every column writes its keys and values, only
    column `pick[b]` of row b queries; the output is `[B, 1, D]`. `layer` (mode
    `packed_read` with `slot_width`, optional): `cache` is every layer's
    `[L, B, H, M, Dh]` and this is the layer's index, an int or a traced scalar (the
    layer is sliced where it is read, only the live positions)."""
    if pick is not None and self.mode != "dense":
      raise ValueError(f"pick: expected None outside mode 'dense', got mode {self.mode!r}")
    dense = lambda name: nn.DenseGeneral((self.num_heads, self.head_dim), use_bias=False,
                                         name=name)
    q, k, v = dense("q")(x), dense("k")(x), dense("v")(x)
    if self.mode != "bidirectional":
      q = rope(q, positions, theta=self.rope_theta)
      k = rope(k, positions, theta=self.rope_theta)
    new_cache = None
    if self.mode == "causal":
      mask = positions[..., None, :] <= positions[..., :, None]  # [B, S, S]
      out = _attend(q, k, v, mask)
    elif self.mode == "bidirectional":
      mask = jnp.ones(x.shape[:-1] + x.shape[-2:-1], bool)
      out = _attend(q, k, v, mask)
    elif self.mode == "dense":
      batch, max_len = cache.k.shape[0], cache.k.shape[2]
      rows = jnp.arange(batch)[:, None]
      new_cache = LayerKV(_entries(cache.k, rows, write_positions, k),
                          _entries(cache.v, rows, write_positions, v))
      mask = jnp.arange(max_len)[None, None, :] <= positions[:, :, None]  # [B, S, M]
      if pick is not None:
        q, mask = pick_columns(q, pick), pick_columns(mask, pick)
      out = _attend_cache(q, new_cache.k, new_cache.v, mask)
    elif self.mode == "packed":
      max_len = cache.k.shape[2]
      new_cache = LayerKV(_entries(cache.k, slot, write_positions, k),
                          _entries(cache.v, slot, write_positions, v))
      keys, values = new_cache.k[slot], new_cache.v[slot]  # [T, H, M, Dh]
      mask = jnp.arange(max_len)[None, None, :] <= positions[:, None, None]  # [T, 1, M]
      out = _attend_cache(q[:, None], keys, values, mask)[:, 0]
    elif self.mode == "packed_read":
      # This pass's entries are attended to as the cache stores them, as the modes that
      # write before they read do: every mode reads the same values.
      ks, vs = _read(k.astype(cache.k.dtype), q), _read(v.astype(cache.v.dtype), q)
      if self.slot_width is None:
        out = _attend_packed_read(q, ks, vs, cache, slot=slot, positions=positions,
                                  write_positions=write_positions)
      else:
        out = _attend_slotted_read(q, ks, vs, cache, slot=slot, positions=positions,
                                   write_positions=write_positions, width=self.slot_width,
                                   layer=layer)
      new_cache = LayerKV(k, v)  # [T, H, Dh]: this pass's entries, to be written
    else:
      raise ValueError(f"unknown attention mode {self.mode!r}")
    out = nn.DenseGeneral(x.shape[-1], axis=(-2, -1), use_bias=False, name="o")(out)
    return out, new_cache


class Block(nn.Module):
  """Pre-norm transformer block: attention then gated MLP, both residual."""
  num_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float
  mode: str
  slot_width: int | None = None  # `Attention.slot_width`

  @nn.compact
  def __call__(self, x, positions, cache=None, slot=None, write_positions=None, pick=None,
               layer=None):
    """`pick [B]`: only column `pick[b]` of row b goes on past the keys and values
    (`Attention`'s pick): the output is `[B, 1, D]`. `layer`: `Attention`'s."""
    attn = Attention(self.num_heads, self.head_dim, self.rope_theta, self.mode,
                     self.slot_width, name="attn")
    h, new_cache = attn(RMSNorm(name="attn_norm")(x), positions, cache, slot, write_positions,
                        pick, layer)
    x = (x if pick is None else pick_columns(x, pick)) + h
    x = x + GatedMLP(self.mlp_dim, name="mlp")(RMSNorm(name="mlp_norm")(x))
    return x, new_cache
