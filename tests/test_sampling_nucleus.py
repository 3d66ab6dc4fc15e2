"""The nucleus (top-p) search against the 31-step bisection it replaced, and the static
branches that skip the nucleus (greedy, top_p = 1)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import av_jax
from av_jax import sampling as S
from av_jax.models import sampling as MS


def _bisection_reference(log_probs, top_p):
  """The previous implementation, verbatim: 31 halvings of the threshold's float bits,
  one masked sum over every row each."""
  probs = jnp.exp(log_probs)
  top_p = jnp.broadcast_to(top_p, probs.shape[:-1] + (1,))
  hi = jax.lax.bitcast_convert_type(jnp.max(probs, axis=-1, keepdims=True), jnp.int32)
  lo = jnp.zeros_like(hi)

  def bisect(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    x = jax.lax.bitcast_convert_type(mid, jnp.float32)
    above = jnp.sum(jnp.where(probs > x, probs, 0.0), axis=-1, keepdims=True)
    ok = above < top_p
    return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

  _, hi = jax.lax.fori_loop(0, 31, bisect, (lo, hi))
  return (probs >= jax.lax.bitcast_convert_type(hi, jnp.float32)) | (top_p >= 1.0)


def _logits(rng, rows, V):
  """Rows of every kind the boundary rules care about: continuous at many scales, many
  exact ties (rounded logits), uniform rows, banned (-inf) tokens, one-hot rows."""
  parts = [rng.normal(size=(rows, V)) * rng.uniform(0.05, 8.0, size=(rows, 1)),
           np.round(rng.normal(size=(rows // 2, V)), 1),
           np.round(rng.normal(size=(rows // 4, V)) * 3),
           np.full((2, V), 1.0)]
  logits = np.concatenate(parts).astype(np.float32)
  logits[::7, :V // 3] = -np.inf
  logits[1, :] = -np.inf
  logits[1, V // 2] = 0.0
  return logits


def _assert_same_nucleus(got, want, log_probs, top_p):
  """Equal masks, except a token whose exact mass strictly above it (float64) is within
  float32 rounding of top_p: there the order of the float32 sums decides, and neither
  the search nor the bisection sums in the order of the definition."""
  got, want = np.asarray(got), np.asarray(want)
  probs = np.exp(np.asarray(log_probs, np.float64))
  rows, tokens = np.nonzero(got != want)
  for r, v in zip(rows, tokens):
    above = probs[r][probs[r] > probs[r, v]].sum()
    assert abs(above - top_p) < 1e-6, (r, v, above, top_p)
  assert len(set(rows)) <= max(1, len(got) // 100)


@pytest.mark.parametrize("top_p", [0.01, 0.05, 0.5, 0.9, 0.95, 0.999, 1.0])
@pytest.mark.parametrize("V", [1, 2, 7, 300, 4096, 9000])
def test_nucleus_search_equals_bisection(maybe_jit, V, top_p):
  # 4096 and 9000 span several row blocks (`_BLOCK_BYTES`), the last one padded.
  rng = np.random.default_rng([V, int(top_p * 1000)])
  rows = 150 if V == 4096 else 40
  log_probs = jax.nn.log_softmax(jnp.asarray(_logits(rng, rows, V)))
  got = maybe_jit(lambda lp: S._top_p_mask(lp, jnp.float32(top_p)))(log_probs)
  want = _bisection_reference(log_probs, jnp.float32(top_p))
  _assert_same_nucleus(got.reshape(-1, V), want.reshape(-1, V), log_probs, top_p)
  np.testing.assert_array_equal(S._top_p_mask_by_bisection(log_probs, jnp.float32(top_p)), want)
  assert np.all(np.asarray(got).sum(-1) >= 1)


def test_long_and_short_nuclei_in_one_batch():
  """Rows from peaked to near-uniform over 4096 tokens (nuclei of a few to thousands):
  brackets of every density in one search."""
  rng = np.random.default_rng(0)
  centre = rng.normal(size=(1, 4096)) * 2
  logits = (centre + rng.normal(size=(96, 4096)) * rng.uniform(0.2, 3, size=(96, 1))
            * np.linspace(0.3, 8, 96)[:, None]).astype(np.float32)
  for top_p in (0.9, 0.95):
    log_probs = jax.nn.log_softmax(jnp.asarray(logits))
    got = jax.jit(S._top_p_mask)(log_probs, jnp.float32(top_p))
    np.testing.assert_array_equal(got, _bisection_reference(log_probs, jnp.float32(top_p)))
    sizes = np.asarray(got).sum(-1)
    assert sizes.min() < S.NUCLEUS_CANDIDATES < sizes.max()  # both kinds of row ran


def test_per_row_top_p_batch_dims_and_vmap():
  rng = np.random.default_rng(3)
  logits = jnp.asarray(_logits(rng, 40, 500)[:60].reshape(3, 4, 5, 500))
  top_p = rng.uniform(0.0, 1.2, size=(3, 4, 5)).astype(np.float32)  # traced: <= 0, > 1 too
  log_probs = jax.nn.log_softmax(logits)
  want = _bisection_reference(log_probs, S.row_option(top_p, logits))
  got = jax.jit(S._top_p_mask)(log_probs, S.row_option(top_p, logits))
  np.testing.assert_array_equal(got, want)
  got = jax.jit(jax.vmap(S._top_p_mask))(log_probs, S.row_option(top_p, logits))
  np.testing.assert_array_equal(got, want)
  assert S._top_p_mask(log_probs[:0], jnp.float32(0.5)).shape == (0, 4, 5, 500)


def test_top_p_within_rounding_of_one_keeps_every_positive_token():
  """A row whose float32 mass is below top_p: every token of positive probability is in
  the nucleus (no candidate bracket), as the bisection gives."""
  probs = np.full((2, 10), 0.1, np.float32)
  probs[1, 0] = 0.0
  log_probs = jnp.log(jnp.asarray(probs))
  top_p = jnp.float32(np.nextafter(np.float32(1), np.float32(0)))
  np.testing.assert_array_equal(S._top_p_mask(log_probs, top_p),
                                _bisection_reference(log_probs, top_p))


def test_gradient_flows_through_the_filtered_distribution():
  logits = jax.random.normal(jax.random.key(0), (3, 200))
  grad = jax.grad(lambda l: av_jax.sampling_log_probs(l, top_p=0.9)[:, 0].sum())(logits)
  assert np.isfinite(np.asarray(grad)).all() and np.abs(np.asarray(grad)).sum() > 0


def _has_nucleus_search(fn, logits) -> bool:
  return "top_k" in str(jax.make_jaxpr(fn)(logits))


def test_greedy_and_top_p_one_skip_the_nucleus_statically():
  logits = jax.random.normal(jax.random.key(1), (4, 64))
  key = jax.random.key(2)
  greedy = dict(temperature=0.0, top_p=0.9)
  assert not _has_nucleus_search(lambda l: MS.sampling_probs(l, **greedy), logits)
  assert not _has_nucleus_search(lambda l: MS.sample_tokens(key, l, **greedy), logits)
  assert not _has_nucleus_search(lambda l: MS.sampling_probs(l, temperature=1.0, top_p=1.0),
                                 logits)
  assert _has_nucleus_search(lambda l: MS.sampling_probs(l, temperature=1.0, top_p=0.9),
                             logits)
  # The static branches give what the traced per-row selection gives.
  np.testing.assert_array_equal(MS.sampling_probs(logits, **greedy),
                                MS.sampling_probs(logits, temperature=jnp.zeros(4), top_p=0.9))
  np.testing.assert_array_equal(MS.sample_tokens(key, logits, **greedy),
                                jnp.argmax(logits, -1))
  for temperature in (0.0, 0.7):
    tokens, log_probs = MS.sample_with_log_probs(key, logits, temperature=temperature,
                                                 top_p=0.9)
    np.testing.assert_array_equal(
        tokens, MS.sample_tokens(key, logits, temperature=temperature, top_p=0.9))
    np.testing.assert_array_equal(
        tokens, MS.sample_tokens(key, logits, temperature=jnp.full(4, temperature), top_p=0.9))
    np.testing.assert_allclose(log_probs, av_jax.sampling_log_probs(
        logits, temperature=temperature, top_p=0.9))
  with pytest.raises(ValueError, match="^temperature"):
    MS.sampling_probs(logits, temperature=-1.0, top_p=0.9)
