"""examples/own_model_engine.py: a user's own Flax NNX target and drafter served by the engine.

Through the `Target` protocol and a user `Drafter`: greedy output equals the target's own
greedy decoding for the av and target_only arms; `profile.measure` times the user's
verify at every bucket and the user's drafter; `make_engine` refuses ambiguous models.
"""

import importlib.util
import pathlib
import sys
import warnings

import jax
import numpy as np
import pytest

from av_jax import engine as E
from av_jax.engine import profile
from av_jax.engine import protocols
from av_jax.models import drafters
from av_jax.sampling import Sampling
from tests import _engine_fixtures as fx

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15]]  # 5 requests, 4 slots
MAX_NEW = [12, 9, 12, 7, 10]


@pytest.fixture(scope="module")
def example():
  sys.path.insert(0, str(EXAMPLES))  # the example imports its sibling own_model_loop
  try:
    spec = importlib.util.spec_from_file_location("own_model_engine",
                                                  EXAMPLES / "own_model_engine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  finally:
    sys.path.remove(str(EXAMPLES))
  return module


@pytest.fixture(scope="module")
def models(example):
  cfg = example.loop.Config()
  return cfg, example.loop.make_models(cfg)


def _config(cfg, mode):
  return E.EngineConfig(num_slots=cfg.num_slots, max_draft=cfg.max_draft, max_len=40,
                        mode=mode, sampling=Sampling(temperature=0.0),
                        programs=E.Programs(steps_per_chunk=4, num_buckets=3))


@pytest.mark.parametrize("mode", ["av", "target_only"])
def test_greedy_output_equals_the_targets_own_greedy_decoding(example, models, mode):
  cfg, (target, drafter) = models
  engine, params = example.make_engine(target, drafter, cfg, _config(cfg, mode))
  assert engine.models is None and engine.target.vocab_size == cfg.vocab
  result = E.generate(engine, params, PROMPTS, max_new_tokens=MAX_NEW, key=jax.random.key(0))
  want = [example.target_greedy(target, p, n, cfg.window) for p, n in zip(PROMPTS, MAX_NEW)]
  assert [c.tokens for c in result.completions] == want
  assert all(c.finish_reason == "length" for c in result.completions)
  stats = result.stats
  if mode == "av":  # drafts were verified and accepted: fewer steps than tokens per slot
    assert stats["verified"] > 0 and stats["emitted"] > 1.5 * stats["steps"]
  else:
    assert stats["verified"] == 0


def test_profile_times_the_users_verify_and_draft_through_the_protocol(example, models):
  cfg, (target, drafter) = models
  engine, params = example.make_engine(target, drafter, cfg, _config(cfg, "av"))
  seen = []  # the packed sizes T the user's verify was traced at

  def verify(params, cache, **inputs):
    seen.append(inputs["tokens"].shape)
    return engine.target.verify(params, cache, **inputs)

  counted = engine._replace(target=engine.target._replace(verify=verify))
  with warnings.catch_warnings():  # timing noise on a shared CPU may need the monotone repair
    warnings.simplefilter("ignore", UserWarning)
    cost, table = profile.profile_costs(counted, params, repeats=2, cache_dir="")
  assert sorted(set(seen)) == [(T,) for T in engine.config.group_bucket_sizes()]
  assert table["buckets"] == list(engine.buckets) and not table["cached"]
  assert all(ms > 0 for ms in table["bucket_ms"]) and table["draft_ms"] > 0
  B, K = cfg.num_slots, cfg.max_draft
  assert cost.verify_ms.shape == (B * (K + 1) + 1,)
  assert np.all(np.diff(np.asarray(cost.verify_ms)) >= 0)  # monotone step function
  # The cache key names the user's model, so another model is profiled anew.
  other = counted._replace(target=counted.target._replace(name="another model"))
  assert profile.cache_key(other) != profile.cache_key(counted)
  # And the attention of its verify pass (per slot or per token) too.
  width = counted.target.verify_read_width
  toggled = counted._replace(target=counted.target._replace(verify_read_width=not width))
  assert profile.cache_key(toggled) != profile.cache_key(counted)


def test_make_engine_takes_exactly_one_of_models_and_target(example, models):
  cfg, (target, drafter) = models
  engine, _ = example.make_engine(target, drafter, cfg, _config(cfg, "av"))
  with pytest.raises(ValueError, match="exactly one"):
    E.make_engine(engine.config, drafter=engine.drafter)
  with pytest.raises(ValueError, match="exactly one"):
    E.make_engine(engine.config, object(), engine.drafter, target=engine.target)
  with pytest.raises(ValueError, match="drafter"):
    E.make_engine(engine.config, target=engine.target)


def test_av_jax_models_are_a_cached_target():
  cfg = fx.tiny_config()
  drafter = drafters.make_drafter("block", cfg)
  engine = E.make_engine(E.EngineConfig(num_slots=2, max_draft=2, max_len=16), cfg, drafter)
  assert engine.target is protocols.transformer_target(cfg)  # one object: no recompiles
  assert (engine.target.vocab_size, engine.target.hidden_size) == (
      cfg.target.vocab_size, cfg.target.d_model)
  assert engine.target.init_cache(2, 16).k.shape[1] == 2 == engine.config.num_slots
