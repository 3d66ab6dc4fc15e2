"""Batched speculative-decoding engine with Adaptive Verification (see `core`)."""

from av_jax.arms import ARMS
from av_jax.engine.config import EngineConfig
from av_jax.engine.config import Programs
from av_jax.engine.core import DecodeState
from av_jax.engine.core import Engine
from av_jax.engine.core import EngineStats
from av_jax.engine.core import Params
from av_jax.engine.core import StepInfo
from av_jax.engine.core import default_cost
from av_jax.engine.core import init_state
from av_jax.engine.core import make_engine
from av_jax.engine.core import prefill
from av_jax.engine.core import run_chunk
from av_jax.engine.core import step
from av_jax.engine.protocols import Target
from av_jax.engine.protocols import TargetOutput
from av_jax.engine.protocols import transformer_target
from av_jax.engine.batching import Completion
from av_jax.engine.batching import GenerateResult
from av_jax.engine.batching import generate

__all__ = (
    "ARMS",
    "Completion",
    "DecodeState",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "GenerateResult",
    "Params",
    "Programs",
    "StepInfo",
    "Target",
    "TargetOutput",
    "default_cost",
    "generate",
    "init_state",
    "make_engine",
    "prefill",
    "run_chunk",
    "step",
    "transformer_target",
)
