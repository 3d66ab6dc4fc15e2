"""Host loop: continuous batching over jitted decode chunks.

The device runs `run_chunk` (a `lax.scan` of decode steps) with no host transfer inside.
Between chunks the host reads the slots' active flags and lengths (one small transfer),
collects finished requests, and prefills waiting requests into the freed slots.

With a mesh spanning several processes (`av_jax.engine.distributed`) every process runs
this same loop: the host reads gather the slot-sharded arrays to every process
(`distributed.fetch`), so all processes take the same decisions, and the host inputs
(prompt, slot, limits) enter the jitted functions as replicated arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from av_jax.costs import CostTables
from av_jax.decider import PolicyDecider
from av_jax.engine import clock as modelled_clock
from av_jax.engine import core
from av_jax.engine import distributed
from av_jax.engine import sharding
from av_jax.selection import CostModel


@dataclasses.dataclass
class Completion:
  """One request's result."""
  prompt: list[int]            # the prompt token ids
  tokens: list[int]            # generated token ids (first one drawn at prefill)
  finish_reason: str           # "eos", "length", or "error"
  error: str | None = None     # why the request was refused, when finish_reason == "error"


@dataclasses.dataclass
class GenerateResult:
  completions: list[Completion]   # in request order
  stats: dict[str, float]         # totals from the engine's running statistics
  infos: list[core.StepInfo]      # per-chunk step records (host numpy), if kept
  state: core.DecodeState | None = None  # the final (idle) state, to continue from
  stopped: bool = False          # True when `stop_after_chunks` ended the run early
  wall_s: float = 0.0            # wall-clock seconds of the run (prefills included)
  # With a modelled clock: `av_jax.engine.clock.figures` of the run (the deployment's
  # modelled seconds, tokens/s and per-request tokens/s, and its "modelled: ..." label),
  # next to the wall clock, never instead of it. None under the wall clock.
  modelled: dict | None = None
  # Wall seconds of each decode chunk (dispatch to its step records on the host; the
  # prefills between chunks are not in them), in chunk order.
  chunk_seconds: list[float] = dataclasses.field(default_factory=list)


def _prompt_bucket(length: int, max_prompt: int) -> int:
  """Static padded prompt length: the next power of two >= 16, capped at max_prompt."""
  size = 16
  while size < length:
    size *= 2
  return min(size, max_prompt)


@functools.lru_cache(maxsize=32)
def compiled(engine: core.Engine):
  """Jitted (prefill, run_chunk, init) for an engine; cached so it compiles once."""
  prefill = jax.jit(lambda params, state, prompt, prompt_len, slot, max_new: core.prefill(
      engine, params, state, prompt=prompt, prompt_len=prompt_len, slot=slot,
      max_new=max_new), donate_argnums=(1,))
  chunk = jax.jit(lambda params, state: core.run_chunk(engine, params, state),
                  donate_argnums=(1,))
  init = jax.jit(lambda params, key, cost: core.init_state(engine, params, key, cost))
  return prefill, chunk, init


@functools.lru_cache(maxsize=32)
def compiled_modes(engine: core.Engine):
  """Jitted `(quiet, drafting)`: `core.run_mode` of each kind, `(params, state, limit) ->
  (state, records, count)` (an engine that `core.splits_quiet`)."""
  return tuple(jax.jit(functools.partial(_mode, engine, quiet), donate_argnums=(1,))
               for quiet in (True, False))


def decode_programs(engine: core.Engine) -> tuple:
  """The jitted decode programs `generate` runs for `engine` (one device): the
  `compiled_modes` pair where the engine splits quiet steps (`core.splits_quiet`), else
  `(run_chunk,)`."""
  return compiled_modes(engine) if core.splits_quiet(engine) else (compiled(engine)[1],)


def _mode(engine, quiet, params, state, limit):
  return core.run_mode(engine, params, state, limit, quiet=quiet)


class _ChunkRunner:
  """One chunk of `steps_per_chunk` steps as a sequence of `core.run_mode` calls: the
  quiet program while no slot drafts, the drafting program while some do, switching on
  the host where one stops short (one count read per call). The chunk's boundaries, and
  so every step's state, are `run_chunk`'s. The kind a chunk starts with is the one the
  last call ended in (a quiet call that finds the next step drafting runs no step)."""

  def __init__(self, engine: core.Engine, programs):
    self.quiet_prog, self.draft_prog = programs
    self.steps = engine.config.programs.steps_per_chunk
    self.quiet = True
    self.calls = [0, 0]  # quiet, drafting

  def __call__(self, params, state):
    done, pieces = 0, []
    while done < self.steps:
      program = self.quiet_prog if self.quiet else self.draft_prog
      self.calls[not self.quiet] += 1
      state, records, count = program(params, state, np.int32(self.steps - done))
      count = int(distributed.fetch(count))
      if count:
        pieces.append((records, count))
      done += count
      if done < self.steps:
        self.quiet = not self.quiet
    return state, pieces

  @staticmethod
  def records(pieces) -> core.StepInfo:
    """The chunk's step records (host NumPy), stacked over its steps."""
    parts = [jax.tree.map(lambda x: x[:count], distributed.fetch(records))
             for records, count in pieces]
    return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)


