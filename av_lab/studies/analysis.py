"""Scoring features and predictors on labelled drafts (studies 2, 3 and 4).

Fits here are offline maximum-likelihood logistic regressions (float64 Newton), the
batch counterpart of the online estimator: a shared slope and one intercept per draft
position (the shipped model), or one slope per position. They are fitted on the first
part of each stream and scored on the rest (out of sample). Metrics are the project's
own (`av_jax.metrics`), evaluated on power-of-two padded arrays so that a report
compiles each metric a handful of times.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import numpy as np

from av_jax import metrics
from av_lab.studies.collect import Drafts


class Fit(NamedTuple):
  """Logistic model `sigmoid(slope[pos] * x + intercepts[pos])`."""
  slope: np.ndarray        # [] shared, or [K] per position
  intercepts: np.ndarray   # [K]

  def predict(self, x: np.ndarray, position: np.ndarray) -> np.ndarray:
    slope = self.slope[position] if np.ndim(self.slope) else self.slope
    return sigmoid(slope * np.asarray(x, np.float64) + self.intercepts[position])


def fit_logistic(x: np.ndarray, position: np.ndarray, label: np.ndarray, num_positions: int,
                 *, per_position_slope: bool = False, l2: float = 1e-6,
                 iters: int = 100) -> Fit:
  """Maximum-likelihood fit by Newton's method (float64) with a tiny ridge.

  Args:
    x: `[N]` feature values.
    position: `[N]` int draft positions in [0, num_positions).
    label: `[N]` bool labels (accepted).
    num_positions: K.
    per_position_slope: one slope per position instead of a shared one.
    l2: ridge on every coefficient (keeps positions without labels finite).
    iters: maximum Newton iterations.

  Returns:
    The fitted coefficients.
  """
  x = np.asarray(x, np.float64)
  position = np.asarray(position)
  y = np.asarray(label, np.float64)
  if not x.shape == position.shape == y.shape or x.ndim != 1:
    raise ValueError(f"x, position, label: expected equal 1-D shapes, got {x.shape}, "
                     f"{position.shape}, {y.shape}")
  if position.size and (position.min() < 0 or position.max() >= num_positions):
    raise ValueError(f"position: expected values in [0, {num_positions})")
  K = num_positions
  onehot = np.eye(K)[position]                              # [N, K]
  slope_cols = onehot * x[:, None] if per_position_slope else x[:, None]
  design = np.concatenate([slope_cols, onehot], axis=1)     # [N, S + K]
  theta = np.zeros(design.shape[1])
  for _ in range(iters):
    mu = sigmoid(design @ theta)
    w = mu * (1.0 - mu)
    grad = design.T @ (mu - y) + l2 * theta
    hess = (design * w[:, None]).T @ design + l2 * np.eye(theta.size)
    delta = np.linalg.solve(hess, grad)
    theta -= delta
    if np.max(np.abs(delta)) < 1e-9:
      break
  s = theta.size - K
  slope = theta[:s] if per_position_slope else theta[0]
  return Fit(slope=np.asarray(slope), intercepts=theta[s:])


def _padded(n: int) -> int:
  return 1 << max(10, int(np.ceil(np.log2(max(n, 1)))))


@functools.lru_cache(maxsize=None)
def _metric_fns():
  return {name: jax.jit(fn) for name, fn in
          (("auc", metrics.auc), ("log_loss", metrics.log_loss), ("ece", metrics.ece))}


def score(probs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
  """AUC, log-loss and ECE (15 equal-width bins) of predictions; NaN when undefined."""
  probs = np.asarray(probs, np.float32)
  labels = np.asarray(labels, bool)
  n = probs.shape[0]
  if n == 0:
    return dict(auc=float("nan"), log_loss=float("nan"), ece=float("nan"), n=0,
                mean_pred=float("nan"), mean_label=float("nan"))
  size = _padded(n)
  p = np.zeros(size, np.float32)
  y = np.zeros(size, bool)
  m = np.zeros(size, bool)
  p[:n], y[:n], m[:n] = probs, labels, True
  out = {name: float(fn(p, y, m)) for name, fn in _metric_fns().items()}
  out.update(n=int(n), mean_pred=float(probs.mean()), mean_label=float(labels.mean()))
  return out


def reliability(probs: np.ndarray, labels: np.ndarray, num_bins: int = 10) -> dict:
  """Per equal-width bin: mean prediction, observed frequency and count."""
  probs = np.asarray(probs, np.float64)
  labels = np.asarray(labels, np.float64)
  bins = np.clip((probs * num_bins).astype(int), 0, num_bins - 1)
  count = np.bincount(bins, minlength=num_bins)
  mean_pred = np.bincount(bins, probs, minlength=num_bins) / np.maximum(count, 1)
  observed = np.bincount(bins, labels, minlength=num_bins) / np.maximum(count, 1)
  return dict(mean_pred=mean_pred.tolist(), observed=observed.tolist(), count=count.tolist())


def split_by_step(drafts: Drafts, fraction: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
  """Boolean masks (earlier part, later part) splitting each segment's steps."""
  early = np.zeros(len(drafts), bool)
  for seg in np.unique(drafts.segment):
    here = drafts.segment == seg
    steps = drafts.step[here]
    cut = steps.min() + fraction * (steps.max() + 1 - steps.min())
    early[here] = steps < cut
  return early, ~early


