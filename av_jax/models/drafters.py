"""The four drafter kinds behind one interface.

| kind         | drafting       | what it is                                                        |
|--------------|----------------|-------------------------------------------------------------------|
| `draft_lm`   | autoregressive | independent small LM with its own KV cache                        |
| `eagle`      | autoregressive | one transformer layer over (target hidden, next-token embedding), |
|              |                | shares the target's embedding/head, feeds its own features back   |
| `block`      | parallel       | K positions in one pass from the target's last hidden state       |
| `block_head` | parallel       | `block` plus a linear confidence head trained on target accepts   |

`drafting` matters to AV's exactness (docs/algorithm.md section 5, rule 2): with an
autoregressive drafter and sampled drafts, q at position i+1 depends on the token drawn at
position i.

The `Drafter` protocol: what the engine calls on a drafter, av_jax's four kinds and a
drafter of the user's own alike (`make_engine(config, target=..., drafter=...)`;
`examples/own_model_engine.py`, `tests/test_drafter_protocol.py`). All functions are pure
and jit-traceable; `K` is static, `temperature` / `top_p` may be traced arrays.

What the drafter's author writes (`Drafter` fields):

  state = drafter.init_state(params, target_params, prompt=[B,P], prompt_hidden=[B,P,D],
                             next_token=[B], K=K, max_len=M, prompt_lens=[B] or None)
  out = drafter.draft(params, target_params, state, key, K=K, temperature=t, top_p=p)
  # out.logits [B,K,V], out.tokens [B,K], out.conf_logits [B,K] or None, out.state
  out = drafter.draft(..., keep_fn=keep_fn, keep_init=aux)   # drafters with `stepwise`
  # keep_fn(depth, logits [B,V], log_probs [B,V], aux) -> (keep [B] bool, aux), called
  # after each depth; depth j+1 is drafted for the rows that keep (stopping is
  # absorbing) and the loop ends when none does: out.depth [B], out.passes []
  state = drafter.commit(out.state, emitted_tokens=[B,K+1], num_emitted=[B],
                         target_hidden=[B,K+1,D])
  # optional: skips=True (rows may skip drafting), and how they catch up:
  state = drafter.catch_up(params, target_params, state, token=[B], hidden=[B,D],
                           mask=[B])                          # a state of its own layout
  state = drafter.absorb(params, target_params, state)       # a DrafterState: see below

B is whatever number of rows the state holds: the engine's B slots, the E rows of a draft
bucket, or the one row of a prefill.

What the engine calls (`Drafter` methods, built on the fields; the engine calls nothing
else, and never looks inside a state):

  state = drafter.start(params, target_params, width=W, **init_state inputs)
  state = drafter.insert_row(state, one_row, slot)           # a prefill's row into slot
  state = drafter.keep_rows(new, old, mask [B])              # new where mask, else old
  rows = drafter.take_rows(state, idx [E]); state = drafter.put_rows(state, rows, idx, keep [E])
  out, update = drafter.draft_rows(params, target_params, state, key, rows=[E] or None,
                                   keep=[E], K=K, temperature=t, top_p=p)  # (+ keep_fn)
  update = drafter.settle_rows(params, target_params, state, rows=..., keep=..., K=K)
  update = drafter.unchanged(state, K=K)                     # a step drafting no row
  state = drafter.write_back(state, update, K=K)             # after the engine's switch
  full = drafter.full_rows(state, K=K)                       # [B] bool, or None
  state = drafter.commit_rows(state, emitted_tokens=..., num_emitted=..., target_hidden=...)
  state = drafter.catch_up_rows(params, target_params, state, token=[B], hidden=[B,D],
                                mask=[B], K=K)

A step that drafts every row calls `draft` and `commit_rows` on the whole state. A step
under subset drafting (the `av` arm, a drafter with `skips`) gathers the rows that draft
into a draft bucket of E rows and calls `draft_rows` in one `lax.switch` branch per E:
the bucket's rows are taken, settle any backlog and draft; the branch returns their
drafts and an `update` of one shape for every E, which `write_back` writes after the
switch (so a large cache is written in place, not copied by the switch); then the rows
that drafted `commit_rows` and the others `catch_up_rows` on the token the target emitted
for them. Where the rows live in a state is declared, not inferred by the engine:
`slot_axis` (an int, or a hashable pytree prefix of the state such as a NamedTuple of
ints), or None for a `DrafterState`.

What the arguments are:

- `params`: `Params.drafter`, any pytree; `target_params`: `Params.target`, any pytree (av_jax's
  EAGLE and block drafters read the target's tied embedding from it; others ignore it).
- `prompt_hidden [B, P, D]` and `target_hidden [B, K+1, D]`: the `hidden` the target
  returns for those tokens (`av_jax.engine.protocols.Target`; D = `Target.hidden_size`).
  For av_jax's transformer it is the final hidden state after the final norm; for a user's
  target it is whatever its `verify` / `prefill` return as `hidden`. The engine never reads
  it.
- The state is a `DrafterState` (`slot_axis` None, the default) or any pytree of the
  author's own whose leaves hold the rows at `slot_axis`. A `DrafterState`'s `cache` is
  the drafter's own: None, a `KVCache` (slots on axis 1), or any array with slots on axis
  0 (e.g. a token history `[B, M]`); `commit` below is shared by every kind and fits any.
- `draft` returns a `DraftOutput`; `log_probs` (what the tokens were drawn from, with
  temperature and top-p) is optional but saves a second top-p pass. With temperature <= 0
  the tokens must be the arg-max of `logits`.
- `Drafter.kind` names the drafter (profile and checkpoint caches key on it; only
  "block_head" enables the `av_head` arm); `Drafter.drafting` is "autoregressive" or
  "parallel" and decides the exact budget policy.
- `skips` (default False) lets a step leave rows out of drafting. Their state must stay as
  if they had drafted: a state of the author's layout needs `catch_up`; a `DrafterState`
  catches up by `catch_up` below, which needs a parallel drafter (one that keeps no cache
  a skipped step would leave behind) or `absorb`, and without either its rows all draft
  (`Drafter.skips_rows`). av_jax's four kinds declare it.
- `absorb(params, target_params, state) -> state` (optional, a `DrafterState`'s): writes
  the pending block into the drafter's own cache without drafting, as the first forward
  of `draft` does (draft_lm: the LM over the pending tokens; eagle: the head over the
  (hidden, token) pairs). Only the returned `cache` is used; `catch_up` then starts a new
  pending block. With `skips` it gives the rows that skip a backlog (`Drafter.backlog`,
  "Lazy catch-up" below), so `absorb` must take a pending block of any width P >= K+1 and
  write only the first `num_pending` entries of each slot (none where it is 0).

Sequence bookkeeping. The committed sequence of slot b ends with token x_n at position n
(the last emitted token, not yet seen by the target). The state holds the committed tokens
the drafter has not consumed yet ("pending", at most K+1, the last of which is x_n), each
paired with the target hidden state that predicted it. `draft` consumes the pending block
and drafts x_{n+1..n+K}. The verification pass runs the target on [x_n, d_1..d_K] at
positions n..n+K; its hidden states and the emitted tokens become the next pending block
(`commit`). Drafter cache entries above the consumed prefix are stale but never read.

Catch-up (`catch_up`). On a step where a slot does not draft, the target emits one token
for it; the drafter's state must stay as if drafting had never stopped (a stale drafter
state collapses acceptance: skipped drafting did so in TensorRT-LLM). The
committed token and the target hidden state that predicted it are appended to the pending
block; when the block is full (K+1 entries) `absorb` consumes it into the cache first and
the token starts a new block. The next `draft` consumes the whole block, so it sees what
it would have seen had it drafted at every step (tested: tests/test_drafter_catchup.py).
Parallel drafters keep no cache: their pending block becomes the one new token.

Lazy catch-up (a backlog). A state `widen`ed to P > K+1 pending columns lets a slot that
does not draft keep up to P committed tokens (with their target hidden states) pending:
`catch_up` then absorbs only when P are pending, and a slot that drafts again first
absorbs its backlog (`settle`, all but the newest entry, which stays pending), so the
absorb runs for the slots that draft, on the step they draft, and never for the tokens
of a request that ends while it does not draft. `draft` and `commit` see K+1 columns
(`settle`'s result; `narrow`); the engine keeps P (`Programs.drafter_backlog`;
`Drafter.start` widens, `Drafter.commit_rows` narrows and widens back). With a `KVCache`
cache a draft bucket's `update` holds only the entries its rows wrote (`CacheWindow`,
P + 1 positions per row from `window_start`) and its rows' pending counts, and
`full_rows` names the rows whose backlog is full: the engine gathers them into the step's
draft bucket to absorb (`draft_rows` with `keep`, or `settle_rows` on a step that drafts
for no row), so `catch_up_rows` never absorbs.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from av_jax import _checks
from av_jax.models import transformer
from av_jax.models.config import (BlockConfig, EagleConfig, ModelsConfig, TransformerConfig,
                                  kv_cache_dtype)
from av_jax.models.layers import Block, LayerKV, RMSNorm
from av_jax.models.sampling import sample_with_log_probs

KINDS = ("draft_lm", "eagle", "block", "block_head")
# Each kind's drafting style: autoregressive (position i+1 reads the drawn token i) or
# parallel (no position reads a drawn token).
DRAFTING = {"draft_lm": "autoregressive", "eagle": "autoregressive", "block": "parallel",
         "block_head": "parallel"}


class DrafterState(NamedTuple):
  """Per-slot drafter state (a pytree)."""
  cache: transformer.KVCache | None  # [L, B, H, M, Dh] own KV cache; None for parallel kinds
  tokens: jax.Array       # [B, K+1] int32 pending committed tokens (entries >= num_pending junk)
  hidden: jax.Array       # [B, K+1, D] target hidden state that predicted each pending token
  num_pending: jax.Array  # [B] int32 >= 1, valid entries of tokens / hidden
  position: jax.Array     # [B] int32 sequence position of tokens[:, 0]


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
  read (see the module docstring), so an inactive slot's cache needs no merge.
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
  module docstring, "Lazy catch-up").

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


def settle(drafter: Drafter, params, target_params, state: DrafterState, *,
           width: int, window: bool = False):
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
  while w < state.tokens.shape[1]:
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


class DraftOutput(NamedTuple):
  """What `draft` returns."""
  logits: jax.Array               # [B, K, V] float32 raw draft logits (q = sampling(logits))
  tokens: jax.Array               # [B, K] int32 drawn draft tokens
  conf_logits: jax.Array | None   # [B, K] float32 confidence-head logits (block_head only)
  state: DrafterState             # state after drafting (commit before the next draft)
  # [B, K, V] float32 log-probabilities the tokens were drawn from (temperature and top-p
  # applied; the temperature-1 softmax when greedy), or None: the engine then recomputes
  # them from `logits`.
  log_probs: jax.Array | None = None
  # [B] int32 depths drafted per slot when a `keep_fn` stopped drafting early (entries
  # of logits / tokens / log_probs at deeper positions are zeros); None: all K.
  depth: jax.Array | None = None
  passes: jax.Array | None = None  # [] int32 drafter passes run; None: K (or 1, parallel)
  # The `keep_fn`'s last `aux` when one stopped drafting (what it computed per depth,
  # e.g. the features the engine would otherwise recompute); None without `keep_fn`.
  keep_aux: Any = None


class Drafter(NamedTuple):
  """A drafter as the engine calls it (the protocol; see the module docstring).

  Fields: metadata and the pure functions the drafter's author writes. Methods: the verbs
  the engine calls, built on the fields; the engine calls nothing else of a drafter, so a
  drafter of the user's own is served like av_jax's. Hashable (the engine is a jit-static
  argument): build one per drafter, not per call.
  """
  kind: str              # one of KINDS, or the name of a user's own drafter
  drafting: str          # "autoregressive" or "parallel" (`DRAFTING[kind]`)
  init_state: Callable   # (params, target_params, *, prompt, prompt_hidden, next_token, K,
                         #  max_len, prompt_lens=None) -> state
  draft: Callable        # (params, target_params, state, key, *, K, temperature, top_p)
                         #  -> DraftOutput
  commit: Callable       # (state, *, emitted_tokens, num_emitted, target_hidden) -> state
  stepwise: bool = False  # `draft` takes `keep_fn` / `keep_init` (early stop by depth)
  # (params, target_params, state) -> state whose cache holds the pending block, or None:
  # a `DrafterState` drafter with a cache needs it to skip rows (`skips`), and with it
  # the rows that skip keep a backlog (lazy catch-up; see the module docstring).
  absorb: Callable | None = None
  # A step may leave rows out of drafting (subset drafting): those rows catch up on the
  # token the target emitted for them (`catch_up_rows`; `skips_rows` says whether they
  # can). False: every step that drafts drafts every active row.
  skips: bool = False
  # Where each leaf of the state holds its row (the slot): an int for every leaf, or a
  # hashable pytree prefix of the state giving one per subtree (a NamedTuple state's own
  # type holding ints: `MyState(cache=1, last=0)`). None: the state is a `DrafterState`
  # (a `KVCache` cache's leaves on axis 1, every other leaf on axis 0).
  slot_axis: Any = None
  # (params, target_params, state, *, token [B], hidden [B, D], mask [B]) -> state: the
  # rows in `mask` emitted `token` without drafting (`hidden`: the target hidden state
  # that predicted it); other rows unchanged. Required with `skips` for a state of the
  # author's own layout (`slot_axis` given); a `DrafterState` catches up by `catch_up`.
  catch_up: Callable | None = None

  # ------------------------------------------------ the verbs the engine calls

  @property
  def skips_rows(self) -> bool:
    """A step may leave rows out of drafting: the drafter declares `skips` and its rows
    can catch up (its `catch_up`; a `DrafterState`'s: a parallel drafter, or `absorb`,
    `can_skip`). A `DrafterState` drafter with a cache and no `absorb` drafts every row."""
    if not self.skips:
      return False
    return self.catch_up is not None if self.slot_axis is not None else can_skip(self)

  @property
  def backlog(self) -> bool:
    """The rows that skip drafting keep the committed tokens pending until they draft
    again (lazy catch-up): a `DrafterState` drafter with `skips` and `absorb`. The
    engine then `start`s states `Programs.drafter_backlog` columns wide."""
    return self.skips_rows and self.slot_axis is None and self.absorb is not None

  def check(self) -> None:
    """Raises a ValueError where the fields do not fit together (`make_engine` calls
    it): `skips` without `catch_up` for a state of the author's own layout, `catch_up`
    on a `DrafterState`, `absorb` on a state of the author's own layout."""
    name = f"drafter {self.kind!r}"
    if self.drafting not in ("autoregressive", "parallel"):
      raise ValueError(f"{name}: drafting must be 'autoregressive' or 'parallel', got "
                       f"{self.drafting!r}")
    try:
      hash(self.slot_axis)
    except TypeError:
      raise ValueError(f"{name}: slot_axis must be hashable (the engine is a jit-static "
                       f"argument): an int or a NamedTuple of ints, got "
                       f"{self.slot_axis!r}") from None
    if self.slot_axis is None:
      if self.catch_up is not None:
        raise ValueError(f"{name}: `catch_up` is for a state of the drafter's own layout "
                         "(give `slot_axis`); a DrafterState catches up by `absorb`")
    else:
      if self.absorb is not None:
        raise ValueError(f"{name}: `absorb` is for a DrafterState (slot_axis None)")
      if self.skips and self.catch_up is None:
        raise ValueError(f"{name}: `skips` with a state of its own layout needs `catch_up`")

  def start(self, params, target_params, *, width: int, **inputs):
    """`init_state(params, target_params, **inputs)` (B new rows, or one for a prefill)
    with `width` pending columns (`widen`; K + 1 unless `backlog`)."""
    state = self.init_state(params, target_params, **inputs)
    return state if self.slot_axis is not None else widen(state, width)

  def _axes(self, state):
    """The slot axis of every leaf of `state` (a pytree of ints of its structure)."""
    if self.slot_axis is None:
      return _state_axes(state)
    return jax.tree.map(lambda a, sub: jax.tree.map(lambda _: a, sub), self.slot_axis, state)

  def insert_row(self, state, one, slot: jax.Array):
    """`state` with row `slot` replaced by the one-row state `one` (a prefill's)."""
    return _insert_row(state, one, self._axes(state), slot)

  def take_rows(self, state, idx: jax.typing.ArrayLike):
    """Rows `idx [E]` of `state`, in that order: a state of E rows."""
    idx = jnp.asarray(idx, jnp.int32)
    _checks.rank("idx", idx, 1, "E")
    return _take_rows(state, self._axes(state), idx)

  def put_rows(self, state, rows, idx: jax.typing.ArrayLike, keep: jax.typing.ArrayLike):
    """`state` with rows `idx [E]` (distinct) replaced by the E-row `rows` where
    `keep [E]`; rows that do not keep are left untouched."""
    idx, keep = jnp.asarray(idx, jnp.int32), jnp.asarray(keep, bool)
    _checks.shape("keep", keep, idx.shape, "E")
    return _put_rows(state, rows, self._axes(state), idx, keep)

  def keep_rows(self, new, old, mask: jax.Array):
    """`new` in the rows where `mask [B]`, `old` in the others. A `DrafterState`'s cache
    is `new`'s whole (`keep_inactive`: entries above a row's consumed prefix are never
    read, so no row of it needs a merge)."""
    if self.slot_axis is None:
      return keep_inactive(new, old, mask)
    return _where_rows(new, old, self._axes(new), mask)

  def draft_rows(self, params, target_params, state, key: jax.Array, *,
                 rows: jax.Array | None, keep: jax.Array, K: int, **kwargs):
    """Drafts for rows `rows [E]` of `state` (None: every row, in order): takes them,
    absorbs any backlog (`settle`) and drafts K tokens (`draft(..., K=K, **kwargs)`:
    `temperature`, `top_p`, and `keep_fn` / `keep_init` where `stepwise`).

    Returns `(out, update)`: the E rows' `DraftOutput`, and what `write_back` writes into
    `state`: the new state of the rows where `keep [E]` (their backlog absorbed, their
    cache drafted), other rows untouched. Every `rows` gives an update of one structure
    and shape (so does `unchanged`): the engine's branches over draft buckets return it
    and write it after its `lax.switch`. With a `KVCache` cache and a backlog it holds
    only the cache entries the rows wrote (`read_window`), so the cache is written in
    place, never copied by the switch.
    """
    return _draft_rows(self, params, target_params, state, key, rows=rows, keep=keep, K=K,
                       **kwargs)

  def full_rows(self, state, *, K: int) -> jax.Array | None:
    """`[B]` bool, the rows whose backlog is full: the engine settles them this step
    (`settle_rows`, or `draft_rows` with `keep`) even if they do not draft, and
    `catch_up_rows` then never absorbs. None: `catch_up_rows` absorbs a full block
    itself (no backlog written in place)."""
    if not _windowed(self, state, K):
      return None
    return state.num_pending >= state.tokens.shape[1]

  def settle_rows(self, params, target_params, state, *, rows: jax.Array | None,
                  keep: jax.Array, K: int):
    """`draft_rows`' update without drafting: rows `rows [E]` (None: every row) where
    `keep [E]` absorb their backlog. Only where `full_rows` is not None."""
    return _settle_rows(self, params, target_params, state, rows=rows, keep=keep, K=K)

  def unchanged(self, state, *, K: int):
    """The update that writes nothing (a step that drafts for no row)."""
    if not _windowed(self, state, K):
      return state
    B = state.tokens.shape[0]
    return _Written(_empty_window(state.cache, rows=B, width=state.tokens.shape[1] + 1),
                    _pending_counts(state), jnp.zeros((B,), bool))

  def write_back(self, state, update, *, K: int):
    """`state` with an update of `draft_rows`, `settle_rows` or `unchanged` written."""
    if not _windowed(self, state, K):
      return update
    return _write_back(state, update)

  def commit_rows(self, state, *, emitted_tokens: jax.Array, num_emitted: jax.Array,
                  target_hidden: jax.Array):
    """`commit` of every row (a `DrafterState` wider than K + 1 is committed narrowed to
    K + 1 columns and widened back: its drafting rows hold no backlog)."""
    commit = functools.partial(self.commit, emitted_tokens=emitted_tokens,
                               num_emitted=num_emitted, target_hidden=target_hidden)
    K1 = jnp.shape(emitted_tokens)[1]
    if self.slot_axis is not None or state.tokens.shape[1] == K1:
      return commit(state)
    return widen(commit(narrow(state, K1)), state.tokens.shape[1])

  def catch_up_rows(self, params, target_params, state, *, token: jax.Array,
                    hidden: jax.Array, mask: jax.Array, K: int):
    """The rows in `mask [B]` emitted `token [B]` without drafting (`hidden [B, D]`: the
    target hidden state that predicted it): `catch_up` (the author's for a state of its
    own layout; av_jax's `catch_up` for a `DrafterState`). Needs `skips_rows`."""
    if self.slot_axis is not None:
      return self.catch_up(params, target_params, state, token=token, hidden=hidden,
                           mask=mask)
    return catch_up(self, params, target_params, state, token=token, hidden=hidden,
                    mask=mask, absorb=not _windowed(self, state, K))

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
  See the module docstring ("Catch-up").

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
  rows = jnp.arange(B)
  new = DrafterState(
      cache=cache,
      tokens=state.tokens.at[rows, at].set(token),
      hidden=state.hidden.at[rows, at].set(hidden.astype(state.hidden.dtype)),
      num_pending=at + 1,
      position=jnp.where(full, state.position + state.num_pending, state.position))
  return keep_inactive(new, state, mask)


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
  settled, window = settle(drafter, params, target_params, sub, width=K + 1, window=True)
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


