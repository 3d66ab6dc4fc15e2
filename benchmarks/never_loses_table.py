"""Tabulates `benchmarks/never_loses.sh` runs (issue 14): AV against the best static arm.

    python benchmarks/never_loses_table.py OUT [--goal 0.97] [--mixed-goal 1.10]

For every (drafter, workload, concurrency): the best static arm (target_only or fixed:K,
by median tokens/s), AV's tokens/s, AV / best static as the median of the per-repeat
ratios (each repeat's AV run against the same repeat of that arm: side by side) with their
range, AV / target-only, the share of steps AV drafted on and the share of its priced
step cost those steps took (`drafting_cost_share`: exploration and re-checks where its
drafts do not pay). Prints a Markdown table and the goals met or missed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import numpy as np

STATIC = ("target_only",)


def _static(arm: str) -> bool:
  return arm == "target_only" or arm.startswith("fixed:")


def rows_of(paths):
  groups: dict = {}
  requests: dict = {}
  settings = None
  for path in sorted(paths):
    with open(path) as f:
      data = json.load(f)
    s = data["settings"]
    settings = settings or s
    for rec in data["results"]:
      key = (rec["drafter"], rec["workload"], rec["concurrency"])
      groups.setdefault(key, {})[rec["arm"]] = rec
      requests[key] = max(s["requests_per_slot"] * rec["concurrency"], s.get("min_requests", 0))
  out = []
  for (drafter, workload, B), arms in sorted(groups.items()):
    if "av" not in arms:
      continue
    static = {a: r for a, r in arms.items() if _static(a)}
    best = max(static, key=lambda a: static[a]["tokens_per_s"])
    per = lambda rec: {x["repeat"]: x["tokens_per_s"] for x in rec["repeats"]}
    av, ref = per(arms["av"]), per(static[best])
    ratio = [av[r] / ref[r] for r in av if r in ref]
    base = per(static["target_only"]) if "target_only" in static else {}
    to_base = [av[r] / base[r] for r in av if r in base]
    out.append(dict(drafter=drafter, workload=workload, concurrency=B, best=best,
                    requests=requests[(drafter, workload, B)],
                    best_tps=static[best]["tokens_per_s"], av_tps=arms["av"]["tokens_per_s"],
                    ratio=float(np.median(ratio)), lo=min(ratio), hi=max(ratio),
                    vs_target_only=float(np.median(to_base)) if to_base else None,
                    drafted=arms["av"].get("drafted_share"),
                    cost_share=arms["av"].get("drafting_cost_share"),
                    clock=arms["av"]["clock"]))
  return out, settings


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("out", help="the folder of never_loses.sh JSON files")
  p.add_argument("--goal", type=float, default=0.97)
  p.add_argument("--mixed-goal", type=float, default=1.10)
  args = p.parse_args(argv)
  rows, settings = rows_of(glob.glob(os.path.join(args.out, "*.json")))
  if not rows:
    raise SystemExit(f"out: no never_loses.sh JSON with an av arm in {args.out}")
  fmt = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"
  print("| drafter | workload | B | requests | best static | best tok/s | av tok/s | "
        "av / best (range) | av / target-only | steps drafting | drafting cost share | "
        ">= %.2f |" % args.goal)
  print("|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|")
  for r in rows:
    print(f"| {r['drafter']} | {r['workload']} | {r['concurrency']} | {r['requests']} | "
          f"{r['best']} | "
          f"{r['best_tps']:.1f} | {r['av_tps']:.1f} | {r['ratio']:.3f} ({r['lo']:.3f}-"
          f"{r['hi']:.3f}) | {fmt(r['vs_target_only'])} | {fmt(r['drafted'], 2)} | "
          f"{fmt(r['cost_share'], 2)} | {'met' if r['ratio'] >= args.goal else 'missed'} |")
  met = sum(r["ratio"] >= args.goal for r in rows)
  print(f"\nAV >= {args.goal}x best static: met at {met} of {len(rows)} points; lowest "
        f"{min(r['ratio'] for r in rows):.3f}")
  mixed = [r for r in rows if r["workload"] == "mixed"]
  if mixed:
    top = max(mixed, key=lambda r: r["ratio"])
    print(f"mixed: best AV / best static {top['ratio']:.3f} ({top['drafter']}, B = "
          f"{top['concurrency']}); goal >= {args.mixed_goal}: "
          f"{'met' if top['ratio'] >= args.mixed_goal else 'missed'}")
  if settings:
    print(f"settings: clock {settings['clock']}, max_new {settings['max_new']}, "
          f"repeats {settings['repeats']}, steps/chunk {settings.get('steps_per_chunk', 8)}, "
          f"warm_start {settings['warm_start']}, T {settings['temperature']}, top-p "
          f"{settings['top_p']}, K {settings['max_draft']}, jax {settings['jax']}, "
          f"device {settings['device']}")


if __name__ == "__main__":
  main()
