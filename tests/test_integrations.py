"""Serving-stack adapters on the stacks' own published test cases, plus AV's glue.

Ported cases (inputs and expected outputs re-typed from the stacks' test files; the code
here is ours):
  * tpu-inference: tests/layers/jax/sample/test_rejection_sampler.py (vllm-project/
    tpu-inference): every greedy scenario of `TestDataFactory` and `TestRejectionSampler`,
    and the non-greedy, top-k and top-p cases of `TestNonGreedyRejectionSampler` /
    `TestTopKTopPSampling`.
  * vLLM: tests/v1/sample/test_rejection_sampler.py (vllm-project/vllm): the greedy
    cases (`test_perfect_match` ... `test_parametrized_cases`).
The stacks' own test helpers build target logits of -100 with +100 at the wanted
arg-max; a case's expected output is given per request as the stack's `parse_output`
returns it (tokens that are not -1, in order, then the bonus token if set).
"""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import av_jax
from av_jax.integrations import tpu_inference, vllm
from tests.test_rejection import assert_law

V = 128   # the stacks' test vocabulary


def _logits(tokens, vocab=V):
  logits = np.full((len(tokens), vocab), -100.0, np.float32)
  logits[np.arange(len(tokens)), tokens] = 100.0
  return logits


def _metadata(do_sampling=False, B=1, temperature=1.0, top_k=-1, top_p=1.0):
  return SimpleNamespace(do_sampling=do_sampling, logprobs=False,
                         temperature=np.full((B,), temperature, np.float32),
                         top_k=np.full((B,), top_k, np.int32),
                         top_p=np.full((B,), top_p, np.float32))


def _parse(output, num_draft, num_tokens):
  """Per-request tokens of a `[T main | B bonus]` output (the stacks' parse semantics)."""
  output = np.asarray(output)
  main, bonus = output[:num_tokens], output[num_tokens:]
  result, start = [], 0
  for b, n in enumerate(num_draft):
    seq = main[start:start + n]
    seq = [int(x) for x in seq if x != -1 and x < V]
    if bonus[b] != -1 and bonus[b] < V:
      seq.append(int(bonus[b]))
    result.append(seq)
    start += n
  return result


# name: (drafts, target arg-max, num_draft_per_seq, bonus, expected per request)
TPU_GREEDY_CASES = {
    "perfect_match": ([1, 2, 3], [1, 2, 3], [3], [4], [[1, 2, 3, 4]]),
    "early_mismatch": ([1, 2, 3], [1, 5, 3], [3], [4], [[1, 5]]),
    "multiple_sequences": ([1, 2, 3, 4], [1, 2, 3, 7], [2, 2], [5, 6], [[1, 2, 5], [3, 7]]),
    "single_token_sequence": ([1], [1], [1], [2], [[1, 2]]),
    "empty_sequence": ([], [], [0], [5], [[5]]),
    "variable_length_sequences": ([1, 2, 3], [1, 5, 3], [2, 1], [6, 7], [[1, 5], [3, 7]]),
    "all_different_lengths": ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [1, 2, 3], [7, 9, 10],
                              [[1, 7], [2, 3, 9], [4, 5, 6, 10]]),
    "mixed_sequence_lengths": ([1, 2, 3, 4, 5], [1, 2, 3, 7, 5], [2, 3], [6, 8],
                               [[1, 2, 6], [3, 7]]),
    "zero_length_mixed": ([1, 2], [1, 2], [0, 2], [5, 6], [[5], [1, 2, 6]]),
    "all_zero_length": ([], [], [0, 0], [5, 6], [[5], [6]]),
    "immediate_rejection": ([1, 2, 3, 4, 5, 6], [9, 2, 3, 4, 5, 6], [3, 2, 1], [10, 11, 12],
                            [[9], [4, 5, 11], [6, 12]]),
    "first_token_mismatch": ([1], [2], [1], [3], [[2]]),
    "multiple_mismatches": ([1, 2, 3, 4, 5, 6], [1, 2, 7, 4, 8, 6], [3, 3], [8, 9],
                            [[1, 2, 7], [4, 8]]),
    "padding_test": ([1, 2], [1, 5], [2], [3], [[1, 5]]),
    "realistic_flattened": ([1, 2, 3], [1, 5, 3], [2, 1], [6, 7], [[1, 5], [3, 7]]),
    "all_immediate_mismatch": ([1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 2, 3, 11, 5, 6, 12, 8, 9],
                               [3, 3, 3], [20, 21, 22], [[10], [11], [12]]),
    "all_perfect_match": ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9], [3, 3, 3],
                          [10, 11, 12], [[1, 2, 3, 10], [4, 5, 6, 11], [7, 8, 9, 12]]),
    "extreme_length_imbalance": (
        list(range(1, 19)), list(range(1, 17)) + [20, 18], [15, 1, 2], [100, 101, 102],
        [list(range(1, 16)) + [100], [16, 101], [20]]),
    "mixed_accept_reject": ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 10, 5, 6, 7, 8, 9],
                            [3, 3, 3], [20, 21, 22], [[1, 2, 3, 20], [10], [7, 8, 9, 22]]),
    "same_position_mismatch": ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 10, 3, 4, 11, 6, 7, 12, 9],
                               [3, 3, 3], [20, 21, 22], [[1, 10], [4, 11], [7, 12]]),
    "single_long_sequence": (list(range(1, 31)), list(range(1, 28)) + [99, 29, 30], [30],
                             [100], [list(range(1, 28)) + [99]]),
}

