"""The verify half of a decode step: the target's pass over the verified tokens, on device.

Each step feeds every active slot's base token and the drafts it verifies to the target
in one pass: the valid entries of `[B, K+1]` packed into a static bucket per verify group
(`_verify_packed`, `lax.switch` over one program per bucket), or, on a step with no
drafts, the base tokens alone (`_plain_pass`). Rejection sampling then decides what each
slot emits (`_verify_phase`). Dimension letters as in `av_jax.engine.core`; G verify
groups, T_g packed tokens of a group's bucket.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from av_jax.engine import protocols
from av_jax.engine.drafting import Drafts
from av_jax.engine.state import DecodeState, Engine, Params
from av_jax.models.sampling import sampling_probs
from av_jax.rejection import RejectionResult, rejection_sample


def group_cache(engine: Engine, cache: Any) -> Any:
  """B -> (G, B/G) at the target cache's slot axis (av_jax's: `[L, B, H, M, Dh]` ->
  `[L, G, B/G, H, M, Dh]`): contiguous slot groups, a free reshape; with slots sharded in
  blocks over 'data', the group axis takes the slot sharding."""
  return protocols.group_cache(engine.target, cache, engine.config.groups)


def verify_forward(engine: Engine, target_params, cache: Any, *,
                   tokens: jax.Array, slot: jax.Array, positions: jax.Array,
                   valid: jax.Array, read: bool = False, width: int | None = None):
  """The verify program of one bucket: each group's packed forward and sampling probs.

  Each group runs `engine.target.verify` (`av_jax.engine.protocols.Target`) on its T_g
  packed tokens.

  Args:
    engine: the engine (temperature, top-p, target).
    target_params: target parameters.
    cache: target cache grouped at its slot axis (`group_cache`; av_jax's:
      `[L, G, B/G, H, M, Dh]`).
    tokens: `[G, T_g]` int32 packed tokens of each group.
    slot: `[G, T_g]` int32 slot of each token within its group (0 .. B/G - 1).
    positions: `[G, T_g]` int32 position of each token.
    valid: `[G, T_g]` bool, False for padding.

    read: run `target.verify_read` (the cache only read) instead of `verify`.
    width: the most valid tokens of one slot (default K + 1), passed on as `slot_width`
      to a `verify_read` that takes it (`Target.verify_read_width`), capped at T_g.

  Returns:
    `(probs [G, T_g, V], hidden [G, T_g, D], cache)`: the target's sampling distribution
    (temperature, top-p) and `hidden` of every packed token, and the grouped cache with
    the valid tokens written; with `read`, the tokens' `writes` (G at axis 0 of every
    leaf) in place of the cache.
  """
  cfg, target = engine.config, engine.target
  a = target.slot_axis  # of B; the group axis G takes its place in the grouped cache
  run = target.verify_read if read else target.verify
  out_a = 0 if read else a

  extra = {}
  if read and target.verify_read_width:
    extra = dict(slot_width=min(cfg.max_draft + 1 if width is None else width,
                                tokens.shape[-1]))

  def one(cache, tokens, slot, positions, valid):
    logits, hidden, cache = run(target_params, cache, tokens=tokens, slot=slot,
                                positions=positions, valid=valid, **extra)
    probs = sampling_probs(logits, temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p)
    return probs, hidden, cache

  if tokens.shape[0] == 1:  # one group: the plain packed program, no batch axis
    squeeze = lambda x: x[0]
    first = lambda x: jax.lax.index_in_dim(x, 0, a, keepdims=False)
    probs, hidden, new = one(jax.tree.map(first, cache),
                             *map(squeeze, (tokens, slot, positions, valid)))
    return probs[None], hidden[None], jax.tree.map(lambda x: jnp.expand_dims(x, out_a), new)
  return jax.vmap(one, in_axes=(a, 0, 0, 0, 0), out_axes=(0, 0, out_a))(
      cache, tokens, slot, positions, valid)


class _Packing(NamedTuple):
  """The `[B, K+1]` verify entries laid out by verify group (`_verify_packed`)."""
  tokens: jax.Array     # [G, B/G, K+1] int32
  positions: jax.Array  # [G, B/G, K+1] int32
  valid: jax.Array      # [G, B/G, K+1] bool
  index: jax.Array      # [G, B/G, K+1] int32, each entry's place in its group's buffer
  slot_ids: jax.Array   # [B/G, K+1] int32, each entry's slot within its group
  bucket: jax.Array     # [] int32, the smallest per-group bucket that holds every group


def _packing(engine: Engine, tokens, positions, valid) -> _Packing:
  """Groups `[B, K+1]` entries into G contiguous groups of B/G slots; each group packs
  its valid entries slot by slot, and all groups take the bucket of the fullest."""
  G = engine.config.groups
  B, K1 = tokens.shape
  sizes = engine.config.group_bucket_sizes()
  grouped = lambda x: x.reshape((G, B // G) + x.shape[1:])
  tokens, positions, valid = grouped(tokens), grouped(positions), grouped(valid)
  per_slot = jnp.sum(valid, axis=2)                                # [G, B/G]
  offsets = jnp.cumsum(per_slot, axis=1) - per_slot                # [G, B/G]
  index = offsets[..., None] + jnp.arange(K1)                      # [G, B/G, K+1]
  fullest = jnp.max(jnp.sum(per_slot, axis=1))
  bucket = jnp.minimum(jnp.searchsorted(jnp.asarray(sizes), fullest, side="left"),
                       len(sizes) - 1).astype(jnp.int32)
  slot_ids = jnp.broadcast_to(jnp.arange(B // G)[:, None], index.shape[1:])  # local slots
  return _Packing(tokens=tokens, positions=positions, valid=valid, index=index,
                  slot_ids=slot_ids, bucket=bucket)


def _bucket_branch(engine: Engine, target_params, packing: _Packing, size: int, *, finish):
  """The verify program of the per-group bucket T_g = `size`: `cache -> (probs, hidden,
  out)` with `probs` and `hidden` unpacked to `[B, K+1, ...]` (`finish` applied to
  `probs` when given), `out` the written cache, or with `verify_read` the tokens' writes
  (token axis B (K+1) at `write_axis`)."""
  target = engine.target
  read = target.verify_read is not None
  w = target.write_axis
  G, BG, K1 = packing.index.shape
  B = G * BG
  index, valid = packing.index, packing.valid
  flat_rows = lambda x: x.reshape(G, -1)

  def run(cache):
    flat = flat_rows(jnp.where(valid, index, size))  # invalid -> out of range, dropped
    def pack(x, fill):  # [G, B/G, K+1] -> [G, T_g], one scatter per group
      row = lambda f, x: jnp.full((size,), fill, x.dtype).at[f].set(x, mode="drop")
      return jax.vmap(row)(flat, flat_rows(jnp.broadcast_to(x, index.shape)))
    probs, hidden, out = verify_forward(
        engine, target_params, group_cache(engine, cache), tokens=pack(packing.tokens, 0),
        slot=pack(packing.slot_ids, 0), positions=pack(packing.positions, 0),
        valid=pack(valid, False), read=read)
    gather = flat_rows(jnp.clip(index, 0, size - 1))
    unpack = lambda x: jax.vmap(lambda row, i: row[i])(x, gather).reshape(
        (B, K1) + x.shape[2:])
    probs = unpack(probs) if finish is None else finish(unpack(probs))
    if not read:
      return probs, unpack(hidden), protocols.ungroup_cache(target, out)
    # [G, ..T_g at 1 + w..] -> [..B (K+1) at w..]: every bucket's writes in one shape
    entries = lambda x: jnp.moveaxis(
        unpack(jnp.moveaxis(x, 1 + w, 1)).reshape((B * K1,) + x.shape[1:1 + w]
                                                  + x.shape[2 + w:]), 0, w)
    return probs, unpack(hidden), jax.tree.map(entries, out)
  return run


def _plain_branch(engine: Engine, target_params, base, finish_plain, K1: int):
  """The plain target pass on the base tokens `base = (tokens, positions, valid)` (each
  `[B]`; a target-only step's program), in the layout of `_bucket_branch`'s outputs:
  `finish_plain(probs [B, V])`, hidden states and writes at column 0 of `[B, K+1]`."""
  target = engine.target
  read = target.verify_read is not None
  w = target.write_axis
  B = base[0].shape[0]

  def plain_pass(cache):
    # The base tokens unpacked (a target-only step's program); their entries go to
    # column 0 of the [B, K+1] layout the buckets' writes have.
    probs, hidden, out = _plain_pass(engine, target_params, cache, base=base[0],
                                     position=base[1], active=base[2])
    column0 = lambda x: jnp.zeros((B, K1) + x.shape[1:], x.dtype).at[:, 0].set(x)
    if read:
      out = jax.tree.map(lambda x: jnp.moveaxis(
          column0(jnp.moveaxis(x, w, 0)).reshape((B * K1,) + x.shape[:w] + x.shape[w + 1:]),
          0, w), out)
    return finish_plain(probs), column0(hidden), out
  return plain_pass


def _verify_packed(engine: Engine, target_params, cache, *, tokens, positions, valid,
                   finish=None, plain=None):
  """Runs the target on the valid entries of `[B, K+1]`, packed per verify group.

  The B slots form G = `verify_groups` contiguous groups of B/G. Each group packs its
  valid tokens into its own buffer; all groups use the smallest per-group bucket T_g that
  holds the fullest group, so the target runs on `[G, T_g]` tokens (`lax.switch` over one
  program per bucket) and each token attends to its slot's cache within its group. With
  the slots sharded in blocks over 'data' and G a multiple of its size, every group lives
  on one shard and verification needs no cross-shard traffic beyond the bucket choice (a
  scalar maximum). The target's sampling distribution (temperature, top-p) is computed
  on the packed rows, so its cost follows the bucket like the forward pass does.

  `finish` (optional): `probs [B, K+1, V] -> RejectionResult`, run inside each bucket's
  branch, so that no `[B, K+1, V]` tensor leaves the switch (forming and passing it is a
  `[B, K+1, V]` copy a step that drafts nothing does not need). `plain`
  (optional, with `finish`): `(use [] bool, probs [B, V] -> RejectionResult)`; where `use`
  holds the step runs the plain target pass on the base tokens `tokens[:, 0]` of the
  slots with `valid[:, 0]` (`_plain_pass`, the program of a target-only step) instead of
  any bucket, and writes nothing else.

  Returns dense `[B, K+1, V]` target sampling probabilities (`finish`'s or `plain`'s
  result instead, when given) and `[B, K+1, D]` hidden states (junk where not valid),
  the updated cache, and the bucket index (0 for the plain pass).
  """
  B, K1 = tokens.shape
  base = (tokens[:, 0], positions[:, 0], valid[:, 0])
  packing = _packing(engine, tokens, positions, valid)
  bucket, valid = packing.bucket, packing.valid
  target = engine.target
  read = target.verify_read is not None

  # The switch reads the cache as stored (grouped inside each branch). A cache written
  # inside the branches comes back from the switch as a new buffer, which XLA copies whole
  # into the decode loop's state on every step of an engine that also switches on
  # drafting (subset drafting); with `verify_read` the branches return the tokens'
  # entries and the cache is written here, in place.
  branches = [_bucket_branch(engine, target_params, packing, s, finish=finish)
              for s in engine.config.group_bucket_sizes()]
  if plain is not None:
    if finish is None:
      raise ValueError("plain: expected a `finish` too (the buckets' sampling)")
    use = plain[0]
    plain_pass = _plain_branch(engine, target_params, base, plain[1], K1)
    probs, hidden, out = jax.lax.switch(jnp.where(use, 0, 1 + bucket),
                                        [plain_pass] + branches, cache)
    bucket = jnp.where(use, 0, bucket).astype(jnp.int32)
    valid = valid & ((jnp.arange(K1) == 0) | ~use)  # the plain pass wrote column 0 only
  elif read and len(branches) == 1:
    # One bucket (fixed K): a conditional on "anything to verify", whose other branch runs
    # nothing, keeps the pass in a branch (see `_target_step`: at the loop body's top
    # level XLA copied the cache on every step).
    probs, hidden, out = jax.lax.cond(jnp.any(valid), branches[0], _idle(branches[0]), cache)
  else:
    probs, hidden, out = jax.lax.switch(bucket, branches, cache)
  if read:
    rows = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, K1))
    ungrouped = lambda x: x.reshape(B * K1)
    out = target.write(cache, out, slot=ungrouped(rows),
                       positions=ungrouped(packing.positions), valid=ungrouped(valid))
  return probs, hidden, out, bucket


def _idle(run):
  """A branch with `run`'s output shapes that computes nothing (zeros)."""
  def idle(cache):
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(run, cache))
  return idle


