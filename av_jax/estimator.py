"""Online acceptance estimator: per-position logistic regression refit by damped IRLS.

    pi[b, i] = sigmoid(slope * f[b, i] + intercepts[i])

One slope shared by the K positions, one intercept per position (K + 1 parameters).
Coefficients stay fixed during a round of `refit_interval` updates; each update adds the
labelled drafts' gradient and Hessian of the negative log-likelihood at the current
coefficients; the round ends with one damped Newton step (docs/algorithm.md section 7).

The Hessian is an arrowhead matrix: a dense slope row/column and a diagonal intercept
block, because every label touches the slope and exactly one intercept. It is stored as
three parts (`hess_slope []`, `hess_cross [K]`, `hess_diag [K]`) and solved in O(K) by the
Schur complement of the diagonal block, so memory is O(K) however many labels arrive.

Robustness (docs/algorithm.md section 7 failure modes): entries whose feature is not finite are never
labelled; positions without labels get a zero step (never NaN); each step is capped at
`max_step` per coefficient (a trust region, so a saturated start climbs instead of
overshooting); coefficients are clamped
to `[-max_abs_coef, max_abs_coef]` (the slope to `[0, max_abs_coef]`) so an all-accept or
all-reject stretch cannot push them to where a workload change takes many rounds to undo.
The step is taken in that order, slope first: its Newton step is damped, capped and
clamped, and only then do the intercepts take their Newton step *given the slope step
actually applied* (`intercept_step`), so that when the slope sits at a clamp the
intercepts do not move as if it had taken its unconstrained step. With the slope clamp
binding this is the exact constrained Newton step of the round's quadratic model.
For data-parallel replicas pass `axis_name` to `update`: the round's statistics are then
summed over that mesh axis so every replica holds identical coefficients.

Label hygiene: `update(..., learn=mask)` drops whole requests from the statistics. A
request whose target applies a transform the drafter never sees (repetition or presence
penalties, banned or allowed ids, a grammar) accepts at rates that say nothing about the
drafter; with `learn[b] = False` its labels add exactly zero to every sum (as if it were
unlabelled), while the round still counts the update. E.g. B = 2, `learn = [True, False]`:
the round's statistics are those of request 0 alone.

Reference: vLLM's online acceptance estimator for Adaptive Verification (PR 52228).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from av_jax import _checks
from av_jax.features import FEATURE_CLIP


@dataclasses.dataclass(frozen=True, kw_only=True)
class EstimatorConfig:
  """Every hyper-parameter of the online estimator, in one place (see `online_estimator`).

  Used by `online_estimator`, the engine (`EngineConfig.estimator`) and the NumPy
  reference (`av_lab.decision_reference`).
  """
  refit_interval: int = 100     # N, updates per round; `update` refits when a round ends
  damping: float = 50.0         # c, evidence damping n / (n + c) of each coefficient's step
  l2: float = 1e-3              # ridge added to the Hessian's diagonal before the solve
  init_slope: float = 0.5       # starting slope (0.45-0.59 measured across real pairs)
  init_intercept: float = 1.5   # starting intercept of every position (vLLM uses 1.5)
  max_abs_coef: float = 20.0    # coefficients are clamped to this magnitude after a refit
  max_step: float = 2.0         # trust region: largest change of a coefficient per refit

  def __post_init__(self):
    if self.refit_interval < 1:
      raise ValueError(f"refit_interval: expected >= 1, got {self.refit_interval}")
    if self.damping < 0 or self.l2 < 0:
      raise ValueError(f"damping and l2: expected >= 0, got {self.damping}, {self.l2}")


class EstimatorState(NamedTuple):
  """State of the online estimator (a pytree; every field is an array).

  The round's accumulators are sums over labelled drafts of the log-loss gradient and
  Hessian at the current coefficients, with phi = (f, e_i), mu = pi, w = mu (1 - mu).
  """
  slope: jax.Array            # [] float32, shared slope w >= 0
  intercepts: jax.Array       # [K] float32, beta_i
  grad_slope: jax.Array       # [] float32, sum (mu - y) f
  grad_intercepts: jax.Array  # [K] float32, sum_{labels at i} (mu - y)
  hess_slope: jax.Array       # [] float32, sum w f^2
  hess_cross: jax.Array       # [K] float32, sum_{labels at i} w f
  hess_diag: jax.Array        # [K] float32, sum_{labels at i} w
  counts: jax.Array           # [K] float32, labels at position i this round (n_i)
  step: jax.Array             # [] int32, updates since the round began
  num_refits: jax.Array       # [] int32, rounds completed


class OnlineEstimator(NamedTuple):
  """The estimator's pure functions (optax-style); see `online_estimator`."""
  init: Callable[[], EstimatorState]
  predict: Callable[..., jax.Array]
  update: Callable[..., EstimatorState]
  refit: Callable[..., EstimatorState]
  num_positions: int
  config: EstimatorConfig


