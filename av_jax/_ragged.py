"""The flat ragged draft buffer of serving stacks, indexed as AV's dense `[B, K]` batch.

Request b owns `num_draft_tokens[b]` consecutive rows of a flat buffer of T rows, in
request order; rows past the sum are padding. Shared by `av_jax.rejection`'s ragged
sampler and the serving-stack adapters (`av_jax.integrations`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class RaggedIndex(NamedTuple):
  """Where each request's drafts sit in the flat buffer."""
  counts: jax.Array    # [B] int32, drafts of request b (clipped to [0, K], cut to fit T)
  starts: jax.Array    # [B] int32, first flat row of request b
  rows: jax.Array      # [B, K] int32, flat row of draft i of request b (clamped in range)
  in_draft: jax.Array  # [B, K] bool, i < counts[b]


def _is_concrete(*xs) -> bool:
  return not any(isinstance(x, jax.core.Tracer) for x in xs)


def check_counts(num_draft_tokens: jax.Array, *, num_tokens: int, max_draft_len: int,
                 name: str = "num_draft_tokens") -> None:
  """Eagerly (concrete values) refuses counts outside [0, K] or summing past T."""
  if not _is_concrete(num_draft_tokens):
    return
  counts = np.asarray(num_draft_tokens)
  if counts.size and (counts.min() < 0 or counts.max() > max_draft_len):
    raise ValueError(f"{name}: expected values in [0, max_draft_len={max_draft_len}], "
                     f"got {counts.tolist()}")
  if counts.sum() > num_tokens:
    raise ValueError(f"{name}: expected a sum of at most T={num_tokens} (the flat draft "
                     f"buffer), got {int(counts.sum())}")


def ragged_index(num_draft_tokens: jax.Array, *, num_tokens: int,
                 max_draft_len: int) -> RaggedIndex:
  """The `[B, K]` view of a flat buffer of `num_tokens` rows.

  Under jit counts are clipped to [0, K] and cut, in request order, to fit T.
  """
  T, K = num_tokens, max_draft_len
  counts = jnp.clip(jnp.asarray(num_draft_tokens).astype(jnp.int32), 0, K)
  starts = jnp.cumsum(counts) - counts
  counts = jnp.clip(T - starts, 0, counts)
  starts = jnp.cumsum(counts) - counts
  i = jnp.arange(K)
  rows = jnp.minimum(starts[:, None] + i[None, :], max(T, 1) - 1)
  return RaggedIndex(counts=counts, starts=starts, rows=rows,
                     in_draft=i[None, :] < counts[:, None])
