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
from av_jax import engine as engine_lib
from av_jax.engine import profile as profile_lib
from av_jax.engine.config import Programs
from av_jax.features import logit_qmax
from av_jax.models import compute, evaluate, pipeline

SETTINGS = (("sampled", 1.0), ("greedy", 0.0))
VERIFY_CONTEXT = 512  # cache length M of the profiled verify programs (the CLI's default)
REFERENCE = os.path.join(os.path.dirname(__file__), "reference", "default_v1_heldout.json")


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
        if setting == "sampled":  # the estimator's feature against these labels
          lab = np.asarray(rec.labeled)
          feat = np.asarray(logit_qmax(rec.draft_logits, temperature=1.0, top_p=mc.top_p))
          stats["logit_qmax_auc"] = evaluate.auc(feat[lab], np.asarray(rec.accepted)[lab])
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
  out.update(extras(pairs[next(iter(pairs))]))
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


def verify_curve(pair, *, num_slots: int, sizes, repeats: int = 5) -> dict:
  """Profiled verify cost (the engine's own program) at packed sizes `sizes`, one run."""
  K = pair.cfg.measure.K
  config = engine_lib.EngineConfig(num_slots=num_slots, max_draft=K, max_len=VERIFY_CONTEXT,
                                   mode="av", programs=Programs(buckets=tuple(sizes)))
  eng = engine_lib.make_engine(config, pair.cfg, pair.drafter)
  params = engine_lib.Params(pair.target_params, pair.drafter_params)
  prof = profile_lib.measure(eng, params, repeats=repeats)
  return {"buckets": prof["buckets"], "ms": prof["bucket_ms"], "draft_ms": prof["draft_ms"],
          "device_kind": prof["device_kind"], "cache_len": VERIFY_CONTEXT}


def samples(pair, *, num: int = 5, steps: int = 64, prompt_len: int = 32) -> dict:
  """`num` held-out prompts per workload continued for `steps` tokens, greedy and T = 1."""
  cfg = pair.cfg
  out = {}
  for w_idx, wl in enumerate(data.list_workloads()):
    prompts = data.prompts(wl, tokenizer=pair.tokenizer, num=num, length=prompt_len, seed=5,
                           config=cfg.data)
    out[wl] = {"prompts": [pair.tokenizer.decode(p) for p in prompts]}
    for setting, temperature in SETTINGS:
      toks = evaluate.sample_continuations(
          pair.target_params, jnp.asarray(prompts), jax.random.key(77 + w_idx), cfg=cfg.target,
          steps=steps, temperature=temperature,
          top_p=cfg.measure.top_p if temperature > 0 else 1.0)
      out[wl][setting] = [pair.tokenizer.decode(t) for t in np.asarray(toks)]
  return out


def extras(pair) -> dict:
  """Held-out bits/byte, multiply-adds per token, verify-cost curves, sample generations."""
  cfg = pair.cfg
  lengths = pair.tokenizer.byte_lengths()
  bpb = {wl: evaluate.heldout_bits_per_byte(
      pair.target_params, pipeline.heldout_windows(cfg, pair.tokenizer, wl), lengths,
      cfg=cfg.target, batch=min(16, cfg.measure.eval_windows))
         for wl in data.list_workloads()}
  K = cfg.measure.K
  t0 = time.time()
  curves = {"B=1": verify_curve(pair, num_slots=1, sizes=range(1, K + 2)),
            "B=16": verify_curve(pair, num_slots=16,
                                 sizes=(16, 32, 48, 64, 96, 128, 16 * (K + 1)))}
  print(f"verify curves in {time.time() - t0:.0f}s: " + json.dumps(
      {k: [round(x, 2) for x in v["ms"]] for k, v in curves.items()}), flush=True)
  return {"bits_per_byte": bpb, "macs": compute.multiply_adds_per_token(cfg),
          "verify_curves": curves, "samples": samples(pair)}


