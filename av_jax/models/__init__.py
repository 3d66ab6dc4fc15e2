"""Small models trained offline for av_jax: a target LM and every drafter kind.

See docs/models.md for the interface contract the engine builds on.
"""

from av_jax.models.checkpoint import assets_dir
from av_jax.models.config import BlockConfig
from av_jax.models.config import EagleConfig
from av_jax.models.config import HeadTrainConfig
from av_jax.models.config import MeasureConfig
from av_jax.models.config import ModelsConfig
from av_jax.models.config import TrainConfig
from av_jax.models.config import TransformerConfig
from av_jax.models.config import config_hash
from av_jax.models.config import load_config
from av_jax.models.drafters import KINDS
from av_jax.models.drafters import DRAFTING
from av_jax.models.drafters import DraftOutput
from av_jax.models.drafters import Drafter
from av_jax.models.drafters import DrafterState
from av_jax.models.drafters import can_skip
from av_jax.models.drafters import catch_up
from av_jax.models.drafters import init_drafter_params
from av_jax.models.drafters import make_drafter
from av_jax.models.registry import ModelPair
from av_jax.models.registry import load
from av_jax.models.registry import load_summary
from av_jax.models.sampling import sample_tokens
from av_jax.models.sampling import sampling_probs
from av_jax.models.transformer import ForwardOutput
from av_jax.models.transformer import KVCache
from av_jax.models.transformer import embedding
from av_jax.models.transformer import forward
from av_jax.models.transformer import forward_packed
from av_jax.models.transformer import init_cache
from av_jax.models.transformer import init_params

__all__ = (
    "BlockConfig",
    "DraftOutput",
    "Drafter",
    "DrafterState",
    "EagleConfig",
    "ForwardOutput",
    "HeadTrainConfig",
    "KINDS",
    "KVCache",
    "DRAFTING",
    "MeasureConfig",
    "ModelPair",
    "ModelsConfig",
    "TrainConfig",
    "TransformerConfig",
    "assets_dir",
    "can_skip",
    "catch_up",
    "config_hash",
    "embedding",
    "forward",
    "forward_packed",
    "init_cache",
    "init_drafter_params",
    "init_params",
    "load",
    "load_config",
    "load_summary",
    "make_drafter",
    "sample_tokens",
    "sampling_probs",
)