# ----------------------------------------------------------------------------- modules


def _output_logits(features: jax.Array, embedding: jax.Array, rank: int) -> jax.Array:
  """Draft logits `[..., V]` of `features [..., D]` (call inside a compact module).

  `rank == 0`: the target's tied head, `features @ embedding.T` (D*V multiply-adds per token).
  `rank > 0`: the drafter's own factored head D -> rank -> V (rank*(D+V) per token): with a
  4096-token vocabulary at D = 384 the tied head alone is 10% of a 16M target's compute per
  token, so drafters in the proportions of deployed pairs (EAGLE-3 shrinks its head to a
  reduced draft vocabulary for the same reason) need a cheaper head.
  """
  if rank == 0:
    return features @ embedding.T
  low = nn.Dense(rank, use_bias=False, name="head_down")(features)
  return nn.Dense(embedding.shape[0], use_bias=False, name="head_up")(low)


class EagleHead(nn.Module):
  """EAGLE-style head: `fc([h_{t-1}; e(x_t)])`, one transformer layer, norm, shared head.

  Reference: Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
  Uncertainty". Input at position t is the target feature that predicted x_t and x_t's
  embedding; the output approximates the target feature at t (which predicts x_{t+1}).
  """
  d_model: int
  cfg: EagleConfig
  rope_theta: float
  mode: str = "causal"

  @nn.compact
  def __call__(self, embedding, hidden, tokens, positions, cache=None, write_positions=None,
               pick=None):
    """`(features [B, P, D], logits [B, P, V], new cache)`; with `pick [B]` (mode
    "dense") every column writes the cache but only row b's column `pick[b]` goes on
    past its keys and values: features `[B, D]`, logits `[B, V]` (the query, the MLP
    and the head run on the column used, not on every pending one)."""
    e = embedding[tokens] * math.sqrt(self.d_model)
    x = nn.Dense(self.d_model, use_bias=False, name="fc")(jnp.concatenate([hidden, e], -1))
    x, new_cache = Block(self.cfg.num_heads, self.cfg.head_dim, self.cfg.mlp_dim,
                         self.rope_theta, self.mode, name="layer")(x, positions, cache, None,
                                                                   write_positions, pick)
    features = RMSNorm(name="norm")(x)
    if pick is not None:
      features = features[:, 0]
    return features, _output_logits(features, embedding, self.cfg.head_rank), new_cache


