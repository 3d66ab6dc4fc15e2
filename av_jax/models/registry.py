"""Loading shipped (or freshly trained) model sets by name."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from av_jax.data.tokenizer import Tokenizer, from_json
from av_jax.models import checkpoint
from av_jax.models.config import ModelsConfig, config_hash, configs_dir, from_dict, load_config
from av_jax.models.drafters import KINDS, Drafter, make_drafter


class ModelPair(NamedTuple):
  """A target and one drafter, ready for the engine."""
  name: str                 # model set name ("default", "tiny", ...)
  cfg: ModelsConfig         # the full config the checkpoints were trained under
  tokenizer: Tokenizer      # the model set's tokenizer
  target_params: Any        # target parameter pytree (float32)
  drafter: Drafter | None   # drafter functions + kind/drafting metadata (None if not requested)
  drafter_params: Any       # drafter parameter pytree (None if not requested)


def _check(meta: dict, cfg: ModelsConfig, part: str, tok_hash: str, path: str) -> None:
  want = config_hash(cfg, part, meta.get("format"))
  if meta.get("config_hash") != want:
    raise ValueError(f"{path}: config hash {meta.get('config_hash')} does not match the "
                     f"config ({want}); the checkpoint was trained under another config")
  if meta.get("tokenizer_hash") != tok_hash:
    raise ValueError(f"{path}: trained with another tokenizer")


def load(name: str = "default", drafter: str | None = None, *,
         directory: str | None = None) -> ModelPair:
  """Loads model set `name` with optional `drafter` kind, checking config hashes.

  The config is the one recorded in the target checkpoint; when `configs/models/{name}.toml`
  exists it must produce the same hashes (a retrained or edited config is caught), and its
  `kv_dtype` (which no checkpoint depends on) is used.

  Args:
    name: model set name.
    drafter: one of `draft_lm`, `eagle`, `block`, `block_head`, or None for the target only.
    directory: where the files are (default: the shipped `av_jax/assets`).

  Returns:
    A `ModelPair`.

  Example:
    >>> pair = load("default", drafter="eagle")
    >>> pair.drafter.drafting
    'autoregressive'
  """
  directory = directory or checkpoint.assets_dir()
  tok_path = os.path.join(directory, f"tokenizer_{name}.json")
  if not os.path.exists(tok_path):
    raise FileNotFoundError(f"missing {tok_path}; retrain with "
                            f"`python benchmarks/train_models.py --config {name}`")
  with open(tok_path, encoding="utf-8") as f:
    tok_json = f.read()
  tok_hash = checkpoint.tokenizer_hash(tok_json)
  target_path = checkpoint.path_of(directory, name, "target")
  target = checkpoint.read(target_path)
  cfg = from_dict(target.meta["config"])
  toml = os.path.join(configs_dir(), f"{name}.toml")
  if os.path.exists(toml):
    file_cfg = load_config(toml)
    if config_hash(file_cfg, "target") != config_hash(cfg, "target"):
      raise ValueError(f"{target_path} was trained under a config that differs from {toml}; "
                       "retrain or restore the config")
    # Settings that do not change a checkpoint (the KV-cache dtype) come from the file.
    cfg = dataclasses.replace(cfg, kv_dtype=file_cfg.kv_dtype)
  _check(target.meta, cfg, "target", tok_hash, target_path)
  d, dparams = None, None
  if drafter is not None:
    if drafter not in KINDS:
      raise KeyError(f"unknown drafter {drafter!r}; known: {KINDS}")
    path = checkpoint.path_of(directory, name, drafter)
    ck = checkpoint.read(path)
    _check(ck.meta, cfg, drafter, tok_hash, path)
    d, dparams = make_drafter(drafter, cfg), _to_jnp(ck.params)
  return ModelPair(name, cfg, from_json(tok_json), _to_jnp(target.params), d, dparams)


def _to_jnp(tree):
  return jax.tree.map(jnp.asarray, tree)


def load_summary(name: str = "default", *, directory: str | None = None) -> dict:
  """The training summary recorded next to the checkpoints (held-out losses, timings)."""
  directory = directory or checkpoint.assets_dir()
  with open(os.path.join(directory, f"{name}_summary.json"), encoding="utf-8") as f:
    return json.load(f)