_T_PAD, _B_PAD = 32, 4   # every case padded to one shape: one compilation for all


@pytest.fixture(scope="module")
def sampler():
  return tpu_inference.RejectionSampler(None)


def test_tpu_inference_issue_example_exact_output_layout(sampler):
  """The layout itself: drafts [1,2,3,4], num_draft [2,2], target arg-max [1,2,3,7],
  bonus [5,6] -> [1,2,3,7 | 5,-1] (vLLM's interleaved layout would be [1,2,5,3,7,-1])."""
  out = sampler(draft_token_ids=jnp.array([1, 2, 3, 4]), num_draft_tokens=jnp.array([2, 2]),
                draft_probs=None, target_logits=_logits([1, 2, 3, 7]),
                bonus_token_ids=jnp.array([5, 6]), sampling_metadata=_metadata())
  np.testing.assert_array_equal(out, [1, 2, 3, 7, 5, -1])
  accepted, labeled, rejected = tpu_inference.labels_from_output(
      out, jnp.array([2, 2]), max_draft_len=2)
  np.testing.assert_array_equal(accepted, [[True, True], [True, False]])
  np.testing.assert_array_equal(labeled, [[True, True], [True, True]])
  np.testing.assert_array_equal(rejected, [0, 1])


@pytest.mark.parametrize("name", sorted(TPU_GREEDY_CASES))
def test_tpu_inference_greedy_cases_padded(sampler, name):
  """Each case with its rows padded to T = 32 (ids -999 past the drafts, as the stack's
  padded variants) and padding requests (no drafts) up to B = 4."""
  drafts, targets, num_draft, bonus, expected = TPU_GREEDY_CASES[name]
  T, B = len(drafts), len(num_draft)
  ids = np.full(_T_PAD, -999, np.int32)
  ids[:T] = drafts
  logits = np.zeros((_T_PAD, V), np.float32)
  logits[:T] = _logits(targets) if T else logits[:0]
  counts = np.zeros(_B_PAD, np.int32)
  counts[:B] = num_draft
  bonus_ids = np.zeros(_B_PAD, np.int32)
  bonus_ids[:B] = bonus
  out = sampler.sample_with_labels(
      draft_token_ids=ids, num_draft_tokens=counts, draft_probs=None, target_logits=logits,
      bonus_token_ids=bonus_ids, sampling_metadata=_metadata())
  assert _parse(out.output_token_ids, counts, _T_PAD)[:B] == expected
  np.testing.assert_array_equal(np.asarray(out.output_token_ids)[T:_T_PAD], -1)  # padding
  # Labels from the output alone equal the sampler's own.
  accepted, labeled, rejected = tpu_inference.labels_from_output(
      out.output_token_ids, counts, max_draft_len=_T_PAD)
  want_accepted, want_labeled = tpu_inference.to_dense_labels(
      out.accepted, out.labeled, counts, max_draft_len=_T_PAD)
  np.testing.assert_array_equal(accepted, want_accepted)
  np.testing.assert_array_equal(labeled, want_labeled)
  np.testing.assert_array_equal(rejected, counts - np.asarray(out.num_accepted))
  for b in range(B):   # accepted drafts + 1 emitted (recovered or bonus) per request
    assert int(out.num_accepted[b]) + 1 == len(expected[b])


