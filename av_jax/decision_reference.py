"""Host-side NumPy reference of the per-step decision (`av_jax.decision.decision_step`).

The same math as the jitted decision, written the way the design note's host code does
it (float32 NumPy on the host: log-sum-exp feature, sigmoid, cumprod, sort + cumsum +
argmax budget, stable top-k allocation, gradient/Hessian accumulation). It serves two
purposes: an independent implementation the tests compare `decision_step` against, and
the NumPy baseline of `benchmarks/overhead.py`.

`DecisionConfig` holds the hyper-parameters once (the estimator's as the
`EstimatorConfig` the engine uses, the planner's as its `PlannerConfig`), so the JAX
decision (`DecisionConfig.jax_decision`, the engine's own verbs via `make_decider`) and
the references are built from the same numbers.
State is a flat dict of NumPy arrays keyed like the flattened `DecisionState`
(`"estimator.slope"`, ..., `"planner.budget"`, `"features"`); `flatten_state` turns a
JAX `DecisionState` into the same dict for comparisons.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from av_jax.decision import Decider, Decision, DecisionState, make_decider, make_decision
from av_jax.estimator import EstimatorConfig
from av_jax.features import FEATURE_CLIP
from av_jax.planner import _ALL, PlannerConfig
from av_jax.selection import CostModel, make_cost_model


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecisionConfig:
  """Hyper-parameters of one decision (estimator, planner, cost tables, drafting)."""
  num_positions: int              # K, maximum draft length
  draft_ms: tuple[float, ...]     # [R_max + 1] drafting cost by active requests
  verify_ms: tuple[float, ...]    # [T_max + 1] verification cost by verified tokens
  policy: str = "current"         # planner budget policy (see av_jax.planner)
  estimator: EstimatorConfig = EstimatorConfig()  # estimator hyper-parameters
  planner: PlannerConfig = PlannerConfig()        # planner hyper-parameters
  temperature: float = 1.0        # drafting temperature (top-p is not modelled here)

  def decider(self) -> Decider:
    """The decision's verbs for these hyper-parameters (the engine's, when it is built
    from the same settings: `make_decider` returns one object per setting)."""
    return make_decider(self.num_positions, policy=self.policy, estimator=self.estimator,
                        planner=self.planner)

  def cost(self) -> CostModel:
    """The cost tables as a `CostModel` (repaired by `make_cost_model`)."""
    return make_cost_model(self.draft_ms, self.verify_ms)

  def jax_decision(self, *, donate: bool = True, feature=None) -> Decision:
    """The jitted JAX decision for these hyper-parameters (`feature`: see decision_step);
    its `step` takes `self.cost()` as its last argument."""
    extra = {} if feature is None else dict(feature=feature)
    return make_decision(self.decider(), temperature=self.temperature, donate=donate,
                         **extra)

  def cost_tables(self) -> tuple[np.ndarray, np.ndarray]:
    """The cost tables as `make_cost_model` repairs them (running max, floor 1e-6)."""
    tables = [np.maximum.accumulate(np.maximum(np.asarray(t, np.float64), 1e-6))
              for t in (self.draft_ms, self.verify_ms)]
    return tables[0].astype(np.float32), tables[1].astype(np.float32)


def flatten_state(state: DecisionState) -> dict[str, np.ndarray]:
  """A JAX `DecisionState` as the reference's flat dict of host arrays."""
  flat = {f"estimator.{k}": np.asarray(v) for k, v in state.estimator._asdict().items()}
  flat.update({f"planner.{k}": np.asarray(v) for k, v in state.planner._asdict().items()})
  flat["features"] = np.asarray(state.features)
  return flat


_F32 = np.float32


def _sigmoid(x: np.ndarray) -> np.ndarray:
  return (_F32(1) / (_F32(1) + np.exp(-x))).astype(_F32)


