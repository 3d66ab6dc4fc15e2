"""The decoder-only transformer used as target and as the independent draft LM.

RoPE, RMSNorm, SwiGLU MLP, tied input/output embedding, explicit KV cache. All entry
points are pure functions of `(params, ...)` with the config static, so they run under
`jax.jit` / `lax.scan` without closing over parameters.

Example:
  >>> cfg = TransformerConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2,
  ...                         head_dim=16, mlp_dim=64)
  >>> params = init_params(cfg, jax.random.key(0))
  >>> cache = init_cache(cfg, batch=2, max_len=16)
  >>> out = forward(params, tokens, positions, cache, cfg=cfg)  # logits [2, S, 64]
"""

from __future__ import annotations

import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from av_jax import _checks
from av_jax.models.checkpoint import stack_layers
from av_jax.models.config import TransformerConfig
from av_jax.models.layers import Block, LayerKV, RMSNorm, pick_columns


class KVCache(NamedTuple):
  """Per-slot KV cache of all layers, heads-major: each `(slot, head)` holds its M
  positions contiguously, the layout attention's batched matrix products read directly
  (a position-major `[.., M, H, Dh]` cache is transposed whole, per layer and step, to
  feed them)."""
  k: jax.Array  # [L, B, H, M, Dh] keys, RoPE applied, entry m holds position m
  v: jax.Array  # [L, B, H, M, Dh] values


def cache_len(cache: KVCache) -> int:
  """M, the positions per slot of `cache`."""
  return cache.k.shape[3]


def take_entries(x: jax.Array, slot: jax.Array, positions: jax.Array) -> jax.Array:
  """Entries `[L, *S, H, Dh]` of a cache leaf `x [L, B, H, M, Dh]` at `(slot, positions)`
  (int arrays broadcasting to a shape S); positions must be in range."""
  n = jnp.broadcast_shapes(jnp.shape(slot), jnp.shape(positions))
  y = x[:, slot, :, positions]                          # [*S, L, H, Dh]
  return jnp.moveaxis(y, tuple(range(len(n))), tuple(range(1, 1 + len(n))))


def put_entries(x: jax.Array, entries: jax.Array, slot: jax.Array,
                positions: jax.Array) -> jax.Array:
  """`x [L, B, H, M, Dh]` with `entries [L, *S, H, Dh]` written at `(slot, positions)`;
  positions >= M are dropped (padding). A scatter into `x`: in place when `x` is donated
  or a loop's carry."""
  n = jnp.broadcast_shapes(jnp.shape(slot), jnp.shape(positions))
  vals = jnp.moveaxis(entries.astype(x.dtype), tuple(range(1, 1 + len(n))),
                      tuple(range(len(n))))             # [*S, L, H, Dh]
  return x.at[:, slot, :, positions].set(vals, mode="drop")


class ForwardOutput(NamedTuple):
  """Output of a forward pass (dense: leading `[B, S]`; packed: leading `[T]`)."""
  logits: jax.Array        # [B, S, V] / [T, V] float32 next-token logits
  hidden: jax.Array        # [B, S, D] / [T, D] final hidden state (after the final norm)
  cache: KVCache | None    # updated cache, None when run without one


def embed_init(d_model: int):
  # Unit-RMS inputs after the sqrt(D) scale, unit-scale logits from unit-RMS hidden states.
  return nn.initializers.normal(stddev=1.0 / math.sqrt(d_model))


class Transformer(nn.Module):
  """Decoder-only transformer; `mode` is the attention mode (see `layers`).

  The layers are one `Block` scanned `num_layers` times (`nn.scan`): their parameters
  are stacked on a leading axis (`params["layers"]`, e.g. the query kernel
  `[L, D, H, Dh]`), so a pass compiles one layer's program, run L times by a loop, not
  L copies of it; every engine program holds several passes, so this bounds its compile.
  """
  cfg: TransformerConfig
  mode: str = "causal"
  slot_width: int | None = None  # packed_read: `layers.Attention.slot_width`

  @nn.compact
  def __call__(self, tokens, positions, cache: KVCache | None = None, slot=None,
               write_positions=None, pick=None):
    """`pick [B]` (mode "dense"): every column writes every layer's cache; the final
    norm and the head run only on row b's column `pick[b]` (outputs `[B, 1, ...]`)."""
    cfg = self.cfg
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=embed_init(cfg.d_model),
                     name="embed")
    x = embed(tokens) * math.sqrt(cfg.d_model)
    # The slotted read pass hands every layer the whole stacked cache and its index: a
    # layer's slice taken outside the attention would be copied whole (XLA:CPU
    # materialises a slice that feeds a product), where the attention slices the live
    # positions only. Every other cached mode scans the cache's layers with the weights.
    stacked = self.mode == "packed_read" and self.slot_width is not None
    layer_cache = None if cache is None else LayerKV(cache.k, cache.v)
    layers = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                     in_axes=(nn.broadcast, nn.broadcast if stacked or cache is None else 0,
                              nn.broadcast, nn.broadcast, nn.broadcast, 0),
                     length=cfg.num_layers)
    x, new = layers(cfg.num_heads, cfg.head_dim, cfg.mlp_dim, cfg.rope_theta, self.mode,
                    self.slot_width, name="layers")(
                        x, positions, layer_cache, slot, write_positions, None,
                        jnp.arange(cfg.num_layers) if stacked else None)
    if pick is not None:
      x = pick_columns(x, pick)
    hidden = RMSNorm(name="final_norm")(x)
    logits = embed.attend(hidden)
    new_cache = None if new is None else KVCache(new.k, new.v)
    return ForwardOutput(logits, hidden, new_cache)


