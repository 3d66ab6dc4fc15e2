"""The studies report: Markdown tables, PNG plots and JSON of every number."""

from __future__ import annotations

import json
import os

import numpy as np

from av_jax import compare
from av_jax.studies import analysis as A
from av_jax.studies import throughput as T
from av_jax.studies.collect import FEATURE_NAMES, Drafts
from av_jax.studies.settings import Settings

ESTIMATOR = "logit(q_max), shared slope (shipped)"
SERVED = "online estimator (served)"
HEAD = "confidence head (trained)"


def _f(x, digits=3) -> str:
  if x is None or (isinstance(x, float) and not np.isfinite(x)):
    return "n/a"
  return f"{x:.{digits}f}"


def _g(x) -> str:
  """A number as recorded (`50`, `0.001`), or n/a when it was not."""
  return "n/a" if x is None else f"{x:g}"


def _table(header: list[str], rows: list[list]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
  return "\n".join(lines)


def _after_warmup(drafts: Drafts, s) -> np.ndarray:
  return drafts.step >= s.warmup_rounds * s.refit_interval


def analyse_labels(labels: dict, s) -> dict:
  """Every number of studies 1-4 (JSON-able)."""
  streams: dict = labels["streams"]
  K = s.k
  out: dict = {}
  # 1. Labelled drafts.
  out["labelled"] = [dict(drafter=d, workload=w, drafts=len(x), acceptance=float(x.label.mean()),
                          acceptance_at=[float(x.label[x.position == k].mean())
                                         if np.any(x.position == k) else None for k in range(K)],
                          mean_entropy=float(-x.feature("neg_entropy").mean()))
                     for (d, w), x in streams.items()]
  # 2. Feature table: one fit per drafter (its workloads pooled), out of sample.
  per_drafter: dict = {}
  for (d, w), x in streams.items():
    per_drafter.setdefault(d, []).append(x)
  per_drafter = {d: _renumber(xs) for d, xs in per_drafter.items()}
  oos = A.out_of_sample(per_drafter, K)
  lossless = {name: spec[3] for name, spec in A.PREDICTORS.items()}
  lossless[SERVED] = lossless[HEAD] = True
  out["feature_table"] = [dict(predictor=name, lossless=lossless[name],
                               **A.score(p, y)) for name, (p, y, _) in oos.items()]
  # 3. Estimator vs head, on the drafter with a head.
  if HEAD in oos and "block_head" in per_drafter:
    head_oos = A.out_of_sample({"block_head": per_drafter["block_head"]}, K)
    names = (ESTIMATOR, SERVED, HEAD, "q_max, no fit")
    cmp = {}
    for name in names:
      p, y, pos = head_oos[name]
      cmp[name] = dict(overall=A.score(p, y), excluding_position_1=A.score(p[pos > 0], y[pos > 0]),
                       auc_at=A.per_position(p, y, pos, K),
                       ece_at=A.per_position(p, y, pos, K, "ece"),
                       reliability=A.reliability(p, y))
    out["estimator_vs_head"] = cmp
  # 4. Coefficients per (drafter, workload), correlation with entropy.
  coef = []
  for (d, w), x in streams.items():
    fit = A.fit_logistic(x.feature("logit_qmax"), x.position, x.label, K)
    coef.append(dict(drafter=d, workload=w, slope=float(fit.slope),
                     intercepts=[float(b) for b in fit.intercepts],
                     mean_entropy=float(-x.feature("neg_entropy").mean()),
                     acceptance=float(x.label.mean())))
  ent = np.asarray([c["mean_entropy"] for c in coef])
  out["coefficients"] = coef
  out["correlation"] = dict(
      slope_vs_entropy=_corr(ent, [c["slope"] for c in coef]),
      intercept1_vs_entropy=_corr(ent, [c["intercepts"][0] for c in coef]),
      pairs=len(coef))
  out["traces"] = [dict(drafter=d, workload=w, step=t.step.tolist(), slope=t.slope.tolist(),
                        intercept1=t.intercepts[:, 0].tolist(),
                        num_refits=t.num_refits.tolist())
                   for (d, w), t in labels["traces"].items()]
  # Served-estimator calibration after warm-up, pooled over every stream.
  pooled = Drafts.concat([x.take(_after_warmup(x, s)) for x in streams.values()])
  out["served_after_warmup"] = A.score(pooled.served, pooled.label)
  out["served_after_warmup_by_drafter"] = {
      d: A.score(*(lambda z: (z.served, z.label))(Drafts.concat(
          [x.take(_after_warmup(x, s)) for (dd, _), x in streams.items() if dd == d])))
      for d in per_drafter}
  # Drift.
  drift = labels["drift"]
  rows = A.round_ece(drift.drafts, s.refit_interval)
  out["drift"] = dict(workloads=list(s.drift_workloads), rounds=rows, drafts=len(drift.drafts),
                      recovery=A.recovery_rounds(rows),
                      trace=dict(step=drift.trace.step.tolist(),
                                 slope=drift.trace.slope.tolist(),
                                 intercept1=drift.trace.intercepts[:, 0].tolist()))
  return out


def _renumber(parts: list[Drafts]) -> Drafts:
  """Concatenates streams as separate segments (so splits happen within each)."""
  return Drafts.concat([Drafts(**{**x.__dict__, "segment": np.full(len(x), i, np.int32)})
                        for i, x in enumerate(parts)])


def _corr(a, b) -> float | None:
  a, b = np.asarray(a, float), np.asarray(b, float)
  if len(a) < 3 or a.std() == 0 or b.std() == 0:
    return None
  return float(np.corrcoef(a, b)[0, 1])


def analyse_throughput(rows: list[dict], s) -> dict:
  summary = T.summarize(rows)
  fixed_k = f"fixed K={s.k}"
  av = f"AV (K={s.k})"
  ratio = T.ratios(rows, baseline=fixed_k)
  pareto = {}
  for c in s.concurrencies:
    pts = [r for r in summary if r["drafter"] == s.pareto_drafter and r["workload"] == "mixed"
           and r["concurrency"] == c and r["mode"] != "oracle"]
    front = T.pareto_front([(r["per_request_tokens_per_s"], r["tokens_per_s"]) for r in pts])
    best_fixed = max((r for r in pts if r["mode"] in ("fixed", "target_only")),
                     key=lambda r: r["tokens_per_s"], default=None)
    av_row = next((r for r in pts if r["arm"] == av), None)
    pareto[c] = dict(on_front=[pts[i]["arm"] for i in front],
                     best_fixed=best_fixed and best_fixed["arm"],
                     av_vs_best_fixed=(av_row["tokens_per_s"] / best_fixed["tokens_per_s"]
                                       if av_row and best_fixed else None))
  return dict(rows=rows, summary=summary,
              ratios=[dict(drafter=d, workload=w, concurrency=c, arm=a, **v)
                      for (d, w, c, a), v in ratio.items()],
              pareto=pareto, versus=versus(rows))


def versus(rows: list[dict]) -> list[dict]:
  """Per (drafter, workload, concurrency) with an AV arm: AV against the best static arm
  of the group, target only and the best confidence-stop arm; the oracle against the best static arm; drafter passes per step.
  Ratios of medians over repeats (`compare.records`)."""
  recs = compare.records(rows)
  out = []
  for av in (r for r in recs if r["mode"] == "av"):
    group = [r for r in recs if (r["drafter"], r["workload"], r["concurrency"]) ==
             (av["drafter"], av["workload"], av["concurrency"])]
    one = lambda pred: next((r for r in group if pred(r)), None)
    ratio = lambda other: av["tokens_per_s"] / other["tokens_per_s"] if other else None
    best = one(lambda r: r["arm"] == av["best_static"])
    target = one(lambda r: r["mode"] == "target_only")
    oracle = one(lambda r: r["mode"] == "oracle")
    conf = max((r for r in group if r["mode"].startswith("confstop")),
               key=lambda r: r["tokens_per_s"], default=None)
    out.append(dict(
        drafter=av["drafter"], workload=av["workload"], concurrency=av["concurrency"],
        clock=av["clock"], static_arms=sum(r["mode"] in compare.STATIC_MODES for r in group),
        best_static=av["best_static"], av_tokens_per_s=av["tokens_per_s"],
        av_vs_best_static=av["vs_best_static"],
        av_steady_vs_best_static=av["steady_vs_best_static"],
        av_vs_target_only=ratio(target),
        best_confstop=conf and conf["arm"], av_vs_best_confstop=ratio(conf),
        oracle_vs_best_static=(oracle["tokens_per_s"] / best["tokens_per_s"]
                               if oracle and best else None),
        av_passes_per_step=av["draft_passes_per_step"],
        av_drafted_share=av["drafted_share"]))
  return out


def analyse_modelled(rows: list[dict], s) -> dict:
  """The modelled-clock sweep: records per arm (ratios to the best static arm) and the
  AV comparisons per (drafter, concurrency)."""
  recs = compare.records(rows)
  # The clock's label names the shapes it charges (an AV record's: its K, not K = 1).
  label = next((r.get("clock_label") for r in recs if r.get("clock_label")
                and r["mode"] == "av"), s.modelled_clock)
  return dict(clock=s.modelled_clock, clock_label=label, rows=rows, records=recs,
              versus=versus(rows))


SERVED_ECE_GOAL, FITTED_ECE_GOAL = 0.015, 0.01
FEATURE_AUC_GOAL = 0.80
LABELS_GOAL = 300_000
SHARE_GOAL = 0.02


def _verdict(ok: bool, miss: str = "missed") -> str:
  return "met" if ok else miss


def _ratio_goal(name: str, entries: list[tuple[str, float | None]], bound: float) -> list:
  """A goal 'every entry >= bound', listing the entries and the misses."""
  measured = ", ".join(f"{k}: {_f(v, 3)}x" for k, v in entries) or "not measured"
  bad = [k for k, v in entries if v is None or v < bound]
  verdict = ("not measured" if not entries else
             "met" if not bad else f"missed at {', '.join(bad)}")
  return [name, measured, verdict]


def _served(lab: dict, s) -> tuple[float, int, str]:
  """The served estimator's pooled ECE, its count and which predictions it scores."""
  e, n = lab["served_after_warmup"]["ece"], lab["served_after_warmup"]["n"]
  if n:
    return e, n, f"after {s.warmup_rounds} warm-up round(s)"
  # Streams that end inside the warm-up (a report of older settings): the feature table's
  # served row, the predictions served on the streams' second halves.
  row = next(r for r in lab["feature_table"] if r["predictor"] == SERVED)
  return row["ece"], row["n"], "on the streams' second halves (none after the warm-up setting)"


def goals(results: dict, s) -> list[list]:
  """The studies v2 goals: measured value, met or missed."""
  out = []
  lab = results.get("labels")
  if lab:
    n = sum(r["drafts"] for r in lab["labelled"]) + lab["drift"].get("drafts", 0)
    out.append([f"At least {LABELS_GOAL:,} labelled drafts", f"{n:,} (streams and drift run)",
                _verdict(n >= LABELS_GOAL, f"missed by {LABELS_GOAL - n:,}")])
    e, n, where = _served(lab, s)
    fitted = next(r for r in lab["feature_table"] if r["predictor"] == ESTIMATOR)["ece"]
    out.append([f"Served estimator ECE <= {SERVED_ECE_GOAL} pooled after warm-up",
                f"served online {_f(e, 4)} {where} (n {n:,})",
                _verdict(e <= SERVED_ECE_GOAL, f"missed by {e - SERVED_ECE_GOAL:.4f}"
                         if np.isfinite(e) else "not measured: no round after warm-up")])
    out.append([f"Offline-fitted ECE <= {FITTED_ECE_GOAL}", f"fitted out of sample {_f(fitted, 4)}",
                _verdict(fitted <= FITTED_ECE_GOAL, f"missed by {fitted - FITTED_ECE_GOAL:.4f}")])
    # The shipped fit of logit(q_max) (shared slope, intercept per position), out of
    # sample, every drafter pooled: the row the note's 0.8259 and v1's 0.765 are.
    raw = next((r for r in lab["feature_table"] if r["predictor"] == ESTIMATOR), None)
    if raw is not None:
      out.append([f"logit(q_max) AUC pooled >= {FEATURE_AUC_GOAL}",
                  f"{_f(raw['auc'])} (the shipped fit, out of sample; n {raw['n']:,})",
                  _verdict(raw["auc"] >= FEATURE_AUC_GOAL,
                           f"missed by {FEATURE_AUC_GOAL - raw['auc']:.3f}")])
    cmp = lab.get("estimator_vs_head")
    if cmp:
      def gaps(name):
        est, head = cmp[name]["auc_at"], cmp[HEAD]["auc_at"]
        return [a - b for a, b in zip(est[1:], head[1:]) if a is not None and b is not None
                and np.isfinite(a) and np.isfinite(b)]
      served, fitted_gaps = gaps(SERVED), gaps(ESTIMATOR)
      worst = min(served) if served else float("nan")
      out.append(["Estimator AUC >= head's from position 2 on",
                  "per-position AUC difference to the head, positions 2..K: online estimator "
                  "as served " + ", ".join(_f(d, 3) for d in served) + "; one offline fit "
                  "per drafter " + ", ".join(_f(d, 3) for d in fitted_gaps),
                  "met" if served and worst >= 0 else f"missed (worst {worst:+.3f})"])
    rec = lab["drift"]["recovery"]
    worst = [r["rounds_to_recover"] for r in rec]
    ok = all(r is not None and r <= 3 for r in worst)
    out.append(["Recalibration after a workload switch within 3 refit rounds",
                "rounds per switch: " + ", ".join(str(r) for r in worst),
                "met" if ok else "missed"])
  for key, clock in (("throughput", "wall"), ("modelled", "modelled")):
    tp = results.get(key)
    if not tp:
      continue
    vs = tp["versus"]
    where = lambda v: f"{v['drafter']}/{v['workload']} B={v['concurrency']}"
    full = [v for v in vs if v["static_arms"] >= 2]  # groups with more than one static arm
    bound = 0.97 if clock == "wall" else 0.98
    out.append(_ratio_goal(f"{clock}: AV >= {bound}x the best static arm everywhere",
                           [(where(v) + f" ({v['best_static']})", v["av_vs_best_static"])
                            for v in full], bound))
    if clock == "wall":
      mixed = [v for v in full if v["workload"] == "mixed"]
      best = max(mixed, key=lambda v: v["av_vs_best_static"] or 0.0, default=None)
      out.append(["wall: on mixed, AV >= 1.10x the best static arm at one concurrency or more",
                  "best: " + (f"{where(best)} {_f(best['av_vs_best_static'], 3)}x" if best
                              else "not measured"),
                  _verdict(bool(best) and best["av_vs_best_static"] >= 1.10)])
    if clock != "wall":
      conf = [v for v in vs if v["av_vs_best_confstop"] is not None]
      out.append(_ratio_goal("modelled: AV >= 1.0x the best confidence-stop arm everywhere",
                             [(where(v) + f" ({v['best_confstop']})", v["av_vs_best_confstop"])
                              for v in conf], 1.0))
  ov = results.get("overhead")
  if ov and ov.get("share") is not None:
    share = ov["share"]   # the full decision charged at every drafting step
    measured = (f"full decision {ov['decision_ms']:.2f} ms; AV step {ov['av_step_ms']:.1f} ms "
                f"= {100 * share:.2f}%")
    if "amortized_share" in ov:
      measured += (f"; amortized (drafting on {100 * ov['drafted_share']:.0f}% of steps, "
                   f"{ov['decision_ms_no_features']:.2f} ms on the others): "
                   f"{100 * ov['amortized_share']:.2f}%")
    out.append([f"Decision <= {100 * SHARE_GOAL:.0f}% of a decode step at concurrency "
                f"{ov['batch']}, charged at every drafting step", measured,
                _verdict(share <= SHARE_GOAL,
                         f"missed by {100 * (share - SHARE_GOAL):.2f} points")])
  t = (results.get("timings") or {}).get("total_s")
  if t is not None and results.get("partial"):
    out.append(["Suite within its time limit here", f"{t / 60:.1f} min so far",
                "not judged: the run did not finish"])
  elif t is not None:
    limit = 300 if results.get("quick") else 3600
    out.append([f"{'--quick' if results.get('quick') else 'Full'} suite within "
                f"{limit // 60} minutes here", f"{t / 60:.1f} min",
                _verdict(t <= limit, f"missed by {(t - limit) / 60:.1f} min")])
  return out


def cost_structure(results: dict, s) -> dict | None:
  """What speculation costs on this machine, from the measured throughput runs.

  At the largest concurrency B (the Pareto drafter, mixed workload): the target-only
  step time, the fixed-K step time, the marginal cost of one more verified draft
  (including drafting it) and the survival a draft needs to pay for itself,
  `s* = marginal / (target-only time per token)`.
  """
  tp = results.get("throughput")
  if not tp:
    return None
  B = max(s.concurrencies)
  rows = [r for r in tp["rows"] if r["drafter"] == s.pareto_drafter and r["workload"] == "mixed"
          and r["concurrency"] == B]
  step_ms = lambda mode, k: np.median([1e3 * r["seconds"] / max(r["steps"], 1) for r in rows
                                       if r["mode"] == mode and r["k"] == k] or [np.nan])
  tok_s = lambda mode, k: np.median([r["tokens_per_s"] for r in rows
                                     if r["mode"] == mode and r["k"] == k] or [np.nan])
  t0, tk = step_ms("target_only", 1), step_ms("fixed", s.k)
  if not (np.isfinite(t0) and np.isfinite(tk)):
    return None
  marginal = (tk - t0) / (B * s.k)
  return dict(batch=B, target_only_step_ms=float(t0), fixed_step_ms=float(tk),
              marginal_ms_per_draft=float(marginal), target_only_ms_per_token=float(t0 / B),
              break_even_survival=float(marginal / (t0 / B)),
              target_only_tokens_per_s=float(tok_s("target_only", 1)),
              fixed_tokens_per_s=float(tok_s("fixed", s.k)),
              av_tokens_per_s=float(tok_s("av", s.k)))


TIE = 0.01  # AUC gaps within this are called ties in the report's prose


def versus_head(gaps: list[float]) -> str:
  """How the served estimator compares with the head from position 2 on, worded from the
  AUC gaps (estimator minus head) themselves."""
  if not gaps:
    return "was not compared with it"
  listed = ", ".join(f"{g:+.3f}" for g in gaps)
  ahead = [i + 2 for i, g in enumerate(gaps) if g > TIE]
  tied = [i + 2 for i, g in enumerate(gaps) if abs(g) <= TIE]
  behind = [i + 2 for i, g in enumerate(gaps) if g < -TIE]
  where = lambda positions: ("every position" if len(positions) == len(gaps) else
                             "position" + ("s " if len(positions) > 1 else " ")
                             + ", ".join(map(str, positions)))
  parts = []
  if ahead:
    parts.append(f"beats it at {where(ahead)}")
  if tied:
    parts.append(f"ties it (within {TIE}) at {where(tied)}")
  if behind:
    parts.append(f"trails it at {where(behind)}")
  return " and ".join(parts) + f" (AUC gaps {listed} from position 2 on)"


def why(results: dict, s) -> list[str]:
  """Why each missed goal was missed, with the measured numbers behind it."""
  out = []
  verdicts = {g[0]: g[2] for g in results["goals"]}
  missed = lambda prefix: any(k.startswith(prefix) and v != "met" for k, v in verdicts.items())
  lab, cs, ov = results.get("labels"), results.get("cost_structure"), results.get("overhead")
  if lab and missed("Served estimator ECE"):
    fitted = next(r for r in lab["feature_table"] if r["predictor"] == ESTIMATOR)
    out.append(
        f"**Estimator ECE.** The same model fitted offline on the first half of each stream "
        f"and scored on the second reaches ECE {_f(fitted['ece'], 4)}; the served "
        f"predictions ({_f(_served(lab, s)[0], 4)}) come from coefficients "
        f"refitted once per {s.refit_interval}-step round by one damped Newton step "
        f"(damping c = {_g((results.get('estimator') or {}).get('damping'))} labels), so they "
        "trail the stream: with continuous batching the mix "
        "of request depths and prompts changes from round to round, and short streams leave "
        "few rounds after warm-up. Per-drafter served ECE is in section 2. Longer streams "
        "(the soak in BENCHMARKS.md runs 10,000 steps) give the estimator time to settle.")
  if lab and missed("Estimator AUC"):
    cmp = lab.get("estimator_vs_head", {})
    gaps = []
    if cmp:
      gaps = [a - b for a, b in zip(cmp[SERVED]["auc_at"][1:], cmp[HEAD]["auc_at"][1:])]
    out.append(
        "**AUC against the trained head.** Our head (block_head) was trained on these "
        "workloads with this drafter and target, and reads the drafter's hidden state, "
        "which carries context the draft distribution's top probability does not. The "
        f"online estimator as served {versus_head(gaps)}; one offline fit pooled over "
        "workloads does "
        "worse, since the served estimator tracks each stream's own intercepts. The note's "
        "estimator won from position 2 on against a head trained elsewhere; ours is "
        "in-domain.")
  if cs and missed("wall: AV >= 0.97x"):
    tp = results.get("throughput") or {}
    av = next((v for v in tp.get("versus", []) if v["drafter"] == s.pareto_drafter
               and v["workload"] == "mixed" and v["concurrency"] == cs["batch"]), None)
    drafting = (f"AV drafted on {100 * av['av_drafted_share']:.0f}% of its steps there "
                f"({av['av_vs_best_static']:.2f}x the best static arm, {av['best_static']})"
                if av else "")
    out.append(
        f"**AV against the best static arm (wall clock).** On this CPU the target is "
        f"compute-bound at large batch: at B={cs['batch']} a target-only step takes "
        f"{cs['target_only_step_ms']:.0f} ms ({cs['target_only_ms_per_token']:.2f} ms per "
        f"token) while every extra verified draft adds {cs['marginal_ms_per_draft']:.2f} ms "
        f"(fixed K={s.k}: {cs['fixed_step_ms']:.0f} ms per step), so a draft pays only if its "
        f"survival exceeds {cs['break_even_survival']:.2f} (target only "
        f"{cs['target_only_tokens_per_s']:.0f} tok/s, fixed K={s.k} "
        f"{cs['fixed_tokens_per_s']:.0f}, AV {cs['av_tokens_per_s']:.0f}). {drafting}. "
        "A drafting step of AV's K = 8 engine pays the K = 8 shapes (the drafter's K "
        "positions, the rejection over K + 1 rows, the verify bucket its budget lands in) "
        "whatever its budget, so AV cannot be as cheap as a small fixed K's engine; "
        "BENCHMARKS.md breaks a B = 8 step down. On accelerators verifying K + 1 tokens "
        "costs about one memory-bound decode step and the break-even survival is near 0 "
        "(section 5m).")
  if ov and missed("Decision <="):
    amortized = None
    tp = results.get("throughput")
    if tp:
      av = [r for r in tp["summary"] if r["mode"] == "av" and r["concurrency"] == ov["batch"]]
      share = np.median([r.get("drafted_share", 1.0) for r in av]) if av else 1.0
      amortized = ov["share"] * share
    amortized = ov.get("amortized_share", amortized)
    out.append(
        f"**Decision overhead.** The full decision reads all B·K·V = "
        f"{ov['batch'] * ov['k'] * ov['vocab']:,} draft log-probabilities once (the feature "
        f"pass; the estimator and planner are O(B·K)); our target has "
        f"{_g((results.get('target') or {}).get('num_layers'))} layers of width "
        f"{_g((results.get('target') or {}).get('d_model'))}, "
        f"so a decode step is cheap next to a vocabulary-wide pass — a 1B-parameter target "
        f"costs about 100x more per token while the decision stays the same. AV decides only "
        f"on steps that draft; amortized over all AV steps the share is "
        f"{_f(100 * amortized if amortized is not None else None, 1)}%.")
  return out


def render(out_dir: str) -> None:
  """Rewrites studies.md and the plots from studies.json (no decoding)."""
  with open(os.path.join(out_dir, "studies.json")) as f:
    results = json.load(f)
  fields = {k: tuple(v) if isinstance(v, list) else v for k, v in results["settings"].items()}
  s = Settings(**fields)
  tp = results.get("throughput")
  if tp:
    tp["pareto"] = {int(c): v for c, v in tp["pareto"].items()}
  if results.get("modelled"):  # recomputed from its rows (a report of older code)
    results["modelled"] = analyse_modelled(results["modelled"]["rows"], s)
  _finish(out_dir, results, s)


def write(out_dir: str, results: dict, s, *, labels=None, throughput_rows=None,
          modelled_rows=None, overhead=None) -> None:
  if labels is not None:
    results["labels"] = analyse_labels(labels, s)
  if throughput_rows is not None:
    results["throughput"] = analyse_throughput(throughput_rows, s)
  if modelled_rows is not None:
    results["modelled"] = analyse_modelled(modelled_rows, s)
  if overhead is not None:
    results["overhead"] = overhead
  _finish(out_dir, results, s)


def _finish(out_dir: str, results: dict, s) -> None:
  results["cost_structure"] = cost_structure(results, s)
  results["goals"] = goals(results, s)
  results["why"] = why(results, s)
  # The results first: a plotting failure (matplotlib missing) must not lose a long run.
  with open(os.path.join(out_dir, "studies.json"), "w") as f:
    json.dump(results, f, indent=1, default=_json_default)
  try:
    plots = _plots(out_dir, results, s)
  except ImportError as e:
    plots = {}
    print(f"plots skipped: {e}. The results are in {out_dir}/studies.json; install "
          f"matplotlib (`pip install 'av_jax[studies]'`) and run `av-jax bench --render-only "
          f"--out {out_dir}` to draw them.", flush=True)
  with open(os.path.join(out_dir, "studies.md"), "w") as f:
    f.write(_markdown(results, s, plots))


def _json_default(x):
  if isinstance(x, (np.integer,)):
    return int(x)
  if isinstance(x, (np.floating,)):
    return float(x)
  if isinstance(x, np.ndarray):
    return x.tolist()
  if isinstance(x, tuple):
    return list(x)
  raise TypeError(type(x))


# ---------------------------------------------------------------------------- plots


MARKERS = "osD^v<>pPX*h"  # one per line of a plot, so lines differ without colour


def _pareto_lines(ax, points: list[dict], arms: list[str]) -> None:
  """One line per arm through its (per-request, total) tokens/s over concurrency, each
  point labelled with its concurrency; AV bold black, the oracle dashed grey."""
  for i, arm in enumerate(arms):
    pts = sorted((r for r in points if r["arm"] == arm), key=lambda r: r["concurrency"])
    style = dict(lw=2.2, color="black") if arm.startswith("AV (") else (
        dict(ls="--", color="grey") if arm.startswith("oracle") else {})
    ax.plot([r["per_request_tokens_per_s"] for r in pts], [r["tokens_per_s"] for r in pts],
            marker=MARKERS[i % len(MARKERS)], label=arm, **style)
    for r in pts:
      ax.annotate(str(r["concurrency"]), (r["per_request_tokens_per_s"], r["tokens_per_s"]),
                  fontsize=5)


def _plots(out_dir: str, results: dict, s) -> dict[str, str]:
  import matplotlib  # deferred: an optional dependency (the `test` / `bench` extras)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # deferred: as above
  files = {}

  def save(fig, name):
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, name), dpi=110)
    plt.close(fig)
    files[name.split(".")[0]] = name

  lab = results.get("labels")
  if lab and lab.get("estimator_vs_head"):
    cmp = lab["estimator_vs_head"]
    fig, ax = plt.subplots(figsize=(5.5, 4.8))
    for name, c in cmp.items():
      style = dict(marker="o")
      if name == "q_max, no fit":
        # The shipped fit is a monotone function of q_max at each position, so both rank
        # the drafts alike and their AUCs are equal: drawn dashed over the shipped line.
        style = dict(marker="x", ls="--", lw=1.0, ms=7)
        name += " (same AUC as the shipped fit: same ranking)"
      ax.plot(np.arange(1, s.k + 1), c["auc_at"], label=name, **style)
    ax.set(xlabel="draft position", ylabel="AUC", title="AUC per position (block_head)")
    ax.set_xticks(np.arange(1, s.k + 1))
    # Below the axes: inside, the legend hides the lines it names.
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=1)
    save(fig, "auc_per_position.png")
    fig, ax = plt.subplots(figsize=(4.6, 4.2))
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, label="perfect calibration")
    for i, (name, c) in enumerate(cmp.items()):
      r = c["reliability"]
      keep = np.asarray(r["count"]) > 0
      ax.plot(np.asarray(r["mean_pred"])[keep], np.asarray(r["observed"])[keep],
              marker=MARKERS[i % len(MARKERS)], label=name)
    ax.set(xlabel="predicted acceptance", ylabel="observed acceptance",
           title="Reliability (block_head, out of sample)")
    ax.legend(fontsize=7)
    save(fig, "reliability.png")
  if lab:
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    # Colour = workload, line style = drafter, so each of the 16 lines is told apart
    # without a 16-colour cycle; a drafter whose traces equal another's (block_head
    # drafts what block drafts) is drawn once and named with it.
    workloads = list(dict.fromkeys(t["workload"] for t in lab["traces"]))
    kinds = list(dict.fromkeys(t["drafter"] for t in lab["traces"]))
    groups = []
    for t in lab["traces"]:
      g = next((g for g in groups if g["workload"] == t["workload"]
                and np.array_equal(g["slope"], t["slope"])
                and np.array_equal(g["intercept1"], t["intercept1"])), None)
      if g is None:
        groups.append(dict(t, names=[t["drafter"]]))
      else:
        g["names"].append(t["drafter"])
    styles = ["-", "--", ":", "-."]
    for g in groups:
      style = dict(lw=1.1, color=f"C{workloads.index(g['workload']) % 10}",
                   ls=styles[kinds.index(g["names"][0]) % len(styles)])
      same = f" (= {', '.join(g['names'][1:])})" if len(g["names"]) > 1 else ""
      axes[0].plot(g["step"], g["slope"], label=f"{g['names'][0]}{same}/{g['workload']}",
                   **style)
      axes[1].plot(g["step"], g["intercept1"], **style)
    axes[0].set(xlabel="decode step", ylabel="slope w", title="online slope")
    axes[1].set(xlabel="decode step", ylabel="intercept, position 1",
                title="online first intercept")
    axes[1].legend(*axes[0].get_legend_handles_labels(), fontsize=6, loc="upper left",
                   bbox_to_anchor=(1.02, 1.0), title="drafter/workload", title_fontsize=6)
    save(fig, "coefficient_traces.png")
    d = lab["drift"]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    rounds = [r["round"] for r in d["rounds"]]
    ax.plot(rounds, [r["ece"] for r in d["rounds"]], marker="o", label="round ECE")
    switches = [r1["round"] - 0.5 for r0, r1 in zip(d["rounds"], d["rounds"][1:])
                if r1["segment"] != r0["segment"]]
    for i, x in enumerate(switches):
      ax.axvline(x, color="red", lw=0.8, label="workload switch" if i == 0 else None)
    ax.set(xlabel="refit round", ylabel="ECE of served predictions",
           title="Drift: " + " -> ".join(d["workloads"]))
    ax.set_xticks(rounds)
    ax.legend(fontsize=7)
    save(fig, "drift_ece.png")
  tp = results.get("throughput")
  if tp:
    summ = [r for r in tp["summary"] if r["drafter"] == s.pareto_drafter
            and r["workload"] == "mixed"]
    arms = list(dict.fromkeys(r["arm"] for r in summ))
    fig, ax = plt.subplots(figsize=(8.6, 4.4))
    _pareto_lines(ax, summ, arms)
    ax.set(xlabel="per-request tokens/s (interactivity)", ylabel="total tokens/s",
           title=f"Pareto: fixed K vs AV ({s.pareto_drafter}, mixed; labels = concurrency)",
           xscale="log", yscale="log")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # off the lines
    save(fig, "pareto.png")
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    keys = sorted({(r["drafter"], r["workload"]) for r in tp["ratios"]
                   if r["arm"] == f"AV (K={s.k})"})
    for i, (d, w) in enumerate(keys):
      pts = sorted((r for r in tp["ratios"] if r["drafter"] == d and r["workload"] == w
                    and r["arm"] == f"AV (K={s.k})"), key=lambda r: r["concurrency"])
      ax.errorbar([r["concurrency"] for r in pts], [r["median"] for r in pts],
                  yerr=[[r["median"] - r["min"] for r in pts], [r["max"] - r["median"]
                                                               for r in pts]],
                  marker=MARKERS[i % len(MARKERS)], capsize=2, label=f"{d}/{w}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="concurrency", ylabel=f"AV tokens/s / fixed K={s.k}",
           title="AV on vs off (side-by-side ratios; bars = spread over repeats)")
    concurrencies = sorted({r["concurrency"] for r in tp["ratios"]})
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])  # one labelled tick each
    ax.minorticks_off()
    if keys:
      ax.legend(fontsize=6, ncol=2)
    save(fig, "av_ratio.png")
  mo = results.get("modelled")
  if mo:
    recs = mo["records"]
    arms = list(dict.fromkeys(r["arm"] for r in recs))
    for d in sorted({r["drafter"] for r in recs}):
      fig, ax = plt.subplots(figsize=(9.0, 4.6))
      _pareto_lines(ax, [r for r in recs if r["drafter"] == d], arms)
      ax.set(xlabel="per-request tokens/s (modelled)", ylabel="total tokens/s (modelled)",
             title=f"Modelled {mo['clock']}: Pareto ({d}, mixed; labels = concurrency)",
             xscale="log", yscale="log")
      ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.02, 1.0))
      save(fig, "modelled_pareto.png")
      break  # one drafter's picture (the first); the tables hold every drafter
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    series = [("av_vs_best_static", "AV / best static"),
              ("av_vs_best_confstop", "AV / best confidence stop"),
              ("oracle_vs_best_static", "oracle / best static")]
    for i, (field, label) in enumerate(series):
      for d in sorted({v["drafter"] for v in mo["versus"]}):
        pts = sorted((v for v in mo["versus"] if v["drafter"] == d and v[field] is not None),
                     key=lambda v: v["concurrency"])
        if pts:
          ax.plot([v["concurrency"] for v in pts], [v[field] for v in pts],
                  marker=MARKERS[i], label=f"{label} ({d})")
    ax.axhline(1.0, color="grey", lw=0.8)
    concurrencies = sorted({v["concurrency"] for v in mo["versus"]})
    ax.set(xscale="log", xlabel="concurrency", ylabel="tokens/s ratio (modelled)",
           title=f"Modelled {mo['clock']}: AV against the other arms")
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.minorticks_off()
    ax.legend(fontsize=6)
    save(fig, "modelled_ratio.png")
  return files