def _sanitize(features: jax.Array) -> jax.Array:
  """Features as scored: NaN -> 0 (a neutral log-odds), +-inf -> +-FEATURE_CLIP."""
  return jnp.clip(jnp.nan_to_num(features, nan=0.0), -FEATURE_CLIP, FEATURE_CLIP)


def newton_step(state: EstimatorState, *, l2: float) -> tuple[jax.Array, jax.Array]:
  """Solves `(H + l2 I) delta = -g` for the arrowhead H of `state`, in O(K).

  With `H = [[a, c^T], [c, diag(d)]]`, eliminating the intercepts gives the slope step
  `delta_w = (-g_w + sum_i c_i g_i / d_i) / (a - sum_i c_i^2 / d_i)` (all with l2 added
  to a and d) and then `delta_i = (-g_i - c_i delta_w) / d_i` (`intercept_step`). An
  unlabelled position has `c_i = g_i = d_i = 0`, so its step is exactly 0. The Schur
  complement is bounded below by `l2` in exact arithmetic; it is clamped there so float32
  cancellation (all features equal in a round) cannot flip its sign.

  Returns:
    `(delta_slope [], delta_intercepts [K])`, the unconstrained Newton step.
  """
  a = state.hess_slope + l2
  d = state.hess_diag + l2
  safe_d = jnp.where(d > 0, d, 1.0)
  c_over_d = jnp.where(d > 0, state.hess_cross / safe_d, 0.0)
  schur = jnp.maximum(a - jnp.sum(c_over_d * state.hess_cross), max(l2, 1e-12))
  delta_slope = (-state.grad_slope + jnp.sum(c_over_d * state.grad_intercepts)) / schur
  return delta_slope, intercept_step(state, delta_slope, l2=l2)


def intercept_step(state: EstimatorState, slope_step: jax.Array, *, l2: float) -> jax.Array:
  """The intercepts' Newton step given the slope step actually taken, in O(K).

  The minimiser over the intercepts of the quadratic model
  `g^T delta + delta^T (H + l2 I) delta / 2` with the slope step fixed at `slope_step`:
  the intercept block of H is diagonal, so `delta_i = (-g_i - c_i slope_step) / d_i`.
  With the unconstrained slope step this is the second half of `newton_step`; with a
  clamped, damped or capped slope step it is the constrained Newton step (the intercepts
  absorb what the slope could not do, instead of moving as if it had).

  Returns:
    `[K]` intercept step (exactly 0 at unlabelled positions).
  """
  d = state.hess_diag + l2
  safe_d = jnp.where(d > 0, d, 1.0)
  return jnp.where(
      d > 0, (-state.grad_intercepts - state.hess_cross * slope_step) / safe_d, 0.0)