@pytest.mark.parametrize("name", ["multiple_sequences", "empty_sequence", "all_zero_length"])
def test_tpu_inference_greedy_cases_unpadded(sampler, name):
  drafts, targets, num_draft, bonus, expected = TPU_GREEDY_CASES[name]
  logits = _logits(targets) if drafts else np.zeros((0, V), np.float32)
  out = sampler(draft_token_ids=np.array(drafts, np.int32),
                num_draft_tokens=np.array(num_draft, np.int32), draft_probs=None,
                target_logits=logits, bonus_token_ids=np.array(bonus, np.int32),
                sampling_metadata=_metadata())
  assert out.shape == (len(drafts) + len(num_draft),)
  assert _parse(out, num_draft, len(drafts)) == expected


def _peaked_probs(tokens, vocab=V):
  """The stack's test drafts: softmax of -100 with +100 at the token."""
  return np.asarray(jax.nn.softmax(jnp.asarray(_logits(tokens, vocab)), axis=-1))


def _padded(sampler, drafts, counts, draft_probs, targets, bonus, meta, key, T=8, B=3):
  """One call padded to T rows and B requests (one compilation for every case)."""
  ids = np.full(T, -999, np.int32)
  ids[:len(drafts)] = drafts
  logits = np.zeros((T, V), np.float32)
  logits[:len(targets)] = _logits(targets) if targets else logits[:0]
  probs = None
  if draft_probs is not None:
    probs = np.full((T, V), 1.0 / V, np.float32)
    probs[:len(drafts)] = draft_probs
  pad = lambda x, fill: np.r_[np.asarray(x), np.full(B - len(x), fill)].astype(np.asarray(x).dtype)
  meta = SimpleNamespace(do_sampling=meta.do_sampling, logprobs=False,
                         temperature=pad(meta.temperature[:len(counts)], -1.0),
                         top_k=pad(meta.top_k[:len(counts)], 0),
                         top_p=pad(meta.top_p[:len(counts)], 1.0))
  counts_pad = pad(np.array(counts, np.int32), 0)
  out = sampler(ids, counts_pad, probs, logits, pad(np.array(bonus, np.int32), 0), meta, key=key)
  return _parse(out, counts_pad, T)[:len(counts)]


