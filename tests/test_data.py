"""Tests of the offline corpora and the workload registry."""

import re
import zlib

import numpy as np
import pytest

from av_jax import data
from av_jax.data import corpora

SMALL = data.DataConfig(max_docs=6, math_docs=60, noisy_docs=60)


def test_registry_names():
  assert data.list_workloads() == ("code", "prose", "math", "noisy")
  with pytest.raises(KeyError):
    data.get_workload("poetry")


@pytest.mark.parametrize("name", ["code", "prose", "math", "noisy"])
def test_splits_are_disjoint_deterministic_and_nonempty(name):
  train = data.documents(name, "train", config=SMALL)
  held = data.documents(name, "heldout", config=SMALL)
  assert train and held
  assert not {d.doc_id for d in train} & {d.doc_id for d in held}
  # Deterministic: regenerating (bypassing the cache) gives the same documents.
  again = [d for d in data.get_workload(name).documents(SMALL)
           if corpora.split_of(d.doc_id, heldout_fraction=SMALL.heldout_fraction) == "heldout"]
  assert list(held) == again[:len(held)]


def test_split_fraction_is_close_to_config():
  ids = [f"doc/{i}" for i in range(4000)]
  frac = np.mean([corpora.split_of(i, heldout_fraction=0.1) == "heldout" for i in ids])
  assert abs(frac - 0.1) < 4 * np.sqrt(0.1 * 0.9 / len(ids))


def test_code_and_prose_of_a_module_share_a_split():
  code_ids = {d.doc_id for d in data.documents("code", "heldout", config=SMALL)}
  for doc in data.documents("prose", "train", config=SMALL):
    assert doc.doc_id not in code_ids


def test_math_solutions_are_correct():
  for doc in data.documents("math", "train", config=SMALL)[:3]:
    for a, op, b, c in re.findall(r"(\d+) ([-+*]) (\d+) = (\d+)", doc.text):
      assert eval(f"{a} {op} {b}") == int(c)  # pylint: disable=eval-used
    for total, groups, per, left in re.findall(
        r"(\d+) / (\d+) = (\d+) remainder (\d+)", doc.text):
      assert divmod(int(total), int(groups)) == (int(per), int(left))


def test_workloads_differ_in_predictability():
  # Compression ratio is a model-free proxy of entropy: math < code < noisy.
  def ratio(name):
    text = "".join(d.text for d in data.documents(name, "heldout", config=SMALL)).encode()
    return len(zlib.compress(text[:60000], 9)) / len(text[:60000])
  r = {n: ratio(n) for n in ("math", "code", "noisy")}
  assert r["math"] < r["code"] < r["noisy"], r


@pytest.fixture(scope="module")
def small_tokenizer():
  texts = [d.text for n in data.list_workloads() for d in data.documents(n, "train",
                                                                          config=SMALL)]
  return data.train_tokenizer(texts, vocab_size=400)


def test_prompts_are_seeded_and_from_heldout_text(small_tokenizer):
  tok = small_tokenizer
  a = data.prompts("code", tokenizer=tok, num=5, length=24, seed=3, config=SMALL)
  b = data.prompts("code", tokenizer=tok, num=5, length=24, seed=3, config=SMALL)
  c = data.prompts("code", tokenizer=tok, num=5, length=24, seed=4, config=SMALL)
  assert a.shape == (5, 24) and a.dtype == np.int32
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  held = "\x00".join(d.text for d in data.documents("code", "heldout", config=SMALL))
  train = "\x00".join(d.text for d in data.documents("code", "train", config=SMALL))
  for row in a:
    text = tok.decode(row)
    if tok.eos_id not in row:  # a window may straddle two documents
      assert text in held and text not in train


def test_mixed_batch_has_equal_shares(small_tokenizer):
  streams = {n: data.token_stream(n, "train", tokenizer=small_tokenizer, config=SMALL)
             for n in data.list_workloads()}
  batch = data.mixed_batch(streams, np.random.default_rng(0), batch=8, length=16)
  assert batch.shape == (8, 16)
  # Rows come in sorted-name order, two per workload; each row is a window of its stream.
  for i, name in enumerate(sorted(streams)):
    for row in batch[2 * i:2 * i + 2]:
      s = streams[name]
      starts = np.nonzero(s[:len(s) - 15] == row[0])[0]
      assert any(np.array_equal(s[j:j + 16], row) for j in starts)
