"""Adaptive Verification behind tpu-inference's `RejectionSampler` interface.

tpu-inference (vllm-project/tpu-inference, `tpu_inference/layers/jax/sample/
rejection_sampler.py`) calls its sampler as

    sampler = RejectionSampler(mesh)
    output = sampler(draft_token_ids [T], num_draft_tokens [B], draft_probs [T, V] or None,
                     target_logits [T, V], bonus_token_ids [B], sampling_metadata, key)

with T target rows (one per draft; the bonus tokens are sampled outside) and returns
`[T main | B bonus]`: main row t is the draft if accepted, the recovered token at the
first rejection, else -1; bonus b is `bonus_token_ids[b]` when request b accepted all
its drafts (or had none), else -1. With a data-parallel mesh (axes in `DATA_AXES`, size
dp > 1) the inputs are split into dp equal blocks of requests and rows and the output is
`[main_0 | bonus_0 | main_1 | bonus_1 ...]`, as tpu-inference's `shard_map` lays it out.
`RejectionSampler` here is a drop-in with that argument order and output layout; its
sampling is AV's exact speculative sampler (`av_jax.rejection_sample`).

Sampling conventions (`sampling_metadata`: any object with fields `do_sampling`,
`temperature [B]`, `top_k [B]`, `top_p [B]`, `logprobs`):
  * `do_sampling` False: greedy for every request, as tpu-inference: a draft is accepted
    iff it is the arg-max of its target logits (first index on ties), the recovered
    token is that arg-max; `draft_probs`, `key` and the other fields are not read.
  * `do_sampling` True: per request, the target law is the one tpu-inference's own
    non-speculative sampler (`sampling.sample`) draws from: logits / temperature, then
    top-k (k > 0; ties with the k-th value kept), then top-p (p < 1; the smallest set of
    mass >= p, ties kept) - the same order and conventions as vLLM. A request with
    temperature < 1e-5 (tpu-inference pads with -1) is greedy, again as its sampler.
    tpu-inference's rejection sampler instead masks top-k/top-p before the temperature
    and divides by `temperature + 1e-9`; the two differ only when top-k/top-p are on and
    the temperature is not 1, and this adapter keeps speculative decoding exact with
    respect to the non-speculative sampler. `draft_probs=None` (n-gram drafts) treats
    each draft as a point mass (accept with probability p(x), recover from p without x),
    as tpu-inference does. `key` is required, as there.
  * `logprobs` True (tpu-inference's flag for requests that asked for log-probabilities):
    `sample_with_labels` also returns `logprobs`, tpu-inference's `LogprobsTensors`
    triple in the output's `[T + B]` rows: column 0 the emitted token with its
    log-probability, then the top `num_logprobs` ids of its row, and the emitted token's
    rank. The law is the one the row was verified against, in vLLM's
    `processed_logprobs` sense: a sampled request's processed logits (temperature, top-k,
    top-p; filtered ids -inf), a greedy request's raw logits (greedy applies no
    transform), log-softmaxed. Placeholders, and the bonus rows (the bonus token was drawn
    by the stack's own sampler from logits this sampler never sees, so its log-probability
    comes from there), read ids -1, log-probabilities NaN and rank -1. False or absent:
    nothing is computed and the program is the one without log-probabilities.
Rows past `sum(num_draft_tokens)` (padding) are -1 in the main output; tpu-inference
would count them as further drafts of the last request, so callers pass T equal to the
sum or ignore those rows (its `parse_output` does).

AV glue: `pack_drafts` turns AV's plan (`draft_tokens [B, K]`, `Plan.num_verified [B]`)
into `draft_token_ids` / `num_draft_tokens`; `labels_from_output` recovers the
estimator's `[B, K]` labels (and `num_rejected_tokens`) from the output alone, and
`RejectionSampler.sample_with_labels` returns the exact labels alongside the output.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from av_jax import _checks
from av_jax.sampling import sampling_log_probs
from av_jax.integrations._layout import (check_counts, mask_labels, pack_drafts, ragged_index,
                                         to_dense_labels, to_flat)
from av_jax.rejection import LogprobsTensors, check_num_logprobs, gather_logprobs, rejection_sample

__all__ = ["DATA_AXES", "GREEDY_TEMPERATURE_EPS", "LogprobsTensors", "PLACEHOLDER_TOKEN_ID",
           "RejectionSampler", "TpuRejectionOutput", "labels_from_output", "pack_drafts",
           "to_dense_labels"]

PLACEHOLDER_TOKEN_ID = -1
# Requests with a temperature below this are greedy (tpu-inference's `_SAMPLING_EPS`).
GREEDY_TEMPERATURE_EPS = 1e-5
# Mesh axes tpu-inference shards the sampler's requests over (its `ATTN_DATA`).
DATA_AXES = ("data", "pcp", "attn_dp", "attn_dp_expert")


class TpuRejectionOutput(NamedTuple):
  """tpu-inference's output plus AV's labels (`RejectionSampler.sample_with_labels`)."""
  output_token_ids: jax.Array  # [T + B] int32, [main | bonus] per data-parallel block
  num_accepted: jax.Array      # [B] int32, accepted drafts per request
  accepted: jax.Array          # [T] bool, flat draft accepted
  labeled: jax.Array           # [T] bool, flat draft has an estimator label
  logprobs: LogprobsTensors | None = None  # [T + B, ...] rows of the output; None unless asked


def _data_parallel_size(mesh) -> int:
  if mesh is None:
    return 1
  shape = dict(mesh.shape)
  return math.prod(shape.get(axis, 1) for axis in DATA_AXES)


def _sampled_log_probs(logits, greedy, temperature, top_k, top_p):
  """Per-row log-probabilities of the sampled law: logits / temperature, top-k, then top-p
  (see the module docstring); greedy rows are scaled by 1 (their law is set elsewhere)."""
  V = logits.shape[-1]
  scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
  kth = jnp.take_along_axis(-jnp.sort(-scaled, axis=-1),
                            jnp.clip(top_k - 1, 0, V - 1)[:, None], axis=-1)
  use_k = ((top_k > 0) & (top_k < V))[:, None]
  scaled = jnp.where(use_k & (scaled < kth), -jnp.inf, scaled)
  return sampling_log_probs(scaled, top_p=top_p)


def _target_probs(logits, greedy, temperature, top_k, top_p):
  """Per-row target law: greedy rows one-hot at the arg-max of the raw logits; others
  logits / temperature, top-k, then top-p (see the module docstring)."""
  V = logits.shape[-1]
  one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), V, dtype=jnp.float32)
  probs = jnp.exp(_sampled_log_probs(logits, greedy, temperature, top_k, top_p))
  return jnp.where(greedy[:, None], one_hot, probs)


def _row_requests(num_draft_tokens, dp, t):
  """`[T]` request owning each flat row (rows are in request order within each block;
  block r holds requests r*b ... r*b + b - 1); padding rows get the block's last one."""
  counts = jnp.clip(num_draft_tokens, 0, None).reshape(dp, -1)
  b = counts.shape[1]
  local = jax.vmap(lambda c: jnp.repeat(jnp.arange(b), c, total_repeat_length=t))(counts)
  return (local + b * jnp.arange(dp)[:, None]).reshape(-1)


