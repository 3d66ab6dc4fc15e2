"""Synthetic demo: AV against fixed K on a synthetic draft stream, no models involved.

Run with `python -m av_lab.synthetic_demo` (the main job on the shipped models is `make demo` /
`av-jax demo`, in `av_lab.demo`). Prints a table of modelled throughput (tokens
per unit of step cost) for target-only decoding, fixed verification of all K draft
tokens, Adaptive Verification with the online estimator, and a hindsight oracle, at
several concurrencies, plus the estimator's calibration after warm-up. It compiles one
program per mode and concurrency: about a minute on a quiet 2-core CPU (68.8 s measured
for issue 12; 48 s of CPU time, 255 s of wall time at load average 15).
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from av_lab import simulate
from av_lab._flags import at_least
from av_jax.selection import make_cost_model

DEMO_ARMS = ("target_only", "fixed", "av", "oracle")  # arms of av_jax.arms.ARMS shown


def compute_bound_cost(num_slots: int, num_positions: int) -> "simulate.CostModel":
  """A step-cost model shaped like a compute-bound target (ms, synthetic).

  Verifying T tokens costs a fixed 4 ms plus 0.05 ms per token once T exceeds the 32
  tokens that fill the accelerator; drafting costs 1 ms plus 0.01 ms per request.
  """
  t = np.arange(num_slots * (num_positions + 1) + 1)
  verify = 4.0 + 0.05 * np.maximum(t - 32, 0)
  draft = 1.0 + 0.01 * np.arange(num_slots + 1)
  return make_cost_model(draft, verify)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--steps", type=at_least(1), default=300, help="decode steps per run")
  parser.add_argument("--warmup", type=at_least(0), default=60,
                      help="steps excluded from figures")
  parser.add_argument("--slots", type=at_least(1), nargs="+", default=[4, 16, 64],
                      help="concurrency")
  parser.add_argument("--positions", type=at_least(1), default=8,
                      help="K, maximum draft length")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if args.warmup >= args.steps:
    parser.error(f"argument --warmup: expected fewer than --steps = {args.steps}, got "
                 f"{args.warmup}")

  start = time.time()
  print(f"av_jax demo: synthetic parallel drafter, K={args.positions}, {args.steps} steps, "
        f"device={jax.devices()[0].device_kind}")
  print(f"{'slots':>5} {'mode':>11} {'tok/step':>9} {'verified':>9} {'cost/step':>9} "
        f"{'tok/cost':>9} {'vs fixed':>8} {'ECE':>7} {'AUC':>6}")
  for num_slots in args.slots:
    workload = simulate.SyntheticWorkload(num_slots=num_slots, num_positions=args.positions)
    cost = compute_bound_cost(num_slots, args.positions)
    rows = {}
    for mode in DEMO_ARMS:
      stats, _ = simulate.run(jax.random.PRNGKey(args.seed), workload, cost, mode=mode,
                              num_steps=args.steps)
      rows[mode] = simulate.summarize(stats, warmup=args.warmup)
    for mode in DEMO_ARMS:
      r = rows[mode]
      ratio = r["tokens_per_cost"] / rows["fixed"]["tokens_per_cost"]
      calib = f"{r['ece']:7.4f} {r['auc']:6.3f}" if mode == "av" else f"{'':>7} {'':>6}"
      print(f"{num_slots:>5} {mode:>11} {r['tokens_per_step']:9.1f} {r['verified_per_step']:9.1f} "
            f"{r['cost_per_step']:9.2f} {r['tokens_per_cost']:9.3f} {ratio:8.3f} {calib}")
  print(f"done in {time.time() - start:.1f} s")


if __name__ == "__main__":
  main()