class BlockDrafter(nn.Module):
  """Parallel block drafter: K_max positions in one bidirectional pass.

  The context vector `fc([h_n-1; e(x_n)])` plus a learned slot embedding forms K_max+1
  slots; `num_layers` bidirectional blocks mix them; slot i (1..K_max) predicts x_{n+i}
  through the target's shared output head. No slot sees a drawn token, so the K
  distributions do not depend on the draws (references: Cai et al. 2024 "Medusa";
  DFlash-style block diffusion drafters). With `with_head`, a linear layer on each slot's
  hidden state gives confidence logits (DSpark-style head).
  """
  d_model: int
  cfg: BlockConfig
  with_head: bool = False

  @nn.compact
  def __call__(self, embedding, hidden, tokens):
    e = embedding[tokens] * math.sqrt(self.d_model)
    ctx = nn.Dense(self.d_model, use_bias=False, name="fc")(jnp.concatenate([hidden, e], -1))
    # Unit scale, like the context vector: with a small init every slot starts as the same
    # function of the context and slot 1 learns a blend of all depths (measured: position-1
    # acceptance 0.2-0.4 with stddev 0.02).
    slots = self.param("slot_embed", nn.initializers.normal(1.0),
                       (self.cfg.block_size + 1, self.d_model))
    x = ctx[..., None, :] + slots  # [..., K_max+1, D]
    for i in range(self.cfg.num_layers):
      x, _ = Block(self.cfg.num_heads, self.cfg.head_dim, self.cfg.mlp_dim, 1.0,
                   "bidirectional", name=f"layer_{i}")(x, None)
    feats = RMSNorm(name="norm")(x[..., 1:, :])  # [..., K_max, D]
    logits = _output_logits(feats, embedding, self.cfg.head_rank)
    conf = None
    if self.with_head:
      conf = nn.Dense(1, name="conf_head")(jax.lax.stop_gradient(feats))[..., 0]
    return feats, logits, conf


