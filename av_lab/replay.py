"""Replay: recorded draft streams through any decision, cost table and concurrency.

A replayed request is a recorded stream (`av_lab.record`): at its t-th decode step it
drafts the recorded features and, verifying m of its drafts, emits
`min(accepted_t, m) + 1` tokens (its recorded accepted length under full verification,
capped by what is verified). The approximation: a request's next step does not depend on
how far this one got (its t + 1-th recorded row is used whatever this step emitted); what
a step drafts is exact for a parallel drafter and, to the depths it drafts, for an
autoregressive one.

B slots serve `num_requests` requests with per-step admission (a finished request's slot
takes the next request on the next step) until all are done; each step is charged the
deployment's priced time (`policy.StepCost`: drafting the rows and depths drafted, then
verifying the tokens fed), and the run's rate is emitted tokens per priced second. Every
arm replays the same requests:

* `target_only`, `fixed:k`: every active request drafts and verifies k positions, priced
  by its own deployment's tables (a K = k engine);
* `av`: `av_jax.policy` with the online estimator, on the K-position tables (an
  autoregressive drafter drafts pass by pass under `Policy.keep_drafting` and verifies
  what it drafted, as the engine does);
* `av-unlagged`, `av-unlagged-depth-cap`: the ablation of the plan's lagged estimator
  (`policy.lagged_features`): each request's next step predicted by the estimator that
  scores its drafts, on its latest features;
* `av-true`: the same decision fed the recorded true acceptance probabilities (what the
  decision's rules cost, apart from the estimator's errors);
* `oracle`: per step, knowing every request's accepted length, the drafting rows and
  depths (verifying exactly the accepted drafts) with the highest tokens per ms;
* `av-depth-cap`: `av` on the engine whose depth cap `policy.depth_cap` chose from the
  warm estimator (its warm-up requests, not the replayed ones), priced by that engine's
  tables;
* ablations of `av` (`av-prior`: no per-request memory; `av-noexplore`: no exploration;
  `av-planned`, `av-planned-depth-cap`: an autoregressive drafter stops at its planned
  depth and verifies the plan's count, the choice not made again after each pass;
  `av-offset:PRIOR/FORGET`: the plan's memory with per-request offsets,
  `av_lab.ablations.lagged_with_offsets`); any adaptive arm with `-depth-cap` appended
  runs on the capped engine.

Example: `python -m av_lab.replay --drafters block --workloads mixed --concurrency 64
--devices h200` prints every arm's modelled tokens/s and AV's ratio to the best static arm;
`--devices av_lab/tables/h100-measured-llama3-8b-eagle3.json` prices the steps with a
device's measured cost table instead (`table_cost`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from av_jax import costs
from av_jax import policy as P
from av_lab import ablations, record

WORKLOADS = ("code", "prose", "math", "noisy")
MIXED = "mixed"
KIND = {"block": "parallel", "block_head": "parallel", "eagle": "autoregressive",
        "draft_lm": "autoregressive"}
SHAPES = {"block": "llama3-8b-dflash", "block_head": "llama3-8b-dflash",
          "eagle": "llama3-8b-eagle3", "draft_lm": "llama3-8b-mtp"}
ADAPTIVE = ("av", "av-unlagged", "av-true", "av-prior", "av-noexplore", "av-seer", "av-nodecay",
            "av-planned")


class Pool(NamedTuple):
  """Recorded rows of every stream of a workload (device arrays)."""
  features: jax.Array      # [rows, K] float32
  accepted: jax.Array      # [rows] int32
  accept_probs: jax.Array  # [rows, K] float32
  starts: np.ndarray       # [N_streams] row of each stream's first step
  steps: np.ndarray        # [N_streams] recorded steps of each stream
  groups: np.ndarray       # [N_streams] workload index of each stream


class Requests(NamedTuple):
  start: jax.Array   # [N] int32, first row replayed
  length: jax.Array  # [N] int32, tokens to emit (<= rows left, so no request runs out)


def load_pool(drafter: str, workload: str, directory: str | None = None) -> Pool:
  names = WORKLOADS if workload == MIXED else (workload,)
  parts = [record.load(drafter, name, directory) for name in names]
  base = np.cumsum([0] + [len(p.accepted) for p in parts])[:-1]
  # Rows padded to a multiple of 2**16, so every pool shares one compiled replay.
  rows = sum(len(p.accepted) for p in parts)
  pad = lambda x: np.concatenate([x, np.zeros((-rows % 2**16,) + x.shape[1:], x.dtype)])
  cat = lambda name: pad(np.concatenate([getattr(p, name) for p in parts]))
  return Pool(
      features=jnp.asarray(cat("features"), jnp.float32),
      accepted=jnp.asarray(cat("accepted"), jnp.int32),
      accept_probs=jnp.asarray(cat("accept_probs"), jnp.float32),
      starts=np.concatenate([b + p.offsets[:-1] for b, p in zip(base, parts)]),
      steps=np.concatenate([p.steps() for p in parts]),
      groups=np.concatenate([np.full(p.num_requests, i) for i, p in enumerate(parts)]))


def make_requests(pool: Pool, *, num: int, length: int, seed: int) -> Requests:
  """`num` requests of `length` tokens drawn from the pool's streams: request i takes
  workload i mod G (a mixed pool interleaves its workloads), a random stream of it and a
  random first step leaving at least `length` steps (fewer tokens where the stream is
  shorter)."""
  rng = np.random.default_rng(seed)
  G = int(pool.groups.max()) + 1
  start, size = np.zeros(num, np.int32), np.zeros(num, np.int32)
  for i in range(num):
    candidates = np.nonzero(pool.groups == i % G)[0]
    s = candidates[rng.integers(len(candidates))]
    n = min(length, int(pool.steps[s]))
    start[i] = pool.starts[s] + rng.integers(int(pool.steps[s]) - n + 1)
    size[i] = n
  return Requests(jnp.asarray(start), jnp.asarray(size))


class Totals(NamedTuple):
  tokens: jax.Array      # [] float32, emitted
  ms: jax.Array          # [] float32, priced time
  draft_ms: jax.Array    # [] float32, of which drafting
  explore_ms: jax.Array  # [] float32, of which exploration (priced)
  steps: jax.Array       # [] int32
  drafting: jax.Array    # [] int32, steps on which some request drafted
  verified: jax.Array    # [] float32, draft tokens verified
  passes: jax.Array      # [] float32, drafter passes (depths run by some request)
  predicted: jax.Array   # [] float32, accepted drafts the estimator predicted for the
                         # verified positions (adaptive arms: calibration of the choice)
  accepted: jax.Array    # [] float32, drafts accepted


def _zeros_totals() -> Totals:
  f, i = (lambda: jnp.zeros((), jnp.float32)), (lambda: jnp.zeros((), jnp.int32))
  return Totals(f(), f(), f(), f(), i(), i(), f(), f(), f(), f())


def _oracle(accepted, active, cost: P.StepCost, K: int) -> jax.Array:
  """Per step, in hindsight: the drafting rows and depths, verifying exactly the accepted
  drafts, with the most tokens per ms (best of two candidate orders: by depth, and by
  request, most accepted first)."""
  B = accepted.shape[0]
  j = jnp.arange(K)[None, :]
  useful = j < accepted[:, None]
  none = jnp.zeros((B, K), bool)
  by_depth = P.choose(useful.astype(jnp.float32), eligible=useful, forced=none,
                      active=active, cost=cost)
  by_row = P.choose(jnp.where(useful, 1.0 + accepted[:, None] / (K + 1.0), 0.0),
                    eligible=useful, forced=none, active=active, cost=cost)
  rate = lambda c: jnp.sum(jnp.where(active, jnp.minimum(accepted, c.num) + 1, 0)) / c.cost_ms
  return jnp.where(rate(by_row) > rate(by_depth), by_row.num, by_depth.num)


@functools.partial(jax.jit, static_argnames=("arm", "num_slots", "kind", "policy",
                                             "block_choice", "shared_passes"))
def _run(pool_f, pool_a, pool_p, requests: Requests, cost: P.StepCost, k_static, state0, *,
         arm: str, num_slots: int, kind: str, policy: P.Policy | None,
         block_choice: bool = False, shared_passes: bool = False):
  B, K = num_slots, pool_f.shape[1]
  N = requests.start.shape[0]
  j = jnp.arange(K)[None, :]
  parallel = kind == "parallel"

  def cond(carry):
    left, nxt = carry[1], carry[2]
    return jnp.any(left > 0) | (nxt < N)

  def body(carry):
    row, left, nxt, state, tot = carry
    idle = left <= 0
    req = nxt + jnp.cumsum(idle) - 1
    admit = idle & (req < N)
    safe = jnp.minimum(req, N - 1)
    row = jnp.where(admit, requests.start[safe], row)
    left = jnp.where(admit, requests.length[safe], left)
    nxt = nxt + jnp.sum(admit, dtype=jnp.int32)
    active = left > 0
    R = jnp.sum(active, dtype=jnp.int32)
    f, a, p = pool_f[row], pool_a[row], pool_p[row]
    explore_ms = jnp.zeros((), jnp.float32)
    if arm == "static":
      m = jnp.where(active, k_static, 0)
      depth = m
    elif arm == "oracle":
      m = _oracle(a, active, cost, K)
      depth = jnp.where(m > 0, K if parallel else m, 0)
    else:
      state = policy.admit(state, admit)
      x = p if arm == "av-true" else f
      if arm == "av-seer":  # the plan sees this step's features (an upper bound)
        state = state._replace(memory=state.memory._replace(
            latest=f, known=jnp.ones_like(state.memory.known)))
      if arm == "av-true":  # the plan knows this step's acceptance probabilities too
        state = state._replace(memory=state.memory._replace(
            latest=p, known=jnp.ones_like(state.memory.known)))
      plan = policy.plan(state, active, cost)
      if parallel and not block_choice:  # the engine's block drafter drafts its block
        plan = plan._replace(depth=jnp.where(plan.draft, K, 0))
      if not (policy.current or arm == "av-planned"):
        staged_m, staged_depth = _staged(policy, state, plan, x, active, cost)
        plan = plan._replace(depth=staged_depth, num=staged_m)
      depth, explore_ms = plan.depth, plan.explore_ms
    drafted = (j < depth[:, None]) & active[:, None]
    rows = jnp.sum(drafted, axis=0, dtype=jnp.int32)
    if shared_passes:  # every drafting row runs every pass up to the deepest (the engine)
      rows = jnp.where(rows > 0, rows[0], 0)
    draft_ms = cost.draft(rows)
    predicted = jnp.zeros((), jnp.float32)
    if arm not in ("static", "oracle"):
      m = policy.verify(state, plan, x, active, cost, draft_ms)
      survival = policy.survival(state, x)
      predicted = jnp.sum(jnp.where(j < m[:, None], survival, 0.0))
    got = jnp.minimum(a, m)
    emitted = jnp.where(active, jnp.minimum(got + 1, left), 0)
    step_ms = draft_ms + cost.verify(R + jnp.sum(m))
    if arm not in ("static", "oracle"):
      acc = (j < got[:, None]) & active[:, None]
      labeled = acc | ((j == got[:, None]) & (j < m[:, None]) & active[:, None])
      state = policy.learn(state, P.StepOutcome(
          features=x, drafted=drafted, accepted=acc, labeled=labeled, step_ms=step_ms,
          explore_ms=explore_ms))
    tot = Totals(tokens=tot.tokens + jnp.sum(emitted), ms=tot.ms + step_ms,
                 draft_ms=tot.draft_ms + draft_ms, explore_ms=tot.explore_ms + explore_ms,
                 steps=tot.steps + 1, drafting=tot.drafting + jnp.any(drafted),
                 verified=tot.verified + jnp.sum(m),
                 passes=tot.passes + (jnp.max(jnp.where(active, depth, 0))),
                 predicted=tot.predicted + predicted, accepted=tot.accepted + jnp.sum(got))
    return row + active, left - emitted, nxt, state, tot

  carry = (jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.int32), jnp.zeros((), jnp.int32),
           state0, _zeros_totals())
  _, _, _, state, tot = jax.lax.while_loop(cond, body, carry)
  return tot, state


def _staged(policy: P.Policy, state: P.PolicyState, plan: P.Plan, features, active,
            cost: P.StepCost):
  """An autoregressive drafter's passes under `Policy.keep_drafting`: the planned rows
  draft depth 1, then each drafts on while the choice made again after the pass says so;
  every drafted position is verified. Returns `(num [B], depth [B])`."""
  B, K = features.shape
  probs = policy.estimator.predict(state.estimator, features)
  going = plan.draft & active
  drafted = jnp.zeros((B, K), bool)
  for j in range(K):
    drafted = drafted.at[:, j].set(going)
    if j + 1 < K:
      going = policy.keep_drafting(state, plan, probs, drafted, j + 1, active=active,
                                   cost=cost)
  depth = jnp.sum(drafted, axis=1, dtype=jnp.int32)
  return depth, depth


@functools.lru_cache(maxsize=None)  # one object per arm: a compiled replay is reused
def _policy(arm: str, K: int, kind: str, refit_interval: int,
            shared_passes: bool = False) -> P.Policy:
  est = P.online_estimator(K, refit_interval=refit_interval)
  if shared_passes:
    if arm == "av-true":
      return P.make_policy(K, drafter_kind=kind, estimator=P.identity_estimator(K),
                           memory=P.latest_features(), shared_passes=True)
    return P.make_policy(K, drafter_kind=kind, estimator=est, shared_passes=True)
  if arm == "av-true":  # the latest true probabilities predict the next step's
    return P.make_policy(K, drafter_kind=kind, estimator=P.identity_estimator(K),
                         memory=P.latest_features())
  if arm.startswith("av-est:"):  # estimator settings, e.g. av-est:damping=10;l2=0.01
    settings = dict(kv.split("=") for kv in arm.split(":", 1)[1].split(";"))
    est = P.online_estimator(K, refit_interval=refit_interval,
                             **{k: float(v) for k, v in settings.items()})
    return P.make_policy(K, drafter_kind=kind, estimator=est)
  if arm.startswith("av-explore:"):
    return P.make_policy(K, drafter_kind=kind, estimator=est,
                         explorer=P.explore_credit(float(arm.split(":")[1])))
  if arm.startswith("av-offset:"):  # per-request offsets, e.g. av-offset:4/0.95
    prior, forget = (float(x) for x in arm.split(":")[1].split("/"))
    memory = ablations.lagged_with_offsets(
        P.online_estimator(K, refit_interval=refit_interval), prior=prior, forget=forget)
    return P.make_policy(K, drafter_kind=kind, estimator=est, memory=memory)
  if arm == "av-seer":  # this step's own features, read by the estimator that scores them
    return P.make_policy(K, drafter_kind=kind, estimator=est, memory=P.latest_features())
  if arm == "av-nodecay":
    return P.make_policy(K, drafter_kind=kind, estimator=est, memory=P.lagged_features(
        P.online_estimator(K, refit_interval=refit_interval), decay=1.0))
  if arm == "av-unlagged":
    return P.make_policy(K, drafter_kind=kind, estimator=est, memory=P.latest_features())
  if arm == "av-prior":
    return P.make_policy(K, drafter_kind=kind, estimator=est, memory=_position_prior())
  if arm == "av-noexplore":
    return P.make_policy(K, drafter_kind=kind, estimator=est, explorer=P.no_exploration())
  return P.make_policy(K, drafter_kind=kind, estimator=est)


def _position_prior() -> P.Part:
  """`av-prior`'s memory: every request is predicted by the depth means."""
  part = P.latest_features()
  return part._replace(update=lambda state, step, **kw: part.update(state, step)._replace(
      known=jnp.zeros_like(state.known)))


