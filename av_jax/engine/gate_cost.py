"""What a gated-off step costs: an AV step that drafts for no slot vs a target-only step.

Issue 14's goal ("AV never loses"): where drafting does not pay, AV's step with every
slot gated off (no drafter pass but the catch-up, an absorb every K + 1 steps for an
autoregressive drafter) must cost at most 5% more than a target-only step, at every
concurrency. `measure_gate_cost` times both side by side in one process on random
weights of a model set (timing does not depend on the weights), N repeats interleaved,
each a chunk of K + 1 decode steps (so the absorb is amortized as in a run) with every
slot busy. `benchmarks/gate_cost.py` is its command line.

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
from av_jax.models.config import ModelsConfig
from av_jax.selection import make_cost_model

GOAL = 1.05  # issue 14: a gated-off step costs at most 5% more than a target-only one


def _params(cfg: ModelsConfig, kind: str) -> core.Params:
  return core.Params(target=M.init_params(cfg.target, jax.random.PRNGKey(0)),
                     drafter=M.init_drafter_params(kind, cfg, jax.random.PRNGKey(1)))


def _busy_state(engine: core.Engine, params: core.Params, *, prompt_len: int):
  """A state with every slot decoding (prefilled with a fixed prompt), the gate closed:
  drafting dearer than any gain, re-checks never (after the first step, run here)."""
  cfg = engine.config
  B, K = cfg.num_slots, cfg.max_draft
  cost = make_cost_model(np.full(B + 1, 1e6), 1.0 + 0.01 * np.arange(B * (K + 1) + 1))
  prefill, chunk, init = batching.compiled(engine)
  state = init(params, jax.random.key(0, impl="rbg"), cost)
  prompt = (jnp.arange(prompt_len, dtype=jnp.int32) % (cfg.max_draft + 2)) + 1
  for slot in range(B):
    state = prefill(params, state, prompt, jnp.int32(prompt_len), jnp.int32(slot),
                    jnp.int32(cfg.max_len))
  return state


def _timer(engine: core.Engine, params: core.Params, state):
  """`() -> seconds` of one chunk from `state` (not donated: every call starts there)."""
  run = jax.jit(lambda p, s: core.run_chunk(engine, p, s))
  state, info = run(params, state)  # the first gated-off step closes the gate
  jax.block_until_ready(run(params, state))  # compile and warm up

  def timed() -> float:
    start = time.perf_counter()
    jax.block_until_ready(run(params, state))
    return time.perf_counter() - start

  return timed, run(params, state)[1]


def measure_gate_cost(models: ModelsConfig, *, kinds: Sequence[str] = ("draft_lm", "eagle",
                                                                       "block"),
                      concurrency: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
                      repeats: int = 10, max_draft: int = 4, max_len: int = 256,
                      prompt_len: int = 64) -> list[dict]:
  """Wall time of a gated-off AV step over a target-only step, per drafter and concurrency.

  Args:
    models: the model set (its shapes; random weights).
    kinds: drafter kinds (`av_jax.models.KINDS`).
    concurrency: slot counts B, every slot busy.
    repeats: timed chunks per engine, interleaved target-only / AV.
    max_draft: K (a chunk is K + 1 steps: one absorb per slot for AR drafters).
    max_len: cache positions per slot.
    prompt_len: tokens prefilled per slot (the context the steps attend to).

  Returns:
    One dict per (kind, B): `median_ratio` (AV / target-only, over the interleaved
    pairs), `min_ratio`, `max_ratio`, `target_only_ms` and `gated_ms` (median per step),
    `drafted` (steps that drafted in a timed chunk: 0 when the gate held) and `goal`.

  Raises:
    ValueError: `max_len` too short for the prompt and two chunks, or `repeats` < 1.
  """
  if repeats < 1:
    raise ValueError(f"repeats: expected >= 1, got {repeats}")
  if max_len < prompt_len + 3 * (max_draft + 1) + 2:
    raise ValueError(f"max_len: expected >= prompt_len + 3 (max_draft + 1) + 2 = "
                     f"{prompt_len + 3 * (max_draft + 1) + 2}, got {max_len}")
  rows = []
  for kind in kinds:
    params = _params(models, kind)
    drafter = M.make_drafter(kind, models)
    for B in concurrency:
      common = dict(num_slots=B, max_draft=max_draft, max_len=max_len,
                    steps_per_chunk=max_draft + 1, explore_every=1,
                    draft_recheck_every=10**6)
      engines = [core.make_engine(core.EngineConfig(mode=mode, **common), models, drafter)
                 for mode in ("target_only", "av")]
      if not engines[1].decider.planner.gated:
        raise ValueError(f"kinds: {kind!r} cannot skip drafting (no `absorb`)")
      timers, infos = zip(*(_timer(e, params, _busy_state(e, params, prompt_len=prompt_len))
                            for e in engines))
      pairs = []
      for _ in range(repeats):
        pairs.append(tuple(t() for t in timers))
      ratios = [g / t for t, g in pairs]
      per_step = lambda i: 1e3 * statistics.median(p[i] for p in pairs) / (max_draft + 1)
      rows.append(dict(drafter=kind, concurrency=B, median_ratio=statistics.median(ratios),
                       min_ratio=min(ratios), max_ratio=max(ratios),
                       target_only_ms=per_step(0), gated_ms=per_step(1),
                       drafted=int(np.sum(np.asarray(infos[1].drafting))),
                       repeats=repeats, goal=GOAL))
  return rows


def format_rows(rows: Sequence[dict]) -> str:
  """A printable table of `measure_gate_cost`'s rows."""
  lines = [f"{'drafter':>9} {'B':>4} {'target ms':>10} {'gated ms':>9} {'ratio':>6} "
           f"{'range':>13} {'goal':>5}"]
  for r in rows:
    ok = "ok" if r["median_ratio"] <= r["goal"] else "OVER"
    lines.append(f"{r['drafter']:>9} {r['concurrency']:>4} {r['target_only_ms']:>10.3f} "
                 f"{r['gated_ms']:>9.3f} {r['median_ratio']:>6.3f} "
                 f"{r['min_ratio']:>6.3f}-{r['max_ratio']:<6.3f} {ok:>5}")
  return "\n".join(lines)