def _eagle_module(cfg: ModelsConfig, mode: str) -> EagleHead:
  return EagleHead(cfg.target.d_model, cfg.eagle, cfg.target.rope_theta, mode)


def _block_module(cfg: ModelsConfig, kind: str) -> BlockDrafter:
  return BlockDrafter(cfg.target.d_model, cfg.block, with_head=(kind == "block_head"))


def init_drafter_params(kind: str, cfg: ModelsConfig, key: jax.Array):
  """Random parameters of drafter `kind` (does not include the shared target embedding)."""
  d = cfg.target.d_model
  emb = jnp.zeros([cfg.target.vocab_size, d])
  if kind == "draft_lm":
    return transformer.init_params(cfg.draft_lm, key)
  if kind == "eagle":
    return _eagle_module(cfg, "causal").init(key, emb, jnp.zeros([1, 4, d]),
                                             jnp.zeros([1, 4], jnp.int32),
                                             jnp.arange(4)[None])["params"]
  if kind in ("block", "block_head"):
    return _block_module(cfg, kind).init(key, emb, jnp.zeros([1, d]),
                                         jnp.zeros([1], jnp.int32))["params"]
  raise KeyError(f"unknown drafter kind {kind!r}; known: {KINDS}")


# ------------------------------------------------------------------------ shared helpers