class NumpyDecision:
  """The decision in float32 NumPy on the host (reference and benchmark baseline)."""

  def __init__(self, config: DecisionConfig):
    self.config = config
    self.draft_ms, self.verify_ms = config.cost_tables()

  def init(self, batch_size: int) -> dict[str, np.ndarray]:
    state = self._fresh_estimator()
    state["estimator.num_refits"] = np.zeros((), np.int32)
    state["planner.budget"] = np.asarray(_ALL, np.int32)
    state["planner.step"] = np.zeros((), np.int32)
    state["features"] = np.zeros((batch_size, self.config.num_positions), _F32)
    return state

  def _fresh_estimator(self) -> dict[str, np.ndarray]:
    c, K = self.config.estimator, self.config.num_positions
    zeros_k = np.zeros((K,), _F32)
    return {
        "estimator.slope": np.asarray(c.init_slope, _F32),
        "estimator.intercepts": np.full((K,), c.init_intercept, _F32),
        "estimator.grad_slope": np.zeros((), _F32),
        "estimator.grad_intercepts": zeros_k.copy(),
        "estimator.hess_slope": np.zeros((), _F32),
        "estimator.hess_cross": zeros_k.copy(),
        "estimator.hess_diag": zeros_k.copy(),
        "estimator.counts": zeros_k.copy(),
        "estimator.step": np.zeros((), np.int32),
    }

  # --- feature ---------------------------------------------------------------------

  def features(self, logits: np.ndarray) -> np.ndarray:
    """logit(q_max) = -log(sum_{v below max} exp(l_v - m) + extra ties), float32."""
    t = self.config.temperature
    if t > 0 and t != 1:
      logits = (logits / _F32(t)).astype(_F32)
    m = logits.max(axis=-1, keepdims=True)
    shifted = np.subtract(logits, m)
    below = shifted < 0
    np.exp(shifted, out=shifted)
    rest = np.sum(shifted, axis=-1, where=below, dtype=_F32)
    ties = (logits.shape[-1] - np.count_nonzero(below, axis=-1) - 1).astype(_F32)
    with np.errstate(divide="ignore"):
      return np.clip(-np.log(rest + ties), -FEATURE_CLIP, FEATURE_CLIP).astype(_F32)

  # --- estimator -------------------------------------------------------------------

  def _update(self, state, features, accepted, labeled):
    c = self.config.estimator
    slope, intercepts = state["estimator.slope"], state["estimator.intercepts"]
    mask = labeled & np.isfinite(features)
    f = np.where(mask, np.clip(np.nan_to_num(features, nan=0.0), -FEATURE_CLIP,
                               FEATURE_CLIP), _F32(0)).astype(_F32)
    mu = _sigmoid(slope * f + intercepts)
    m = mask.astype(_F32)
    resid = m * (mu - accepted.astype(_F32))
    weight = m * mu * (_F32(1) - mu)
    new = dict(state)
    for name, value in (("grad_slope", np.sum(resid * f)),
                        ("grad_intercepts", resid.sum(0)),
                        ("hess_slope", np.sum(weight * f * f)),
                        ("hess_cross", (weight * f).sum(0)),
                        ("hess_diag", weight.sum(0)),
                        ("counts", m.sum(0))):
      new[f"estimator.{name}"] = (state[f"estimator.{name}"] + value).astype(_F32)
    new["estimator.step"] = state["estimator.step"] + np.int32(1)
    if new["estimator.step"] >= c.refit_interval:
      new = self._refit(new)
    return new

  def _refit(self, state):
    """Damped Newton step on the arrowhead Hessian (Schur complement), then reset."""
    c = self.config.estimator
    g_w, g = state["estimator.grad_slope"], state["estimator.grad_intercepts"]
    cross = state["estimator.hess_cross"]
    a = state["estimator.hess_slope"] + _F32(c.l2)
    d = state["estimator.hess_diag"] + _F32(c.l2)
    safe_d = np.where(d > 0, d, _F32(1))
    c_over_d = np.where(d > 0, cross / safe_d, _F32(0))
    schur = np.maximum(a - np.sum(c_over_d * cross), _F32(max(c.l2, 1e-12)))
    delta_w = (-g_w + np.sum(c_over_d * g)) / schur
    n_i = state["estimator.counts"]
    n = np.sum(n_i)
    # Slope first (damped, capped, clamped); the intercepts then step given the slope
    # step actually applied.
    step_w = np.clip(n / (n + _F32(c.damping + 1e-30)) * delta_w, -c.max_step, c.max_step)
    slope = np.clip(state["estimator.slope"] + step_w, 0, c.max_abs_coef).astype(_F32)
    applied_w = slope - state["estimator.slope"]
    delta = np.where(d > 0, (-g - cross * applied_w) / safe_d, _F32(0))
    step = np.clip(n_i / (n_i + _F32(c.damping + 1e-30)) * delta, -c.max_step, c.max_step)
    intercepts = state["estimator.intercepts"] + step
    new = dict(state)
    new.update(self._fresh_estimator())
    new["estimator.slope"] = slope
    new["estimator.intercepts"] = np.clip(intercepts, -c.max_abs_coef,
                                          c.max_abs_coef).astype(_F32)
    new["estimator.num_refits"] = state["estimator.num_refits"] + np.int32(1)
    return new

  # --- survival, budget, allocation ------------------------------------------------

  @staticmethod
  def _ranked(surv, active):
    s = np.clip(np.nan_to_num(surv, nan=0.0), 0, 1)
    s = np.minimum.accumulate(s, axis=1)
    return np.where(active[:, None], s, _F32(-1)).astype(_F32)

  def _budget(self, surv, active):
    B, K = surv.shape
    ranked = self._ranked(surv, active)
    num_active = int(active.sum())
    flat = -np.sort(-ranked.ravel())
    n = np.arange(B * K + 1)
    expected = _F32(num_active) + np.concatenate(
        [np.zeros(1, _F32), np.cumsum(np.maximum(flat, 0), dtype=_F32)])
    draft = self.draft_ms[min(num_active, len(self.draft_ms) - 1)]
    tokens = num_active + n
    verify = self.verify_ms[np.minimum(tokens, len(self.verify_ms) - 1)]
    throughput = expected / np.maximum(draft + verify, _F32(1e-12))
    valid = (n <= num_active * K) & (tokens < len(self.verify_ms))
    valid[0] = True
    return np.int32(np.argmax(np.where(valid, throughput, -np.inf)))

  def _allocate(self, surv, budget, active):
    B, K = surv.shape
    flat = self._ranked(surv, active).T.ravel()  # position-major: ties -> lower i, lower b
    order = np.argsort(-flat, kind="stable")
    rank = np.empty(B * K, np.int64)
    rank[order] = np.arange(B * K)
    return ((rank < budget) & (flat >= 0)).reshape(K, B).T

  def _plan(self, state, probs, active):
    c = self.config
    B, K = probs.shape
    surv = np.cumprod(probs, axis=1, dtype=_F32)
    next_budget = state["planner.budget"]
    if c.policy == "current":
      budget = self._budget(surv, active)
    elif c.policy == "lagged":
      budget, next_budget = state["planner.budget"], self._budget(surv, active)
    elif c.policy == "fixed":
      budget = np.int32(B * K)
    else:
      budget = np.int32(0)
    mask = self._allocate(surv, budget, active)
    step = int(state["planner.step"])
    explored = np.zeros(B, bool)
    every = c.planner.explore_every
    if every > 0 and c.policy in ("current", "lagged") and step % every == 0:
      explored[(step // every) % B] = True
      explored &= active
    mask |= explored[:, None]
    # The reported budget is at most B * K (the lagged first step's "everything").
    return mask, np.int32(min(budget, B * K)), np.asarray(next_budget, np.int32)

  # --- the step --------------------------------------------------------------------

  def step(self, state, logits, accepted, labeled, active):
    """Mirrors `decision_step`; returns `(num_verified [B], mask [B, K], budget, state)`."""
    features = self.features(logits)
    state = self._update(state, state["features"], accepted, labeled)
    slope, intercepts = state["estimator.slope"], state["estimator.intercepts"]
    probs = _sigmoid(slope * np.clip(np.nan_to_num(features, nan=0.0), -FEATURE_CLIP,
                                     FEATURE_CLIP) + intercepts)
    mask, budget, next_budget = self._plan(state, probs, active)
    state = dict(state)
    state["planner.budget"] = next_budget
    state["planner.step"] = state["planner.step"] + np.int32(1)
    state["features"] = features
    return mask.sum(axis=1, dtype=np.int32), mask, budget, state