def pad_cost(tables: costs.CostTables, K: int, num_slots: int) -> P.StepCost:
  """A `StepCost` padded to K depth columns and `B (K + 1)` verified tokens (static arms of
  a smaller K share the adaptive arms' shapes)."""
  depth = np.zeros((num_slots + 1, K))
  d = np.asarray(tables.draft_depth_ms)
  depth[:, :d.shape[1]] = d[:num_slots + 1]
  v = np.asarray(tables.cost.verify_ms)
  verify = np.full(num_slots * (K + 1) + 1, v[-1])
  verify[:len(v)] = v[:len(verify)]
  return P.StepCost(jnp.asarray(depth, jnp.float32), jnp.asarray(verify, jnp.float32))


@functools.lru_cache(maxsize=512)
def deployment_cost(device: str, drafter: str, num_slots: int, k: int, K: int,
                    context_len: int = 2048, block_choice: bool = False) -> P.StepCost:
  """The modelled llama3-8b deployment's prices for a K = k engine (k = 0: no drafter).
  A parallel drafter's pass drafts its whole block of k (the engine's); with
  `block_choice` its depth columns are the pass's increments with the block size (an
  engine that can run a smaller block on a step). `device` may instead name a cost-table
  file (`*.json`, `av_jax.costs.save_cost_table`, such as a device's measured table):
  `table_cost` prices from it."""
  if device.endswith(".json"):
    return table_cost(device, num_slots, k, K)
  tables = lambda k, drafter: costs.roofline_costs(
      "llama3-8b", drafter, device, drafter_kind=KIND[drafter_name], num_slots=num_slots,
      max_draft=max(k, 1), context_len=context_len)
  drafter_name = drafter
  top = tables(k, SHAPES[drafter] if k else None)
  if k and KIND[drafter] == "parallel" and block_choice:
    passes = [np.asarray(tables(d, SHAPES[drafter]).draft_depth_ms)[:, 0]
              for d in range(1, k + 1)]
    top = top._replace(draft_depth_ms=P.StepCost.parallel_depths(np.stack(passes)))
  return pad_cost(top, K, num_slots)


