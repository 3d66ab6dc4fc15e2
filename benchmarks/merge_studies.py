"""Adds the modelled-clock rows of other studies runs to one run's report, and redraws it.

The modelled sweep's figures do not depend on this machine's load (every step is charged
the deployment's roofline cost), so its slowest part (concurrency 256: a compile of
1-2 minutes per arm here) can run in a second process beside the labelled drafts, and be
merged afterwards:

    av-jax bench --modelled-concurrencies 1,16,64 --out reports/v2
    av-jax bench --skip labels,throughput,per_workload,overhead \
      --modelled-concurrencies 256 --out reports/v2m256
    python benchmarks/merge_studies.py reports/v2 reports/v2m256

The merged report lists every run's command, commit and timings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from av_lab.studies import report


def merge(main_dir: str, others: list[str]) -> dict:
  """Appends each of `others`' modelled rows to `main_dir`'s studies.json (rewritten)."""
  path = os.path.join(main_dir, "studies.json")
  with open(path) as f:
    results = json.load(f)
  if not results.get("modelled"):
    raise ValueError(f"main_dir: {path} has no modelled sweep to add rows to")
  rows = results["modelled"]["rows"]
  settings = results["settings"]
  merged = results.setdefault("merged_runs", [])
  for other in others:
    with open(os.path.join(other, "studies.json")) as f:
      extra = json.load(f)
    if extra["settings"].get("modelled_clock") != settings.get("modelled_clock"):
      raise ValueError(f"others: {other} ran on the clock {extra['settings'].get('modelled_clock')}"
                       f", expected {settings.get('modelled_clock')}")
    have = {(r["drafter"], r["concurrency"]) for r in rows}
    new = [r for r in extra.get("modelled", {}).get("rows", [])
           if (r["drafter"], r["concurrency"]) not in have]
    if not new:
      raise ValueError(f"others: {other} adds no modelled (drafter, concurrency) point")
    rows.extend(new)
    settings["modelled_concurrencies"] = sorted(
        set(settings["modelled_concurrencies"]) | {r["concurrency"] for r in new})
    merged.append(dict(command=extra["command"], commit=extra.get("commit"),
                       timings=extra.get("timings"), hardware=extra.get("hardware"),
                       rows=len(new)))
  with open(path, "w") as f:
    json.dump(results, f, indent=1)
  report.render(main_dir)  # goals, tables and plots recomputed from the rows
  with open(path) as f:
    return json.load(f)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("main_dir", help="the run whose report is completed")
  p.add_argument("others", nargs="+", help="runs whose modelled rows are added")
  args = p.parse_args(argv)
  merge(args.main_dir, args.others)
  print(f"merged {', '.join(args.others)} into {args.main_dir}/studies.md")
  return 0


if __name__ == "__main__":
  sys.exit(main())
