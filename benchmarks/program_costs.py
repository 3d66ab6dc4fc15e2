"""Per-step cost of the engine's target programs, one source tree against another.

Times, for each concurrency B (every slot busy, mid-cache), the programs a decode step
runs on the target: the whole plain step of a target-only engine (`core.run_chunk`,
per step), the verify program of the smallest and the largest bucket (`core.verify_forward`
at T = B and T = B (K + 1), the pass that reads the cache, with the target's sampling
distribution), and optionally the whole step of a gated AV engine (`av`; `av-gate` in
trees that have it) with one slot
drafting all K (`profile.whole_step_ms`'s "one" regime). Each tree is imported in its
own worker process (`PYTHONPATH`); rounds are interleaved across the trees so machine
load hits them alike, and the smallest time of each entry over the rounds is kept.

    python benchmarks/program_costs.py --trees /work/wt-base,. --slots 1,16,64
    python benchmarks/program_costs.py --trees . --slots 16 --trace   # top ops per program

Prints ms per program, ratios to the plain step, and each tree against the first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_WORKER = r"""
import json, sys, time
import numpy as np
import jax, jax.numpy as jnp
from av_jax import models as M
from av_jax.engine import core

args = json.loads(sys.argv[1])
B, K, L, S = args["slots"], args["k"], args["max_len"], args["steps"]
models = M.load_config(args["config"])
drafter = M.make_drafter(args["drafter"], models)
def busy(engine, params):
  state = core.init_state(engine, params, jax.random.PRNGKey(0))
  length = max(1, (L - S * (K + 1)) // 2)
  return state._replace(active=jnp.ones((B,), bool), length=jnp.full((B,), length, jnp.int32),
                        max_new=jnp.full((B,), L, jnp.int32))

def mk(mode):
  shape = dict(mode=mode, num_slots=B, max_draft=K, max_len=L)
  try:
    from av_jax.engine.config import Programs
    from av_jax.sampling import Sampling
    cfg = core.EngineConfig(**shape, sampling=Sampling(temperature=1.0, top_p=0.95),
                            programs=Programs(steps_per_chunk=S))
  except ImportError:  # a tree without `av_jax.engine.config` takes these settings flat
    cfg = core.EngineConfig(**shape, steps_per_chunk=S, temperature=1.0, top_p=0.95)
  return core.make_engine(cfg, models, drafter)

pair = M.load(args["config"], drafter=args["drafter"])
params = core.Params(target=pair.target_params, drafter=pair.drafter_params)

engine = mk("target_only")
state0 = busy(engine, params)
run = jax.jit(lambda p, s: core.run_chunk(engine, p, s), donate_argnums=1)
fresh = lambda: jax.block_until_ready(jax.tree.map(jnp.copy, state0))
t0 = time.perf_counter(); run_c = run.lower(params, fresh()).compile(); compile_plain = time.perf_counter() - t0

cache = core.group_cache(engine, state0.target_cache)
def verify(tp, cache, tokens, slot, positions, valid):
  return core.verify_forward(engine, tp, cache, tokens=tokens, slot=slot, positions=positions,
                             valid=valid, read=True)[0]
vjit = jax.jit(verify)
length = max(1, (L - S * (K + 1)) // 2)
def vinputs(size):
  t = jnp.arange(size, dtype=jnp.int32)[None]
  return (params.target, cache, jnp.ones((1, size), jnp.int32), t % B, length + t // B,
          jnp.ones((1, size), bool))
progs = {}
compile_s = {"plain": compile_plain}
for name, size in (("verify_T=B", B), ("verify_T=B(K+1)", B * (K + 1))):
  t0 = time.perf_counter(); c = vjit.lower(*vinputs(size)).compile(); compile_s[name] = time.perf_counter() - t0
  progs[name] = (c, vinputs(size))

if args["one"]:
  from av_jax.engine import profile as prof
  from av_jax.arms import ARMS
  eng_av = mk("av-gate" if "av-gate" in ARMS else "av")  # the tree's gated AV arm
  st_av = core.init_state(eng_av, params, jax.random.PRNGKey(0))

def time_plain():
  times = []
  for _ in range(args["repeats"]):
    s = fresh(); t0 = time.perf_counter(); jax.block_until_ready(run_c(params, s)); times.append((time.perf_counter() - t0) * 1e3 / S)
  return float(np.median(times))

def time_prog(c, a):
  ts = []
  for _ in range(args["repeats"]):
    t0 = time.perf_counter(); jax.block_until_ready(c(*a)); ts.append((time.perf_counter() - t0) * 1e3)
  return float(np.median(ts))

jax.block_until_ready(run_c(params, fresh()))
for c, a in progs.values():
  jax.block_until_ready(c(*a))
print(json.dumps({"ready": True, "compile_s": compile_s}), flush=True)
for line in sys.stdin:
  if args["trace"]:
    import tempfile
    sys.path.insert(0, "benchmarks")
    import step_profile as sp
    out = {}
    for name, (c, a, fn) in {"plain": (run_c, None, lambda: run_c(params, fresh())),
                             **{n: (c, a, (lambda c=c, a=a: c(*a))) for n, (c, a) in progs.items()}}.items():
      instrs = sp.instructions(c.as_text())
      with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
          for _ in range(3):
            jax.block_until_ready(fn())
        ev = sp.read_trace(folder)
      r = sp.summarize(ev, instrs, steps=S if name == "plain" else 1)
      top = sorted(r["keys"].items(), key=lambda kv: -kv[1])[:args["top"]]
      out[name] = dict(wall_ms=r["wall_ms"], thunk_ms=r["thunk_ms"],
                       top=[(p[-110:], s[:60], round(ms, 3)) for (p, s), ms in top])
    print(json.dumps(out), flush=True)
    continue
  res = {"plain": time_plain()}
  for name, (c, a) in progs.items():
    res[name] = time_prog(c, a)
  if args["one"]:
    w = prof.whole_step_ms(eng_av, params, st_av, repeats=args["repeats"])
    res["one"] = w["one"]; res["skip"] = w["skip"]
  print(json.dumps(res), flush=True)
"""


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--trees", default=".", help="comma-separated source trees; first = reference")
  p.add_argument("--slots", default="16", help="comma-separated concurrencies B")
  p.add_argument("--config", default="default", help="model set")
  p.add_argument("--drafter", default="block", help="drafter kind (the AV engine's)")
  p.add_argument("--k", type=int, default=8, help="K")
  p.add_argument("--max-len", type=int, default=512, help="cache positions per slot")
  p.add_argument("--steps", type=int, default=4, help="steps per timed chunk")
  p.add_argument("--repeats", type=int, default=5, help="timed runs per entry and round")
  p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
  p.add_argument("--one", action="store_true",
                 help="also the whole step, one slot drafting")
  p.add_argument("--trace", action="store_true", help="print each program's top ops instead")
  p.add_argument("--top", type=int, default=15, help="ops listed with --trace")
  p.add_argument("--python", default=sys.executable, help="interpreter of the workers")
  p.add_argument("--json", default="", help="write the figures to this file")
  args = p.parse_args(argv)
  trees = [os.path.abspath(t) for t in args.trees.split(",")]
  print(f"load: {os.getloadavg()}", flush=True)
  results = {}
  for B in [int(b) for b in args.slots.split(",")]:
    spec = dict(slots=B, k=args.k, max_len=args.max_len, steps=args.steps, config=args.config,
                drafter=args.drafter, repeats=args.repeats, one=args.one, trace=args.trace,
                top=args.top)
    workers = []
    for tree in trees:
      env = dict(os.environ, PYTHONPATH=tree)
      w = subprocess.Popen([args.python, "-c", _WORKER, json.dumps(spec)], cwd=tree, env=env,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
      ready = json.loads(w.stdout.readline())
      print(f"B = {B}, {tree}: compile s {json.dumps({k: round(v, 2) for k, v in ready['compile_s'].items()})}",
            flush=True)
      workers.append(w)
    rounds = {t: [] for t in trees}
    for r in range(1 if args.trace else args.rounds):
      for tree, w in zip(trees, workers):
        w.stdin.write("go\n")
        w.stdin.flush()
        rounds[tree].append(json.loads(w.stdout.readline()))
    for w in workers:
      w.stdin.close()
      w.wait()
    if args.trace:
      for tree in trees:
        for name, r in rounds[tree][0].items():
          print(f"--- B = {B} {tree} {name}: wall {r['wall_ms']:.2f} ms, thunks {r['thunk_ms']:.2f} ms")
          for path, shape, ms in r["top"]:
            print(f"  {ms:8.3f}  {shape:40} {path}")
      continue
    best = {t: {k: min(x[k] for x in rounds[t]) for k in rounds[t][0]} for t in trees}
    results[B] = best
    ref = best[trees[0]]
    for tree in trees:
      b = best[tree]
      line = "  ".join(f"{k} {v:8.2f} ms ({v / b['plain']:.2f}x plain"
                       + (f", {ref[k] / v:.2f}x faster" if tree != trees[0] else "") + ")"
                       for k, v in b.items())
      print(f"B = {B:3d} {os.path.basename(tree):>20}: {line}", flush=True)
  print(f"load: {os.getloadavg()}", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(settings=vars(args), results=results), f, indent=1)


if __name__ == "__main__":
  main()
