"""Main job: Adaptive Verification against fixed K on the shipped models.

`make demo` (or `av-jax demo`) decodes held-out prompts of one workload with the shipped
target and one drafter in three modes — target only, fixed verification of all K drafts,
and AV with the online estimator — side by side in one run, and prints wall-clock
throughput as ratios to fixed K, with tokens per step, verified drafts per step and the
acceptance rate. Compilation and cost profiling happen before the timed runs.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from av_jax import data
from av_jax.arms import get_arm
from av_jax._flags import at_least, model_set, temperature, top_p
from av_jax import engine as E
from av_jax import models as M
from av_jax.engine import profile as prof


def add_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--models", default="default", type=model_set,
                 help="shipped model set name")
  p.add_argument("--drafter", default="block", choices=("draft_lm", "eagle", "block",
                                                        "block_head"))
  p.add_argument("--workload", default="code", choices=("code", "prose", "math", "noisy"))
  p.add_argument("--slots", type=at_least(1), default=16, help="B, concurrent request slots")
  p.add_argument("--k", type=at_least(1), default=8, help="K, maximum draft length")
  p.add_argument("--requests", type=at_least(1), default=32, help="requests decoded per mode")
  p.add_argument("--prompt-len", type=at_least(1), default=32, help="prompt tokens")
  p.add_argument("--max-new", type=at_least(1), default=64, help="tokens generated per request")
  p.add_argument("--temperature", type=temperature, default=1.0, help="0 = greedy")
  p.add_argument("--top-p", type=top_p, default=0.95, help="nucleus mass in (0, 1]")
  p.add_argument("--repeats", type=at_least(1), default=1, help="timed runs per mode")
  p.add_argument("--seed", type=int, default=0)


def run_modes(pair, *, modes, slots, k, requests, prompt_len, max_new, temperature, top_p,
              workload, seed=0, repeats=1, log=print) -> dict[str, dict]:
  """Decodes the same prompts in every mode; returns per-mode figures (importable)."""
  prompts = data.prompts(workload, tokenizer=pair.tokenizer, num=requests, length=prompt_len,
                         seed=seed).tolist()
  params = E.Params(target=pair.target_params, drafter=pair.drafter_params)
  max_len = prompt_len + max_new + k + 8
  rows = {}
  engines = {}
  for mode in modes:
    config = E.EngineConfig(num_slots=slots, max_draft=k, max_len=max_len, mode=mode,
                            temperature=temperature, top_p=top_p, eos_id=-1,
                            steps_per_chunk=8, refit_interval=20)
    engine = E.make_engine(config, pair.cfg, pair.drafter)
    cost = None
    if get_arm(mode).adaptive:
      start = time.perf_counter()
      cost, profile = prof.profile_costs(engine, params)
      log(f"[{mode}] cost profile ({time.perf_counter() - start:.1f} s):\n"
          + prof.format_profile(profile))
    start = time.perf_counter()
    E.generate(engine, params, prompts[:slots], max_new_tokens=k + 2,
               key=jax.random.PRNGKey(seed), cost=cost)  # compile + warm-up
    log(f"[{mode}] compiled in {time.perf_counter() - start:.1f} s")
    engines[mode] = (engine, cost)
  for r in range(repeats):  # interleaved, so machine noise hits every mode alike
    for mode in modes:
      engine, cost = engines[mode]
      start = time.perf_counter()
      result = E.generate(engine, params, prompts, max_new_tokens=max_new,
                          key=jax.random.PRNGKey(seed + 1 + r), cost=cost)
      elapsed = time.perf_counter() - start
      s = result.stats
      rows.setdefault(mode, []).append(dict(
          seconds=elapsed, tokens=s["emitted"], steps=s["steps"],
          tokens_per_s=s["emitted"] / elapsed, tokens_per_step=s["emitted"] / s["steps"],
          verified_per_step=s["verified"] / s["steps"],
          acceptance=s["accepted"] / max(s["labeled"], 1)))
  return {m: {key: float(np.median([row[key] for row in rs])) for key in rs[0]}
          for m, rs in rows.items()}


def format_table(rows: dict[str, dict], base: str = "fixed") -> str:
  lines = [f"{'mode':>12} {'tok/s':>8} {'vs fixed':>8} {'tok/step':>8} {'verified/step':>13} "
           f"{'accept':>7}"]
  for mode, r in rows.items():
    ratio = r["tokens_per_s"] / rows[base]["tokens_per_s"] if base in rows else float("nan")
    lines.append(f"{mode:>12} {r['tokens_per_s']:8.1f} {ratio:8.3f} {r['tokens_per_step']:8.2f} "
                 f"{r['verified_per_step']:13.1f} {r['acceptance']:7.3f}")
  return "\n".join(lines)


def main(args) -> None:
  start = time.perf_counter()
  pair = M.load(args.models, drafter=args.drafter)
  modes = ["target_only", "fixed", "av"] + (["av_head"] if args.drafter == "block_head" else [])
  print(f"av_jax demo: models={args.models} drafter={args.drafter} ({pair.drafter.drafting}) "
        f"workload={args.workload} B={args.slots} K={args.k} T={args.temperature} "
        f"top_p={args.top_p} requests={args.requests} x {args.max_new} tokens, "
        f"device={jax.devices()[0].device_kind}")
  rows = run_modes(pair, modes=modes, slots=args.slots, k=args.k, requests=args.requests,
                   prompt_len=args.prompt_len, max_new=args.max_new,
                   temperature=args.temperature, top_p=args.top_p, workload=args.workload,
                   seed=args.seed, repeats=args.repeats)
  print(format_table(rows))
  print(f"done in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__)
  add_args(parser)
  main(parser.parse_args())
