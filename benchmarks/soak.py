"""Soak: the real engine for 10,000 decode steps, workloads switching every 500 steps.

    python benchmarks/soak.py                      # default models, block drafter, B=16, K=8
    python benchmarks/soak.py --steps 1000 --segment 100   # a short smoke run

The shipped target and drafter decode held-out prompts with continuous batching: after
every chunk the free slots are refilled from the queue of the current workload, and the
queue switches workload (code -> prose -> math -> noisy -> code ...) every `--segment`
steps, so the slots hold a mix of two workloads just after a switch, as a server would.
One estimator runs the whole time (no reset between segments). Per segment it records
the ECE and AUC of the served predictions (`StepInfo.probs` against `StepInfo.accepted`
on `StepInfo.labeled`; over the whole segment and over its second half), the
coefficients at the segment's end, acceptance, tokens and verified drafts per step,
throughput, the process RSS and the live device buffers. Writes `reports/soak.json` and
prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import jax
import numpy as np


def rss_mib() -> float:
  """Current resident set size of this process (VmRSS), MiB."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  return float("nan")


def peak_rss_mib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def live_buffers() -> tuple[int, float]:
  arrays = jax.live_arrays()
  return len(arrays), sum(a.nbytes for a in arrays) / 2**20


class Queue:
  """Prompts of one workload, drawn in seeded batches of `num` as they run out."""

  def __init__(self, workload: str, *, tokenizer, num: int, length: int, seed: int):
    self.workload, self.tokenizer, self.num, self.length = workload, tokenizer, num, length
    self.seed, self.batch, self.prompts = seed, 0, []

  def pop(self) -> np.ndarray:
    if not self.prompts:
      from av_jax import data
      drawn = data.prompts(self.workload, tokenizer=self.tokenizer, num=self.num,
                           length=self.length, seed=self.seed * 1000 + self.batch)
      self.prompts = list(drawn[::-1])
      self.batch += 1
    return self.prompts.pop()


def segment_row(infos, state, *, steps: int, seconds: float) -> dict:
  """Figures of one segment from its stacked `StepInfo`s and the state at its end."""
  from av_jax import metrics
  cat = lambda name: np.concatenate([getattr(i, name) for i in infos])
  probs, accepted, labeled = cat("probs"), cat("accepted"), cat("labeled")
  half = probs.shape[0] // 2
  est = jax.tree.map(np.asarray, state.estimator)
  labels_at = labeled.sum(axis=(0, 1))
  count, mib = live_buffers()
  return dict(
      steps=steps, seconds=seconds, steps_per_s=steps / seconds,
      tokens_per_step=float(cat("emitted").sum()) / steps,
      verified_per_step=float(cat("verified").sum()) / steps,
      active_per_step=float(cat("active").mean()),
      labels=int(labeled.sum()),
      acceptance=float((accepted & labeled).sum() / max(labeled.sum(), 1)),
      acceptance_at=((accepted & labeled).sum(axis=(0, 1)) / np.maximum(labels_at, 1)).tolist(),
      mean_prob=float(probs[labeled].mean()) if labeled.any() else float("nan"),
      ece=float(metrics.ece(probs, accepted, labeled)),
      ece_2nd_half=float(metrics.ece(probs[half:], accepted[half:], labeled[half:])),
      auc=float(metrics.auc(probs, accepted, labeled)),
      auc_feature=float(metrics.auc(cat("features"), accepted, labeled)),
      slope=float(est.slope), intercepts=est.intercepts.tolist(),
      coefficients_finite=bool(np.isfinite(est.slope) and np.isfinite(est.intercepts).all()),
      nonfinite=int(state.stats.nonfinite), rss_mib=rss_mib(), peak_rss_mib=peak_rss_mib(),
      live_buffers=count, live_mib=mib)


