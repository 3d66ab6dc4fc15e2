"""Prototype of a faster exact `logit_qmax` for XLA:CPU (measured by overhead.py).

Why. On XLA:CPU (jax 0.10) reductions are emitted as YNNPACK fusions, which take
elementwise producers into the fusion only if every op is supported and has a single
consumer. `av_jax.features.logit_qmax` uses comparisons (`scaled < m`, `scaled == m`)
and two reductions sharing `m`; comparisons are not YNN ops and the shared max is
emitted as a fusion whose *output is the broadcast max*, so the compiled program writes
three `[B, K, V]` float32 temporaries and reads the logits or a temporary seven times
(`hlo_passes` counts them).

How. The same quantity, `-log(sum_{v below max} exp(l_v - m) + (#maxima - 1))`, written
compare-free: `below = min((m - l) * 1e38, 1)` is 1 for every entry below the max and 0
at the max (any nonzero float32 gap times 1e38 exceeds 1; NaN stays NaN), and the two
sums become two channels of one reduction. The vocabulary is cut into chunks of at most
`_CHUNK` entries (YNN's fused max-then-sum slows down by an order of magnitude once a
row no longer fits in cache, measured between V = 32768 and 65536): one pass takes the
chunk maxima, a second fused pass takes each chunk's two sums relative to its own
maximum, and the `[B, K, V / chunk]` partial results are combined exactly (chunks below
the row max are rescaled by `exp(m_c - m)`; only chunks at the row max contribute to the
tie count). No `[B, K, V]` temporary is written. Rows whose max is not finite (all -inf,
+inf or NaN logits) come out NaN here and are recomputed with the library function
under a `lax.cond`, which costs nothing unless such a row exists; so the result equals
`logit_qmax` on every input (up to float32 summation order).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from av_jax.features import FEATURE_CLIP, logit_qmax

# (m - l) * _GAP_SCALE >= 1 for any nonzero float32 gap down to ~1e-38 (normal floats).
_GAP_SCALE = 1e38
# Chunk length: the fused max-then-sum stays in cache (see the module docstring).
_CHUNK = 8192


def _chunk_length(vocab: int) -> int:
  """Largest divisor of V in [1024, _CHUNK], else V itself (one chunk)."""
  if vocab <= _CHUNK:
    return vocab
  for c in range(_CHUNK, 1023, -1):
    if vocab % c == 0:
      return c
  return vocab


def logit_qmax_fused(logits, *, temperature=1.0, top_p=1.0) -> jax.Array:
  """`logit_qmax` in two fused passes with no `[B, K, V]` temporary (same values).

  Gaps are taken on the raw logits and divided by the temperature afterwards (the max
  commutes with a positive scale), so the max entry gives exactly d = 0 even where XLA
  recomputes `l / T` differently in two fusions (it does, with a reciprocal multiply).
  """
  if not (isinstance(top_p, (int, float)) and top_p >= 1.0):
    return logit_qmax(logits, temperature=temperature, top_p=top_p)  # sort dominates
  logits = jnp.asarray(logits, jnp.float32)
  temp = jnp.asarray(temperature, jnp.float32)[..., None]
  temp = jnp.where(temp > 0, temp, 1.0)                         # [..., 1]; <= 0: greedy
  V = logits.shape[-1]
  C = _chunk_length(V)
  chunks = logits.reshape(*logits.shape[:-1], V // C, C)        # [..., N, C]
  chunk_max = jnp.max(chunks, axis=-1)                          # [..., N]
  # An all -inf chunk gets shift 0 so that it contributes exactly nothing (not NaN).
  shift = jnp.where(chunk_max == -jnp.inf, 0.0, chunk_max)
  d = (chunks - shift[..., None])[..., None, :]                 # [..., N, 1, C] <= 0
  below = jnp.minimum(d * -_GAP_SCALE, 1.0)                     # 1 below the max, 0 at it
  channel = jnp.array([[0.0], [1.0]], jnp.float32)              # rest | count at max
  inv_t = (1.0 / temp)[..., None, None]
  sums = jnp.sum(jnp.exp(d * inv_t) * below * (1.0 - channel) + (1.0 - below) * channel,
                 axis=-1)
  m = jnp.max(chunk_max, axis=-1, keepdims=True)
  top = chunk_max == m                                          # chunks holding the row max
  rescale = jnp.exp(jnp.where(top, 0.0, chunk_max - m) / temp)
  rest = jnp.sum(sums[..., 0] * rescale + jnp.where(top, 0.0, sums[..., 1] * rescale), -1)
  ties = jnp.sum(jnp.where(top, sums[..., 1], 0.0), axis=-1) - 1.0
  fast = jnp.clip(-jnp.log(rest + ties), -FEATURE_CLIP, FEATURE_CLIP)
  bad = jnp.isnan(fast)
  return jax.lax.cond(jnp.any(bad),
                      lambda: jnp.where(bad, logit_qmax(logits, temperature=temperature), fast),
                      lambda: fast)


def hlo_passes(fn, shape) -> dict:
  """Counts in the compiled HLO of `fn` on a float32 `shape` input the top-level ops that
  write a full-size array and the full-size operands they read (a proxy for passes over
  the logits: one jitted `jnp.max` is 0 writes, 1 read)."""
  text = jax.jit(fn).lower(jnp.zeros(shape, jnp.float32)).compile().as_text()
  entry = text[text.index("ENTRY"):].splitlines()[1:]
  full = "f32[" + ",".join(map(str, shape)) + "]"
  shapes, writes, reads = {}, 0, 0
  for line in entry:
    match = re.match(r"\s*(?:ROOT )?(%[\w.\-]+) = (\S+) (\w[\w\-]*)\((.*?)\)", line)
    if not match:
      continue
    name, out_shape, op, operands = match.groups()
    shapes[name] = out_shape.split("{")[0]
    if op == "parameter":
      continue
    writes += shapes[name] == full
    reads += sum(shapes.get(o) == full for o in re.findall(r"%[\w.\-]+", operands))
  return dict(full_writes=writes, full_reads=reads)