def test_tpu_inference_non_greedy_cases(sampler):
  meta = _metadata(do_sampling=True, B=3)
  # test_non_greedy_basic_functionality: the first draft matches, so it is kept.
  parsed = _padded(sampler, [10, 20, 30], [3], _peaked_probs([10, 20, 30]), [10, 50, 30], [99],
                   meta, jax.random.PRNGKey(42))
  assert parsed[0][0] == 10 and parsed == [[10, 50]]  # exact here: p(20) ~ 0, p(50) ~ 1
  # test_non_greedy_deterministic_with_seed.
  runs = [_padded(sampler, [1, 2, 3, 4], [4], _peaked_probs([1, 2, 3, 4]), [1, 5, 3, 6], [99],
                  meta, jax.random.PRNGKey(123)) for _ in range(3)]
  assert runs[0] == runs[1] == runs[2]
  # test_non_greedy_with_draft_probs_none.
  assert _padded(sampler, [15, 25], [2], None, [15, 35], [88], meta,
                 jax.random.PRNGKey(777)) == [[15, 35]]
  # test_non_greedy_multiple_sequences.
  parsed = _padded(sampler, [1, 2, 3, 4, 5, 6, 7], [2, 3, 2],
                   _peaked_probs([1, 2, 3, 4, 5, 6, 7]), [1, 5, 3, 8, 5, 6, 9], [11, 12, 13],
                   meta, jax.random.PRNGKey(456))
  assert [seq[0] for seq in parsed] == [1, 3, 6]
  # test_non_greedy_with_all_accepted_tokens / _vs_greedy_same_perfect_case.
  args = ([5, 15, 25], [3], _peaked_probs([5, 15, 25]), [5, 15, 25], [99])
  assert _padded(sampler, *args, _metadata(B=3), None) == [[5, 15, 25, 99]]
  assert _padded(sampler, *args, meta, jax.random.PRNGKey(555)) == [[5, 15, 25, 99]]
  # test_non_greedy_empty_sequence.
  assert _padded(sampler, [], [0, 0], None, [], [77, 88], meta,
                 jax.random.PRNGKey(333)) == [[77], [88]]
  # test_non_greedy_requires_key.
  with pytest.raises(ValueError, match="^key: a random key must be provided"):
    sampler([1, 2], [2], None, _logits([1, 3]), [99], _metadata(True), key=None)


def _masked_runs(sampler, target_logits, meta, B, K, vocab):
  """The stack's `_test_masked_logits`: random drafts, ten keys; main tokens returned."""
  draft_probs = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(42), (B * K, vocab)), -1)
  draft_ids = jax.random.categorical(jax.random.PRNGKey(123), jnp.log(draft_probs + 1e-8))
  outs = [np.asarray(sampler(draft_ids, np.full(B, K, np.int32), draft_probs, target_logits,
                             np.zeros(B, np.int32), meta, key=k))
          for k in jax.random.split(jax.random.PRNGKey(456), 10)]
  return np.stack(outs)[:, :B * K]   # [10, T] main rows, -1 where not emitted


@pytest.mark.parametrize("top_k", [1, 5, 99])
def test_tpu_inference_top_k_only_samples_allowed_tokens(sampler, top_k):
  vocab, B, K = 100, 10, 3
  allowed = [np.asarray(jax.random.permutation(jax.random.fold_in(jax.random.PRNGKey(42), i),
                                               vocab))[:top_k] for i in range(B * K)]
  logits = np.zeros((B * K, vocab), np.float32)
  for i, idx in enumerate(allowed):
    logits[i, idx] += 0.1
  main = _masked_runs(sampler, logits, _metadata(True, B, top_k=top_k), B, K, vocab)
  for i in range(B * K):
    tokens = main[:, i][main[:, i] != -1]
    assert np.isin(tokens, allowed[i]).all(), (i, tokens)
  assert (main != -1).sum() >= B * 10  # at least one token per request and key checked


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_tpu_inference_top_p_only_samples_the_nucleus(sampler, top_p):
  vocab, B, K = 100, 10, 3
  logits = np.asarray(jax.random.normal(jax.random.PRNGKey(42), (B * K, vocab)), np.float64)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  order = np.argsort(probs, axis=-1)                  # ascending, as the stack's test
  mass_below = np.cumsum(np.take_along_axis(probs, order, -1), -1)
  masked = mass_below <= 1 - top_p
  masked[:, -1] = False
  main = _masked_runs(sampler, logits.astype(np.float32), _metadata(True, B, top_p=top_p), B,
                      K, vocab)
  for i in range(B * K):
    tokens = main[:, i][main[:, i] != -1]
    assert np.isin(tokens, order[i][~masked[i]]).all(), (i, tokens)


