"""Start-up cost profiling: measured step-cost tables for the decision.

Every bucket's verify program (the target's packed forward on T tokens) and the drafter
are timed on the device in use: warm-up, then the median of `repeats` runs. The verify
table is a step function of the bucket (T tokens cost what the smallest bucket >= T
costs) and is forced monotone. The result is cached on disk keyed by device kind, engine
config and model config, so a server profiles once per machine kind.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from av_jax.engine import batching, core
from av_jax.models import config as models_config
from av_jax.profiling import bounded_buckets
from av_jax.profiling import median_ms as _median_ms
from av_jax.profiling import step_cost_model
from av_jax.selection import CostModel, make_cost_model


# Rounds every entry of a profile is timed in at least (its smallest time kept): load on
# a shared machine only adds time, and a spike can leave a table in order.
PROGRAM_ROUNDS = 2  # the verify buckets and the drafter's programs
STEP_ROUNDS = 3     # the whole-step regimes, the anchors every step is priced by


def measure(engine: core.Engine, params: core.Params, *, repeats: int = 5) -> dict:
  """Times every verify bucket and the drafter; returns a JSON-able profile.

  Both go through the engine's protocols, so a target and drafter of the user's own
  (`make_engine(config, target=..., drafter=...)`) are timed like av_jax's: the target's
  `Target.verify` per bucket, the drafter's `Drafter.draft` on an empty state
  (`_draft_timings`).

  A bucket's verify program is what the engine's verify branch runs
  (`core.verify_forward`): with G = `verify_groups` groups, G packed forwards of T_g =
  T / G tokens each (batched) and the target's sampling distribution on the packed rows.
  `buckets` holds the total sizes T = G T_g (`engine.buckets`), the units of the cost
  tables: those up to the first holding B (K + 1) tokens, the most a step packs; a
  configured bucket past it is never run, so it is not timed (`skipped_buckets`).
  """
  cfg = engine.config
  B, K, M, G = cfg.num_slots, cfg.max_draft, cfg.max_len, cfg.groups
  state = core.init_state(engine, params, jax.random.key(0, impl="rbg"))
  cache = core.group_cache(engine, state.target_cache)

  read = engine.target.verify_read is not None  # the pass the engine runs (verify._verify_packed)

  def verify(target_params, cache, tokens, slot, positions, valid):
    return core.verify_forward(engine, target_params, cache, tokens=tokens, slot=slot,
                               positions=positions, valid=valid, read=read)[0]

  verify = jax.jit(verify)

  def bucket_timer(size):
    # Realistic packing: each group's slots round-robin, positions mid-cache, all valid.
    t = jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), (G, size))
    slot = t % (B // G)
    positions = M // 2 + t // (B // G)
    tokens = jnp.ones((G, size), jnp.int32)
    return lambda: _median_ms(verify, params.target, cache, tokens, slot, positions,
                              jnp.ones((G, size), bool), repeats=repeats)

  timed = bounded_buckets(cfg.group_bucket_sizes(), (B // G) * (K + 1))
  bucket_ms = retime_falls([bucket_timer(size) for size in timed], min_rounds=PROGRAM_ROUNDS)
  buckets = list(engine.buckets)

  drafting = _draft_timings(engine, params, repeats=repeats)
  profile = dict(device_kind=jax.devices()[0].device_kind, buckets=buckets[:len(timed)],
                 bucket_ms=bucket_ms, skipped_buckets=buckets[len(timed):],
                 draft_ms=drafting.pop("draft_ms"), repeats=repeats, verify_groups=G)
  profile.update(drafting)
  if engine.decider.gated:
    profile["step_ms"] = retime_regimes(
        profile, lambda: whole_step_ms(engine, params, state, repeats=repeats),
        num_slots=B, max_tokens=B * (K + 1), min_rounds=STEP_ROUNDS)
  return profile


def _draft_timings(engine: core.Engine, params: core.Params, *, repeats: int) -> dict:
  """The drafter's entries of a profile (`measure`), timed through the `Drafter` protocol:
  `draft_ms` (`Drafter.draft` of K tokens for all B rows); under subset drafting
  `draft_buckets` and `draft_bucket_ms` (E rows, `Drafter.take_rows`); where the drafting
  loop stops between depths, `draft_first_ms` (depth 1 alone, per draft bucket)."""
  cfg = engine.config
  B, K = cfg.num_slots, cfg.max_draft

  def draft(dp, tp, ds, key):  # drafting and its sampling (tokens, log-probs) as run
    out = engine.drafter.draft(dp, tp, ds, key, K=K, temperature=cfg.sampling.temperature,
                               top_p=cfg.sampling.top_p)
    return out.logits, out.tokens, out.log_probs

  draft = jax.jit(draft)
  # A drafting step drafts from K + 1 pending columns (a backlog is settled first).
  dstate = core._empty_drafter(engine, params, width=K + 1)
  rows_of = lambda e: (dstate if e == B
                       else engine.drafter.take_rows(dstate, jnp.arange(e, dtype=jnp.int32)))
  draft_ms = min(_median_ms(draft, params.drafter, params.target, dstate,
                            jax.random.key(1, impl="rbg"), repeats=repeats)
                 for _ in range(PROGRAM_ROUNDS))
  profile = dict(draft_ms=draft_ms)
  if engine.decider.gated:
    # Under subset drafting a step drafts for E rows (a draft bucket), so drafting costs
    # what the bucket holding the drafting requests costs.
    sizes = cfg.draft_bucket_sizes()
    profile["draft_buckets"] = list(sizes)
    def draft_timer(e):
      rows = rows_of(e)
      return lambda: _median_ms(draft, params.drafter, params.target, rows,
                                jax.random.key(1, impl="rbg"), repeats=repeats)

    timers = [(lambda: draft_ms) if e == B else draft_timer(e) for e in sizes]
    profile["draft_bucket_ms"] = retime_falls(timers, min_rounds=PROGRAM_ROUNDS)
  if core._stepwise(engine):
    # Pass pricing charges c of K passes `fixed + (c / K) (full - fixed)`: the fixed part
    # from the drafter's program at depth 1 (its first pass consumes the K + 1 pending
    # columns and costs more than a later one). Per draft bucket under subset drafting.
    def first_timer(e):
      rows = rows_of(e)
      return lambda: _median_ms(draft_first, params.drafter, params.target, rows,
                                jax.random.key(1, impl="rbg"), repeats=repeats)

    def draft_first(dp, tp, ds, key):
      out = engine.drafter.draft(dp, tp, ds, key, K=1, temperature=cfg.sampling.temperature,
                                 top_p=cfg.sampling.top_p)
      return out.logits, out.tokens, out.log_probs

    draft_first = jax.jit(draft_first)
    sizes = profile.get("draft_buckets", [B])
    profile["draft_first_ms"] = retime_falls([first_timer(e) for e in sizes],
                                              min_rounds=PROGRAM_ROUNDS)
  return profile


def retime_regimes(profile: dict, timer, *, num_slots: int, max_tokens: int,
                   rounds: int = 2, min_rounds: int = 1) -> dict:
  """Whole-step times (`timer() -> whole_step_ms`'s dict) whose anchors are in order.

  The verify table is anchored on the regimes (`verify_table`), so a regime timed under
  a load spike prices every step: a step without drafting timed above the drafting
  regimes makes drafting look free (the table keeps its running maximum), and the
  profile stays cached. Every regime is timed `min_rounds` times (whole rounds, one after
  another) and keeps its smallest time: load only adds time, and a spike that leaves the
  regimes in order is invisible to the check below. Then, where
  an anchor at more tokens costs less than one at fewer, every regime is timed again and
  keeps its smaller time, up to `rounds` times.
  """
  steps = timer()
  keep = lambda steps, again: {k: (min(v, again[k]) if k in _REGIMES else v)
                               for k, v in steps.items()}
  for _ in range(min_rounds - 1):
    steps = keep(steps, timer())
  for _ in range(rounds):
    anchors = step_anchors(dict(profile, step_ms=steps), num_slots=num_slots,
                           max_tokens=max_tokens)
    if all(ms_a <= ms_b for (t_a, ms_a), (t_b, ms_b) in zip(anchors, anchors[1:])
           if t_a < t_b):
      break
    steps = keep(steps, timer())
  return steps


_REGIMES = ("skip", "one", "full")


def retime_falls(timers, *, rounds: int = 2, min_rounds: int = 1) -> list[float]:
  """Times `timers` (each `() -> ms`, one per table entry, ascending work) and re-times
  every entry that costs more than a later one, keeping the smaller time, up to `rounds`
  times. Load on a shared machine only adds time, so a spike is an entry above what more
  work cost; left alone, the tables' running maximum would spread it over every larger
  entry. Every entry is first timed `min_rounds` times (rounds
  over all entries) and keeps its smallest time, which also catches a spike that leaves
  the table in order. What stays non-monotone is repaired by `make_cost_model`.
  """
  times = [float(t()) for t in timers]
  for _ in range(min_rounds - 1):
    times = [min(old, float(t())) for old, t in zip(times, timers)]
  for _ in range(rounds):
    falls = [i for i in range(len(times) - 1) if times[i] > min(times[i + 1:])]
    if not falls:
      break
    for i in falls:
      times[i] = min(times[i], float(timers[i]()))
  return times


def whole_step_ms(engine: core.Engine, params: core.Params, state: core.DecodeState, *,
                  repeats: int = 5) -> dict:
  """Per-step wall time of the engine's own decode programs in fixed regimes (below).

  The programs timed above are only part of a step: sampling, rejection over `[B, K+1,
  V]`, packing, the drafter's commit and catch-up and the decision cost time too, and on
  a CPU or at small batch they can outweigh the target's forward. This runs the
  programs decoding runs (`batching.decode_programs`: for an engine that splits quiet
  steps, `core.run_mode`'s quiet program for "skip" and its drafting program for the
  others; else `run_chunk`) with every slot active, mid-cache, in three fixed regimes,
  the decision's state set before each step (`decider.regime`): "skip", a step on which
  no slot drafts (a target-only step of B requests); "one", slot 0 alone drafting all K
  and verifying them (the smallest draft bucket: a plan that drafts a few slots); "full",
  every slot drafting all K and verifying them (free verification in the plan). Timing
  them compiles them. Returns `{"skip", "one", "full": ms per step, "<regime>_rows":
  drafter rows run, "<regime>_verified": drafts verified per step (not "skip")}`.
  """
  cfg = engine.config
  B, K, M, S = cfg.num_slots, cfg.max_draft, cfg.max_len, cfg.programs.steps_per_chunk
  length = jnp.full((B,), max(1, (M - S * (K + 1)) // 2), jnp.int32)
  planner = state.planner
  free = make_cost_model(np.zeros(B + 1), 1.0 + 1e-6 * np.arange(B * (K + 1) + 1))
  free = jax.tree.map(lambda new, old: jnp.asarray(new, old.dtype), free, state.cost)
  default = state.cost
  regimes = {name: engine.decider.regime(planner, name) for name in ("skip", "one", "full")}
  tables = {"skip": default}
  # Each regime runs in the program decoding runs it in: `(state, records, steps run)`.
  if core.splits_quiet(engine):
    quiet_program, drafting_program = batching.compiled_modes(engine)
    quiet = lambda params, s: quiet_program(params, s, np.int32(S))
    chunk = lambda params, s: drafting_program(params, s, np.int32(S))
  else:
    one_program = batching.compiled(engine)[1]
    quiet = chunk = lambda params, s: (*one_program(params, s), S)
  out = {}
  s = jax.tree.map(lambda x: x.copy(), state)  # the chunk donates its state
  for name, fixed in regimes.items():
    def fresh(s):  # the same regime on every timed chunk (own buffers: the chunk donates)
      copy = lambda tree: jax.tree.map(lambda x: x.copy(), tree)
      return s._replace(active=jnp.ones((B,), bool), length=jnp.array(length, copy=True),
                        max_new=jnp.full((B,), M, jnp.int32), planner=copy(fixed),
                        cost=copy(tables.get(name, free)))
    times, info = [], None
    for i in range(repeats + 2):  # two warm-up chunks
      s = jax.block_until_ready(fresh(s))
      start = time.perf_counter()
      s, info, count = (quiet if name == "skip" else chunk)(params, s)
      count = int(count)  # the drafting program stops where the slots' caches fill
      if count == 0:
        raise RuntimeError(f"whole_step_ms: regime {name!r} ran no step (max_len {M})")
      if i >= 2:
        times.append((time.perf_counter() - start) * 1e3 / count)
    info = jax.tree.map(lambda x, n=count: np.asarray(x)[:n], info)
    out[name] = float(np.median(times))
    if name == "skip":
      out["skip_rows"] = int(np.max(info.draft_rows))
    else:
      out[f"{name}_verified"] = float(np.mean(info.verified))
      out[f"{name}_rows"] = int(np.max(info.draft_rows))
      out[f"{name}_row_steps"] = [int(r) for r in np.asarray(info.draft_rows)]
  return out


def step_anchors(profile: dict, *, num_slots: int, max_tokens: int) -> list[tuple[int, float]]:
  """The verify costs whole steps measured: `[(T, ms)]`, T the tokens a regime verifies.

  From `profile["step_ms"]`: a step that drafts nothing verifies B tokens
  and costs `skip`; the one-slot step verifies B + K and costs `one` less the smallest
  draft bucket's program (on each step, the bucket of the rows that ran: full backlogs
  absorbed there widen it); the full step verifies B (K + 1) and costs `full` less the
  drafter's program for all B slots. Empty for a profile without whole-step times.
  """
  steps = profile.get("step_ms")
  if not steps:
    return []
  B, T = num_slots, max_tokens
  K = (T - B) // B
  anchors = [(B, float(steps["skip"]))]
  draft, fixed = _program_tables(profile, num_slots=B)
  if "one" in steps:
    draft_one = (profile["draft_bucket_ms"][0] if "draft_bucket_ms" in profile
                 else profile["draft_ms"])
    if steps.get("one_row_steps"):
      # Full backlogs absorbed in the drafting bucket widen it on some steps: each step's
      # drafter program is the bucket of the rows that ran.
      draft_one = float(np.mean(draft[np.clip(steps["one_row_steps"], 0, B)]))
    one = float(steps["one"]) - float(draft_one)
    if one <= full_anchor(profile) or B + K >= T:
      anchors.append((B + K, one))
    # else: the one-slot step costs more than the full step's verification, which
    # verifies B (K - 1) more tokens: the excess is its drafting path (rows gathered into
    # a small bucket and scattered back), priced in the draft table (`subset_overhead`).
  anchors.append((T, full_anchor(profile)))
  return anchors


def full_anchor(profile: dict) -> float:
  """The full step's verify anchor: `full` less the drafter's program for all B slots."""
  return float(profile["step_ms"]["full"]) - float(profile["draft_ms"])


def subset_overhead(profile: dict, *, num_slots: int, max_tokens: int) -> float:
  """What a step drafting in a draft bucket E < B pays beyond its programs, in ms.

  Zero unless the one-slot regime's verify anchor lies above the full step's (at B = 2
  on this CPU: slot 0 drafting alone cost 12.4 ms, both slots drafting 12.9 ms): more
  tokens cannot cost less to verify, so its excess over the verify table at B + K (from
  the other anchors) is the subset path's (gather, settle, scatter of the rows), and every
  bucket E < B is charged it (`draft_tables`), so both regimes are priced at what they
  cost. Kept in the verify table instead, the running maximum priced the full step above
  its measured cost.
  """
  steps = profile.get("step_ms") or {}
  if "one" not in steps:
    return 0.0
  B, T = num_slots, max_tokens
  K = (T - B) // B
  if B + K >= T:  # B = 1: one bucket, the two regimes are averaged (`verify_table`)
    return 0.0
  draft, _ = _program_tables(profile, num_slots=B)
  rows = steps.get("one_row_steps") or [1]
  draft_one = float(np.mean(draft[np.clip(rows, 0, B)]))
  one = float(steps["one"]) - draft_one
  if one <= full_anchor(profile):
    return 0.0
  verify = verify_table(profile, num_slots=B, max_tokens=T)
  return max(one - float(verify[min(B + K, T)]), 0.0)


def verify_table(profile: dict, *, num_slots: int, max_tokens: int) -> np.ndarray:
  """`[max_tokens + 1]` verify costs: the programs' table mapped onto whole steps.

  The programs timed alone (`bucket_ms`) are not what a step pays: on a gated-off step
  the engine runs a target-only step's plain pass, not the smallest packed bucket, and
  the rest of a step (sampling, rejection, packing, the drafter's commit) adds or fuses
  away time. The table takes the anchors' costs at their token counts (`step_anchors`)
  and follows the programs' shape V between them: for T_a < T <= T_b, `ms_a + (ms_b -
  ms_a) (V(T) - V(T_a)) / (V(T_b) - V(T_a))` (ms_b where the programs do not grow: T costs
  what its bucket, or the regime at T_b, costs). Entries below B tokens are scaled by
  skip / V(B). Anchors at one token count (B = 1: the one-slot and the full step are the
  same regime) are averaged, and their costs kept monotone (a running maximum: load only
  adds time). Without whole-step times, the programs' table.
  """
  cost = step_cost_model(profile["buckets"], profile["bucket_ms"], profile["draft_ms"],
                         num_slots=num_slots, max_tokens=max_tokens)
  verify = np.asarray(cost.verify_ms, np.float64)
  anchors = step_anchors(profile, num_slots=num_slots, max_tokens=max_tokens)
  if not anchors:
    return verify
  at = {}
  for t, ms in anchors:
    at.setdefault(t, []).append(ms)
  ts = sorted(at)
  ys = np.maximum.accumulate(np.maximum([np.mean(at[t]) for t in ts], 1e-6))
  out = np.minimum(verify * (ys[0] / max(float(verify[ts[0]]), 1e-12)), ys[0])
  for (t_a, y_a), (t_b, y_b) in zip(zip(ts, ys), zip(ts[1:], ys[1:])):
    t = np.arange(t_a + 1, t_b + 1)
    grow = float(verify[t_b] - verify[t_a])
    frac = (verify[t] - verify[t_a]) / grow if grow > 0 else np.ones(t.shape)
    out[t] = y_a + frac * (y_b - y_a)
  out[ts[0]] = ys[0]
  return out


def draft_tables(profile: dict, *, num_slots: int,
                 max_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """`_program_tables` with the subset path's overhead (`subset_overhead`, needs
  `max_tokens` = B (K + 1)) added to every R drafted in a bucket E < B, in both the
  drafting cost and its fixed part (it does not depend on the depth)."""
  draft, fixed = _program_tables(profile, num_slots=num_slots)
  if max_tokens is None:
    return draft, fixed
  extra = subset_overhead(profile, num_slots=num_slots, max_tokens=max_tokens)
  if extra > 0:
    B = num_slots
    sizes = np.asarray(profile.get("draft_buckets", [B]))
    index = np.minimum(np.searchsorted(sizes, np.arange(B + 1), side="left"), len(sizes) - 1)
    small = sizes[index] < B
    # At most what drafting all B in place costs (the table stays monotone).
    grown = np.minimum(draft + extra, draft[B])
    fixed = np.where(small, np.clip(fixed + (grown - draft), 0.0, grown), fixed)
    draft = np.where(small, grown, draft)
  return draft, fixed


def _program_tables(profile: dict, *, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
  """`([B + 1], [B + 1])`: a profile's drafting cost by drafting requests R (all K
  passes) and its fixed part (`CostModel.draft_fixed_ms`).

  R requests cost what the smallest draft bucket E >= R costs (R = 0: the smallest; a
  step with none does not draft); all B slots `draft_ms` without draft buckets. The fixed
  part of a bucket whose depth-1 program costs `first` and K-depth program `full`:
  `(K first - full) / (K - 1)`, in [0, full] (the affine price exact at 1 and K passes);
  zero without depth-1 times (a parallel drafter, or a profile from before them).
  """
  B = num_slots
  draft = np.full(B + 1, float(profile["draft_ms"]))  # drafting for all B slots
  sizes = np.asarray(profile.get("draft_buckets", [B]))
  full = np.asarray(profile.get("draft_bucket_ms", [profile["draft_ms"]]), np.float64)
  index = np.minimum(np.searchsorted(sizes, np.arange(B + 1), side="left"), len(sizes) - 1)
  if "draft_bucket_ms" in profile:
    draft = full[index]
  fixed = np.zeros(B + 1)
  if "draft_first_ms" in profile:
    K = (int(profile["buckets"][-1]) - B) // B
    first = np.asarray(profile["draft_first_ms"], np.float64)
    per = (K * first - full) / max(K - 1, 1) if K > 1 else full
    fixed = np.clip(per, 0.0, full)[index]
  return draft, fixed


def cost_model_from_profile(profile: dict, *, num_slots: int, max_tokens: int) -> CostModel:
  """Step-function, monotone `CostModel` from `measure`'s bucket times, its verify
  entries mapped onto the whole steps the profile measured (`verify_table`).

  A non-monotone profile is repaired to its running maximum with a `UserWarning`
  (`av_jax.profiling.step_cost_model`).

  Raises:
    ValueError: when the profile's buckets stop short of `max_tokens` (a profile of
      another configuration), naming the sizes missing.
  """
  if int(profile["buckets"][-1]) < max_tokens:
    raise ValueError(f"profile: its largest bucket is {profile['buckets'][-1]} tokens, the "
                     f"planner prices steps of up to {max_tokens}: T = "
                     f"{int(profile['buckets'][-1]) + 1}..{max_tokens} are missing "
                     "(re-measure with refresh=True)")
  draft, fixed = draft_tables(profile, num_slots=num_slots, max_tokens=max_tokens)
  # What whole steps cost (section 8.2): the verify entries are mapped onto the measured
  # regimes; a step's drafting is priced by the drafter's programs. A drafting step runs
  # the same verification whatever its active slots, so it pays at least what verifying
  # one draft at full batch costs (B = 64: a step verifying one draft costs what the
  # one-slot regime measured, not the target-only step's 64-token price).
  verify = verify_table(profile, num_slots=num_slots, max_tokens=max_tokens)
  return make_cost_model(draft, verify, draft_fixed_ms=fixed,
                         drafting_floor_ms=float(verify[min(num_slots + 1, max_tokens)]))


# Bumped whenever what `measure` times changes, so older cached profiles are not reused.
PROFILE_VERSION = 16  # what `measure` times; a change makes cached profiles stale


def cache_key(engine: core.Engine) -> str:
  cfg = dataclasses.asdict(engine.config)
  cfg["programs"].pop("steps_per_chunk")
  # av_jax's model set by its config; a target of the user's own by its name.
  models = (engine.target.name if engine.models is None else models_config.identity(engine.models))
  # How the target's verify pass attends (per slot or per token) changes every bucket's
  # time: a target that toggles it gets a profile of its own.
  blob = json.dumps([PROFILE_VERSION, jax.devices()[0].device_kind, cfg, models,
                     engine.drafter.kind, bool(engine.target.verify_read_width)],
                    sort_keys=True, default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_cache_dir() -> str:
  return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                      "av_jax", "costs")


def profile_costs(engine: core.Engine, params: core.Params, *, repeats: int = 5,
                  cache_dir: str | None = None, refresh: bool = False) -> tuple[CostModel, dict]:
  """Measured `CostModel` for `engine`, from the disk cache when present.

  Args:
    engine: the engine whose buckets and drafter are timed.
    params: model parameters.
    repeats: timed runs per program after warm-up (median taken).
    cache_dir: where profiles are kept (default `~/.cache/av_jax/costs`); "" disables.
    refresh: re-measure even when cached.

  Returns:
    `(cost_model, profile)`; `profile["cached"]` says whether it came from disk,
    `profile["age_s"]` (cached only) how long ago it was measured and `profile["path"]`
    where it is kept. A profile measured under load stays cached until `refresh=True`
    (`av-jax profile --refresh`): `describe_source` says which one is in use.
  """
  cfg = engine.config
  cache_dir = default_cache_dir() if cache_dir is None else cache_dir
  path = os.path.join(cache_dir, f"{cache_key(engine)}.json") if cache_dir else ""
  profile = None
  if path and os.path.exists(path) and not refresh:
    try:
      with open(path) as f:
        profile = json.load(f)
      profile["cached"] = True
      # Older cache entries carry no time stamp: the file's modification time is when
      # it was written.
      measured_at = profile.get("measured_at", os.path.getmtime(path))
      profile["age_s"] = max(time.time() - float(measured_at), 0.0)
    except (OSError, ValueError, TypeError):
      profile = None  # a corrupt cache entry is re-measured
  if profile is None:
    profile = measure(engine, params, repeats=repeats)
    profile["measured_at"] = time.time()
    if path:
      os.makedirs(cache_dir, exist_ok=True)
      with open(path, "w") as f:
        json.dump(profile, f, indent=1)
    profile["cached"] = False
  profile["path"] = path
  cost = cost_model_from_profile(profile, num_slots=cfg.num_slots,
                                 max_tokens=cfg.num_slots * (cfg.max_draft + 1))
  return cost, profile


def _age(seconds: float) -> str:
  for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
    if seconds >= size:
      return f"{seconds / size:.1f} {unit}"
  return f"{seconds:.0f} s"


def describe_source(profile: dict) -> str:
  """One line: whether the profile was measured now or read from the cache, and its age."""
  if profile.get("cached"):
    return (f"cost profile: cached, measured {_age(profile.get('age_s', 0.0))} ago "
            f"({profile.get('path') or 'cache'}; --refresh re-measures)")
  return "cost profile: measured now" + (f", cached in {profile['path']}"
                                         if profile.get("path") else "")


def format_profile(profile: dict) -> str:
  """A printable table of a profile, after a line saying where it came from."""
  lines = [describe_source(profile),
           f"device: {profile['device_kind']}  (median of {profile['repeats']} runs)",
           f"draft (all slots, K tokens): {profile['draft_ms']:.3f} ms",
           *([f"draft by drafting slots E: " + ", ".join(
               f"{e}: {ms:.3f} ms" for e, ms in zip(profile["draft_buckets"],
                                                   profile["draft_bucket_ms"]))]
             if "draft_bucket_ms" in profile else []),
           *([f"draft at depth 1 by draft bucket: " + ", ".join(
               f"{e}: {ms:.3f} ms" for e, ms in zip(
                   profile.get("draft_buckets", [profile["buckets"][0]]),
                   profile["draft_first_ms"]))]
             if "draft_first_ms" in profile else []),
           *([f"whole step (all slots active): none drafting {profile['step_ms']['skip']:.3f} ms, "
              f"one slot drafting {profile['step_ms'].get('one', float('nan')):.3f} ms, "
              f"all drafting {profile['step_ms']['full']:.3f} ms"
              ]
             if profile.get("step_ms") else []),
           *([f"verify priced at whole steps: " + ", ".join(
               f"T = {t}: {ms:.3f} ms" for t, ms in step_anchors(
                   profile, num_slots=profile["buckets"][0],
                   max_tokens=profile["buckets"][-1]))]
             if profile.get("step_ms") else []),
           "timed: verify at T = " + ", ".join(str(t) for t in profile["buckets"])
           + f" (the buckets up to the largest step, {profile['buckets'][-1]} tokens)"
           + (", not " + ", ".join(str(t) for t in profile["skipped_buckets"])
              + " (never run)" if profile.get("skipped_buckets") else "")
           + "; drafter at " + ("E = " + ", ".join(str(e) for e in profile["draft_buckets"])
                                + " drafting slots" if "draft_buckets" in profile
                                else "all slots"),
           f"{'bucket T':>9} {'verify ms':>10} {'ms/token':>9}"]
  for size, ms in zip(profile["buckets"], profile["bucket_ms"]):
    lines.append(f"{size:>9} {ms:>10.3f} {ms / size:>9.4f}")
  return "\n".join(lines)