def sigmoid(x):
  """Logistic function without overflow warnings (float64)."""
  return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, np.float64)))


# name -> (feature column, fitted?, per-position slope?, lossless)
PREDICTORS = {
    "logit(q_max), shared slope (shipped)": ("logit_qmax", True, False, True),
    "logit(q_max), slope per position": ("logit_qmax", True, True, True),
    "q_max, no fit": ("logit_qmax", False, False, True),
    "top-2 margin, fitted": ("top2_margin", True, False, True),
    "neg. entropy, fitted": ("neg_entropy", True, False, True),
    "logit(q_sampled), fitted": ("logit_q_sampled", True, False, False),
    "-log(-log q_sampled), fitted": ("gumbel_q_sampled", True, False, False),
}


def out_of_sample(streams: dict[str, Drafts], num_positions: int, *,
                  fraction: float = 0.5) -> dict[str, tuple[np.ndarray, np.ndarray,
                                                              np.ndarray]]:
  """Every predictor fitted on the early part of each stream, applied to the later part.

  Args:
    streams: labelled drafts per stream (one fit per dict entry, e.g. per drafter, pooled
      over its workloads).
    num_positions: K.
    fraction: share of each segment's steps used for fitting.

  Returns:
    predictor name -> (predictions, labels, positions) on the later parts, concatenated
    over streams. Extra names: "online estimator (served)" and, for streams with a head,
    "confidence head (trained)".
  """
  out: dict[str, list] = {}
  for drafts in streams.values():
    early, late = split_by_step(drafts, fraction)
    test = drafts.take(late)
    for name, (column, fitted, per_pos, _) in PREDICTORS.items():
      x = drafts.feature(column)
      if fitted:
        fit = fit_logistic(x[early], drafts.position[early], drafts.label[early],
                           num_positions, per_position_slope=per_pos)
        pred = fit.predict(x[late], test.position)
      else:
        pred = sigmoid(x[late])
      out.setdefault(name, []).append((pred, test.label, test.position))
    out.setdefault("online estimator (served)", []).append(
        (test.served, test.label, test.position))
    if np.any(drafts.conf > 0):
      out.setdefault("confidence head (trained)", []).append(
          (test.conf, test.label, test.position))
  return {name: tuple(np.concatenate(parts) for parts in zip(*rows))
          for name, rows in out.items()}


def per_position(probs, labels, positions, num_positions: int, metric: str = "auc"):
  return [score(probs[positions == k], labels[positions == k])[metric]
          for k in range(num_positions)]


def round_ece(drafts: Drafts, refit_interval: int) -> list[dict]:
  """ECE of the served predictions per estimator round (steps // refit_interval)."""
  rounds = drafts.step // refit_interval
  rows = []
  for r in np.unique(rounds):
    here = rounds == r
    s = score(drafts.served[here], drafts.label[here])
    rows.append(dict(round=int(r), segment=int(np.bincount(drafts.segment[here]).argmax()),
                     ece=s["ece"], n=s["n"], mean_pred=s["mean_pred"],
                     mean_label=s["mean_label"]))
  return rows


def recovery_rounds(rows: list[dict], *, tail_fraction: float = 1 / 3,
                    slack: float = 0.01) -> list[dict]:
  """Refit rounds each segment after the first needs to return to its calibrated ECE.

  A segment's calibrated level is the median round ECE over its last `tail_fraction`
  of rounds; the segment has recovered at the first round from which every later round
  of the segment stays within `slack` of the larger of that level and the previous
  segment's level (both workloads' steady states count as calibrated).

  Returns:
    Per switch: the segment, its level, the threshold, the rounds to recover (None if it
    never did within the segment), the rounds the segment had, and the first round's ECE.
  """
  segs = sorted({r["segment"] for r in rows})
  levels = {}
  for seg in segs:
    eces = [r["ece"] for r in rows if r["segment"] == seg]
    tail = eces[-max(1, int(round(len(eces) * tail_fraction))):]
    levels[seg] = float(np.median(tail))
  out = []
  for prev, seg in zip(segs, segs[1:]):
    eces = [r["ece"] for r in rows if r["segment"] == seg]
    threshold = max(levels[seg], levels[prev]) + slack
    ok = [e <= threshold for e in eces]
    recovered = next((i for i in range(len(ok)) if all(ok[i:])), None)
    out.append(dict(segment=seg, level=levels[seg], threshold=threshold,
                    rounds_to_recover=recovered, rounds=len(eces), first_ece=eces[0]))
  return out