def _extra_sections(res: dict, cfg, summary: dict) -> list[str]:
  """Compute per token, bits/byte against the old set, verify-cost curves, feature AUCs."""
  if "macs" not in res:
    return []
  macs = res["macs"]
  lines = ["", "## Compute per token", "",
           "Multiply-adds per token counted from the shapes (`av_jax.models.compute`: every "
           "weight read once; attention over the context not included). Drafters: per drafted "
           "token (`block`: one pass over K_max + 1 slots / K_max; `eagle`, `draft_lm`: one "
           "drafting step).", "",
           "| model | multiply-adds / token | / target |", "|---|---:|---:|"]
  for part, m in macs.items():
    lines.append(f"| {part} | {m / 1e6:.3f}M | {m / macs['target']:.3f} |")
  ref = {}
  if cfg.name == "default" and os.path.exists(REFERENCE):
    with open(REFERENCE, encoding="utf-8") as f:
      ref = json.load(f)
  lines += ["", "## Held-out bits per byte, against the old set", "",
            "Summed next-token cross-entropy over the text's bytes (comparable across "
            "tokenizers; `<|endoftext|>` stands for no bytes but is charged), "
            f"{cfg.measure.eval_windows} held-out windows of {cfg.train_target.seq_len + 1} "
            f"tokens per workload. Old: {ref.get('model_set', 'not recorded')}.", "",
            "| workload | old bits/byte | new bits/byte | change |", "|---|---:|---:|---:|"]
  for wl, b in res["bits_per_byte"].items():
    old = ref.get("workloads", {}).get(wl, {}).get("bits_per_byte")
    change = f"{(b - old) / old * 100:+.1f}%" if old else "-"
    lines.append(f"| {wl} | {_fmt(old)} | {b:.3f} | {change} |")
  for name, c in res["verify_curves"].items():
    base = c["ms"][0]
    lines += ["", f"## Verify cost, {name} ({c['device_kind']}, cache length {c['cache_len']})",
              "", "The engine's verify program (`av_jax.engine.profile.measure`, median of 5 "
              "runs) at each packed size T, measured side by side in one run; drafting all "
              f"slots ({name[2:]}) K = {cfg.measure.K} tokens: {c['draft_ms']:.2f} ms.", "",
              "| T | verify ms | / T = smallest |", "|---:|---:|---:|"]
    for t, ms in zip(c["buckets"], c["ms"]):
      lines.append(f"| {t} | {ms:.2f} | {ms / base:.2f} |")
  lines += ["", "## logit(q_max) AUC per workload and drafter", "",
            f"AUC of the estimator's feature against the accept/reject labels of the sampled "
            f"setting (temperature 1, top-p {cfg.measure.top_p}, every position).", "",
            "| drafter | " + " | ".join(data.list_workloads()) + " |",
            "|---|" + "---:|" * len(data.list_workloads())]
  for kind, by in res["drafters"].items():
    lines.append(f"| {kind} | " + " | ".join(
        _fmt(by["sampled"][wl].get("logit_qmax_auc")) for wl in data.list_workloads()) + " |")
  path = summary.get("training_path", "CPU (this machine)")
  lines += ["", "## Training", "", f"Path: {path}. Timings above; tokens per second and "
            "GFLOP/s were printed by the training bars."]
  return lines


def _sample_sections(res: dict) -> list[str]:
  if "samples" not in res:
    return []
  lines = ["", "## Sample generations", "",
           "Five held-out prompts per workload (32 tokens), each continued for 64 tokens by "
           "the target alone, greedy and at temperature 1 / top-p 0.95. `⏎` marks a newline."]
  show = lambda t: t.replace("\n", "⏎").replace("`", "'")
  for wl, d in res["samples"].items():
    lines += ["", f"### {wl}", ""]
    for i, prompt in enumerate(d["prompts"]):
      lines += [f"{i + 1}. prompt: `{show(prompt)}`",
                f"   * greedy: `{show(d['greedy'][i])}`",
                f"   * T = 1: `{show(d['sampled'][i])}`"]
  return lines


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
  lines += _extra_sections(res, cfg, summary)
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
  lines += _sample_sections(res)
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