def _init(K: int, config: EstimatorConfig) -> EstimatorState:
  # Every field gets its own buffer, so a fresh state can be donated to a jitted step.
  zeros_k = lambda: jnp.zeros((K,), jnp.float32)
  zero = lambda: jnp.zeros((), jnp.float32)
  return EstimatorState(
      slope=jnp.asarray(config.init_slope, jnp.float32),
      intercepts=jnp.full((K,), config.init_intercept, jnp.float32),
      grad_slope=zero(), grad_intercepts=zeros_k(), hess_slope=zero(),
      hess_cross=zeros_k(), hess_diag=zeros_k(), counts=zeros_k(),
      step=jnp.zeros((), jnp.int32), num_refits=jnp.zeros((), jnp.int32))


def _check_features(K: int, features: jax.Array) -> None:
  _checks.floating("features", features)
  _checks.rank_at_least("features", features, 1)
  if features.shape[-1] != K:
    raise ValueError(
        f"features: expected last dimension K={K} ([..., K]), got shape {features.shape}")


def _predict(K: int, state: EstimatorState, features: jax.typing.ArrayLike) -> jax.Array:
  features = jnp.asarray(features)
  _check_features(K, features)
  return jax.nn.sigmoid(state.slope * _sanitize(features) + state.intercepts)


def _refit(K: int, config: EstimatorConfig, state: EstimatorState) -> EstimatorState:
  c = config
  # Slope first: Newton step, damped, capped by the trust region, then clamped to
  # [0, max_abs_coef]; `applied` is the step the slope really takes.
  delta_slope, _ = newton_step(state, l2=c.l2)
  n_i = state.counts
  n = jnp.sum(n_i)
  step_slope = jnp.clip(n / (n + c.damping + 1e-30) * delta_slope, -c.max_step, c.max_step)
  slope = jnp.clip(state.slope + step_slope, 0.0, c.max_abs_coef)
  applied = slope - state.slope
  # Then the intercepts' Newton step given that slope step (not the unconstrained one),
  # damped and capped the same way per position, then clamped.
  delta_intercepts = intercept_step(state, applied, l2=c.l2)
  step_intercepts = jnp.clip(n_i / (n_i + c.damping + 1e-30) * delta_intercepts,
                             -c.max_step, c.max_step)
  intercepts = jnp.clip(state.intercepts + step_intercepts, -c.max_abs_coef, c.max_abs_coef)
  return _init(K, config)._replace(slope=slope, intercepts=intercepts,
                                   num_refits=state.num_refits + 1)


def _label_mask(K: int, features, accepted, labeled, learn) -> jax.Array:
  """The checked `[..., K]` mask of labels that count: labelled, finite, learning."""
  _check_features(K, features)
  _checks.shape("accepted", accepted, features.shape)
  _checks.shape("labeled", labeled, features.shape)
  _checks.boolean("labeled", labeled)
  mask = labeled & jnp.isfinite(features)
  if learn is not None:
    learn = jnp.asarray(learn)
    _checks.shape("learn", learn, features.shape[:-1])
    _checks.boolean("learn", learn)
    mask = mask & learn[..., None]
  return mask


def _round_stats(state: EstimatorState, features, accepted, mask) -> dict:
  """The log-loss gradient and Hessian sums of one batch of labels at `state`'s
  coefficients (summed over every batch dimension, per position K)."""
  f = jnp.where(mask, _sanitize(features), 0.0)
  mu = jax.nn.sigmoid(state.slope * f + state.intercepts)
  m = mask.astype(jnp.float32)
  resid = m * (mu - accepted.astype(jnp.float32))
  weight = m * mu * (1.0 - mu)
  lead = tuple(range(f.ndim - 1))
  return dict(
      grad_slope=jnp.sum(resid * f),
      grad_intercepts=jnp.sum(resid, axis=lead),
      hess_slope=jnp.sum(weight * f * f),
      hess_cross=jnp.sum(weight * f, axis=lead),
      hess_diag=jnp.sum(weight, axis=lead),
      counts=jnp.sum(m, axis=lead))