@functools.lru_cache(maxsize=512)
def table_cost(path: str, num_slots: int, k: int, K: int) -> P.StepCost:
  """A K = k engine's prices from a cost-table file: its verify table, and its drafter's
  first k depth columns (none for k = 0). The file prices the drafter it was measured
  with (`benchmarks/accelerator.py` measures an EAGLE-3-shaped, autoregressive one: replay
  autoregressive drafters on it). Example: the H100 table, 64 rows, replayed at B = 16,
  k = 2 prices a step drafting 16 rows two depths deep at `draft_depth_ms[16, :2].sum()`.

  Raises:
    ValueError: naming `path`, where the table has fewer drafter rows than `num_slots`.
  """
  tables = costs.load_cost_table(path)
  rows = np.asarray(tables.draft_depth_ms).shape[0] - 1
  if num_slots > rows:
    raise ValueError(f"devices: {path} prices up to {rows} drafting requests, "
                     f"got concurrency {num_slots}")
  depth = np.asarray(tables.draft_depth_ms)[:, :k] if k else np.zeros((rows + 1, 1))
  return pad_cost(tables._replace(draft_depth_ms=depth), K, num_slots)


@dataclasses.dataclass(frozen=True)
class Point:
  drafter: str
  workload: str
  device: str
  concurrency: int


