"""Scoring metrics for acceptance predictors: AUC, log-loss, ECE (jit-able, maskable).

All take `(scores_or_probs, labels, mask=None)` of any common shape and reduce over every
element where `mask` is True. AUC ranks raw scores (any monotone feature works); log-loss
and ECE need probabilities in [0, 1].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from av_jax import _checks

# Probabilities are clipped to [EPS, 1 - EPS] in the log-loss, as scikit-learn does for
# float32 inputs.
EPS = 1e-7


def _prepare(values, labels, mask):
  values = jnp.asarray(values, jnp.float32)
  labels = jnp.asarray(labels)
  _checks.shape("labels", labels, values.shape)
  if mask is None:
    mask = jnp.ones(values.shape, bool)
  mask = jnp.asarray(mask)
  _checks.shape("mask", mask, values.shape)
  _checks.boolean("mask", mask)
  return values.reshape(-1), labels.reshape(-1).astype(bool), mask.reshape(-1)


def auc(scores: jax.typing.ArrayLike, labels: jax.typing.ArrayLike,
        mask: jax.typing.ArrayLike | None = None) -> jax.Array:
  """Area under the ROC curve (Mann-Whitney U with tied scores counted one half).

  Args:
    scores: `[...]` finite scores, larger meaning more likely positive.
    labels: `[...]` bool or 0/1.
    mask: optional `[...]` bool; only True entries count.

  Returns:
    float32 scalar; NaN when there are no positives or no negatives.
  """
  scores, labels, mask = _prepare(scores, labels, mask)
  # Masked entries move above every finite score, so counts below a valid score only
  # see valid entries.
  keyed = jnp.where(mask, scores, jnp.inf)
  ordered = jnp.sort(keyed)
  below = jnp.searchsorted(ordered, keyed, side="left")
  not_above = jnp.searchsorted(ordered, keyed, side="right")
  mid_rank = (below + not_above + 1).astype(jnp.float32) / 2.0  # 1-based average rank
  pos = mask & labels
  n_pos = jnp.sum(pos, dtype=jnp.float32)
  n_neg = jnp.sum(mask & ~labels, dtype=jnp.float32)
  u = jnp.sum(jnp.where(pos, mid_rank, 0.0)) - n_pos * (n_pos + 1.0) / 2.0
  return jnp.where((n_pos > 0) & (n_neg > 0), u / (n_pos * n_neg), jnp.nan)


def log_loss(probs: jax.typing.ArrayLike, labels: jax.typing.ArrayLike,
             mask: jax.typing.ArrayLike | None = None) -> jax.Array:
  """Mean negative log-likelihood of the labels, probabilities clipped to [EPS, 1-EPS]."""
  probs, labels, mask = _prepare(probs, labels, mask)
  p = jnp.clip(probs, EPS, 1.0 - EPS)
  nll = -jnp.where(labels, jnp.log(p), jnp.log1p(-p))
  return jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def ece(probs: jax.typing.ArrayLike, labels: jax.typing.ArrayLike,
        mask: jax.typing.ArrayLike | None = None, *, num_bins: int = 15) -> jax.Array:
  """Expected calibration error with equal-width bins, weighted by occupancy.

  Bin j holds probabilities in [j/num_bins, (j+1)/num_bins), the last bin also 1.0.
  `ECE = sum_j (n_j / n) |mean_prob_j - mean_label_j|`.
  """
  probs, labels, mask = _prepare(probs, labels, mask)
  bins = jnp.clip(jnp.floor(probs * num_bins).astype(jnp.int32), 0, num_bins - 1)
  w = mask.astype(jnp.float32)
  sum_prob = jax.ops.segment_sum(w * probs, bins, num_segments=num_bins)
  sum_label = jax.ops.segment_sum(w * labels, bins, num_segments=num_bins)
  # |mean_prob - mean_label| * n_j / n == |sum_prob - sum_label| / n.
  return jnp.sum(jnp.abs(sum_prob - sum_label)) / jnp.maximum(jnp.sum(w), 1.0)
