"""Saving and loading checkpoints with a config hash guard.

A checkpoint file `{name}_{part}.msgpack` holds `{"meta": json, "params": pytree}` in
flax msgpack. Parameters are stored in float16 (halving the shipped size) and loaded as
float32; every recorded number (held-out loss, acceptance) is measured with the
float16-rounded weights, so loading reproduces it. `meta` records the format version,
the full config, the part's config hash and the tokenizer's hash; `load` refuses a file
whose hash disagrees with the config it is loaded under or whose tokenizer differs.

Format 2 stores a transformer part's (`target`, `draft_lm`) layers stacked on a leading
axis, as `transformer.Transformer` holds them (`params["layers"]`); format 1 stored them
one subtree per layer (`layer_0` ... `layer_{L-1}`) and is read by stacking those, so a
format-1 file loads to the same parameters. E.g. a format-1 target's
`layer_3/attn/q/kernel [D, H, Dh]` is `layers/attn/q/kernel[3]` of `[L, D, H, Dh]`.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization

FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
STORE_DTYPE = np.float16
TRANSFORMER_PARTS = ("target", "draft_lm")  # the parts whose layers format 2 stacks


def assets_dir() -> str:
  """Directory of the shipped assets (`av_jax/assets`)."""
  return str(importlib.resources.files("av_jax.assets"))


def tokenizer_hash(tokenizer_json: str) -> str:
  return hashlib.sha256(tokenizer_json.encode("utf-8")).hexdigest()[:16]


def round_params(params):
  """Params as they will be after a save/load round trip (float16-rounded, float32)."""
  return jax.tree.map(lambda x: np.asarray(x).astype(STORE_DTYPE).astype(np.float32), params)


def path_of(directory: str, name: str, part: str) -> str:
  return os.path.join(directory, f"{name}_{part}.msgpack")


def save(path: str, params, meta: dict[str, Any]) -> int:
  """Writes `params` (stored as float16) and `meta` to `path`; returns the byte size."""
  tree = {"meta": json.dumps({"format": FORMAT_VERSION, **meta}, sort_keys=True),
          "params": jax.tree.map(lambda x: np.asarray(x).astype(STORE_DTYPE), params)}
  blob = serialization.msgpack_serialize(tree)
  with open(path, "wb") as f:
    f.write(blob)
  return len(blob)


class Checkpoint(NamedTuple):
  params: Any          # float32 parameter pytree
  meta: dict           # format, config, config_hash, tokenizer_hash, part, ...


def read(path: str) -> Checkpoint:
  """Reads a checkpoint file (no hash checks; see `models.load`)."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"missing checkpoint {path}; retrain with "
                            "`python benchmarks/train_models.py --config <name>`")
  with open(path, "rb") as f:
    tree = serialization.msgpack_restore(f.read())
  meta = json.loads(tree["meta"])
  if meta.get("format") not in READABLE_FORMATS:
    raise ValueError(f"{path}: checkpoint format {meta.get('format')}: expected one of "
                     f"{READABLE_FORMATS}")
  params = jax.tree.map(lambda x: np.asarray(x, np.float32), tree["params"])
  if meta["format"] == 1 and meta.get("part") in TRANSFORMER_PARTS:
    params = jax.tree.map(np.asarray, stack_layers(params))
  return Checkpoint(params, meta)


def stack_layers(params: dict) -> dict:
  """A tree of named layers (`layer_0` ... `layer_{L-1}`) with them stacked into `layers`
  (leading axis L), the layout `transformer.Transformer` holds. E.g. `layer_3/attn/q/kernel
  [D, H, Dh]` becomes `layers/attn/q/kernel[3]` of `[L, D, H, Dh]`."""
  count = sum(1 for k in params if k.startswith("layer_"))
  if count == 0 or any(f"layer_{i}" not in params for i in range(count)):
    raise ValueError(f"params: expected subtrees layer_0 ... layer_{{L-1}}, got keys "
                     f"{sorted(params)}")
  out = {k: v for k, v in params.items() if not k.startswith("layer_")}
  out["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs),
                               *[params[f"layer_{i}"] for i in range(count)])
  return out
