"""Time the sampling step (temperature, top-p) with the nucleus search and with the
31-step bisection of every row, side by side.

The step is `models.sampling.sampling_probs` on `[T, V]` logits. Programs: "new" as
shipped (`sampling._top_p_mask`); "old" the same function traced with
`sampling._top_p_mask_by_bisection` in its place; "old_blocked" the bisection run over
the same row blocks as the search (`sampling._by_row_blocks`), which separates what the
blocks gain (passes over cached rows) from what the fewer passes gain. Each repeat times
every program once, interleaved, so load on a shared machine lands on all of them
alike; ratios are of the medians. Logits: at the model set's vocabulary, the target's
logits over held-out windows of every workload (cycled to T rows); at any other V,
Gaussian logits times each `--scale` (2: a nucleus of ~10^4 of 32000 tokens at top-p
0.95, 4: ~400, 6: ~25).

  python benchmarks/sampling_passes.py --rows 64 576 --vocab model 32000 --top-p 0.95
"""

from __future__ import annotations

import argparse
import json
import os
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from av_jax import sampling
from av_jax.models import sampling as model_sampling


def model_logits(name: str, rows: int) -> np.ndarray:
  """`[rows, V]` logits of model set `name`'s target over held-out windows of every
  workload, interleaved, cycled to `rows`."""
  from av_jax.data import workloads
  from av_jax.models import pipeline, registry, transformer
  pair = registry.load(name)
  parts = []
  for workload in workloads.list_workloads():
    windows = pipeline.heldout_windows(pair.cfg, pair.tokenizer, workload)[:4, :-1]
    positions = np.broadcast_to(np.arange(windows.shape[1]), windows.shape)
    out = transformer.forward(pair.target_params, jnp.asarray(windows), jnp.asarray(positions),
                              cfg=pair.cfg.target)
    parts.append(np.asarray(out.logits).reshape(-1, out.logits.shape[-1]))
  mixed = np.stack(parts, axis=1).reshape(-1, parts[0].shape[-1])  # workloads interleaved
  return mixed[np.arange(rows) % len(mixed)]


def _blocked_bisection(log_probs, top_p):
  """`_top_p_mask_by_bisection` over the search's row blocks."""
  probs = jnp.exp(log_probs)
  shape, V = probs.shape, probs.shape[-1]
  top_p = jnp.broadcast_to(top_p, shape[:-1] + (1,)).reshape(-1, 1)
  probs = probs.reshape(-1, V)
  keep = probs >= sampling._by_row_blocks(sampling._bisection_threshold, probs, top_p)
  return (keep | (top_p >= 1.0)).reshape(shape)


def programs(top_p: float) -> dict:
  """The sampling step with the nucleus search ("new"), the bisection ("old") and the
  bisection over row blocks ("old_blocked")."""
  def step(logits):
    return model_sampling.sampling_probs(logits, temperature=1.0, top_p=top_p)

  def traced_with(mask_fn):
    program = jax.jit(lambda logits: step(logits))

    def run(logits):  # traced on the first call, with `mask_fn` in place
      with mock.patch.object(sampling, "_top_p_mask", mask_fn):
        return program(logits)
    return run
  return {"old": traced_with(sampling._top_p_mask_by_bisection),
          "old_blocked": traced_with(_blocked_bisection), "new": jax.jit(step)}


def time_case(logits: np.ndarray, top_p: float, repeats: int) -> dict:
  fns = programs(top_p)
  x = jnp.asarray(logits)
  support = {name: fn(x) > 0 for name, fn in fns.items()}  # compiles each
  rows_differing = int(jnp.sum(jnp.any(support["old"] != support["new"], axis=-1)))
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(x))
      times[name].append((time.perf_counter() - start) * 1e3)
  med = {name: float(np.median(t)) for name, t in times.items()}
  return dict(median_ms=med, old_over_new=med["old"] / med["new"],
              old_blocked_over_new=med["old_blocked"] / med["new"],
              rows_differing=rows_differing)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, nargs="+", default=[64, 576],
                      help="T rows (B = 64: 64 drafting, 576 = 64 x (K + 1) verifying, K = 8)")
  parser.add_argument("--vocab", nargs="+", default=["model", "32000"],
                      help="V: 'model' (the model set's logits) or a size (Gaussian logits)")
  parser.add_argument("--model", default="default", help="model set of --vocab model")
  parser.add_argument("--scale", type=float, nargs="+", default=[2.0, 4.0, 6.0],
                      help="Gaussian logit scales (V other than 'model')")
  parser.add_argument("--top-p", type=float, nargs="+", default=[0.95])
  parser.add_argument("--repeats", type=int, default=15, help="interleaved timed rounds")
  args = parser.parse_args()
  results = []
  for vocab in args.vocab:
    for rows in args.rows:
      if vocab == "model":
        cases = [(f"{args.model} target", model_logits(args.model, rows))]
      else:
        rng = np.random.default_rng(0)
        cases = [(f"normal x {s:g}", (rng.normal(size=(rows, int(vocab))) * s).astype(np.float32))
                 for s in args.scale]
      for label, logits in cases:
        for top_p in args.top_p:
          row = dict(T=rows, V=logits.shape[-1], logits=label, top_p=top_p,
                     **time_case(logits, top_p, args.repeats))
          print(json.dumps(row), flush=True)
          results.append(row)
  print(json.dumps(dict(load_average=os.getloadavg(), device=jax.devices()[0].device_kind,
                        jax=jax.__version__, repeats=args.repeats)))


if __name__ == "__main__":
  main()