def _reference_law(logits, temperature, top_k, top_p, *, temperature_first=True):
  """float64 sampled law: logits / T, top-k, top-p (or the masks before T when not
  `temperature_first`, tpu-inference's rejection sampler's order)."""
  z = np.asarray(logits, np.float64)

  def nucleus(z):
    p = np.exp(z - z.max())
    p /= p.sum()
    s = np.sort(p)[::-1]
    kept = s[(np.cumsum(s) - s) < top_p]
    return np.where(p >= kept.min(), z, -np.inf)

  def masks(z):
    z = np.where(z >= np.sort(z)[::-1][top_k - 1], z, -np.inf)
    return nucleus(z)

  z = masks(z / temperature) if temperature_first else masks(z) / temperature
  p = np.exp(z - z.max())
  return p / p.sum()


def test_tpu_inference_sampling_is_exact_for_the_sampler_law():
  """2**15 requests, 2 drafts each from a fixed q: the first emitted token follows the
  target law of temperature 1.5, top-k 6, top-p 0.6 (chi-square and TV, as
  tests/test_rejection.py). Negative control: tpu-inference's rejection sampler's order
  (masks before the temperature) is a different law, which the same test rejects."""
  vocab, n, K = 8, 2**15, 2
  rng = np.random.default_rng(0)
  target = (rng.normal(size=vocab) * 1.5).astype(np.float32)
  q = rng.dirichlet(np.ones(vocab)).astype(np.float32)
  ids = jax.random.categorical(jax.random.PRNGKey(1), jnp.log(q), shape=(n * K,))
  meta = _metadata(True, n, temperature=1.5, top_k=6, top_p=0.6)
  sampler = tpu_inference.RejectionSampler(None, max_draft_len=K)
  out = np.asarray(sampler(ids, np.full(n, K, np.int32), np.tile(q, (n * K, 1)),
                           np.tile(target, (n * K, 1)), np.zeros(n, np.int32), meta,
                           key=jax.random.PRNGKey(2)))
  first = out[:n * K].reshape(n, K)[:, 0]
  law = _reference_law(target, 1.5, 6, 0.6)
  assert_law(first, law, "tpu-inference adapter, first token")
  other = _reference_law(target, 1.5, 6, 0.6, temperature_first=False)
  assert 0.5 * np.abs(other - law).sum() > 0.2   # a nucleus of 2 tokens instead of 3
  with pytest.raises(AssertionError):
    assert_law(first, other, "masks-before-temperature law (control)")


def test_tpu_inference_greedy_request_inside_a_sampling_batch():
  """temperature < 1e-5 (and the stack's padding value -1) is greedy per request."""
  meta = _metadata(True, 2)
  meta.temperature = np.array([-1.0, 0.0], np.float32)
  sampler = tpu_inference.RejectionSampler(None)
  for seed in range(3):
    out = sampler([1, 2, 3, 4], [2, 2], _peaked_probs([1, 9, 3, 4]),
                  np.asarray(_logits([1, 2, 3, 7])) / 50.0, [5, 6], meta,
                  key=jax.random.PRNGKey(seed))
    np.testing.assert_array_equal(out, [1, 2, 3, 7, 5, -1])


def test_tpu_inference_data_parallel_blocks():
  """dp = 2: each half of the requests and rows is its own block, output
  [main_0 | bonus_0 | main_1 | bonus_1] (tpu-inference's shard_map layout)."""
  mesh = SimpleNamespace(shape={"data": 2, "model": 1})
  single = tpu_inference.RejectionSampler(None, max_draft_len=3)
  both = tpu_inference.RejectionSampler(mesh, max_draft_len=3)
  halves = [([1, 2, 3, 0], [3, 0], [1, 2, 4, 0], [7, 8]), ([4, 5, 6, 7], [1, 3], [4, 5, 6, 9],
                                                          [10, 11])]
  want = [np.asarray(single(d, c, None, _logits(t), bonus, _metadata()))
          for d, c, t, bonus in halves]
  got = both(sum((h[0] for h in halves), []), sum((h[1] for h in halves), []), None,
             _logits(sum((h[2] for h in halves), [])), sum((h[3] for h in halves), []),
             _metadata())
  np.testing.assert_array_equal(got, np.concatenate(want))
  np.testing.assert_array_equal(want[0], [1, 2, 4, -1, -1, 8])   # padding row 3 -> -1
  with pytest.raises(ValueError, match="divisible"):
    both([1, 2, 3], [1, 2], None, _logits([1, 2, 3]), [0, 0], _metadata())


