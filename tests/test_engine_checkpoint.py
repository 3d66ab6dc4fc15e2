"""Checkpoint/resume: a stopped-and-resumed run equals an uninterrupted one; bad or
mismatched checkpoints are refused and leave the running state untouched."""

import os

import chex
import jax
import numpy as np
import pytest

from av_jax import engine as E
from av_jax.engine import batching
from av_jax.engine import checkpoint
from av_jax.engine import core
from av_jax.estimator import EstimatorConfig
from av_jax.sampling import Sampling
from tests import _engine_fixtures as fx

PROMPTS = [[1, 2, 3], [4], list(range(5, 22)), [7] * 6, [2, 9], [3] * 4, [11, 12]]
MAX_NEW = [12, 20, 6, 15, 9, 18, 7]


def _engine(**overrides):
  cfg, drafter, params = fx.pair("eagle")  # autoregressive: the lagged policy's state matters
  settings = dict(num_slots=3, max_draft=3, max_len=64, mode="av",
                  sampling=Sampling(temperature=1.0),
                  estimator=EstimatorConfig(refit_interval=3),
                  programs=E.Programs(steps_per_chunk=2))
  settings.update(overrides)
  return E.make_engine(E.EngineConfig(**settings), cfg, drafter), params


def test_stopped_and_resumed_run_equals_uninterrupted(tmp_path):
  engine, params = _engine()
  full = E.generate(engine, params, PROMPTS, max_new_tokens=MAX_NEW, key=fx.key(4))
  path = str(tmp_path / "ckpt")
  part = E.generate(engine, params, PROMPTS, max_new_tokens=MAX_NEW, key=fx.key(4),
                    stop_after_chunks=3, checkpoint_path=path)
  assert part.stopped and any(c is None for c in part.completions)
  assert os.path.exists(os.path.join(path, checkpoint.META))
  resumed = E.generate(engine, params, PROMPTS, max_new_tokens=MAX_NEW, key=fx.key(4),
                       resume_from=path)
  assert not resumed.stopped
  assert [c.tokens for c in resumed.completions] == [c.tokens for c in full.completions]
  chex.assert_trees_all_equal(resumed.state.estimator, full.state.estimator)
  assert int(full.state.estimator.num_refits) >= 2
  # The verify layout is not part of the identity: a run saved by an engine with one
  # verify group per slot (as on a 3-way 'data' mesh) resumes here, and vice versa.
  grouped, _ = _engine(programs=E.Programs(steps_per_chunk=2, verify_groups=3))
  again = E.generate(grouped, params, PROMPTS, max_new_tokens=MAX_NEW, key=fx.key(4),
                     resume_from=path)
  assert [c.tokens for c in again.completions] == [c.tokens for c in full.completions]


def test_mismatched_or_damaged_checkpoints_are_refused(tmp_path):
  engine, params = _engine()
  path = str(tmp_path / "ckpt")
  E.generate(engine, params, PROMPTS, max_new_tokens=MAX_NEW, key=fx.key(4),
             stop_after_chunks=1, checkpoint_path=path)
  _, _, init = batching.compiled(engine)
  running = init(params, fx.key(9), core.default_cost(engine.config))
  snapshot = lambda s: jax.tree.map(np.asarray, s._replace(key=jax.random.key_data(s.key)))
  before = snapshot(running)

  other, _ = _engine(max_draft=4)
  with pytest.raises(ValueError, match="max_draft"):
    checkpoint.restore(path, engine=other, like=running)
  # A nested setting that differs is named, with both values.
  refit, _ = _engine(estimator=EstimatorConfig(refit_interval=4))
  with pytest.raises(ValueError, match=r"estimator\.refit_interval: 3 vs 4"):
    checkpoint.restore(path, engine=refit, like=running)
  buckets, _ = _engine(programs=E.Programs(steps_per_chunk=2, num_buckets=2))
  with pytest.raises(ValueError, match=r"programs\.num_buckets: 4 vs 2"):
    checkpoint.restore(path, engine=buckets, like=running)
  block = E.make_engine(engine.config, fx.tiny_config(), fx.pair("block")[1])
  with pytest.raises(ValueError, match="drafter"):
    checkpoint.restore(path, engine=block, like=running)
  with pytest.raises(ValueError, match="requests"):
    E.generate(engine, params, PROMPTS[:2], max_new_tokens=4, key=fx.key(4), resume_from=path)

  # Truncate every array file: the restore fails with a clear error.
  for root, _, files in os.walk(os.path.join(path, "state")):
    for name in files:
      if name not in ("_METADATA", "_CHECKPOINT_METADATA", "commit_success.txt"):
        with open(os.path.join(root, name), "r+b") as f:
          f.truncate(3)
  with pytest.raises(ValueError, match="cannot read"):
    checkpoint.restore(path, engine=engine, like=running)
  with pytest.raises(ValueError, match="metadata"):
    checkpoint.restore(str(tmp_path / "missing"), engine=engine, like=running)
  chex.assert_trees_all_equal(snapshot(running), before)  # the running state is untouched


def test_estimator_and_planner_state_round_trip(tmp_path):
  engine, params = _engine()
  result = E.generate(engine, params, PROMPTS, max_new_tokens=MAX_NEW, key=fx.key(5))
  server_state = (result.state.estimator, result.state.planner)
  checkpoint.save(str(tmp_path / "est"), server_state, engine=engine)
  restored, extra = checkpoint.restore(str(tmp_path / "est"), engine=engine, like=server_state)
  chex.assert_trees_all_equal(restored, server_state)
  assert extra == {}