def _last_pending(state: DrafterState):
  """(token [B], hidden [B, D], position [B]) of the newest committed token x_n."""
  idx = state.num_pending - 1
  tok = jnp.take_along_axis(state.tokens, idx[:, None], 1)[:, 0]
  hid = jnp.take_along_axis(state.hidden, idx[:, None, None], 1)[:, 0]
  return tok, hid, state.position + idx


def _pick(x: jax.Array, idx: jax.Array) -> jax.Array:
  """x[b, idx[b]] for x [B, P, ...]."""
  return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 1)), 1)[:, 0]


def _pending_inputs(state: DrafterState):
  width = state.tokens.shape[1]
  offs = jnp.arange(width)[None]
  return state.position[:, None] + offs, offs < state.num_pending[:, None]


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


def _pending_from_prompt(prompt_hidden, next_token, prompt_lens, K):
  batch, _, d = prompt_hidden.shape
  last_h = _pick(prompt_hidden, prompt_lens - 1)
  tokens = jnp.zeros([batch, K + 1], jnp.int32).at[:, 0].set(next_token)
  hidden = jnp.zeros([batch, K + 1, d], prompt_hidden.dtype).at[:, 0].set(last_h)
  return tokens, hidden


def _check_init(prompt, prompt_hidden, next_token):
  _checks.rank("prompt", prompt, 2, "BP")
  _checks.shape("prompt_hidden", prompt_hidden, prompt.shape + (None,), "BPD")
  _checks.shape("next_token", next_token, prompt.shape[:1], "B")


