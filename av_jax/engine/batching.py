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
  last call ended in (a call that finds the next step of the other kind runs no step)."""

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

  def compile(self, params, state):
    """Compiles both programs before serving, so the first step of either kind does not
    stall on its compile: each runs with a limit of 0 steps, which returns the state
    unchanged. Returns the state (the programs donate it)."""
    for program in (self.quiet_prog, self.draft_prog):
      state = program(params, state, np.int32(0))[0]
    return state

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
  max_new_tokens, learn = _per_request(engine, prompts, max_new_tokens, learn, mesh=mesh,
                                       checkpoints=(checkpoint_path, resume_from))
  queue = _Queue(engine, prompts, max_new_tokens, learn)
  params, state, programs = _start(engine, params, key, cost, state, mesh, queue,
                                   resume_from, masked=not all(learn))
  state, out = _serve(queue, programs, params, state, keep_infos=keep_infos,
                      clocked=tables is not None, on_chunk=on_chunk,
                      stop_after_chunks=stop_after_chunks, checkpoint_path=checkpoint_path)
  return GenerateResult(completions=queue.completions, stats=_stats(state),
                        infos=out["infos"], state=state, stopped=out["stopped"],
                        wall_s=time.perf_counter() - start,
                        modelled=_modelled(out["records"], tables),
                        chunk_seconds=out["chunk_seconds"])


def _serve(queue, programs, params, state, *, keep_infos, clocked, on_chunk,
           stop_after_chunks, checkpoint_path):
  """`generate`'s loop: chunks until every request is done (or `stop_after_chunks`),
  settling the queue after each. Returns the state and {infos, records (the modelled
  clock's fields), chunk_seconds, stopped}."""
  prefill, chunk, runner = programs
  out = dict(infos=[], records=[], chunk_seconds=[], stopped=False)
  state = queue.settle(prefill, params, state)
  chunks = 0
  while queue.busy():
    if stop_after_chunks is not None and chunks >= stop_after_chunks:
      out["stopped"] = True
      if checkpoint_path is not None:
        queue.save(checkpoint_path, state)
      break
    began = time.perf_counter()
    if runner is None:
      state, info = chunk(params, state)
      jax.block_until_ready(info.emitted)  # the loop syncs in `settle` anyway
      out["chunk_seconds"].append(time.perf_counter() - began)
    else:
      state, pieces = runner(params, state)  # reads each call's count
      out["chunk_seconds"].append(time.perf_counter() - began)
      if keep_infos or clocked or on_chunk is not None:
        info = runner.records(pieces)
    chunks += 1
    if keep_infos:
      out["infos"].append(distributed.fetch(info))
    if clocked:
      out["records"].append(modelled_clock.ClockRecord(*distributed.fetch(
          modelled_clock.step_fields(info))))
    if on_chunk is not None:
      on_chunk(state, info)
    state = queue.settle(prefill, params, state)
  return state, out


def _per_request(engine: core.Engine, prompts, max_new_tokens, learn, *, mesh, checkpoints):
  """`generate`'s `max_new_tokens` and `learn` as one checked entry per prompt."""
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
  if not all(learn):
    if not isinstance(engine.decider, PolicyDecider):  # its `learn` takes the mask
      raise ValueError(f"learn: a per-request mask needs the av arm's decider (PolicyDecider), "
                       f"got {type(engine.decider).__name__}")
    if mesh is not None or any(path is not None for path in checkpoints):
      raise ValueError("learn: a per-request mask runs on one device without checkpoints "
                       "(mesh, checkpoint_path and resume_from must be None)")
  return list(max_new_tokens), learn


class _Queue:
  """The requests of one `generate` call: which slot holds which, who waits, what is
  done. `settle` collects finished slots and prefills free ones."""

  def __init__(self, engine: core.Engine, prompts, max_new_tokens, learn):
    cfg = engine.config
    self.engine, self.prompts, self.max_new, self.learn = engine, prompts, max_new_tokens, learn
    self.max_prompt = cfg.max_len - cfg.max_draft - 2
    self.completions: list[Completion | None] = [None] * len(prompts)
    self.waiting = []
    for i, prompt in enumerate(prompts):
      error = validate_prompt(prompt, vocab_size=engine.target.vocab_size,
                              max_prompt=self.max_prompt)
      if error is None and max_new_tokens[i] < 1:
        error = f"max_new_tokens: expected >= 1, got {max_new_tokens[i]}"
      if error is not None:
        self.completions[i] = Completion(list(prompt), [], "error", error)
      else:
        self.waiting.append(i)
    self.waiting.reverse()  # pop() serves requests in order
    self.owner = [-1] * cfg.num_slots  # request index held by each slot

  def busy(self) -> bool:
    return any(o >= 0 for o in self.owner)

  def restore(self, extra: dict) -> None:
    """The queue a checkpoint saved (`save`)."""
    if extra.get("num_requests") != len(self.prompts):
      raise ValueError(f"resume_from: the checkpoint holds {extra.get('num_requests')} "
                       f"requests, got {len(self.prompts)} prompts")
    self.owner = list(extra["owner"])
    self.waiting = list(extra["waiting"])
    self.completions = [None if c is None else Completion(**c) for c in extra["completions"]]

  def save(self, path: str, state: core.DecodeState) -> None:
    from av_jax.engine import checkpoint  # deferred: orbax is heavy, needed only here
    checkpoint.save(path, state, engine=self.engine, extra=dict(
        num_requests=len(self.prompts), owner=self.owner, waiting=self.waiting,
        completions=[None if c is None else dataclasses.asdict(c)
                     for c in self.completions]))

  def _finish(self, b: int, tokens, lengths, prompt_lens) -> None:
    i = self.owner[b]
    out = tokens[b, prompt_lens[b]:lengths[b]].tolist()
    reason = "eos" if out and out[-1] == self.engine.config.eos_id else "length"
    self.completions[i] = Completion(list(self.prompts[i]), out, reason)
    self.owner[b] = -1

  def _admit(self, prefill, params, state, b: int):
    i = self.waiting.pop()
    prompt = np.asarray(self.prompts[i], np.int32)
    padded = np.zeros((_prompt_bucket(len(prompt), self.max_prompt),), np.int32)
    padded[:len(prompt)] = prompt
    state = prefill(params, state, padded, np.int32(len(prompt)), np.int32(b),
                    np.int32(self.max_new[i]))
    if state.learn is not None:  # the slot teaches as its new request says
      state = state._replace(learn=state.learn.at[b].set(self.learn[i]))
    self.owner[b] = i
    return state

  def settle(self, prefill, params, state: core.DecodeState) -> core.DecodeState:
    """Collects finished slots and refills free ones until nothing changes."""
    while True:
      active = distributed.fetch(state.active)
      changed = False
      host = None  # (tokens, lengths, prompt_lens), fetched once a slot finished
      for b in range(len(self.owner)):
        if self.owner[b] >= 0 and not active[b]:
          host = host or distributed.fetch((state.tokens, state.length, state.prompt_len))
          self._finish(b, *host)
          changed = True
        if self.owner[b] < 0 and self.waiting:
          state = self._admit(prefill, params, state, b)
          changed = True
      if not changed:
        return state


def _start(engine: core.Engine, params, key, cost, state, mesh, queue: _Queue,
           resume_from, *, masked: bool):
  """(params, state, (prefill, chunk, runner)) placed for `mesh` (or one device): the
  given state, the checkpoint's (restoring `queue`), or a fresh one."""
  B = engine.config.num_slots
  prefill, chunk, init = compiled(engine)
  cost = core.default_cost(engine.config) if cost is None else cost
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
    queue.restore(extra)
  if masked and state.learn is None:
    state = state._replace(learn=jnp.ones((B,), bool))
  if mesh is not None:
    params, state = sharding.place(engine, mesh, params, state)
    prefill, chunk, modes = compiled_sharded(engine, mesh, params, state)
  else:
    modes = compiled_modes(engine) if core.splits_quiet(engine) else None
  runner = None if modes is None else _ChunkRunner(engine, modes)
  if runner is not None:
    state = runner.compile(params, state)
  return params, state, (prefill, chunk, runner)


def _stats(state: core.DecodeState) -> dict:
  """The state's running totals as host numbers (`GenerateResult.stats`)."""
  s = distributed.fetch(state.stats)
  return dict(steps=int(s.steps), emitted=int(s.emitted), verified=int(s.verified),
              draft_tokens=int(s.draft_tokens), nonfinite=int(s.nonfinite),
              accepted=int(s.accepted_at.sum()), labeled=int(s.labeled_at.sum()),
              acceptance_at=(s.accepted_at / np.maximum(s.labeled_at, 1)).tolist(),
              bucket_hist=s.bucket_hist.tolist())


def _modelled(records, tables):
  """The modelled clock's figures of this run's steps (None on the wall clock)."""
  if tables is None:
    return None
  return modelled_clock.figures(
      modelled_clock.ClockRecord(*(np.concatenate([getattr(r, f) for r in records])
                                   if records else np.zeros((0,), np.int64)
                                   for f in modelled_clock.ClockRecord._fields)),
      tables)  # this run's tokens (stats are running totals of a continued state)


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