def static_arms(K: int) -> tuple[str, ...]:
  return ("target_only",) + tuple(f"fixed:{k}" for k in range(1, K + 1))


def replay_point(point: Point, *, arms: Sequence[str], pool: Pool, num_requests: int,
                 length: int, seed: int = 0, refit_interval: int = 16,
                 warm: bool = True, cost_fn=None, block_choice: bool = False,
                 shared_passes: bool = False) -> dict[str, dict]:
  """Every arm at one point; `{arm: {"tokens_per_s", ...}}` (modelled seconds).
  `shared_passes`: an autoregressive drafter's passes are charged for every drafting
  request up to the deepest (an engine of static shapes, like av_jax's), and AV plans so;
  else each request pays its own depths (ragged kernels)."""
  K = int(pool.features.shape[1])
  B, kind = point.concurrency, KIND[point.drafter]
  cost_fn = cost_fn or (lambda k: deployment_cost(point.device, point.drafter, B, k, K,
                                                  block_choice=block_choice))
  requests = make_requests(pool, num=num_requests, length=length, seed=seed)
  out = {}
  for arm in arms:
    if arm.endswith("-depth-cap"):
      out[arm] = _capped_av(point, pool=pool, requests=requests, length=length, seed=seed,
                            refit_interval=refit_interval, shared_passes=shared_passes,
                            arm=arm.removesuffix("-depth-cap"))
      continue
    if arm in ADAPTIVE or arm.startswith(("av-explore:", "av-est:", "av-offset:")):
      policy = _policy(arm, K, kind, refit_interval, shared_passes)
      cost, k = cost_fn(K), 0
      state = (_warm(policy, pool, cost, B=B, kind=kind, arm=arm, length=length, seed=seed,
                     block_choice=block_choice, shared_passes=shared_passes)
               if warm else policy.init(B))
      mode = arm
    elif arm == "oracle":
      policy, state, cost, k, mode = None, jnp.zeros(()), cost_fn(K), 0, "oracle"
    else:
      k = 0 if arm == "target_only" else int(arm.split(":")[1])
      policy, state, cost, mode = None, jnp.zeros(()), cost_fn(k), "static"
    tot, _ = _run(pool.features, pool.accepted, pool.accept_probs, requests, cost, k, state,
                  arm=mode, num_slots=B, kind=kind, policy=policy, block_choice=block_choice,
                  shared_passes=shared_passes)
    out[arm] = _totals(tot)
  return out


