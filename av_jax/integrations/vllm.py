"""Adaptive Verification in vLLM's spec-decode layout.

vLLM (v1) packs the drafts of B requests flat (`draft_token_ids [T]`, per-request
`num_draft_tokens [B]`) and computes `T + B` logits rows in request order: request b's
`num_draft_tokens[b]` draft positions, then its bonus position. Its rejection sampler
returns `sampled_token_ids [B, max_spec_len + 1]` with -1 (`PLACEHOLDER_TOKEN_ID`) after
each request's last token. `rejection_sample` here takes that layout of target
*probabilities* (apply your sampling transforms first) and returns vLLM's output rows
plus what vLLM does not return and AV needs: per-draft acceptance labels.

Target probabilities: vLLM's `compute_probs` divides the logits by the temperature, then
applies top-k and top-p, then the softmax; compute the same (for temperature and top-p,
`exp(av_jax.sampling_log_probs(logits, temperature=..., top_p=...))`). For vLLM's greedy
requests pass one-hot rows at the arg-max: a draft is then accepted iff it is the arg-max
and the recovered token is the arg-max, exactly vLLM's greedy kernel.

`draft_probs=None` is vLLM's n-gram case (a deterministic draft): the draft is treated
as a point mass, so it is accepted with probability p(x) and a rejection emits from p with
x removed, as vLLM does.

Log-probabilities (`logprobs=n`, vLLM's `max_num_logprobs`; None, the default, computes
none): `logprobs_tensors`, vLLM's `LogprobsTensors` triple on the flattened rows of
`sampled_token_ids` (`[B * (max_spec_len + 1)]`, request b's row i at `b (K + 1) + i`, as
vLLM lays them out before `parse_output` drops the placeholders): column 0 the emitted
token and its `log target_probs`, then the top n of its row, and the emitted token's rank.
The law is the `target_probs` given, so with vLLM's `compute_probs` these are vLLM's
`processed_logprobs`. Placeholders read ids -1, log-probabilities NaN and rank -1.

With AV: `num_draft_tokens` is the plan's `num_verified` (`pack_drafts` packs AV's dense
drafts this way); `to_dense_labels` turns the `[T]` labels back into the `[B, K]`
`accepted` / `labeled` that `make_decision` takes at the next step.

Reference: vllm/v1/sample/rejection_sampler.py (vLLM project).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from av_jax import _checks
from av_jax.integrations._layout import mask_labels, pack_drafts, ragged_index, to_dense_labels
from av_jax.rejection import LogprobsTensors, rejection_sample_ragged

__all__ = ["LogprobsTensors", "PLACEHOLDER_TOKEN_ID", "VllmRejectionOutput",
           "labels_from_output", "pack_drafts", "rejection_sample", "to_dense_labels"]

PLACEHOLDER_TOKEN_ID = -1


class VllmRejectionOutput(NamedTuple):
  """vLLM's output rows plus AV's labels."""
  sampled_token_ids: jax.Array  # [B, max_spec_len + 1] int32, -1 after the last token
  num_accepted: jax.Array       # [B] int32, accepted drafts per request
  accepted: jax.Array           # [T] bool, flat draft accepted (each request's a prefix)
  labeled: jax.Array            # [T] bool, flat draft has an estimator label
  logprobs_tensors: LogprobsTensors | None = None  # [B (K + 1), ...]; None unless asked


def rejection_sample(
    key: jax.Array,
    *,
    draft_token_ids: jax.typing.ArrayLike,
    num_draft_tokens: jax.typing.ArrayLike,
    max_spec_len: int,
    draft_probs: jax.typing.ArrayLike | None,
    target_probs: jax.typing.ArrayLike,
    logprobs: int | None = None,
) -> VllmRejectionOutput:
  """Speculative sampling on vLLM's flat drafts and interleaved `T + B` target rows.

  Args:
    key: PRNG key.
    draft_token_ids: `[T]` int flat drafts; rows past `sum(num_draft_tokens)` are padding.
    num_draft_tokens: `[B]` int in [0, max_spec_len], summing to at most T.
    max_spec_len: static K.
    draft_probs: `[T, V]` draft distributions, or None for a deterministic (n-gram) draft.
    target_probs: `[T + B, V]` target distributions in vLLM's logits layout (request b's
      draft rows then its bonus row, requests in order).
    logprobs: static; None (default) computes none; n in [0, V] returns
      `logprobs_tensors` with the top n of every row (module docstring).

  Returns:
    A `VllmRejectionOutput`.

  Raises:
    ValueError: as `av_jax.rejection_sample_ragged` (shapes, `logprobs` outside [0, V];
      eagerly also counts that do not fit and draft ids outside [0, V) in verified
      positions).

  Example:
    >>> out = rejection_sample(key, draft_token_ids=ids, num_draft_tokens=n,
    ...                        max_spec_len=4, draft_probs=None, target_probs=p)
    >>> out.sampled_token_ids   # [[1, 2, 5], [3, 7, -1]]
  """
  draft_token_ids = jnp.asarray(draft_token_ids)
  target_probs = jnp.asarray(target_probs, jnp.float32)
  _checks.rank("draft_token_ids", draft_token_ids, 1, "T")
  _checks.integer("draft_token_ids", draft_token_ids)
  _checks.rank("target_probs", target_probs, 2, "T+B,V")
  T, V = draft_token_ids.shape[0], target_probs.shape[-1]
  K = int(max_spec_len)
  if draft_probs is None:
    # A deterministic draft: a point mass on its token (out-of-range ids are handled by
    # the sampler; the one-hot row of a clipped id is never read for them).
    draft_probs = jax.nn.one_hot(jnp.clip(draft_token_ids, 0, V - 1), V, dtype=jnp.float32)
  result = rejection_sample_ragged(
      key, draft_probs=draft_probs, draft_tokens=draft_token_ids,
      num_draft_tokens=num_draft_tokens, target_probs=target_probs, max_draft_len=K,
      logprobs=logprobs, logprob_ranks=True)
  B = result.num_emitted.shape[0]
  index = ragged_index(num_draft_tokens, num_tokens=T, max_draft_len=K)
  i = jnp.arange(K + 1)
  rows = jnp.minimum(index.starts[:, None] + jnp.arange(B)[:, None] + i[None, :], T + B - 1)
  emitted = i[None, :] < result.num_emitted[:, None]
  sampled = jnp.where(emitted, result.tokens[rows], PLACEHOLDER_TOKEN_ID)
  tensors = None
  if result.logprobs is not None:
    # The target rows' layout -> vLLM's flattened `[B, K + 1]` rows; a row past a
    # request's last token may belong to the next request, so it is masked.
    def rows_of(values, fill):
      picked = values[rows]
      mask = emitted.reshape(emitted.shape + (1,) * (picked.ndim - 2))
      return jnp.where(mask, picked, fill).reshape((B * (K + 1),) + picked.shape[2:])
    lp = result.logprobs
    tensors = LogprobsTensors(logprob_token_ids=rows_of(lp.logprob_token_ids, -1),
                              logprobs=rows_of(lp.logprobs, jnp.nan),
                              selected_token_ranks=rows_of(lp.selected_token_ranks, -1))
  return VllmRejectionOutput(sampled_token_ids=sampled, num_accepted=result.num_accepted,
                             accepted=result.accepted, labeled=result.labeled,
                             logprobs_tensors=tensors)


def labels_from_output(
    sampled_token_ids: jax.typing.ArrayLike,
    num_draft_tokens: jax.typing.ArrayLike,
    *,
    learn: jax.typing.ArrayLike | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """AV's `[B, K]` labels from vLLM's `sampled_token_ids [B, K + 1]` alone.

  Request b emitted `n_b` tokens (its non-placeholder entries): it accepted `n_b - 1`
  drafts, and rejected the next when that is fewer than its `num_draft_tokens[b]`. E.g.
  rows `[[1, 2, 5], [3, 7, -1]]` with 2 drafts each: request 0 accepted both (5 is its
  bonus token), request 1 accepted one and rejected its second draft.

  Args:
    sampled_token_ids: `[B, K + 1]` vLLM's output rows, -1 after each request's last token.
    num_draft_tokens: `[B]` drafts per request.
    learn: optional `[B]` bool, requests whose labels the estimator learns from; a
      request whose target applied a transform the drafter never sees (penalties,
      banned ids, a grammar) passes False and gets no label (`accepted` is kept).

  Returns:
    `(accepted [B, K], labeled [B, K], num_rejected_tokens [B])`.
  """
  sampled_token_ids = jnp.asarray(sampled_token_ids)
  num_draft_tokens = jnp.asarray(num_draft_tokens)
  _checks.rank("sampled_token_ids", sampled_token_ids, 2, "B,K+1")
  _checks.integer("sampled_token_ids", sampled_token_ids)
  B, K = sampled_token_ids.shape[0], sampled_token_ids.shape[1] - 1
  _checks.shape("num_draft_tokens", num_draft_tokens, (B,), "B")
  _checks.integer("num_draft_tokens", num_draft_tokens)
  counts = jnp.clip(num_draft_tokens.astype(jnp.int32), 0, K)
  emitted = jnp.sum(sampled_token_ids != PLACEHOLDER_TOKEN_ID, axis=-1, dtype=jnp.int32)
  num_accepted = jnp.clip(emitted - 1, 0, counts)
  pos = jnp.arange(K)[None, :]
  accepted = pos < num_accepted[:, None]
  labeled = accepted | ((pos == num_accepted[:, None]) & (num_accepted < counts)[:, None])
  return accepted, mask_labels(labeled, learn), counts - num_accepted
