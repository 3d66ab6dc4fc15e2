"""Tests of the byte-level BPE tokenizer."""

import random

import pytest

from av_jax import data

TEXTS = ["def f(x):\n    return x + 1\n", "The quick brown fox jumps over the lazy dog.",
         "Answer: 42\n", "id=deadbeef01 user=u12345 amount=12.50\n"] * 20


@pytest.fixture(scope="module")
def tok():
  return data.train_tokenizer(TEXTS, vocab_size=300)


def test_vocab_and_special(tok):
  assert 257 <= tok.vocab_size <= 300
  assert tok.eos_id == 0
  assert tok.decode_bytes([tok.eos_id]) == b""


@pytest.mark.parametrize("text", [
    "", " ", "  leading and trailing  ", "\t\ttabs\n\r\nnewlines\n",
    "unicode: héllo wörld ☃ 日本語 🙂", "def f(x):\n    return x ** 2  # comment\n",
    "\x00\x01 control \x7f chars",
])
def test_round_trip_exact(tok, text):
  ids = tok.encode(text)
  assert tok.decode_bytes(ids) == text.encode("utf-8")
  assert tok.decode(ids) == text


def test_round_trip_random_strings(tok):
  rng = random.Random(0)
  alphabet = [chr(c) for c in range(32, 127)] + ["é", "ß", "→", "中", "\n", "\t", "🙂"]
  for _ in range(200):
    s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    assert tok.decode_bytes(tok.encode(s)) == s.encode()


def test_merges_compress(tok):
  # 43 merges learnt from four repeated lines already save over a third of the tokens.
  for text in TEXTS[:4]:
    assert len(tok.encode(text * 3)) < 0.66 * len((text * 3).encode())


def test_decode_skips_padding(tok):
  ids = tok.encode("abc")
  assert tok.decode_bytes(list(ids) + [-1, -1]) == b"abc"


def test_training_is_deterministic():
  a = data.train_tokenizer(TEXTS, vocab_size=300)
  b = data.train_tokenizer(TEXTS, vocab_size=300)
  assert a.to_json() == b.to_json()


def test_shipped_default_tokenizer_round_trips_stdlib():
  tok = data.load_tokenizer("default")
  assert tok.vocab_size == 4096
  doc = data.documents("code", "heldout")[0].text
  ids = tok.encode(doc)
  assert tok.decode_bytes(ids) == doc.encode()
  assert len(ids) < len(doc.encode()) / 2.5  # BPE learnt useful merges for code
  with pytest.raises(FileNotFoundError):
    data.load_tokenizer("no-such-set")
