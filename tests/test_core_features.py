"""Features against a float64 NumPy reference, including the numerically hard rows."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import av_jax
from av_jax import features as F
from av_jax import sampling as S


def _ref_scaled(logits, temperature=1.0, top_p=1.0):
  """float64 reference of the sampled distribution's logits (temperature, then top-p)."""
  z = np.asarray(logits, np.float64)
  t = temperature if temperature > 0 else 1.0
  z = z / t
  if top_p < 1.0:
    out = np.empty_like(z)
    for idx in np.ndindex(z.shape[:-1]):
      row = z[idx]
      m = np.max(row)
      p = np.exp(row - m)
      p /= p.sum()
      s = np.sort(p)[::-1]
      exclusive = np.cumsum(s) - s
      kept = s[(exclusive < top_p) | (np.arange(len(s)) == 0)]
      out[idx] = np.where(p >= kept.min(), row, -np.inf)
    z = out
  return z


def _ref_logit_qmax(logits, temperature=1.0, top_p=1.0):
  z = _ref_scaled(logits, temperature, top_p)
  out = np.empty(z.shape[:-1])
  for idx in np.ndindex(z.shape[:-1]):
    row = z[idx]
    a = int(np.argmax(row))
    rest = np.delete(row, a)
    m = row[a]
    if rest.size == 0 or np.all(rest == -np.inf):
      out[idx] = np.inf
    else:
      r = np.max(rest)
      out[idx] = m - (r + np.log(np.sum(np.exp(rest - r))))
  return np.clip(out, -F.FEATURE_CLIP, F.FEATURE_CLIP)


def _hard_rows(rng, V=7):
  rows = [
      rng.normal(size=V) * 3,
      np.full(V, 2.0),                                  # uniform, all tied
      np.r_[5.0, 5.0, rng.normal(size=V - 2)],          # tie at the top
      np.r_[1e30, rng.normal(size=V - 1)],              # huge logit
      np.r_[80.0, 0.0, -80.0, rng.normal(size=V - 3)],  # float32 exp overflow range
      np.r_[3.0, np.full(V - 1, -np.inf)],              # one-hot via -inf
      np.r_[-np.inf, 0.5, -np.inf, 0.4, -np.inf, 0.3, -np.inf][:V],
      np.r_[12.0, -12.0, rng.normal(size=V - 2) - 20],  # q_max very close to 1
  ]
  return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.9),
                                               (1.0, 0.5), (0.0, 1.0), (0.0, 0.8)])
def test_logit_qmax_matches_float64_reference(maybe_jit, temperature, top_p):
  rng = np.random.default_rng(0)
  logits = np.concatenate([_hard_rows(rng), rng.normal(size=(40, 7)).astype(np.float32) * 4])
  fn = maybe_jit(lambda l: av_jax.logit_qmax(l, temperature=temperature, top_p=top_p))
  got = np.asarray(fn(logits))
  want = _ref_logit_qmax(logits, temperature, top_p)
  assert got.dtype == np.float32
  chex.assert_tree_all_finite(got)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_one_hot_and_single_token_are_clipped_finite():
  one_hot = jnp.array([[0.0, -jnp.inf, -jnp.inf], [jnp.inf, 0.0, 1.0]])
  np.testing.assert_array_equal(av_jax.logit_qmax(one_hot), [F.FEATURE_CLIP] * 2)
  assert float(av_jax.logit_qmax(jnp.array([[4.0]]))[0]) == F.FEATURE_CLIP  # V = 1
  # q_max = 1 - 1e-9 is still resolved, not clipped: log-odds ~ 20.7.
  np.testing.assert_allclose(av_jax.logit_qmax(jnp.array([0.0, -np.log(1e9) + 0.0])),
                             np.log(1e9), rtol=1e-5)


def test_logit_qmax_is_log_odds_of_top_probability():
  probs = np.array([[0.8, 0.15, 0.05], [0.5, 0.3, 0.2]])
  got = av_jax.logit_qmax(jnp.log(probs))
  # q_max = 0.5 has log-odds 0, where only an absolute tolerance means anything: float32
  # rounding of the exp-sum leaves ~6e-8 there (jax 0.11.2 on XLA:CPU).
  np.testing.assert_allclose(got, np.log(probs[:, 0] / (1 - probs[:, 0])), rtol=1e-5,
                             atol=1e-6)


