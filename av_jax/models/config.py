"""Typed model and training configs, loaded from `configs/models/{name}.toml`.

Every field is documented in the TOML files; the dataclasses below repeat the meaning in
one line each. `config_hash` fingerprints the parts of a config that determine a
checkpoint's shapes and contents, and `load` refuses files written under another hash.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tomllib
from typing import Any

import jax.numpy as jnp

from av_jax.data.workloads import DataConfig
from av_jax.models import checkpoint


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
  """A decoder-only transformer (target, or the independent `draft_lm`)."""
  vocab_size: int        # V, tokenizer vocabulary
  d_model: int           # D, residual width
  num_layers: int        # transformer blocks
  num_heads: int         # attention heads (no grouped-query sharing)
  head_dim: int          # per-head width
  mlp_dim: int           # hidden width of the gated (SwiGLU) MLP
  max_len: int = 512     # largest cache length / position the model is used at
  rope_theta: float = 10000.0  # RoPE base frequency


@dataclasses.dataclass(frozen=True, kw_only=True)
class EagleConfig:
  """EAGLE/MTP-style feature-level head: one transformer layer at the target's width."""
  num_heads: int         # attention heads of the single layer
  head_dim: int          # per-head width
  mlp_dim: int           # gated MLP hidden width
  feature_loss: float = 0.1  # weight of the smooth-L1 loss on predicted target features
  unroll: int = 2        # training-time unrolled steps feeding predicted features back
  head_rank: int = 0     # 0: logits through the target's tied [V, D] head; R > 0: a factored
                         # head D -> R -> V of the drafter's own (R*(D+V) multiply-adds per
                         # token instead of D*V), as deployed drafters shrink their head


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockConfig:
  """Parallel block drafter (Medusa/DFlash style) with an optional confidence head."""
  block_size: int        # K_max, positions predicted in one pass
  num_layers: int        # bidirectional transformer layers over the K_max+1 slots
  num_heads: int         # attention heads
  head_dim: int          # per-head width
  mlp_dim: int           # gated MLP hidden width
  head_rank: int = 0     # 0: the target's tied head; R > 0: own factored head D -> R -> V


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
  """Optimisation of one model (AdamW, linear warm-up then cosine decay)."""
  steps: int             # optimiser steps
  batch: int             # sequences per step (split equally across workloads)
  seq_len: int           # tokens per sequence
  lr: float              # peak learning rate
  warmup: int            # linear warm-up steps
  weight_decay: float = 0.01  # AdamW decoupled weight decay
  grad_clip: float = 1.0      # global-norm gradient clipping


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadTrainConfig:
  """Confidence head of `block_head`: labels from verification, then logistic training."""
  num_prompts: int       # training prompts per workload used to collect labels
  prompt_len: int        # tokens per prompt
  steps: int             # decode steps run per prompt while collecting labels
  train_steps: int       # optimiser steps of the head
  lr: float              # learning rate (Adam)
  batch: int             # labelled drafts per optimiser step


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeasureConfig:
  """What `benchmarks/measure_models.py` and the checkpoint summary measure."""
  K: int = 8             # draft length
  num_prompts: int = 64  # held-out prompts per workload
  prompt_len: int = 64   # tokens per prompt
  steps: int = 8         # speculative decode steps per prompt
  eval_windows: int = 64 # held-out windows per workload for the held-out loss
  top_p: float = 0.95    # nucleus mass of the sampled setting


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelsConfig:
  """Everything that defines one named model set (`tiny`, `default`)."""
  name: str                    # config name; also the checkpoint / tokenizer file prefix
  seed: int                    # master seed of all training
  tokenizer_vocab: int         # BPE vocabulary size
  tokenizer_chars: int         # characters per workload the tokenizer is trained on
  data: DataConfig             # corpora and split
  target: TransformerConfig    # the target model
  draft_lm: TransformerConfig  # the independent small draft LM
  eagle: EagleConfig           # the EAGLE-style head
  block: BlockConfig           # the block drafter (and block_head's trunk)
  train_target: TrainConfig    # target pre-training
  train_drafters: TrainConfig  # joint distillation of draft_lm, eagle and block
  train_head: HeadTrainConfig
  measure: MeasureConfig
  kv_dtype: str = "float32"    # KV-cache element type of the target and the drafters

  def __post_init__(self):
    if self.kv_dtype not in KV_DTYPES:
      raise ValueError(f"kv_dtype: expected one of {sorted(KV_DTYPES)}, got {self.kv_dtype!r}")


