"""The studies suite: every measurement of the design note, on the shipped models.

`av-jax bench [--quick]` (or `python benchmarks/run_all.py`) runs, with fixed seeds:

1. labelled drafts: fixed K speculative decoding with every feature recorded, on every
   workload and drafter (`collect`);
2. the feature table, 3. estimator vs confidence head, 4. slope and intercepts with a
   workload-switch drift run (`analysis`);
5. throughput sweeps: AV on/off per drafter on the mixed workload and per workload for
   one drafter, and the Pareto picture of fixed K against AV with the oracle ceiling
   (`throughput`);
6. overhead: the per-step decision microbenchmark and AV's share of a decode step;

and writes `reports/studies.md` (tables, goals met or missed, the machine, the settings
and the command), PNG plots and `reports/studies.json` with every number.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from av_jax import _machine
from av_jax import compare
from av_jax._flags import at_least
from av_jax import data
from av_jax import engine as E
from av_jax import models as M
from av_jax.decision import make_decider, make_decision
from av_jax.estimator import EstimatorConfig
from av_jax.selection import linear_cost_model
from av_jax.studies import collect as C
from av_jax.studies import report
from av_jax.studies import throughput as T
from av_jax.studies.settings import DRAFTERS, WORKLOADS, Settings


def hardware() -> dict:
  out = _machine.describe()
  out["load_avg_start"] = out.pop("load_avg")
  return out


def _bar(total: int, desc: str, enabled: bool):
  return tqdm(total=total, desc=desc, disable=not enabled, mininterval=2.0, leave=False)


def _mixed_prompts(pair, num: int, length: int, seed: int) -> list[list[int]]:
  per = [data.prompts(w, tokenizer=pair.tokenizer, num=num, length=length, seed=seed).tolist()
         for w in WORKLOADS]
  return [per[i % len(WORKLOADS)][i // len(WORKLOADS)] for i in range(num)]


def study_labels(pairs, s: Settings, log, progress: bool) -> dict:
  """Studies 1-4 data: labelled drafts per (drafter, workload) and the drift run."""
  max_len = s.prompt_len + s.label_max_new + s.k + 8
  num_prompts = label_prompts(s)
  streams, traces = {}, {}
  total = len(s.label_drafters) * len(WORKLOADS) * s.label_steps + len(s.drift_workloads) * s.drift_steps
  bar = _bar(total, "labelled drafts", progress)
  engines = {}
  for kind in s.label_drafters:
    pair = pairs[kind]
    config = C.study_config(slots=s.label_slots, max_draft=s.k, max_len=max_len,
                            temperature=s.temperature, top_p=s.top_p,
                            refit_interval=s.refit_interval)
    engines[kind] = E.make_engine(config, pair.cfg, pair.drafter)
    params = E.Params(target=pair.target_params, drafter=pair.drafter_params)
    for w in WORKLOADS:
      prompts = data.prompts(w, tokenizer=pair.tokenizer, num=num_prompts,
                             length=s.prompt_len, seed=s.seed).tolist()
      stream = C.collect(engines[kind], params, [prompts], steps=s.label_steps,
                         max_new=s.label_max_new, key=jax.random.PRNGKey(s.seed),
                         progress=bar.update)
      streams[(kind, w)] = stream.drafts
      traces[(kind, w)] = stream.trace
      log(f"  labelled {kind:>10} {w:>5}: {len(stream.drafts):7d} drafts, "
          f"acceptance {stream.drafts.label.mean():.3f}, {stream.seconds:.1f} s")
  kind = s.drift_drafter
  pair = pairs[kind]
  params = E.Params(target=pair.target_params, drafter=pair.drafter_params)
  segments = [data.prompts(w, tokenizer=pair.tokenizer, num=num_prompts, length=s.prompt_len,
                           seed=s.seed + 1 + i).tolist()
              for i, w in enumerate(s.drift_workloads)]
  drift = C.collect(engines[kind], params, segments, steps=s.drift_steps,
                    max_new=s.label_max_new, key=jax.random.PRNGKey(s.seed + 7),
                    progress=bar.update)
  bar.close()
  log(f"  drift {' -> '.join(s.drift_workloads)}: {len(drift.drafts)} drafts, "
      f"{drift.seconds:.1f} s")
  return dict(streams=streams, traces=traces, drift=drift)


def label_prompts(s: Settings) -> int:
  """Prompts per labelled stream: enough that no slot runs out before the stream ends.

  A request commits at most K + 1 tokens a step, so it lasts at least
  ceil(label_max_new / (K + 1)) steps; a slot serves at most steps / that + 1 requests.
  (A fixed 4 per slot ran out after ~48 steps: idle slots label nothing.)
  """
  steps = max(s.label_steps, s.drift_steps)
  shortest = -(-s.label_max_new // (s.k + 1))
  return s.label_slots * max(4, steps // shortest + 1)


def _pareto_arms(s: Settings) -> list:
  return T.pareto_arms(s.pareto_ks, s.k, confstop=s.confstop)


def study_throughput(pairs, s: Settings, log, progress: bool, compiled: dict | None = None,
                     concurrencies=None) -> list[dict]:
  """Study 5 rows: every (drafter, workload, concurrency, arm, repeat), wall clock."""
  max_len = s.prompt_len + s.throughput_max_new + s.k + 8
  sweeper = T.Sweeper(temperature=s.temperature, top_p=s.top_p, max_len=max_len,
                      refit_interval=s.refit_interval, seed=s.seed, log=log,
                      compiled=compiled)
  # (drafter, workload) -> arms
  cases = {}
  for kind in s.on_off_drafters:
    cases[(kind, "mixed")] = T.on_off_arms(s.k)
  cases[(s.pareto_drafter, "mixed")] = _pareto_arms(s)
  for w in WORKLOADS if s.per_workload else ():
    cases.setdefault((s.per_workload_drafter, w), T.on_off_arms(s.k))
  concurrencies = s.concurrencies if concurrencies is None else concurrencies
  return _sweep(sweeper, pairs, s, cases, concurrencies, s.repeats, log,
                _bar(sum(len(a) for a in cases.values()) * len(concurrencies) * s.repeats,
                     "throughput", progress))


def study_modelled(pairs, s: Settings, log, progress: bool, compiled: dict | None = None,
                   concurrencies=None) -> list[dict]:
  """Study 5 on the modelled accelerator clock: the Pareto arms per modelled drafter
  (mixed workload), each step charged the deployment's roofline cost (`compare`)."""
  max_len = s.prompt_len + s.throughput_max_new + s.k + 8
  runner = compare.Runner(temperature=s.temperature, top_p=s.top_p, max_len=max_len,
                          refit_interval=s.refit_interval, seed=s.seed, log=log,
                          clock=compare.parse_clock(s.modelled_clock), compiled=compiled)
  cases = {(kind, "mixed"): _pareto_arms(s) for kind in s.modelled_drafters}
  concurrencies = s.modelled_concurrencies if concurrencies is None else concurrencies
  total = sum(len(a) for a in cases.values()) * len(concurrencies) * s.modelled_repeats
  return _sweep(runner, pairs, s, cases, concurrencies, s.modelled_repeats, log,
                _bar(total, "modelled", progress))


