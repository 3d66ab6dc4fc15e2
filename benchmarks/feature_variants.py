"""HLO pass counting for overhead.py, and the history of the fused `logit_qmax`.

The prototype described below is now the library's `logit_qmax`.

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

from av_jax.features import logit_qmax

# The fused prototype that lived here was adopted into `av_jax.features.logit_qmax`
# (with gaps clamped at 0 so that a fused producer recomputed with different rounding
# cannot break it). The name stays so overhead.py's `jax_fused` column remains
# comparable with the first, pre-adoption runs recorded in BENCHMARKS.md.
logit_qmax_fused = logit_qmax


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
