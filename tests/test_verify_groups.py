"""Verify groups: per-group packing changes no value, greedy output, or sampled token."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from av_jax import engine as E
from av_jax.engine import core
from av_jax.engine import profile as prof
from av_jax.models import transformer
from av_jax.sampling import Sampling
from tests import _engine_fixtures as fx

# Prompts of at most 16 tokens: one prefill compilation per engine.
PROMPTS = [[1, 2, 3], [4], list(range(5, 16)), [7] * 6, [3, 9]]
MAX_NEW = [9, 12, 6, 10, 8]


def _engine(kind, mode, *, temperature=0.0):
  cfg, drafter, params = fx.pair(kind)
  config = E.EngineConfig(num_slots=4, max_draft=3, max_len=40, mode=mode,
                          sampling=Sampling(temperature=temperature),
                          programs=E.Programs(steps_per_chunk=4, num_buckets=2,
                                              verify_groups=2))
  return E.make_engine(config, cfg, drafter), params


def _tokens(result):
  return [c.tokens for c in result.completions]


def test_packed_verify_is_the_same_for_every_grouping():
  # Uneven groups: group 0 (slots 0, 1) holds 4 + 3 valid tokens and group 1 only 1 + 0,
  # so the fullest group picks the bucket. Every value must equal the single buffer's:
  # packing moves rows, it never changes what a row computes. (One slot per group, the
  # layout of 4 slots on 4 data shards, runs in tests/test_sharding.py.)
  cfg, drafter, params = fx.pair("block")
  B, K, M = 4, 3, 16
  num_verified = jnp.asarray([3, 2, 0, 0])
  active = jnp.asarray([True, True, True, False])
  j = jnp.arange(K + 1)[None]
  valid = active[:, None] & (j <= num_verified[:, None])
  positions = jnp.asarray([5, 3, 8, 2])[:, None] - 1 + j
  tokens = jax.random.randint(jax.random.key(0), (B, K + 1), 0, fx.VOCAB)
  k = jax.random.normal(jax.random.key(1), (cfg.target.num_layers, B, cfg.target.num_heads,
                                            M, cfg.target.head_dim))
  cache = transformer.KVCache(k, -k)
  engines = {groups: E.make_engine(E.EngineConfig(
      num_slots=B, max_draft=K, max_len=M, mode="av",
      sampling=Sampling(temperature=1.0, top_p=0.9),
      programs=E.Programs(buckets=(8, 16), verify_groups=groups)), cfg, drafter)
             for groups in (1, 2)}

  @jax.jit  # one compilation for both groupings
  def run(target_params, cache):
    return {groups: core._verify_packed(engine, target_params, cache, tokens=tokens,
                                        positions=positions, valid=valid)
            for groups, engine in engines.items()}

  out = jax.device_get(run(params.target, cache))
  valid = np.asarray(valid)
  # 8 valid tokens in one buffer: bucket 8 of (8, 16). Two groups of 7 and 1 tokens: bucket
  # 8 of (4, 8) per group, where the mean of 4 per group would have been too small.
  assert engines[1].config.group_bucket_sizes() == (8, 16) and int(out[1][3]) == 0
  assert engines[2].config.group_bucket_sizes() == (4, 8) and int(out[2][3]) == 1
  for groups in (1, 2):
    probs, hidden, new_cache, _ = out[groups]
    np.testing.assert_array_equal(probs[valid], out[1][0][valid], err_msg=f"{groups}")
    np.testing.assert_array_equal(hidden[valid], out[1][1][valid], err_msg=f"{groups}")
    for got, want in zip(new_cache, out[1][2]):
      np.testing.assert_array_equal(got, want, err_msg=f"cache, {groups} groups")
  assert not np.array_equal(out[1][2].k, np.asarray(k))  # the valid tokens were written


@pytest.mark.parametrize("kind,mode", [("block", "av")])  # eagle: the sampling test below
def test_greedy_with_two_groups_equals_target_only_greedy(kind, mode):
  engine, params = _engine(kind, mode)
  want = [fx.greedy_reference(False, p, n) for p, n in zip(PROMPTS, MAX_NEW)]
  result = E.generate(engine, params, PROMPTS, max_new_tokens=MAX_NEW, key=fx.key(0))
  assert _tokens(result) == want
  assert result.stats["verified"] > 0


def test_sampling_with_two_groups_draws_the_same_tokens():
  # Packing per group moves tokens between buffer rows but changes no value, so the same
  # key draws exactly the same tokens.
  engine, params = _engine("eagle", "av", temperature=1.0)
  programs = dataclasses.replace(engine.config.programs, verify_groups=None)
  one = engine._replace(config=dataclasses.replace(engine.config, programs=programs))
  grouped = E.generate(engine, params, PROMPTS, max_new_tokens=MAX_NEW, key=fx.key(4))
  single = E.generate(one, params, PROMPTS, max_new_tokens=MAX_NEW, key=fx.key(4))
  assert _tokens(grouped) == _tokens(single)
  assert grouped.stats["emitted"] == single.stats["emitted"]
  assert grouped.stats["verified"] == single.stats["verified"]


def test_profile_times_the_grouped_program():
  cfg, drafter, params = fx.pair("block")
  engine = E.make_engine(E.EngineConfig(num_slots=4, max_draft=2, max_len=16, mode="av",
                                        programs=E.Programs(num_buckets=2, verify_groups=2)),
                         cfg, drafter)
  profile = prof.measure(engine, params, repeats=1)
  # Total sizes (G x T_g), the units of the cost tables.
  assert profile["buckets"] == list(engine.buckets) == [4, 12]
  assert profile["verify_groups"] == 2 and all(ms > 0 for ms in profile["bucket_ms"])
  cost = prof.cost_model_from_profile(profile, num_slots=4, max_tokens=12)
  # The verify entries are the grouped program's whole steps measured (`verify_table`):
  # B = 4 tokens cost the step without drafting, 12 the full step less its drafting, and
  # 6 (B + K, in the 12 bucket with 5) the one-slot step less its bucket's drafting where
  # that lies below the full step (else it is the subset path's overhead, priced in the
  # draft table); kept monotone (a loaded machine can time a larger regime cheaper).
  steps = profile["step_ms"]
  anchors = prof.step_anchors(profile, num_slots=4, max_tokens=12)
  assert anchors[0] == (4, steps["skip"])
  assert anchors[-1] == (12, pytest.approx(steps["full"] - profile["draft_ms"]))
  ts = [t for t, _ in anchors]
  assert ts in ([4, 12], [4, 6, 12])
  want = np.maximum.accumulate([ms for _, ms in anchors])
  v = np.asarray(cost.verify_ms)
  np.testing.assert_allclose(v[ts], np.maximum(want, 1e-6), rtol=1e-6)
  assert v[5] == v[6]  # one bucket, one regime


def test_group_bucket_sizes():
  config = E.EngineConfig(num_slots=8, max_draft=8,
                          programs=E.Programs(num_buckets=4, verify_groups=2))
  assert config.group_bucket_sizes() == (4, 8, 17, 36)
  assert config.bucket_sizes() == (8, 16, 34, 72)
  assert E.EngineConfig(num_slots=8, max_draft=8, mode="fixed", programs=E.Programs(
      verify_groups=4)).bucket_sizes() == (72,)
  assert E.EngineConfig(num_slots=4, max_draft=2, programs=E.Programs(
      buckets=(4, 6), verify_groups=2)).group_bucket_sizes() == (2, 3, 6)
  # None and 1 are the single packed buffer of all slots.
  assert (E.EngineConfig(num_slots=8, programs=E.Programs(verify_groups=1)).bucket_sizes()
          == E.EngineConfig(num_slots=8).bucket_sizes())


@pytest.mark.parametrize("groups", [0, -2, 3, 16, 2.0, True])
def test_bad_verify_groups_are_refused(groups):
  with pytest.raises(ValueError, match="verify_groups"):
    E.EngineConfig(num_slots=8, programs=E.Programs(verify_groups=groups))


def test_buckets_must_split_evenly_over_groups():
  with pytest.raises(ValueError, match="buckets"):
    E.EngineConfig(num_slots=8, programs=E.Programs(buckets=(6, 12), verify_groups=4))