def _sweep(runner, pairs, s: Settings, cases: dict, concurrencies, repeats: int, log,
           bar) -> list[dict]:
  rows = []
  for c in concurrencies:
    num = max(4, s.requests_per_slot * c)
    for (kind, w), arms in cases.items():
      pair = pairs[kind]
      if w == "mixed":
        prompts = _mixed_prompts(pair, num, s.prompt_len, s.seed)
      else:
        prompts = data.prompts(w, tokenizer=pair.tokenizer, num=num, length=s.prompt_len,
                               seed=s.seed).tolist()
      for arm in arms:  # compile and profile before any timing
        runner.engine(pair, c, arm, prompts)
      for r in range(repeats):
        for arm in arms:
          row = runner.run(pair, c, arm, prompts, max_new=s.throughput_max_new, repeat=r)
          row["workload"] = w
          rows.append(row)
          bar.update(1)
      log(f"  {runner.clock.name} {kind:>10} {w:>5} B={c:3d}: " + ", ".join(
          f"{a.name} {np.median([x['tokens_per_s'] for x in rows if x['drafter'] == kind and x['workload'] == w and x['concurrency'] == c and x['arm'] == a.name]):.0f}"
          for a in arms) + " tok/s")
  bar.close()
  return rows


def study_overhead(s: Settings, pair, throughput_rows, log) -> dict:
  """Study 6: the decision microbenchmark and its share of an AV decode step."""
  B, K = max(s.concurrencies), s.k
  V = pair.cfg.target.vocab_size
  cost = linear_cost_model(B, B * (K + 1), verify_fixed=1.0, verify_per_token=0.02)
  decider = make_decider(K, policy="lagged",
                         estimator=EstimatorConfig(refit_interval=s.refit_interval))
  # The engine scores the already top-p-filtered log-probs it samples from, so the
  # decision's feature pass runs with top_p=1 on them (no extra nucleus pass).
  decide = make_decision(decider, temperature=1.0, top_p=1.0)

  def median_ms(vocab: int) -> tuple[float, list[float]]:
    logits = jax.random.normal(jax.random.PRNGKey(0), (B, K, vocab)) * 3.0
    state = decide.init(B)
    acc, lab, act = np.zeros((B, K), bool), np.zeros((B, K), bool), np.ones((B,), bool)
    for _ in range(3):
      plan, state = decide.step(state, logits, acc, lab, act, cost)
    jax.block_until_ready(plan)
    times = []
    for _ in range(s.overhead_repeats):
      start = time.perf_counter()
      plan, state = decide.step(state, logits, acc, lab, act, cost)
      jax.block_until_ready(plan)
      times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times)), times

  decision_ms, times = median_ms(V)
  # A step that does not draft runs only the O(B K) part (predict, plan): timed with a
  # one-token vocabulary, so the feature pass is negligible.
  small_ms, _ = median_ms(1)
  av = [r for r in throughput_rows if r["mode"] == "av" and r["concurrency"] == B]
  step_ms = float(np.median([1e3 * r["seconds"] / r["steps"] for r in av])) if av else None
  drafted = float(np.median([r.get("drafted_share", 1.0) for r in av])) if av else 1.0
  share = decision_ms / step_ms if step_ms else None
  per_step_ms = drafted * decision_ms + (1 - drafted) * small_ms
  amortized = per_step_ms / step_ms if step_ms else None
  log(f"  decision B={B} K={K} V={V}: {decision_ms:.2f} ms ({small_ms:.2f} ms without the "
      f"feature pass); AV decode step "
      f"{'n/a (no throughput run)' if step_ms is None else f'{step_ms:.1f} ms'}, drafting "
      f"{drafted:.0%} of steps; amortized share "
      f"{'n/a' if amortized is None else f'{100 * amortized:.2f}%'}")
  return dict(batch=B, k=K, vocab=V, decision_ms=decision_ms, decision_ms_all=times,
              decision_ms_no_features=small_ms, av_step_ms=step_ms, share=share,
              drafted_share=drafted, per_step_ms=per_step_ms, amortized_share=amortized,
              recompiles=decide.num_traces() - 2)