def _plain_pass(engine: Engine, target_params, cache, *, base, position, active):
  """The target pass of a step with no drafts: each verify group runs its B/G base
  tokens through the target (the smallest bucket, no packing).

  Returns `(probs [B, V], hidden [B, D], out)`: the target's sampling distribution and
  hidden state at each slot's base token, and with `verify_read` the tokens' entries
  (token axis B at `write_axis`) for `target.write`, else the written cache (ungrouped).
  """
  cfg, target = engine.config, engine.target
  B, G = cfg.num_slots, cfg.groups
  grouped = lambda x: x.reshape(G, B // G)
  # With `verify_read` the pass reads the cache and the caller writes it after, as a
  # gated step does (`_verify_packed`), so target-only decoding runs the same attention
  # program.
  read = target.verify_read is not None
  run = lambda cache: verify_forward(
      engine, target_params, group_cache(engine, cache), tokens=grouped(base),
      slot=grouped(jnp.tile(jnp.arange(B // G, dtype=jnp.int32), G)),
      positions=grouped(position), valid=grouped(active), read=read, width=1)
  if not read:
    probs, hidden, out = run(cache)
    return probs.reshape(B, -1), hidden.reshape(B, -1), protocols.ungroup_cache(target, out)
  # A batch with no active slot runs no target pass (the drain's last steps). The
  # conditional also keeps XLA from copying the whole cache on every step: a read-only
  # pass followed by its write at the top level of the decode loop's body was compiled
  # with two copies of the cache per step, the same pass inside a branch with none
  # (`tests/test_engine_inplace.py` checks the compiled chunk).
  probs, hidden, out = jax.lax.cond(jnp.any(active), run, _idle(run), cache)
  w = target.write_axis  # [G, ..B/G at 1 + w..] -> [..B at w..]
  merge = lambda x: jnp.moveaxis(jnp.moveaxis(x, 1 + w, 1).reshape((B,) + x.shape[1:1 + w]
                                                                     + x.shape[2 + w:]), 0, w)
  return probs.reshape(B, -1), hidden.reshape(B, -1), jax.tree.map(merge, out)


def _target_step(engine: Engine, target_params, cache, key, *, base, position, active):
  """Verification of a step with no drafts: one target token per slot, sampled.

  The same law as `rejection_sample` with nothing verified (a draw from the target's
  sampling distribution), at the cost of a target-only step (`_plain_pass`): it samples
  on `[B, V]`; no `[B, K+1, V]` tensor is formed.

  Returns `(RejectionResult, hidden [B, K+1, D], cache, bucket index 0)`.
  """
  cfg, target = engine.config, engine.target
  B, K = cfg.num_slots, cfg.max_draft
  probs, hidden, out = _plain_pass(engine, target_params, cache, base=base,
                                   position=position, active=active)
  if target.verify_read is not None:
    out = target.write(cache, out, slot=jnp.arange(B, dtype=jnp.int32), positions=position,
                       valid=active)
  # probs is the sampling distribution (one-hot when greedy): a categorical draw from its
  # log is the target's token either way.
  full = jnp.zeros((B, K + 1) + hidden.shape[1:], hidden.dtype).at[:, 0].set(hidden)
  return _plain_result(key, probs, K), full, out, jnp.zeros((), jnp.int32)


def _plain_result(key: jax.Array, probs: jax.Array, K: int) -> RejectionResult:
  """A step that verified nothing: one token per slot drawn from the target's sampling
  distribution `probs [B, V]` (one-hot when greedy: a categorical draw from its log is
  the target's token either way), the law of `rejection_sample` with nothing verified."""
  B = probs.shape[0]
  token = jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)
  zeros = jnp.zeros((B, K), bool)
  return RejectionResult(
      tokens=jnp.full((B, K + 1), -1, jnp.int32).at[:, 0].set(token),
      num_emitted=jnp.ones((B,), jnp.int32), num_accepted=jnp.zeros((B,), jnp.int32),
      accepted=zeros, labeled=zeros)


class _Verdict(NamedTuple):
  """What verification decided: the rejection sampler's result and the target's pass."""
  result: RejectionResult          # emitted tokens, accepted / labelled drafts
  target_hidden: jax.Array         # [B, K+1, D] target hidden states of the fed tokens
  target_cache: Any                # the target cache with the fed tokens written
  bucket: jax.Array                # [] int32, index of the packed bucket that ran
  # [B, K] float32, min(1, p/q) of every draft (recording engines only; else None)
  accept_probs: jax.Array | None = None


def _verify_phase(engine: Engine, params: Params, state: DecodeState, drafts: Drafts,
                  num_verified: jax.Array, key: jax.Array, *, packed) -> _Verdict:
  """The base token and the verified drafts, packed, in one target pass; then rejection
  sampling. `packed` False: a step that drafted nothing in a program that never drafts,
  a plain target step (no `[B, K+1, V]`). `packed` a traced `[]` bool (a gated step):
  where it is False the verify switch runs the plain pass of a target-only step and the
  target's own draw (`_plain_result`: the law and the draw of a plain step), else a
  packed bucket and rejection sampling inside its branch. The target cache is written
  after the switch (`verify_read`): a cache returned by a conditional inside the decode
  loop is copied whole on every step (XLA's copy insertion), and a step without drafts
  that ran the smallest packed bucket would form `[B, K+1, V]` target probabilities it
  does not need."""
  B, K = engine.config.num_slots, engine.config.max_draft
  base = state.tokens[jnp.arange(B), state.length - 1]
  if packed is False:
    return _Verdict(*_target_step(engine, params.target, state.target_cache, key, base=base,
                                  position=state.length - 1, active=state.active))
  tokens = jnp.concatenate([base[:, None], drafts.tokens], axis=1)        # [B, K+1]
  j = jnp.arange(K + 1)[None, :]
  positions = state.length[:, None] - 1 + j
  valid = state.active[:, None] & (j <= num_verified[:, None])
  reject = lambda target_probs: rejection_sample(
      key, draft_probs=drafts.probs, draft_tokens=drafts.tokens, target_probs=target_probs,
      num_verified=num_verified)
  record = engine.config.programs.record_features
  if record:
    reject = lambda target_probs, reject=reject: (
        reject(target_probs), _accept_probs(drafts, target_probs))
  plain_result = lambda probs: _plain_result(key, probs, K)
  if record:
    plain_result = lambda probs, plain_result=plain_result: (
        plain_result(probs), jnp.zeros((B, K), jnp.float32))
  plain = None if packed is True else (~packed, plain_result)
  finished, hidden, cache, bucket = _verify_packed(
      engine, params.target, state.target_cache, tokens=tokens, positions=positions,
      valid=valid, finish=reject, plain=plain)
  if record:
    return _Verdict(finished[0], hidden, cache, bucket, accept_probs=finished[1])
  return _Verdict(finished, hidden, cache, bucket)


def _accept_probs(drafts: Drafts, target_probs: jax.Array) -> jax.Array:
  """`[B, K]`: min(1, p(x) / q(x)) of every draft token, its acceptance probability given
  the draft prefix before it (`target_probs [B, K+1, V]` conditioned on that prefix)."""
  K = drafts.tokens.shape[1]
  token = jnp.clip(drafts.tokens, 0, drafts.probs.shape[-1] - 1)[..., None]
  q_x = jnp.take_along_axis(drafts.probs, token, axis=-1)[..., 0]
  p_x = jnp.take_along_axis(target_probs[:, :K], token, axis=-1)[..., 0]
  return jnp.where(q_x > 0, jnp.minimum(1.0, p_x / jnp.maximum(q_x, 1e-30)), 0.0)