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
