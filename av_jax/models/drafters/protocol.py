"""The `Drafter` protocol (what the engine calls on a drafter) and its `DraftOutput`; the
kinds av_jax builds (`KINDS`, `DRAFTING`). See the `av_jax.models.drafters` docstring."""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from av_jax import _checks
from av_jax.models.drafters.backlog import (_draft_rows, _empty_window, _pending_counts,
                                            _settle_rows, _windowed, _write_back, _Written,
                                            can_skip, catch_up)
from av_jax.models.drafters.state import (DrafterState, _insert_row, _put_rows, _state_axes,
                                          _take_rows, _where_rows, keep_inactive, narrow,
                                          widen)

KINDS = ("draft_lm", "eagle", "block", "block_head")
# Each kind's drafting style: autoregressive (position i+1 reads the drawn token i) or
# parallel (no position reads a drawn token).
DRAFTING = {"draft_lm": "autoregressive", "eagle": "autoregressive", "block": "parallel",
         "block_head": "parallel"}


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
  """A drafter as the engine calls it (the protocol; see the package docstring).

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
  # the rows that skip keep a backlog (lazy catch-up; see the package docstring).
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
    `keep [E]` absorb their backlog, over the backlog's whole width (the engine settles
    rows of which some are full). Only where `full_rows` is not None."""
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
