"""What a quiet step costs: an AV step that drafts for no slot vs a target-only step.

Where drafting does not pay, AV's step that drafts for no slot (no drafter pass but the
catch-up: for an autoregressive drafter the
token joins the slot's backlog, absorbed when `pending_width` are pending) must cost at
most 5% more than a target-only step, at every concurrency. `measure_gate_cost` times
both side by side in one process on random weights of a model set (timing does not
depend on the weights), N repeats interleaved, each a chunk of `steps` decode steps with
every slot busy, run in place (the state donated, as `batching` runs chunks): by
default the AV engine's `pending_width` steps, so each chunk holds one absorb of a full
backlog per slot (a long quiet stretch, amortized as in a run); `steps` = K + 1
with the default backlog times a short stretch (no absorb).
`benchmarks/gate_cost.py` is its command line.

Example:
  >>> rows = measure_gate_cost(M.load_config("tiny"), kinds=("eagle",), concurrency=(1, 8))
  >>> rows[0]["median_ratio"]
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from av_jax import models as M
from av_jax.engine import batching, core
from av_jax.engine.config import EngineConfig, Programs
from av_jax.models.config import ModelsConfig
from av_jax.selection import make_cost_model

GOAL = 1.05  # a quiet step costs at most 5% more than a target-only one


def _params(cfg: ModelsConfig, kind: str) -> core.Params:
  return core.Params(target=M.init_params(cfg.target, jax.random.PRNGKey(0)),
                     drafter=M.init_drafter_params(kind, cfg, jax.random.PRNGKey(1)))


def _busy_state(engine: core.Engine, params: core.Params, *, prompt_len: int,
                key: jax.Array | None = None):
  """A state with every slot decoding (prefilled with a fixed prompt) and drafting priced
  dearer than any gain, so AV's plan drafts for no slot.
  `key`: the run's PRNG key (default an rbg key; `jax.random.PRNGKey` as runs use)."""
  cfg = engine.config
  B, K = cfg.num_slots, cfg.max_draft
  cost = make_cost_model(np.full(B + 1, 1e6), 1.0 + 0.01 * np.arange(B * (K + 1) + 1))
  prefill, chunk, init = batching.compiled(engine)
  state = init(params, jax.random.key(0, impl="rbg") if key is None else key, cost)
  prompt = (jnp.arange(prompt_len, dtype=jnp.int32) % (cfg.max_draft + 2)) + 1
  for slot in range(B):
    state = prefill(params, state, prompt, jnp.int32(prompt_len), jnp.int32(slot),
                    jnp.int32(cfg.max_len))
  return state


def _timer(engine: core.Engine, params: core.Params, state, steps: int, *,
           quiet: bool = False):
  """`() -> seconds` of `steps` steps from `state`, in place as the engine runs them (the
  state donated; each call times a fresh copy, made before its clock starts). `quiet`:
  the gated engine's quiet program (`core.run_mode`, what `generate` runs while no slot
  drafts), else the one-program chunk (`core.run_chunk`)."""
  state, _ = jax.jit(lambda p, s: core.step(engine, p, s))(params, state)  # a first step
  if quiet:
    run = jax.jit(lambda p, s: core.run_mode(engine, p, s, steps, quiet=True,
                                             num_steps=steps)[:2], donate_argnums=1)
  else:
    run = jax.jit(lambda p, s: core.run_chunk(engine, p, s, steps), donate_argnums=1)
  fresh = lambda: jax.block_until_ready(jax.tree.map(jnp.copy, state))
  _, info = jax.block_until_ready(run(params, fresh()))  # compile and warm up

  def timed() -> float:
    copy = fresh()
    start = time.perf_counter()
    jax.block_until_ready(run(params, copy))
    return time.perf_counter() - start

  return timed, info