def test_tpu_inference_bad_inputs_name_the_argument(sampler):
  ok = dict(draft_token_ids=np.array([1, 2]), num_draft_tokens=np.array([1, 1]),
            draft_probs=None, target_logits=_logits([1, 2]), bonus_token_ids=np.array([0, 0]),
            sampling_metadata=_metadata())
  for name, bad, pattern in [
      ("draft_token_ids", np.array([1, 2, 3]), "draft_token_ids"),
      ("bonus_token_ids", np.array([0]), "bonus_token_ids"),
      ("num_draft_tokens", np.array([2, 1]), "num_draft_tokens: expected a sum"),
      ("target_logits", np.zeros((2,), np.float32), "target_logits"),
      ("sampling_metadata", SimpleNamespace(do_sampling=np.array(True)), "sampling_metadata"),
  ]:
    with pytest.raises(ValueError, match=f"^{pattern}"):
      sampler(**{**ok, name: bad})
  with pytest.raises(ValueError, match="^sampling_metadata.top_k"):
    meta = _metadata(True, 2)
    meta.top_k = None
    sampler(**{**ok, "sampling_metadata": meta}, key=jax.random.PRNGKey(0))


# vLLM: name: (spec tokens per request, output tokens per request (drafts' arg-max then
# the bonus token), expected sampled_token_ids rows).
VLLM_GREEDY_CASES = {
    "perfect_match": ([[1, 2, 3]], [[1, 2, 3, 4]], [[1, 2, 3, 4]]),
    "early_mismatch": ([[1, 2, 3]], [[1, 5, 3, 4]], [[1, 5, -1, -1]]),
    "multiple_sequences": ([[1, 2], [3]], [[1, 2, 5], [3, 4]], [[1, 2, 5], [3, 4, -1]]),
    "single_token_sequence": ([[1]], [[1, 2]], [[1, 2]]),
    "empty_sequence": ([[]], [[5]], [[5]]),
    "multiple_mismatches": ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7, 6], [4, 8, 6, 9]],
                            [[1, 2, 7, -1], [4, 8, -1, -1]]),
    "parametrized_perfect_with_bonus": ([[1, 2]], [[1, 2, 3]], [[1, 2, 3]]),
    "parametrized_first_mismatch": ([[1]], [[2, 3]], [[2, -1]]),
    "parametrized_mixed": ([[1, 2], [3, 4]], [[1, 5, 6], [3, 4, 7]], [[1, 5, -1], [3, 4, 7]]),
}

_vllm_jit = jax.jit(vllm.rejection_sample, static_argnames="max_spec_len")


@pytest.mark.parametrize("name", sorted(VLLM_GREEDY_CASES))
def test_vllm_greedy_cases(name):
  """vLLM's layout: target rows interleaved (request b's drafts then its bonus row);
  padded to T = 8, B = 4, max_spec_len = 3 (one compilation for all cases)."""
  spec, outputs, expected = VLLM_GREEDY_CASES[name]
  T_pad, B_pad, K = 8, 4, 3
  ids = np.full(T_pad, -1, np.int32)
  flat = sum(spec, [])
  ids[:len(flat)] = flat
  counts = np.zeros(B_pad, np.int32)
  counts[:len(spec)] = [len(s) for s in spec]
  rows = sum(outputs, []) + [0] * (T_pad + B_pad - len(sum(outputs, [])))
  out = _vllm_jit(jax.random.key(0), draft_token_ids=ids, num_draft_tokens=counts,
                  max_spec_len=K, draft_probs=None,
                  target_probs=np.eye(V, dtype=np.float32)[rows])
  got = np.asarray(out.sampled_token_ids)[:len(spec)]
  want = np.full((len(spec), K + 1), -1)
  for b, row in enumerate(expected):
    want[b, :len(row)] = row
  np.testing.assert_array_equal(got, want)
  accepted, labeled = vllm.to_dense_labels(out.accepted, out.labeled, counts, max_draft_len=K)
  pos = np.arange(K)
  for b, row in enumerate(expected):
    n = sum(t != -1 for t in row) - 1       # accepted drafts: all emitted but the last
    np.testing.assert_array_equal(accepted[b], pos < n)
    np.testing.assert_array_equal(labeled[b], (pos < n) | ((pos == n) & (n < len(spec[b]))))


