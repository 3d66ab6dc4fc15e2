"""Multiply-adds per token counted from shapes agree with the parameters the models hold."""

import dataclasses

import jax
import numpy as np
import pytest

from av_jax import models
from av_jax.models import compute, drafters, transformer


def _count(tree):
  return sum(int(np.size(x)) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("rank", [0, 12])
def test_counts_match_parameters(rank):
  cfg = models.load_config("tiny")
  cfg = dataclasses.replace(cfg, eagle=dataclasses.replace(cfg.eagle, head_rank=rank),
                            block=dataclasses.replace(cfg.block, head_rank=rank))
  d, v = cfg.target.d_model, cfg.target.vocab_size
  macs = compute.multiply_adds_per_token(cfg)
  # Every weight matrix is read once per token; norms (one scale per width) are not counted.
  target = transformer.init_params(cfg.target, jax.random.key(0))
  assert macs["target"] == _count(target) - (2 * cfg.target.num_layers + 1) * d
  eagle = drafters.init_drafter_params("eagle", cfg, jax.random.key(1))
  tied = d * v if rank == 0 else 0  # the tied head lives in the target's parameters
  assert macs["eagle"] == _count(eagle) - 3 * d + tied
  block = drafters.init_drafter_params("block", cfg, jax.random.key(2))
  k, layers = cfg.block.block_size, cfg.block.num_layers
  slots = (k + 1) * d
  weights = _count(block) - slots - (2 * layers + 1) * d   # slot embeddings and norms
  head = d * v if rank == 0 else rank * (d + v)
  per_pass = (weights - (0 if rank == 0 else head) - 2 * d * d) * (k + 1) + 2 * d * d + k * head
  np.testing.assert_allclose(macs["block"], per_pass / k)


def test_v2_shapes_meet_the_compute_ratios():
  macs = compute.multiply_adds_per_token(models.load_config("configs/models/default.toml"))
  for kind in ("draft_lm", "block", "block_head"):
    assert macs[kind] <= 0.10 * macs["target"], kind
  assert macs["eagle"] <= 0.15 * macs["target"]
