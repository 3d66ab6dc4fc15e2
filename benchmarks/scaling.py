"""How the AV decision and the sharded engine scale with slots B, drafts K, vocabulary V.

Two measurements (docs/scaling.md):

* `--part decision` (default): times the jitted per-step decision (`av_jax.decision`:
  `logit_qmax` of the `[B, K, V]` draft logits, estimator update, predict, survival, budget,
  allocation) over a grid of B, K, V, and at V = 16 for every (B, K), which leaves the part
  that does not read the logits (estimator, planner, dispatch). Fits that part as
  `c0 + c_pos * B*K`, takes the median of `(t - t_16) / (B*K*V)` as the cost per logit, and
  extrapolates to serving sizes.
* `--part collectives`: compiles one engine step (shapes only, nothing is allocated) on fake
  CPU meshes of (data, 1) and (1, model) devices and lists every collective in the compiled
  program with its shape and bytes: what crosses the 'data' axis (hosts, in a multi-host
  run) and what crosses the 'model' axis, per decode step and per packed bucket. The
  engine verifies with one packed group per 'data' shard, as `generate(mesh=...)` runs it
  (`--verify-groups 1`: one packed buffer for all slots, the layout before verify groups).

    .venv/bin/python benchmarks/scaling.py                      # decision grid, ~2-3 min
    .venv/bin/python benchmarks/scaling.py --part collectives   # ~1-2 min
    .venv/bin/python benchmarks/scaling.py --part collectives --verify-groups 1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

DEVICES = 8  # fake CPU devices for the collectives census


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--part", choices=("decision", "collectives"), default="decision")
  p.add_argument("--B", default="8,32,128", help="slots, comma-separated")
  p.add_argument("--K", default="4,8,16", help="draft positions, comma-separated")
  p.add_argument("--V", default="4096,32768", help="vocabulary sizes, comma-separated")
  p.add_argument("--repeats", type=int, default=9, help="timed steps per size (median)")
  p.add_argument("--max-bytes-repeats", type=float, default=1.0,
                 help="cap repeats so repeats * logits GiB <= this (keeps big sizes short)")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps per size")
  p.add_argument("--models", default="default", help="model config of the census")
  p.add_argument("--verify-groups", default="auto",
                 help="census: Programs.verify_groups, an int or 'auto' (the 'data' size)")
  p.add_argument("--out", default=None, help="JSON results path")
  args = p.parse_args(argv)
  for name in ("B", "K", "V"):
    setattr(args, name, [int(x) for x in getattr(args, name).split(",")])
  args.verify_groups = None if args.verify_groups == "auto" else int(args.verify_groups)
  return args


def hardware() -> dict:
  from av_lab import _machine
  d = _machine.describe()
  return dict(cpu=d["cpu"], cores=d["cores"], jax=d["jax"], backend=d["backend"],
              load_avg=d["load_avg"])


# ----------------------------------------------------------------------------------------
# Part 1: the per-step decision.


def _decision_inputs(B, K, V, seed=0):
  import jax
  import numpy as np
  k1, k2 = jax.random.split(jax.random.key(seed))
  scale = jax.random.uniform(k1, (B, K, 1), minval=0.5, maxval=6.0)
  logits = jax.block_until_ready(jax.random.normal(k2, (B, K, V)) * scale)
  rng = np.random.default_rng(seed)
  steps = []
  for t in range(4):
    a = rng.integers(0, K + 1, B)
    pos = np.arange(K)[None]
    steps.append(tuple(jax.numpy.asarray(x) for x in (
        pos < a[:, None], (pos <= a[:, None]) & (t > 0), rng.random(B) < 0.9)))
  return logits, steps


def time_decision(B, K, V, args) -> dict:
  """Median seconds of one jitted decision step at (B, K, V)."""
  import jax
  import numpy as np
  from av_lab.decision_reference import DecisionConfig
  tokens = np.arange(B * (K + 1) + 1)
  # Affine costs with the break-even survival near 1/3: the budget is interior.
  cfg = DecisionConfig(num_positions=K, draft_ms=(1.0,) * (B + 1),
                       verify_ms=tuple(2.0 + 1.5 / B * tokens), policy="current")
  decide, cost = cfg.jax_decision(), cfg.cost()
  state = decide.init(B)
  logits, steps = _decision_inputs(B, K, V)
  gib = B * K * V * 4 / 2**30
  repeats = max(3, min(args.repeats, int(args.max_bytes_repeats / gib)))
  times = []
  for rep in range(args.warmup + repeats):
    t0 = time.perf_counter()
    plan, state = decide.step(state, logits, *steps[rep % len(steps)], cost)
    jax.block_until_ready((plan, state))
    if rep >= args.warmup:
      times.append(time.perf_counter() - t0)
  assert decide.num_traces() == 1, "the decision retraced"
  return dict(B=B, K=K, V=V, repeats=repeats, ms=1e3 * statistics.median(times))


def fit_rest(rows) -> dict:
  """Least squares `ms = c0 + c_pos * B*K` (weights 1/ms: relative error)."""
  import numpy as np
  X = np.array([[1.0, r["B"] * r["K"]] for r in rows])
  y = np.array([r["ms"] for r in rows])
  w = 1.0 / y
  coef, *_ = np.linalg.lstsq(X * w[:, None], y * w, rcond=None)
  return dict(c0_ms=float(coef[0]), pos_ns=float(coef[1] * 1e6),
              max_rel_err=float(np.max(np.abs(X @ coef - y) / y)))


def run_decision(args) -> dict:
  hw = hardware()
  print(f"# {hw['cpu']}, {hw['cores']} cores, jax {hw['jax']} ({hw['backend']}), "
        f"load avg {hw['load_avg'][0]:.1f}", flush=True)
  t_start = time.time()
  rows = {}
  for V in [16] + args.V:  # V = 16: the decision without (practically) any logits
    for B in args.B:
      for K in args.K:
        rows[B, K, V] = time_decision(B, K, V, args)
        print(f"B={B:4d} K={K:3d} V={V:6d}  {rows[B, K, V]['ms']:9.3f} ms", flush=True)
  rest = fit_rest([rows[B, K, 16] for B in args.B for K in args.K])
  # Per-logit cost: the V = 16 time (estimator, planner, dispatch) removed.
  per_logit = {(B, K, V): (rows[B, K, V]["ms"] - rows[B, K, 16]["ms"]) * 1e6 / (B * K * V)
               for B in args.B for K in args.K for V in args.V}
  logit_ns = statistics.median(per_logit.values())
  print("\n| B | K | " + " | ".join(f"V={V} ms" for V in [16] + args.V) + " | " +
        " | ".join(f"ns/logit V={V}" for V in args.V) + " |")
  print("|---:|---:|" + "---:|" * (1 + 2 * len(args.V)))
  for B in args.B:
    for K in args.K:
      print(f"| {B} | {K} | " + " | ".join(f"{rows[B, K, V]['ms']:.2f}" for V in
                                         [16] + args.V) + " | " +
            " | ".join(f"{per_logit[B, K, V]:.2f}" for V in args.V) + " |")
  print(f"\nnon-logit part (V=16): {rest['c0_ms']:.3f} ms + {rest['pos_ns']:.1f} ns * B*K "
        f"(max rel. error {rest['max_rel_err']:.0%})")
  print(f"per logit (V=16 time removed): median {logit_ns:.2f} ns, range "
        f"{min(per_logit.values()):.2f}-{max(per_logit.values()):.2f} ns")
  extrapolated = []
  for B, K, V in ((256, 8, 128 * 1024), (256, 8, 256 * 1024), (1024, 8, 128 * 1024)):
    ms = rest["c0_ms"] + rest["pos_ns"] * 1e-6 * B * K + logit_ns * 1e-6 * B * K * V
    extrapolated.append(dict(B=B, K=K, V=V, ms=ms))
    print(f"extrapolated B={B} K={K} V={V}: {rest['c0_ms']:.2f} + {rest['pos_ns']:.0f}e-6 * "
          f"{B * K} + {logit_ns:.2f}e-6 * {B * K * V:,d} = {ms:.0f} ms per step on this CPU")
  hw["load_avg_end"] = os.getloadavg()
  print(f"# {time.time() - t_start:.0f} s, load avg at end {hw['load_avg_end'][0]:.1f}")
  return dict(hardware=hw, rows=list(rows.values()), rest=rest, logit_ns_median=logit_ns,
              per_logit_ns={f"{B}x{K}x{V}": v for (B, K, V), v in per_logit.items()},
              extrapolated=extrapolated)


# ----------------------------------------------------------------------------------------
# Part 2: collectives in one compiled engine step.

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_OP = re.compile(r"=\s*(.+?)\s+(all-reduce|all-gather|collective-permute|all-to-all|"
                 r"reduce-scatter)(-start)?\(")
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


def collectives(hlo_text: str) -> list[dict]:
  """Every collective of a compiled HLO module: kind, shapes, bytes, where it runs.

  `where` is "step" (inside the decode loop, every step), "bucket i" (inside the packed
  verify branch i, steps that use bucket i) or "chunk" (once per chunk).
  """
  out = []
  for line in hlo_text.splitlines():
    m = _OP.search(line)
    if m is None:
      continue
    shapes = [(dt, tuple(int(d) for d in dims.split(",") if d))
              for dt, dims in _SHAPE.findall(m.group(1))]
    if m.group(3):  # async start: (operands, outputs); count the outputs
      shapes = shapes[len(shapes) // 2:]
    nbytes = 0
    for dt, dims in shapes:
      n = 1
      for d in dims:
        n *= d
      nbytes += n * _BYTES.get(dt, 4)
    name = re.search(r'op_name="([^"]*)"', line)
    name = name.group(1) if name else ""
    branch = re.search(r"branch_(\d+)_fun", name)
    where = (f"bucket {branch.group(1)}" if branch else
             "step" if "/while/body/" in name else "chunk")
    short = re.sub(r"^jit\([^)]*\)/(while/body/)?(closed_call/)?", "", name)
    short = re.sub(r"cond/branch_\d+_fun/", "", short)
    out.append(dict(kind=m.group(2), shapes=[f"{dt}{list(d)}" for dt, d in shapes],
                    bytes=nbytes, where=where, op=short))
  return out


def census(models_name: str, *, data: int, model: int, num_slots: int, max_draft: int,
           max_len: int, drafter: str = "block", num_buckets: int = 2,
           verify_groups: int | None = None) -> dict:
  """Compiles one engine step (a chunk of 1 step) on a (data, model) mesh from shapes.

  `verify_groups` None means what `generate(mesh=...)` runs: one group per 'data' shard.
  """
  import jax
  from av_jax import engine as E
  from av_jax import models as M
  from av_jax.engine import batching, sharding
  from av_jax.sampling import Sampling
  cfg = M.load_config(models_name)
  drafter_fns = M.make_drafter(drafter, cfg)
  engine = E.make_engine(E.EngineConfig(num_slots=num_slots, max_draft=max_draft,
                                        max_len=max_len, mode="av",
                                        sampling=Sampling(temperature=1.0),
                                        programs=E.Programs(steps_per_chunk=1,
                                                            num_buckets=num_buckets,
                                                            verify_groups=verify_groups)),
                         cfg, drafter_fns)
  params = jax.eval_shape(lambda: E.Params(
      target=M.init_params(cfg.target, jax.random.key(0)),
      drafter=M.init_drafter_params(drafter, cfg, jax.random.key(1))))
  devices = jax.devices()[:data * model]
  import numpy as np
  mesh = sharding.make_mesh(data, model, devices=np.asarray(devices).reshape(data, model))
  engine = sharding.for_mesh(engine, mesh)
  state = jax.eval_shape(lambda p: E.init_state(engine, p, jax.random.key(0)), params)
  with jax.set_mesh(mesh):
    _, chunk, _ = batching.compiled_sharded(engine, mesh, params, state)
    text = chunk.lower(params, state).compile().as_text()
  t = cfg.target
  return dict(models=models_name, drafter=drafter, data=data, model=model, B=num_slots,
              K=max_draft, M=max_len, buckets=list(engine.buckets),
              verify_groups=engine.config.groups,
              group_buckets=list(engine.config.group_bucket_sizes()), L=t.num_layers,
              H=t.num_heads, Dh=t.head_dim, D=t.d_model, F=t.mlp_dim, V=t.vocab_size,
              collectives=collectives(text))


def run_collectives(args) -> dict:
  import jax
  jax.config.update("jax_num_cpu_devices", DEVICES)
  hw = hardware()
  print(f"# {hw['cpu']}, jax {hw['jax']}; {DEVICES} fake CPU devices; models "
        f"{args.models!r}, block drafter, shapes only")
  results = []
  settings = [dict(data=4, model=1, num_slots=16, max_draft=8, max_len=256),
              dict(data=4, model=1, num_slots=16, max_draft=8, max_len=512),
              dict(data=1, model=2, num_slots=16, max_draft=8, max_len=256)]
  for s in settings:
    t0 = time.time()
    r = census(args.models, verify_groups=args.verify_groups, **s)
    results.append(r)
    axis = "data" if s["data"] > 1 else "model"
    print(f"\n## mesh data={s['data']} model={s['model']} (collectives cross '{axis}'); "
          f"B={r['B']} K={r['K']} M={r['M']} buckets {r['buckets']} (G={r['verify_groups']} "
          f"groups of {r['group_buckets']}); L={r['L']} H={r['H']} "
          f"Dh={r['Dh']} D={r['D']} F={r['F']} V={r['V']}  [{time.time() - t0:.0f} s]")
    total = {}
    for c in r["collectives"]:
      total[c["where"]] = total.get(c["where"], 0) + c["bytes"]
      print(f"  {c['where']:9s} {c['kind']:18s} {c['bytes']:>11,d} B  "
            f"{' '.join(c['shapes'])}  {c['op'][-70:]}")
    print("  total bytes by where: " + ", ".join(f"{k}: {v:,d}" for k, v in
                                                 sorted(total.items())))
  return dict(hardware=hw, results=results)


def main(argv=None):
  args = parse_args(argv)
  result = run_decision(args) if args.part == "decision" else run_collectives(args)
  if args.out:
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(dict(command=" ".join(["benchmarks/scaling.py"] + sys.argv[1:]), **result),
                f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
