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


def key(seed: int) -> jax.Array:
  """PRNG keys for engine tests: the rbg generator compiles several times faster on CPU
  than threefry, and the engine works with any key type."""
  return jax.random.key(seed, impl="rbg")


PAD = 64  # uncached reference sequences are padded to this length: one compilation


@functools.partial(jax.jit, static_argnames="cfg")
def _last_logits(target_params, seq, lengths, *, cfg):
  positions = jnp.broadcast_to(jnp.arange(seq.shape[1]), seq.shape)
  logits = M.forward(target_params, seq, positions, cfg=cfg).logits  # causal: padding after
  return jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]


def target_logits(cfg, target_params, sequences: np.ndarray) -> np.ndarray:
  """Uncached target logits of the last position of each row of `sequences [N, S]`."""
  sequences = np.asarray(sequences, np.int32)
  n, s = sequences.shape
  padded = np.zeros((n, PAD), np.int32)
  padded[:, :s] = sequences
  out = _last_logits(target_params, padded, np.full((n,), s, np.int32), cfg=cfg.target)
  return np.asarray(out, np.float64)


@functools.lru_cache(maxsize=None)
def _greedy_cached(copy_target, prompt, max_new, eos_id):
  cfg = tiny_config(copy_target)
  target = pair("block", copy_target)[2].target if not copy_target else pair(
      "draft_lm", True)[2].target
  seq = list(prompt)
  out = []
  for _ in range(max_new):
    nxt = int(np.argmax(target_logits(cfg, target, np.asarray([seq]))[0]))
    out.append(nxt)
    seq.append(nxt)
    if nxt == eos_id:
      break
  return tuple(out)


def greedy_reference(copy_target: bool, prompt, max_new, eos_id=-1) -> list[int]:
  """Target-only greedy decoding without a cache: the oracle for greedy equality."""
  return list(_greedy_cached(copy_target, tuple(prompt), max_new, eos_id))
