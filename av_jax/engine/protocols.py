"""What the engine calls on a target model: the `Target` protocol, and av_jax's own.

`make_engine(config, target=..., drafter=...)` serves any model that provides these
functions; `make_engine(config, models, drafter)` builds av_jax's transformer as one
(`transformer_target`). All functions are pure and jit-traceable; `params` is whatever
pytree the caller passes as `Params.target` (never closed over), the cache is any pytree
whose leaves all carry the slot axis B at `slot_axis`.

    cache = target.init_cache(num_slots, max_len)     # B slots of M positions each
    logits, hidden, cache = target.verify(params, cache, tokens=[T], slot=[T],
                                          positions=[T], valid=[T])
    logits, hidden, cache = target.prefill(params, one_slot_cache, tokens=[P], valid=[P])

`verify` is the packed forward the engine verifies with (T tokens from any slots, padded
to a static bucket): token t belongs to cache row `slot[t]` at position `positions[t]`;
it writes its own entry there and reads that slot's entries at positions <= its own,
which includes earlier packed tokens of the same slot. Padding has `valid[t] = False`
and must write nothing; its outputs are never read. `logits [T, V]` are the next-token
logits (the engine applies temperature and top-p), `hidden [T, D]` is any per-token
feature vector of width `hidden_size`: the engine never reads it, it only hands it to
the drafter (`Drafter.init_state`'s `prompt_hidden`, `Drafter.commit`'s
`target_hidden`), so it is what the user's drafter wants from the target (EAGLE-style
heads: the final hidden state; a drafter that reads only tokens: anything, e.g. zeros).

`verify_read` and `write` (optional, both or neither) split `verify`: the pass reads the
cache and returns the tokens' entries (`writes`, token axis T at `write_axis`), and
`write(cache, writes, slot=[N], positions=[N], valid=[N])` writes them (the engine passes
them re-ordered, N >= T). With them the engine writes the cache after its bucket switch,
in place; without them each bucket's `verify` writes it, and XLA copies the whole cache
once per step of an engine whose steps choose between programs (subset drafting).

With `verify_read_width` the engine also passes `slot_width=W` to `verify_read`: at
most W valid tokens of one slot are in the pass (av_jax's transformer then attends
per slot and reads each slot's cache once).
`prefill` runs a prompt of P (a static bucket) tokens at positions 0..P-1 into a fresh
one-slot cache (`init_cache(1, max_len)`); positions where `valid` is False are padding
after the prompt. Without one (None) the engine prefills with `verify` (slot 0).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from av_jax.models import transformer
from av_jax.models.config import ModelsConfig, kv_cache_dtype


class TargetOutput(NamedTuple):
  """What `Target.verify` and `Target.prefill` return (any 3-tuple in this order works)."""
  logits: jax.Array  # [T, V] float32 next-token logits (before temperature and top-p)
  hidden: jax.Array  # [T, D] per-token features handed to the drafter (D = hidden_size)
  cache: Any         # the cache pytree with the valid tokens written


class Target(NamedTuple):
  """A target model as the engine calls it: static metadata and pure functions.

  Hashable (the engine is a jit-static argument): build one per model, not per call, or
  equal models recompile. See the module docstring for the contract of each function.
  """
  name: str             # identity of the model (keys the on-disk profile cache)
  vocab_size: int       # V, logits width; prompt ids must lie in [0, V)
  hidden_size: int      # D, width of `hidden`
  init_cache: Callable  # (num_slots, max_len) -> cache pytree, B at `slot_axis` of every leaf
  verify: Callable      # (params, cache, *, tokens [T], slot [T], positions [T], valid [T])
                        #  -> (logits [T, V], hidden [T, D], cache)
  prefill: Callable | None = None  # (params, cache, *, tokens [P], valid [P]) on a one-slot
                                   #  cache -> (logits [P, V], hidden [P, D], cache);
                                   #  None: `verify` with slot 0, positions 0..P-1
  slot_axis: int = 0    # the axis of B in every cache leaf
  # Optional, both or neither: `verify` split into a pass that only reads the cache and
  # the write of its entries, which the engine does after its bucket switch (a cache
  # written inside a `lax.switch` in the decode loop is copied whole by XLA every step):
  verify_read: Callable | None = None  # as `verify` -> (logits [T, V], hidden [T, D],
                                       #  writes: a pytree, token axis T at `write_axis`)
  write: Callable | None = None        # (cache, writes, *, slot [N], positions [N],
                                       #  valid [N]) -> cache with the valid entries written
  write_axis: int = 0   # the token axis of every `writes` leaf
  # `verify_read` takes `slot_width=W` (static): the pass holds at most W valid tokens
  # per slot (the engine's K + 1), e.g. to attend per slot instead of per token.
  verify_read_width: bool = False


def prefill_with_verify(target: Target, params, cache, *, tokens: jax.Array,
                        valid: jax.Array):
  """`target.prefill`, or its packed `verify` on slot 0 at positions 0..P-1 without one."""
  if target.prefill is not None:
    return target.prefill(params, cache, tokens=tokens, valid=valid)
  P = tokens.shape[0]
  return target.verify(params, cache, tokens=tokens, slot=jnp.zeros((P,), jnp.int32),
                       positions=jnp.arange(P, dtype=jnp.int32), valid=valid)


def group_cache(target: Target, cache, groups: int):
  """B -> (G, B/G) at the slot axis of every leaf: contiguous slot groups (a free reshape)."""
  a = target.slot_axis
  return jax.tree.map(lambda x: x.reshape(x.shape[:a] + (groups, -1) + x.shape[a + 1:]), cache)


def ungroup_cache(target: Target, cache):
  """The inverse of `group_cache`: (G, B/G) -> B at the slot axis."""
  a = target.slot_axis
  return jax.tree.map(lambda x: x.reshape(x.shape[:a] + (-1,) + x.shape[a + 2:]), cache)


def insert_slot(target: Target, cache, one_slot, slot: jax.Array):
  """`cache` with row `slot` replaced by the one-slot cache `one_slot` (prefill)."""
  a = target.slot_axis

  def put(batched, single):
    start = [0] * batched.ndim
    start[a] = slot
    return jax.lax.dynamic_update_slice(batched, single.astype(batched.dtype), start)
  return jax.tree.map(put, cache, one_slot)


@functools.lru_cache(maxsize=64)
def transformer_target(models: ModelsConfig) -> Target:
  """av_jax's transformer (`models.target`) as a `Target`.

  Cached: equal configs give the same object, so engines built from equal model sets
  compile once. The cache is a `KVCache` `[L, B, H, M, Dh]` (slots on axis 1) of
  `models.kv_dtype`; `hidden` is the final hidden state after the final norm, which the
  EAGLE and block drafters read.
  """
  cfg = models.target

  def init_cache(num_slots, max_len):
    return transformer.init_cache(cfg, num_slots, max_len, kv_cache_dtype(models))

  def verify(params, cache, *, tokens, slot, positions, valid):
    out = transformer.forward_packed(params, tokens, slot=slot, positions=positions,
                                     valid=valid, cache=cache, cfg=cfg)
    return TargetOutput(out.logits, out.hidden, out.cache)

  def prefill(params, cache, *, tokens, valid):
    positions = jnp.arange(tokens.shape[0])[None]
    out = transformer.forward(params, tokens[None], positions, cache, cfg=cfg,
                              valid=valid[None])
    return TargetOutput(out.logits[0], out.hidden[0], out.cache)

  def verify_read(params, cache, *, tokens, slot, positions, valid, slot_width=None):
    out, writes = transformer.forward_packed_read(params, tokens, slot=slot,
                                                  positions=positions, valid=valid,
                                                  cache=cache, cfg=cfg, slot_width=slot_width)
    return out.logits, out.hidden, writes

  def write(cache, writes, *, slot, positions, valid):
    return transformer.write_packed(cache, writes, slot=slot, positions=positions,
                                    valid=valid)

  name = "av_jax.transformer " + json.dumps(dataclasses.asdict(cfg), sort_keys=True)
  if models.kv_dtype != "float32":  # the float32 name is the one it had before the setting
    name += f" kv_dtype={models.kv_dtype}"
  return Target(name=name, vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                init_cache=init_cache, verify=verify, prefill=prefill, slot_axis=1,
                verify_read=verify_read, write=write, write_axis=1, verify_read_width=True)
