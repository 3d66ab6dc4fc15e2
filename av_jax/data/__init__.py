"""Offline corpora, workload registry and tokenizer."""

from av_jax.data.corpora import Document
from av_jax.data.tokenizer import Tokenizer
from av_jax.data.tokenizer import load_tokenizer
from av_jax.data.tokenizer import train_tokenizer
from av_jax.data.workloads import DataConfig
from av_jax.data.workloads import WORKLOADS
from av_jax.data.workloads import Workload
from av_jax.data.workloads import documents
from av_jax.data.workloads import get_workload
from av_jax.data.workloads import list_workloads
from av_jax.data.workloads import mixed_batch
from av_jax.data.workloads import prompts
from av_jax.data.workloads import sample_windows
from av_jax.data.workloads import token_stream

__all__ = (
    "DataConfig",
    "Document",
    "Tokenizer",
    "WORKLOADS",
    "Workload",
    "documents",
    "get_workload",
    "list_workloads",
    "load_tokenizer",
    "mixed_batch",
    "prompts",
    "sample_windows",
    "token_stream",
    "train_tokenizer",
)
