"""Engine: greedy equality with target-only decoding, stops, inert slots, no recompiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from av_jax import engine as E
from av_jax.sampling import Sampling
from av_jax.engine import batching as G
from tests import _engine_fixtures as fx

PROMPTS = [[1, 2, 3], [4], list(range(5, 22)), [7, 7, 7, 7, 7, 7]]
MAX_NEW = [9, 14, 6, 11]


def _engine(kind, mode, copy_target=False, **overrides):
  cfg, drafter, params = fx.pair(kind, copy_target)
  settings = dict(num_slots=3, max_draft=4, max_len=64, mode=mode,
                  sampling=Sampling(temperature=0.0), programs=E.Programs(steps_per_chunk=3))
  settings.update(overrides)
  return E.make_engine(E.EngineConfig(**settings), cfg, drafter), params


@pytest.mark.parametrize("kind,mode,copy_target", [
    ("block", "target_only", False),
    ("block", "av", False),
    ("block_head", "av_head", False),
    ("eagle", "av", False),
    ("draft_lm", "av", False),
    ("draft_lm", "fixed", True),
    ("draft_lm", "av", True),
])
def test_greedy_equals_target_only_greedy(kind, mode, copy_target):
  engine, params = _engine(kind, mode, copy_target)
  want = [fx.greedy_reference(copy_target, p, n) for p, n in zip(PROMPTS, MAX_NEW)]
  result = E.generate(engine, params, PROMPTS, max_new_tokens=MAX_NEW, key=fx.key(0))
  assert [c.tokens for c in result.completions] == want
  assert all(c.finish_reason == "length" for c in result.completions)
  if mode == "target_only":
    assert result.stats["verified"] == 0
  elif mode != "oracle":  # the oracle counts only accepted drafts as verified
    assert result.stats["verified"] > 0
  if copy_target:  # the drafter is the target: every verified draft is accepted
    assert result.stats["acceptance_at"][0] == 1.0
    assert result.stats["emitted"] > result.stats["steps"] * 2


@pytest.mark.parametrize("kind", ["block", "eagle"])
def test_eos_stops_a_request_where_target_greedy_emits_it(kind):
  # An EOS that the reference emits mid-way in one request stops that request there.
  eos = fx.greedy_reference(False, PROMPTS[1], MAX_NEW[1])[5]
  engine, params = _engine(kind, "av", eos_id=eos)
  want = [fx.greedy_reference(False, p, n, eos) for p, n in zip(PROMPTS, MAX_NEW)]
  result = E.generate(engine, params, PROMPTS, max_new_tokens=MAX_NEW, key=fx.key(0))
  assert [c.tokens for c in result.completions] == want
  assert result.completions[1].finish_reason == "eos"
  assert result.completions[1].tokens[-1] == eos and len(result.completions[1].tokens) <= 6


def test_drafting_with_the_target_itself_emits_k_plus_one_per_step():
  engine, params = _engine("draft_lm", "fixed", copy_target=True, num_slots=1, max_draft=4)
  result = E.generate(engine, params, [[1, 2]], max_new_tokens=[1 + 5 * 6],
                      key=fx.key(0))
  assert result.stats["steps"] == 6 and result.stats["emitted"] == 30
  assert result.stats["acceptance_at"] == [1.0] * 4


def test_no_recompile_after_warmup_and_inert_slots():
  engine, params = _engine("block", "av", programs=E.Programs(steps_per_chunk=3, num_buckets=3))
  prefill, chunk, init = G.compiled(engine)
  E.generate(engine, params, PROMPTS, max_new_tokens=MAX_NEW, key=fx.key(1))
  programs = G.decode_programs(engine)  # the quiet and the drafting program
  assert len(programs) == 2
  sizes = lambda: [p._cache_size() for p in programs] + [prefill._cache_size()]
  first = sizes()
  assert first[:2] == [1, 1]
  result = E.generate(engine, params, [[3, 1], [2] * 9, [5] * 20], max_new_tokens=[20, 3, 8],
                      key=fx.key(2))
  assert sizes() == first
  assert len(result.stats["bucket_hist"]) == len(engine.buckets) == 3

  # An idle state stays idle: nothing emitted, nothing written, no labels.
  state = result.state
  new_state, info = chunk(params, jax.tree.map(jnp.copy, state))
  np.testing.assert_array_equal(new_state.tokens, state.tokens)
  np.testing.assert_array_equal(new_state.length, state.length)
  np.testing.assert_array_equal(new_state.target_cache.k, state.target_cache.k)
  assert int(jnp.sum(info.emitted)) == 0 and not bool(jnp.any(info.labeled))
  assert int(new_state.stats.emitted) == int(state.stats.emitted)


def test_same_seed_same_tokens_when_sampling():
  engine, params = _engine("eagle", "av", sampling=Sampling(temperature=1.0))
  run = lambda seed: [c.tokens for c in E.generate(
      engine, params, PROMPTS, max_new_tokens=MAX_NEW, key=fx.key(seed)).completions]
  first = run(5)
  assert run(5) == first
  assert run(6) != first


def test_bad_requests_are_refused_individually():
  engine, params = _engine("block", "fixed")
  prompts = [[1, 2], [], [1, 99], [3] * 100, [4, 5]]
  result = E.generate(engine, params, prompts, max_new_tokens=4, key=fx.key(0))
  reasons = [c.finish_reason for c in result.completions]
  assert reasons == ["length", "error", "error", "error", "length"]
  assert "empty" in result.completions[1].error
  assert "vocabulary" in result.completions[2].error
  assert "exceed" in result.completions[3].error
  assert len(result.completions[4].tokens) == 4


def test_engine_config_errors():
  cfg, drafter, _ = fx.pair("eagle")
  with pytest.raises(ValueError, match="mode"):
    E.EngineConfig(mode="bogus")
  with pytest.raises(ValueError, match="av_head"):
    E.make_engine(E.EngineConfig(mode="av_head"), cfg, drafter)
  with pytest.raises(ValueError, match="policy"):
    E.make_engine(E.EngineConfig(mode="av", policy="current",
                                 sampling=Sampling(temperature=1.0)), cfg, drafter)
  # Greedy drafting makes the current-step budget exact even for an autoregressive drafter.
  policy = lambda t: E.make_engine(E.EngineConfig(sampling=Sampling(temperature=t)), cfg,
                                   drafter).policy
  assert policy(0.0) == "current" and policy(1.0) == "lagged"


def test_bucket_sizes():
  assert E.EngineConfig(num_slots=8, max_draft=8,
                        programs=E.Programs(num_buckets=4)).bucket_sizes() == (8, 17, 35, 72)
  assert E.EngineConfig(num_slots=8, max_draft=8, mode="fixed").bucket_sizes() == (72,)
  assert E.EngineConfig(num_slots=2, max_draft=2,
                        programs=E.Programs(buckets=(3, 4))).bucket_sizes() == (3, 4, 6)


def test_unprofitable_drafting_is_skipped_and_output_unchanged():
  """With drafting dearer than any gain (and than exploration's share of step time can
  buy), AV's plan drafts for no slot; with drafting free it drafts on every step with an
  active slot. Greedy output equals target-only greedy decoding either way."""
  from av_jax.selection import make_cost_model
  engine, params = _engine("block", "av")
  B, K = engine.config.num_slots, engine.config.max_draft
  cost = make_cost_model(np.full(B + 1, 100.0), 1.0 + 0.02 * np.arange(B * (K + 1) + 1))
  want = [fx.greedy_reference(False, p, n) for p, n in zip(PROMPTS, MAX_NEW)]
  result = E.generate(engine, params, PROMPTS, max_new_tokens=MAX_NEW, key=fx.key(0),
                      cost=cost, keep_infos=True)
  assert [c.tokens for c in result.completions] == want
  drafted = np.concatenate([i.drafting for i in result.infos])
  assert not drafted.any()
  free = make_cost_model(np.full(B + 1, 1e-3), 1.0 + 0.02 * np.arange(B * (K + 1) + 1))
  result = E.generate(engine, params, PROMPTS, max_new_tokens=MAX_NEW, key=fx.key(0),
                      cost=free, keep_infos=True)
  # (A step with no active slot has nobody to draft for: a target-only step.)
  drafted = np.concatenate([i.drafting for i in result.infos])
  num_active = np.concatenate([i.active for i in result.infos])
  np.testing.assert_array_equal(drafted, num_active > 0)
  assert num_active.min() == 0 and num_active.max() > 0
  assert [c.tokens for c in result.completions] == want
