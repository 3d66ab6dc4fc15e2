"""The KV-cache dtype setting (`ModelsConfig.kv_dtype`): float32 by default, bfloat16 on
request for the target and the drafters' caches, attention computed in float32."""

import dataclasses
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from av_jax.sampling import Sampling
from av_jax import engine as E
from av_jax import models as M
from av_jax.engine import protocols
from av_jax.models import config as C
from av_jax.models import transformer as T
from tests import _engine_fixtures as fx


def test_setting_defaults_to_float32_and_is_validated():
  cfg = M.load_config("tiny")
  assert cfg.kv_dtype == "float32"
  raw = C.to_dict(cfg)
  del raw["kv_dtype"]  # configs written before the setting load as float32
  assert C.from_dict(raw).kv_dtype == "float32"
  with pytest.raises(ValueError, match=r"^kv_dtype: expected one of \['bfloat16', 'float32'\]"):
    dataclasses.replace(cfg, kv_dtype="float16")
  bf16 = dataclasses.replace(cfg, kv_dtype="bfloat16")
  # No checkpoint depends on it: the same hashes, and float32 identities are unchanged.
  assert C.config_hash(bf16, "eagle") == C.config_hash(cfg, "eagle")
  assert "kv_dtype" not in C.identity(cfg) and C.identity(bf16)["kv_dtype"] == "bfloat16"


def test_bfloat16_halves_the_target_and_drafter_caches():
  cfg, _, params = fx.pair("eagle")
  bf16 = dataclasses.replace(cfg, kv_dtype="bfloat16")
  nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
  f32_cache = protocols.transformer_target(cfg).init_cache(4, 64)
  bf16_cache = protocols.transformer_target(bf16).init_cache(4, 64)
  assert bf16_cache.k.dtype == jnp.bfloat16 and f32_cache.k.dtype == jnp.float32
  assert 2 * nbytes(bf16_cache) == nbytes(f32_cache)
  prompt = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
  hidden = jnp.zeros((1, 4, cfg.target.d_model))
  for kind in ("eagle", "draft_lm"):
    drafter_params = M.init_drafter_params(kind, bf16, jax.random.PRNGKey(1))
    state = M.make_drafter(kind, bf16).init_state(
        drafter_params, params.target, prompt=prompt, prompt_hidden=hidden,
        next_token=jnp.asarray([5]), K=4, max_len=64)
    assert state.cache.k.dtype == jnp.bfloat16, kind


def test_bfloat16_cached_decoding_matches_float32_logits():
  """Prefill then 16 one-token steps: bfloat16 keeps 8 significant bits per key and value
  (relative error <= 2**-9), which moves these logits (std 1.5) by at most 0.1."""
  cfg, _, params = fx.pair("block")
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, fx.VOCAB, (2, 40)), jnp.int32)

  def decode(dtype):
    out = T.forward(params.target, tokens[:, :24], jnp.broadcast_to(jnp.arange(24), (2, 24)),
                    T.init_cache(cfg.target, 2, 64, dtype), cfg=cfg.target)
    logits, cache = [out.logits], out.cache
    for i in range(24, 40):
      out = T.forward(params.target, tokens[:, i:i + 1], jnp.full((2, 1), i), cache,
                      cfg=cfg.target)
      logits.append(out.logits)
      cache = out.cache
    assert cache.k.dtype == dtype
    return np.asarray(jnp.concatenate(logits, axis=1))

  f32, bf16 = decode(jnp.float32), decode(jnp.bfloat16)
  np.testing.assert_allclose(bf16, f32, atol=0.1)
  assert np.mean(bf16.argmax(-1) == f32.argmax(-1)) > 0.95


def test_bfloat16_speculative_greedy_equals_target_only_greedy():
  """Every attention mode reads the entries as the cache stores them, so verifying K + 1
  tokens in one pass sees what one-token target steps see."""
  cfg, drafter, params = fx.pair("eagle")
  bf16 = dataclasses.replace(cfg, kv_dtype="bfloat16")
  drafter = M.make_drafter("eagle", bf16)
  prompts = [[1, 2, 3], [4], list(range(5, 22)), [7, 7, 7, 7, 7, 7]]
  max_new = [9, 14, 6, 11]
  tokens = {}
  for mode in ("av", "target_only"):
    engine = E.make_engine(E.EngineConfig(num_slots=3, max_draft=4, max_len=64, mode=mode,
                                          sampling=Sampling(temperature=0.0),
                                          programs=E.Programs(steps_per_chunk=3)),
                           bf16, drafter)
    result = E.generate(engine, params, prompts, max_new_tokens=max_new, key=fx.key(0))
    tokens[mode] = [c.tokens for c in result.completions]
    if mode == "av":
      assert result.stats["verified"] > 0
  assert tokens["av"] == tokens["target_only"]


def test_registry_takes_the_setting_from_the_config_file(tmp_path, monkeypatch):
  shutil.copy(os.path.join(C.configs_dir(), "default.toml"), tmp_path / "default.toml")
  path = tmp_path / "default.toml"
  path.write_text(path.read_text().replace('kv_dtype = "float32"', 'kv_dtype = "bfloat16"'))
  monkeypatch.setenv("AV_JAX_CONFIGS", str(tmp_path))
  pair = M.load("default", drafter="eagle")
  assert pair.cfg.kv_dtype == "bfloat16"
