"""Features of the draft distribution that predict target acceptance.

The shipped feature is `logit_qmax`, the log-odds of the draft's top token in the
distribution the drafter actually sampled from (temperature, then top-p). It reads the
distribution only, never the drawn token, so pruning on it keeps speculative decoding
exact (spec section 2, rule 1). The registry `FEATURES` also holds alternatives for the
studies; the lossy ones read the drawn token and are flagged so the planner refuses them.

Numerics. Every feature is computed in log space from the logits. Features are finite:
a distribution with a single support token (one-hot, or V = 1) has log-odds +inf, which
is clipped to `FEATURE_CLIP`; the same clip bounds every other feature. A row containing
a NaN logit gives a NaN feature, on every path and vocabulary size (checked explicitly:
XLA:CPU's max may skip NaN on long rows). NaN is the honest answer for a faulty row: the
engine treats a non-finite feature as a fault and falls back per slot, and the estimator
never labels it (see `estimator`).

Options: `temperature` >= 0 (0 = greedy) and `top_p` in (0, 1], checked as
`av_jax.sampling.check_options` says (shapes at trace time, values when concrete, a
`ValueError` naming the argument).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from av_jax import _checks
from av_jax.sampling import check_options, row_option, sampling_log_probs, scaled_logits

# Features are clipped to [-FEATURE_CLIP, FEATURE_CLIP]. 30 nats of log-odds is a top
# probability of 1 - 1e-13: beyond float32 resolution of the probability itself.
FEATURE_CLIP = 30.0

_NEG_INF = -jnp.inf


def _nan_rows_to_nan(logits: jax.Array, feature: jax.Array) -> jax.Array:
  """NaN wherever the row of logits holds a NaN (whatever the reductions did with it)."""
  return jnp.where(jnp.any(jnp.isnan(logits), axis=-1), jnp.nan, feature)


def _clip(feature: jax.Array) -> jax.Array:
  # NaN stays NaN (a bad row); +-inf become the documented bound.
  return jnp.clip(feature, -FEATURE_CLIP, FEATURE_CLIP)


def logit_qmax(
    logits: jax.typing.ArrayLike,
    *,
    temperature: jax.typing.ArrayLike = 1.0,
    top_p: jax.typing.ArrayLike = 1.0,
) -> jax.Array:
  """Log-odds of the top token of the draft distribution: the shipped AV feature.

  `f = log q_max - log(1 - q_max) = m - logsumexp(l_v, v != argmax)`, with `l` the
  logits after temperature and top-p and `m = max l`. Lossless: reads q, never the drawn
  token (spec section 2).

  Numerics: shift invariance gives `f = -log(sum_{v != argmax} exp(l_v - m))`. The sum
  is taken over entries strictly below `m` plus one for every further entry tied at the
  maximum, so it is exact for ties and needs no normalisation pass: one max pass and
  one fused exp-sum pass over the logits (the engine's per-step hot path). A row with a
  single support token (one-hot, V = 1, a lone +inf) gives +inf, clipped to
  +FEATURE_CLIP; a row of only -inf logits is read as uniform. A row holding a NaN logit
  gives NaN (checked explicitly, so also on long rows where XLA:CPU's max skips NaN).

  Args:
    logits: `[..., V]` draft logits.
    temperature: scalar or `[...]` >= 0; 0 (greedy) uses the temperature-1 softmax.
    top_p: scalar or `[...]` nucleus mass in (0, 1].

  Returns:
    `[...]` float32 in `[-FEATURE_CLIP, FEATURE_CLIP]` (or NaN for NaN rows).

  Raises:
    ValueError: as `sampling_log_probs`, naming the argument.

  Example:
    >>> logit_qmax(jnp.log(jnp.array([0.8, 0.2])))  # log(0.8 / 0.2) = 1.386
  """
  logits = jnp.asarray(logits, dtype=jnp.float32)
  _checks.rank_at_least("logits", logits, 1)
  check_options(logits, temperature, top_p)
  if not (isinstance(top_p, (int, float)) and top_p >= 1.0):
    return _nan_rows_to_nan(  # the nucleus dominates the cost here
        logits, _logit_qmax_reference(scaled_logits(logits, temperature, top_p)))
  scale = row_option(temperature, logits)
  fast = _clip(-jnp.log(_rest_plus_ties(logits, jnp.where(scale > 0, scale, 1.0))))
  # Rows whose max is not finite (all -inf, a +inf, NaN) come out NaN from the fast path;
  # only then is the reference formula evaluated (lax.cond: free when no such row).
  bad = jnp.isnan(fast)
  feature = jax.lax.cond(
      jnp.any(bad),
      lambda: jnp.where(bad, _logit_qmax_reference(scaled_logits(logits, temperature, 1.0)),
                        fast),
      lambda: fast)
  return _nan_rows_to_nan(logits, feature)


def _logit_qmax_reference(scaled: jax.Array) -> jax.Array:
  """The direct formula (comparisons, two reductions): exact for every input, but on
  XLA:CPU it writes three [..., V] temporaries. Used with top-p and for bad rows."""
  m = jnp.max(scaled, axis=-1, keepdims=True)
  below = scaled < m
  rest = jnp.sum(jnp.where(below, jnp.exp(jnp.where(below, scaled - m, 0.0)), 0.0), axis=-1)
  # `>=`, not `==`: XLA may recompute a fused producer of `scaled` in this reduction with
  # different rounding than in the max; an entry landing above m still counts as a max.
  ties = jnp.sum((scaled >= m).astype(jnp.float32), axis=-1) - 1.0
  return _clip(-jnp.log(rest + ties))


# (m - l) * _GAP_SCALE >= 1 for every nonzero float32 gap (normal floats).
_GAP_SCALE = 1e38
# Longest vocabulary chunk reduced in one fused sweep: XLA:CPU's fused max-then-sum
# slows down ~10x once a row stops fitting in cache (measured between V=32768 and 65536).
_CHUNK = 8192


def _chunk_length(vocab: int) -> int:
  """Largest divisor of V in [1024, _CHUNK], else V itself (one chunk)."""
  if vocab <= _CHUNK:
    return vocab
  for c in range(_CHUNK, 1023, -1):
    if vocab % c == 0:
      return c
  return vocab


def _rest_plus_ties(logits: jax.Array, temperature: jax.Array) -> jax.Array:
  """`sum_{v below max} exp((l_v - m) / T) + (#maxima - 1)` in two fused passes and no
  [..., V] temporary; NaN for rows whose max is not finite. `temperature`: [..., 1] > 0.

  Compare-free so that XLA:CPU fuses it: `below = min((m - l) * 1e38, 1)` is 1 below the
  max and 0 at it, and the rest and the count of maxima are two channels of one sum.
  Gaps are taken on the raw logits and divided by T afterwards (max commutes with a
  positive scale), so a max entry gives exactly d = 0 even if XLA recomputes l / T
  differently in two fusions. Per chunk of the vocabulary the sums are relative to the
  chunk's own max, then combined exactly: chunks below the row max are rescaled by
  exp((m_c - m) / T) (their maxima are ordinary entries), only chunks at the row max add
  to the tie count.
  """
  V = logits.shape[-1]
  C = _chunk_length(V)
  chunks = logits.reshape(*logits.shape[:-1], V // C, C)
  chunk_max = jnp.max(chunks, axis=-1)
  shift = jnp.where(chunk_max == _NEG_INF, 0.0, chunk_max)  # an all -inf chunk adds 0
  # Clamped at 0: when the logits' producer is fused into both passes, XLA may recompute
  # it with different rounding, and the max entry could land a hair above its own chunk
  # max. Clamped, it counts as a maximum; a hair below, it counts in the rest channel
  # (as exp(~0) = 1, the tie count one lower): the total is right either way.
  d = jnp.minimum(chunks - shift[..., None], 0.0)[..., None, :]  # [..., N, 1, C] <= 0
  below = jnp.minimum(d * -_GAP_SCALE, 1.0)
  channel = jnp.array([[0.0], [1.0]], jnp.float32)
  inv_t = (1.0 / temperature)[..., None, None]
  sums = jnp.sum(jnp.exp(d * inv_t) * below * (1.0 - channel) + (1.0 - below) * channel,
                 axis=-1)
  m = jnp.max(chunk_max, axis=-1, keepdims=True)
  top = chunk_max == m
  rescale = jnp.exp(jnp.where(top, 0.0, chunk_max - m) / temperature)
  rest = jnp.sum(sums[..., 0] * rescale + jnp.where(top, 0.0, sums[..., 1] * rescale), -1)
  ties = jnp.sum(jnp.where(top, sums[..., 1], 0.0), axis=-1) - 1.0
  return rest + ties


def top2_margin(
    logits: jax.typing.ArrayLike,
    *,
    temperature: jax.typing.ArrayLike = 1.0,
    top_p: jax.typing.ArrayLike = 1.0,
) -> jax.Array:
  """`log q_(1) - log q_(2)`: gap between the two most likely draft tokens. Lossless.

  A row with one support token has an infinite margin, clipped to FEATURE_CLIP.
  """
  log_probs = sampling_log_probs(logits, temperature=temperature, top_p=top_p)
  top2 = jax.lax.top_k(log_probs, min(2, log_probs.shape[-1]))[0]
  if log_probs.shape[-1] < 2:
    return _nan_rows_to_nan(log_probs, jnp.full(log_probs.shape[:-1], FEATURE_CLIP,
                                                jnp.float32))
  return _nan_rows_to_nan(log_probs, _clip(top2[..., 0] - top2[..., 1]))


def neg_entropy(
    logits: jax.typing.ArrayLike,
    *,
    temperature: jax.typing.ArrayLike = 1.0,
    top_p: jax.typing.ArrayLike = 1.0,
) -> jax.Array:
  """Negative entropy `sum_v q log q` (nats) of the draft distribution. Lossless.

  Negated so that, like the other features, larger means more confident.
  """
  log_probs = sampling_log_probs(logits, temperature=temperature, top_p=top_p)
  probs = jnp.exp(log_probs)
  plogp = jnp.where(probs == 0, 0.0, probs * log_probs)  # 0 log 0 = 0; NaN stays NaN
  return _nan_rows_to_nan(log_probs, _clip(jnp.sum(plogp, axis=-1)))


def _sampled_log_prob(logits, tokens, temperature, top_p):
  if tokens is None:
    raise ValueError("tokens: this feature reads the drawn token; pass tokens=[...] int")
  log_probs = sampling_log_probs(logits, temperature=temperature, top_p=top_p)
  tokens = jnp.asarray(tokens)
  _checks.shape("tokens", tokens, log_probs.shape[:-1])
  return jnp.take_along_axis(log_probs, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


def logit_q_sampled(logits, *, tokens=None, temperature=1.0, top_p=1.0) -> jax.Array:
  """`logit(q(x))` of the drawn token x. LOSSY: pruning on it biases the output."""
  log_q = _sampled_log_prob(logits, tokens, temperature, top_p)
  # log(1 - q) = log1p(-exp(log q)), accurate for q near 0 and near 1.
  return _clip(log_q - jnp.log1p(-jnp.exp(jnp.minimum(log_q, -1e-30))))


def gumbel_q_sampled(logits, *, tokens=None, temperature=1.0, top_p=1.0) -> jax.Array:
  """`-log(-log q(x))` of the drawn token x. LOSSY: pruning on it biases the output."""
  log_q = _sampled_log_prob(logits, tokens, temperature, top_p)
  return _clip(-jnp.log(jnp.maximum(-log_q, 1e-30)))


class Feature(NamedTuple):
  """A registered feature.

  Attributes:
    fn: `fn(logits [..., V], *, tokens=None, temperature, top_p) -> [...]` float32.
    lossless: False when the feature reads the drawn token (never usable for pruning).
    description: one line for reports.
  """
  fn: Callable[..., jax.Array]
  lossless: bool
  description: str

  def __call__(self, logits, *, tokens=None, temperature=1.0, top_p=1.0) -> jax.Array:
    if self.lossless:
      return self.fn(logits, temperature=temperature, top_p=top_p)
    return self.fn(logits, tokens=tokens, temperature=temperature, top_p=top_p)


FEATURES: dict[str, Feature] = {
    "logit_qmax": Feature(logit_qmax, True, "log-odds of the draft's top token (shipped)"),
    "top2_margin": Feature(top2_margin, True, "log q_(1) - log q_(2)"),
    "neg_entropy": Feature(neg_entropy, True, "negative entropy of q (nats)"),
    "logit_q_sampled": Feature(logit_q_sampled, False, "logit of q(drawn token) - lossy"),
    "gumbel_q_sampled": Feature(gumbel_q_sampled, False, "-log(-log q(drawn token)) - lossy"),
}


def get_feature(name: str, *, for_pruning: bool = True) -> Feature:
  """Looks a feature up by name; refuses lossy features when they would prune."""
  if name not in FEATURES:
    raise ValueError(f"feature: unknown name {name!r}; expected one of {sorted(FEATURES)}")
  feature = FEATURES[name]
  if for_pruning and not feature.lossless:
    raise ValueError(
        f"feature: {name!r} reads the drawn token and biases the output distribution "
        "(spec section 2); it may be measured in studies but never used for pruning")
  return feature