def _totals(tot: Totals) -> dict:
  tot = jax.tree.map(float, jax.device_get(tot))
  return dict(tokens_per_s=1e3 * tot.tokens / tot.ms, tokens=tot.tokens, ms=tot.ms,
              steps=tot.steps, drafting_share=tot.drafting / tot.steps,
              explore_share=tot.explore_ms / tot.ms, draft_share=tot.draft_ms / tot.ms,
              verified_per_step=tot.verified / tot.steps,
              passes_per_step=tot.passes / tot.steps,
              calibration=tot.predicted / max(tot.accepted, 1.0))


def _truncated(pool: Pool, k: int) -> Pool:
  """The pool as a K = k drafter records it: its first k depths."""
  return pool._replace(features=pool.features[:, :k], accept_probs=pool.accept_probs[:, :k],
                       accepted=jnp.minimum(pool.accepted, k))


# A warm estimator has been refitted at least this many times (a server that has been
# running): warm-up runs of fresh requests repeat until it has, at most `_WARM_RUNS` runs.
WARM_REFITS = 8
_WARM_RUNS = 32


def warmup_requests(pool: Pool, *, B: int, length: int, seed: int, run: int = 0) -> Requests:
  """The requests of warm-up run `run` (other requests than the replayed ones)."""
  return make_requests(pool, num=max(B, 32), length=length, seed=seed + 7919 * (run + 1))


