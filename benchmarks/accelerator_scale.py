"""The accelerator-scale study (issue 13 item 4): fixed K against AV on a modelled H200.

    PYTHONPATH=. python benchmarks/accelerator_scale.py --quick --out reports/scale_quick
    PYTHONPATH=. python benchmarks/accelerator_scale.py --out reports/scale   # full preset

Acceptance comes from the shipped models decoding held-out prompts here (`--models`,
default the shipped `default` set); time from the modelled H200 / llama3-8b clock
(`av_jax.costs.roofline_costs`, fused serving kernels, 2048-token contexts), each drafter
kind with its deployment cost shape (`av_lab.compare.DEPLOYMENT_DRAFTERS`: block ->
DFlash-style, eagle -> EAGLE-3-style, draft_lm -> MTP-style). Arms: fixed K in {0, 1, 2, 3,
4, 6, 8} (K = 0 is target only) and AV (K = 8), at concurrency 1 ... 256. Writes
`scale.json` (`av-jax compare`'s settings and records plus the goals), `scale.md` and,
when matplotlib is installed, `pareto.png` (total vs per-request tokens/s).

The goals of the issue, each reported met or missed with the figures behind it: AV on the
frontier at >= 8 of 9 concurrencies; AV >= 0.98x the best fixed K at concurrency 1-16;
AV >= 1.15x fixed K = 8 at 64; AV >= 1.3x the best fixed K at 256.

Presets (this 2-core CPU): `--quick` one drafter (block), concurrency 1, 16, 64, 256, arms
K in {0, 2, 8} + AV, 16 new tokens per request; full: block, all nine concurrencies and all
arms, 24 new tokens, one request per slot (at least 16 per run). Add
drafters with `--drafters block,eagle,draft_lm` (each adds a full preset's time). Rerun
unchanged on another model set with `--models NAME`. By default the online estimator is
fitted on a warm-up run of other prompts first (a running server's state; the runs are
short, a few estimator rounds); `--cold-start` starts every run from its prior.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from av_lab import compare as C

# Step counts are chosen so that the full preset fits the 30 minutes on this 2-core
# CPU at the v2 target's size (acceptance is what the models contribute; time is modelled):
# one request per slot (at least 16 per run) of 24 new tokens. Flags override them.
FULL = dict(concurrency=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            arms="target_only,fixed:1,fixed:2,fixed:3,fixed:4,fixed:6,fixed:8,av",
            drafters="block", requests_per_slot=1, max_new=24, min_requests=16)
QUICK = dict(concurrency=(1, 16, 64, 256), arms="target_only,fixed:2,fixed:8,av",
             drafters="block", requests_per_slot=1, max_new=16, min_requests=8)
AV = "av"


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, help="folder for scale.json, scale.md, pareto.png")
  p.add_argument("--quick", action="store_true", help="reduced preset (<= 5 min idle)")
  p.add_argument("--models", default="default", help="shipped model set (acceptance)")
  p.add_argument("--drafters", default=None, help="comma-separated drafter kinds")
  p.add_argument("--concurrency", default=None, help="comma-separated concurrencies")
  p.add_argument("--arms", default=None, help="comma-separated arms (av-jax compare)")
  p.add_argument("--clock", default="h200:llama3-8b", help="DEVICE:SHAPE or a table .json")
  p.add_argument("--context-len", type=int, default=2048, help="KV positions per request")
  p.add_argument("--max-new", type=int, default=None, help="tokens per request (preset)")
  p.add_argument("--repeats", type=int, default=1, help="runs per arm (interleaved)")
  p.add_argument("--min-requests", type=int, default=None,
                 help="requests per run at least (preset)")
  p.add_argument("--requests-per-slot", type=int, default=None,
                 help="requests per slot per run (preset)")
  p.add_argument("--steps-per-chunk", type=int, default=1,
                 help="decode steps between refills (1: a serving stack's per-step refill)")
  p.add_argument("--cold-start", action="store_true",
                 help="every run starts from the estimator's prior (default: fitted on a "
                      "warm-up run of other prompts, as in a running server)")
  return p.parse_args(argv)


def _ratios(results: list[dict], metric: str) -> dict:
  """{(drafter, B): dict(av, best, best_arm, fixed8, frontier)} under `metric`."""
  out = {}
  for key in {(r["drafter"], r["concurrency"]) for r in results}:
    group = [r for r in results if (r["drafter"], r["concurrency"]) == key]
    static = [r for r in group if r["mode"] in C.STATIC_MODES]
    best = max(static, key=lambda r: r[metric])
    av = next(r for r in group if r["arm"] == AV)
    per = "steady_per_request_tokens_per_s" if metric.startswith("steady") else (
        "per_request_tokens_per_s")
    front = C.pareto_front([(r[per], r[metric]) for r in group])
    f8 = next((r for r in group if r["arm"] == "fixed:8"), None)
    out[key] = dict(vs_best=av[metric] / best[metric], best_arm=best["arm"],
                    vs_fixed8=None if f8 is None else av[metric] / f8[metric],
                    on_front=group.index(av) in front)
  return out


def goals(results: list[dict], metric: str = "tokens_per_s") -> list[dict]:
  """The issue's four goals per drafter under `metric`, met or missed, with the figures."""
  out = []
  table = _ratios(results, metric)
  for drafter in sorted({r["drafter"] for r in results}):
    av = {c: v for (d, c), v in table.items() if d == drafter}
    conc = sorted(av)
    on = [c for c in conc if av[c]["on_front"]]
    need = max(len(conc) - 1, 1)
    off = [f"B={c} (best static {av[c]['best_arm']}, AV {av[c]['vs_best']:.3f}x)"
           for c in conc if c not in on]
    row = lambda goal, met, figures: dict(drafter=drafter, metric=metric, goal=goal, met=met,
                                         figures=figures)
    out.append(row(f"AV on the frontier at >= {need} of {len(conc)} concurrencies",
                   len(on) >= need, f"{len(on)} of {len(conc)}"
                   + (f"; off at {', '.join(off)}" if off else "")))
    low = [c for c in conc if c <= 16]
    out.append(row("AV >= 0.98x the best fixed K at concurrency 1-16",
                   bool(low) and min(av[c]["vs_best"] for c in low) >= 0.98,
                   ", ".join(f"B={c}: {av[c]['vs_best']:.3f}x ({av[c]['best_arm']})"
                             for c in low) or "not run"))
    v64 = av.get(64, {}).get("vs_fixed8")
    out.append(row("AV >= 1.15x fixed K=8 at concurrency 64", v64 is not None and v64 >= 1.15,
                   "not run" if v64 is None else f"{v64:.3f}x"))
    r256 = av.get(256)
    out.append(row("AV >= 1.3x the best fixed K at concurrency 256",
                   r256 is not None and r256["vs_best"] >= 1.3, "not run" if r256 is None
                   else f"{r256['vs_best']:.3f}x ({r256['best_arm']})"))
  return out


