"""Log-probabilities of emitted tokens: the samplers and both adapters against a direct
log-softmax of the target law at the emitted positions (accepted, recovered and bonus
tokens, greedy and sampled), the placeholders' fill, bad input, and the unchanged program
when they are off."""

import collections
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from av_jax import rejection
from av_jax.integrations import tpu_inference as tpu
from av_jax.integrations import vllm
from av_jax.rejection import rejection_sample, rejection_sample_ragged

B, K, V = 48, 4, 12


def _problem(seed, *, sharp=1.5):
  """Draft and target laws close enough that accepts, recoveries and bonuses all occur."""
  k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
  base = sharp * jax.random.normal(k1, (B, K + 1, V))
  target_logits = base + 0.7 * jax.random.normal(k2, (B, K + 1, V))
  draft_probs = jax.nn.softmax(base[:, :K], axis=-1)
  draft_tokens = jax.random.categorical(k3, jnp.log(draft_probs)).astype(jnp.int32)
  num_verified = jax.random.randint(k4, (B,), 0, K + 1)
  return draft_probs, draft_tokens, target_logits, num_verified


def _kinds(tokens, num_accepted, num_verified):
  """`[B, K+1]` masks of accepted, recovered and bonus positions."""
  pos = np.arange(K + 1)[None, :]
  a, n = np.asarray(num_accepted)[:, None], np.asarray(num_verified)[:, None]
  return pos < a, (pos == a) & (a < n), (pos == a) & (a == n)


def _check_against(lp, tokens, law, *, top, ranks=True):
  """`lp` (LogprobsTensors, rows like `tokens`) equals the direct reading of `law`
  (log-probabilities, rows like `tokens`, `[..., V]`) where a token was emitted, and the
  fill elsewhere."""
  tokens, law = np.asarray(tokens), np.asarray(law, np.float64)
  ids, values = np.asarray(lp.logprob_token_ids), np.asarray(lp.logprobs)
  emitted = tokens >= 0
  assert ids.shape == tokens.shape + (1 + top,)
  np.testing.assert_array_equal(ids[..., 0], tokens)
  direct = np.take_along_axis(law, np.clip(tokens, 0, V - 1)[..., None], -1)[..., 0]
  np.testing.assert_allclose(values[..., 0][emitted], direct[emitted], rtol=1e-5, atol=1e-5)
  if top:
    order = np.sort(law, axis=-1)[..., ::-1][..., :top]
    np.testing.assert_allclose(values[..., 1:][emitted], order[emitted], rtol=1e-5, atol=1e-5)
    picked = np.take_along_axis(law, ids[..., 1:].clip(0), -1)
    np.testing.assert_allclose(picked[emitted], order[emitted], rtol=1e-5, atol=1e-5)
  if ranks:
    expected = (law >= direct[..., None] - 1e-6).sum(-1)
    np.testing.assert_array_equal(np.asarray(lp.selected_token_ranks)[emitted],
                                  expected[emitted])
    assert np.all(np.asarray(lp.selected_token_ranks)[~emitted] == -1)
  assert np.all(ids[~emitted] == -1)
  assert np.all(np.isnan(values[~emitted]))


@pytest.mark.parametrize("jit", [False, True])
def test_dense_sampled_logprobs_equal_log_softmax_of_target(jit):
  q, x, logits, n = _problem(0)
  p = jax.nn.softmax(logits, axis=-1)
  fn = lambda key: rejection_sample(key, draft_probs=q, draft_tokens=x, target_probs=p,
                                    num_verified=n, logprobs=3, logprob_ranks=True)
  out = (jax.jit(fn) if jit else fn)(jax.random.key(1))
  accepted, recovered, bonus = _kinds(out.tokens, out.num_accepted, n)
  # The batch exercises every kind of emitted token.
  assert accepted.sum() > 5 and recovered.sum() > 5 and bonus.sum() > 5
  _check_against(out.logprobs, out.tokens, jax.nn.log_softmax(logits, axis=-1), top=3)


def test_dense_greedy_logprobs_are_those_of_the_one_hot_law():
  q, x, logits, n = _problem(2)
  one_hot = jax.nn.one_hot(jnp.argmax(logits, -1), V)
  # Greedy drafts: the draft is its own arg-max (a point mass).
  x = jnp.argmax(jnp.log(q), -1).astype(jnp.int32)
  out = rejection_sample(jax.random.key(3), draft_probs=jax.nn.one_hot(x, V), draft_tokens=x,
                         target_probs=one_hot, num_verified=n, logprobs=1, logprob_ranks=True)
  accepted, recovered, bonus = _kinds(out.tokens, out.num_accepted, n)
  assert accepted.sum() > 0 and recovered.sum() > 5 and bonus.sum() > 5
  emitted = np.asarray(out.tokens) >= 0
  # Every emitted token is the arg-max: log 1 = 0, rank 1; the top-1 is itself.
  np.testing.assert_array_equal(np.asarray(out.logprobs.logprobs)[emitted], 0.0)
  np.testing.assert_array_equal(np.asarray(out.logprobs.selected_token_ranks)[emitted], 1)
  with np.errstate(divide="ignore"):
    _check_against(out.logprobs, out.tokens, np.log(np.asarray(one_hot)), top=1)


