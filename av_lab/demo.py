"""Main job: what Adaptive Verification is for, on the shipped models, on two clocks.

`make demo` (`av-jax demo`) decodes the mixed workload (code, prose, math and noisy
prompts, interleaved) with the shipped target and one drafter, at a low and a high
concurrency, in three kinds of arm: the target alone, fixed K (every request drafts and
verifies K; the best of the K values run is the static choice a deployment could have
tuned) and AV (`av_jax.policy`: who drafts, how deep and what is verified, from one
priced choice). Each arm decodes the same prompts on two clocks, with each engine
compiled once for both:

* a modelled accelerator (`--clock`, default `h200:llama3-8b`): acceptance from the real
  models run here, every step charged what that deployment would pay for what it did
  (`av_jax.engine.clock`), and AV deciding with the same tables;
* this machine's wall clock: AV decides with the modelled tables of the shipped shapes on
  this machine's measured rates (`av_lab.compare.machine_tables`; no profiling).

It prints one table per concurrency (tokens/s on each clock, and each arm's ratio to the
target alone) and a paragraph generated from the numbers: where speculation paid and
where it did not, and how AV compares with the best fixed K.

Example (the table at concurrency 32 of one run; tokens/s, and the ratio to the target
alone; the modelled columns are the same on every run, the wall clock's follow the machine):

    concurrency 32          modelled h200:llama3-8b      wall clock (this machine)
      arm                 tok/s  vs target best static        tok/s  vs target best static
      target_only        5450.9      1.000                    406.7      1.000           *
      fixed:2            7471.0      1.371           *        306.0      0.752
      fixed:4            6925.3      1.270                    241.8      0.594
      av                 5830.2      1.070                    279.6      0.687

AV reaches 0.78x the best static arm here: its estimator starts cold, and the run is one
wave of 32 requests of 24 tokens that ends when its slowest request does, where the best
rate a step (AV's objective, and the hindsight oracle's) is not the shortest wave. On the
replay ground at these settings (eagle, mixed, h200, B = 32, one wave, warm estimator; the
command is in BENCHMARKS.md, section 4) AV reaches 0.89x fixed:2 and the per-step oracle
0.95x; with three requests a slot arriving as slots free, AV reaches 0.98x the best static
arm. `--requests-per-slot 2` runs the demo with arrivals (in about 1.5x the time).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Mapping, Sequence

import jax

from av_lab import compare as C
from av_lab._flags import at_least, checked, model_set, temperature, top_p

DEFAULT_CONCURRENCY = "1,32"  # a low and a high concurrency
DEFAULT_ARMS = "target_only,fixed:2,fixed:4,av"
DEFAULT_CLOCK = "h200:llama3-8b"


def add_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--models", default="default", type=model_set, help="shipped model set name")
  p.add_argument("--drafter", default="eagle", choices=("draft_lm", "eagle", "block"),
                 help="the drafter of every speculative arm")
  p.add_argument("--workload", default=C.MIXED,
                 choices=(C.MIXED, "code", "prose", "math", "noisy"))
  p.add_argument("--concurrency", default=DEFAULT_CONCURRENCY,
                 type=checked(lambda t: C._int_list("concurrency", t)),  # pylint: disable=protected-access
                 help="comma-separated concurrencies (slots B): a low and a high one")
  p.add_argument("--slots", type=at_least(1), default=None,
                 help="one concurrency B (instead of --concurrency)")
  p.add_argument("--arms", default=DEFAULT_ARMS, type=checked(C.parse_arms),
                 help="comma-separated arms: target_only, fixed:K, av (av_jax.arms)")
  p.add_argument("--clock", default=DEFAULT_CLOCK, type=checked(C.parse_clock),
                 help="the modelled clock: DEVICE:SHAPE (e.g. h200:llama3-8b) or a cost-table "
                      ".json")
  p.add_argument("--k", type=at_least(1), default=8, help="K of arms given without :K")
  p.add_argument("--requests", type=at_least(1), default=4,
                 help="requests per run at least (a run decodes max(this, B x "
                      "--requests-per-slot) requests)")
  p.add_argument("--requests-per-slot", type=at_least(1), default=1,
                 help="requests per slot: 1 is one wave; more arrive as slots free")
  p.add_argument("--prompt-len", type=at_least(1), default=32, help="prompt tokens")
  p.add_argument("--max-new", type=at_least(1), default=24, help="tokens generated per request")
  p.add_argument("--temperature", type=temperature, default=1.0, help="0 = greedy")
  p.add_argument("--top-p", type=top_p, default=0.95, help="nucleus mass in (0, 1]")
  p.add_argument("--repeats", type=at_least(1), default=1,
                 help="timed runs per arm and clock, interleaved")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--compile-workers", type=at_least(1), default=min(2, os.cpu_count() or 1),
                 help="engines compiled at once before the modelled runs (threads)")
  p.add_argument("--json", default=None, help="also write both comparisons' JSON here")


class Progress:
  """One line per event, with the seconds since the demo started (stdout, flushed)."""

  def __init__(self, out=None):
    self.start = time.perf_counter()
    self.out = out or sys.stdout

  def __call__(self, message: str) -> None:
    self.out.write(f"[{time.perf_counter() - self.start:5.0f} s] {message}\n")
    self.out.flush()


def _compare_log(progress: Callable[[str], None], clock: str) -> Callable[[str], None]:
  """compare's log lines as progress lines: compiles as they finish, a group's table as
  'decoded'."""
  def log(line: str) -> None:
    if line.startswith("  compiled"):
      progress(line.strip())
    else:
      head = line.split("  [", 1)[0]
      progress(f"decoded {head} on the {clock} clock")
  return log


def run(args, *, progress: Callable[[str], None] | None = None,
        pairs: Mapping | None = None, prompts=None) -> dict:
  """Both comparisons; returns `{"modelled": result, "wall": result}` (`C.compare`'s).

  `pairs` and `prompts` replace the shipped models and workload prompts (tests)."""
  progress = progress or Progress()
  concurrency = (args.slots,) if args.slots else C._int_list("concurrency", args.concurrency)  # pylint: disable=protected-access
  compiled: dict = {}  # engines shared by both clocks: each compiles once
  common = dict(drafters=args.drafter, workloads=args.workload, concurrency=concurrency,
                arms=args.arms, repeats=args.repeats, models=args.models,
                max_draft=args.k, max_new=args.max_new, prompt_len=args.prompt_len,
                requests_per_slot=args.requests_per_slot, min_requests=args.requests,
                temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                compiled=compiled, pairs=pairs, prompts=prompts)
  progress(f"compiling and decoding on the modelled clock {args.clock} ...")
  modelled = C.compare(clock=args.clock, log=_compare_log(progress, "modelled"),
                       compile_workers=args.compile_workers, **common)
  progress("decoding again on this machine's wall clock (engines compiled above) ...")
  wall = C.compare(clock="wall", log=_compare_log(progress, "wall"),
                   wall_cost=lambda pair, engine: C.machine_tables(
                       args.models, pair.drafter.kind, engine.config).cost, **common)
  return dict(modelled=modelled, wall=wall)


def _index(result: Mapping) -> dict:
  return {(r["concurrency"], r["arm"]): r for r in result["results"]}


def format_tables(results: Mapping, *, clock: str) -> str:
  """One table per concurrency: tokens/s on both clocks and the ratio to target only."""
  m, w = _index(results["modelled"]), _index(results["wall"])
  lines = []
  for c in sorted({c for c, _ in m}):
    arms = [a for cc, a in m if cc == c]
    lines += [f"concurrency {c:<4} {'modelled ' + clock:>30} {'wall clock (this machine)':>30}",
              f"  {'arm':<12} {'tok/s':>12} {'vs target':>10} {'best static':>6}"
              f" {'tok/s':>12} {'vs target':>10} {'best static':>6}"]
    for arm in arms:
      cells = []
      for index in (m, w):
        r, base = index.get((c, arm)), index.get((c, "target_only"))
        if r is None:
          cells.append(f"{'':>12} {'':>10} {'':>11}")
          continue
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        best = "*" if r["arm"] == r.get("best_static") else ""
        cells.append(f"{r['tokens_per_s']:12.1f} {ratio:10.3f} {best:>11}")
      lines.append(f"  {arm:<12} " + " ".join(cells))
    lines.append("")
  lines.append("  * the best static arm (target only or a fixed K) of that clock and concurrency")
  return "\n".join(lines)


def _clock_sentence(index: Mapping, concurrency: Sequence[int], name: str) -> str:
  """Where speculation paid on one clock, and AV against the best static arm."""
  paid, lost, av = [], [], []
  for c in concurrency:
    base = index.get((c, "target_only"))
    fixed = [r for (cc, a), r in index.items() if cc == c and r["mode"] == "fixed"]
    best_fixed = max(fixed, key=lambda r: r["tokens_per_s"], default=None)
    if base and best_fixed:
      ratio = best_fixed["tokens_per_s"] / base["tokens_per_s"]
      (paid if ratio > 1.0 else lost).append(f"{c} ({best_fixed['arm']} at {ratio:.2f}x the "
                                             f"target alone)")
    r = index.get((c, "av"))
    if r is not None and r.get("vs_best_static") is not None:
      av.append(f"{r['vs_best_static']:.2f}x the best static arm ({r['best_static']}) at "
                f"concurrency {c}, drafting on {100 * (r['drafted_share'] or 0):.0f}% of steps")
  parts = []
  if paid:
    parts.append(f"speculation paid at concurrency {' and '.join(paid)}")
  if lost:
    parts.append(f"it did not at {' and '.join(lost)}" if paid else
                 f"speculation did not pay at concurrency {' and '.join(lost)}")
  text = f"On {name}, " + ", ".join(parts) + "." if parts else f"On {name}, no fixed K ran."
  if av:
    text += " AV, which does not know the best K in advance, reached " + "; ".join(av) + "."
  return text


def summary(results: Mapping, *, clock: str) -> str:
  """The paragraph: where speculation paid and where not, on each clock, from the numbers."""
  m, w = _index(results["modelled"]), _index(results["wall"])
  concurrency = sorted({c for c, _ in m})
  return (_clock_sentence(m, concurrency, f"the modelled {clock}") + " "
          + _clock_sentence(w, concurrency, "this machine's wall clock") + " "
          "Both clocks decode the same prompts with the same models, so what is accepted is "
          "the same; they differ in what a step costs.")


def main(args) -> None:
  progress = Progress()
  concurrency = (args.slots,) if args.slots else C._int_list("concurrency", args.concurrency)  # pylint: disable=protected-access
  print(f"av_jax demo: models={args.models}, drafter={args.drafter}, workload={args.workload}, "
        f"concurrency {','.join(map(str, concurrency))}, arms {args.arms}, "
        f"max(B, {args.requests}) requests x {args.max_new} tokens, K={args.k}, "
        f"repeats={args.repeats}; clocks: {args.clock} (modelled) and wall "
        f"({jax.devices()[0].device_kind})", flush=True)
  load = os.getloadavg()[0]
  results = run(args, progress=progress)
  print()
  print(format_tables(results, clock=args.clock))
  print()
  print(summary(results, clock=args.clock))
  print(f"Wall figures: {args.repeats} run(s) per arm; load average {load:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end ({os.cpu_count()} CPUs).")
  if args.json:
    C.write_json(args.json, results)
  print(f"done in {time.perf_counter() - progress.start:.1f} s"
        + (f"; JSON in {args.json}" if args.json else ""), flush=True)


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__)
  add_args(parser)
  main(parser.parse_args())