# The KV-cache element types a model set may use. The cache stores keys and values in this
# type and attention upcasts what it reads to float32: bfloat16 halves the cache's bytes
# (and the bytes attention reads) at 8 significant bits per entry (relative rounding error
# <= 2**-9); float32 stores what the layers computed.
KV_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def kv_cache_dtype(cfg: ModelsConfig):
  """The jnp dtype of `cfg.kv_dtype`."""
  return KV_DTYPES[cfg.kv_dtype]


def _build(cls, raw: dict[str, Any]):
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = set(raw) - names
  if unknown:
    raise ValueError(f"{cls.__name__}: unknown keys {sorted(unknown)}")
  return cls(**raw)


def configs_dir() -> str:
  """`configs/models/` of the repository (overridable with $AV_JAX_CONFIGS)."""
  here = os.path.dirname(os.path.abspath(__file__))
  default = os.path.join(here, "..", "..", "configs", "models")
  return os.environ.get("AV_JAX_CONFIGS", os.path.normpath(default))


def from_dict(raw: dict[str, Any]) -> ModelsConfig:
  raw = dict(raw)
  vocab = raw["tokenizer_vocab"]
  return ModelsConfig(
      name=raw["name"], seed=raw["seed"], tokenizer_vocab=vocab,
      tokenizer_chars=raw["tokenizer_chars"],
      data=_build(DataConfig, raw.get("data", {})),
      target=_build(TransformerConfig, {"vocab_size": vocab, **raw["target"]}),
      draft_lm=_build(TransformerConfig, {"vocab_size": vocab, **raw["draft_lm"]}),
      eagle=_build(EagleConfig, raw["eagle"]),
      block=_build(BlockConfig, raw["block"]),
      train_target=_build(TrainConfig, raw["train_target"]),
      train_drafters=_build(TrainConfig, raw["train_drafters"]),
      train_head=_build(HeadTrainConfig, raw["train_head"]),
      measure=_build(MeasureConfig, raw.get("measure", {})),
      kv_dtype=raw.get("kv_dtype", "float32"),
  )


def load_config(name_or_path: str) -> ModelsConfig:
  """Loads `configs/models/{name}.toml` (or a path to a TOML file)."""
  path = name_or_path
  if not path.endswith(".toml"):
    path = os.path.join(configs_dir(), f"{name_or_path}.toml")
  with open(path, "rb") as f:
    return from_dict(tomllib.load(f))


def to_dict(cfg) -> dict[str, Any]:
  return dataclasses.asdict(cfg)


def identity(cfg: ModelsConfig) -> dict[str, Any]:
  """`to_dict(cfg)` without the settings at the value every config had before the setting
  existed (`kv_dtype` "float32"): what identifies a model set in engine checkpoints and
  cached profiles, unchanged for the configs saved before it."""
  d = to_dict(cfg)
  if d.get("kv_dtype") == "float32":
    del d["kv_dtype"]
  return d


# Fields added after checkpoints were shipped, with the value those checkpoints were built
# with: left out of the hash at that value, so older checkpoints keep loading.
_HASH_NEUTRAL = {"head_rank": 0}


def config_hash(cfg: ModelsConfig, part: str, format: int | None = None) -> str:
  """Fingerprint of what determines checkpoint `part` ("target", "eagle", ...).

  Covers the model shapes, the training settings of that part and of everything it was
  distilled from, the data, the seed and the checkpoint format version `format` (default
  the one `checkpoint.save` writes; a file is checked against the format it was written
  in, so files of every readable format keep loading).
  """
  d = to_dict(cfg)
  for section in d.values():  # fields added later, at the value older files were built with
    if isinstance(section, dict):
      for field, neutral in _HASH_NEUTRAL.items():
        if section.get(field, None) == neutral:
          del section[field]
  keys = ["seed", "tokenizer_vocab", "tokenizer_chars", "data", "target", "train_target"]
  # The drafters are distilled jointly, so each depends on all drafter shapes.
  drafters = ["draft_lm", "eagle", "block", "train_drafters"]
  extra = {"target": [], "draft_lm": drafters, "eagle": drafters, "block": drafters,
           "block_head": drafters + ["train_head"]}[part]
  fmt = checkpoint.FORMAT_VERSION if format is None else format
  blob = json.dumps({"format": fmt, "part": part,
                     **{k: d[k] for k in keys + extra}}, sort_keys=True)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]
