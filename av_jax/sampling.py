"""Sampling settings and the distribution a sampler draws from: temperature, then top-p.

`Sampling(temperature, top_p)` is the engine's sampling setting (gemma style).
`sampling_log_probs` applies it to logits: temperature, then the nucleus (top-p) filter,
whose threshold is found without sorting a row (`_top_p_mask`). The drafters and the target's
verification draw from this distribution (`av_jax.models.sampling`), and the features
read it (`av_jax.features`): both import it from here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from av_jax import _checks

_NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
  """How draft and target tokens are drawn."""
  temperature: float = 1.0  # softmax temperature; <= 0 draws greedily (the arg-max)
  top_p: float = 1.0        # nucleus mass in (0, 1]; 1 disables the filter

  def __post_init__(self):
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p: expected a value in (0, 1], got {self.top_p}")

  @property
  def greedy(self) -> bool:
    """Whether tokens are the arg-max (temperature <= 0)."""
    return self.temperature <= 0


def row_option(value, logits: jax.Array, name: str = "option") -> jax.Array:
  """Broadcasts a per-row scalar option (`temperature`, `top_p`) to `[..., 1]`."""
  value = jnp.asarray(value, dtype=jnp.float32)
  lead = tuple(logits.shape[:-1])
  try:
    fits = np.broadcast_shapes(value.shape, lead) == lead
  except ValueError:
    fits = False
  if not fits:
    raise ValueError(
        f"{name}: option has shape {value.shape}; expected a scalar or an array "
        f"broadcastable to the leading dimensions {lead} of logits")
  return value[..., None]


def check_options(logits: jax.Array, temperature, top_p) -> None:
  """Refuses bad `temperature` / `top_p` with a `ValueError` naming the argument.

  Shapes are checked at trace time; values whenever they are concrete (Python numbers,
  or arrays outside jit): temperature >= 0 (0 = greedy), top_p in (0, 1]. Traced values
  cannot be checked: a traced temperature <= 0 then reads as greedy, a top_p <= 0 keeps
  only the top token(s), a top_p > 1 keeps everything.
  """
  for name, value in (("temperature", temperature), ("top_p", top_p)):
    row_option(value, logits, name)
    if isinstance(value, jax.core.Tracer):
      continue
    value = np.asarray(value, np.float64)
    if name == "temperature" and not np.all(value >= 0):
      raise ValueError(f"temperature: expected >= 0 (0 = greedy), got {value.tolist()}")
    if name == "top_p" and not np.all((value > 0) & (value <= 1)):
      raise ValueError(f"top_p: expected values in (0, 1] (1 = no filtering), got "
                       f"{value.tolist()}")


# The nucleus search's sizes (static): bisection steps before the bracket is counted, the
# most probabilities a bracket may hold before they are read, the counted steps allowed to
# get there, and the bytes of rows searched at a time (small enough to stay in cache across
# the search's passes).
_BRACKET_STEPS = 12
NUCLEUS_CANDIDATES = 32
_NARROW_STEPS = 4
_BLOCK_BYTES = 1 << 20
_BITS_STEPS = 31      # the bits of 1.0 are 0x3f800000 < 2**30: 31 halvings reach adjacent floats


def _top_p_mask(log_probs: jax.Array, top_p: jax.Array) -> jax.Array:
  """Bool mask of the nucleus: tokens with prob >= the last nucleus token's prob.

  Definition: sorting descending, the nucleus holds the sorted entries whose exclusive
  cumulative mass is below `top_p` (the top token is always kept), and the threshold is
  applied by value, so ties at the boundary are all kept. Equivalently, token v is kept
  iff the mass strictly above its probability is below `top_p`, and the threshold is the
  smallest probability with that property (`_top_p_mask_by_sort` writes it directly).
  The threshold is found without sorting a row (`_nucleus_threshold`), over blocks of
  rows of `_BLOCK_BYTES`, and is the sort's up to float32 summation order at an exact
  boundary.
  """
  probs = jax.lax.stop_gradient(jnp.exp(log_probs))  # a mask has no gradient
  shape, V = probs.shape, probs.shape[-1]
  top_p = jnp.broadcast_to(top_p, shape[:-1] + (1,)).reshape(-1, 1)
  probs = probs.reshape(-1, V)
  if probs.shape[0] == 0:
    return jnp.zeros(shape, bool)
  threshold = _by_row_blocks(_nucleus_threshold, probs, top_p)
  return ((probs >= threshold) | (top_p >= 1.0)).reshape(shape)


def _by_row_blocks(fn, probs: jax.Array, top_p: jax.Array) -> jax.Array:
  """`fn(probs, top_p) -> [R, 1]` run on blocks of rows of at most `_BLOCK_BYTES` in turn.

  A search of many passes then reads each block from memory once and makes its further
  passes over a block in cache: 576 rows of 32000 float32 are 74 MB, one pass over all of
  them streams from memory, a block of 8 rows (1 MiB) stays in cache.
  """
  rows, V = probs.shape
  size = max(1, _BLOCK_BYTES // (4 * V))
  if rows <= size:
    return fn(probs, top_p)
  blocks = -(-rows // size)
  pad = lambda x: jnp.pad(x, ((0, blocks * size - rows), (0, 0))).reshape(blocks, size, -1)
  out = jax.lax.map(lambda block: fn(*block), (pad(probs), pad(top_p)))
  return out.reshape(blocks * size, 1)[:rows]


def _bits(x: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, jnp.int32)


def _float(bits: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _nucleus_threshold(probs: jax.Array, top_p: jax.Array) -> jax.Array:
  """`[R, 1]` nucleus thresholds of `probs [R, V]` by a bracket, then its values.

  Bisection over the float bits of `[0, max]` brackets the threshold (`_bisect`):
  `_BRACKET_STEPS` steps (an interval 2**-12 of the bits wide, about 1/32 of a factor of
  two), then up to `_NARROW_STEPS` more, each with a count, until no row's interval holds
  more than `NUCLEUS_CANDIDATES` probabilities. Those are all the values the threshold can
  be: `lax.top_k` reads them and `_threshold_in` finds it among them from the mass above
  the interval. Typically 12 masked sums, a count and a top-k, where the bisection takes
  31 sums. A row still holding more (many ties at the threshold: a uniform row) finishes
  the bisection to one float, its answer; the rows are searched together, so then all do.
  """
  hi = _bits(jnp.max(probs, axis=-1, keepdims=True))
  carry = _bisect(probs, top_p, (jnp.zeros_like(hi), hi, jnp.zeros(hi.shape)), _BRACKET_STEPS)
  inside = lambda carry: (probs > _float(carry[0])) & (probs <= _float(carry[1]))
  count = lambda carry: jnp.sum(inside(carry), axis=-1, keepdims=True, dtype=jnp.int32)
  k = min(NUCLEUS_CANDIDATES, probs.shape[-1])

  def narrow(state):
    step, carry, _ = state
    carry = _bisect(probs, top_p, carry, 1)
    return step + 1, carry, count(carry)

  step, carry, counts = jax.lax.while_loop(
      lambda s: (s[0] < _BRACKET_STEPS + _NARROW_STEPS) & jnp.any(s[2] > k), narrow,
      (jnp.int32(_BRACKET_STEPS), carry, count(carry)))
  candidates = jax.lax.top_k(jnp.where(inside(carry), probs, -1.0), k)[0]
  # No candidate: the mass above 0 was below top_p (top_p within float32 rounding of the
  # row's sum); the bisection's answer is then hi, the smallest positive float.
  threshold = jnp.minimum(_threshold_in(candidates, carry[2], top_p), _float(carry[1]))
  unresolved = jnp.any(counts > k)
  _, (_, hi, _) = jax.lax.while_loop(
      lambda s: unresolved & (s[0] < _BITS_STEPS),
      lambda s: (s[0] + 1, _bisect(probs, top_p, s[1], 1)), (step, carry))
  return jnp.where(counts > k, _float(hi), threshold)


def _bisect(probs, top_p, carry, steps: int):
  """`steps` halvings of the threshold's bit interval; `carry = (lo, hi, above_hi)`.

  `lo < hi` are int32 bit patterns of non-negative floats (monotone in the value) with
  the mass strictly above `lo` >= top_p and the mass above `hi`, `above_hi`, below it: the
  threshold lies in `(lo, hi]`. Each step is one masked sum over the row.
  """
  def step(_, carry):
    lo, hi, above_hi = carry
    mid = lo + (hi - lo) // 2
    above = jnp.sum(jnp.where(probs > _float(mid), probs, 0.0), axis=-1, keepdims=True)
    ok = above < top_p
    return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi), jnp.where(ok, above, above_hi)
  return jax.lax.fori_loop(0, steps, step, carry)


def _threshold_in(candidates: jax.Array, above: jax.Array, top_p: jax.Array) -> jax.Array:
  """The nucleus threshold `[R, 1]` among `candidates [R, C]`: all the values it can be,
  descending, padded with -1; `above` is the mass strictly above the largest.

  Candidate j is kept iff `above` plus the candidates before it is below `top_p` (the
  first always: the mass strictly above it is `above`); the threshold is the smallest
  kept value. Example: above 0.5, candidates (0.2, 0.2, 0.1), top_p 0.75: the sums 0.5,
  0.7, 0.9 keep both 0.2s, so the threshold is 0.2.
  """
  kept = above + jnp.cumsum(candidates, axis=-1) - candidates < top_p
  kept = kept.at[:, 0].set(True) & (candidates >= 0)
  return jnp.min(jnp.where(kept, candidates, jnp.inf), axis=-1, keepdims=True)


def _bisection_threshold(probs: jax.Array, top_p: jax.Array) -> jax.Array:
  """`[..., 1]` nucleus thresholds by `_BITS_STEPS` bisection steps (a masked sum each)."""
  hi = _bits(jnp.max(probs, axis=-1, keepdims=True))
  _, hi, _ = _bisect(probs, top_p, (jnp.zeros_like(hi), hi, jnp.zeros(hi.shape)), _BITS_STEPS)
  return _float(hi)


def _top_p_mask_by_bisection(log_probs: jax.Array, top_p: jax.Array) -> jax.Array:
  """The nucleus by `_bisection_threshold` on every row: the same mask as `_top_p_mask`
  up to float32 summation order at a boundary; the benchmarks' baseline
  (`benchmarks/sampling_passes.py`)."""
  probs = jnp.exp(log_probs)
  top_p = jnp.broadcast_to(top_p, probs.shape[:-1] + (1,))
  return (probs >= _bisection_threshold(probs, top_p)) | (top_p >= 1.0)


def _top_p_mask_by_sort(log_probs: jax.Array, top_p: jax.Array) -> jax.Array:
  """The nucleus by sorting (the definition, written directly); the tests' reference."""
  probs = jnp.exp(log_probs)
  sorted_probs = -jnp.sort(-probs, axis=-1)
  exclusive = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
  keep_sorted = exclusive < top_p
  keep_sorted = keep_sorted.at[..., 0].set(True)
  threshold = jnp.min(jnp.where(keep_sorted, sorted_probs, jnp.inf), axis=-1, keepdims=True)
  return probs >= threshold


