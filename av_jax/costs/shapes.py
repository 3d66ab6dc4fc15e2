"""Model shapes for the roofline: the parts of a transformer that set its step cost.

`ModelShape` is a decoder-only transformer's (or a drafter's) layer, head and cache
sizes; `SHAPES` the published ones (Llama-3.1-8B and its drafters), `shipped_shapes`
those of av_jax's model sets, read from their configs; `get_shape` finds either by name.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from av_jax.costs.devices import DTYPE_BYTES, _positive
from av_jax.models.config import load_config


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
  """The parts of a decoder-only transformer (or drafter) that set its step cost.

  Every layer is attention (q, k, v, o projections, grouped-query KV heads) plus a gated
  SwiGLU MLP (gate, up, down). RMSNorm gains (3 D-vectors per layer) are left out: under
  0.01% of the bytes. The input embedding is a gather of T rows per step, also left out;
  the output head (V x D) is read in full every step whether or not it is tied.
  """
  name: str                # registry name
  num_layers: int          # decoder layers
  d_model: int             # D, residual width
  mlp_dim: int             # gated MLP hidden width
  num_heads: int           # query heads
  num_kv_heads: int        # KV heads (grouped-query attention; = num_heads without it)
  head_dim: int            # width per head
  vocab_size: int          # rows of the output head (a drafter's reduced vocabulary)
  dtype: str = "bfloat16"  # matmul dtype: picks the device's peak FLOP/s
  bytes_per_param: float | None = None  # bytes per weight; None: the dtype's width
  kv_bytes: float | None = None         # bytes per KV-cache element; None: bytes_per_param
  tied_embedding: bool = False  # output head = input embedding (one V x D matrix stored)
  attn_input_dim: int | None = None  # width entering q/k/v (EAGLE-3: 2 D); None: D
  input_proj_dim: int = 0  # features projected to D before the layers (EAGLE fc: 2 D or 3 D)
  context_attention: bool = True  # attends to a KV cache of the context (False: a block
                                  # drafter that sees only the last target hidden state)
  head_rank: int = 0       # 0: a V x D output head; R > 0: a factored head D -> R -> V
                           # (av_jax's drafters with `head_rank`, R (D + V) weights)
  source: str = ""         # where the shape comes from

  def __post_init__(self):
    for field in ("num_layers", "d_model", "mlp_dim", "num_heads", "num_kv_heads",
                  "head_dim", "vocab_size"):
      value = getattr(self, field)
      if not (isinstance(value, (int, np.integer)) and value > 0):
        raise ValueError(f"{field}: expected a positive integer, got {value!r}")
    if self.dtype not in DTYPE_BYTES:
      raise ValueError(f"dtype: expected one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_kv_heads: expected a divisor of num_heads={self.num_heads}, "
                       f"got {self.num_kv_heads}")
    for field in ("bytes_per_param", "kv_bytes", "attn_input_dim"):
      if getattr(self, field) is not None:
        _positive(field, getattr(self, field))
    if self.input_proj_dim < 0:
      raise ValueError(f"input_proj_dim: expected >= 0, got {self.input_proj_dim}")

  @property
  def param_bytes(self) -> float:
    """b, bytes per weight."""
    return DTYPE_BYTES[self.dtype] if self.bytes_per_param is None else self.bytes_per_param

  @property
  def kv_element_bytes(self) -> float:
    return self.param_bytes if self.kv_bytes is None else self.kv_bytes

  @property
  def layer_params(self) -> int:
    """Weights of one decoder layer: q, k, v, o and the three MLP matrices."""
    d_in = self.attn_input_dim or self.d_model
    q = d_in * self.num_heads * self.head_dim
    kv = 2 * d_in * self.num_kv_heads * self.head_dim
    o = self.num_heads * self.head_dim * self.d_model
    return q + kv + o + 3 * self.d_model * self.mlp_dim

  @property
  def dense_params(self) -> int:
    """Weights every token multiplies, except the output head: layers + input projection."""
    return self.num_layers * self.layer_params + self.input_proj_dim * self.d_model

  @property
  def head_params(self) -> int:
    """V x D output head, or R (D + V) for a factored one."""
    if self.head_rank:
      return self.head_rank * (self.d_model + self.vocab_size)
    return self.vocab_size * self.d_model

  @property
  def num_params(self) -> int:
    """Stored weights (an untied input embedding counted; a shared one is not)."""
    embedding = 0 if self.tied_embedding else self.head_params
    return self.dense_params + self.head_params + embedding

  @property
  def kv_bytes_per_position(self) -> float:
    """KV-cache bytes of one context position over all layers (keys and values)."""
    return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_element_bytes


def shape_from_config(name: str, cfg, *, source: str = "",
                      kv_dtype: str = "float32") -> ModelShape:
  """The shape of an av_jax `TransformerConfig` (float32 weights, tied embedding, no GQA)
  with a KV cache of `kv_dtype` (`ModelsConfig.kv_dtype`)."""
  return ModelShape(name=name, num_layers=cfg.num_layers, d_model=cfg.d_model,
                    mlp_dim=cfg.mlp_dim, num_heads=cfg.num_heads, num_kv_heads=cfg.num_heads,
                    head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, dtype="float32",
                    kv_bytes=DTYPE_BYTES[kv_dtype], tied_embedding=True, source=source)


def shipped_shapes(config) -> dict[str, ModelShape]:
  """The shapes of a model set, read from its config (a name such as "default", or a
  `ModelsConfig`).

  Names: the set's name (the target) and `<name>-<kind>` for every drafter kind. The
  eagle head is one layer at the target's width over `fc([h; e])` (2 D -> D) sharing the
  target's head; the block drafters are `block.num_layers` bidirectional layers over the
  K_max + 1 slots of `fc([h; e])`, with no context attention, sharing the target's head.
  """
  cfg = load_config(config) if isinstance(config, str) else config
  name = cfg.name
  src = f"configs/models/{name}.toml" if isinstance(config, str) else f"model set {name!r}"
  target = shape_from_config(name, cfg.target, source=f"{src} [target]", kv_dtype=cfg.kv_dtype)
  d, vocab = cfg.target.d_model, cfg.target.vocab_size
  common = dict(d_model=d, vocab_size=vocab, dtype="float32", tied_embedding=True,
                input_proj_dim=2 * d, kv_bytes=DTYPE_BYTES[cfg.kv_dtype])
  eagle = ModelShape(name=f"{name}-eagle", num_layers=1, mlp_dim=cfg.eagle.mlp_dim,
                     num_heads=cfg.eagle.num_heads, num_kv_heads=cfg.eagle.num_heads,
                     head_dim=cfg.eagle.head_dim, head_rank=cfg.eagle.head_rank,
                     source=f"{src} [eagle]", **common)
  block = ModelShape(name=f"{name}-block", num_layers=cfg.block.num_layers,
                     mlp_dim=cfg.block.mlp_dim, num_heads=cfg.block.num_heads,
                     num_kv_heads=cfg.block.num_heads, head_dim=cfg.block.head_dim,
                     head_rank=cfg.block.head_rank, context_attention=False,
                     source=f"{src} [block]", **common)
  return {name: target,
          f"{name}-draft_lm": shape_from_config(f"{name}-draft_lm", cfg.draft_lm,
                                                source=f"{src} [draft_lm]",
                                                kv_dtype=cfg.kv_dtype),
          f"{name}-eagle": eagle, f"{name}-block": block,
          f"{name}-block_head": dataclasses.replace(block, name=f"{name}-block_head")}


_LLAMA3_8B = ModelShape(
    name="llama3-8b", num_layers=32, d_model=4096, mlp_dim=14336, num_heads=32,
    num_kv_heads=8, head_dim=128, vocab_size=128256, dtype="bfloat16",
    source="Llama-3.1-8B config.json: 32 layers, hidden 4096, intermediate 14336, 32 heads / "
           "8 KV heads of 128, vocab 128256, untied embedding (8.03 B params).")
SHAPES: dict[str, ModelShape] = {
    "llama3-8b": _LLAMA3_8B,
    # EAGLE-3 (Li et al. 2025): fc over three target hidden layers (3 D -> D), one decoder
    # layer whose q/k/v read [embedding; features] (2 D), and its own head over a reduced
    # draft vocabulary of 32000 tokens (the EAGLE-3 Llama-3.1-8B config's draft_vocab_size:
    # the most frequent target tokens, mapped back to the 128256-token vocabulary).
    "llama3-8b-eagle3": dataclasses.replace(
        _LLAMA3_8B, name="llama3-8b-eagle3", num_layers=1, vocab_size=32000,
        attn_input_dim=2 * 4096, input_proj_dim=3 * 4096,
        source="EAGLE-3 head for Llama-3.1-8B (configs/llama3-8B-eagle3.json of the EAGLE-3 "
               "/ SpecForge releases): 1 layer at hidden 4096, q/k/v over 2 x 4096, fc "
               "3 x 4096 -> 4096, draft_vocab_size 32000."),
    # MTP (DeepSeek-V3, section 2.2): one transformer block over proj([norm h; norm e])
    # (2 D -> D) that shares the target's embedding and full output head, run once per
    # drafted token.
    "llama3-8b-mtp": dataclasses.replace(
        _LLAMA3_8B, name="llama3-8b-mtp", num_layers=1, input_proj_dim=2 * 4096,
        tied_embedding=True,
        source="DeepSeek-V3-style MTP module at Llama-3.1-8B's width: 1 layer, projection "
               "2 x 4096 -> 4096, the target's full 128256-token head shared."),
    # DFlash-style block drafter (Chen et al. 2025): a few target-width layers draft the
    # whole block in one parallel pass, conditioned on target context features, sharing
    # the target's embedding and head. 5 layers is an assumption (DFlash-style release
    # configs use a handful; change num_layers for another drafter).
    "llama3-8b-dflash": dataclasses.replace(
        _LLAMA3_8B, name="llama3-8b-dflash", num_layers=5, input_proj_dim=2 * 4096,
        tied_embedding=True,
        source="DFlash-style block drafter at Llama-3.1-8B's width: 5 layers (assumed), "
               "projection of target features 2 x 4096 -> 4096, shared 128256-token head, "
               "attends to the context."),
}
_SHIPPED_CONFIGS = ("default", "tiny")


def shape_names() -> tuple[str, ...]:
  """Every name `get_shape` accepts."""
  shipped = [n for c in _SHIPPED_CONFIGS for n in shipped_shapes(c)]
  return tuple(SHAPES) + tuple(shipped)


def get_shape(name: str | ModelShape) -> ModelShape:
  """A `ModelShape` by name: published shapes (`SHAPES`) or a shipped model set's.

  Shipped shapes are read from `configs/models/<set>.toml` on each call, so they follow
  the config ("default" is the target, "default-eagle" its eagle head, and so on).

  Raises:
    ValueError: an unknown name, listing the known ones.
  """
  if isinstance(name, ModelShape):
    return name
  if name in SHAPES:
    return SHAPES[name]
  config = name.split("-", 1)[0]
  if config in _SHIPPED_CONFIGS:
    shapes = shipped_shapes(config)
    if name in shapes:
      return shapes[name]
  raise ValueError(f"shape: unknown model shape {name!r}; known: {list(shape_names())}")