@functools.partial(jax.jit, static_argnames=("do_sampling", "dp", "max_draft_len",
                                             "num_logprobs"))
def _forward(draft_token_ids, num_draft_tokens, draft_probs, target_logits, bonus_token_ids,
             temperature, top_k, top_p, key, *, do_sampling, dp, max_draft_len,
             num_logprobs=None):
  T, V = target_logits.shape
  B = num_draft_tokens.shape[0]
  t, b, K = T // dp, B // dp, max_draft_len
  logits = target_logits.astype(jnp.float32)
  if do_sampling and T:
    row = _row_requests(num_draft_tokens, dp, t)
    target = _target_probs(logits, temperature[row] < GREEDY_TEMPERATURE_EPS,
                           temperature[row], top_k[row], top_p[row])
  else:
    target = jax.nn.one_hot(jnp.argmax(logits, axis=-1), V, dtype=jnp.float32)
  if draft_probs is None:  # greedy, or a deterministic (n-gram) draft: a point mass
    draft = jax.nn.one_hot(jnp.clip(draft_token_ids, 0, V - 1), V, dtype=jnp.float32)
  else:
    draft = draft_probs.astype(jnp.float32)
  # Greedy verification with one-hot targets is deterministic: any key gives the result.
  keys = jax.random.split(jax.random.key(0) if key is None else key, dp)
  # The law each row's log-probabilities are read from (the module docstring): a greedy
  # row's raw logits, a sampled row's processed ones. Only built when asked for.
  log_law = None
  if num_logprobs is not None:
    log_law = jax.nn.log_softmax(logits, axis=-1)
    if do_sampling and T:
      greedy = temperature[row] < GREEDY_TEMPERATURE_EPS
      log_law = jnp.where(greedy[:, None], log_law, _sampled_log_probs(
          logits, greedy, temperature[row], top_k[row], top_p[row]))

  def block(key, ids, counts, q, p, bonus, log_law):
    index = ragged_index(counts, num_tokens=t, max_draft_len=K)
    if t == 0:  # no draft rows: gather from one dummy row, masked below
      q, p, ids = jnp.zeros((1, V)), jnp.zeros((1, V)), jnp.zeros((1,), jnp.int32)
    rows, mask = index.rows, index.in_draft
    # No bonus row is sampled from: when a request accepts all its drafts, the stack's
    # bonus token is emitted instead (below), so a uniform placeholder row stands in for
    # it and whatever the sampler draws past a request's drafts is dropped by `to_flat`.
    p_rows = jnp.concatenate([jnp.where(mask[..., None], p[rows], 0.0),
                              jnp.full((counts.shape[0], 1, V), 1.0 / V)], axis=1)
    out = rejection_sample(key, draft_probs=jnp.where(mask[..., None], q[rows], 0.0),
                           draft_tokens=jnp.where(mask, ids[rows], 0),
                           target_probs=p_rows, num_verified=index.counts)
    # out.tokens holds the accepted drafts, then the recovered token, then -1.
    main = to_flat(out.tokens[:, :K], index, num_tokens=t, fill=PLACEHOLDER_TOKEN_ID)
    bonus = jnp.where(out.num_accepted == index.counts, bonus.astype(jnp.int32),
                      PLACEHOLDER_TOKEN_ID)
    logprobs = None
    if log_law is not None:  # main rows from the law, bonus rows placeholders
      logprobs = gather_logprobs(log_law, main, num_logprobs)
      logprobs = jax.tree.map(
          lambda m, fill: jnp.concatenate([m, jnp.full((bonus.shape[0],) + m.shape[1:], fill,
                                                       m.dtype)]),
          logprobs, LogprobsTensors(-1, jnp.nan, -1))
    return (jnp.concatenate([main, bonus]), out.num_accepted,
            to_flat(out.accepted, index, num_tokens=t, fill=False),
            to_flat(out.labeled, index, num_tokens=t, fill=False), logprobs)

  split = lambda x, n: x.reshape((dp, n) + x.shape[1:])
  output, num_accepted, accepted, labeled, logprobs = jax.vmap(block)(
      keys, split(draft_token_ids.astype(jnp.int32), t), split(num_draft_tokens, b),
      split(draft, t), split(target, t), split(bonus_token_ids, b),
      None if log_law is None else split(log_law, t))
  if logprobs is not None:
    logprobs = jax.tree.map(lambda x: x.reshape((T + B,) + x.shape[2:]), logprobs)
  return TpuRejectionOutput(output_token_ids=output.reshape(-1),
                            num_accepted=num_accepted.reshape(-1),
                            accepted=accepted.reshape(-1), labeled=labeled.reshape(-1),
                            logprobs=logprobs)