def test_av_plan_through_both_layouts_equals_the_dense_sampler():
  """AV's dense drafts and plan -> `pack_drafts` -> vLLM layout: the same tokens and
  labels as `av_jax.rejection_sample` on the dense batch with the same key; and the
  tpu-inference adapter gives the same labels from its own output (greedy targets)."""
  rng = np.random.default_rng(5)
  B, K, vocab = 6, 3, 5
  draft_probs = rng.dirichlet(np.ones(vocab), size=(B, K)).astype(np.float32)
  drafts = rng.integers(0, vocab, size=(B, K)).astype(np.int32)
  target = rng.dirichlet(np.ones(vocab), size=(B, K + 1)).astype(np.float32)
  num_verified = np.array([0, 3, 1, 2, 3, 0], np.int32)
  key = jax.random.key(7)
  dense = jax.jit(av_jax.rejection_sample)(key, draft_probs=draft_probs, draft_tokens=drafts,
                                           target_probs=target, num_verified=num_verified)
  ids, counts, flat_q = vllm.pack_drafts(drafts, num_verified, draft_probs=draft_probs)
  assert ids.shape == (B * K,) and flat_q.shape == (B * K, vocab)
  np.testing.assert_array_equal(counts, num_verified)
  T = ids.shape[0]
  rows = np.concatenate([target[b, :num_verified[b] + 1] for b in range(B)])
  flat_p = np.concatenate([rows, np.full((T + B - len(rows), vocab), 1.0 / vocab)])
  out = _vllm_jit(key, draft_token_ids=ids, num_draft_tokens=counts, max_spec_len=K,
                  draft_probs=flat_q, target_probs=flat_p.astype(np.float32))
  np.testing.assert_array_equal(out.sampled_token_ids, dense.tokens)
  accepted, labeled = vllm.to_dense_labels(out.accepted, out.labeled, counts, max_draft_len=K)
  np.testing.assert_array_equal(accepted, dense.accepted)
  np.testing.assert_array_equal(labeled, dense.labeled)
  # tpu-inference layout, greedy: labels from the output alone equal the exact ones.
  assert int(ids[0]) == drafts[1, 0]   # request 0 verifies nothing: request 1's drafts first
  sampler = tpu_inference.RejectionSampler(None, max_draft_len=K)
  packed = np.concatenate([target[b, :num_verified[b]] for b in range(B)])
  logits = np.log(np.concatenate([packed, np.full((T - len(packed), vocab), 1.0 / vocab)]))
  result = sampler.sample_with_labels(ids, counts, None, logits.astype(np.float32),
                                      np.arange(B, dtype=np.int32), _metadata())
  got = tpu_inference.labels_from_output(result.output_token_ids, counts, max_draft_len=K)
  want = tpu_inference.to_dense_labels(result.accepted, result.labeled, counts,
                                       max_draft_len=K)
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(got[1], want[1])
  # Greedy: accepted iff each draft is its row's arg-max, up to the first miss.
  match = drafts == np.argmax(target[:, :K], -1)
  lead = np.cumprod(match & (np.arange(K) < num_verified[:, None]), axis=1).sum(1)
  np.testing.assert_array_equal(result.num_accepted, lead)