def _init_inputs(prompt, prompt_hidden, next_token, prompt_lens):
  """Checked, typed `init_state` inputs; `lens [B]` defaults to the full prompt length."""
  prompt, prompt_hidden = jnp.asarray(prompt), jnp.asarray(prompt_hidden)
  next_token = jnp.asarray(next_token, jnp.int32)
  _check_init(prompt, prompt_hidden, next_token)
  batch, length = prompt.shape
  lens = jnp.full([batch], length, jnp.int32) if prompt_lens is None else jnp.asarray(
      prompt_lens, jnp.int32)
  return prompt, prompt_hidden, next_token, lens


def _autoregressive(step, carry, first, keys, K, keep_fn=None, keep_init=None):
  """Depths 2..K of an autoregressive draft after depth 1 (`first`).

  `step(carry, (key,)) -> (carry, (logits [B,V], token [B], log_probs [B,V]))` runs one
  drafter pass. Without `keep_fn` a `lax.scan` runs all K - 1 passes. With it a
  `lax.while_loop` runs pass j + 1 while some row keeps drafting after depth j: rows that
  stopped still ride along in a pass that runs (their outputs are discarded, their cache
  writes land above the prefix the next step consumes and are never read), and a pass
  no row needs is not run. Depth j's key is `keys[j - 1]` either way, so what a row
  drafts does not depend on where other rows stopped.

  Returns `(carry, logits [B,K,V], tokens [B,K], log_probs [B,K,V], depth [B] | None,
  passes [] | None, aux | None)` (`aux`: the `keep_fn`'s last).
  """
  logits0, tok0, lp0 = first
  if keep_fn is None:
    carry, (logits, toks, lps) = jax.lax.scan(step, carry, (keys[1:],))
    stack = lambda f, rest: jnp.concatenate([f[:, None], jnp.moveaxis(rest, 0, 1)], 1)
    return (carry, stack(logits0, logits), stack(tok0, toks), stack(lp0, lps), None, None,
            None)
  B = tok0.shape[0]
  buffer = lambda x: jnp.zeros((B, K) + x.shape[1:], x.dtype).at[:, 0].set(x)
  keep, aux = keep_fn(jnp.int32(1), logits0, lp0, keep_init)
  init = (jnp.int32(1), carry, buffer(logits0), buffer(tok0), buffer(lp0),
          jnp.ones((B,), jnp.int32), keep, aux)

  def cond(loop):
    j, keep = loop[0], loop[6]
    return (j < K) & jnp.any(keep)

  def body(loop):
    j, carry, logits, toks, lps, depth, keep, aux = loop
    carry, (lg, tok, lp) = step(carry, (keys[j],))
    row = lambda x: keep.reshape((B,) + (1,) * (x.ndim - 1))
    put = lambda buf, x: jax.lax.dynamic_update_index_in_dim(
        buf, jnp.where(row(x), x, jnp.zeros_like(x)), j, axis=1)
    more, aux = keep_fn(j + 1, lg, lp, aux)
    return (j + 1, carry, put(logits, lg), put(toks, tok), put(lps, lp),
            depth + keep.astype(jnp.int32), keep & more, aux)

  passes, carry, logits, toks, lps, depth, _, aux = jax.lax.while_loop(cond, body, init)
  return carry, logits, toks, lps, depth, passes, aux