_SHARDED: dict = {}


def compiled_sharded(engine: core.Engine, mesh, params: core.Params,
                     state: core.DecodeState):
  """Jitted (prefill, run_chunk, modes) with explicit in/out shardings over `mesh`
  (`modes`: `compiled_modes`'s pair, None for an engine that does not split quiet steps)."""
  key = (engine, mesh, jax.tree.structure(params))
  if key not in _SHARDED:
    params_sh = sharding.param_shardings(mesh, params)
    state_sh = sharding.state_shardings(mesh, state)
    rep = NamedSharding(mesh, PartitionSpec())
    prefill_fn = lambda params, state, prompt, prompt_len, slot, max_new: core.prefill(
        engine, params, state, prompt=prompt, prompt_len=prompt_len, slot=slot,
        max_new=max_new)
    chunk_fn = lambda params, state: core.run_chunk(engine, params, state)
    if sharding.is_explicit(mesh):
      # Explicit axes type every array's sharding; the model code inside is written for
      # compiler propagation, so it runs in Auto mode between explicitly sharded
      # inputs and outputs.
      spec = lambda tree: jax.tree.map(lambda sh: sh.spec, tree)
      info_spec = core.StepInfo(*([PartitionSpec()] * len(core.StepInfo._fields)))
      prefill_fn = jax.sharding.auto_axes(prefill_fn, out_sharding=spec(state_sh))
      chunk_fn = jax.sharding.auto_axes(chunk_fn, out_sharding=(spec(state_sh), info_spec))
    prefill = jax.jit(prefill_fn, in_shardings=(params_sh, state_sh, rep, rep, rep, rep),
                      out_shardings=state_sh, donate_argnums=(1,))
    chunk = jax.jit(chunk_fn, in_shardings=(params_sh, state_sh),
                    out_shardings=(state_sh, rep), donate_argnums=(1,))
    modes = None
    if core.splits_quiet(engine):
      def mode_fn(quiet):
        fn = functools.partial(_mode, engine, quiet)
        if sharding.is_explicit(mesh):
          fn = jax.sharding.auto_axes(fn, out_sharding=(spec(state_sh), info_spec,
                                                        PartitionSpec()))
        return jax.jit(fn, in_shardings=(params_sh, state_sh, rep),
                       out_shardings=(state_sh, rep, rep), donate_argnums=(1,))
      modes = (mode_fn(True), mode_fn(False))
    _SHARDED[key] = (prefill, chunk, modes)
  return _SHARDED[key]


def validate_prompt(prompt: Sequence[int], *, vocab_size: int, max_prompt: int) -> str | None:
  """Why a prompt cannot be served, or None."""
  if len(prompt) == 0:
    return "prompt: expected at least one token, got an empty prompt"
  if len(prompt) > max_prompt:
    return f"prompt: {len(prompt)} tokens exceed the engine's limit of {max_prompt}"
  bad = [t for t in prompt if not 0 <= int(t) < vocab_size]
  if bad:
    return f"prompt: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})"
  return None