def soak(engine, params, cost, *, workloads, num_steps: int, segment: int, prompt_len: int,
         max_new: int, tokenizer, seed: int = 0, log=print) -> list[dict]:
  """Runs `num_steps` decode steps with continuous batching; one row per segment.

  Every `segment` steps the queue switches to the next of `workloads`; after every chunk
  of `engine.config.programs.steps_per_chunk` steps the free slots are refilled from the
  queue.
  """
  from av_jax.engine import batching
  cfg = engine.config
  S = cfg.programs.steps_per_chunk
  if segment % S or num_steps % segment:
    raise ValueError(f"segment: expected a multiple of steps_per_chunk={S} "
                     f"dividing steps={num_steps}, got {segment}")
  prefill, chunk, init = batching.compiled(engine)
  state = init(params, jax.random.PRNGKey(seed), cost)
  rows = []
  for index in range(num_steps // segment):
    workload = workloads[index % len(workloads)]
    queue = Queue(workload, tokenizer=tokenizer, num=64, length=prompt_len, seed=seed + index)
    infos, requests, finite = [], 0, True
    lo, hi = np.full(cfg.max_draft + 1, np.inf), np.full(cfg.max_draft + 1, -np.inf)
    start = time.perf_counter()
    for _ in range(segment // S):
      active = np.asarray(state.active)
      for slot in np.flatnonzero(~active):
        state = prefill(params, state, queue.pop().astype(np.int32), np.int32(prompt_len),
                        np.int32(slot), np.int32(max_new))
        requests += 1
      state, info = chunk(params, state)
      infos.append(jax.tree.map(np.asarray, info))
      # Coefficients change only at refits; reading them every chunk checks every value
      # the planner was served when refit_interval divides steps_per_chunk.
      coef = np.concatenate([np.asarray(state.estimator.slope)[None],
                             np.asarray(state.estimator.intercepts)])
      finite = finite and bool(np.isfinite(coef).all())
      lo, hi = np.minimum(lo, coef), np.maximum(hi, coef)
    jax.block_until_ready(state)
    row = segment_row(infos, state, steps=segment, seconds=time.perf_counter() - start)
    row.update(segment=index, workload=workload, requests=requests,
               coefficients_finite_every_chunk=finite, coef_min=lo.tolist(),
               coef_max=hi.tolist())
    rows.append(row)
    log(format_row(row))
  return rows


HEADER = (f"{'seg':>3} {'workload':>8} {'ECE':>6} {'ECE 2nd':>7} {'AUC':>6} {'accept':>6} "
          f"{'mean p':>6} {'labels':>7} {'tok/step':>8} {'ver/step':>8} {'slope':>6} "
          f"{'b_1':>6} {'b_K':>6} {'steps/s':>7} {'RSS MiB':>8} {'buffers':>7}")


def format_row(r: dict) -> str:
  return (f"{r['segment']:>3} {r['workload']:>8} {r['ece']:6.4f} {r['ece_2nd_half']:7.4f} "
          f"{r['auc']:6.3f} {r['acceptance']:6.3f} {r['mean_prob']:6.3f} {r['labels']:>7} "
          f"{r['tokens_per_step']:8.2f} {r['verified_per_step']:8.1f} {r['slope']:6.3f} "
          f"{r['intercepts'][0]:6.2f} {r['intercepts'][-1]:6.2f} {r['steps_per_s']:7.1f} "
          f"{r['rss_mib']:8.1f} {r['live_buffers']:>7}")


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--models", default="default", help="shipped model set name")
  p.add_argument("--drafter", default="block", help="drafter kind")
  p.add_argument("--workloads", default="code,prose,math,noisy", help="cycled per segment")
  p.add_argument("--slots", type=int, default=16, help="B, concurrent request slots")
  p.add_argument("--k", type=int, default=8, help="K, maximum draft length")
  p.add_argument("--steps", type=int, default=10_000, help="decode steps in all")
  p.add_argument("--segment", type=int, default=500, help="steps per workload segment")
  p.add_argument("--steps-per-chunk", type=int, default=20, help="host sync granularity")
  p.add_argument("--refit-interval", type=int, default=20, help="estimator round length N")
  p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens")
  p.add_argument("--max-new", type=int, default=64, help="tokens generated per request")
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--top-p", type=float, default=0.95)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="reports/soak.json", help="JSON results path")
  args = p.parse_args(argv)

  from av_jax import engine as E
  from av_jax import models as M
  from av_jax.engine import profile as prof
  from av_jax.estimator import EstimatorConfig
  from av_jax.sampling import Sampling
  start = time.perf_counter()
  pair = M.load(args.models, drafter=args.drafter)
  config = E.EngineConfig(num_slots=args.slots, max_draft=args.k,
                          max_len=args.prompt_len + args.max_new + args.k + 8, mode="av",
                          eos_id=-1,
                          sampling=Sampling(temperature=args.temperature, top_p=args.top_p),
                          estimator=EstimatorConfig(refit_interval=args.refit_interval),
                          programs=E.Programs(steps_per_chunk=args.steps_per_chunk))
  engine = E.make_engine(config, pair.cfg, pair.drafter)
  params = E.Params(target=pair.target_params, drafter=pair.drafter_params)
  cost, profile = prof.profile_costs(engine, params)
  print(prof.format_profile(profile))
  print(f"soak: models={args.models} drafter={args.drafter} B={args.slots} K={args.k} "
        f"steps={args.steps} segment={args.segment} workloads={args.workloads} "
        f"T={args.temperature} top_p={args.top_p} refit={args.refit_interval} "
        f"device={jax.devices()[0].device_kind}", flush=True)
  print(HEADER, flush=True)
  rows = soak(engine, params, cost, workloads=args.workloads.split(","),
              num_steps=args.steps, segment=args.segment, prompt_len=args.prompt_len,
              max_new=args.max_new, tokenizer=pair.tokenizer, seed=args.seed,
              log=lambda line: print(line, flush=True))
  total = time.perf_counter() - start
  rss = [r["rss_mib"] for r in rows]
  summary = dict(
      all_finite=all(r["coefficients_finite_every_chunk"] for r in rows),
      nonfinite=rows[-1]["nonfinite"], seconds=total,
      rss_growth_mib_after_first_segment=rss[-1] - rss[0] if rows else 0.0,
      live_buffers=sorted({r["live_buffers"] for r in rows}))
  print(f"done in {total:.0f} s: coefficients finite after every chunk: "
        f"{summary['all_finite']}; RSS {rss[0]:.0f} -> {rss[-1]:.0f} MiB; live buffers "
        f"{summary['live_buffers']}")
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(dict(args=vars(args), command=" ".join(["python"] + sys.argv),
                   summary=summary, segments=rows), f, indent=1)


if __name__ == "__main__":
  main()
