"""Measures a trained model set and writes MODELS.md.

Usage:
  python benchmarks/measure_models.py --config default            # writes MODELS.md
  python benchmarks/measure_models.py --config tiny --dir /tmp/tiny --out /tmp/MODELS.md

For every drafter, workload and setting (temperature 1 / top-p 0.95, and greedy) it runs
`measure.steps` speculative steps from `measure.num_prompts` held-out prompts with every
one of K draft tokens verified, and reports per-position acceptance (accepted / labelled:
the acceptance rate of position i given positions 1..i-1 were accepted), the number of
labels, and the mean tokens emitted per verification step. For `block_head` it reports the
confidence head's AUC on the held-out labels, next to the AUC of the online estimator's
feature logit(q_max) on the same labels.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from av_jax import data
from av_jax import models
from av_jax.features import logit_qmax
from av_jax.models import evaluate

SETTINGS = (("sampled", 1.0), ("greedy", 0.0))


def measure(name: str, directory: str | None, kinds=models.KINDS) -> dict:
  pairs = {k: models.load(name, drafter=k, directory=directory) for k in kinds}
  cfg = next(iter(pairs.values())).cfg
  mc = cfg.measure
  out = {"drafters": {}, "head_auc": {}}
  for kind, pair in pairs.items():
    out["drafters"][kind] = {}
    for w_idx, wl in enumerate(data.list_workloads()):
      prompts = jnp.asarray(data.prompts(wl, tokenizer=pair.tokenizer, num=mc.num_prompts,
                                         length=mc.prompt_len, seed=1, config=cfg.data))
      for setting, temperature in SETTINGS:
        t0 = time.time()
        top_p = mc.top_p if temperature > 0 else 1.0
        rec = evaluate.rollout(pair.target_params, pair.drafter_params, prompts,
                               jax.random.key(1000 + w_idx), cfg=cfg, drafter=pair.drafter,
                               K=mc.K, steps=mc.steps, temperature=temperature, top_p=top_p)
        stats = evaluate.acceptance_stats(rec)
        stats["seconds"] = time.time() - t0
        out["drafters"][kind].setdefault(setting, {})[wl] = stats
        print(f"{kind:<10} {wl:<6} {setting:<7} pos1 {stats['acceptance'][0]:.3f} "
              f"emitted {stats['mean_emitted']:.2f} ({stats['seconds']:.1f}s)", flush=True)
        if kind == "block_head" and setting == "sampled":
          lab = np.asarray(rec.labeled)
          y = np.asarray(rec.accepted)[lab]
          conf = np.asarray(rec.conf_logits)[lab]
          feat = np.asarray(logit_qmax(rec.draft_logits, temperature=1.0,
                                       top_p=mc.top_p))[lab]
          pos = np.nonzero(lab)[-1]
          out["head_auc"][wl] = {
              "head": evaluate.auc(conf, y), "logit_qmax": evaluate.auc(feat, y),
              "labels": int(lab.sum()),
              "head_by_position": [evaluate.auc(conf[pos == i], y[pos == i])
                                   for i in range(mc.K)],
              "_raw": (conf.tolist(), feat.tolist(), y.tolist())}
  if not out["head_auc"]:
    out["cfg"] = cfg
    return out
  raw = [v.pop("_raw") for v in out["head_auc"].values()]
  conf = np.concatenate([r[0] for r in raw])
  feat = np.concatenate([r[1] for r in raw])
  y = np.concatenate([np.asarray(r[2], bool) for r in raw])
  out["head_auc"]["all"] = {"head": evaluate.auc(conf, y), "logit_qmax": evaluate.auc(feat, y),
                            "labels": int(len(y))}
  out["cfg"] = cfg
  return out


def _fmt(x):
  return "-" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x:.2f}"


def write_markdown(path: str, name: str, res: dict, summary: dict, command: str,
                   seconds: float) -> None:
  cfg = res["cfg"]
  mc = cfg.measure
  lines = [
      "# Models: measured figures",
      "",
      f"Model set `{name}` (config `configs/models/{name}.toml`), produced by",
      "",
      "```",
      f"python benchmarks/train_models.py --config {name}",
      *[f"python benchmarks/train_models.py --config {name} --only {k}"
        for k in summary.get("retrained", {})],
      command,
      "```",
      "",
      f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on "
      f"{os.cpu_count()} CPU cores ({platform.machine()}, JAX {jax.__version__}, backend "
      f"{jax.default_backend()}); measurement took {seconds / 60:.1f} min. Training wall "
      f"time: {summary['timings']['total_s'] / 60:.1f} min (tokenizer+data "
      f"{summary['timings']['tokenizer_and_data_s'] / 60:.1f}, target "
      f"{summary['timings']['target_s'] / 60:.1f}, drafters "
      f"{summary['timings']['drafters_s'] / 60:.1f}, head {summary['timings']['head_s'] / 60:.1f}"
      " min) on the same machine, which was shared with other jobs while training.",
      *[f"Then `--only {k}` retrained {k} in {t['total_s'] / 60:.1f} min."
        for k, t in summary.get("retrained", {}).items()],
      "",
      "## Sizes",
      "",
      "| model | parameters | file (float16) |",
      "|---|---:|---:|",
  ]
  for part, n in summary["num_params"].items():
    lines.append(f"| {part} | {n / 1e6:.2f}M | {summary['bytes'][part] / 1e6:.2f} MB |")
  lines += [f"| all files incl. tokenizer | | {summary['total_bytes'] / 1e6:.2f} MB |", "",
            "Parameter counts of drafters exclude the target's embedding/output matrix they "
            "share (`eagle`, `block`, `block_head`).", "",
            "## Target: held-out loss", "",
            f"Next-token cross-entropy on {mc.eval_windows} held-out windows of "
            f"{cfg.train_target.seq_len + 1} tokens per workload (the figure stored in the "
            "checkpoint and checked by `tests/test_models.py`).", "",
            "| workload | loss (nats/token) | perplexity |", "|---|---:|---:|"]
  for wl, loss in summary["heldout_loss"].items():
    lines.append(f"| {wl} | {loss:.3f} | {np.exp(loss):.1f} |")
  for setting, label in (("sampled", f"temperature 1, top-p {mc.top_p}"),
                         ("greedy", "greedy (temperature 0)")):
    lines += ["", f"## Acceptance, {label}, K = {mc.K}", "",
              f"Per-position acceptance = accepted / labelled (acceptance of position i given "
              f"1..i-1 were accepted); {mc.num_prompts} held-out prompts of {mc.prompt_len} "
              f"tokens x {mc.steps} steps per workload, all K drafts verified. `emitted` = "
              "mean tokens per verification step (accepted + 1). `n8` = labels at position 8.",
              "",
              "| drafter | workload | " + " | ".join(f"p{i + 1}" for i in range(mc.K)) +
              " | emitted | n8 |",
              "|---|---|" + "---:|" * (mc.K + 2)]
    for kind in models.KINDS:
      for wl, st in res["drafters"][kind][setting].items():
        lines.append(f"| {kind} | {wl} | " + " | ".join(_fmt(a) for a in st["acceptance"]) +
                     f" | {st['mean_emitted']:.2f} | {st['labels'][-1]} |")
    lines += ["", f"Survival, {label}: fraction of verification steps whose positions 1..i were "
              "all accepted (falls with depth by construction; its sum + 1 is `emitted`).", "",
              "| drafter | workload | " + " | ".join(f"s{i + 1}" for i in range(mc.K)) + " |",
              "|---|---|" + "---:|" * mc.K]
    for kind in models.KINDS:
      for wl, st in res["drafters"][kind][setting].items():
        lines.append(f"| {kind} | {wl} | " + " | ".join(_fmt(a) for a in st["survival"]) + " |")
  lines += ["", "## Against the goals", "",
            "Position-1 acceptance (temperature 1, top-p) per workload, sorted, and whether the "
            "survival falls with depth everywhere:", ""]
  for kind in models.KINDS:
    sampled = res["drafters"][kind]["sampled"]
    order = sorted(sampled, key=lambda w: sampled[w]["acceptance"][0])
    p1 = ", ".join(f"{w} {sampled[w]['acceptance'][0]:.2f}" for w in order)
    falls = all(np.all(np.diff(st["survival"]) <= 0) for st in sampled.values())
    lines.append(f"* `{kind}`: {p1}; survival non-increasing: {falls}.")
  lines += ["", "## Confidence head (`block_head`) on held-out labels", "",
            f"AUC of the head's logits against accept/reject labels of the sampled setting "
            f"above (held-out prompts; the head was trained on labels from train-split "
            f"prompts), next to the AUC of the online estimator's feature logit(q_max) on the "
            "same labels.", "",
            "| workload | labels | head AUC | logit(q_max) AUC | head AUC by position 1..K |",
            "|---|---:|---:|---:|---|"]
  for wl, a in res["head_auc"].items():
    by_pos = " ".join(_fmt(x) for x in a.get("head_by_position", []))
    lines.append(f"| {wl} | {a['labels']} | {a['head']:.3f} | {a['logit_qmax']:.3f} | "
                 f"{by_pos} |")
  lines.append("")
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="default")
  parser.add_argument("--dir", default=None, help="checkpoint directory (default: assets)")
  parser.add_argument("--out", default="MODELS.md")
  parser.add_argument("--json", default=None, help="also write the raw figures here")
  parser.add_argument("--from-json", default=None,
                      help="start from figures saved by --json: rewrite the markdown, or with "
                           "--kinds re-measure just those drafters and merge")
  parser.add_argument("--kinds", default=None, help="comma-separated drafter kinds to measure")
  args = parser.parse_args()
  t0 = time.time()
  kinds = tuple(args.kinds.split(",")) if args.kinds else models.KINDS
  res = {}
  if args.from_json:
    with open(args.from_json, encoding="utf-8") as f:
      res = json.load(f)
    res["cfg"] = models.load(args.config, directory=args.dir).cfg
  if not args.from_json or args.kinds:
    new = measure(args.config, args.dir, kinds)
    if res:
      res["drafters"].update(new["drafters"])
      if new["head_auc"]:
        res["head_auc"] = new["head_auc"]
      res["seconds"] = res.get("seconds", 0.0) + time.time() - t0
    else:
      res = new
  summary = models.load_summary(args.config, directory=args.dir)
  if not args.from_json or args.kinds:  # a pure markdown rewrite measured nothing
    res["commands"] = res.get("commands", []) + [
        " ".join(["python", "benchmarks/measure_models.py"] + sys.argv[1:])]
  command = "\n".join(res["commands"])
  write_markdown(args.out, args.config, res, summary, command,
                 res.get("seconds", time.time() - t0))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"seconds": time.time() - t0,
                 **{k: v for k, v in res.items() if k != "cfg"}}, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