class RejectionSampler:
  """Drop-in for tpu-inference's `RejectionSampler(mesh)`, sampling with AV's sampler.

  Args:
    mesh: the `jax.sharding.Mesh` (or None); its data-parallel axes (`DATA_AXES`) set
      the block layout of the output, as in tpu-inference.
    max_draft_len: static upper bound K of `num_draft_tokens` (the speculative config's
      number of speculative tokens). The sampler works on a dense `[B, K, V]` view, so
      pass it in serving; default T per data-parallel block (always enough).

  Example:
    >>> sampler = RejectionSampler(mesh)
    >>> sampler(draft_token_ids=jnp.array([1, 2, 3, 4]), num_draft_tokens=jnp.array([2, 2]),
    ...         draft_probs=None, target_logits=logits, bonus_token_ids=jnp.array([5, 6]),
    ...         sampling_metadata=greedy_metadata)   # [1, 2, 3, 7, 5, -1]
  """

  def __init__(self, mesh, *, max_draft_len: int | None = None):
    self.mesh = mesh
    self.max_draft_len = max_draft_len

  def __call__(self, draft_token_ids, num_draft_tokens, draft_probs, target_logits,
               bonus_token_ids, sampling_metadata, key=None) -> jax.Array:
    """tpu-inference's call: returns `output_token_ids [T + B]` (see the module)."""
    return self.sample_with_labels(
        draft_token_ids=draft_token_ids, num_draft_tokens=num_draft_tokens,
        draft_probs=draft_probs, target_logits=target_logits,
        bonus_token_ids=bonus_token_ids, sampling_metadata=sampling_metadata,
        key=key).output_token_ids

  forward = __call__

  def sample_with_labels(self, draft_token_ids, num_draft_tokens, draft_probs,
                         target_logits, bonus_token_ids, sampling_metadata: Any,
                         key=None, *, num_logprobs: int = 0) -> TpuRejectionOutput:
    """As `__call__`, also returning AV's per-draft labels (`[T]`, flat order) and, when
    `sampling_metadata.logprobs` is True, the log-probabilities (module docstring) with
    the top `num_logprobs` alternatives of every row (the batch's largest request, as
    tpu-inference's `max_num_logprobs`).

    Raises:
      ValueError: naming the argument, on wrong shapes or dtypes, a missing key when
        sampling, shapes not divisible by the data-parallel size, `num_logprobs` outside
        [0, V], and eagerly on counts that do not fit a block or exceed `max_draft_len`,
        and on out-of-range draft ids in verified positions.
    """
    draft_token_ids = jnp.asarray(draft_token_ids)
    num_draft_tokens = jnp.asarray(num_draft_tokens)
    target_logits = jnp.asarray(target_logits)
    bonus_token_ids = jnp.asarray(bonus_token_ids)
    _checks.rank("target_logits", target_logits, 2, "TV")
    T, V = target_logits.shape
    _checks.shape("draft_token_ids", draft_token_ids, (T,), "T")
    _checks.integer("draft_token_ids", draft_token_ids)
    _checks.rank("num_draft_tokens", num_draft_tokens, 1, "B")
    _checks.integer("num_draft_tokens", num_draft_tokens)
    B = num_draft_tokens.shape[0]
    _checks.shape("bonus_token_ids", bonus_token_ids, (B,), "B")
    _checks.integer("bonus_token_ids", bonus_token_ids)
    do_sampling = sampling_metadata.do_sampling
    if not isinstance(do_sampling, (bool, np.bool_)):
      raise ValueError(f"sampling_metadata.do_sampling: expected a Python bool (static), "
                       f"got {type(do_sampling).__name__}")
    do_sampling = bool(do_sampling)
    if do_sampling and draft_probs is not None:
      draft_probs = jnp.asarray(draft_probs)
      _checks.shape("draft_probs", draft_probs, (T, V), "TV")
    if not do_sampling:
      draft_probs = None
    options = []
    for name, dtype in (("temperature", jnp.float32), ("top_k", jnp.int32),
                        ("top_p", jnp.float32)):
      value = getattr(sampling_metadata, name, None) if do_sampling else None
      if do_sampling:
        if value is None:
          raise ValueError(f"sampling_metadata.{name}: expected a [B={B}] array when "
                           "do_sampling is True, got None")
        value = jnp.asarray(value)
        _checks.shape(f"sampling_metadata.{name}", value, (B,), "B")
        value = value.astype(dtype)
      else:
        value = jnp.zeros((B,), dtype)
      options.append(value)
    if do_sampling and key is None:
      raise ValueError("key: a random key must be provided for non-greedy sampling")
    want_logprobs = getattr(sampling_metadata, "logprobs", False)
    if not isinstance(want_logprobs, (bool, np.bool_)) and want_logprobs is not None:
      raise ValueError(f"sampling_metadata.logprobs: expected a Python bool (static) or None, "
                       f"got {type(want_logprobs).__name__}")
    logprobs = (check_num_logprobs(num_logprobs, V, "num_logprobs") if want_logprobs
                else None)
    dp = _data_parallel_size(self.mesh)
    if T % dp or B % dp:
      raise ValueError(f"target_logits / num_draft_tokens: T={T} and B={B} must be "
                       f"divisible by the mesh's data-parallel size {dp}")
    t = T // dp
    K = max(t, 1) if self.max_draft_len is None else int(self.max_draft_len)
    if K < 1:
      raise ValueError(f"max_draft_len: expected >= 1, got {self.max_draft_len}")
    for r in range(dp):
      check_counts(num_draft_tokens[r * (B // dp):(r + 1) * (B // dp)], num_tokens=t,
                   max_draft_len=K)
    return _forward(draft_token_ids, num_draft_tokens, draft_probs, target_logits,
                    bonus_token_ids, *options, key, do_sampling=do_sampling, dp=dp,
                    max_draft_len=K, num_logprobs=logprobs)


def labels_from_output(
    output_token_ids: jax.typing.ArrayLike,
    num_draft_tokens: jax.typing.ArrayLike,
    *,
    max_draft_len: int,
    dp_size: int = 1,
    learn: jax.typing.ArrayLike | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """AV's labels from a `[T + B]` output alone (`num_rejected_tokens`-style).

  Request b emitted `n_b` main tokens (its non-placeholder main rows); if its bonus slot
  is set it accepted all `num_draft_tokens[b]` drafts, else `n_b - 1` (the last main
  token is the recovered one) and rejected the next. A draft id that ended verification
  without being a draw (out of range; see `av_jax.rejection`) reads as a rejection here:
  `RejectionSampler.sample_with_labels` gives the exact labels.

  Args:
    output_token_ids: `[T + B]` the sampler's output.
    num_draft_tokens: `[B]` drafts per request.
    max_draft_len: static K.
    dp_size: data-parallel blocks of the output (`RejectionSampler`'s mesh).
    learn: optional `[B]` bool, requests whose labels the estimator learns from; a
      request whose target applied a transform the drafter never sees (penalties,
      banned ids, a grammar) passes False and gets no label (`accepted` is kept).

  Returns:
    `(accepted [B, K], labeled [B, K], num_rejected_tokens [B])`; `num_rejected_tokens`
    is `num_draft_tokens - num_accepted`, as the stacks count it.
  """
  output_token_ids = jnp.asarray(output_token_ids)
  num_draft_tokens = jnp.asarray(num_draft_tokens)
  _checks.rank("output_token_ids", output_token_ids, 1, "T+B")
  _checks.rank("num_draft_tokens", num_draft_tokens, 1, "B")
  B = num_draft_tokens.shape[0]
  T = output_token_ids.shape[0] - B
  if T < 0 or T % dp_size or B % dp_size:
    raise ValueError(f"output_token_ids: expected [T + B] with T, B divisible by "
                     f"dp_size={dp_size}, got shape {output_token_ids.shape} for B={B}")
  accepted, labeled, rejected = _labels_from_output(
      output_token_ids, num_draft_tokens, max_draft_len=int(max_draft_len),
      dp_size=int(dp_size))
  return accepted, mask_labels(labeled, learn), rejected


@functools.partial(jax.jit, static_argnames=("max_draft_len", "dp_size"))
def _labels_from_output(output_token_ids, num_draft_tokens, *, max_draft_len, dp_size):
  B = num_draft_tokens.shape[0]
  T = output_token_ids.shape[0] - B
  t, b, K = T // dp_size, B // dp_size, max_draft_len
  blocks = output_token_ids.reshape(dp_size, t + b)

  def block(out, counts):
    index = ragged_index(counts, num_tokens=t, max_draft_len=K)
    main = out[:t][index.rows] if t else jnp.full(index.rows.shape, -1, jnp.int32)
    emitted = jnp.sum(index.in_draft & (main != PLACEHOLDER_TOKEN_ID), axis=-1)
    bonus = out[t:] != PLACEHOLDER_TOKEN_ID
    num_accepted = jnp.where(bonus, index.counts, jnp.maximum(emitted - 1, 0))
    pos = jnp.arange(K)[None, :]
    accepted = pos < num_accepted[:, None]
    labeled = accepted | ((pos == num_accepted[:, None]) & ~bonus[:, None]
                          & (num_accepted < index.counts)[:, None])
    return accepted, labeled, index.counts - num_accepted

  accepted, labeled, rejected = jax.vmap(block)(blocks, num_draft_tokens.reshape(dp_size, b))
  return accepted.reshape(B, K), labeled.reshape(B, K), rejected.reshape(B)
