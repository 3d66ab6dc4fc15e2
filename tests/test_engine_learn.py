"""The engine's per-request `learn` flag: a request marked False (its target applies a
transform its drafter never sees) teaches the estimator nothing."""

import jax
import numpy as np
import pytest

from av_jax import engine as E
from av_jax.estimator import EstimatorConfig
from av_jax.sampling import Sampling
from tests import _engine_fixtures as fx

PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8]]


def _run(engine, params, learn):
  return E.generate(engine, params, PROMPTS, max_new_tokens=10, key=jax.random.key(0),
                    learn=learn)


def test_requests_marked_not_to_learn_add_no_labels():
  cfg, drafter, params = fx.pair("block")
  engine = E.make_engine(E.EngineConfig(num_slots=2, max_draft=2, max_len=32, mode="av",
                                        sampling=Sampling(temperature=0.0),
                                        estimator=EstimatorConfig(refit_interval=2)), cfg, drafter)
  everyone = _run(engine, params, True)
  nobody = _run(engine, params, False)
  # Verification labelled drafts in both runs, and greedy output is the target's either way.
  assert everyone.stats["labeled"] > 0 and nobody.stats["labeled"] > 0
  assert [c.tokens for c in everyone.completions] == [c.tokens for c in nobody.completions]
  # Unmasked the estimator learned (the negative control); masked it saw no label at all.
  assert int(everyone.state.estimator.num_refits) > 0
  fresh = engine.decider.estimator.init()
  assert float(nobody.state.estimator.counts.sum()) == 0.0
  np.testing.assert_array_equal(nobody.state.estimator.intercepts, fresh.intercepts)
  assert float(nobody.state.estimator.slope) == float(fresh.slope)
  assert not np.array_equal(np.asarray(everyone.state.estimator.intercepts),
                            np.asarray(fresh.intercepts))
  # A mix: fewer labels reach the estimator than verification produced.
  some = _run(engine, params, [True, False, True, False])
  assert 0 < int(some.state.estimator.num_refits) or float(some.state.estimator.counts.sum()) > 0
  with pytest.raises(ValueError, match=r"learn: expected 4 flags"):
    _run(engine, params, [True, False])