def _warm(policy: P.Policy, pool: Pool, cost: P.StepCost, *, B: int, kind: str, length: int,
          seed: int, arm: str = "av", block_choice: bool = False,
          shared_passes: bool = False, runs: list | None = None) -> P.PolicyState:
  """A fresh state whose estimator was fitted by replaying warm-up requests until it has
  been refitted `WARM_REFITS` times. Example: eagle math at B = 16 emits 32 warm-up
  requests in ~24 steps, so a refit every 16 steps needs ~6 runs for 8 refits. `runs`:
  a list that gets `(requests, state at the run's end)` of every warm-up run."""
  state = policy.init(B)
  for run in range(_WARM_RUNS):
    warmup = warmup_requests(pool, B=B, length=length, seed=seed, run=run)
    _, state = _run(pool.features, pool.accepted, pool.accept_probs, warmup, cost, 0,
                    state, arm=arm, num_slots=B, kind=kind, policy=policy,
                    block_choice=block_choice, shared_passes=shared_passes)
    fresh = policy.init(B)
    state = fresh._replace(estimator=state.estimator,
                           memory=fresh.memory._replace(lag=state.memory.lag))
    if runs is not None:
      runs.append((warmup, state))
    refits = getattr(state.estimator, "num_refits", None)
    if refits is None or int(refits) >= WARM_REFITS:
      break
  return state


