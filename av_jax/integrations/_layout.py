"""Ragged <-> dense layout helpers shared by the serving-stack adapters.

Serving stacks pack the drafts of B requests into one flat buffer of T rows: request b
owns `num_draft_tokens[b]` consecutive rows, in request order, and rows past
`sum(num_draft_tokens)` are padding. AV plans on a dense `[B, K]` batch and verifies the
first `num_verified[b]` drafts of request b, so its plan *is* the stacks' per-request
draft length: `num_draft_tokens = num_verified`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from av_jax import _checks
# The flat-buffer index is shared with the core's `rejection_sample_ragged`.
from av_jax._ragged import RaggedIndex, check_counts, ragged_index  # noqa: F401 (re-exported)


def to_flat(values: jax.Array, index: RaggedIndex, *, num_tokens: int, fill) -> jax.Array:
  """Scatters `[B, K, ...]` per-draft values to the flat `[T, ...]` rows; `fill` elsewhere."""
  flat_rows = jnp.where(index.in_draft, index.rows, num_tokens).reshape(-1)
  out = jnp.full((num_tokens,) + values.shape[2:], fill, values.dtype)
  return out.at[flat_rows].set(values.reshape((-1,) + values.shape[2:]), mode="drop")


def pack_drafts(
    draft_tokens: jax.typing.ArrayLike,
    num_verified: jax.typing.ArrayLike,
    *,
    draft_probs: jax.typing.ArrayLike | None = None,
    num_tokens: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """AV's plan as a stack's flat spec-decode inputs.

  Request b's first `num_verified[b]` drafts are packed consecutively, in request order;
  the rest of the buffer is padding (-1 ids, zero probabilities).

  Args:
    draft_tokens: `[B, K]` int drafts (AV's dense layout).
    num_verified: `[B]` int, the plan's verified positions per request (AV's
      `Plan.num_verified`); becomes `num_draft_tokens`.
    draft_probs: optional `[B, K, V]` draft distributions.
    num_tokens: static T of the flat buffer; default B * K (always enough).

  Returns:
    `(draft_token_ids [T], num_draft_tokens [B], draft_probs [T, V] or None)`.
  """
  draft_tokens = jnp.asarray(draft_tokens)
  num_verified = jnp.asarray(num_verified)
  _checks.rank("draft_tokens", draft_tokens, 2, "BK")
  _checks.integer("draft_tokens", draft_tokens)
  B, K = draft_tokens.shape
  _checks.shape("num_verified", num_verified, (B,), "B")
  _checks.integer("num_verified", num_verified)
  T = B * K if num_tokens is None else int(num_tokens)
  check_counts(num_verified, num_tokens=T, max_draft_len=K, name="num_verified")
  if draft_probs is not None:
    draft_probs = jnp.asarray(draft_probs, jnp.float32)
    _checks.rank("draft_probs", draft_probs, 3, "BKV")
    _checks.shape("draft_probs", draft_probs, (B, K, None), "BKV")
  return _pack(draft_tokens, num_verified, draft_probs, num_tokens=T)


@functools.partial(jax.jit, static_argnames="num_tokens")
def _pack(draft_tokens, num_verified, draft_probs, *, num_tokens):
  K = draft_tokens.shape[1]
  index = ragged_index(num_verified, num_tokens=num_tokens, max_draft_len=K)
  ids = to_flat(draft_tokens.astype(jnp.int32), index, num_tokens=num_tokens, fill=-1)
  probs = (None if draft_probs is None
           else to_flat(draft_probs, index, num_tokens=num_tokens, fill=0.0))
  return ids, index.counts, probs


def to_dense_labels(
    accepted: jax.typing.ArrayLike,
    labeled: jax.typing.ArrayLike,
    num_draft_tokens: jax.typing.ArrayLike,
    *,
    max_draft_len: int,
) -> tuple[jax.Array, jax.Array]:
  """Flat `[T]` labels back to AV's `[B, K]` (what `make_decision` / the estimator take).

  Returns:
    `(accepted [B, K], labeled [B, K])` bool; positions past a request's drafts False.
  """
  accepted = jnp.asarray(accepted)
  labeled = jnp.asarray(labeled)
  _checks.rank("accepted", accepted, 1, "T")
  _checks.shape("labeled", labeled, accepted.shape, "T")
  return _to_dense(accepted, labeled, jnp.asarray(num_draft_tokens),
                   max_draft_len=int(max_draft_len))


@functools.partial(jax.jit, static_argnames="max_draft_len")
def _to_dense(accepted, labeled, num_draft_tokens, *, max_draft_len):
  index = ragged_index(num_draft_tokens, num_tokens=accepted.shape[0],
                       max_draft_len=max_draft_len)
  if accepted.shape[0] == 0:
    shape = index.in_draft.shape
    return jnp.zeros(shape, bool), jnp.zeros(shape, bool)
  return (index.in_draft & accepted[index.rows].astype(bool),
          index.in_draft & labeled[index.rows].astype(bool))


def mask_labels(labeled: jax.Array, learn: jax.typing.ArrayLike | None) -> jax.Array:
  """`[B, K]` labels of the requests with `learn[b]` True only (all when `learn` is None).

  E.g. `labeled = [[1, 1], [1, 0]]`, `learn = [False, True]` -> `[[0, 0], [1, 0]]`.
  """
  if learn is None:
    return labeled
  learn = jnp.asarray(learn)
  _checks.shape("learn", learn, labeled.shape[:1], "B")
  _checks.boolean("learn", learn)
  return labeled & learn[:, None]