def test_ragged_logprobs_follow_the_target_rows_layout():
  q, x, logits, n = _problem(4)
  counts = np.asarray(n)
  T = int(counts.sum())
  starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
  flat_q = np.concatenate([np.asarray(q)[b, :c] for b, c in enumerate(counts)])
  flat_x = np.concatenate([np.asarray(x)[b, :c] for b, c in enumerate(counts)])
  rows = np.concatenate([np.asarray(logits)[b, :c + 1] for b, c in enumerate(counts)])
  out = rejection_sample_ragged(jax.random.key(5), draft_probs=flat_q, draft_tokens=flat_x,
                                num_draft_tokens=n, target_probs=jax.nn.softmax(rows, -1),
                                max_draft_len=K, logprobs=2, logprob_ranks=True)
  assert out.logprobs.logprobs.shape == (T + B, 3)
  _check_against(out.logprobs, out.tokens, jax.nn.log_softmax(jnp.asarray(rows), -1), top=2)
  # Bonus rows (a request's last row) carry a token whenever it accepted everything.
  last = starts + np.arange(B) + counts
  bonus = np.asarray(out.num_accepted) == counts
  assert bonus.sum() > 5
  assert np.all(np.isfinite(np.asarray(out.logprobs.logprobs)[last[bonus], 0]))


def test_vllm_adapter_logprobs_on_the_flattened_output_rows():
  q, x, logits, n = _problem(6)
  counts = np.asarray(n)
  flat_q = np.concatenate([np.asarray(q)[b, :c] for b, c in enumerate(counts)])
  flat_x = np.concatenate([np.asarray(x)[b, :c] for b, c in enumerate(counts)])
  rows = np.concatenate([np.asarray(logits)[b, :c + 1] for b, c in enumerate(counts)]) / 0.7
  out = vllm.rejection_sample(jax.random.key(7), draft_token_ids=flat_x, num_draft_tokens=n,
                              max_spec_len=K, draft_probs=flat_q,
                              target_probs=jax.nn.softmax(rows, -1), logprobs=2)
  sampled = np.asarray(out.sampled_token_ids)
  # Request b's row i reads the law at its i-th target row.
  law = np.full((B, K + 1, V), np.nan)
  starts = np.concatenate([[0], np.cumsum(counts)[:-1]]) + np.arange(B)
  log_rows = np.asarray(jax.nn.log_softmax(jnp.asarray(rows), -1))
  for b in range(B):
    law[b, :counts[b] + 1] = log_rows[starts[b]:starts[b] + counts[b] + 1]
  lp = out.logprobs_tensors
  assert lp.logprobs.shape == (B * (K + 1), 3)
  _check_against(jax.tree.map(lambda a: np.asarray(a).reshape((B, K + 1) + a.shape[1:]), lp),
                 sampled, np.nan_to_num(law, nan=0.0), top=2)
  assert vllm.rejection_sample(jax.random.key(7), draft_token_ids=flat_x, num_draft_tokens=n,
                               max_spec_len=K, draft_probs=flat_q,
                               target_probs=jax.nn.softmax(rows, -1)).logprobs_tensors is None


def _tpu_case(seed, counts):
  k1, k2 = jax.random.split(jax.random.key(seed))
  T = int(sum(counts))
  logits = 1.5 * jax.random.normal(k1, (T, V))
  greedy_ids = np.asarray(jnp.argmax(logits, -1))
  # Half the drafts are the arg-max (accepted greedily), the rest another id.
  other = (greedy_ids + 1 + np.asarray(jax.random.randint(k2, (T,), 0, V - 1))) % V
  ids = np.where(np.arange(T) % 3 != 2, greedy_ids, other).astype(np.int32)
  return logits, jnp.asarray(ids), jnp.asarray(counts, jnp.int32)


def _topk_topp_reference(logits, temperature, top_k, top_p):
  """The sampled law written directly (NumPy, sorts): logits / T, top-k, top-p."""
  out = []
  for row, t, k, p in zip(np.asarray(logits, np.float64), temperature, top_k, top_p):
    z = row / t
    if 0 < k < len(z):
      z = np.where(z < np.sort(z)[::-1][k - 1], -np.inf, z)
    lp = z - np.logaddexp.reduce(z)
    probs = np.exp(lp)
    order = np.sort(probs)[::-1]
    exclusive = np.cumsum(order) - order
    threshold = order[exclusive < p].min() if p < 1 else 0.0
    z = np.where(probs >= threshold, z, -np.inf)
    out.append(z - np.logaddexp.reduce(z))
  return np.stack(out)