def _capped_av(point: Point, *, pool: Pool, requests: Requests, length: int, seed: int,
               refit_interval: int, shared_passes: bool, arm: str = "av") -> dict:
  """`av-depth-cap`: AV on an engine whose depth cap `policy.depth_cap` chose from the warm
  estimator's survival on the warm-up requests' recorded features (other requests than
  the replayed ones) and each cap's deployment tables (as `compare --depth-cap` does);
  then AV, warmed again
  at that cap, replays the requests on it. Each warm-up run's requests are predicted
  with the coefficients that run ended with, as the engine's warm-up samples its curves
  with the coefficients in force (`compare._CurveSampler`): one refit does not decide."""
  K, B, kind = int(pool.features.shape[1]), point.concurrency, KIND[point.drafter]
  policy = _policy(arm, K, kind, refit_interval, shared_passes)
  caps = [deployment_cost(point.device, point.drafter, B, k, k) for k in range(1, K + 1)]
  warm = dict(B=B, kind=kind, length=length, seed=seed, shared_passes=shared_passes, arm=arm)
  runs: list = []
  _warm(policy, pool, caps[-1], runs=runs, **warm)
  # One curve per warm-up request: the mean predicted survival over its recorded steps.
  survival = np.concatenate([_request_curves(policy, state, pool, warmup)
                             for warmup, state in runs])
  cap = P.depth_cap(survival, caps, num_slots=B, shared_passes=kind == "parallel").cap
  sub = _truncated(pool, cap)
  policy = _policy(arm, cap, kind, refit_interval, shared_passes)
  state = _warm(policy, sub, caps[cap - 1], **warm)
  tot, _ = _run(sub.features, sub.accepted, sub.accept_probs, requests, caps[cap - 1], 0,
                state, arm=arm, num_slots=B, kind=kind, policy=policy,
                shared_passes=shared_passes)
  return dict(_totals(tot), depth_cap=cap)


def _request_curves(policy: P.Policy, state: P.PolicyState, pool: Pool,
                    requests: Requests) -> np.ndarray:
  """`[N, K]`: each request's predicted survival under `state`, averaged over its rows."""
  starts, lengths = np.asarray(requests.start), np.asarray(requests.length)
  rows = np.concatenate([np.arange(a, a + n) for a, n in zip(starts, lengths)])
  owner = np.repeat(np.arange(len(starts)), lengths)
  per_row = np.asarray(policy.survival(state, pool.features[jnp.asarray(rows)]))
  return np.stack([per_row[owner == i].mean(axis=0) for i in range(len(starts))])


def summarize(result: dict[str, dict], K: int) -> dict:
  statics = [a for a in static_arms(K) if a in result]
  best = max(statics, key=lambda a: result[a]["tokens_per_s"]) if statics else None
  row = {"best_static": best}
  for arm, r in result.items():
    if best is not None:
      row[f"{arm}/best"] = r["tokens_per_s"] / result[best]["tokens_per_s"]
  return row


def grid(*, drafters: Sequence[str], workloads: Sequence[str], devices: Sequence[str],
         concurrency: Sequence[int], arms: Sequence[str], requests_per_slot: int = 3,
         min_requests: int = 96, length: int = 64, seed: int = 0, block_choice: bool = False,
         log=print) -> list[dict]:
  rows = []
  for drafter in drafters:
    for workload in workloads:
      pool = load_pool(drafter, workload)
      K = int(pool.features.shape[1])
      for B in concurrency:
        for device in devices:
          point = Point(drafter, workload, device, B)
          result = replay_point(point, arms=arms, pool=pool,
                                num_requests=max(requests_per_slot * B, min_requests),
                                length=length, seed=seed, block_choice=block_choice)
          row = dict(dataclasses.asdict(point), arms=result, **summarize(result, K))
          rows.append(row)
          log(format_row(row))
  return rows


def ablation_table(rows: Sequence[dict], arms: Sequence[str]) -> str:
  """Markdown: per arm, its ratio to the best static arm over the grid's points (min,
  median, mean) and the points at >= 0.98x and at >= 1.02x."""
  lines = ["| arm | min | median | mean | points >= 0.98 | points >= 1.02 |",
           "|---|---:|---:|---:|---:|---:|"]
  for arm in arms:
    r = np.asarray([row[f"{arm}/best"] for row in rows if f"{arm}/best" in row])
    if len(r):
      lines.append(f"| {arm} | {r.min():.3f} | {np.median(r):.3f} | {r.mean():.3f} | "
                   f"{int((r >= 0.98).sum())}/{len(r)} | {int((r >= 1.02).sum())}/{len(r)} |")
  return "\n".join(lines)


