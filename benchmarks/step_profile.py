"""Where a quiet AV step's time goes (its plan drafts for no slot), against a target-only
step.

Runs, in one process, chunks of decode steps of a target-only engine and of an AV engine
whose plan drafts for no slot (every slot busy, drafting priced out: `_busy_state`),
under `jax.profiler`, and reads the trace's per-thunk events (XLA:CPU records one
per executed HLO instruction). Each executed instruction is keyed by its source path
(the HLO `op_name` metadata with the loop and branch frames removed) and its output shape,
so the same work in the two programs has the same key. Prints per step: wall time, thunks
executed and their summed time for each arm, then the keys on which AV spends the most
more time than target-only (work only AV does, or does bigger).

    .venv/bin/python benchmarks/step_profile.py --config default --drafter block --concurrency 16
    .venv/bin/python benchmarks/step_profile.py --config tiny --concurrency 2 --json out.json

Figures are this machine's, under the profiler (it adds a few microseconds per thunk):
read the ratios and the keys, not the absolute times. `benchmarks/program_costs.py --trace`
lists each target program's costliest instructions the same way.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from av_jax import models as M
from av_jax.engine import batching, core
from av_jax.engine.config import Programs
from av_jax.sampling import Sampling
from av_jax.selection import make_cost_model

_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+) (\w[\w-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]+)"')
_CONTAINERS = {"conditional", "while", "call"}  # their events span their bodies' thunks
_FRAMES = re.compile(r"while/body/|closed_call/|cond/branch_\d+_fun/")


def instructions(hlo_text: str) -> dict[str, tuple[str, str, str]]:
  """`{instruction name: (opcode, output shape, source path)}` of a compiled module's text;
  the source path is the `op_name` metadata without loop, call and branch frames."""
  out = {}
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if not m:
      continue
    name, shape, opcode = m.groups()
    op = _OP_NAME.search(line)
    path = _FRAMES.sub("", re.sub(r"^jit\([^)]*\)/", "", op.group(1))) if op else ""
    out[name] = (opcode, re.sub(r"\{[^}]*\}", "", shape), path or "(no metadata)")
  return out


def read_trace(folder: str) -> list[dict]:
  """The complete ('X') events of the `jax.profiler` trace written under `folder`."""
  files = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True)
  if not files:
    raise ValueError(f"folder: no *.trace.json.gz under {folder!r}")
  with gzip.open(files[0]) as f:
    return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def summarize(events: list[dict], instrs: dict, *, steps: int) -> dict:
  """Per-step figures of one arm's traced chunks (each `steps` steps).

  Returns `wall_ms` (median over the executions of first-to-last thunk, per step),
  `thunks` and `thunk_ms` (leaf thunks per step and their summed time per step), and
  `keys`: `{(source path, shape): milliseconds per step}` over the leaf thunks."""
  runs = collections.defaultdict(list)
  for e in events:
    name = e["name"]
    if name in instrs and instrs[name][0] not in _CONTAINERS and "run_id" in e.get("args", {}):
      runs[e["args"]["run_id"]].append(e)
  if not runs:
    raise ValueError("events: no thunk of the compiled chunk in the trace")
  total_steps = steps * len(runs)
  walls, keys, count, busy = [], collections.Counter(), 0, 0.0
  for evs in runs.values():
    walls.append((max(e["ts"] + e["dur"] for e in evs) - min(e["ts"] for e in evs)) / steps)
    for e in evs:
      _, shape, path = instrs[e["name"]]
      keys[(path, shape)] += e["dur"] / 1e3 / total_steps
      busy += e["dur"]
      count += 1
  return dict(wall_ms=statistics.median(walls) / 1e3, thunks=count / total_steps,
              thunk_ms=busy / 1e3 / total_steps, keys=dict(keys), executions=len(runs))


def _params(models, kind: str) -> core.Params:
  return core.Params(target=M.init_params(models.target, jax.random.PRNGKey(0)),
                     drafter=M.init_drafter_params(kind, models, jax.random.PRNGKey(1)))


def _busy_state(engine: core.Engine, params: core.Params, *, prompt_len: int, key: jax.Array):
  """A state with every slot decoding (prefilled with a fixed prompt) and drafting priced
  dearer than any gain, so AV's plan drafts for no slot."""
  cfg = engine.config
  B, K = cfg.num_slots, cfg.max_draft
  cost = make_cost_model(np.full(B + 1, 1e6), 1.0 + 0.01 * np.arange(B * (K + 1) + 1))
  prefill, _, init = batching.compiled(engine)
  state = init(params, key, cost)
  prompt = (jnp.arange(prompt_len, dtype=jnp.int32) % (K + 2)) + 1
  for slot in range(B):
    state = prefill(params, state, prompt, jnp.int32(prompt_len), jnp.int32(slot),
                    jnp.int32(cfg.max_len))
  return state