def _save(out: str, results: dict, s: Settings, timings: dict, start: float, **studies
          ) -> None:
  """Writes the report with what has run so far (a later study adds to it)."""
  results["timings"] = dict(timings, total_s=time.perf_counter() - start)
  results["partial"] = True
  report.write(out, results, s, **studies)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="av-jax bench", description=__doc__.split("\n")[0])
  add_args(p)
  return run(p.parse_args(argv))


def add_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--quick", action="store_true", help="reduced suite (minutes)")
  p.add_argument("--out", default="reports", help="output folder")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--no-progress", action="store_true", help="no progress bars")
  p.add_argument("--concurrencies", default=None,
                 help="comma-separated concurrencies (overrides the preset)")
  p.add_argument("--on-off-drafters", default=None,
                 help="comma-separated drafters for the AV on/off sweep (overrides)")
  p.add_argument("--pareto-ks", default=None,
                 help="comma-separated fixed K of the Pareto sweep, 0 = target only")
  p.add_argument("--repeats", type=at_least(1), default=None, help="timed repeats per arm")
  p.add_argument("--modelled-concurrencies", default=None,
                 help="comma-separated concurrencies of the modelled-clock sweep (overrides)")
  p.add_argument("--render-only", action="store_true",
                 help="rewrite studies.md and the plots from an existing studies.json")
  p.add_argument("--skip", default="", type=_skip_list,
                 help=f"comma-separated studies to skip: {','.join(SKIPPABLE)}")


SKIPPABLE = ("labels", "throughput", "per_workload", "modelled", "overhead")  # names --skip accepts


def _skip_list(text: str) -> str:
  """An argparse type for --skip: every name must be a known study."""
  unknown = sorted({x for x in text.split(",") if x} - set(SKIPPABLE))
  if unknown:
    raise argparse.ArgumentTypeError(f"unknown studies {unknown}; known: "
                                     f"{', '.join(SKIPPABLE)}")
  return text


