"""examples/own_model_loop.py: a user's own Flax NNX models decoded with av_jax's core.

Greedy AV decoding must equal the target's own greedy decoding token for token, and the
estimator must have learnt from the loop's labels; with sampling, the first emitted
token of every slot must follow the target's distribution (chi-square).
"""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import av_jax

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "own_model_loop.py"


@pytest.fixture(scope="module")
def example():
  spec = importlib.util.spec_from_file_location("own_model_loop", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def models(example):
  return example.make_models(example.Config())  # the models depend on V, W, widths only


def test_greedy_output_equals_the_targets_own_greedy_decoding(example, models):
  cfg = example.Config(temperature=0.0)
  target, drafter = models
  cost = example.profile(target, drafter, cfg)
  prompt = jnp.arange(cfg.num_slots * cfg.window).reshape(cfg.num_slots, cfg.window)
  tokens, state, steps = example.generate(target, drafter, prompt % cfg.vocab, cfg, cost=cost)
  np.testing.assert_array_equal(tokens, example.target_greedy(target, prompt % cfg.vocab,
                                                               cfg.max_new))
  assert steps < cfg.max_new  # drafts were accepted: fewer steps than tokens
  # The estimator was refitted from the loop's labels and moved off its start.
  est = state.estimator
  assert int(est.num_refits) >= 1
  assert np.all(np.isfinite(np.asarray(est.intercepts))) and np.isfinite(float(est.slope))
  assert float(est.slope) != pytest.approx(0.5) and not np.allclose(est.intercepts, 1.5)


def test_sampled_first_token_follows_the_target(example, models):
  cfg = example.Config(num_slots=2048, max_new=1, temperature=1.0)
  target, drafter = models
  cost = av_jax.linear_cost_model(cfg.num_slots, cfg.num_slots * (cfg.max_draft + 1))
  context = jnp.array([3, 5], jnp.int32)
  tokens, _, steps = example.generate(target, drafter, jnp.tile(context, (cfg.num_slots, 1)),
                                      cfg, cost=cost, seed=1)
  assert steps == 1 and np.all(tokens[:, 0] >= 0)
  p = np.asarray(jax.nn.softmax(target(context)), np.float64)
  counts = np.bincount(tokens[:, 0], minlength=cfg.vocab)
  keep = p * cfg.num_slots >= 5  # chi-square cells with enough expected counts
  observed = np.append(counts[keep], counts[~keep].sum())
  expected = np.append(p[keep], p[~keep].sum()) * cfg.num_slots
  if expected[-1] == 0:
    observed, expected = observed[:-1], expected[:-1]
  expected *= observed.sum() / expected.sum()  # float32 softmax: sums agree to 1e-7 only
  assert stats.chisquare(observed, expected).pvalue > 1e-4
