"""Tiny random model sets for engine tests (vocabulary 24, width 32): fast and exact."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from av_jax import engine as E
from av_jax import models as M

VOCAB = 24


@functools.lru_cache(maxsize=None)
def tiny_config(copy_target: bool = False) -> M.ModelsConfig:
  """The `tiny` model set shrunk to VOCAB tokens; `copy_target` makes draft_lm = target."""
  cfg = M.load_config("tiny")
  target = dataclasses.replace(cfg.target, vocab_size=VOCAB)
  draft_lm = target if copy_target else dataclasses.replace(cfg.draft_lm, vocab_size=VOCAB)
  return dataclasses.replace(cfg, target=target, draft_lm=draft_lm)


@functools.lru_cache(maxsize=None)
def pair(kind: str, copy_target: bool = False):
  """(models config, drafter, Params) with random weights; `draft_lm_copy` drafts exactly."""
  cfg = tiny_config(copy_target)
  target = M.init_params(cfg.target, jax.random.PRNGKey(0))
  # Sharper random logits make the target's choices less uniform (more realistic).
  target = jax.tree.map(lambda x: x * 1.5, target)
  drafter = M.make_drafter(kind, cfg)
  params = target if copy_target else M.init_drafter_params(kind, cfg, jax.random.PRNGKey(1))
  return cfg, drafter, E.Params(target=target, drafter=params)


def target_logits(cfg, target_params, sequences: np.ndarray) -> np.ndarray:
  """Uncached target logits of the last position of each row of `sequences [N, S]`."""
  seq = jnp.asarray(sequences, jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(seq.shape[1]), seq.shape)
  out = M.forward(target_params, seq, positions, cfg=cfg.target)
  return np.asarray(out.logits[:, -1], np.float64)


def greedy_reference(cfg, target_params, prompt, max_new, eos_id=-1) -> list[int]:
  """Target-only greedy decoding without a cache: the oracle for greedy equality."""
  seq = list(prompt)
  out = []
  for _ in range(max_new):
    nxt = int(np.argmax(target_logits(cfg, target_params, np.asarray([seq]))[0]))
    out.append(nxt)
    seq.append(nxt)
    if nxt == eos_id:
      break
  return out