def profile(models, *, drafter: str, concurrency: int, max_draft: int = 8, max_len: int = 80,
            prompt_len: int = 32, steps: int = 8, chunks: int = 3, rounds: int = 3) -> dict:
  """Traces `rounds` x `chunks` chunks of `steps` quiet steps of each arm
  (target-only, AV), the arms' rounds interleaved."""
  if steps < 1 or chunks < 1 or rounds < 1:
    raise ValueError(f"steps, chunks, rounds: expected >= 1, got {steps}, {chunks}, {rounds}")
  if max_len < prompt_len + steps + max_draft + 4:
    raise ValueError(f"max_len: expected >= prompt_len + steps + max_draft + 4 = "
                     f"{prompt_len + steps + max_draft + 4}, got {max_len}")
  params = _params(models, drafter)
  kind = M.make_drafter(drafter, models)
  arms = {}
  for mode in ("target_only", "av"):
    config = core.EngineConfig(mode=mode, num_slots=concurrency, max_draft=max_draft,
                               max_len=max_len, sampling=Sampling(temperature=1.0, top_p=0.95),
                               programs=Programs(steps_per_chunk=steps))
    engine = core.make_engine(config, models, kind)
    # The engine's default (threefry) key, as runs use.
    state = _busy_state(engine, params, prompt_len=prompt_len, key=jax.random.PRNGKey(0))
    state, _ = jax.jit(lambda p, s: core.step(engine, p, s))(params, state)  # a first step
    run = jax.jit(lambda p, s: core.run_chunk(engine, p, s, steps), donate_argnums=1)
    instrs = instructions(run.lower(params, state).compile().as_text())
    fresh = lambda state=state: jax.block_until_ready(jax.tree.map(jnp.copy, state))
    _, info = jax.block_until_ready(run(params, fresh()))  # compile and warm up
    arms[mode] = (run, fresh, instrs, int(jnp.sum(info.drafting)))

  def traced(mode, n):
    run, fresh = arms[mode][:2]
    copies = [fresh() for _ in range(n)]
    with tempfile.TemporaryDirectory() as folder:
      with jax.profiler.trace(folder):
        for c in copies:
          jax.block_until_ready(run(params, c))
      return read_trace(folder)

  traced("av", 1)  # the profiler's first session starts slower: not counted
  events = {mode: [] for mode in arms}
  for r in range(rounds):  # interleaved, so machine noise hits both arms alike
    for mode in arms:
      for e in traced(mode, chunks):
        if "run_id" in e.get("args", {}):  # run ids are unique within a session only
          e["args"]["run_id"] = f"{r}:{e['args']['run_id']}"
        events[mode].append(e)
  result = {mode: dict(summarize(events[mode], arms[mode][2], steps=steps),
                       drafted=arms[mode][3]) for mode in arms}
  return result


def extra_keys(result: dict, top: int = 12) -> list[dict]:
  """The keys on which AV spends the most more time per step than target-only."""
  av, to = result["av"]["keys"], result["target_only"]["keys"]
  rows = [dict(path=p, shape=s, av_ms=ms, target_only_ms=to.get((p, s), 0.0),
               extra_ms=ms - to.get((p, s), 0.0)) for (p, s), ms in av.items()]
  return sorted(rows, key=lambda r: -r["extra_ms"])[:top]


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="default", help="model set: tiny | default")
  p.add_argument("--drafter", default="block", help="drafter kind")
  p.add_argument("--concurrency", type=int, default=16, help="slots B, every one busy")
  p.add_argument("--max-draft", type=int, default=8, help="K")
  p.add_argument("--max-len", type=int, default=80, help="cache positions per slot")
  p.add_argument("--prompt-len", type=int, default=32, help="tokens prefilled per slot")
  p.add_argument("--steps", type=int, default=8, help="steps per traced chunk")
  p.add_argument("--chunks", type=int, default=3, help="traced chunks per arm and round")
  p.add_argument("--rounds", type=int, default=3, help="interleaved trace rounds per arm")
  p.add_argument("--top", type=int, default=12, help="keys listed")
  p.add_argument("--json", default="", help="write the figures to this file")
  args = p.parse_args(argv)
  result = profile(M.load_config(args.config), drafter=args.drafter,
                   concurrency=args.concurrency, max_draft=args.max_draft,
                   max_len=args.max_len, prompt_len=args.prompt_len, steps=args.steps,
                   chunks=args.chunks, rounds=args.rounds)
  print(f"device: {jax.devices()[0].device_kind} (under jax.profiler), models: {args.config}, "
        f"{args.drafter}, B = {args.concurrency}, K = {args.max_draft}, cache {args.max_len}")
  for mode in ("target_only", "av"):
    r = result[mode]
    print(f"{mode:>12}: {r['wall_ms']:7.3f} ms/step wall, {r['thunks']:6.1f} thunks/step, "
          f"{r['thunk_ms']:7.3f} thunk-ms/step, drafted steps {r['drafted']}")
  ratio = result["av"]["wall_ms"] / result["target_only"]["wall_ms"]
  print(f"AV / target-only wall per step: {ratio:.3f}")
  rows = extra_keys(result, args.top)
  print(f"{'extra ms':>9} {'av ms':>7} {'t-o ms':>7}  source path [shape]")
  for r in rows:
    print(f"{r['extra_ms']:9.3f} {r['av_ms']:7.3f} {r['target_only_ms']:7.3f}  "
          f"{r['path'][:90]} {r['shape'][:40]}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(settings=vars(args), ratio=ratio, extra=rows,
                     arms={m: {k: v for k, v in result[m].items() if k != "keys"}
                           for m in result}), f, indent=1)


if __name__ == "__main__":
  main()