def generate(engine: core.Engine, params: core.Params, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int | Sequence[int], key: jax.Array,
             cost: CostModel | None = None, keep_infos: bool = False,
             on_chunk: Callable[[core.DecodeState, core.StepInfo], None] | None = None,
             state: core.DecodeState | None = None, mesh=None,
             stop_after_chunks: int | None = None, checkpoint_path: str | None = None,
             resume_from: str | None = None,
             clock: str | CostTables = "wall",
             learn: bool | Sequence[bool] = True) -> GenerateResult:
  """Generates continuations of `prompts` with continuous batching.

  Args:
    engine: a configured engine (`core.make_engine`).
    params: target and drafter parameters.
    prompts: token-id lists. A bad prompt (empty, too long, ids outside the vocabulary)
      gets a Completion with `finish_reason="error"`; the others are served.
    max_new_tokens: output limit, one for all or one per request.
    key: PRNG key of the run (same key, same tokens).
    cost: step-cost tables for the planner (`core.default_cost` when None): a
      `CostModel`, or `CostTables` (`av_jax.costs`) whose `.cost` is used.
    keep_infos: keep every chunk's per-step records (host copies) in the result.
    on_chunk: called after every chunk with the state and the chunk's step records
      (streaming, progress).
    state: continue from this decode state instead of a fresh one (must be idle).
    mesh: a ('data', 'model') `jax.sharding.Mesh` (`av_jax.engine.sharding.make_mesh`):
      slots over 'data', heads and MLP width over 'model'. None runs on one device. An
      engine whose `programs.verify_groups` is None runs with one verify group per 'data' shard
      (`sharding.for_mesh`), so verification stays on each shard.
    stop_after_chunks: end the run after this many chunks even if requests remain
      (unfinished completions are None); with `checkpoint_path`, the decode state and the
      queue are saved there first.
    checkpoint_path: folder for the checkpoint written when `stop_after_chunks` stops.
    resume_from: a checkpoint written that way; the run continues exactly where it
      stopped (same prompts, limits and engine required), producing the tokens of an
      uninterrupted run with the same key.
    clock: "wall" (default), or a modelled clock: `CostTables` (or "modelled" with
      `cost` given as `CostTables`). The planner then decides with those tables
      (`tables.cost` is the state's cost model) and every step is charged what they say
      it costs (`av_jax.engine.clock`); `GenerateResult.modelled` holds the figures,
      next to `wall_s`. A continued `state` keeps its own cost model.
    learn: per request (or one for all), whether its verification labels teach the
      estimator: False for a request whose target applies a transform its drafter never
      sees (a repetition penalty, banned ids, a grammar), whose acceptance says nothing
      about the drafter. All True (the default) runs the programs without a mask. A
      mask needs the `av` arm's decider and one device, without checkpoints.

  Returns:
    A `GenerateResult`.
  """
  tables = _modelled_tables(clock, cost)
  if isinstance(cost, CostTables):
    cost = cost.cost
  if tables is not None:
    cost = tables.cost  # the planner decides with the tables it is charged with
  start = time.perf_counter()
  if mesh is not None:
    engine = sharding.for_mesh(engine, mesh)  # one verify group per 'data' shard
  cfg = engine.config
  B = cfg.num_slots
  prefill, chunk, init = compiled(engine)
  if isinstance(max_new_tokens, int):
    max_new_tokens = [max_new_tokens] * len(prompts)
  if len(max_new_tokens) != len(prompts):
    raise ValueError(f"max_new_tokens: expected {len(prompts)} limits, got "
                     f"{len(max_new_tokens)}")
  if isinstance(learn, (bool, np.bool_)):
    learn = [bool(learn)] * len(prompts)
  learn = [bool(flag) for flag in learn]
  if len(learn) != len(prompts):
    raise ValueError(f"learn: expected {len(prompts)} flags (one per prompt), got {len(learn)}")
  masked = not all(learn)
  if masked:
    if not isinstance(engine.decider, PolicyDecider):  # its `learn` takes the mask
      raise ValueError(f"learn: a per-request mask needs the av arm's decider (PolicyDecider), "
                       f"got {type(engine.decider).__name__}")
    if mesh is not None or checkpoint_path is not None or resume_from is not None:
      raise ValueError("learn: a per-request mask runs on one device without checkpoints "
                       "(mesh, checkpoint_path and resume_from must be None)")
  max_prompt = cfg.max_len - cfg.max_draft - 2
  vocab = engine.target.vocab_size
  completions: list[Completion | None] = [None] * len(prompts)
  waiting = []
  for i, prompt in enumerate(prompts):
    error = validate_prompt(prompt, vocab_size=vocab, max_prompt=max_prompt)
    if error is None and max_new_tokens[i] < 1:
      error = f"max_new_tokens: expected >= 1, got {max_new_tokens[i]}"
    if error is not None:
      completions[i] = Completion(list(prompt), [], "error", error)
    else:
      waiting.append(i)
  waiting.reverse()  # pop() serves requests in order

  owner = [-1] * B  # request index held by each slot
  cost = core.default_cost(cfg) if cost is None else cost
  if mesh is not None:
    sharding.check_divisible(engine, mesh)
    params = sharding.put(params, sharding.param_shardings(mesh, params))
    if state is None and resume_from is None:
      # Created sharded: no process ever holds the whole state.
      state = sharding.init_state(engine, mesh, params, key, cost)
  if state is None:
    state = init(params, key, cost)
  if resume_from is not None:
    from av_jax.engine import checkpoint  # deferred: orbax is heavy, needed only here
    state, extra = checkpoint.restore(resume_from, engine=engine, like=state)
    if extra.get("num_requests") != len(prompts):
      raise ValueError(f"resume_from: the checkpoint holds {extra.get('num_requests')} "
                       f"requests, got {len(prompts)} prompts")
    owner = list(extra["owner"])
    waiting = list(extra["waiting"])
    completions = [None if c is None else Completion(**c) for c in extra["completions"]]
  if masked and state.learn is None:
    state = state._replace(learn=jnp.ones((B,), bool))
  if mesh is not None:
    params, state = sharding.place(engine, mesh, params, state)
    prefill, chunk, modes = compiled_sharded(engine, mesh, params, state)
  else:
    modes = compiled_modes(engine) if core.splits_quiet(engine) else None
  runner = None if modes is None else _ChunkRunner(engine, modes)
  infos = []
  records = []  # the modelled clock's fields of every chunk

  def settle(state):
    """Collects finished slots and refills free ones until nothing changes."""
    while True:
      active = distributed.fetch(state.active)
      changed = False
      lengths = prompt_lens = tokens = None
      for b in range(B):
        if owner[b] >= 0 and not active[b]:
          if tokens is None:
            tokens, lengths, prompt_lens = distributed.fetch(
                (state.tokens, state.length, state.prompt_len))
          i = owner[b]
          out = tokens[b, prompt_lens[b]:lengths[b]].tolist()
          reason = "eos" if out and out[-1] == cfg.eos_id else "length"
          completions[i] = Completion(list(prompts[i]), out, reason)
          owner[b] = -1
          changed = True
        if owner[b] < 0 and waiting:
          i = waiting.pop()
          prompt = np.asarray(prompts[i], np.int32)
          size = _prompt_bucket(len(prompt), max_prompt)
          padded = np.zeros((size,), np.int32)
          padded[:len(prompt)] = prompt
          state = prefill(params, state, padded, np.int32(len(prompt)), np.int32(b),
                          np.int32(max_new_tokens[i]))
          if state.learn is not None:  # the slot teaches as its new request says
            state = state._replace(learn=state.learn.at[b].set(learn[i]))
          owner[b] = i
          changed = True
      if not changed:
        return state

  state = settle(state)
  chunks = 0
  chunk_seconds: list[float] = []
  stopped = False
  while any(o >= 0 for o in owner):
    if stop_after_chunks is not None and chunks >= stop_after_chunks:
      stopped = True
      if checkpoint_path is not None:
        from av_jax.engine import checkpoint  # deferred: orbax is heavy, needed only here
        checkpoint.save(checkpoint_path, state, engine=engine, extra=dict(
            num_requests=len(prompts), owner=owner, waiting=waiting,
            completions=[None if c is None else dataclasses.asdict(c) for c in completions]))
      break
    began = time.perf_counter()
    if runner is None:
      state, info = chunk(params, state)
      jax.block_until_ready(info.emitted)  # the loop syncs in `settle` anyway
      chunk_seconds.append(time.perf_counter() - began)
    else:
      state, pieces = runner(params, state)  # reads each call's count
      chunk_seconds.append(time.perf_counter() - began)
      if keep_infos or tables is not None or on_chunk is not None:
        info = runner.records(pieces)
    chunks += 1
    if keep_infos:
      infos.append(distributed.fetch(info))
    if tables is not None:
      records.append(modelled_clock.ClockRecord(*distributed.fetch(
          modelled_clock.step_fields(info))))
    if on_chunk is not None:
      on_chunk(state, info)
    state = settle(state)

  s = distributed.fetch(state.stats)
  stats = dict(steps=int(s.steps), emitted=int(s.emitted), verified=int(s.verified),
               draft_tokens=int(s.draft_tokens), nonfinite=int(s.nonfinite),
               accepted=int(s.accepted_at.sum()), labeled=int(s.labeled_at.sum()),
               acceptance_at=(s.accepted_at / np.maximum(s.labeled_at, 1)).tolist(),
               bucket_hist=s.bucket_hist.tolist())
  modelled = None
  if tables is not None:
    modelled = modelled_clock.figures(
        modelled_clock.ClockRecord(*(np.concatenate([getattr(r, f) for r in records])
                                     if records else np.zeros((0,), np.int64)
                                     for f in modelled_clock.ClockRecord._fields)),
        tables)  # this run's tokens (stats are running totals of a continued state)
  return GenerateResult(completions=completions, stats=stats, infos=infos, state=state,
                        stopped=stopped, wall_s=time.perf_counter() - start,
                        modelled=modelled, chunk_seconds=chunk_seconds)


def _modelled_tables(clock, cost) -> CostTables | None:
  """The `CostTables` of a modelled clock, None for the wall clock."""
  if isinstance(clock, CostTables):
    return clock
  if clock == "wall":
    return None
  if clock == "modelled":
    if not isinstance(cost, CostTables):
      raise ValueError("clock: 'modelled' needs cost= given as av_jax.costs.CostTables "
                       f"(the tables to decide with and charge), got {type(cost).__name__}")
    return cost
  raise ValueError(f"clock: expected 'wall', 'modelled' or av_jax.costs.CostTables, got "
                   f"{clock!r}")
