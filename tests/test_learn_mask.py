"""The per-request `learn` mask: requests whose target applies a transform the drafter
never sees add nothing to the estimator's statistics.

The stream: acceptance at depth i is `sigmoid(w f + b_i)` (the truth the estimator
fits); half the requests carry a penalty that scales their acceptance by 0.3 (a target-
only transform). Unmasked, the fit moves away from the truth; masked, it does not; and
when the penalty does nothing (the negative control) masking changes nothing that
matters.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from av_jax.decider import make_policy_decider
from av_jax.estimator import online_estimator
from av_jax.integrations import tpu_inference as tpu
from av_jax.integrations import vllm

B, K = 64, 4
TRUE_SLOPE = 0.6
TRUE_INTERCEPTS = np.array([1.5, 1.0, 0.5, 0.0], np.float32)


def _stream(key, steps, penalty):
  """`steps` rounds of `[B, K]` features, accepted prefixes and labels; odd requests'
  acceptance is multiplied by `penalty`."""
  kf, ku = jax.random.split(key)
  f = 2.0 * jax.random.normal(kf, (steps, B, K))
  prob = jax.nn.sigmoid(TRUE_SLOPE * f + TRUE_INTERCEPTS)
  penalised = (jnp.arange(B) % 2 == 1)[None, :, None]
  prob = jnp.where(penalised, penalty * prob, prob)
  accept_each = jax.random.uniform(ku, (steps, B, K)) < prob
  accepted = jnp.cumprod(accept_each, axis=-1).astype(bool)
  num = jnp.sum(accepted, -1, keepdims=True)
  labeled = accepted | (jnp.arange(K) == num)
  return f, accepted, labeled


@functools.partial(jax.jit, static_argnames=("masked",))
def _fit(f, accepted, labeled, *, masked):
  est = online_estimator(K, refit_interval=10)
  learn = jnp.arange(B) % 2 == 0  # the unpenalised requests

  def step(state, xs):
    return est.update(state, *xs, learn=learn if masked else None), None

  state, _ = jax.lax.scan(step, est.init(), (f, accepted, labeled))
  return state


def _error(state):
  return max(abs(float(state.slope) - TRUE_SLOPE),
             float(np.max(np.abs(np.asarray(state.intercepts) - TRUE_INTERCEPTS))))


def test_mask_keeps_penalised_requests_out_of_the_fit():
  data = _stream(jax.random.key(0), 400, penalty=0.3)
  unmasked, masked = _fit(*data, masked=False), _fit(*data, masked=True)
  assert int(masked.num_refits) == 40
  # Without the mask the penalised half drags the fit off the truth (log 0.3 = -1.2 in
  # the log-odds of half the labels); with it the fit sits within sampling error of the
  # truth (the same tolerance the unpenalised stream meets below).
  assert _error(unmasked) > 0.5, _error(unmasked)
  assert _error(masked) < 0.2, _error(masked)
  assert _error(unmasked) - _error(masked) > 0.4


def test_mask_is_harmless_when_the_penalty_does_nothing():
  # Negative control: the same stream with no penalty. Both fits find the truth, so the
  # difference measured above is the penalty's, not the mask's.
  data = _stream(jax.random.key(0), 400, penalty=1.0)
  unmasked, masked = _fit(*data, masked=False), _fit(*data, masked=True)
  assert _error(unmasked) < 0.2 and _error(masked) < 0.2
  assert abs(_error(unmasked) - _error(masked)) < 0.15


def test_masked_update_equals_the_update_on_the_learning_requests_alone():
  f, accepted, labeled = (x[0] for x in _stream(jax.random.key(1), 1, penalty=0.3))
  est = online_estimator(K)
  learn = jnp.arange(B) % 3 == 0
  masked = est.update(est.init(), f, accepted, labeled, learn=learn)
  alone = est.update(est.init(), f[learn], accepted[learn], labeled[learn])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6),
               masked, alone)
  # All True is no mask at all.
  jax.tree.map(np.testing.assert_array_equal,
               est.update(est.init(), f, accepted, labeled, learn=jnp.ones((B,), bool)),
               est.update(est.init(), f, accepted, labeled))


def test_decider_learn_passes_the_mask_to_the_estimator():
  f, accepted, labeled = (x[0] for x in _stream(jax.random.key(2), 1, penalty=0.3))
  decider = make_policy_decider(K, drafter_kind="parallel", greedy=True, gated=False)
  decision = decider.init(B)
  learn = jnp.arange(B) % 2 == 0
  masked = decider.learn(decision, f, accepted, labeled, learn=learn)
  by_hand = decider.learn(decision, f, accepted, labeled & learn[:, None])
  everything = decider.learn(decision, f, accepted, labeled)
  jax.tree.map(np.testing.assert_array_equal, masked.estimator, by_hand.estimator)
  assert float(masked.estimator.counts.sum()) < float(everything.estimator.counts.sum())
  # The memory still sees the masked requests' drafted features; the plan's own estimator
  # (in the memory) learns from the unmasked labels only, as the drafts' estimator does.
  seen = lambda m: m._replace(lag=None)
  jax.tree.map(np.testing.assert_array_equal, seen(masked.planner.memory),
               seen(everything.planner.memory))
  jax.tree.map(np.testing.assert_array_equal, masked.planner.memory.lag,
               by_hand.planner.memory.lag)
  assert (float(masked.planner.memory.lag.counts.sum())
          < float(everything.planner.memory.lag.counts.sum()))


def test_adapters_labels_from_output_apply_the_mask():
  # vLLM rows: request 0 accepted both drafts (5 is its bonus), request 1 one of two.
  sampled = jnp.array([[1, 2, 5], [3, 7, -1]])
  acc, lab, rej = vllm.labels_from_output(sampled, jnp.array([2, 2]))
  np.testing.assert_array_equal(acc, [[True, True], [True, False]])
  np.testing.assert_array_equal(lab, [[True, True], [True, True]])
  np.testing.assert_array_equal(rej, [0, 1])
  _, lab, _ = vllm.labels_from_output(sampled, jnp.array([2, 2]),
                                      learn=jnp.array([True, False]))
  np.testing.assert_array_equal(lab, [[True, True], [False, False]])
  # tpu-inference's [T main | B bonus] for the same outcome.
  out = jnp.array([1, 2, 3, 7, 5, -1])
  acc, lab, rej = tpu.labels_from_output(out, jnp.array([2, 2]), max_draft_len=2,
                                         learn=jnp.array([False, True]))
  np.testing.assert_array_equal(acc, [[True, True], [True, False]])
  np.testing.assert_array_equal(lab, [[False, False], [True, True]])
  np.testing.assert_array_equal(rej, [0, 1])


def test_a_mask_of_the_wrong_shape_or_dtype_is_refused_naming_learn():
  f, accepted, labeled = (x[0] for x in _stream(jax.random.key(3), 1, penalty=1.0))
  est = online_estimator(K)
  with pytest.raises(ValueError, match=r"learn: expected shape \(64,\)"):
    est.update(est.init(), f, accepted, labeled, learn=jnp.ones((B, K), bool))
  with pytest.raises(ValueError, match="learn"):
    est.update(est.init(), f, accepted, labeled, learn=jnp.ones((B,), jnp.int32))
  decider = make_policy_decider(K, drafter_kind="parallel", greedy=True, gated=False)
  with pytest.raises(ValueError, match=r"learn: expected a \[B=64\] bool"):
    decider.learn(decider.init(B), f, accepted, labeled, learn=jnp.ones((B - 1,), bool))
  with pytest.raises(ValueError, match=r"learn: expected shape \(2,\)"):
    vllm.labels_from_output(jnp.array([[1, 2, 5], [3, 7, -1]]), jnp.array([2, 2]),
                            learn=jnp.ones((3,), bool))
  with pytest.raises(ValueError, match=r"learn: expected shape \(2,\)"):
    tpu.labels_from_output(jnp.array([1, 2, 3, 7, 5, -1]), jnp.array([2, 2]),
                           max_draft_len=2, learn=jnp.ones((1,), bool))
