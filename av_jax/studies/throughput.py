"""Throughput sweeps: AV against fixed draft lengths, side by side (study 5).

The sweeps run on `av_jax.compare`'s implementation (one implementation for `av-jax
compare`, `av-jax demo` and the studies): for one concurrency C (slots) at a time, every
arm — target only, fixed K, AV, the oracle — gets its engine compiled (and AV its cost
tables profiled) before any timing; then the arms decode the same prompts in interleaved
repeats, so machine noise hits them alike. Figures per run: wall-clock tokens/s,
per-request tokens/s (tokens/s divided by the mean number of busy slots), tokens and
verified drafts per step, acceptance.

The oracle verifies every draft (it needs the labels) and is charged, in hindsight, only
for the drafts that were accepted: its tokens/s is a ceiling modelled from the measured
run, `T_oracle = T_measured - sum_steps [cost(tokens verified) - cost(tokens needed)]`
with the profiled step-cost tables.
"""

from __future__ import annotations

from typing import Sequence

from av_jax import compare
from av_jax.compare import pareto_front
from av_jax.compare import ratios
from av_jax.compare import summarize

# The studies' arms are `compare`'s, with their own labels ("fixed K=4", "AV (K=8)").
Arm = compare.ArmSpec

__all__ = ("Arm", "Sweeper", "on_off_arms", "pareto_arms", "pareto_front", "ratios",
           "summarize")


def pareto_arms(ks: Sequence[int] = (0, 1, 2, 4, 6, 8), k_av: int = 8,
                oracle: bool = True, confstop: Sequence[float] = ()) -> list[Arm]:
  """Fixed K (0 = target only), AV, vLLM's confidence stop at each threshold of
  `confstop`, and the oracle ceiling."""
  arms = [Arm("target only (K=0)", "target_only", 1) if k == 0 else Arm(f"fixed K={k}",
                                                                        "fixed", k)
          for k in ks]
  arms.append(Arm(f"AV (K={k_av})", "av", k_av))
  for t in confstop:
    if not 0.0 <= t <= 1.0:
      raise ValueError(f"confstop: expected thresholds in [0, 1], got {tuple(confstop)!r}")
    arms.append(Arm(f"confidence stop T={t:g} (K={k_av})", f"confstop:{t:g}", k_av))
  if oracle:
    arms.append(Arm(f"oracle (K={k_av})", "oracle", k_av))
  return arms


def on_off_arms(k: int = 8) -> list[Arm]:
  return [Arm(f"fixed K={k}", "fixed", k), Arm(f"AV (K={k})", "av", k)]


class Sweeper(compare.Runner):
  """`compare.Runner` on the wall clock: compiles and profiles engines once per
  (drafter, concurrency, arm) and runs them."""
