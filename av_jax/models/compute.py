"""Multiply-adds per token of every model, counted from the config's shapes.

Weights only: each parameter read for a token is one multiply-add (the embedding lookup is
free, the tied output head is `D x V`). Attention over the context adds
`2 x layers x context x heads x head_dim` more per token (scores and values), listed
separately because it depends on the context length, not on the model.

Per token means per *drafted* token for drafters: `draft_lm` and `eagle` run once per
depth; `block` runs one pass over `K_max + 1` slots for `K_max` drafts, so its pass is
divided by `K_max`.
"""

from __future__ import annotations

from av_jax.models.config import BlockConfig, EagleConfig, ModelsConfig, TransformerConfig


def _layer(d_model: int, num_heads: int, head_dim: int, mlp_dim: int) -> int:
  """One pre-norm block: q, k, v, o projections and the gated (3-matrix) MLP."""
  return 4 * d_model * num_heads * head_dim + 3 * d_model * mlp_dim


def _head(d_model: int, vocab: int, rank: int) -> int:
  return d_model * vocab if rank == 0 else rank * (d_model + vocab)


def transformer_macs(cfg: TransformerConfig) -> int:
  """Per token of a decoder-only LM: its layers plus the tied `D x V` output head."""
  return (cfg.num_layers * _layer(cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.mlp_dim)
          + cfg.d_model * cfg.vocab_size)


def eagle_macs(cfg: EagleConfig, d_model: int, vocab: int) -> int:
  """Per drafting step: `fc` (2D -> D), one layer at the target's width, the output head."""
  return (2 * d_model * d_model + _layer(d_model, cfg.num_heads, cfg.head_dim, cfg.mlp_dim)
          + _head(d_model, vocab, cfg.head_rank))


def block_macs(cfg: BlockConfig, d_model: int, vocab: int, *, with_head: bool) -> float:
  """Per drafted token: one pass (`fc`, layers over K_max + 1 slots, K_max heads) / K_max."""
  k = cfg.block_size
  layers = cfg.num_layers * _layer(d_model, cfg.num_heads, cfg.head_dim, cfg.mlp_dim)
  per_pass = (2 * d_model * d_model + (k + 1) * layers
              + k * (_head(d_model, vocab, cfg.head_rank) + (d_model if with_head else 0)))
  return per_pass / k


def multiply_adds_per_token(cfg: ModelsConfig) -> dict[str, float]:
  """`{part: multiply-adds per (drafted) token}` for the target and every drafter kind."""
  d, v = cfg.target.d_model, cfg.target.vocab_size
  return {
      "target": float(transformer_macs(cfg.target)),
      "draft_lm": float(transformer_macs(cfg.draft_lm)),
      "eagle": float(eagle_macs(cfg.eagle, d, v)),
      "block": block_macs(cfg.block, d, v, with_head=False),
      "block_head": block_macs(cfg.block, d, v, with_head=True),
  }


def attention_macs_per_token(cfg: TransformerConfig, context: int) -> int:
  """Scores and weighted values over `context` cached positions, all layers."""
  return 2 * cfg.num_layers * context * cfg.num_heads * cfg.head_dim