def grid_markdown(rows: Sequence[dict], arm: str = "av") -> str:
  """Markdown: one table per drafter, a row per (workload, B), `arm` / the best static
  arm on every device, and on the first device the best static arm, `av-true` and the
  oracle."""
  out = []
  devices = list(dict.fromkeys(r["device"] for r in rows))
  for drafter in dict.fromkeys(r["drafter"] for r in rows):
    first = devices[0]
    out += [f"**{drafter}** ({arm} / best static arm, modelled llama3-8b)", "",
            "| workload | B | " + " | ".join(devices) + f" | best static ({first}) | "
            f"av-true ({first}) | oracle ({first}) |",
            "|---|---:|" + "---:|" * (len(devices) + 3)]
    mine = [r for r in rows if r["drafter"] == drafter]
    for workload in dict.fromkeys(r["workload"] for r in mine):
      for B in sorted({r["concurrency"] for r in mine if r["workload"] == workload}):
        at = {r["device"]: r for r in mine if r["workload"] == workload
              and r["concurrency"] == B}
        cell = lambda v: f"**{v:.3f}**" if v < 0.98 else f"{v:.3f}"
        f = at[first]
        out.append(f"| {workload} | {B} | " + " | ".join(cell(at[d][f"{arm}/best"])
                                                          for d in devices)
                   + f" | {f['best_static']} | {f.get('av-true/best', float('nan')):.3f} | "
                   f"{f.get('oracle/best', float('nan')):.3f} |")
    out.append("")
  return "\n".join(out)


def format_row(row: dict) -> str:
  ratios = " ".join(f"{k[:-5]}={v:.3f}" for k, v in row.items()
                    if k.endswith("/best") and not k.startswith(("fixed", "target")))
  return (f"{row['drafter']:8s} {row['workload']:6s} {row['device']:8s} "
          f"B={row['concurrency']:<5d} best={row['best_static']:11s} {ratios}")


def main(argv=None) -> None:
  import argparse
  import json
  import time
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--drafters", default="block,eagle,draft_lm")
  parser.add_argument("--workloads", default="mixed,math,code")
  parser.add_argument("--devices", default=",".join(costs.DEVICES))
  parser.add_argument("--concurrency", default="1,4,16,64,256,1024")
  parser.add_argument("--arms", default=None,
                      help="default: every static arm, av, av-true, oracle")
  parser.add_argument("--length", type=int, default=64)
  parser.add_argument("--requests-per-slot", type=int, default=3)
  parser.add_argument("--min-requests", type=int, default=96,
                      help="requests replayed at least (B = 32 with 1 a slot and 32: one wave)")
  parser.add_argument("--json", default=None)
  parser.add_argument("--block-choice", action="store_true",
                      help="a parallel drafter may run a smaller block on a step")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--markdown", default=None, help="write the grid's tables here")
  parser.add_argument("--table-arm", default="av", help="the arm the --markdown tables show")
  args = parser.parse_args(argv)
  arms = (args.arms.split(",") if args.arms else
          list(static_arms(8)) + ["av", "av-true", "oracle"])
  start = time.perf_counter()
  rows = grid(drafters=args.drafters.split(","), workloads=args.workloads.split(","),
              devices=args.devices.split(","),
              concurrency=[int(c) for c in args.concurrency.split(",")], arms=arms,
              requests_per_slot=args.requests_per_slot, min_requests=args.min_requests,
              length=args.length, seed=args.seed,
              block_choice=args.block_choice)
  print(f"{len(rows)} points in {time.perf_counter() - start:.0f} s")
  print(ablation_table(rows, [a for a in arms if a not in static_arms(8)]))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  if args.markdown:
    with open(args.markdown, "w") as f:
      f.write(grid_markdown(rows, args.table_arm) + "\n" + ablation_table(rows, [
          a for a in arms if a not in static_arms(8)]) + "\n")


if __name__ == "__main__":
  main()