def run(args) -> int:
  if args.render_only:
    report.render(args.out)
    print(f"rendered {args.out}/studies.md from {args.out}/studies.json")
    return 0
  start = time.perf_counter()
  s = Settings.quick() if args.quick else Settings()
  skip = {x for x in args.skip.split(",") if x}
  s.seed = args.seed
  ints = lambda text: tuple(int(x) for x in text.split(",") if x)
  if args.concurrencies:
    s.concurrencies = ints(args.concurrencies)
  if args.pareto_ks:
    s.pareto_ks = ints(args.pareto_ks)
  if args.on_off_drafters:
    s.on_off_drafters = tuple(x for x in args.on_off_drafters.split(",") if x)
    bad = set(s.on_off_drafters) - set(DRAFTERS)
    if bad:
      raise ValueError(f"--on-off-drafters: unknown {sorted(bad)}; expected {DRAFTERS}")
  if args.repeats:
    s.repeats = args.repeats
  if args.modelled_concurrencies:
    s.modelled_concurrencies = ints(args.modelled_concurrencies)
  if "modelled" in skip:
    s.modelled_clock = None
  if "labels" in skip:  # nothing to label: load only the drafters the sweeps use
    s.label_drafters = ()
  if "per_workload" in skip:
    s.per_workload = False
  s.validate()
  progress = not args.no_progress and sys.stderr.isatty()
  os.makedirs(args.out, exist_ok=True)
  flags = [("--quick", args.quick), (f"--seed {args.seed}", args.seed),
           (f"--skip {args.skip}", args.skip),
           (f"--concurrencies {args.concurrencies}", args.concurrencies),
           (f"--on-off-drafters {args.on_off_drafters}", args.on_off_drafters),
           (f"--pareto-ks {args.pareto_ks}", args.pareto_ks),
           (f"--repeats {args.repeats}", args.repeats),
           (f"--modelled-concurrencies {args.modelled_concurrencies}",
            args.modelled_concurrencies)]
  command = " ".join(["av-jax bench"] + [flag for flag, given in flags if given])
  log_lines = []

  def log(msg):
    log_lines.append(msg)
    print(msg, flush=True)

  log(f"{command}: writing {args.out}/studies.md")
  kinds = sorted(set(s.label_drafters) | set(s.on_off_drafters) | {
      s.pareto_drafter, s.per_workload_drafter} | ({s.drift_drafter} if s.label_drafters
                                                   else set())
      | (set(s.modelled_drafters) if s.modelled_clock else set()), key=DRAFTERS.index)
  pairs = {k: M.load(s.models, drafter=k) for k in kinds}
  results = dict(command=command, settings=dataclasses.asdict(s), hardware=hardware(),
                 quick=bool(args.quick), commit=_machine.commit())
  # Facts the report's prose states, read from what ran rather than written into it.
  target = next(iter(pairs.values())).cfg.target if pairs else None
  results["target"] = None if target is None else dict(num_layers=target.num_layers,
                                                       d_model=target.d_model)
  results["estimator"] = dataclasses.asdict(C.study_config(
      slots=1, max_draft=s.k, max_len=s.k + 3, temperature=s.temperature, top_p=s.top_p,
      refit_interval=s.refit_interval).estimator)
  timings = {}
  labels = throughput_rows = modelled_rows = overhead = None
  compiled = {}  # engines built once for the wall and the modelled sweeps
  if "labels" not in skip:
    t = time.perf_counter()
    log("[1-4] labelled drafts")
    labels = study_labels(pairs, s, log, progress)
    timings["labels_s"] = time.perf_counter() - t
    _save(args.out, results, s, timings, start, labels=labels)
  # One concurrency at a time: its wall sweep, then its modelled sweep on the same
  # compiled engines; then every engine is released (a process that keeps ~30 compiled
  # engines alive exhausts the kernel's memory-map limit in LLVM's JIT: a crash seen at
  # the 27th), and the report so far is written, so a crash loses one concurrency only.
  wall = s.concurrencies if "throughput" not in skip else ()
  modelled = s.modelled_concurrencies if s.modelled_clock else ()
  for c in sorted(set(wall) | set(modelled)):
    if c in wall:
      t = time.perf_counter()
      log(f"[5] throughput, concurrency {c}")
      throughput_rows = (throughput_rows or []) + study_throughput(
          pairs, s, log, progress, compiled, concurrencies=(c,))
      timings["throughput_s"] = timings.get("throughput_s", 0.0) + time.perf_counter() - t
      for key in [k for k in compiled if k[0] not in s.modelled_drafters or c not in modelled]:
        del compiled[key]  # the modelled sweep needs only its drafters' engines
      gc.collect()
    if c in modelled:
      t = time.perf_counter()
      log(f"[5m] throughput on the modelled clock {s.modelled_clock}, concurrency {c}")
      modelled_rows = (modelled_rows or []) + study_modelled(
          pairs, s, log, progress, compiled, concurrencies=(c,))
      timings["modelled_s"] = timings.get("modelled_s", 0.0) + time.perf_counter() - t
    compiled.clear()
    jax.clear_caches()
    gc.collect()
    _save(args.out, results, s, timings, start, throughput_rows=throughput_rows,
          modelled_rows=modelled_rows)
  if "overhead" not in skip:
    t = time.perf_counter()
    log("[6] overhead")
    overhead = study_overhead(s, pairs[kinds[0]], throughput_rows or [], log)
    timings["overhead_s"] = time.perf_counter() - t
  timings["total_s"] = time.perf_counter() - start
  results["timings"] = timings
  results["partial"] = False
  results["hardware"]["load_avg_end"] = list(os.getloadavg())
  report.write(args.out, results, s, labels=labels, throughput_rows=throughput_rows,
               modelled_rows=modelled_rows, overhead=overhead)
  log(f"done in {timings['total_s']:.0f} s: {args.out}/studies.md, {args.out}/studies.json")
  return 0


if __name__ == "__main__":
  sys.exit(main())
