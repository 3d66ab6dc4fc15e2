"""`av-jax compare`: any set of arms side by side, on the wall clock or a modelled one.

    av-jax compare --drafter block --workload mixed --concurrency 1,2,4,8,16,32,64 \\
        --arms target_only,fixed:1,fixed:2,fixed:4,fixed:8,av --repeats 3 --clock wall \\
        --json out.json

For every (drafter, workload, concurrency) all arms are compiled (and, on the wall clock,
AV's cost tables profiled) before any timing; then the arms decode the same prompts in
interleaved repeats, so machine noise hits them alike. Each arm reports tokens/s and
per-request tokens/s (tokens/s over the mean number of busy slots), the median over
repeats, and the adaptive arms their ratio to the best static arm (target only or a
fixed K) and to each arm.

Clocks (`parse_clock`):

* `wall`: seconds measured on this machine;
* `<device>:<shape>` (e.g. `h200:llama3-8b`): modelled by `av_jax.costs.roofline_costs`
  for that device and target shape, with the drafter's cost shape picked per drafter
  kind (`DEPLOYMENT_DRAFTERS`: EAGLE-3-style for eagle, MTP-style for draft_lm,
  DFlash-style for block and block_head). Acceptance comes from the real models run
  here; every step is charged what the deployment would pay for what it did
  (`av_jax.engine.clock`), and AV plans with the same tables. Wall figures are recorded
  next to the modelled ones;
* `<table.json>`: a measured cost-table file (`av_jax.costs.load_cost_table`,
  `benchmarks/accelerator.py`).

The studies' throughput sweeps (`av_lab.studies.throughput`) run on `Runner`, this
module's implementation.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import os
import time
from typing import Callable, Mapping, Sequence

import jax
import numpy as np

from av_jax import costs
from av_jax import data
from av_jax import engine as E
from av_jax import models as M
from av_jax import policy as P
from av_jax.arms import ARMS, get_arm, parse_arm
from av_jax.engine import clock as modelled_clock
from av_jax.engine import core
from av_jax.engine import profile as prof
from av_jax.estimator import EstimatorConfig
from av_jax.sampling import Sampling

MIXED = "mixed"  # every workload, interleaved request by request
STATIC_MODES = ("target_only", "fixed")  # arms whose budget does not adapt
DEFAULT_ARMS = "target_only,fixed:1,fixed:2,fixed:4,fixed:8,av"
DEFAULT_CONTEXT = 2048  # KV positions per request of a modelled deployment
# The drafter cost shape a deployment of each published target runs, by drafter kind.
DEPLOYMENT_DRAFTERS = {
    "llama3-8b": {"eagle": "llama3-8b-eagle3", "draft_lm": "llama3-8b-mtp",
                  "block": "llama3-8b-dflash", "block_head": "llama3-8b-dflash"},
}


def workload_names() -> tuple[str, ...]:
  """Every workload `compare` accepts: the registered ones and `mixed`."""
  return tuple(data.list_workloads()) + (MIXED,)


class _CurveSampler:
  """`generate`'s `on_chunk` for `policy.depth_cap`: after every chunk, the predicted
  survival curve of every request that ran through it, weighted by the tokens it emitted
  in it (a request's weights then sum to its length less its first chunk). A request
  that finished in the chunk still holds its slot here (the next request takes it after
  `on_chunk`) and is sampled once more; the slot, inactive at this sample, starts a new
  request at the next."""

  def __init__(self, engine):
    self.engine = engine
    self.curves, self.weights = [], []
    self.last = None  # (generated tokens [B], active [B]) at the previous sample

  def __call__(self, state, info) -> None:
    del info
    generated = np.asarray(state.length - state.prompt_len)
    active = np.asarray(state.active)
    if self.last is not None:
      before, was = self.last
      ran = was & (generated > before)  # the same request, still running or just done
      if ran.any():
        curves = np.asarray(self.engine.decider.predicted_survival(state.decision))
        self.curves.append(curves[ran])
        self.weights.append((generated - before)[ran])
    self.last = (generated, active)

  def result(self) -> tuple[np.ndarray, np.ndarray]:
    if not self.curves:
      raise ValueError("depth_cap: the warm-up ran no request across two chunks (decode "
                       "more tokens per request in the warm-up)")
    return np.concatenate(self.curves), np.concatenate(self.weights).astype(np.float64)


# ---------------------------------------------------------------------------------- arms


@dataclasses.dataclass(frozen=True)
class ArmSpec:
  """One arm of a comparison (hashable)."""
  name: str  # label in tables and JSON ("fixed:4", or the studies' "fixed K=4")
  mode: str  # the engine's arm, a key of `av_jax.arms.ARMS`
  k: int     # max_draft K of its engine (1 for target only: the engine needs K >= 1)

  @property
  def static(self) -> bool:
    return self.mode in STATIC_MODES


def parse_arms(arms: str | Sequence[str], *, max_draft: int = 8) -> list[ArmSpec]:
  """`"target_only,fixed:4,av"` -> ArmSpecs; any arm of `av_jax.arms.ARMS`, drafting arms
  with an optional `:K` (default `max_draft`).

  Raises:
    ValueError: naming `arms` and the known arm names, for an unknown or repeated arm.
  """
  items = [a.strip() for a in (arms.split(",") if isinstance(arms, str) else arms)]
  items = [a for a in items if a]
  if not items:
    raise ValueError(f"arms: expected at least one arm of {tuple(ARMS)}, got {arms!r}")
  out = []
  for item in items:
    try:
      arm, k = parse_arm(item)
    except ValueError as e:
      raise ValueError(f"arms: {e}; known arms: {tuple(ARMS)} (drafting ones as NAME:K)"
                       ) from None
    # The engine's mode carries a confidence stop's threshold ("confstop:0.8"); the bare
    # arm name would fall back to the default T.
    mode = f"{arm.name}:{arm.threshold}" if arm.threshold is not None else arm.name
    out.append(ArmSpec(item, mode, (k or max_draft) if arm.drafts else 1))
  if len({a.name for a in out}) != len(out):
    raise ValueError(f"arms: each arm at most once, got {items}")
  return out


def _int_list(name: str, value: str | Sequence[int]) -> tuple[int, ...]:
  items = value.split(",") if isinstance(value, str) else list(value)
  try:
    out = tuple(int(x) for x in items if str(x).strip())
  except ValueError:
    raise ValueError(f"{name}: expected comma-separated positive integers, got {value!r}"
                     ) from None
  if not out or min(out) < 1:
    raise ValueError(f"{name}: expected comma-separated positive integers, got {value!r}")
  return out


def _names(name: str, value: str | Sequence[str], known: Sequence[str]) -> tuple[str, ...]:
  items = tuple(x.strip() for x in (value.split(",") if isinstance(value, str) else value))
  items = tuple(x for x in items if x)
  bad = [x for x in items if x not in known]
  if not items or bad:
    raise ValueError(f"{name}: unknown {bad or value!r}; known: {list(known)}")
  return items


# --------------------------------------------------------------------------------- clocks


@dataclasses.dataclass(frozen=True)
class ClockSpec:
  """What a comparison's seconds come from (`parse_clock`)."""
  kind: str                 # "wall", "roofline" (device:shape) or "table" (a file)
  device: str | None = None   # roofline: a name of `av_jax.costs.DEVICE_NAMES`
  shape: str | None = None    # roofline: the target's shape name
  path: str | None = None     # table: the cost-table file
  context_len: int = DEFAULT_CONTEXT  # roofline: KV positions per request

  @property
  def modelled(self) -> bool:
    return self.kind != "wall"

  @property
  def name(self) -> str:
    return {"wall": "wall", "roofline": f"{self.device}:{self.shape}",
            "table": str(self.path)}[self.kind]


def parse_clock(text: str, *, context_len: int = DEFAULT_CONTEXT) -> ClockSpec:
  """`wall`, `<device>:<shape>` or a cost-table `.json` file.

  Raises:
    ValueError: naming `clock`, with the known devices and shapes.
  """
  if text == "wall":
    return ClockSpec("wall")
  if text.endswith(".json"):
    if not os.path.exists(text):
      raise ValueError(f"clock: cost-table file {text!r} does not exist")
    return ClockSpec("table", path=text)
  device, sep, shape = text.partition(":")
  if not sep:
    raise ValueError(f"clock: expected 'wall', DEVICE:SHAPE or a cost-table .json file, got "
                     f"{text!r}; devices {list(costs.DEVICE_NAMES)}, shapes "
                     f"{list(costs.shape_names())}")
  if device not in costs.DEVICE_NAMES:
    raise ValueError(f"clock: unknown device {device!r}; known: {list(costs.DEVICE_NAMES)}")
  if shape not in costs.shape_names():
    raise ValueError(f"clock: unknown shape {shape!r}; known: {list(costs.shape_names())}")
  if context_len < 1:
    raise ValueError(f"context_len: expected a positive integer, got {context_len}")
  return ClockSpec("roofline", device=device, shape=shape, context_len=context_len)


def machine_tables(models: str, drafter_kind: str, config) -> costs.CostTables:
  """Modelled tables of the shipped model set `models` on this machine: the roofline of
  its shapes (`costs.shipped_shapes`) on the rates `costs.cpu_spec` measures (~3 s, once
  per process), for an engine `config`'s slots, K, cache length and buckets. What AV
  plans with where no profile has been measured."""
  return costs.roofline_costs(models, f"{models}-{drafter_kind}", "cpu",
                              drafter_kind=drafter_kind, num_slots=config.num_slots,
                              max_draft=config.max_draft, context_len=config.max_len,
                              buckets=config.bucket_sizes(), implementation="av_jax")


def drafter_shape(target: str, kind: str) -> str:
  """The drafter cost shape a deployment of `target` runs for drafter `kind`."""
  if target in DEPLOYMENT_DRAFTERS:
    return DEPLOYMENT_DRAFTERS[target][kind]
  name = f"{target}-{kind}"  # a shipped model set's own drafter (default-eagle, ...)
  if name not in costs.shape_names():
    raise ValueError(f"clock: no drafter shape for {kind!r} with target {target!r}; known "
                     f"shapes: {list(costs.shape_names())}")
  return name


@functools.lru_cache(maxsize=256)
def deployment_tables(clock: ClockSpec, *, drafter_kind: str, num_slots: int,
                      max_draft: int) -> costs.CostTables:
  """The cost tables a modelled clock charges an engine of B slots and K drafts with.

  Roofline tables have a bucket per token count (`buckets=None`): the deployment pays
  for the tokens it verifies. A measured table is resized to the engine's shapes (verify
  for T <= B (K + 1), draft rows R <= B), refusing one that does not cover them.
  """
  if clock.kind == "roofline":
    return costs.roofline_costs(clock.shape, drafter_shape(clock.shape, drafter_kind),
                                clock.device, drafter_kind=drafter_kind,
                                num_slots=num_slots, max_draft=max_draft,
                                context_len=clock.context_len)
  if clock.kind != "table":
    raise ValueError(f"clock: the wall clock has no cost tables, got {clock!r}")
  tables = costs.load_cost_table(clock.path, max_tokens=num_slots * (max_draft + 1))
  depth = np.asarray(tables.draft_depth_ms)
  if depth.shape[0] < num_slots + 1 or depth.shape[1] < max_draft:
    raise ValueError(f"clock: {clock.path} has draft rows for R <= {depth.shape[0] - 1} and "
                     f"{depth.shape[1]} depths; the engine needs R <= {num_slots} and "
                     f"K = {max_draft}")
  depth = depth[:num_slots + 1, :max_draft]
  cost = costs.depth_cost_model(depth, tables.cost.verify_ms)
  return tables._replace(cost=cost, draft_depth_ms=depth)


# --------------------------------------------------------------------------------- runner


def workload_prompts(pair, workload: str, *, num: int, length: int, seed: int
                     ) -> list[list[int]]:
  """`num` held-out prompts of `workload` (`mixed`: every workload in turn)."""
  if workload != MIXED:
    return data.prompts(workload, tokenizer=pair.tokenizer, num=num, length=length,
                        seed=seed).tolist()
  names = data.list_workloads()
  per = [data.prompts(w, tokenizer=pair.tokenizer, num=num, length=length,
                      seed=seed).tolist() for w in names]
  return [per[i % len(names)][i // len(names)] for i in range(num)]


class Runner:
  """Compiles (and profiles) one engine per (drafter, concurrency, arm) and runs it.

  Under the wall clock AV (and the oracle, charged with AV's tables) plans with the
  engine's profiled cost tables; under a modelled clock every arm decides and is
  charged with the deployment's tables (`deployment_tables`), and the wall figures are
  recorded next to the modelled ones.
  """

  def __init__(self, *, temperature: float, top_p: float, max_len: int,
               refit_interval: int, steps_per_chunk: int = 8, seed: int = 0,
               clock: ClockSpec = ClockSpec("wall"), warm_start: bool = False,
               log: Callable[[str], None] = print, compiled: dict | None = None,
               drafter_backlog: int | None = None, num_buckets: int | None = None,
               wall_cost: Callable | None = None, depth_cap: bool = False):
    # depth_cap: the av arm runs on the engine shape `policy.depth_cap` picks (`shaped`).
    self.depth_cap = depth_cap
    self._shapes: dict = {}
    self._curves: dict = {}  # (kind, slots, arm) -> (curves, weights) of its warm-up
    # compiled: {(drafter kind, slots, arm): engine} shared with another runner (a sweep
    # on another clock), so an engine is built and compiled once for both.
    # warm_start: every run of an adaptive arm continues from the idle state the arm's
    # previous run (first: the warm-up run) ended in, so the online estimator starts
    # fitted, as in a server that has been running; False: every run starts from the
    # estimator's prior. A static arm has nothing to fit: its runs start fresh.
    self.warm_start = warm_start
    self.drafter_backlog = drafter_backlog  # Programs.drafter_backlog (lazy catch-up)
    self.num_buckets = num_buckets  # Programs.num_buckets (None: the engine's default)
    self._states: dict = {}
    self.temperature, self.top_p, self.max_len = temperature, top_p, max_len
    self.refit_interval, self.steps_per_chunk, self.seed = refit_interval, steps_per_chunk, seed
    self.clock, self.log = clock, log
    self.warm_tokens = 32  # tokens per request of the warm-up run under warm_start
    self._engines: dict = {}
    self._profiles: dict = {}
    self.compiled = {} if compiled is None else compiled
    # wall_cost(pair, engine) -> CostModel: the tables AV plans with on the wall clock
    # instead of profiling them (e.g. `machine_tables`); None: profiled.
    self.wall_cost = wall_cost

  def _config(self, slots: int, arm: ArmSpec) -> E.EngineConfig:
    backlog = None if self.drafter_backlog is None else max(self.drafter_backlog, arm.k + 1)
    programs = E.Programs(steps_per_chunk=self.steps_per_chunk, drafter_backlog=backlog,
                          **({} if self.num_buckets is None
                             else {"num_buckets": self.num_buckets}))
    return E.EngineConfig(num_slots=slots, max_draft=arm.k, max_len=self.max_len,
                          mode=arm.mode, eos_id=-1,
                          sampling=Sampling(temperature=self.temperature, top_p=self.top_p),
                          estimator=EstimatorConfig(refit_interval=self.refit_interval),
                          programs=programs)

  def tables(self, pair, slots: int, arm: ArmSpec) -> costs.CostTables | None:
    """The modelled clock's tables for this engine (None on the wall clock)."""
    if not self.clock.modelled:
      return None
    return deployment_tables(self.clock, drafter_kind=pair.drafter.kind, num_slots=slots,
                             max_draft=arm.k)

  def engine(self, pair, slots: int, arm: ArmSpec, warm_prompts) -> tuple[core.Engine, object]:
    """The compiled engine and its planner cost (profiled or modelled), built once."""
    key = (pair.drafter.kind, slots, arm)
    if key not in self._engines:
      config = self._config(slots, arm)
      engine = self.compiled.get(key)
      if engine is None or engine.config != config:
        engine = self.compiled[key] = E.make_engine(config, pair.cfg, pair.drafter)
      params = E.Params(target=pair.target_params, drafter=pair.drafter_params)
      start = time.perf_counter()
      cost = self.tables(pair, slots, arm)
      if cost is None and self.wall_cost is not None and get_arm(arm.mode).adaptive:
        cost = self.wall_cost(pair, engine)
      if cost is None and (get_arm(arm.mode).adaptive or arm.mode == "oracle"):
        # The oracle is charged with the tables AV plans against (same buckets): the
        # tables price the hardware (verify buckets, drafter passes per depth), not the
        # policy, so one profile (cached on disk by the AV engine's config) serves both.
        shared = arm.mode == "oracle"
        av_engine = engine if not shared else E.make_engine(
            dataclasses.replace(config, mode="av"), pair.cfg, pair.drafter)
        cost, profile = prof.profile_costs(av_engine, params)
        self._profiles[key] = profile
      # Only an adaptive arm carries what a warm-up fits (the online estimator); a static
      # arm's warm-up is a short run that compiles the program, so a warm-started sweep
      # does not decode every prompt once more per static arm.
      fit = self.warm_start and get_arm(arm.mode).adaptive
      sample = (_CurveSampler(engine) if fit and self.depth_cap and arm.mode == "av"
                else None)
      warm = E.generate(engine, params, warm_prompts if fit else warm_prompts[:slots],
                        max_new_tokens=self.warm_tokens if fit else arm.k + 2,
                        key=jax.random.PRNGKey(self.seed), cost=cost, on_chunk=sample)
      if fit:
        self._states[key] = warm.state
      if sample is not None:
        self._curves[key] = sample.result()
      self.log(f"  compiled {pair.drafter.kind} B={slots} {arm.name} in "
               f"{time.perf_counter() - start:.1f} s")
      self._engines[key] = (engine, cost)
    return self._engines[key]

  def shaped(self, pair, slots: int, arm: ArmSpec, warm_prompts) -> ArmSpec:
    """The arm as it runs: under `depth_cap`, the `av` arm on the depth cap
    `policy.depth_cap` picks from its warm-up run on its K = `arm.k` engine (every
    running request's predicted survival curve after every chunk, weighted by the tokens
    it emitted in the chunk, `_CurveSampler`; each cap's tables on this clock). Other
    arms, and `av` without `depth_cap`: unchanged."""
    if not self.depth_cap or arm.mode != "av":
      return arm
    memo = (pair.drafter.kind, slots, arm)
    if memo not in self._shapes:
      if not (self.warm_start and self.clock.modelled):
        raise ValueError("depth_cap: needs warm_start (a fitted estimator) and a modelled "
                         f"clock (each cap's tables), got warm_start={self.warm_start}, "
                         f"clock {self.clock.name!r}")
      policy = self.engine(pair, slots, arm, warm_prompts)[0].decider.policy
      survival, weights = self._curves[memo]
      caps = [P.StepCost.from_tables(deployment_tables(
          self.clock, drafter_kind=pair.drafter.kind, num_slots=slots, max_draft=k))
              for k in range(1, arm.k + 1)]
      choice = P.depth_cap(survival, caps, num_slots=slots, weights=weights,
                           shared_passes=policy.drafter_kind == "parallel" or policy.shared_passes)
      rates = " ".join(f"{r / choice.rates.max():.3f}" for r in choice.rates)
      self.log(f"  depth cap {pair.drafter.kind} B={slots} {arm.name}: K = {choice.cap} "
               f"(predicted rate of caps 1..{arm.k} / best: {rates})")
      self._shapes[memo] = dataclasses.replace(arm, k=choice.cap)
    return self._shapes[memo]

  def profile(self, pair, slots: int, arm: ArmSpec) -> dict | None:
    return self._profiles.get((pair.drafter.kind, slots, arm))

  def run(self, pair, slots: int, arm: ArmSpec, prompts, *, max_new: int, repeat: int) -> dict:
    """One timed run: a row of wall figures, and the modelled ones under a modelled clock
    (`tokens_per_s` and `per_request_tokens_per_s` are the runner's clock's)."""
    engine, cost = self.engine(pair, slots, arm, prompts)
    params = E.Params(target=pair.target_params, drafter=pair.drafter_params)
    active, verified, drafted, emitted, passes, rows = [], [], [], [], [], []

    def on_chunk(state, info):
      rows.append(info.draft_rows)
      active.append(info.active)
      verified.append(info.verified)
      drafted.append(info.drafting)
      emitted.append(info.emitted)
      passes.append(info.draft_passes)

    tables = self.tables(pair, slots, arm)
    start = time.perf_counter()
    key = (pair.drafter.kind, slots, arm)
    # A continued state's statistics are running totals: this run's are the difference.
    before = self._states.get(key)
    before = None if before is None else jax.device_get(before.stats)
    result = E.generate(engine, params, prompts, max_new_tokens=max_new,
                        key=jax.random.PRNGKey(self.seed + 1 + repeat), cost=cost,
                        on_chunk=on_chunk, clock="wall" if tables is None else tables,
                        state=self._states.get(key))
    if key in self._states:  # an adaptive arm under warm_start continues from here
      self._states[key] = result.state
    seconds = time.perf_counter() - start
    active = np.concatenate([np.asarray(a) for a in active])
    verified = np.concatenate([np.asarray(v) for v in verified])
    drafted = np.concatenate([np.asarray(d) for d in drafted])
    passes = np.concatenate([np.asarray(p) for p in passes])
    rows = np.concatenate([np.asarray(r) for r in rows])
    busy = active > 0
    s = result.stats
    if before is not None:
      s = dict(s, emitted=s["emitted"] - int(before.emitted),
               accepted=s["accepted"] - int(before.accepted_at.sum()),
               labeled=s["labeled"] - int(before.labeled_at.sum()))
    tok_s = s["emitted"] / seconds
    mean_active = float(active[busy].mean()) if busy.any() else 1.0
    row = dict(drafter=pair.drafter.kind, concurrency=slots, arm=arm.name, mode=arm.mode,
               k=arm.k, repeat=repeat, clock=self.clock.name, seconds=seconds,
               tokens=s["emitted"], steps=int(busy.sum()), tokens_per_s=tok_s,
               per_request_tokens_per_s=tok_s / mean_active,
               wall_tokens_per_s=tok_s, wall_per_request_tokens_per_s=tok_s / mean_active,
               tokens_per_step=s["emitted"] / max(int(busy.sum()), 1),
               verified_per_step=float(verified[busy].mean()) if busy.any() else 0.0,
               acceptance=s["accepted"] / max(s["labeled"], 1),
               drafted_share=float(drafted[busy].mean()) if busy.any() else 0.0,
               # drafter passes per busy step (K per drafting step of an autoregressive
               # drafter without a stop, 1 for a parallel one, 0 when not drafting)
               draft_passes_per_step=float(passes[busy].mean()) if busy.any() else 0.0,
               drafting_cost_share=_drafting_cost_share(cost, engine, active, verified,
                                                        drafted, rows, busy))
    # Steady state on the wall clock: the chunks on which every slot was busy on every
    # step (the tail of a closed request set, where slots idle, is left out), their
    # tokens over their chunk seconds (prefills between chunks are not in them).
    full = [bool(np.all(np.asarray(a) == slots)) for a in active]
    full_s = sum(t for t, f in zip(result.chunk_seconds, full) if f)
    full_tokens = sum(int(np.sum(e)) for e, f in zip(emitted, full) if f)
    steady = full_tokens / full_s if full_s > 0 else 0.0
    row.update(steady_tokens_per_s=steady, steady_per_request_tokens_per_s=steady / slots,
               steady_steps=int(sum(np.asarray(a).size for a, f in zip(active, full) if f)),
               wall_steady_tokens_per_s=steady)
    if result.modelled is not None:
      m = result.modelled
      row.update(tokens_per_s=m["tokens_per_s"],
                 per_request_tokens_per_s=m["per_request_tokens_per_s"],
                 modelled_seconds=m["seconds"], modelled_step_ms=m["mean_step_ms"],
                 steady_tokens_per_s=m["steady_tokens_per_s"],
                 steady_per_request_tokens_per_s=m["steady_per_request_tokens_per_s"],
                 steady_steps=m["steady_steps"],
                 clock_label=m["label"])
    elif arm.mode == "oracle":
      # Wall clock: the oracle verified every draft and is charged, in hindsight, only for
      # the accepted ones, with the profiled tables.
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


# --------------------------------------------------------------------------- aggregation


def _drafting_cost_share(cost, engine, active, verified, drafted, rows, busy) -> float | None:
  """The share of a run's step cost spent on steps that drafted, priced by the planner's
  own tables (`cost`: the profiled or modelled `CostModel`; None for a static arm, whose
  engine has no profile): a step costs `draft_cost(rows) + verify_cost(active +
  verified)`, `draft_cost` only when it drafted. Where AV's drafts do not pay (its gate
  keeps drafting off) this is what exploration and re-checks cost."""
  if cost is None or not busy.any():
    return None
  cost = getattr(cost, "cost", cost)  # a modelled clock's CostTables: its CostModel
  draft = np.asarray(cost.draft_ms, np.float64)
  verify = np.asarray(cost.verify_ms, np.float64)
  B = engine.config.num_slots
  tokens = np.minimum(active + verified, verify.shape[0] - 1)
  step = verify[tokens] + np.where(drafted, draft[np.clip(rows, 0, B)], 0.0)
  total = float(step[busy].sum())
  return float(step[busy & drafted].sum()) / total if total > 0 else None


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


def records(rows: Sequence[dict]) -> list[dict]:
  """One record per (drafter, workload, concurrency, arm): the medians over repeats, the
  per-repeat values, and for every arm its ratio to the best static arm of its group
  and, for adaptive arms, to each other arm (ratios of the medians)."""
  keys = ("drafter", "workload", "concurrency", "arm")
  groups: dict = {}
  for r in rows:
    groups.setdefault(tuple(r[k] for k in keys), []).append(r)
  out = []
  for key, rs in groups.items():
    rs = sorted(rs, key=lambda r: r["repeat"])
    med = lambda name: (float(np.median([r[name] for r in rs]))
                        if all(r.get(name) is not None for r in rs) else None)
    rec = dict(zip(keys, key), clock=rs[0]["clock"], mode=rs[0]["mode"], k=rs[0]["k"],
               tokens_per_s=med("tokens_per_s"),
               per_request_tokens_per_s=med("per_request_tokens_per_s"),
               wall_tokens_per_s=med("wall_tokens_per_s"),
               wall_per_request_tokens_per_s=med("wall_per_request_tokens_per_s"),
               tokens_per_step=med("tokens_per_step"),
               verified_per_step=med("verified_per_step"), acceptance=med("acceptance"),
               drafted_share=med("drafted_share"),
               draft_passes_per_step=med("draft_passes_per_step"),
               drafting_cost_share=med("drafting_cost_share"),
               steady_tokens_per_s=med("steady_tokens_per_s"),
               steady_per_request_tokens_per_s=med("steady_per_request_tokens_per_s"),
               wall_steady_tokens_per_s=med("wall_steady_tokens_per_s"),
               repeats=[{k: r[k] for k in ("repeat", "tokens_per_s",
                                           "per_request_tokens_per_s", "wall_tokens_per_s",
                                           "wall_per_request_tokens_per_s", "seconds",
                                           "modelled_seconds", "tokens", "steps",
                                           "steady_tokens_per_s", "steady_steps")
                         if k in r} for r in rs])
    if "clock_label" in rs[0]:
      rec["clock_label"] = rs[0]["clock_label"]
    out.append(rec)
  for rec in out:
    group = [r for r in out if all(r[k] == rec[k] for k in keys[:3])]
    static = [r for r in group if r["mode"] in STATIC_MODES]
    best = max(static, key=lambda r: r["tokens_per_s"], default=None)
    rec["best_static"] = best and best["arm"]
    rec["vs_best_static"] = (rec["tokens_per_s"] / best["tokens_per_s"]
                             if best is not None else None)
    steady_best = max((r["steady_tokens_per_s"] or 0.0 for r in static), default=0.0)
    rec["steady_vs_best_static"] = (rec["steady_tokens_per_s"] / steady_best
                                    if steady_best > 0 and rec["steady_tokens_per_s"]
                                    else None)
    if get_arm(rec["mode"]).adaptive:
      rec["vs"] = {r["arm"]: rec["tokens_per_s"] / r["tokens_per_s"] for r in group
                   if r["arm"] != rec["arm"]}
    front = pareto_front([(r["per_request_tokens_per_s"], r["tokens_per_s"]) for r in group])
    rec["on_frontier"] = group.index(rec) in front
  return out


# -------------------------------------------------------------------------------- compare


def _compile_ahead(runner: Runner, jobs: Sequence[tuple], *, workers: int) -> None:
  """`runner.engine(*job)` for every job, `workers` at a time: XLA compiles outside the
  GIL, so on two cores two programs compile at once. Only for a modelled clock, whose
  figures are priced by tables, not timed. The adaptive arms (the longest compiles) go
  first. Example: the demo's 4 arms at 2 concurrencies are 8 jobs; with 2 workers its two
  AV engines compile side by side, then the static arms two at a time."""
  jobs = sorted(jobs, key=lambda job: not get_arm(job[2].mode).adaptive)
  with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
    for future in [pool.submit(runner.engine, *job) for job in jobs]:
      future.result()


def compare(*, drafters: str | Sequence[str] = "block", workloads: str | Sequence[str] = MIXED,
            concurrency: str | Sequence[int] = (1, 2, 4, 8), arms: str | Sequence[str] = DEFAULT_ARMS,
            repeats: int = 3, clock: str | ClockSpec = "wall", models: str = "default",
            max_draft: int = 8, max_new: int = 48, prompt_len: int = 32,
            requests_per_slot: int = 2, min_requests: int = 4, max_len: int | None = None, temperature: float = 1.0,
            top_p: float = 0.95, refit_interval: int = 16, steps_per_chunk: int = 8,
            seed: int = 0, context_len: int = DEFAULT_CONTEXT, warm_start: bool = False,
            drafter_backlog: int | None = None, num_buckets: int | None = None,
            pairs: Mapping[str, object] | None = None,
            prompts: Callable[..., list[list[int]]] | None = None,
            log: Callable[[str], None] = print, compiled: dict | None = None,
            wall_cost: Callable | None = None, depth_cap: bool = False,
            compile_workers: int = 1) -> dict:
  """Runs the arms side by side; returns `{"settings": {...}, "results": [records]}`.

  Args:
    drafters: drafter kinds (comma-separated or a list).
    workloads: workload names (`workload_names()`).
    concurrency: slots B of each sweep point (requests = `requests_per_slot` x B, at
      least `min_requests`).
    arms: arm names (`parse_arms`).
    repeats: timed runs per arm, interleaved.
    clock: "wall", DEVICE:SHAPE or a cost-table file (`parse_clock`), or a `ClockSpec`.
    models: the shipped model set (ignored for drafters given in `pairs`).
    max_draft: K of arms given without `:K`.
    max_new: tokens generated per request.
    prompt_len: prompt tokens.
    requests_per_slot: requests per slot of each run.
    min_requests: requests of a run at least (small concurrencies).
    max_len: cache positions per slot (default prompt + output + K + 8).
    temperature, top_p: sampling of drafts and target.
    refit_interval: the estimator's round length.
    steps_per_chunk: decode steps per host sync.
    seed: prompts and keys.
    context_len: KV positions per request of a roofline clock.
    warm_start: an adaptive arm's warm-up run decodes every prompt for `max_new` tokens
      and each of its runs continues from the state its previous run ended in (the
      estimator starts fitted, as in a running server); static arms have nothing to fit
      and warm up with a short compile run only. False: every run starts from the prior.
    drafter_backlog: `Programs.drafter_backlog` of every engine (lazy catch-up; None:
      the default 4 (K + 1); raised to K + 1 where smaller, so 1 means the eager catch-up).
    num_buckets: `Programs.num_buckets` of every engine (None: the engine's default).
    pairs: `{drafter kind: ModelPair}` to use instead of loading `models` (tests).
    prompts: `prompts(pair, workload, num=, length=, seed=)` instead of the held-out
      workload prompts (tests).
    log: progress lines.
    compiled: `{(drafter kind, slots, arm): engine}` shared with another comparison (the
      same arms on another clock), so each engine compiles once.
    wall_cost: `wall_cost(pair, engine) -> CostModel`, the tables AV plans with on the
      wall clock (None: profiled, `av_jax.engine.profile`).
    depth_cap: the `av` arm runs on the engine of the depth cap `policy.depth_cap` picks
      from its warm-up (`Runner.shaped`; needs `warm_start` and a modelled clock); its
      records carry that K.
    compile_workers: on a modelled clock, build and warm every engine of the sweep in
      this many threads before any run (`_compile_ahead`); 1: one at a time, each group
      before its runs. The wall clock always compiles one at a time (its profiles time).

  Raises:
    ValueError: naming the argument, for unknown arms, workloads, drafters, clocks or
      non-positive sizes.
  """
  drafter_names = _names("drafter", drafters, M.KINDS)
  workload_list = _names("workload", workloads, workload_names())
  slots_list = _int_list("concurrency", concurrency)
  arm_list = parse_arms(arms, max_draft=max_draft)
  spec = clock if isinstance(clock, ClockSpec) else parse_clock(clock, context_len=context_len)
  for name, value in (("repeats", repeats), ("max_new", max_new), ("prompt_len", prompt_len),
                      ("requests_per_slot", requests_per_slot),
                      ("min_requests", min_requests)):
    if not (isinstance(value, int) and value >= 1):
      raise ValueError(f"{name}: expected a positive integer, got {value!r}")
  k_max = max(a.k for a in arm_list)
  max_len = max_len or prompt_len + max_new + k_max + 8
  prompts = prompts or workload_prompts
  start = time.perf_counter()
  pairs = dict(pairs or {})
  for kind in drafter_names:
    if kind not in pairs:
      pairs[kind] = M.load(models, drafter=kind)
  runner = Runner(temperature=temperature, top_p=top_p, max_len=max_len,
                  refit_interval=refit_interval, steps_per_chunk=steps_per_chunk, seed=seed,
                  clock=spec, warm_start=warm_start, log=log,
                  drafter_backlog=drafter_backlog, num_buckets=num_buckets,
                  compiled=compiled, wall_cost=wall_cost, depth_cap=depth_cap)
  runner.warm_tokens = max_new
  rows, groups = [], []
  for slots in slots_list:
    num = max(min_requests, requests_per_slot * slots)
    for kind in drafter_names:
      for workload in workload_list:
        ps = prompts(pairs[kind], workload, num=num, length=prompt_len, seed=seed)
        # A warm start fits the estimator on other prompts of the same workload.
        warm = prompts(pairs[kind], workload, num=num, length=prompt_len,
                       seed=seed + 1000) if warm_start else ps
        groups.append((slots, kind, workload, ps, warm))
  if compile_workers > 1 and spec.modelled:
    _compile_ahead(runner, [(pairs[kind], slots, arm, warm) for slots, kind, _, _, warm
                            in groups for arm in arm_list], workers=compile_workers)
  for slots, kind, workload, ps, warm in groups:
    pair = pairs[kind]
    for arm in arm_list:  # compile (and profile) before any timing
      runner.engine(pair, slots, arm, warm)
    running = [runner.shaped(pair, slots, arm, warm) for arm in arm_list]
    for arm in running:
      runner.engine(pair, slots, arm, warm)
    group = []
    for r in range(repeats):  # interleaved, so machine noise hits every arm alike
      for arm in running:
        row = runner.run(pair, slots, arm, ps, max_new=max_new, repeat=r)
        row["workload"] = workload
        group.append(row)
    rows += group
    log(format_group(records(group)))
  settings = dict(
      drafters=list(drafter_names), workloads=list(workload_list),
      concurrency=list(slots_list), arms=[a.name for a in arm_list], repeats=repeats,
      clock=spec.name, clock_kind=spec.kind, models=models, max_draft=max_draft,
      max_new=max_new, prompt_len=prompt_len, requests_per_slot=requests_per_slot,
      min_requests=min_requests, max_len=max_len, temperature=temperature, top_p=top_p, refit_interval=refit_interval,
      steps_per_chunk=steps_per_chunk, seed=seed, warm_start=warm_start, depth_cap=depth_cap,
      drafter_backlog=drafter_backlog, num_buckets=num_buckets, context_len=spec.context_len if spec.kind == "roofline" else None,
      drafter_shapes=({k: drafter_shape(spec.shape, k) for k in drafter_names}
                      if spec.kind == "roofline" else None),
      device=jax.devices()[0].device_kind, jax=jax.__version__,
      seconds=time.perf_counter() - start)
  return dict(settings=settings, results=records(rows))


def format_group(group: Sequence[dict]) -> str:
  """A printable table of one (drafter, workload, concurrency)'s records."""
  if not group:
    return ""
  g = group[0]
  if "clock_label" in g:  # the tables differ per arm by K only: show the adaptive arm's
    label = next((r["clock_label"] for r in group if "vs" in r), g["clock_label"])
    label = f"{label.removeprefix('modelled: ')}; K per arm"
    kind = "modelled"
  else:
    label, kind = "this machine", "wall"
  head = (f"{g['drafter']} / {g['workload']} / concurrency {g['concurrency']}  "
          f"[{kind}: {label}]")
  lines = [head, f"  {'arm':>12} {'tok/s':>10} {'tok/s/req':>10} {'vs best static':>14} "
                 f"{'tok/step':>8} {'accept':>6} {'wall tok/s':>10} {'steady tok/s':>12} "
                 f"{'steady vs best':>14} {'passes/step':>11}"]
  for r in group:
    vs = "" if r["vs_best_static"] is None else f"{r['vs_best_static']:.3f}"
    steady = "" if r.get("steady_tokens_per_s") is None else f"{r['steady_tokens_per_s']:.1f}"
    svs = "" if r.get("steady_vs_best_static") is None else f"{r['steady_vs_best_static']:.3f}"
    lines.append(f"  {r['arm']:>12} {r['tokens_per_s']:10.1f} "
                 f"{r['per_request_tokens_per_s']:10.1f} {vs:>14} {r['tokens_per_step']:8.2f} "
                 f"{r['acceptance']:6.3f} {r['wall_tokens_per_s']:10.1f} {steady:>12} "
                 f"{svs:>14} {r.get('draft_passes_per_step') or 0.0:11.2f}")
  for r in group:
    if "vs" in r and r["vs_best_static"] is None:  # no static arm to compare against
      lines.append(f"  {r['arm']}: no static arm (target_only, fixed:K) in this comparison")
    elif "vs" in r:
      lines.append(f"  {r['arm']} vs best static ({r['best_static']}): "
                   f"{r['vs_best_static']:.3f}x; vs each: " + ", ".join(
                       f"{a} {v:.3f}x" for a, v in r["vs"].items()))
  return "\n".join(lines)


def write_json(path: str, result: Mapping) -> None:
  """Writes `compare`'s result (settings and results) as JSON."""
  folder = os.path.dirname(path)
  if folder:
    os.makedirs(folder, exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=1, default=float)
