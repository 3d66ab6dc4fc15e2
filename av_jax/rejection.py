"""Speculative (rejection) sampling with a per-request number of verified positions.

Standard speculative sampling (spec section 6; Leviathan et al. 2023, Chen et al. 2023):
for i = 1..m_b accept draft token x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the
first rejection emit one token from norm(max(0, p_i - q_i)); if all m_b are accepted emit a
bonus token from p_{m_b + 1}. A request with m_b = 0 emits one token from p_1.

The emitted token is drawn by an exponential race, `argmax_v r(v) / E_v` with
E_v ~ Exp(1) i.i.d., which samples exactly from the normalised `r` without normalising
(and without a division by a possibly tiny mass). The three emission cases share one
formula: the row `a` = number accepted, residual `max(0, p_a - [a < m] q_a)`.

One-hot target probabilities reproduce greedy verification exactly: p(x) = 1 accepts with
probability 1, p(x) = 0 rejects, and the residual is the one-hot arg-max.

Draft ids outside [0, V). Ids in unverified positions are never read, so padding there
(-1, or anything) is safe. An out-of-range id in a verified position is not a draw from
q, so it can neither be accepted nor labelled: verification stops just before it (it is
treated like the first unverified position: unlabelled, and the token emitted there is
drawn from the target's p, which keeps the output exact whatever the bad id was). Under
`jax.jit` values cannot raise, so this is the defined behaviour; called eagerly with
concrete arrays, the functions raise a `ValueError` naming `draft_tokens` instead.

Log-probabilities (`logprobs=n`, a static int; None, the default, computes none and leaves
the compiled program as it is without the feature): every emitted token's log-probability
under the law it was verified against, `log target_probs[b, i, token]` at its row i, plus the
n most likely ids of that row, in the layout of vLLM's `LogprobsTensors` (column 0 the
emitted token, then the top n). E.g. `target_probs[0, 0] = [0.5, 0.25, 0.25]`, token 1
emitted at position 0, n = 1: `logprob_token_ids[0, 0] = [1, 0]`,
`logprobs[0, 0] = [log 0.25, log 0.5]`, and with `logprob_ranks=True`
`selected_token_ranks[0, 0] = 3` (three ids are at least as likely). A -1 placeholder gets
ids -1, log-probabilities NaN and rank -1. The emitted tokens' values are a gather; the
top-n and the ranks each read every row `[B, K+1, V]` in full, which the sampler itself
never does (it reads one `[V]` row per request), so they cost what that pass costs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from av_jax import _checks
from av_jax._ragged import _is_concrete, check_counts, ragged_index


def _valid_prefix(draft_tokens: jax.Array, num_verified: jax.Array, V: int) -> jax.Array:
  """`num_verified` cut before the first draft id outside [0, V) (`[B]` int32).

  Eagerly (concrete values) an out-of-range id in a verified position raises instead.
  """
  K = draft_tokens.shape[-1]
  in_range = (draft_tokens >= 0) & (draft_tokens < V)
  valid = jnp.sum(jnp.cumprod(in_range.astype(jnp.int32), axis=-1), axis=-1)
  if _is_concrete(draft_tokens, num_verified):
    verified = jnp.arange(K)[None, :] < num_verified[:, None]
    bad = np.asarray(verified & ~in_range)
    if bad.any():
      b, i = (int(v[0]) for v in np.nonzero(bad))
      raise ValueError(
          f"draft_tokens: expected ids in [0, V={V}) at verified positions, got "
          f"{int(draft_tokens[b, i])} at request {b}, position {i} (under jit such a "
          "position ends verification instead)")
  return jnp.minimum(num_verified, valid)


class LogprobsTensors(NamedTuple):
  """Log-probabilities of emitted tokens (vLLM's `LogprobsTensors` fields), N = the rows.

  Placeholders (no token emitted) read -1 ids, NaN log-probabilities and rank -1: NaN
  because -inf is a real value (a token outside a top-p nucleus has it).
  """
  logprob_token_ids: jax.Array     # [N, 1 + n] int32, the emitted token, then the top-n ids
  logprobs: jax.Array              # [N, 1 + n] float32, their log-probabilities
  selected_token_ranks: jax.Array | None  # [N] int32, ids at least as likely as the emitted
                                          # one (1 = the top); None when not asked for


class RejectionResult(NamedTuple):
  """Outcome of one verification step."""
  tokens: jax.Array        # [B, K+1] int32, emitted tokens, -1 after the last one
  num_emitted: jax.Array   # [B] int32, num_accepted + 1
  num_accepted: jax.Array  # [B] int32, accepted draft tokens (<= num_verified)
  accepted: jax.Array      # [B, K] bool, position accepted (a prefix)
  labeled: jax.Array       # [B, K] bool, position has an estimator label
  logprobs: LogprobsTensors | None = None  # [B, K+1, ...] rows of `tokens`; None unless asked


def check_num_logprobs(logprobs, V: int, name: str = "logprobs") -> int | None:
  """`logprobs` as a static int in [0, V] (top-n alternatives), or None (off)."""
  if logprobs is None:
    return None
  if isinstance(logprobs, bool) or not isinstance(logprobs, (int, np.integer)):
    raise ValueError(f"{name}: expected None (off) or an int number of top log-probabilities "
                     f"in [0, V={V}], got {logprobs!r}")
  if not 0 <= int(logprobs) <= V:
    raise ValueError(f"{name}: expected a number of top log-probabilities in [0, V={V}] "
                     f"(the vocabulary), got {int(logprobs)}")
  return int(logprobs)


def gather_logprobs(
    scores: jax.Array,
    tokens: jax.Array,
    num_logprobs: int,
    *,
    to_log=lambda x: x,
    ranks: bool = True,
) -> LogprobsTensors:
  """The emitted tokens' log-probabilities and the top-n of each row.

  Args:
    scores: `[..., V]` log-probabilities, or any increasing function of them (e.g. the
      probabilities) with `to_log` mapping them to log-probabilities: ranks and the top-n
      are found on `scores` and only the `1 + n` values kept are mapped, so a probability
      row is not logged in full.
    tokens: `[...]` int emitted tokens, -1 for a placeholder.
    num_logprobs: static n >= 0, top alternatives per row.
    to_log: elementwise map from `scores` to log-probabilities.
    ranks: also count each emitted token's rank (a pass over every row).

  Returns:
    `LogprobsTensors` with `[..., 1 + n]` ids and log-probabilities and `[...]` ranks
    (None when `ranks` is False).
  """
  V = scores.shape[-1]
  tokens = tokens.astype(jnp.int32)
  emitted = tokens >= 0
  picked = jnp.take_along_axis(scores, jnp.clip(tokens, 0, V - 1)[..., None], axis=-1)
  ids, values = tokens[..., None], picked
  if num_logprobs:
    top_values, top_ids = jax.lax.top_k(scores, num_logprobs)
    ids = jnp.concatenate([ids, top_ids.astype(jnp.int32)], axis=-1)
    values = jnp.concatenate([values, top_values], axis=-1)
  return LogprobsTensors(
      logprob_token_ids=jnp.where(emitted[..., None], ids, -1),
      logprobs=jnp.where(emitted[..., None], to_log(values).astype(jnp.float32), jnp.nan),
      # Rank as vLLM counts it: the ids at least as likely as the emitted one (1 = the top).
      selected_token_ranks=(jnp.where(emitted, jnp.sum(scores >= picked[..., 0:1], axis=-1,
                                                       dtype=jnp.int32), -1)
                            if ranks else None))


def _check_dense(draft_probs, draft_tokens, target_probs, num_verified):
  _checks.rank("draft_probs", draft_probs, 3, "BKV")
  B, K, V = draft_probs.shape
  _checks.shape("draft_tokens", draft_tokens, (B, K), "BK")
  _checks.integer("draft_tokens", draft_tokens)
  _checks.shape("target_probs", target_probs, (B, K + 1, V), "B,K+1,V")
  _checks.shape("num_verified", num_verified, (B,), "B")
  _checks.integer("num_verified", num_verified)


def rejection_sample(
    key: jax.Array,
    *,
    draft_probs: jax.typing.ArrayLike,
    draft_tokens: jax.typing.ArrayLike,
    target_probs: jax.typing.ArrayLike,
    num_verified: jax.typing.ArrayLike,
    logprobs: int | None = None,
    logprob_ranks: bool = False,
) -> RejectionResult:
  """Verifies the first `num_verified[b]` draft tokens of every request.

  Args:
    key: PRNG key.
    draft_probs: `[B, K, V]` the distributions q the draft tokens were drawn from.
    draft_tokens: `[B, K]` int draft tokens.
    target_probs: `[B, K+1, V]` target distributions p at each position given the draft
      prefix; row K gives the bonus token after K accepted.
    num_verified: `[B]` int in [0, K], verified positions per request.
    logprobs: static; None (default) computes no log-probabilities; n >= 0 returns
      `result.logprobs`, every emitted token's `log target_probs` at its row with the
      top-n of that row (`[B, K+1, 1 + n]`; see the module docstring).
    logprob_ranks: static; with `logprobs`, also each emitted token's rank in its row.

  Returns:
    A `RejectionResult`. Labels (spec section 6): accepted positions are labelled 1; the
    first rejected position is labelled 0; unverified positions are unlabelled.

  Raises:
    ValueError: on wrong shapes or dtypes, `logprobs` not None or an int in [0, V]; eagerly
      also on a draft id outside [0, V) in a verified position (under jit that position
      ends verification; see the module docstring).

  Example:
    >>> out = rejection_sample(key, draft_probs=q, draft_tokens=x, target_probs=p,
    ...                        num_verified=jnp.full((B,), K))
  """
  draft_probs = jnp.asarray(draft_probs, jnp.float32)
  target_probs = jnp.asarray(target_probs, jnp.float32)
  draft_tokens = jnp.asarray(draft_tokens)
  num_verified = jnp.asarray(num_verified)
  _check_dense(draft_probs, draft_tokens, target_probs, num_verified)
  num_logprobs = check_num_logprobs(logprobs, draft_probs.shape[-1])
  result = _rejection_sample(key, draft_probs=draft_probs, draft_tokens=draft_tokens,
                             target_probs=target_probs, num_verified=num_verified)
  if num_logprobs is None:
    return result
  return result._replace(logprobs=gather_logprobs(target_probs, result.tokens, num_logprobs,
                                                  to_log=jnp.log, ranks=logprob_ranks))


def _rejection_sample(key, *, draft_probs, draft_tokens, target_probs,
                      num_verified) -> RejectionResult:
  """`rejection_sample` on checked float32 arrays, without log-probabilities."""
  B, K, V = draft_probs.shape
  draft_tokens = draft_tokens.astype(jnp.int32)
  num_verified = jnp.clip(num_verified.astype(jnp.int32), 0, K)
  num_verified = _valid_prefix(draft_tokens, num_verified, V)
  key_accept, key_emit = jax.random.split(key)

  # Ids past the valid prefix are never accepted (masked by `verified` below); clipping
  # only keeps the gather in range (JAX would read -1 as V - 1).
  safe_tokens = jnp.clip(draft_tokens, 0, V - 1)
  q_x = jnp.take_along_axis(draft_probs, safe_tokens[..., None], axis=-1)[..., 0]
  p_x = jnp.take_along_axis(target_probs[:, :K], safe_tokens[..., None], axis=-1)[..., 0]
  u = jax.random.uniform(key_accept, (B, K))
  # Accept with probability min(1, p/q): u ~ U[0, 1) so u * q < p has exactly that
  # probability, needs no division, and rejects tokens the target gives p = 0.
  positions = jnp.arange(K)
  verified = positions[None, :] < num_verified[:, None]
  accept_each = (u * q_x < p_x) & verified
  accepted = jnp.cumprod(accept_each.astype(jnp.int32), axis=-1).astype(bool)
  num_accepted = jnp.sum(accepted, axis=-1, dtype=jnp.int32)

  rejected = num_accepted < num_verified
  p_row = jnp.take_along_axis(target_probs, num_accepted[:, None, None], axis=1)[:, 0]
  q_row = jnp.take_along_axis(draft_probs, jnp.minimum(num_accepted, K - 1)[:, None, None],
                              axis=1)[:, 0]
  residual = jnp.maximum(p_row - jnp.where(rejected[:, None], q_row, 0.0), 0.0)
  # Float rounding can leave an all-zero residual only when p ~= q; p is then the law.
  residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_row)
  exponential = jax.random.exponential(key_emit, (B, V))
  # E = 0 has probability 2**-23 per entry, and 0 / 0 = NaN would win the argmax: entries
  # outside the residual's support are excluded explicitly.
  race = jnp.where(residual > 0, residual / exponential, -1.0)
  emitted = jnp.argmax(race, axis=-1).astype(jnp.int32)

  out_positions = jnp.arange(K + 1)[None, :]
  padded_drafts = jnp.concatenate([draft_tokens, jnp.zeros((B, 1), jnp.int32)], axis=1)
  tokens = jnp.where(out_positions < num_accepted[:, None], padded_drafts,
                     jnp.where(out_positions == num_accepted[:, None], emitted[:, None], -1))
  labeled = accepted | ((positions[None, :] == num_accepted[:, None]) & rejected[:, None])
  return RejectionResult(tokens=tokens, num_emitted=num_accepted + 1,
                         num_accepted=num_accepted, accepted=accepted, labeled=labeled)


class RaggedRejectionResult(NamedTuple):
  """Outcome of one verification step in the ragged layout (`rejection_sample_ragged`)."""
  tokens: jax.Array        # [T+B] int32, emitted tokens in the target rows' layout, else -1
  num_emitted: jax.Array   # [B] int32, num_accepted + 1
  num_accepted: jax.Array  # [B] int32, accepted draft tokens of each request
  accepted: jax.Array      # [T] bool, flat draft token accepted (each request's a prefix)
  labeled: jax.Array       # [T] bool, flat draft token has an estimator label
  logprobs: LogprobsTensors | None = None  # [T+B, ...] rows of `tokens`; None unless asked


def rejection_sample_ragged(
    key: jax.Array,
    *,
    draft_probs: jax.typing.ArrayLike,
    draft_tokens: jax.typing.ArrayLike,
    num_draft_tokens: jax.typing.ArrayLike,
    target_probs: jax.typing.ArrayLike,
    max_draft_len: int,
    logprobs: int | None = None,
    logprob_ranks: bool = False,
) -> RaggedRejectionResult:
  """`rejection_sample` in vLLM's ragged layout (flat drafts, interleaved target rows).

  Request b owns `num_draft_tokens[b]` consecutive flat draft tokens and that many + 1
  consecutive target rows (drafts, then bonus), in request order: the `T + B` logits rows
  vLLM's model runner computes. Every request verifies all its drafts. Same key, same
  tokens and labels as the dense function on the padded batch. (tpu-inference's layout:
  `av_jax.integrations.tpu_inference.RejectionSampler`.)

  E.g. num_draft_tokens [2, 0, 1]: drafts [a0 a1 | c0], target rows [a0 a1 a_bonus |
  b_bonus | c0 c_bonus].

  Args:
    key: PRNG key.
    draft_probs: `[T, V]` draft distributions of the flat draft tokens.
    draft_tokens: `[T]` int flat draft tokens (past `sum(num_draft_tokens)`: padding).
    num_draft_tokens: `[B]` int in [0, max_draft_len], summing to at most T.
    target_probs: `[T + B, V]` target distributions, request b's rows at
      `cu[b] + b ... cu[b] + b + num_draft_tokens[b]` with `cu` the exclusive cumsum.
    max_draft_len: static K, an upper bound of `num_draft_tokens`.
    logprobs: static; n >= 0 returns `result.logprobs` `[T + B, 1 + n]` (None: none).
    logprob_ranks: static; with `logprobs`, also the emitted tokens' ranks.

  Returns:
    A `RaggedRejectionResult`: `tokens [T + B]` in `target_probs`' layout (a request's
    emitted tokens, then -1 up to its rows' end; -1 past the last request); `accepted`
    and `labeled` `[T]` in the flat draft order (False past the last request's drafts).

  Raises:
    ValueError: on wrong shapes or dtypes; eagerly also when `num_draft_tokens` leaves
      [0, max_draft_len] or sums to more than T, or a draft id is outside [0, V). Under
      jit counts are clipped, then cut in request order to fit T (the layout is the cut
      counts'), and a bad id ends its request's verification.
  """
  draft_probs, draft_tokens, num_draft_tokens, target_probs, K = _ragged_inputs(
      draft_probs, draft_tokens, num_draft_tokens, target_probs, max_draft_len)
  T, V = draft_probs.shape
  B = num_draft_tokens.shape[0]
  num_logprobs = check_num_logprobs(logprobs, V)
  check_counts(num_draft_tokens, num_tokens=T, max_draft_len=K)

  if T == 0:  # no draft token in the batch: gather from one dummy row, masked below
    draft_probs = jnp.zeros((1, V), jnp.float32)
    draft_tokens = jnp.zeros((1,), jnp.int32)
  counts, starts, draft_rows, in_draft = ragged_index(num_draft_tokens, num_tokens=T,
                                                      max_draft_len=K)
  i = jnp.arange(K + 1)
  target_rows = jnp.minimum(starts[:, None] + jnp.arange(B)[:, None] + i[None, :],
                            T + B - 1)                                     # [B, K+1]
  dense = rejection_sample(
      key,
      draft_probs=jnp.where(in_draft[..., None], draft_probs[draft_rows], 0.0),
      draft_tokens=jnp.where(in_draft, draft_tokens[draft_rows].astype(jnp.int32), 0),
      target_probs=target_probs[target_rows],
      num_verified=counts, logprobs=num_logprobs, logprob_ranks=logprob_ranks)
  # Outputs back to the target rows, labels to the draft rows; padding keeps the fill.
  own = i[None, :] <= counts[:, None]
  to_target = _ragged_scatter(jnp.where(own, target_rows, T + B), T + B)
  to_draft = _ragged_scatter(jnp.where(in_draft, draft_rows, T), T)
  lp = dense.logprobs
  scattered = None if lp is None else LogprobsTensors(
      logprob_token_ids=to_target(lp.logprob_token_ids, -1),
      logprobs=to_target(lp.logprobs, jnp.nan),
      selected_token_ranks=(None if lp.selected_token_ranks is None
                            else to_target(lp.selected_token_ranks, -1)))
  return RaggedRejectionResult(tokens=to_target(dense.tokens, -1),
                               num_emitted=dense.num_emitted,
                               num_accepted=dense.num_accepted,
                               accepted=to_draft(dense.accepted, False),
                               labeled=to_draft(dense.labeled, False), logprobs=scattered)


def _ragged_inputs(draft_probs, draft_tokens, num_draft_tokens, target_probs,
                   max_draft_len):
  """`rejection_sample_ragged`'s arguments as arrays, their shapes and dtypes checked;
  returns them with K = `max_draft_len`."""
  draft_probs = jnp.asarray(draft_probs, jnp.float32)
  target_probs = jnp.asarray(target_probs, jnp.float32)
  draft_tokens = jnp.asarray(draft_tokens)
  num_draft_tokens = jnp.asarray(num_draft_tokens)
  _checks.rank("draft_probs", draft_probs, 2, "TV")
  T, V = draft_probs.shape
  _checks.shape("draft_tokens", draft_tokens, (T,), "T")
  _checks.integer("draft_tokens", draft_tokens)
  _checks.rank("num_draft_tokens", num_draft_tokens, 1, "B")
  _checks.integer("num_draft_tokens", num_draft_tokens)
  B = num_draft_tokens.shape[0]
  _checks.shape("target_probs", target_probs, (T + B, V), "T+B,V")
  K = int(max_draft_len)
  if K < 1:
    raise ValueError(f"max_draft_len: expected >= 1, got {max_draft_len}")
  return draft_probs, draft_tokens, num_draft_tokens, target_probs, K


def _ragged_scatter(index: jax.Array, size: int):
  """A function writing `[B, n, ...]` values to the flat rows `index [B, n]` of a
  `[size, ...]` buffer filled with `fill` (indices >= size are dropped).

  E.g. index [[0, 1, 5], [2, 5, 5]], size 5: values [[a, b, c], [d, e, f]] -> [a, b, d, fill,
  fill].
  """
  def scatter(values: jax.Array, fill) -> jax.Array:
    out = jnp.full((size,) + values.shape[2:], fill, values.dtype)
    return out.at[index.reshape(-1)].set(values.reshape((-1,) + values.shape[2:]),
                                         mode="drop")
  return scatter