class _LayerwiseInit(nn.Module):
  """`Transformer`'s parameters as L named blocks (`layer_0` ... `layer_{L-1}`): each
  layer is initialised from its own named key, so a seed gives the same weights as a
  model of L separate blocks; `init_params` stacks them (`checkpoint.stack_layers`)."""
  cfg: TransformerConfig

  @nn.compact
  def __call__(self, tokens, positions):
    cfg = self.cfg
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=embed_init(cfg.d_model),
                     name="embed")
    x = embed(tokens) * math.sqrt(cfg.d_model)
    for i in range(cfg.num_layers):
      x, _ = Block(cfg.num_heads, cfg.head_dim, cfg.mlp_dim, cfg.rope_theta, "causal",
                   name=f"layer_{i}")(x, positions)
    return embed.attend(RMSNorm(name="final_norm")(x))


def init_params(cfg: TransformerConfig, key: jax.Array):
  """Random parameters (a pytree of float32 arrays), layers stacked (`Transformer`)."""
  tokens = jnp.zeros([1, 4], jnp.int32)
  return stack_layers(_LayerwiseInit(cfg).init(key, tokens, jnp.arange(4)[None])["params"])


def init_cache(cfg: TransformerConfig, batch: int, max_len: int,
               dtype=jnp.float32) -> KVCache:
  """An all-zero cache `[L, B, H, M, Dh]` for `batch` slots of `max_len` positions."""
  shape = (cfg.num_layers, batch, cfg.num_heads, max_len, cfg.head_dim)
  return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def embedding(params) -> jax.Array:
  """`[V, D]` tied embedding / output matrix (the drafters share the target's)."""
  return params["embed"]["embedding"]


def forward(params, tokens: jax.typing.ArrayLike, positions: jax.typing.ArrayLike,
            cache: KVCache | None = None, *, cfg: TransformerConfig,
            valid: jax.typing.ArrayLike | None = None,
            pick: jax.typing.ArrayLike | None = None) -> ForwardOutput:
  """Dense forward of a block of tokens per slot.

  Without a cache this is causal self-attention within each row (training, reference).
  With a cache, token `[b, s]` writes its K/V at `cache[:, b, positions[b, s]]` and
  attends to slot b's entries at positions <= `positions[b, s]` (the prefix already in the
  cache plus earlier tokens of this block).

  Args:
    params: transformer parameters.
    tokens: `[B, S]` int token ids.
    positions: `[B, S]` int positions (need not start at 0 or be equal across rows).
    cache: optional `KVCache` `[L, B, H, M, Dh]`.
    cfg: the model config (static).
    valid: optional `[B, S]` bool; invalid tokens write nothing (their outputs are junk).
    pick: optional `[B]` int (with a cache): every token writes the cache, but outputs
      are computed for token `[b, pick[b]]` only (the last layer's query and MLP and the
      head run on one token per row, as drafting from a pending block needs).

  Returns:
    `ForwardOutput(logits [B,S,V], hidden [B,S,D], cache)`; with `pick`, `logits [B,V]`
    and `hidden [B,D]`.
  """
  tokens = jnp.asarray(tokens)
  positions = jnp.asarray(positions, jnp.int32)
  _checks.rank("tokens", tokens, 2, "BS")
  _checks.shape("positions", positions, tokens.shape, "BS")
  _checks.integer("tokens", tokens)
  if cache is None:
    if pick is not None:
      raise ValueError("pick: expected None without a cache (it serves the cached pass)")
    return Transformer(cfg, "causal").apply({"params": params}, tokens, positions)
  _checks.shape("cache.k", cache.k, (cfg.num_layers, tokens.shape[0], cfg.num_heads, None,
                                     cfg.head_dim), "LBHMD")
  write = positions
  if valid is not None:
    write = jnp.where(jnp.asarray(valid), positions, cache_len(cache))
  if pick is None:
    return Transformer(cfg, "dense").apply({"params": params}, tokens, positions, cache, None,
                                           write)
  pick = jnp.asarray(pick, jnp.int32)
  _checks.shape("pick", pick, tokens.shape[:1], "B")
  out = Transformer(cfg, "dense").apply({"params": params}, tokens, positions, cache, None,
                                        write, pick)
  return out._replace(logits=out.logits[:, 0], hidden=out.hidden[:, 0])


