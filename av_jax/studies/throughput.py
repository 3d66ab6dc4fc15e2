"""Throughput sweeps: AV against fixed draft lengths, side by side (study 5).

For one concurrency C (slots) at a time, every arm — target only, fixed K, AV, the
oracle — gets its engine compiled (and AV its cost tables profiled) before any timing;
then the arms decode the same prompts in interleaved repeats, so machine noise hits them
alike. Figures per run: wall-clock tokens/s, per-request tokens/s (tokens/s divided by
the mean number of busy slots), tokens and verified drafts per step, acceptance.

The oracle verifies every draft (it needs the labels) and is charged, in hindsight, only
for the drafts that were accepted: its tokens/s is a ceiling modelled from the measured
run, `T_oracle = T_measured - sum_steps [cost(tokens verified) - cost(tokens needed)]`
with the profiled step-cost tables.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import numpy as np

from av_jax import engine as E
from av_jax.engine import core
from av_jax.engine import profile as prof


@dataclasses.dataclass(frozen=True)
class Arm:
  name: str     # label in tables and plots
  mode: str     # engine mode
  k: int        # max_draft (K)


def pareto_arms(ks: Sequence[int] = (0, 1, 2, 4, 6, 8), k_av: int = 8,
                oracle: bool = True) -> list[Arm]:
  arms = [Arm("target only (K=0)", "target_only", 1) if k == 0 else Arm(f"fixed K={k}",
                                                                        "fixed", k)
          for k in ks]
  arms.append(Arm(f"AV (K={k_av})", "av", k_av))
  if oracle:
    arms.append(Arm(f"oracle (K={k_av})", "oracle", k_av))
  return arms


def on_off_arms(k: int = 8) -> list[Arm]:
  return [Arm(f"fixed K={k}", "fixed", k), Arm(f"AV (K={k})", "av", k)]


class Sweeper:
  """Compiles and profiles engines once per (drafter, concurrency, arm); runs them."""

  def __init__(self, *, temperature: float, top_p: float, max_len: int,
               refit_interval: int, steps_per_chunk: int = 8, seed: int = 0,
               log: Callable[[str], None] = print):
    self.temperature, self.top_p, self.max_len = temperature, top_p, max_len
    self.refit_interval, self.steps_per_chunk, self.seed = refit_interval, steps_per_chunk, seed
    self.log = log
    self._engines: dict = {}
    self._profiles: dict = {}

  def engine(self, pair, slots: int, arm: Arm, warm_prompts) -> tuple[core.Engine, object]:
    key = (pair.drafter.kind, slots, arm)
    if key not in self._engines:
      config = E.EngineConfig(num_slots=slots, max_draft=arm.k, max_len=self.max_len,
                              mode=arm.mode, temperature=self.temperature, top_p=self.top_p,
                              eos_id=-1, steps_per_chunk=self.steps_per_chunk,
                              refit_interval=self.refit_interval)
      engine = E.make_engine(config, pair.cfg, pair.drafter)
      params = E.Params(target=pair.target_params, drafter=pair.drafter_params)
      start = time.perf_counter()
      cost = None
      if arm.mode in ("av", "av_head", "oracle"):
        # The oracle is charged with the tables AV plans against (same buckets).
        av_engine = engine if arm.mode != "oracle" else E.make_engine(
            dataclasses.replace(config, mode="av"), pair.cfg, pair.drafter)
        cost, profile = prof.profile_costs(av_engine, params)
        self._profiles[key] = profile
      E.generate(engine, params, warm_prompts[:slots], max_new_tokens=arm.k + 2,
                 key=jax.random.PRNGKey(self.seed), cost=cost)
      self.log(f"  compiled {pair.drafter.kind} B={slots} {arm.name} in "
               f"{time.perf_counter() - start:.1f} s")
      self._engines[key] = (engine, cost)
    return self._engines[key]

  def profile(self, pair, slots: int, arm: Arm) -> dict | None:
    return self._profiles.get((pair.drafter.kind, slots, arm))

  def run(self, pair, slots: int, arm: Arm, prompts, *, max_new: int, repeat: int) -> dict:
    engine, cost = self.engine(pair, slots, arm, prompts)
    params = E.Params(target=pair.target_params, drafter=pair.drafter_params)
    active, verified, drafted = [], [], []

    def on_chunk(state, info):
      active.append(info.active)
      verified.append(info.verified)
      drafted.append(info.drafting)

    start = time.perf_counter()
    result = E.generate(engine, params, prompts, max_new_tokens=max_new,
                        key=jax.random.PRNGKey(self.seed + 1 + repeat), cost=cost,
                        on_chunk=on_chunk)
    seconds = time.perf_counter() - start
    active = np.concatenate([np.asarray(a) for a in active])
    verified = np.concatenate([np.asarray(v) for v in verified])
    drafted = np.concatenate([np.asarray(d) for d in drafted])
    busy = active > 0
    s = result.stats
    tok_s = s["emitted"] / seconds
    mean_active = float(active[busy].mean()) if busy.any() else 1.0
    row = dict(drafter=pair.drafter.kind, concurrency=slots, arm=arm.name, mode=arm.mode,
               k=arm.k, repeat=repeat, seconds=seconds, tokens=s["emitted"],
               steps=int(busy.sum()), tokens_per_s=tok_s,
               per_request_tokens_per_s=tok_s / mean_active,
               tokens_per_step=s["emitted"] / max(int(busy.sum()), 1),
               verified_per_step=float(verified[busy].mean()) if busy.any() else 0.0,
               acceptance=s["accepted"] / max(s["labeled"], 1),
               drafted_share=float(drafted[busy].mean()) if busy.any() else 0.0)
    if arm.mode == "oracle":
      profile = self.profile(pair, slots, arm)
      model = prof.cost_model_from_profile(profile, num_slots=slots,
                                           max_tokens=slots * (arm.k + 1))
      verify = np.asarray(model.verify_ms)
      needed = np.minimum(active + verified, verify.shape[0] - 1)[busy]
      charged = np.full_like(needed, slots * (arm.k + 1))
      saved_ms = float(np.sum(verify[charged] - verify[needed]))
      oracle_s = max(seconds - saved_ms / 1e3, 1e-9)
      row.update(seconds=oracle_s, tokens_per_s=s["emitted"] / oracle_s,
                 per_request_tokens_per_s=s["emitted"] / oracle_s / mean_active,
                 measured_seconds=seconds)
    return row


def summarize(rows: Sequence[dict], keys=("drafter", "workload", "concurrency", "arm")
              ) -> list[dict]:
  """Median and spread (min, max) over repeats of tokens/s per group."""
  groups: dict = {}
  for r in rows:
    groups.setdefault(tuple(r.get(k) for k in keys), []).append(r)
  out = []
  for key, rs in groups.items():
    tps = np.asarray([r["tokens_per_s"] for r in rs])
    prs = np.asarray([r["per_request_tokens_per_s"] for r in rs])
    out.append(dict(zip(keys, key), repeats=len(rs), tokens_per_s=float(np.median(tps)),
                    tokens_per_s_min=float(tps.min()), tokens_per_s_max=float(tps.max()),
                    per_request_tokens_per_s=float(np.median(prs)),
                    tokens_per_step=float(np.median([r["tokens_per_step"] for r in rs])),
                    verified_per_step=float(np.median([r["verified_per_step"] for r in rs])),
                    acceptance=float(np.median([r["acceptance"] for r in rs])),
                    drafted_share=float(np.median([r.get("drafted_share", 1.0) for r in rs])),
                    mode=rs[0]["mode"], k=rs[0]["k"]))
  return out


def ratios(rows: Sequence[dict], *, baseline: str) -> dict:
  """Per (drafter, workload, concurrency, arm): median over repeats of the per-repeat
  ratio of tokens/s to the baseline arm's in the same repeat (side-by-side ratios)."""
  index = {(r["drafter"], r.get("workload"), r["concurrency"], r["repeat"], r["arm"]): r
           for r in rows}
  out: dict = {}
  for (d, w, c, rep, arm), r in index.items():
    base = index.get((d, w, c, rep, baseline))
    if base is not None:
      out.setdefault((d, w, c, arm), []).append(r["tokens_per_s"] / base["tokens_per_s"])
  return {k: dict(median=float(np.median(v)), min=float(np.min(v)), max=float(np.max(v)),
                  n=len(v)) for k, v in out.items()}


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
  """Indices of points not dominated in both coordinates (larger is better)."""
  front = []
  for i, (x, y) in enumerate(points):
    if not any((x2 >= x and y2 >= y) and (x2 > x or y2 > y) for x2, y2 in points):
      front.append(i)
  return front
