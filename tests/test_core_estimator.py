"""Online estimator: exact IRLS step, convergence to the MLE, chunking, robustness."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression

import av_jax


def _synthetic(rng, n_steps, B, K, slope=0.6, intercepts=None, label_rate=0.8):
  """Features, labels drawn from a true per-position logistic model, and label masks."""
  if intercepts is None:
    intercepts = np.linspace(1.0, -1.0, K)
  f = rng.normal(1.0, 2.0, size=(n_steps, B, K)).astype(np.float32)
  p = 1 / (1 + np.exp(-(slope * f + intercepts)))
  y = rng.uniform(size=p.shape) < p
  labeled = rng.uniform(size=p.shape) < label_rate
  return f, y, labeled


def _numpy_gradient_hessian(slope, intercepts, f, y, mask):
  """float64 gradient [K+1] and dense Hessian [K+1, K+1] of the log-loss, label by label."""
  K = f.shape[-1]
  f = f.reshape(-1, K).astype(np.float64)
  y = y.reshape(-1, K).astype(np.float64)
  mask = mask.reshape(-1, K) & np.isfinite(f)
  g = np.zeros(K + 1)
  H = np.zeros((K + 1, K + 1))
  counts = np.zeros(K)
  for r, c in zip(*np.nonzero(mask)):
    phi = np.zeros(K + 1)
    phi[0] = f[r, c]
    phi[1 + c] = 1.0
    mu = 1 / (1 + np.exp(-(slope * f[r, c] + intercepts[c])))
    g += (mu - y[r, c]) * phi
    H += mu * (1 - mu) * np.outer(phi, phi)
    counts[c] += 1
  return g, H, counts


def _numpy_damped_newton(slope, intercepts, f, y, mask, *, damping, l2, max_abs_coef=20.0,
                         max_step=2.0):
  """Independent float64 reference of one refit, with dense linear algebra.

  The slope's step is the slope entry of the dense Newton step, damped, capped and
  clamped; the intercepts' step is then the dense solve of the intercept block given
  that applied slope step (the minimiser of the quadratic model over the intercepts),
  damped and capped per position, then clamped.
  """
  g, H, counts = _numpy_gradient_hessian(slope, intercepts, f, y, mask)
  A = H + l2 * np.eye(len(g))
  delta = np.linalg.solve(A, -g)
  n = counts.sum()
  step_w = np.clip(n / (n + damping) * delta[0], -max_step, max_step)
  new_slope = np.clip(slope + step_w, 0, max_abs_coef)
  applied = new_slope - slope
  delta_b = np.linalg.solve(A[1:, 1:], -(g[1:] + A[1:, 0] * applied))
  step_b = np.clip(counts / (counts + damping) * delta_b, -max_step, max_step)
  new_b = np.clip(intercepts + step_b, -max_abs_coef, max_abs_coef)
  return new_slope, new_b


@pytest.mark.parametrize("K", [1, 4, 8])
def test_refit_equals_float64_numpy_newton_step(maybe_jit, K):
  rng = np.random.default_rng(K)
  f, y, labeled = _synthetic(rng, 5, 16, K)
  labeled[..., -1] &= K == 1  # the deepest position gets no labels (unless K = 1)
  est = av_jax.online_estimator(K, refit_interval=1000, damping=50.0, l2=1e-3,
                                init_slope=0.3, init_intercept=0.5)
  update, refit = maybe_jit(est.update), maybe_jit(est.refit)
  state = est.init()
  for t in range(5):
    state = update(state, f[t], y[t], labeled[t])
  assert int(state.step) == 5 and int(state.num_refits) == 0
  state = refit(state)
  want_slope, want_b = _numpy_damped_newton(0.3, np.full(K, 0.5), f, y, labeled,
                                            damping=50.0, l2=1e-3)
  np.testing.assert_allclose(state.slope, want_slope, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(state.intercepts, want_b, rtol=1e-5, atol=1e-5)
  if K > 1:
    assert float(state.intercepts[-1]) == 0.5  # no labels: intercept kept exactly
  chex.assert_trees_all_equal(state.counts, jnp.zeros(K))
  assert int(state.step) == 0 and int(state.num_refits) == 1


def _issue_case(est):
  """K = 1 from (slope 0, intercept 0): 800/1000 accepted at f = 0, 200/1000 at f = 4."""
  f = np.r_[np.zeros(1000), np.full(1000, 4.0)].astype(np.float32)[:, None]
  y = np.r_[np.arange(1000) < 800, np.arange(1000) < 200][:, None]
  return est.update(est.init(), f, y, np.ones_like(y))


@pytest.mark.parametrize("damping", [0.0, 50.0])
def test_slope_clamp_binding_keeps_the_constrained_mle(maybe_jit, damping):
  """Issue case: the observed rate is 0.5 and the data favour a negative slope, so the
  maximum-likelihood fit with slope >= 0 is the start (0, 0). The slope is clamped at 0;
  the intercept must take its step given that clamped slope step (0), not the step it
  would take alongside the unconstrained (negative) slope step."""
  est = av_jax.online_estimator(1, refit_interval=1000, damping=damping, init_slope=0.0,
                                init_intercept=0.0)
  state = maybe_jit(est.refit)(_issue_case(est))
  assert float(state.slope) == 0.0
  np.testing.assert_allclose(state.intercepts, [0.0], atol=1e-6)
  np.testing.assert_allclose(est.predict(state, jnp.array([[0.0], [4.0]])), 0.5, atol=1e-6)
  # Negative control: the unconstrained joint step moves the intercept to ~1.17 (the old
  # behaviour); the test above is the one that tells the two apart.
  delta_slope, delta_intercepts = av_jax.estimator.newton_step(_issue_case(est), l2=1e-3)
  assert float(delta_slope) < -0.3 and float(delta_intercepts[0]) > 1.0


def _constrained_case(rng, K):
  """A round from a small slope whose data favour a true slope in [-1.5, 1]: for
  many seeds the clamp at 0 binds, for the others it does not."""
  slope = float(rng.uniform(0.0, 0.3))
  intercepts = rng.normal(0.0, 1.0, K)
  f, y, labeled = _synthetic(rng, 2, 64, K, slope=float(rng.uniform(-1.5, 1.0)),
                             intercepts=rng.normal(0.0, 1.0, K), label_rate=0.9)
  return slope, intercepts, f, y, labeled


@pytest.mark.parametrize("K", [1, 3, 6])
def test_refit_is_the_float64_constrained_newton_step(K):
  """Random rounds, no damping, no trust region: the refit equals the minimiser of the
  round's quadratic model subject to slope >= 0, certified by its KKT conditions in
  float64 (intercept gradient 0; slope gradient 0 inside, >= 0 at the bound)."""
  rng = np.random.default_rng(10 + K)
  est = av_jax.online_estimator(K, refit_interval=1000, damping=0.0, l2=1e-3,
                                max_step=1e6, max_abs_coef=1e6)
  refit, update = jax.jit(est.refit), jax.jit(est.update)
  bound = 0
  for _ in range(12):
    slope, intercepts, f, y, labeled = _constrained_case(rng, K)
    state = est.init()._replace(slope=jnp.float32(slope),
                                intercepts=jnp.asarray(intercepts, jnp.float32))
    for t in range(2):
      state = update(state, f[t], y[t], labeled[t])
    new = refit(state)
    g, H, _ = _numpy_gradient_hessian(np.float32(slope), intercepts.astype(np.float32), f, y,
                                      labeled)
    A = H + 1e-3 * np.eye(K + 1)
    x = np.r_[float(new.slope) - np.float32(slope),
              np.asarray(new.intercepts, np.float64) - intercepts.astype(np.float32)]
    grad = g + A @ x                                   # gradient of the model at the step
    scale = np.abs(g).max() + 1.0
    np.testing.assert_allclose(grad[1:], 0.0, atol=2e-4 * scale)
    if float(new.slope) == 0.0:                        # at the bound: no descent inward
      bound += 1
      assert grad[0] >= -2e-4 * scale
    else:
      np.testing.assert_allclose(grad[0], 0.0, atol=2e-4 * scale)
    # The same step from the dense reference (intercepts solved given the clamped slope).
    want_slope, want_b = _numpy_damped_newton(np.float32(slope), intercepts.astype(np.float32),
                                              f, y, labeled, damping=0.0, l2=1e-3,
                                              max_abs_coef=1e6, max_step=1e6)
    np.testing.assert_allclose(new.slope, want_slope, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(new.intercepts, want_b, rtol=1e-4, atol=1e-4)
  assert 3 <= bound < 12  # both the binding and the free case were exercised


def test_capped_and_damped_slope_step_moves_the_intercepts_consistently():
  """With the trust region and damping binding on the slope, the intercepts step given
  the slope step applied (dense float64 reference)."""
  rng = np.random.default_rng(21)
  K = 3
  f, y, labeled = _synthetic(rng, 3, 64, K, slope=3.0, intercepts=np.array([0.5, 0., -.5]))
  est = av_jax.online_estimator(K, refit_interval=1000, damping=20.0, l2=1e-3,
                                init_slope=0.0, init_intercept=0.0, max_step=0.5)
  state = est.init()
  for t in range(3):
    state = est.update(state, f[t], y[t], labeled[t])
  new = est.refit(state)
  assert float(new.slope) == 0.5  # the trust region binds on the slope
  want_slope, want_b = _numpy_damped_newton(0.0, np.zeros(K), f, y, labeled, damping=20.0,
                                            l2=1e-3, max_step=0.5)
  np.testing.assert_allclose(new.slope, want_slope, rtol=1e-5)
  np.testing.assert_allclose(new.intercepts, want_b, rtol=1e-4, atol=1e-5)


def test_many_rounds_converge_to_sklearn_mle():
  rng = np.random.default_rng(3)
  K = 4
  f, y, labeled = _synthetic(rng, 4, 512, K, slope=0.55, intercepts=np.array([1.2, .5, 0, -.8]))
  est = av_jax.online_estimator(K, refit_interval=4, damping=1e-6, l2=1e-9)
  update = jax.jit(est.update)
  state = est.init()
  for _ in range(25):  # each round sees the whole data set at the current coefficients
    for t in range(4):
      state = update(state, f[t], y[t], labeled[t])
  rows, cols = np.nonzero(labeled.reshape(-1, K))
  X = np.zeros((len(rows), K + 1))
  X[:, 0] = f.reshape(-1, K)[rows, cols]
  X[np.arange(len(rows)), 1 + cols] = 1.0
  mle = LogisticRegression(C=np.inf, fit_intercept=False, tol=1e-10, max_iter=10000)
  mle.fit(X, y.reshape(-1, K)[rows, cols])
  np.testing.assert_allclose(state.slope, mle.coef_[0, 0], atol=2e-3)
  np.testing.assert_allclose(state.intercepts, mle.coef_[0, 1:], atol=2e-3)


def test_batch_at_once_equals_chunks():
  rng = np.random.default_rng(4)
  K = 5
  f, y, labeled = _synthetic(rng, 1, 64, K)
  est = av_jax.online_estimator(K, refit_interval=100)
  whole = est.update(est.init(), f[0], y[0], labeled[0])
  chunked = est.init()
  for part in np.array_split(np.arange(64), 4):
    chunked = est.update(chunked, f[0][part], y[0][part], labeled[0][part])
  chunked = chunked._replace(step=whole.step)  # four calls count four updates
  chex.assert_trees_all_close(whole, chunked, rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(est.refit(whole), est.refit(chunked), rtol=1e-5, atol=1e-5)


def test_automatic_refit_at_end_of_round():
  rng = np.random.default_rng(5)
  f, y, labeled = _synthetic(rng, 3, 8, 3)
  est = av_jax.online_estimator(3, refit_interval=3)
  state = est.init()
  manual = est.init()
  for t in range(3):
    state = est.update(state, f[t], y[t], labeled[t])
    manual = est.update(manual, f[t], y[t], labeled[t]) if t < 2 else manual
  assert int(state.num_refits) == 1 and int(state.step) == 0
  # The third update is the round's last: equal to accumulating it, then refit.
  bigger = av_jax.online_estimator(3, refit_interval=100)
  manual = bigger.refit(bigger.update(manual, f[2], y[2], labeled[2]))
  chex.assert_trees_all_close(state._replace(num_refits=manual.num_refits), manual, atol=1e-6)


def test_predict_is_sigmoid_of_linear_score():
  est = av_jax.online_estimator(3, init_slope=0.7, init_intercept=0.2)
  state = est.init()._replace(intercepts=jnp.array([1.0, 0.0, -1.0]))
  f = jnp.array([[0.5, -2.0, 3.0], [jnp.nan, jnp.inf, -jnp.inf]])
  want = 1 / (1 + np.exp(-(0.7 * np.array([[0.5, -2, 3], [0, 30, -30]]) + [1, 0, -1])))
  np.testing.assert_allclose(est.predict(state, f), want, rtol=1e-6)
  np.testing.assert_allclose(jax.vmap(est.predict, in_axes=(None, 0))(state, f[None]),
                             want[None], rtol=1e-6)


def test_adversarial_rounds_keep_coefficients_finite():
  """10,000 rounds (refit every update) of random, all-accept, all-reject, non-finite
  and empty rounds: every coefficient stays finite and within its clamp."""
  B, K = 16, 4
  est = av_jax.online_estimator(K, refit_interval=1, damping=1.0, l2=1e-3)

  def body(state, key):
    k_mode, k_f, k_y, k_l, k_bad = jax.random.split(key, 5)
    mode = jax.random.randint(k_mode, (), 0, 5)
    f = jax.random.normal(k_f, (B, K)) * 10.0
    bad = jax.random.uniform(k_bad, (B, K)) < 0.3
    f = jnp.where((mode == 3) & bad, jnp.array([jnp.nan, jnp.inf, -jnp.inf])[
        jax.random.randint(k_bad, (B, K), 0, 3)], f)
    y = jax.random.uniform(k_y, (B, K)) < 0.5
    y = jnp.where(mode == 1, True, jnp.where(mode == 2, False, y))
    labeled = jnp.where(mode == 4, False, jax.random.uniform(k_l, (B, K)) < 0.7)
    state = est.update(state, f, y, labeled)
    return state, (state.slope, state.intercepts)

  state, (slopes, intercepts) = jax.jit(lambda s, k: jax.lax.scan(body, s, k))(
      est.init(), jax.random.split(jax.random.PRNGKey(0), 10_000))
  assert int(state.num_refits) == 10_000
  chex.assert_tree_all_finite((slopes, intercepts))
  assert float(slopes.min()) >= 0.0 and float(np.abs(intercepts).max()) <= 20.0

  # Long all-accept, then all-reject: the clamp keeps the way back short.
  f = jnp.ones((B, K))
  for y in (True, False):
    def run(s, _):
      return est.update(s, f, jnp.full((B, K), y), jnp.ones((B, K), bool)), None
    state = jax.lax.scan(run, state, None, length=2000)[0]
    chex.assert_tree_all_finite(state)
  assert float(est.predict(state, f).max()) < 0.5


def test_update_ignores_non_finite_and_unlabelled_entries():
  est = av_jax.online_estimator(2)
  f = jnp.array([[jnp.nan, 1.0], [jnp.inf, 2.0]])
  y = jnp.array([[True, False], [True, True]])
  state = est.update(est.init(), f, y, jnp.array([[True, True], [True, False]]))
  np.testing.assert_array_equal(state.counts, [0.0, 1.0])
  chex.assert_tree_all_finite(state)


def test_bad_inputs_name_the_argument():
  est = av_jax.online_estimator(3)
  state = est.init()
  f = jnp.zeros((2, 3))
  with pytest.raises(ValueError, match="features"):
    est.predict(state, jnp.zeros((2, 4)))
  with pytest.raises(ValueError, match="accepted"):
    est.update(state, f, jnp.zeros((2, 2), bool), jnp.zeros((2, 3), bool))
  with pytest.raises(ValueError, match="labeled"):
    est.update(state, f, jnp.zeros((2, 3), bool), jnp.zeros((2, 3)))
  with pytest.raises(ValueError, match="num_positions"):
    av_jax.online_estimator(0)
  with pytest.raises(ValueError, match="refit_interval"):
    av_jax.online_estimator(3, refit_interval=0)


def test_update_does_not_retrace_across_steps():
  est = av_jax.online_estimator(4, refit_interval=3)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(state, f, y, labeled):
    return est.update(state, f, y, labeled)

  state = est.init()
  rng = np.random.default_rng(6)
  for _ in range(7):
    f, y, labeled = _synthetic(rng, 1, 8, 4)
    state = step(state, f[0], y[0], labeled[0])
  assert int(state.num_refits) == 2


def test_data_parallel_psum_gives_identical_replicas():
  """Statistics summed over a mapped axis equal the single-replica fit on all data."""
  rng = np.random.default_rng(7)
  f, y, labeled = _synthetic(rng, 1, 32, 3)
  est = av_jax.online_estimator(3, refit_interval=1)
  shards = [a[0].reshape(4, 8, 3) for a in (f, y, labeled)]
  replicas = jax.vmap(lambda s, a, b, c: est.update(s, a, b, c, axis_name="data"),
                      in_axes=(None, 0, 0, 0), axis_name="data")(est.init(), *shards)
  single = est.update(est.init(), f[0], y[0], labeled[0])
  for r in range(4):
    chex.assert_trees_all_close(jax.tree.map(lambda x: x[r], replicas), single, atol=1e-5)
