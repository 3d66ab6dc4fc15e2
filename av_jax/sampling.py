"""Sampling settings and the distribution a sampler draws from: temperature, then top-p.

`Sampling(temperature, top_p)` is the engine's sampling setting (gemma style).
`sampling_log_probs` applies it to logits: temperature, then the nucleus (top-p) filter,
whose mask is found by bisection instead of a sort. The drafters and the target's
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


def _top_p_mask(log_probs: jax.Array, top_p: jax.Array) -> jax.Array:
  """Bool mask of the nucleus: tokens with prob >= the last nucleus token's prob.

  Definition: sorting descending, the nucleus holds the sorted entries whose exclusive
  cumulative mass is below `top_p` (the top token is always kept), and the threshold is
  applied by value, so ties at the boundary are all kept. Equivalently, token v is kept
  iff the mass strictly above its probability, `S(p_v) = sum_{u: p_u > p_v} p_u`, is below
  `top_p`. S is monotone, so the threshold `x* = min{x : S(x) < top_p}` is found by
  bisection over the bit patterns of non-negative float32 x (monotone in x): 31 fused
  masked sums instead of a sort, ~10x faster on XLA:CPU at V = 4096 and exact (the same
  mask as the sort, up to float32 summation order at a boundary).
  """
  probs = jnp.exp(log_probs)
  top_p = jnp.broadcast_to(top_p, probs.shape[:-1] + (1,))
  # Invariant: S(bits lo) >= top_p (lo = 0.0: all the mass), S(bits hi) < top_p (the max).
  hi = jax.lax.bitcast_convert_type(jnp.max(probs, axis=-1, keepdims=True), jnp.int32)
  lo = jnp.zeros_like(hi)

  def bisect(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    x = jax.lax.bitcast_convert_type(mid, jnp.float32)
    above = jnp.sum(jnp.where(probs > x, probs, 0.0), axis=-1, keepdims=True)
    ok = above < top_p
    return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

  # hi - lo < 2**30 (the bits of 1.0 are 0x3f800000): 31 halvings reach adjacent floats.
  _, hi = jax.lax.fori_loop(0, 31, bisect, (lo, hi))
  return (probs >= jax.lax.bitcast_convert_type(hi, jnp.float32)) | (top_p >= 1.0)


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