def _update(K: int, config: EstimatorConfig, state: EstimatorState,
            features: jax.typing.ArrayLike, accepted: jax.typing.ArrayLike,
            labeled: jax.typing.ArrayLike, *, axis_name: str | None = None,
            learn: jax.typing.ArrayLike | None = None) -> EstimatorState:
  features, accepted, labeled = map(jnp.asarray, (features, accepted, labeled))
  mask = _label_mask(K, features, accepted, labeled, learn)
  stats = _round_stats(state, features, accepted, mask)
  if axis_name is not None:
    stats = jax.lax.psum(stats, axis_name)
  state = state._replace(
      **{k: getattr(state, k) + v for k, v in stats.items()}, step=state.step + 1)
  # The refit is O(K): computing it every step and selecting is cheaper than a cond.
  done = state.step >= config.refit_interval
  refitted = _refit(K, config, state)
  return jax.tree.map(lambda r, s: jnp.where(done, r, s), refitted, state)


def online_estimator(
    num_positions: int,
    config: EstimatorConfig | None = None,
    **overrides,
) -> OnlineEstimator:
  """Builds the online per-position logistic acceptance estimator.

  Args:
    num_positions: K, the maximum draft length.
    config: the hyper-parameters (`EstimatorConfig()` when None):
      * `refit_interval`: N, updates per round; `update` refits when a round ends.
      * `damping`: c in the evidence damping `n / (n + c)` of each coefficient's step.
      * `l2`: ridge added to the Hessian's diagonal before the solve.
      * `init_slope`: starting slope (the note measures 0.45-0.59 across real pairs).
      * `init_intercept`: starting intercept of every position (vLLM uses 1.5).
      * `max_abs_coef`: coefficients are clamped to this magnitude after each refit.
      * `max_step`: trust region: no coefficient moves more than this per refit (after
        damping). Near saturation the log-loss Hessian vanishes and a full Newton step
        from a pessimistic start (intercepts -5) would be ~+100, overshooting into
        oscillation between the clamps; capped steps climb monotonically instead.
    **overrides: `EstimatorConfig` fields replacing those of `config`
      (`online_estimator(4, refit_interval=20)`).

  Returns:
    `OnlineEstimator(init, predict, update, refit, num_positions, config)`:
      * `init() -> EstimatorState`
      * `predict(state, features [B,K]) -> probs [B,K]`
      * `update(state, features [B,K], accepted [B,K] bool, labeled [B,K] bool, *,
        axis_name=None, learn=None) -> state`; refits when the round's
        `refit_interval`-th update ends. `learn`: `[B]` bool (the batch dimensions of
        `features`), requests whose labels count; None: all.
      * `refit(state) -> state`; ends the round now.

  Example:
    >>> est = online_estimator(4)
    >>> state = est.init()
    >>> probs = est.predict(state, features)          # [B, 4]
    >>> state = est.update(state, features, accepted, labeled)
  """
  if (isinstance(num_positions, bool)
      or not isinstance(num_positions, (int, np.integer)) or num_positions < 1):
    raise ValueError(f"num_positions: expected an int K >= 1, got {num_positions!r}")
  if config is not None and not isinstance(config, EstimatorConfig):
    raise ValueError(f"config: expected an EstimatorConfig or None, got {config!r}")
  config = dataclasses.replace(config or EstimatorConfig(), **overrides)
  K = int(num_positions)
  return OnlineEstimator(init=functools.partial(_init, K, config),
                         predict=functools.partial(_predict, K),
                         update=functools.partial(_update, K, config),
                         refit=functools.partial(_refit, K, config),
                         num_positions=K, config=config)


def identity_estimator(K: int) -> OnlineEstimator:
  """An estimator that reads its input as the acceptance probabilities and never learns
  (the replay feeds it the true ones, to separate the estimator's errors from the
  decision's)."""
  return OnlineEstimator(init=lambda: jnp.zeros((), jnp.float32),
                         predict=lambda state, x: x, update=lambda state, *a, **k: state,
                         refit=lambda state: state, num_positions=int(K),
                         config=EstimatorConfig())