@pytest.mark.parametrize("do_sampling", [False, True])
def test_tpu_adapter_logprobs_in_the_output_rows(do_sampling):
  counts = [3, 0, 4, 2, 4, 1]
  logits, ids, n = _tpu_case(8, counts)
  Bn, T = len(counts), int(sum(counts))
  bonus_ids = jnp.arange(Bn, dtype=jnp.int32)
  temperature = np.array([0.7, 1.0, 1.3, 0.0, 0.9, 1.0], np.float32)
  top_k = np.array([0, 5, 0, 0, 3, 0], np.int32)
  top_p = np.array([1.0, 1.0, 0.8, 1.0, 0.9, 1.0], np.float32)
  md = types.SimpleNamespace(do_sampling=do_sampling, logprobs=True, temperature=temperature,
                             top_k=top_k, top_p=top_p)
  sampler = tpu.RejectionSampler(None, max_draft_len=4)
  out = sampler.sample_with_labels(ids, n, None, logits, bonus_ids, md,
                                   key=jax.random.key(9), num_logprobs=2)
  row_request = np.repeat(np.arange(Bn), counts)
  if do_sampling:
    greedy = temperature[row_request] < tpu.GREEDY_TEMPERATURE_EPS
    law = np.where(greedy[:, None], np.asarray(jax.nn.log_softmax(logits, -1)),
                   _topk_topp_reference(logits, np.where(greedy, 1.0,
                                                         temperature[row_request]),
                                        top_k[row_request], top_p[row_request]))
  else:
    law = np.asarray(jax.nn.log_softmax(logits, -1))  # greedy: the raw logits' law
  tokens = np.asarray(out.output_token_ids)
  main = tokens[:T]
  assert (main >= 0).sum() > 5
  _check_against(jax.tree.map(lambda a: np.asarray(a)[:T], out.logprobs), main, law, top=2)
  # Bonus rows: drawn by the stack's sampler, so placeholders here.
  assert np.all(np.isnan(np.asarray(out.logprobs.logprobs)[T:]))
  assert np.all(np.asarray(out.logprobs.logprob_token_ids)[T:] == -1)
  # Off (the flag False): no log-probabilities, the same tokens.
  md.logprobs = False
  off = sampler.sample_with_labels(ids, n, None, logits, bonus_ids, md, key=jax.random.key(9))
  assert off.logprobs is None
  np.testing.assert_array_equal(np.asarray(off.output_token_ids), tokens)


def test_top_n_larger_than_the_vocabulary_is_refused_naming_the_argument():
  q, x, logits, n = _problem(10)
  p = jax.nn.softmax(logits, -1)
  with pytest.raises(ValueError, match=r"logprobs: .*\[0, V=12\].*got 13"):
    rejection_sample(jax.random.key(0), draft_probs=q, draft_tokens=x, target_probs=p,
                     num_verified=n, logprobs=V + 1)
  with pytest.raises(ValueError, match="logprobs: expected None"):
    rejection_sample(jax.random.key(0), draft_probs=q, draft_tokens=x, target_probs=p,
                     num_verified=n, logprobs=True)
  with pytest.raises(ValueError, match=r"logprobs: .*got -1"):
    rejection_sample_ragged(jax.random.key(0), draft_probs=q[0], draft_tokens=x[0],
                            num_draft_tokens=jnp.array([K]), target_probs=p[0],
                            max_draft_len=K, logprobs=-1)
  with pytest.raises(ValueError, match=r"logprobs: .*V=12"):
    vllm.rejection_sample(jax.random.key(0), draft_token_ids=x[0], num_draft_tokens=[K],
                          max_spec_len=K, draft_probs=None, target_probs=p[0], logprobs=99)
  logits_t, ids, counts = _tpu_case(0, [2, 2])
  md = types.SimpleNamespace(do_sampling=False, logprobs=True)
  with pytest.raises(ValueError, match=r"num_logprobs: .*V=12.*got 20"):
    tpu.RejectionSampler(None).sample_with_labels(ids, counts, None, logits_t,
                                                  jnp.array([0, 0]), md, num_logprobs=20)


def _op_counts(lowered) -> collections.Counter:
  """Operations of a lowered program by name (StableHLO text)."""
  return collections.Counter(re.findall(r"\b(?:stablehlo|chlo|mhlo)\.[a-z_]+",
                                        lowered.as_text()))


def test_logprobs_off_compiles_the_program_without_the_feature():
  q, x, logits, n = _problem(11)
  p = jax.nn.softmax(logits, -1)
  args = (jax.random.key(0), q, x, p, n)

  def sampler(**options):
    return jax.jit(lambda key, q, x, p, n: rejection_sample(
        key, draft_probs=q, draft_tokens=x, target_probs=p, num_verified=n, **options))

  # The reference: the verification alone, as the module builds it without the feature.
  reference = jax.jit(lambda key, q, x, p, n: rejection._rejection_sample(
      key, draft_probs=q, draft_tokens=x, target_probs=p, num_verified=n))
  off = _op_counts(sampler().lower(*args))
  assert off == _op_counts(reference.lower(*args))
  assert off == _op_counts(sampler(logprobs=None, logprob_ranks=True).lower(*args))
  # The check sees the feature: with it on, the program grows.
  on = _op_counts(sampler(logprobs=0).lower(*args))
  assert sum(on.values()) > sum(off.values())
  assert sum(_op_counts(sampler(logprobs=2, logprob_ranks=True).lower(*args)).values()) > sum(
      on.values())
