"""Checkpoint and resume of engine state with orbax.

A checkpoint is a folder holding the decode state (or any state pytree, e.g. just the
estimator and planner of a server) written by `orbax.checkpoint.StandardCheckpointer`,
plus `av_jax_meta.json`: what the state belongs to (engine config, model config hash,
drafter kind) and any host bookkeeping the caller adds (the continuous-batching queue).
`restore` refuses a checkpoint of another engine (other K, slots, drafter, models) or a
damaged one with a `ValueError` that says what differs; the caller's running state is
never modified (restore returns new arrays).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from av_jax.engine import core
from av_jax.models import config as models_config

META = "av_jax_meta.json"
FORMAT = 2


def engine_identity(engine: core.Engine) -> dict:
  """What a checkpoint must match to be restored into `engine`."""
  cfg = dataclasses.asdict(engine.config)
  programs = cfg["programs"]
  programs.pop("steps_per_chunk")  # host-sync granularity does not change the state
  programs.pop("quiet_program")  # nor the program a quiet step runs in (bit-identical)
  # Neither does the verify layout (tokens are bit-identical for every number of verify
  # groups, tests/test_verify_groups.py): a run saved on a mesh resumes on one device.
  programs.pop("verify_groups")
  programs.pop("record_features")  # what StepInfo records, not the state
  # av_jax's own models by their config; a user's own target (`engine.models` None) by its
  # protocol name (`av_jax.engine.Target.name`).
  models = (json.dumps(models_config.identity(engine.models), sort_keys=True, default=str)
            if engine.models is not None else f"target:{engine.target.name}")
  return dict(format=FORMAT, drafter=engine.drafter.kind, policy=engine.policy,
              num_slots=engine.config.num_slots, max_draft=engine.config.max_draft,
              engine_config=json.dumps(cfg, sort_keys=True, default=str),
              models_hash=hashlib.sha256(models.encode()).hexdigest()[:16])


def _config_diff(saved: str, current: str) -> str:
  """The settings two `engine_config` JSON strings differ in, as dotted names."""
  try:
    saved_cfg = json.loads(saved)
  except ValueError:
    return f"unreadable saved config {saved!r}"
  diffs = []

  def walk(a, b, prefix):
    if isinstance(a, dict) and isinstance(b, dict):
      for key in sorted(set(a) | set(b)):
        walk(a.get(key, "<absent>"), b.get(key, "<absent>"), f"{prefix}{key}.")
    elif a != b:
      diffs.append(f"{prefix[:-1]}: {a!r} vs {b!r}")

  walk(saved_cfg, json.loads(current), "")
  return "; ".join(diffs)


def _split_key(state):
  """Typed PRNG keys are stored as raw key data; returns (state, impl name or None)."""
  if isinstance(state, core.DecodeState) and jax.dtypes.issubdtype(state.key.dtype,
                                                                    jax.dtypes.prng_key):
    impl = str(jax.random.key_impl(state.key))
    return state._replace(key=jax.random.key_data(state.key)), impl
  return state, None


def save(path: str, state: Any, *, engine: core.Engine, extra: dict | None = None) -> None:
  """Writes `state` (a DecodeState or any state pytree of `engine`) to folder `path`.

  Args:
    path: a folder that must not exist yet (orbax never overwrites).
    state: the pytree to save; device arrays are fetched as they are.
    engine: the engine the state belongs to (recorded for `restore`'s checks).
    extra: JSON-able host bookkeeping stored beside the arrays.
  """
  path = os.path.abspath(path)
  state, key_impl = _split_key(state)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.join(path, "state"), state)
    ckptr.wait_until_finished()
  meta = dict(engine_identity(engine), key_impl=key_impl, extra=extra or {},
              treedef=str(jax.tree.structure(state)))
  with open(os.path.join(path, META), "w") as f:
    json.dump(meta, f, indent=1)


def restore(path: str, *, engine: core.Engine, like: Any) -> tuple[Any, dict]:
  """Reads a checkpoint written by `save` for the same engine.

  Args:
    path: the checkpoint folder.
    engine: the engine the state is restored into.
    like: a state of the expected structure (e.g. `core.init_state(...)` or the running
      state); only its shapes, dtypes and structure are read, it is not modified.

  Returns:
    `(state, extra)`: new arrays, and the host bookkeeping saved with them.

  Raises:
    ValueError: the folder is missing, damaged or truncated, or the checkpoint belongs
      to another engine (the message names the settings that differ).
  """
  path = os.path.abspath(path)
  meta_path = os.path.join(path, META)
  try:
    with open(meta_path) as f:
      meta = json.load(f)
  except (OSError, ValueError) as err:
    raise ValueError(f"checkpoint {path}: unreadable metadata ({err})") from None
  want = engine_identity(engine)
  for field, value in want.items():
    if meta.get(field) != value:
      if field == "engine_config" and isinstance(meta.get(field), str):
        raise ValueError(f"checkpoint {path}: it was saved by another engine; engine "
                         f"settings differ (saved vs this engine): "
                         f"{_config_diff(meta[field], value)}")
      raise ValueError(f"checkpoint {path}: {field} is {meta.get(field)!r}, but the engine "
                       f"has {value!r}; it was saved by another engine")
  like, like_impl = _split_key(like)
  if str(jax.tree.structure(like)) != meta.get("treedef"):
    raise ValueError(f"checkpoint {path}: state structure differs from `like`")
  if meta.get("key_impl") != like_impl:
    raise ValueError(f"checkpoint {path}: PRNG key type {meta.get('key_impl')!r} differs "
                     f"from `like`'s {like_impl!r}")
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
  try:
    with ocp.StandardCheckpointer() as ckptr:
      state = ckptr.restore(os.path.join(path, "state"), abstract)
  except Exception as err:  # orbax raises many types for damaged files
    raise ValueError(f"checkpoint {path}: cannot read the arrays ({type(err).__name__}: "
                     f"{str(err)[:200]})") from None
  bad = [a.shape for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(abstract))
         if np.shape(a) != b.shape]
  if bad:
    raise ValueError(f"checkpoint {path}: array shapes differ from `like` ({bad[:3]})")
  if like_impl is not None:
    state = state._replace(key=jax.random.wrap_key_data(state.key, impl=like_impl))
  return state, meta.get("extra", {})