def test_per_row_temperature_and_top_p_arrays(maybe_jit):
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(3, 4, 9)).astype(np.float32) * 2
  temps = rng.uniform(0.5, 1.5, size=(3, 4)).astype(np.float32)
  top_ps = rng.uniform(0.5, 1.0, size=(3, 4)).astype(np.float32)
  got = maybe_jit(lambda l, t, p: av_jax.logit_qmax(l, temperature=t, top_p=p))(
      logits, temps, top_ps)
  want = np.array([[_ref_logit_qmax(logits[i, j], temps[i, j], top_ps[i, j])
                    for j in range(4)] for i in range(3)])
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_nan_rows_stay_nan_and_do_not_leak():
  logits = jnp.array([[jnp.nan, 0.0, 1.0], [0.0, 1.0, 2.0]])
  for name in ("logit_qmax", "top2_margin", "neg_entropy"):
    got = F.FEATURES[name](logits)
    assert np.isnan(got[0]) and np.isfinite(got[1]), name
  got = av_jax.logit_qmax(logits, top_p=0.9)
  assert np.isnan(got[0]) and np.isfinite(got[1])


def test_sampling_log_probs_normalised_and_nucleus():
  logits = jnp.array([2.0, 1.0, 0.0, -1.0])
  lp = av_jax.sampling_log_probs(logits, top_p=0.7)
  probs = np.exp(np.asarray(lp))
  np.testing.assert_allclose(probs.sum(), 1.0, rtol=1e-6)
  assert probs[2] == 0 and probs[3] == 0 and probs[1] > 0  # 0.64 < 0.7 so 2 tokens kept