def _packed_inputs(tokens, slot, positions, valid, cache: KVCache):
  """Checked, typed packed inputs; `write` is `positions`, M (dropped) for padding."""
  tokens = jnp.asarray(tokens)
  slot = jnp.asarray(slot, jnp.int32)
  positions = jnp.asarray(positions, jnp.int32)
  valid = jnp.asarray(valid)
  _checks.rank("tokens", tokens, 1, "T")
  for name, x in (("slot", slot), ("positions", positions), ("valid", valid)):
    _checks.shape(name, x, tokens.shape, "T")
  _checks.boolean("valid", valid)
  return tokens, slot, positions, jnp.where(valid, positions, cache_len(cache))


def forward_packed(params, tokens: jax.typing.ArrayLike, *, slot: jax.typing.ArrayLike,
                   positions: jax.typing.ArrayLike, valid: jax.typing.ArrayLike,
                   cache: KVCache, cfg: TransformerConfig) -> ForwardOutput:
  """Packed (ragged) forward for verification: T tokens from any slots, one program.

  Token t belongs to slot `slot[t]` at position `positions[t]`. It writes its K/V into
  that slot's cache at that position and attends to the slot's cache up to its position,
  which includes earlier packed tokens of the same slot. The dense layers run on the T
  packed tokens only. Padding entries have `valid[t] = False`: they write nothing and their
  outputs are junk. Pad T to a few static sizes to bound recompiles.

  Args:
    params: transformer parameters.
    tokens: `[T]` int token ids.
    slot: `[T]` int slot (cache row) of each token.
    positions: `[T]` int position of each token within its slot.
    valid: `[T]` bool, False for padding.
    cache: `KVCache` `[L, B, H, M, Dh]`.
    cfg: the model config (static).

  Returns:
    `ForwardOutput(logits [T,V], hidden [T,D], cache)`.
  """
  tokens, slot, positions, write = _packed_inputs(tokens, slot, positions, valid, cache)
  return Transformer(cfg, "packed").apply({"params": params}, tokens, positions, cache, slot,
                                          write)


class PackedWrites(NamedTuple):
  """The K/V a packed pass computed, not yet written (`forward_packed_read`)."""
  k: jax.Array  # [L, T, H, Dh] keys of the pass's tokens, RoPE applied
  v: jax.Array  # [L, T, H, Dh] values


def forward_packed_read(params, tokens: jax.typing.ArrayLike, *, slot: jax.typing.ArrayLike,
                        positions: jax.typing.ArrayLike, valid: jax.typing.ArrayLike,
                        cache: KVCache, cfg: TransformerConfig,
                        slot_width: int | None = None
                        ) -> tuple[ForwardOutput, PackedWrites]:
  """`forward_packed` with the cache only read: the same logits and hidden states (up to
  float rounding), and the tokens' K/V returned for `write_packed` instead of a written
  cache (`ForwardOutput.cache` is None). Lets a caller run the pass inside a branch of
  `lax.switch` and write the cache after it, which XLA does in place (a cache returned
  by a branch inside a decode loop is copied whole on every step).

  Args, shapes and padding as `forward_packed`; `slot_width` (optional, static): at most
  this many valid tokens of one slot in the pass, which lets the attention run per slot
  (`layers`, mode `packed_read`): the cache is read once instead of once per token. A
  slot with more valid tokens than `slot_width` gets wrong outputs: it must bound them.

  Returns:
    `(ForwardOutput(logits [T,V], hidden [T,D], None), PackedWrites [L, T, H, Dh])`.
  """
  tokens, slot, positions, write = _packed_inputs(tokens, slot, positions, valid, cache)
  if slot_width is not None and (isinstance(slot_width, bool) or int(slot_width) < 1):
    raise ValueError(f"slot_width: expected a positive int or None, got {slot_width!r}")
  out = Transformer(cfg, "packed_read", slot_width).apply({"params": params}, tokens,
                                                          positions, cache, slot, write)
  return ForwardOutput(out.logits, out.hidden, None), PackedWrites(out.cache.k, out.cache.v)


def write_packed(cache: KVCache, writes: PackedWrites, *, slot: jax.typing.ArrayLike,
                 positions: jax.typing.ArrayLike, valid: jax.typing.ArrayLike) -> KVCache:
  """`cache` with entry t of `writes` (`[L, N, H, Dh]`, any N) at `[slot[t], positions[t]]`
  where `valid[t]`; what `forward_packed` writes when `writes` is `forward_packed_read`'s.
  """
  slot = jnp.asarray(slot, jnp.int32)
  write = jnp.where(jnp.asarray(valid), jnp.asarray(positions, jnp.int32), cache_len(cache))
  return KVCache(put_entries(cache.k, writes.k, slot, write),
                 put_entries(cache.v, writes.v, slot, write))


def lm_loss(params, tokens: jax.Array, *, cfg: TransformerConfig,
            mask: jax.Array | None = None) -> jax.Array:
  """Mean next-token cross-entropy (nats/token) of `tokens [B, S]` without a cache."""
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1] - 1), tokens[:, :-1].shape)
  logits = forward(params, tokens[:, :-1], positions, cfg=cfg).logits
  nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]
  if mask is None:
    return jnp.mean(nll)
  return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1)