# ---------------------------------------------------------------------------- markdown


def _versus_table(tp: dict) -> str:
  return _table(
      ["drafter", "workload", "B", "best static", "AV tok/s", "AV / best static",
       "AV / target only", "AV / best conf. stop", "oracle / best static",
       "passes/step AV", "AV steps drafting %"],
      [[v["drafter"], v["workload"], v["concurrency"], v["best_static"],
        _f(v["av_tokens_per_s"], 1), _f(v["av_vs_best_static"], 3),
        _f(v["av_vs_target_only"], 3),
        "" if v["best_confstop"] is None else
        f"{_f(v['av_vs_best_confstop'], 3)} ({v['best_confstop']})",
        _f(v["oracle_vs_best_static"], 3), _f(v["av_passes_per_step"], 2),
        _f(100 * v["av_drafted_share"], 0)]
       for v in tp["versus"]])


def _markdown(results: dict, s, plots: dict) -> str:
  hw = results["hardware"]
  md = [f"# av_jax studies report\n",
        f"Command: `{results['command']}` (seed {s.seed}), commit "
        f"{results.get('commit') or 'not recorded'}. Machine: {hw['cpu']}, "
        f"{hw['usable_cores']} usable cores, backend {hw['backend']} ({hw['device']}), "
        f"jax {hw['jax']}, Python {hw['python']}; load average at start "
        f"{', '.join(f'{x:.1f}' for x in hw['load_avg_start'])}, at end "
        f"{', '.join(f'{x:.1f}' for x in hw.get('load_avg_end', []))}. "
        f"Wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in results["timings"].items())
        + ".\n",
        "Settings: " + ", ".join(f"{k}={v}" for k, v in results["settings"].items()) + ".\n",
        "".join(f"Merged in (`benchmarks/merge_studies.py`): `{m['command']}`, commit "
                f"{m.get('commit') or 'not recorded'}, {m['rows']} modelled rows, wall time "
                + ", ".join(f"{k} {v:.0f} s" for k, v in (m.get("timings") or {}).items())
                + ".\n" for m in results.get("merged_runs", [])),
        ("**Partial report**: written after a study finished; the run had not ended.\n"
         if results.get("partial") else ""),
        "Every number below is in `studies.json`. Speeds are compared side by side in one "
        "run (interleaved repeats) and reported as ratios; absolute tokens/s are for this "
        "machine only.\n", "## Goals\n",
        _table(["goal", "measured", "verdict"], results["goals"]), ""]
  if results.get("why"):
    md += ["\nWhere a goal is missed, why:\n"] + [f"- {w}" for w in results["why"]]
  lab = results.get("labels")
  if lab:
    md += ["\n## 1. Labelled drafts\n",
           f"Fixed K={s.k} speculative decoding (every draft verified), temperature "
           f"{s.temperature}, top-p {s.top_p}, {s.label_slots} concurrent requests, "
           f"{s.label_steps} decode steps per stream. One row per labelled draft (accepted "
           f"drafts and the first rejection): features {', '.join(FEATURE_NAMES)}, position, "
           "label, workload, drafter, the online estimator's served prediction and the "
           "confidence-head score where the drafter has one.\n",
           _table(["drafter", "workload", "labelled drafts", "acceptance",
                   "acceptance by position 1..K", "mean draft entropy (nats)"],
                  [[r["drafter"], r["workload"], r["drafts"], _f(r["acceptance"]),
                    " ".join(_f(a, 2) for a in r["acceptance_at"]), _f(r["mean_entropy"], 2)]
                   for r in lab["labelled"]])]
    md += ["\n## 2. Feature table\n",
           "Out of sample: each fitted predictor is fitted per drafter (its workloads pooled) "
           "on the first half of every stream's steps and scored on the second half; "
           "`q_max, no fit` uses the draft's top probability directly; the online estimator "
           "row scores the predictions it actually served during the second halves; the "
           "confidence head is the trained head of the block_head drafter (its rows only). "
           "Predictions of all drafters pooled.\n",
           _table(["predictor", "lossless", "AUC", "log-loss", "ECE", "mean pred", "observed",
                   "n"],
                  [[r["predictor"], "yes" if r["lossless"] else "**no**", _f(r["auc"]),
                    _f(r["log_loss"]), _f(r["ece"], 4), _f(r["mean_pred"]),
                    _f(r["mean_label"]), r["n"]] for r in lab["feature_table"]]),
           f"\nServed online estimator after {s.warmup_rounds} warm-up rounds, pooled over "
           f"every stream: ECE {_f(lab['served_after_warmup']['ece'], 4)}, AUC "
           f"{_f(lab['served_after_warmup']['auc'])} (n={lab['served_after_warmup']['n']}); "
           "per drafter: " + ", ".join(f"{d} {_f(v['ece'], 4)}" for d, v in
                                       lab["served_after_warmup_by_drafter"].items()) + "."]
    cmp = lab.get("estimator_vs_head")
    if cmp:
      md += ["\n## 3. Estimator vs confidence head (block_head drafter, out of sample)\n",
             _table(["predictor", "AUC", "log-loss", "ECE", "AUC excl. pos. 1",
                     "log-loss excl. pos. 1", "ECE excl. pos. 1"],
                    [[n, _f(c["overall"]["auc"]), _f(c["overall"]["log_loss"]),
                      _f(c["overall"]["ece"], 4), _f(c["excluding_position_1"]["auc"]),
                      _f(c["excluding_position_1"]["log_loss"]),
                      _f(c["excluding_position_1"]["ece"], 4)] for n, c in cmp.items()]),
             "\nAUC per position:\n",
             _table(["predictor"] + [str(k + 1) for k in range(s.k)],
                    [[n] + [_f(a) for a in c["auc_at"]] for n, c in cmp.items()]),
             "\n![AUC per position](auc_per_position.png) ![reliability](reliability.png)"]
    corr = lab["correlation"]
    md += ["\n## 4. Slope and intercepts\n",
           "Full-stream maximum-likelihood fit of the shipped model per drafter and workload "
           "(shared slope, intercept per position).\n",
           _table(["drafter", "workload", "slope", "intercepts 1..K", "mean entropy",
                   "acceptance"],
                  [[c["drafter"], c["workload"], _f(c["slope"], 2),
                    " ".join(_f(b, 2) for b in c["intercepts"]), _f(c["mean_entropy"], 2),
                    _f(c["acceptance"])] for c in lab["coefficients"]]),
           f"\nCorrelation over the {corr['pairs']} (drafter, workload) pairs: slope vs mean "
           f"draft entropy {_f(corr['slope_vs_entropy'], 2)}; first intercept vs mean draft "
           f"entropy {_f(corr['intercept1_vs_entropy'], 2)}.\n",
           "![coefficient traces](coefficient_traces.png)\n",
           f"Drift ({s.drift_drafter}): workloads {' -> '.join(lab['drift']['workloads'])}, "
           f"{s.drift_steps} steps each, refit every {s.refit_interval} steps. A segment's "
           "calibrated level is the median round ECE over its last third; it has recovered "
           "at the first round from which every later round stays within 0.01 of the larger "
           "of its and the previous segment's level. Round 0 is served entirely with the "
           "coefficients fitted before the switch.\n",
           _table(["switch to segment", "first-round ECE", "level", "threshold",
                   "refit rounds to recover", "rounds in segment"],
                  [[r["segment"], _f(r["first_ece"], 4), _f(r["level"], 4),
                    _f(r["threshold"], 4), r["rounds_to_recover"], r["rounds"]]
                   for r in lab["drift"]["recovery"]]),
           "\n![drift](drift_ece.png)"]
  tp = results.get("throughput")
  if tp:
    md += ["\n## 5. Throughput\n",
           f"Requests: max(4, {s.requests_per_slot} x concurrency) prompts of {s.prompt_len} "
           f"tokens, {s.throughput_max_new} new tokens each, continuous batching; "
           f"{s.repeats} interleaved repeats. Ratios are per repeat against fixed K={s.k} "
           "in the same repeat (median [min, max]). Per-request tokens/s = tokens/s divided "
           "by the mean number of busy slots. The oracle verifies everything and is charged "
           "in hindsight only for accepted drafts, using the profiled step-cost tables "
           "(a modelled ceiling). Every run starts from the estimator's prior (a cold "
           f"start: with {s.throughput_max_new} new tokens per request a run lasts a few "
           f"{s.refit_interval}-step refit rounds at most, so AV decides mostly on its prior "
           "and its first refits; the labelled-draft streams of sections 1-4 measure the "
           "estimator once fitted).\n"]
    keys = sorted({(r["drafter"], r["workload"]) for r in tp["ratios"]})
    rows = []
    for d, w in keys:
      for c in s.concurrencies:
        fx = next((r for r in tp["summary"] if (r["drafter"], r["workload"], r["concurrency"],
                                                 r["arm"]) == (d, w, c, f"fixed K={s.k}")), None)
        av = next((r for r in tp["summary"] if (r["drafter"], r["workload"], r["concurrency"],
                                                 r["arm"]) == (d, w, c, f"AV (K={s.k})")), None)
        ra = next((r for r in tp["ratios"] if (r["drafter"], r["workload"], r["concurrency"],
                                                r["arm"]) == (d, w, c, f"AV (K={s.k})")), None)
        if fx and av and ra:
          rows.append([d, w, c, _f(fx["tokens_per_s"], 1), _f(av["tokens_per_s"], 1),
                       f"{ra['median']:.3f} [{ra['min']:.3f}, {ra['max']:.3f}]",
                       _f(fx["tokens_per_step"], 2), _f(av["tokens_per_step"], 2),
                       _f(av["verified_per_step"], 1), _f(100 * av["drafted_share"], 0)])
    md += [_table(["drafter", "workload", "concurrency", f"fixed K={s.k} tok/s", "AV tok/s",
                   "AV / fixed", "tok/step fixed", "tok/step AV", "verified/step AV",
                   "AV steps drafting %"], rows)]
    md += [f"\nPareto ({s.pareto_drafter}, mixed workload): total tokens/s and per-request "
           "tokens/s per arm; `*` marks the arms on the frontier at that concurrency.\n"]
    arms = list(dict.fromkeys(r["arm"] for r in tp["summary"]
                              if r["drafter"] == s.pareto_drafter and r["workload"] == "mixed"))
    rows = []
    for c in s.concurrencies:
      front = tp["pareto"][c]["on_front"]
      cells = []
      for arm in arms:
        r = next((r for r in tp["summary"] if r["drafter"] == s.pareto_drafter
                  and r["workload"] == "mixed" and r["concurrency"] == c and r["arm"] == arm),
                 None)
        cells.append("" if r is None else f"{r['tokens_per_s']:.0f} / "
                     f"{r['per_request_tokens_per_s']:.1f}{' *' if arm in front else ''}")
      rows.append([c] + cells)
    md += [_table(["concurrency"] + [f"{a} (total / per-request)" for a in arms], rows),
           "\n![Pareto](pareto.png) ![AV ratio](av_ratio.png)"]
    md += ["\nAV against the other arms of its run (ratios of medians over "
           "repeats; `best static` is the fastest target-only or fixed-K arm of the same "
           "run, so it is K = 8 alone where only the on/off arms ran):\n", _versus_table(tp)]
  mo = results.get("modelled")
  if mo:
    md += [f"\n## 5m. Throughput on the modelled clock {mo['clock']}\n",
           f"**Modelled, not measured**: {mo['clock_label']}. The engine decodes here (the "
           "same requests, tokens and decisions as a deployment would see, with the shipped "
           "models' acceptance) and every step is charged the roofline cost of the deployment "
           "shapes for the tokens it verified and the drafter passes it ran; AV plans with "
           f"the same tables. {s.modelled_repeats} repeat(s) per arm (the modelled clock has "
           "no timing noise; repeats differ only in sampling). Mixed workload, requests as "
           "in section 5, cold estimator. The oracle is charged on this clock like every "
           "arm, for what it verified and the K drafter passes it ran: not a ceiling here.\n"]
    arms = list(dict.fromkeys(r["arm"] for r in mo["records"]))
    rows = []
    for d in s.modelled_drafters:
      for c in s.modelled_concurrencies:
        cells = []
        for arm in arms:
          r = next((r for r in mo["records"] if (r["drafter"], r["concurrency"], r["arm"]) ==
                    (d, c, arm)), None)
          cells.append("" if r is None else f"{r['tokens_per_s']:.0f} "
                       f"({r['vs_best_static']:.2f}x){' *' if r['on_frontier'] else ''}")
        if any(cells):
          rows.append([d, c] + cells)
    md += [_table(["drafter", "concurrency"] + [f"{a}" for a in arms], rows),
           "\nCells: modelled tokens/s (ratio to the best static arm of the row); `*`: on the "
           "Pareto frontier of total against per-request tokens/s.\n", _versus_table(mo)]
    if "modelled_pareto" in plots:
      md += ["\n![modelled Pareto](modelled_pareto.png) ![modelled ratios](modelled_ratio.png)"]
  ov = results.get("overhead")
  if ov:
    md += ["\n## 6. Overhead\n",
           f"The per-step decision (`av_jax.decision.make_decision`: feature pass on the "
           f"sampler's log-probs, estimator update and predict, survival, budget, "
           f"allocation) at B={ov['batch']}, K={ov['k']}, V={ov['vocab']}: median "
           f"{ov['decision_ms']:.2f} ms over {len(ov['decision_ms_all'])} steps "
           f"(recompiles after warm-up: {ov['recompiles']}). An AV decode step of the engine "
           f"at the same concurrency: {_f(ov['av_step_ms'], 1)} ms (throughput runs), so "
           f"the decision is {_f(100 * ov['share'] if ov['share'] else None, 1)}% of a step. "
           + (f"AV runs the full decision only on steps that draft "
              f"({100 * ov['drafted_share']:.0f}% here) and the O(B·K) predict-and-plan "
              f"({ov['decision_ms_no_features']:.2f} ms) on the others: "
              f"{ov['per_step_ms']:.2f} ms per step, {100 * ov['amortized_share']:.1f}% of "
              "an AV step. " if "amortized_share" in ov else "")
           + "The core microbenchmark against NumPy and PyTorch is `python "
           "benchmarks/overhead.py` (BENCHMARKS.md)."]
  return "\n".join(md) + "\n"