def test_other_features_against_reference():
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(20, 6)).astype(np.float32) * 3
  tokens = rng.integers(0, 6, size=20)
  z = logits.astype(np.float64)
  log_q = z - np.log(np.exp(z).sum(-1, keepdims=True))
  srt = np.sort(log_q, -1)
  np.testing.assert_allclose(av_jax.top2_margin(logits), srt[:, -1] - srt[:, -2], rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(av_jax.neg_entropy(logits), (np.exp(log_q) * log_q).sum(-1),
                             rtol=1e-5, atol=1e-5)
  lqs = log_q[np.arange(20), tokens]
  np.testing.assert_allclose(F.FEATURES["logit_q_sampled"](logits, tokens=tokens),
                             lqs - np.log1p(-np.exp(lqs)), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(F.FEATURES["gumbel_q_sampled"](logits, tokens=tokens),
                             -np.log(-lqs), rtol=1e-4, atol=1e-4)


def test_registry_flags_and_refuses_lossy_for_pruning():
  assert {"logit_qmax", "top2_margin", "neg_entropy"} <= {
      k for k, f in av_jax.FEATURES.items() if f.lossless}
  assert {"logit_q_sampled", "gumbel_q_sampled"} <= {
      k for k, f in av_jax.FEATURES.items() if not f.lossless}
  with pytest.raises(ValueError, match="biases"):
    av_jax.get_feature("logit_q_sampled")
  assert av_jax.get_feature("logit_q_sampled", for_pruning=False).lossless is False
  with pytest.raises(ValueError, match="feature"):
    av_jax.get_feature("nope")
  with pytest.raises(ValueError, match="tokens"):
    av_jax.FEATURES["logit_q_sampled"](jnp.zeros((2, 3)))


def test_vmap_and_bad_shapes():
  logits = jnp.arange(24.0).reshape(2, 3, 4)
  np.testing.assert_allclose(jax.vmap(av_jax.logit_qmax)(logits), av_jax.logit_qmax(logits))
  with pytest.raises(ValueError, match="logits"):
    av_jax.logit_qmax(jnp.float32(1.0))
  with pytest.raises(ValueError, match="option"):
    av_jax.logit_qmax(logits, temperature=jnp.ones((2, 3, 4, 5)))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logit_qmax_long_vocabulary_chunked_path(maybe_jit, temperature):
  """V > 8192 takes the chunked fused path: ties across chunks, -inf chunks, a far max."""
  rng = np.random.default_rng(9)
  V = 3 * 8192
  rows = rng.normal(size=(6, V)).astype(np.float32) * 3
  rows[1, [5, 9000, 20000]] = 40.0                       # the max tied in three chunks
  rows[2, :8192] = -np.inf                               # a whole chunk banned
  rows[3, 17] = 60.0                                     # q_max ~ 1 - 1e-15: clipped
  rows[4, 8191] = 25.0                                   # max at a chunk boundary
  rows[5] = -np.inf
  rows[5, 12345] = 1.0                                   # one-hot through -inf
  got = np.asarray(maybe_jit(lambda l: av_jax.logit_qmax(l, temperature=temperature))(rows))
  np.testing.assert_allclose(got, _ref_logit_qmax(rows, temperature), rtol=3e-5, atol=3e-5)


@pytest.mark.parametrize("V", [8, 3 * 8192])
def test_logit_qmax_fused_with_its_producer_under_jit(V):
  """Regression: when the logits are produced inside the same jit (here by the PRNG),
  XLA recomputes them in each reduction with possibly different rounding; the feature
  must not depend on bitwise-identical recomputation."""
  key = jax.random.key(3, impl="rbg")

  def produce_and_score(k):
    return av_jax.logit_qmax(jax.random.normal(k, (8, 3, V)) * 2.0)

  keys = jax.random.split(key, 16)
  got = jax.jit(jax.vmap(produce_and_score))(keys)
  logits = jax.vmap(lambda k: jax.random.normal(k, (8, 3, V)) * 2.0)(keys)
  np.testing.assert_allclose(got, av_jax.logit_qmax(np.asarray(logits)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.95, 0.999])
def test_top_p_mask_equals_sort_definition(maybe_jit, top_p):
  rng = np.random.default_rng(int(top_p * 1000))
  logits = np.concatenate([
      rng.normal(size=(30, 300)) * rng.uniform(0.1, 8.0, size=(30, 1)),
      np.round(rng.normal(size=(10, 300)), 1),           # many exact ties
      np.full((2, 300), 1.0),                             # uniform
  ]).astype(np.float32)
  log_probs = jax.nn.log_softmax(jnp.asarray(logits))
  got = maybe_jit(lambda lp: S._top_p_mask(lp, jnp.float32(top_p)))(log_probs)
  want = S._top_p_mask_by_sort(log_probs, jnp.float32(top_p))
  np.testing.assert_array_equal(got, want)
  assert np.all(np.asarray(got).sum(-1) >= 1)


@pytest.mark.parametrize("V,jit", [(7, False), (7, True), (4096, True), (3 * 8192, True)])
def test_nan_logit_gives_nan_feature_on_every_path(V, jit):
  """A NaN anywhere in a row gives NaN (the documented contract), also on long rows
  where XLA:CPU's max skips NaN and the fast path alone returned a finite value."""
  rng = np.random.default_rng(V)
  logits = rng.normal(size=(3, V)).astype(np.float32)
  logits[0, V // 2] = np.nan        # NaN in the middle of a row
  logits[1, -1] = np.nan            # NaN at the end (the last chunk)
  for kwargs in ({}, {"temperature": 0.7}, {"top_p": 0.9}):
    for name in ("logit_qmax", "top2_margin", "neg_entropy"):
      fn = lambda l: F.FEATURES[name](l, **kwargs)
      got = np.asarray((jax.jit(fn) if jit else fn)(logits))
      assert np.isnan(got[:2]).all() and np.isfinite(got[2]), (name, kwargs, got)


def test_bad_options_raise_value_error_naming_them():
  logits = jnp.zeros((2, 3, 5))
  for fn in (av_jax.logit_qmax, av_jax.sampling_log_probs, av_jax.neg_entropy):
    for top_p in (0.0, -0.5, 1.5, np.array([[0.5, 0.9, 1.2], [1.0] * 3])):
      with pytest.raises(ValueError, match=r"^top_p: expected values in \(0, 1\]"):
        fn(logits, top_p=top_p)
    for temperature in (-1.0, np.array([0.5, -0.1])[:, None], float("nan")):
      with pytest.raises(ValueError, match=r"^temperature: expected >= 0"):
        fn(logits, temperature=temperature)
    with pytest.raises(ValueError, match=r"^temperature: option has shape \(2,\)"):
      fn(logits, temperature=jnp.ones((2,)))      # [2] does not broadcast to [2, 3]
    with pytest.raises(ValueError, match=r"^top_p: option has shape \(2, 2\)"):
      fn(logits, top_p=jnp.full((2, 2), 0.5))
  # Valid edge values pass: temperature 0 (greedy), top_p 1, per-row arrays.
  av_jax.logit_qmax(logits, temperature=0.0, top_p=1.0)
  av_jax.logit_qmax(logits, temperature=np.ones((2, 1)), top_p=np.full((2, 3), 0.5))
  # Under jit traced values cannot be checked: documented, and the shape still is.
  got = jax.jit(lambda l, p: av_jax.logit_qmax(l, top_p=p))(logits, jnp.float32(1.5))
  np.testing.assert_allclose(got, av_jax.logit_qmax(logits), rtol=1e-6)
  with pytest.raises(ValueError, match="^temperature"):
    jax.jit(lambda l, t: av_jax.logit_qmax(l, temperature=t))(logits, jnp.ones((4,)))
