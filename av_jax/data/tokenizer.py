"""Byte-level BPE tokenizer trained locally with the `tokenizers` library.

The vocabulary holds the 256 byte symbols, one special `<|endoftext|>` token (id 0) and BPE
merges learnt from the training mix. `decode_bytes` maps ids straight to their bytes, so
decoding round-trips any text exactly (`decode_bytes(encode(s)) == s.encode()`).
"""

from __future__ import annotations

import functools
import importlib.resources
from typing import Iterable, Sequence

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
  """Inverse of GPT-2's byte -> printable-unicode table used by the ByteLevel pre-tokenizer."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
      range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return {chr(c): b for b, c in zip(bs, cs)}


class Tokenizer:
  """A trained byte-level BPE tokenizer.

  Example:
    >>> tok = load_tokenizer("default")
    >>> tok.decode(tok.encode("x = 1"))
    'x = 1'
  """

  def __init__(self, inner: tokenizers.Tokenizer):
    self.inner = inner
    self.eos_id = inner.token_to_id(EOS)
    table = _unicode_to_byte()
    vocab = inner.get_vocab()
    self._bytes = [b""] * inner.get_vocab_size()
    for piece, idx in vocab.items():
      self._bytes[idx] = b"" if piece == EOS else bytes(table[ch] for ch in piece)

  @property
  def vocab_size(self) -> int:
    return self.inner.get_vocab_size()

  def encode(self, text: str) -> list[int]:
    return self.inner.encode(text).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self.inner.encode_batch(list(texts))]

  def byte_lengths(self) -> np.ndarray:
    """`[V]` int32: bytes of text each token stands for (0 for `<|endoftext|>`)."""
    return np.asarray([len(b) for b in self._bytes], np.int32)

  def decode_bytes(self, ids: Iterable[int]) -> bytes:
    """Exact bytes of `ids` (the special token decodes to nothing; -1 padding is skipped)."""
    return b"".join(self._bytes[int(i)] for i in np.asarray(ids).ravel() if int(i) >= 0)

  def decode(self, ids: Iterable[int]) -> str:
    return self.decode_bytes(ids).decode("utf-8", errors="replace")

  def to_json(self) -> str:
    return self.inner.to_str()

  def save(self, path: str) -> None:
    self.inner.save(path)


def train_tokenizer(texts: Iterable[str], *, vocab_size: int) -> Tokenizer:
  """Trains a byte-level BPE on `texts` (deterministic for a given input order).

  Args:
    texts: training texts.
    vocab_size: total vocabulary size including the 256 bytes and `<|endoftext|>`.

  Returns:
    The trained `Tokenizer`.
  """
  if vocab_size < 257:
    raise ValueError(f"vocab_size must be >= 257 (bytes + special), got {vocab_size}")
  inner = tokenizers.Tokenizer(models.BPE())
  inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  inner.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
  inner.train_from_iterator(texts, trainer=trainer)
  return Tokenizer(inner)


def from_json(text: str) -> Tokenizer:
  return Tokenizer(tokenizers.Tokenizer.from_str(text))


@functools.lru_cache(maxsize=8)
def load_tokenizer(name: str = "default") -> Tokenizer:
  """Loads the shipped tokenizer `av_jax/assets/tokenizer_{name}.json`."""
  res = importlib.resources.files("av_jax.assets").joinpath(f"tokenizer_{name}.json")
  if not res.is_file():
    raise FileNotFoundError(
        f"no shipped tokenizer {name!r}; retrain with `python benchmarks/train_models.py "
        f"--config {name}`")
  return from_json(res.read_text(encoding="utf-8"))