def measure_gate_cost(models: ModelsConfig, *, kinds: Sequence[str] = ("draft_lm", "eagle",
                                                                       "block"),
                      concurrency: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
                      repeats: int = 10, max_draft: int = 4, max_len: int = 256,
                      prompt_len: int = 64, backlog: int | None = None,
                      steps: int | None = None) -> list[dict]:
  """Wall time of a quiet AV step over a target-only step, per drafter and concurrency.

  Args:
    models: the model set (its shapes; random weights).
    kinds: drafter kinds (`av_jax.models.KINDS`).
    concurrency: slot counts B, every slot busy.
    repeats: timed chunks per engine, interleaved target-only / AV.
    max_draft: K.
    max_len: cache positions per slot (>= prompt_len + steps + K + 3).
    prompt_len: tokens prefilled per slot (the context the steps attend to).
    backlog: the AV engine's `programs.drafter_backlog` (None: its default, 4 (K + 1); K + 1:
      the eager catch-up).
    steps: decode steps per timed chunk; None: the AV engine's `pending_width` (one
      absorb of a full backlog per slot per chunk for AR drafters; K + 1 for parallel).

  Returns:
    One dict per (kind, B): `median_ratio` (AV's quiet program, `core.run_mode`, what a
    run runs while no slot drafts / target-only, over the interleaved triples),
    `min_ratio`, `max_ratio`, `one_program_ratio` (median; AV's whole step program,
    `core.run_chunk`, what `programs.quiet_program=False` runs), `target_only_ms`, `gated_ms` and
    `one_program_ms` (median per step), `drafted` (steps that drafted in a timed chunk: 0
    when the gate held; the quiet program cannot draft), `steps`, `backlog` (the AV
    engine's `pending_width`) and `goal`.

  Raises:
    ValueError: `max_len` too short for the prompt and a chunk, `repeats` or `steps` < 1.
  """
  if repeats < 1:
    raise ValueError(f"repeats: expected >= 1, got {repeats}")
  if steps is not None and steps < 1:
    raise ValueError(f"steps: expected >= 1 or None, got {steps}")
  rows = []
  for kind in kinds:
    params = _params(models, kind)
    drafter = M.make_drafter(kind, models)
    for B in concurrency:
      programs = Programs(steps_per_chunk=max_draft + 1, drafter_backlog=backlog)
      common = dict(num_slots=B, max_draft=max_draft, max_len=max_len, programs=programs)
      engines = [core.make_engine(EngineConfig(mode=mode, **common), models, drafter)
                 for mode in ("target_only", "av")]
      if not engines[1].decider.gated:
        raise ValueError(f"kinds: {kind!r} cannot skip drafting (no `absorb`)")
      n = steps or engines[1].pending_width
      if max_len < prompt_len + n + max_draft + 3:
        raise ValueError(f"max_len: expected >= prompt_len + steps + max_draft + 3 = "
                         f"{prompt_len + n + max_draft + 3}, got {max_len}")
      timers, infos = zip(*(_timer(e, params, _busy_state(e, params, prompt_len=prompt_len), n,
                                   quiet=quiet)
                            for e, quiet in zip(engines + engines[1:], (False, True, False))))
      triples = []
      for _ in range(repeats):
        triples.append(tuple(t() for t in timers))
      ratios = [g / t for t, g, _ in triples]
      per_step = lambda i: 1e3 * statistics.median(p[i] for p in triples) / n
      rows.append(dict(drafter=kind, concurrency=B, median_ratio=statistics.median(ratios),
                       min_ratio=min(ratios), max_ratio=max(ratios),
                       one_program_ratio=statistics.median(w / t for t, _, w in triples),
                       target_only_ms=per_step(0), gated_ms=per_step(1),
                       one_program_ms=per_step(2),
                       drafted=int(np.sum(np.asarray(infos[2].drafting))),
                       steps=n, backlog=engines[1].pending_width, repeats=repeats,
                       goal=GOAL))
  return rows


def format_rows(rows: Sequence[dict]) -> str:
  """A printable table of `measure_gate_cost`'s rows."""
  lines = [f"{'drafter':>9} {'B':>4} {'steps':>5} {'backlog':>7} {'target ms':>10} "
           f"{'gated ms':>9} {'ratio':>6} {'range':>13} {'goal':>5} {'one-program':>11}"]
  for r in rows:
    ok = "ok" if r["median_ratio"] <= r["goal"] else "OVER"
    lines.append(f"{r['drafter']:>9} {r['concurrency']:>4} {r['steps']:>5} "
                 f"{r['backlog']:>7} {r['target_only_ms']:>10.3f} "
                 f"{r['gated_ms']:>9.3f} {r['median_ratio']:>6.3f} "
                 f"{r['min_ratio']:>6.3f}-{r['max_ratio']:<6.3f} {ok:>5} "
                 f"{r['one_program_ratio']:>11.3f}")
  return "\n".join(lines)