# ------------------------------------------------------------------------------ draft_lm


def _make_draft_lm(cfg: ModelsConfig) -> Drafter:
  lm_cfg: TransformerConfig = cfg.draft_lm

  def init_state(params, target_params, *, prompt, prompt_hidden, next_token, K, max_len,
                 prompt_lens=None):
    del target_params
    prompt, prompt_hidden, next_token, lens = _init_inputs(prompt, prompt_hidden, next_token,
                                                           prompt_lens)
    batch, length = prompt.shape
    positions = jnp.broadcast_to(jnp.arange(length), prompt.shape)
    cache = transformer.init_cache(lm_cfg, batch, max_len, kv_cache_dtype(cfg))
    cache = transformer.forward(params, prompt, positions, cache, cfg=lm_cfg,
                                valid=positions < lens[:, None]).cache
    tokens, hidden = _pending_from_prompt(prompt_hidden, next_token, lens, K)
    return DrafterState(cache, tokens, hidden, jnp.ones([batch], jnp.int32), lens)

  def draft(params, target_params, state, key, *, K, temperature=1.0, top_p=1.0,
            keep_fn=None, keep_init=None):
    del target_params
    positions, valid = _pending_inputs(state)
    # Every pending token writes the cache; only the newest predicts depth 1, so the last
    # layer's query and MLP and the head run on it alone (`transformer.forward` pick).
    out = transformer.forward(params, state.tokens, positions, state.cache, cfg=lm_cfg,
                              valid=valid, pick=state.num_pending - 1)
    logits0 = out.logits
    _, _, pos_n = _last_pending(state)
    keys = jax.random.split(key, K)
    tok0, lp0 = sample_with_log_probs(keys[0], logits0, temperature=temperature, top_p=top_p)

    def step(carry, inp):
      cache, tok, pos = carry
      k, = inp
      o = transformer.forward(params, tok[:, None], pos[:, None], cache, cfg=lm_cfg)
      logits = o.logits[:, 0]
      nxt, lp = sample_with_log_probs(k, logits, temperature=temperature, top_p=top_p)
      return (o.cache, nxt, pos + 1), (logits, nxt, lp)

    (cache, _, _), logits, toks, lps, depth, passes, aux = _autoregressive(
        step, (out.cache, tok0, pos_n + 1), (logits0, tok0, lp0), keys, K, keep_fn,
        keep_init)
    return DraftOutput(logits, toks, None, state._replace(cache=cache), lps, depth, passes,
                       aux)

  def absorb(params, target_params, state):
    del target_params
    positions, valid = _pending_inputs(state)
    out = transformer.forward(params, state.tokens, positions, state.cache, cfg=lm_cfg,
                              valid=valid)
    return state._replace(cache=out.cache)

  return Drafter("draft_lm", DRAFTING["draft_lm"], init_state, draft, commit, stepwise=True,
                 absorb=absorb, skips=True)


# --------------------------------------------------------------------------------- eagle