def markdown(result: dict, goal_rows: list[dict], command: str) -> str:
  s = result["settings"]
  lines = [f"# Accelerator-scale study (modelled: {s['clock'].replace(':', ' / ')} shapes, "
           f"acceptance from av_jax {s['models']} models)", "",
           f"Acceptance from av_jax `{s['models']}` models on this machine ({s['device']}, "
           f"jax {s['jax']}); time modelled ({s['clock']}, context {s['context_len']}, "
           f"drafter cost shapes {s['drafter_shapes']}). {s['max_new']} new tokens per "
           f"request, prompts of {s['prompt_len']}, >= {s['min_requests']} requests per run, "
           f"{s['repeats']} repeat(s), estimator "
           f"{'fitted on a warm-up run first' if s['warm_start'] else 'from its prior'}; "
           f"{s['seconds']:.0f} s.", "", f"    {command}", "",
           "## Goals", "", "Whole run (`tokens_per_s`: every step, the final drain included) and "
           "steady state (`steady_tokens_per_s`: the steps with every slot busy).", "",
           "| drafter | metric | goal | status | figures |", "|---|---|---|---|---|"]
  for g in goal_rows:
    lines.append(f"| {g['drafter']} | {g['metric']} | {g['goal']} | "
                 f"{'met' if g['met'] else 'missed'} | {g['figures']} |")
  arms = s["arms"]
  for drafter in s["drafters"]:
    rows = [r for r in result["results"] if r["drafter"] == drafter]
    lines += ["", f"## {drafter}: modelled tokens/s (per-request tokens/s), AV ratios", "",
              "| B | " + " | ".join(arms) + " | AV / best static | AV / fixed:8 |",
              "|---:|" + "---:|" * (len(arms) + 2)]
    for c in s["concurrency"]:
      at = {r["arm"]: r for r in rows if r["concurrency"] == c}
      cells = [f"{at[a]['tokens_per_s']:.0f} ({at[a]['per_request_tokens_per_s']:.0f})"
               + ("*" if at[a]["on_frontier"] else "")
               + (f" / {at[a]['steady_tokens_per_s']:.0f}" if at[a].get("steady_tokens_per_s")
                  else "") if a in at else "" for a in arms]
      av = at.get(AV)
      ratio = "" if av is None else f"{av['vs_best_static']:.3f} ({av['best_static']})"
      r8 = "" if av is None or "fixed:8" not in av["vs"] else f"{av['vs']['fixed:8']:.3f}"
      lines.append(f"| {c} | " + " | ".join(cells) + f" | {ratio} | {r8} |")
    lines += ["", "Cells: whole-run tokens/s (per-request tokens/s), `*` on the whole-run Pareto "
                  "frontier at that concurrency, `/` steady-state tokens/s. Ratios: whole run. "
                  "Acceptance and tokens/step per arm are in scale.json."]
  return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> bool:
  """Total vs per-request tokens/s, one line per arm across concurrencies (if matplotlib)."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top  (deferred: optional)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top  (deferred: optional)
  except ImportError:
    return False
  s = result["settings"]
  fig, axes = plt.subplots(1, len(s["drafters"]), figsize=(6.5 * len(s["drafters"]), 5),
                           squeeze=False)
  for ax, drafter in zip(axes[0], s["drafters"]):
    for arm in s["arms"]:
      pts = sorted((r["concurrency"], r["per_request_tokens_per_s"], r["tokens_per_s"])
                   for r in result["results"] if r["drafter"] == drafter and r["arm"] == arm)
      style = dict(lw=2.5, color="k") if arm == AV else dict(lw=1, alpha=0.8)
      ax.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", label=arm, **style)
      if arm == AV:
        for c, x, y in pts:
          ax.annotate(str(c), (x, y), fontsize=7)
    ax.set(xscale="log", yscale="log", xlabel="per-request tokens/s (modelled)",
           ylabel="total tokens/s (modelled)", title=f"{drafter}: {s['clock']} (labels = B)")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def main(argv=None) -> int:
  args = parse_args(argv)
  preset = QUICK if args.quick else FULL
  flags = " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
  command = f"PYTHONPATH=. python benchmarks/accelerator_scale.py {flags}"
  os.makedirs(args.out, exist_ok=True)
  start = time.perf_counter()
  result = C.compare(drafters=args.drafters or preset["drafters"], workloads=C.MIXED,
                     concurrency=args.concurrency or preset["concurrency"],
                     arms=args.arms or preset["arms"], repeats=args.repeats,
                     clock=args.clock, models=args.models, max_draft=8,
                     max_new=args.max_new or preset["max_new"], prompt_len=32,
                     requests_per_slot=args.requests_per_slot or preset["requests_per_slot"],
                     min_requests=args.min_requests or preset["min_requests"],
                     warm_start=not args.cold_start,
                     context_len=args.context_len, refit_interval=16,
                     steps_per_chunk=args.steps_per_chunk,
                     log=lambda line: print(line, flush=True))
  goal_rows = goals(result["results"]) + goals(result["results"], "steady_tokens_per_s")
  result.update(goals=goal_rows, command=command)
  C.write_json(os.path.join(args.out, "scale.json"), result)
  with open(os.path.join(args.out, "scale.md"), "w") as f:
    f.write(markdown(result, goal_rows, command))
  plotted = plot(result, os.path.join(args.out, "pareto.png"))
  print(open(os.path.join(args.out, "scale.md")).read())
  print(f"done in {time.perf_counter() - start:.0f} s"
        + ("" if plotted else " (no matplotlib: no plot)"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
