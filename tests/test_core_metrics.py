"""Metrics against scikit-learn (AUC, log-loss) and a NumPy ECE."""

import numpy as np
import pytest
from sklearn.metrics import log_loss as sk_log_loss
from sklearn.metrics import roc_auc_score

import av_jax
from av_jax import metrics


def _numpy_ece(p, y, num_bins=15):
  bins = np.minimum((p * num_bins).astype(int), num_bins - 1)
  total = 0.0
  for j in range(num_bins):
    sel = bins == j
    if sel.any():
      total += sel.mean() * abs(p[sel].mean() - y[sel].mean())
  return total


@pytest.mark.parametrize("seed", range(4))
def test_metrics_match_references(maybe_jit, seed):
  rng = np.random.default_rng(seed)
  n = 2000
  p = rng.uniform(size=n).astype(np.float32)
  if seed % 2:
    p = np.round(p, 2)  # heavy ties in the scores
  y = rng.uniform(size=n) < p ** 0.8
  mask = rng.uniform(size=n) < 0.7
  got_auc = maybe_jit(metrics.auc)(p, y, mask)
  np.testing.assert_allclose(got_auc, roc_auc_score(y[mask], p[mask]), rtol=1e-5)
  got_ll = maybe_jit(metrics.log_loss)(p, y, mask)
  np.testing.assert_allclose(got_ll, sk_log_loss(y[mask], np.clip(p[mask], 1e-7, 1 - 1e-7)),
                             rtol=1e-5)
  np.testing.assert_allclose(maybe_jit(metrics.ece)(p, y, mask), _numpy_ece(p[mask], y[mask]),
                             rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(metrics.ece(p, y, num_bins=10), _numpy_ece(p, y, 10), rtol=1e-4,
                             atol=1e-6)


def test_metrics_on_2d_inputs_and_degenerate_labels():
  p = np.array([[0.9, 0.2], [0.6, 0.4]], np.float32)
  y = np.array([[1, 0], [1, 1]], bool)
  np.testing.assert_allclose(metrics.auc(p, y), roc_auc_score(y.ravel(), p.ravel()))
  assert np.isnan(metrics.auc(p, np.ones_like(y)))
  assert float(metrics.ece(np.array([1.0, 1.0]), np.array([True, True]))) == 0.0
  # Scores need not be probabilities for AUC: a raw feature works.
  f = np.array([-3.0, 10.0, 2.0, 0.5])
  np.testing.assert_allclose(metrics.auc(f, [0, 1, 1, 0]), 1.0)
  assert av_jax.metrics is metrics
