"""PyTorch-eager reference of the per-step decision, for benchmarks/overhead.py.

The same math as `av_jax.decision.decision_step` and `av_jax.decision_reference.
NumpyDecision`, op for op, in float32 torch on the CPU, written as an eager serving
engine would (in-place ops where they save a pass or an allocation). State is the same
flat dict as the NumPy reference, holding tensors. Needs `torch` (the `bench` extra).
"""

from __future__ import annotations

import numpy as np
import torch

from av_jax.decision_reference import DecisionConfig
from av_jax.features import FEATURE_CLIP
from av_jax.planner import _ALL

_F32 = torch.float32


class TorchDecision:
  """The decision in float32 PyTorch eager on the CPU."""

  def __init__(self, config: DecisionConfig):
    self.config = config
    draft_ms, verify_ms = config.cost_tables()
    self.draft_ms = torch.from_numpy(draft_ms)
    self.verify_ms = torch.from_numpy(verify_ms)

  def _fresh_estimator(self):
    c, K = self.config.estimator, self.config.num_positions
    return {
        "estimator.slope": torch.tensor(c.init_slope, dtype=_F32),
        "estimator.intercepts": torch.full((K,), c.init_intercept, dtype=_F32),
        "estimator.grad_slope": torch.zeros((), dtype=_F32),
        "estimator.grad_intercepts": torch.zeros(K, dtype=_F32),
        "estimator.hess_slope": torch.zeros((), dtype=_F32),
        "estimator.hess_cross": torch.zeros(K, dtype=_F32),
        "estimator.hess_diag": torch.zeros(K, dtype=_F32),
        "estimator.counts": torch.zeros(K, dtype=_F32),
        "estimator.step": torch.zeros((), dtype=torch.int32),
    }

  def init(self, batch_size: int):
    state = self._fresh_estimator()
    state["estimator.num_refits"] = torch.zeros((), dtype=torch.int32)
    state["planner.budget"] = torch.tensor(_ALL, dtype=torch.int32)
    state["planner.step"] = torch.zeros((), dtype=torch.int32)
    state["planner.drafting_pays"] = torch.tensor(True)  # the decision always drafts
    state["planner.tau"] = torch.zeros((), dtype=_F32)  # survival stop's threshold: no stop
    # The skip-drafting gate's fields, constant here (the decision is not gated).
    every = self.config.planner.recheck_every or 4 * max(self.config.planner.explore_every, 1)
    state["planner.slot_pays"] = torch.ones(batch_size, dtype=torch.bool)
    state["planner.recheck_interval"] = torch.tensor(every, dtype=torch.int32)
    state["planner.next_recheck"] = torch.tensor(every, dtype=torch.int32)
    state["planner.recheck_count"] = torch.zeros((), dtype=torch.int32)
    state["features"] = torch.zeros(batch_size, self.config.num_positions, dtype=_F32)
    return state

  def features(self, logits: torch.Tensor) -> torch.Tensor:
    t = self.config.temperature
    if t > 0 and t != 1:
      logits = logits / t
    m = logits.amax(dim=-1, keepdim=True)
    shifted = logits - m
    below = shifted < 0
    rest = shifted.exp_().masked_fill_(~below, 0.0).sum(dim=-1)
    ties = (logits.shape[-1] - below.sum(dim=-1) - 1).to(_F32)
    return (-torch.log(rest + ties)).clamp_(-FEATURE_CLIP, FEATURE_CLIP)

  @staticmethod
  def _sanitize(features):
    return torch.nan_to_num(features, nan=0.0).clamp(-FEATURE_CLIP, FEATURE_CLIP)

  def _update(self, state, features, accepted, labeled):
    c = self.config.estimator
    mask = labeled & torch.isfinite(features)
    f = torch.where(mask, self._sanitize(features), 0.0)
    mu = torch.sigmoid(state["estimator.slope"] * f + state["estimator.intercepts"])
    m = mask.to(_F32)
    resid = m * (mu - accepted.to(_F32))
    weight = m * mu * (1.0 - mu)
    new = dict(state)
    for name, value in (("grad_slope", torch.sum(resid * f)),
                        ("grad_intercepts", resid.sum(0)),
                        ("hess_slope", torch.sum(weight * f * f)),
                        ("hess_cross", (weight * f).sum(0)),
                        ("hess_diag", weight.sum(0)),
                        ("counts", m.sum(0))):
      new[f"estimator.{name}"] = state[f"estimator.{name}"] + value
    new["estimator.step"] = state["estimator.step"] + 1
    if int(new["estimator.step"]) >= c.refit_interval:
      new = self._refit(new)
    return new

  def _refit(self, state):
    c = self.config.estimator
    g_w, g = state["estimator.grad_slope"], state["estimator.grad_intercepts"]
    cross = state["estimator.hess_cross"]
    a = state["estimator.hess_slope"] + c.l2
    d = state["estimator.hess_diag"] + c.l2
    safe_d = torch.where(d > 0, d, 1.0)
    c_over_d = torch.where(d > 0, cross / safe_d, 0.0)
    schur = torch.clamp(a - torch.sum(c_over_d * cross), min=max(c.l2, 1e-12))
    delta_w = (-g_w + torch.sum(c_over_d * g)) / schur
    delta = torch.where(d > 0, (-g - cross * delta_w) / safe_d, 0.0)
    n_i = state["estimator.counts"]
    n = torch.sum(n_i)
    step_w = torch.clamp(n / (n + c.damping + 1e-30) * delta_w, -c.max_step, c.max_step)
    step = torch.clamp(n_i / (n_i + c.damping + 1e-30) * delta, -c.max_step, c.max_step)
    slope = state["estimator.slope"] + step_w
    intercepts = state["estimator.intercepts"] + step
    new = dict(state)
    new.update(self._fresh_estimator())
    new["estimator.slope"] = slope.clamp(0, c.max_abs_coef)
    new["estimator.intercepts"] = intercepts.clamp(-c.max_abs_coef, c.max_abs_coef)
    new["estimator.num_refits"] = state["estimator.num_refits"] + 1
    return new

  @staticmethod
  def _ranked(surv, active):
    s = torch.nan_to_num(surv, nan=0.0).clamp(0, 1)
    s = torch.cummin(s, dim=1).values
    return torch.where(active[:, None], s, -1.0)

  def _budget(self, surv, active):
    B, K = surv.shape
    ranked = self._ranked(surv, active)
    num_active = int(active.sum())
    flat = -torch.sort(-ranked.reshape(-1)).values
    n = torch.arange(B * K + 1)
    expected = num_active + torch.cat([torch.zeros(1), torch.cumsum(flat.clamp(min=0), 0)])
    draft = self.draft_ms[min(num_active, len(self.draft_ms) - 1)]
    tokens = num_active + n
    verify = self.verify_ms[tokens.clamp(max=len(self.verify_ms) - 1)]
    throughput = expected / torch.clamp(draft + verify, min=1e-12)
    valid = (n <= num_active * K) & (tokens < len(self.verify_ms))
    valid[0] = True
    return int(torch.argmax(torch.where(valid, throughput, -torch.inf)))

  def _allocate(self, surv, budget, active):
    B, K = surv.shape
    flat = self._ranked(surv, active).T.reshape(-1)
    order = torch.sort(-flat, stable=True).indices
    rank = torch.empty(B * K, dtype=torch.int64)
    rank[order] = torch.arange(B * K)
    return ((rank < budget) & (flat >= 0)).reshape(K, B).T

  def step(self, state, logits, accepted, labeled, active):
    """Mirrors `decision_step`; returns `(num_verified [B], mask [B, K], budget, state)`."""
    c = self.config
    features = self.features(logits)
    state = self._update(state, state["features"], accepted, labeled)
    probs = torch.sigmoid(state["estimator.slope"] * self._sanitize(features)
                          + state["estimator.intercepts"])
    B, K = probs.shape
    surv = torch.cumprod(probs, dim=1)
    next_budget = state["planner.budget"]
    if c.policy == "current":
      budget = self._budget(surv, active)
    elif c.policy == "lagged":
      budget = int(state["planner.budget"])
      next_budget = torch.tensor(self._budget(surv, active), dtype=torch.int32)
    elif c.policy == "fixed":
      budget = B * K
    else:
      budget = 0
    mask = self._allocate(surv, budget, active)
    step = int(state["planner.step"])
    every = c.planner.explore_every
    if every > 0 and c.policy in ("current", "lagged") and step % every == 0:
      slot = (step // every) % B
      mask[slot] |= bool(active[slot])
    state = dict(state)
    state["planner.budget"] = next_budget
    state["planner.step"] = state["planner.step"] + 1
    state["features"] = features
    budget = min(budget, B * K)  # reported at most B * K, as the planner does
    return mask.sum(dim=1, dtype=torch.int32), mask, budget, state


def to_numpy_state(state) -> dict[str, np.ndarray]:
  """A torch reference state as host NumPy arrays (for agreement checks)."""
  return {k: v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v) for k, v in state.items()}