def scaled_logits(logits, temperature, top_p) -> jax.Array:
  """Logits of the sampled distribution up to a per-row constant: `l / T`, top-p masked."""
  logits = jnp.asarray(logits, dtype=jnp.float32)
  _checks.rank_at_least("logits", logits, 1)
  scale = row_option(temperature, logits)
  scaled = logits / jnp.where(scale > 0, scale, 1.0)
  if isinstance(top_p, (int, float)) and top_p >= 1.0:
    return scaled
  keep = _top_p_mask(jax.nn.log_softmax(scaled, axis=-1), row_option(top_p, logits))
  # NaN entries are kept so that a bad row stays visibly bad downstream.
  return jnp.where(keep | jnp.isnan(scaled), scaled, _NEG_INF)


def sampling_log_probs(
    logits: jax.typing.ArrayLike,
    *,
    temperature: jax.typing.ArrayLike = 1.0,
    top_p: jax.typing.ArrayLike = 1.0,
) -> jax.Array:
  """Log-probabilities of the distribution a sampler draws from.

  Applies temperature, then top-p (nucleus) filtering; filtered tokens get -inf.
  A temperature of 0 means greedy drafting; the distribution returned is then the
  temperature-1 softmax, from which features are computed (docs/algorithm.md section 2).

  Args:
    logits: `[..., V]` raw logits. -inf entries are allowed (banned tokens).
    temperature: scalar or `[...]` per-row temperature >= 0.
    top_p: scalar or `[...]` per-row nucleus mass in (0, 1]; 1 disables filtering.

  Returns:
    `[..., V]` float32 log-probabilities.

  Raises:
    ValueError: naming the argument, for logits of rank 0, an option whose shape does not
      broadcast to the leading dimensions, or (when concrete) a temperature < 0 or a
      top_p outside (0, 1] (`check_options`).

  Example:
    >>> lp = sampling_log_probs(jnp.array([2.0, 1.0, 0.0]), top_p=0.7)
  """
  logits = jnp.asarray(logits, dtype=jnp.float32)
  _checks.rank_at_least("logits", logits, 1)
  check_options(logits, temperature, top_p)
  return jax.nn.log_softmax(scaled_logits(logits, temperature, top_p), axis=-1)
