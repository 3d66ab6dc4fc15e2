"""Workload registry: named corpora with train / held-out splits and seeded prompt sets.

| name    | text                                                        | predictability |
|---------|-------------------------------------------------------------|----------------|
| `math`  | generated arithmetic word problems with worked solutions    | high           |
| `code`  | CPython standard-library sources of the running interpreter | medium         |
| `prose` | Python reference topics and standard-library docstrings     | medium-low     |
| `noisy` | log records with random ids, numbers and hex fields         | low            |

Example:
  >>> from av_jax import data
  >>> tok = data.load_tokenizer("default")
  >>> p = data.prompts("code", tokenizer=tok, num=4, length=64, seed=0)  # [4, 64] int32
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterator

import numpy as np

from av_jax.data import corpora
from av_jax.data.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
  """How the corpora are built and split."""
  heldout_fraction: float = 0.1   # fraction of documents (by id hash) held out
  max_docs: int = 0               # cap on documents per workload, 0 = no cap (tiny configs cap)
  math_docs: int = 1500           # generated math documents (16 problems each)
  noisy_docs: int = 1500          # generated noisy documents (24 records each)
  seed: int = 0                   # seed of the generated corpora


@dataclasses.dataclass(frozen=True)
class Workload:
  """A named workload."""
  name: str                                                   # registry key
  description: str                                            # one line for tables
  documents: Callable[[DataConfig], Iterator[corpora.Document]]  # all documents, both splits


WORKLOADS: dict[str, Workload] = {
    "code": Workload("code", "CPython stdlib sources", lambda c: corpora.code_documents()),
    "prose": Workload("prose", "Python reference topics + stdlib docstrings",
                      lambda c: corpora.prose_documents()),
    "math": Workload("math", "generated arithmetic word problems",
                     lambda c: corpora.math_documents(num_docs=c.math_docs, seed=c.seed)),
    "noisy": Workload("noisy", "records with random ids/hex/numbers",
                      lambda c: corpora.noisy_documents(num_docs=c.noisy_docs, seed=c.seed)),
}


def list_workloads() -> tuple[str, ...]:
  """Names of the registered workloads, in a fixed order."""
  return tuple(WORKLOADS)


def get_workload(name: str) -> Workload:
  if name not in WORKLOADS:
    raise KeyError(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}")
  return WORKLOADS[name]


@functools.lru_cache(maxsize=64)
def documents(name: str, split: str, *, config: DataConfig = DataConfig()
             ) -> tuple[corpora.Document, ...]:
  """Documents of workload `name` in `split` ("train" or "heldout"), in a fixed order."""
  if split not in ("train", "heldout"):
    raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
  out = []
  for doc in get_workload(name).documents(config):
    if config.max_docs and len(out) >= config.max_docs:
      break  # documents come in a fixed order, so the cap keeps the first ones
    if corpora.split_of(doc.doc_id, heldout_fraction=config.heldout_fraction) == split:
      out.append(doc)
  return tuple(out)


_STREAMS: dict = {}


def token_stream(name: str, split: str, *, tokenizer: Tokenizer,
                 config: DataConfig = DataConfig()) -> np.ndarray:
  """All documents of a split tokenised and joined by `<|endoftext|>`: `[N]` int32 (cached)."""
  key = (name, split, id(tokenizer), config)
  if key not in _STREAMS:
    docs = documents(name, split, config=config)
    ids = tokenizer.encode_batch([d.text for d in docs])
    parts = []
    for seq in ids:
      parts.append(np.asarray(seq, np.int32))
      parts.append(np.asarray([tokenizer.eos_id], np.int32))
    _STREAMS[key] = np.concatenate(parts) if parts else np.zeros([0], np.int32)
  return _STREAMS[key]


def sample_windows(stream: np.ndarray, rng: np.random.Generator, *, num: int,
                   length: int) -> np.ndarray:
  """`num` random windows of `length` tokens from `stream`: `[num, length]` int32."""
  if len(stream) <= length:
    raise ValueError(f"stream of {len(stream)} tokens is too short for windows of {length}")
  starts = rng.integers(0, len(stream) - length, size=num)
  return np.stack([stream[s:s + length] for s in starts]).astype(np.int32)


def mixed_batch(streams: dict[str, np.ndarray], rng: np.random.Generator, *, batch: int,
                length: int) -> np.ndarray:
  """A training batch with an equal share of windows from every stream: `[batch, length]`."""
  names = sorted(streams)
  counts = [batch // len(names) + (i < batch % len(names)) for i in range(len(names))]
  rows = [sample_windows(streams[n], rng, num=c, length=length)
          for n, c in zip(names, counts) if c]
  return np.concatenate(rows)


def prompts(name: str, *, tokenizer: Tokenizer, num: int, length: int, seed: int = 0,
            split: str = "heldout", config: DataConfig = DataConfig()) -> np.ndarray:
  """A seeded, reproducible prompt set drawn from held-out text of workload `name`.

  Args:
    name: workload name (see `list_workloads()`).
    tokenizer: tokenizer the prompts are encoded with.
    num: number of prompts.
    length: tokens per prompt.
    seed: seed of the window positions.
    split: "heldout" (default) or "train" (used to collect training labels).
    config: corpus configuration.

  Returns:
    `[num, length]` int32 token ids.
  """
  stream = token_stream(name, split, tokenizer=tokenizer, config=config)
  rng = np.random.default_rng([seed, sorted(WORKLOADS).index(name)])
  return sample_windows(stream, rng, num=num, length=length)
