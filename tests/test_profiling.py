"""`av_jax.profiling`: cost tables for a user's own verify and draft functions.

The toy programs sleep for a known time per bucket, so the measured table has a known
shape: a step function of the buckets, each step at least its sleep, and the median
ignores one slow call.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import av_jax
from av_jax import profiling

B, K = 2, 7                       # the largest bucket must hold B (K + 1) = 16 tokens
BUCKETS = (4, 8, 16)


def sleeper(ms_of_size):
  """A verify program that takes `ms_of_size(T)` milliseconds on T tokens, and its calls."""
  calls = []

  def verify(tokens):
    calls.append(tokens.shape[0])
    time.sleep(ms_of_size(tokens.shape[0]) / 1e3)
    return tokens

  return verify, calls


def verify_args(size):
  return (np.zeros((size,), np.int32),)


def test_profile_is_a_step_function_of_the_buckets():
  known = {4: 5.0, 8: 15.0, 16: 30.0}
  verify, calls = sleeper(known.__getitem__)
  draft = lambda: time.sleep(0.004)
  profile = profiling.measure_costs(verify, draft, verify_args=verify_args, buckets=BUCKETS,
                                    num_slots=B, max_draft=K, repeats=5)
  # Two warm-up calls, then the median of 5, per bucket in order.
  assert calls == [4] * 7 + [8] * 7 + [16] * 7
  for size, ms in zip(BUCKETS, profile["bucket_ms"]):
    assert known[size] <= ms < known[size] + 25.0, (size, ms)
  assert 4.0 <= profile["draft_ms"] < 29.0
  assert profile["buckets"] == list(BUCKETS) and profile["repeats"] == 5

  cost = profiling.step_cost_model(profile["buckets"], profile["bucket_ms"],
                                   profile["draft_ms"], num_slots=B, max_tokens=B * (K + 1))
  verify_ms = np.asarray(cost.verify_ms)
  assert verify_ms.shape == (B * (K + 1) + 1,)
  np.testing.assert_allclose(verify_ms[0:5], profile["bucket_ms"][0], rtol=1e-6)   # T <= 4
  np.testing.assert_allclose(verify_ms[5:9], profile["bucket_ms"][1], rtol=1e-6)   # 4 < T <= 8
  np.testing.assert_allclose(verify_ms[9:], profile["bucket_ms"][2], rtol=1e-6)    # 8 < T <= 16
  np.testing.assert_allclose(cost.draft_ms, np.full(B + 1, profile["draft_ms"]), rtol=1e-6)


def test_median_ignores_one_slow_call():
  count = [0]

  def verify(tokens):
    count[0] += 1
    time.sleep(0.2 if count[0] == 4 else 0.002)  # the 2nd timed call of 5 is slow
    return tokens

  ms = profiling.median_ms(verify, *verify_args(4), repeats=5)
  assert count[0] == 7 and 2.0 <= ms < 100.0


def test_non_monotone_profile_is_repaired_with_a_warning():
  verify, _ = sleeper({4: 20.0, 8: 5.0, 16: 30.0}.__getitem__)  # the middle bucket is "fast"
  with pytest.warns(UserWarning, match="verify_ms: not monotone"):
    cost = av_jax.profile_costs(verify, None, verify_args=verify_args, buckets=BUCKETS,
                                num_slots=B, max_draft=K, repeats=3)
  verify_ms = np.asarray(cost.verify_ms)
  assert np.all(np.diff(verify_ms) >= 0)
  np.testing.assert_allclose(verify_ms[5:9], verify_ms[4])      # repaired to the running max
  assert verify_ms[4] >= 20.0 and verify_ms[-1] >= 30.0
  np.testing.assert_allclose(cost.draft_ms, 0.0, atol=1e-5)       # no drafter: free (floored)


def test_jitted_jax_program_and_planner():
  weights = jnp.ones((32, 32), jnp.float32)
  verify = jax.jit(lambda w, x: jnp.tanh(x @ w) @ w)
  draft = jax.jit(lambda w, x: jnp.tanh(x @ w))
  cost = av_jax.profile_costs(verify, draft,
                              verify_args=lambda size: (weights, jnp.ones((size, 32))),
                              draft_args=(weights, jnp.ones((B, 32))),
                              buckets=BUCKETS, num_slots=B, max_draft=K, repeats=2)
  assert np.all(np.asarray(cost.verify_ms)[1:] > 0) and np.all(np.asarray(cost.draft_ms) > 0)
  planner = av_jax.make_planner(policy="current")
  plan, _ = planner.plan(planner.init(), jnp.full((B, K), 0.9), cost)
  assert plan.num_verified.shape == (B,)


@pytest.mark.parametrize("kwargs, message", [
    (dict(buckets=(4, 4, 16)), "strictly increasing"),
    (dict(buckets=()), "strictly increasing"),
    (dict(buckets=(4, 8)), "buckets: no bucket holds the 16 tokens .* T = 9..16 are missing"),
    (dict(max_tokens=10), "max_tokens: .* up to num_slots \\* \\(max_draft \\+ 1\\) = 16 .*"
                          "misses T = 11..16"),
    (dict(max_tokens=40), "buckets: no bucket holds the 40 tokens"),
    (dict(repeats=0), "repeats"),
    (dict(num_slots=0), "num_slots"),
])
def test_bad_arguments_are_refused(kwargs, message):
  args = dict(verify_args=verify_args, buckets=BUCKETS, num_slots=B, max_draft=K)
  args.update(kwargs)
  with pytest.raises(ValueError, match=message):
    profiling.measure_costs(lambda x: x, None, **args)


@pytest.mark.filterwarnings("ignore:verify_ms. not monotone")  # equal sleeps: noise may repair
def test_only_the_shapes_the_caller_runs_are_timed():
  # Generic buckets up to 64; two slots of K = 7 pack 16 tokens at most.
  verify, calls = sleeper(lambda size: 1.0)
  profile = profiling.measure_costs(verify, None, verify_args=verify_args,
                                    buckets=(4, 8, 16, 32, 64), num_slots=B, max_draft=K,
                                    repeats=1)
  assert sorted(set(calls)) == [4, 8, 16]          # 32 and 64 never run: never timed
  assert profile["buckets"] == [4, 8, 16] and profile["skipped_buckets"] == [32, 64]
  assert profile["max_tokens"] == 16
  # A caller whose steps pack up to 24 tokens: the first bucket holding 24 is timed too.
  verify, calls = sleeper(lambda size: 1.0)
  cost = av_jax.profile_costs(verify, None, verify_args=verify_args, buckets=(4, 8, 16, 32, 64),
                              num_slots=B, max_draft=K, repeats=1, max_tokens=24)
  assert sorted(set(calls)) == [4, 8, 16, 32]
  assert np.shape(cost.verify_ms) == (25,)
  profiling.check_cost_covers(cost, num_slots=B, max_draft=K)


def test_a_table_short_of_the_planners_shapes_is_refused():
  short = profiling.step_cost_model((4, 8), (1.0, 2.0), 1.0, num_slots=B, max_tokens=10)
  with pytest.raises(ValueError, match=r"cost.verify_ms: covers 10 at most, .* up to 16: "
                                       r"11..16 are missing"):
    profiling.check_cost_covers(short, num_slots=B, max_draft=K)
  few_slots = profiling.step_cost_model((16,), (1.0,), 1.0, num_slots=1, max_tokens=16)
  with pytest.raises(ValueError, match=r"cost.draft_ms: covers 1 at most, .* up to 2"):
    profiling.check_cost_covers(few_slots, num_slots=B, max_draft=K)
  # A table that covers them passes (the negative control).
  full = profiling.step_cost_model((4, 8, 16), (1.0, 2.0, 3.0), 1.0, num_slots=B,
                                   max_tokens=16)
  profiling.check_cost_covers(full, num_slots=B, max_draft=K)