def _make_eagle(cfg: ModelsConfig) -> Drafter:
  ecfg = cfg.eagle
  dense_head = _eagle_module(cfg, "dense")
  one_layer = TransformerConfig(vocab_size=1, d_model=cfg.target.d_model, num_layers=1,
                                num_heads=ecfg.num_heads, head_dim=ecfg.head_dim,
                                mlp_dim=ecfg.mlp_dim)

  def run(params, emb, hidden, tokens, positions, cache, write, pick=None):
    layer = LayerKV(cache.k[0], cache.v[0])
    feats, logits, new = dense_head.apply({"params": params}, emb, hidden, tokens, positions,
                                          layer, write, pick)
    return feats, logits, transformer.KVCache(new.k[None], new.v[None])

  def init_state(params, target_params, *, prompt, prompt_hidden, next_token, K, max_len,
                 prompt_lens=None):
    prompt, prompt_hidden, next_token, lens = _init_inputs(prompt, prompt_hidden, next_token,
                                                           prompt_lens)
    batch, length = prompt.shape
    cache = transformer.init_cache(one_layer, batch, max_len, kv_cache_dtype(cfg))
    # The pair (h_{t-1}, x_t) of sequence position t >= 1 lives at head position t - 1, so
    # every head-cache entry at or below a query's position is written (RoPE makes the
    # shift invisible to the outputs).
    positions = jnp.broadcast_to(jnp.arange(length - 1), (batch, length - 1))
    write = jnp.where(positions + 1 < lens[:, None], positions, max_len)
    if length > 1:
      _, _, cache = run(params, transformer.embedding(target_params), prompt_hidden[:, :-1],
                        prompt[:, 1:], positions, cache, write)
    tokens, hidden = _pending_from_prompt(prompt_hidden, next_token, lens, K)
    return DrafterState(cache, tokens, hidden, jnp.ones([batch], jnp.int32), lens)

  def draft(params, target_params, state, key, *, K, temperature=1.0, top_p=1.0,
            keep_fn=None, keep_init=None):
    emb = transformer.embedding(target_params)
    positions, valid = _pending_inputs(state)
    positions = positions - 1  # head position = sequence position - 1 (see init_state)
    max_len = transformer.cache_len(state.cache)
    # Every pending column writes the head's cache; only the newest predicts depth 1, so
    # only it runs on past its keys and values (`EagleHead` pick).
    idx = state.num_pending - 1
    feat0, logits0, cache = run(params, emb, state.hidden, state.tokens, positions,
                                state.cache, jnp.where(valid, positions, max_len), idx)
    _, _, pos_n = _last_pending(state)
    keys = jax.random.split(key, K)
    tok0, lp0 = sample_with_log_probs(keys[0], logits0, temperature=temperature, top_p=top_p)

    def step(carry, inp):
      cache, feat, tok, pos = carry
      k, = inp
      f, lg, cache = run(params, emb, feat[:, None], tok[:, None], pos[:, None], cache,
                         pos[:, None])
      f, lg = f[:, 0], lg[:, 0]
      nxt, lp = sample_with_log_probs(k, lg, temperature=temperature, top_p=top_p)
      return (cache, f, nxt, pos + 1), (lg, nxt, lp)

    (cache, _, _, _), logits, toks, lps, depth, passes, aux = _autoregressive(
        step, (cache, feat0, tok0, pos_n), (logits0, tok0, lp0), keys, K, keep_fn,
        keep_init)
    return DraftOutput(logits, toks, None, state._replace(cache=cache), lps, depth, passes,
                       aux)

  def absorb(params, target_params, state):
    positions, valid = _pending_inputs(state)
    positions = positions - 1  # head position = sequence position - 1 (see init_state)
    _, _, cache = run(params, transformer.embedding(target_params), state.hidden,
                      state.tokens, positions, state.cache,
                      jnp.where(valid, positions, transformer.cache_len(state.cache)))
    return state._replace(cache=cache)

  return Drafter("eagle", DRAFTING["eagle"], init_state, draft, commit, stepwise=True,
                 absorb=absorb, skips=True)


# --------------------------------------------------------------------------------- block


def _make_block(cfg: ModelsConfig, kind: str) -> Drafter:
  module = _block_module(cfg, kind)

  def init_state(params, target_params, *, prompt, prompt_hidden, next_token, K, max_len,
                 prompt_lens=None):
    del params, target_params, max_len
    prompt, prompt_hidden, next_token, lens = _init_inputs(prompt, prompt_hidden, next_token,
                                                           prompt_lens)
    batch, length = prompt.shape
    tokens, hidden = _pending_from_prompt(prompt_hidden, next_token, lens, K)
    return DrafterState(None, tokens, hidden, jnp.ones([batch], jnp.int32), lens)

  def draft(params, target_params, state, key, *, K, temperature=1.0, top_p=1.0):
    if K > cfg.block.block_size:
      raise ValueError(f"K={K} exceeds the block drafter's block_size {cfg.block.block_size}")
    tok, hid, _ = _last_pending(state)
    _, logits, conf = module.apply({"params": params}, transformer.embedding(target_params),
                                   hid, tok)
    logits = logits[:, :K]
    # All K distributions are fixed before any draw: independent draws per position.
    toks, log_probs = sample_with_log_probs(key, logits, temperature=temperature, top_p=top_p)
    return DraftOutput(logits, toks, None if conf is None else conf[:, :K], state, log_probs)

  return Drafter(kind, DRAFTING[kind], init_state, draft, commit, skips=True)


@functools.lru_cache(maxsize=64)
def make_drafter(kind: str, cfg: ModelsConfig) -> Drafter:
  """The `Drafter` of `kind` for model set `cfg` (functions close over the config only).

  Cached: equal `(kind, cfg)` give the same object, so jitted callers taking the drafter
  as a static argument do not recompile.

  Example:
    >>> d = make_drafter("eagle", cfg)
    >>> draft = jax.jit(d.draft, static_argnames="K")
  """
  if kind == "draft_lm":
    return _make_draft_lm(cfg)
  if kind == "eagle":
    return _make_eagle(cfg)
  if kind in ("block", "block_head"):
    return _make_block(cfg, kind)
  raise KeyError(f"unknown drafter kind {kind!r}; known: {KINDS}")
