"""Per-step AV decision overhead: jitted JAX vs host NumPy vs PyTorch eager (issue 2).

Times the whole per-step decision (`av_jax.decision.decision_step`: logit_qmax of the
`[B, K, V]` draft logits, then the decider's `learn`, `score` and `plan`: estimator
update, predict, survival, budget, allocation) as one jitted function, interleaved in
one run with the same decision in NumPy (`av_lab.decision_reference`) and PyTorch eager
(`benchmarks/references.py`); checks that the three agree; counts traces; and compares
the feature pass with one jitted `jnp.max` over the same logits (one read of the logits
is the floor).

The verbs timed are the engine's own: `DecisionConfig.decider()` returns the object
`make_decider` gives `av_jax.engine.make_engine` for the same settings, and
`tests/test_one_decision.py` checks that the engine's step-by-step decisions equal
`decision_step`'s.

    .venv/bin/python benchmarks/overhead.py                 # the three issue sizes
    .venv/bin/python benchmarks/overhead.py --quick         # small smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from av_lab.decision_reference import DecisionConfig, NumpyDecision, flatten_state
from av_jax.estimator import EstimatorConfig
from av_jax.features import logit_qmax
from feature_variants import hlo_passes, logit_qmax_fused  # benchmarks/ is on sys.path

try:
  import torch
  from references import TorchDecision, to_numpy_state  # benchmarks/ is on sys.path
except ImportError:  # the `bench` extra is not installed: run without the torch column
  torch = None

ISSUE_SIZES = "8x4x32768,64x8x32768,256x8x131072"
QUICK_SIZES = "8x4x4096,16x4x8192"


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--sizes", default=ISSUE_SIZES, help="comma-separated BxKxV")
  p.add_argument("--repeats", type=int, default=30, help="timed steps per size (median)")
  p.add_argument("--max-bytes-repeats", type=float, default=8.0,
                 help="cap repeats so repeats * logits GiB <= this (keeps big sizes short)")
  p.add_argument("--warmup", type=int, default=3, help="untimed steps per size")
  p.add_argument("--check-steps", type=int, default=4, help="steps of the agreement check")
  p.add_argument("--policy", default="current", help="planner policy (av_jax.planner)")
  p.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}, 5 repeats")
  p.add_argument("--out", default="reports/overhead.json", help="JSON results path")
  args = p.parse_args(argv)
  if args.quick:
    args.sizes, args.repeats = QUICK_SIZES, 5
  args.sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
  return args


def hardware() -> dict:
  from av_lab import _machine
  return dict(cpu=_machine.cpu_model(), cores=os.cpu_count(),
              usable_cores=len(os.sched_getaffinity(0)), jax=jax.__version__,
              numpy=np.__version__, torch=None if torch is None else torch.__version__,
              backend=jax.default_backend(), load_avg_start=os.getloadavg())


def config_for(B: int, K: int, policy: str) -> DecisionConfig:
  """Synthetic affine costs putting the break-even survival near 1/3 (interior budget)."""
  tokens = np.arange(B * (K + 1) + 1)
  return DecisionConfig(num_positions=K, draft_ms=(1.0,) * (B + 1),
                        verify_ms=tuple(2.0 + 1.5 / B * tokens), policy=policy)


def make_inputs(B: int, K: int, V: int, seed: int = 0, pool: int = 4):
  """Logits generated once on device (per-row scale spreads the feature), plus a pool of
  previous-step labels and active masks that the steps cycle through."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  scale = jax.random.uniform(k1, (B, K, 1), minval=0.5, maxval=6.0)
  logits = jax.block_until_ready(jax.random.normal(k2, (B, K, V)) * scale)
  rng = np.random.default_rng(seed)
  steps = []
  for t in range(pool):
    a = rng.integers(0, K + 1, B)
    pos = np.arange(K)[None]
    steps.append(dict(accepted=pos < a[:, None], labeled=(pos <= a[:, None]) & (t > 0),
                      active=rng.random(B) < 0.9))
  return logits, steps


def time_once(fn) -> tuple[float, object]:
  t0 = time.perf_counter()
  out = fn()
  return time.perf_counter() - t0, out


def check_agreement(cfg, logits_j, logits_np, logits_t, steps) -> dict:
  """Runs all implementations from fresh states on the same inputs; returns max diffs.
  A short refit interval makes the check cover the Newton refit too."""
  cfg = dataclasses.replace(cfg, estimator=EstimatorConfig(refit_interval=2))
  impls = {"numpy": (NumpyDecision(cfg), logits_np, np.asarray)}
  if torch is not None:
    impls["torch"] = (TorchDecision(cfg), logits_t, torch.from_numpy)
  decide, B, cost = cfg.jax_decision(), logits_np.shape[0], cfg.cost()
  fused = cfg.jax_decision(feature=logit_qmax_fused)
  js, fs = decide.init(B), fused.init(B)
  states = {k: impl.init(B) for k, (impl, _, _) in impls.items()}
  worst = {k: 0.0 for k in impls}
  for inputs in steps:
    labels = [jnp.asarray(inputs[k]) for k in ("accepted", "labeled", "active")]
    plan, js = decide.step(js, logits_j, *labels, cost)
    fplan, fs = fused.step(fs, logits_j, *labels, cost)
    ref_state = flatten_state(js)
    if not np.array_equal(fplan.num_verified, plan.num_verified):
      raise AssertionError("fused-feature decision disagrees with the library decision")
    worst["jax_fused"] = max(worst.get("jax_fused", 0.0), float(
        np.max(np.abs(np.asarray(fs.features) - np.asarray(js.features)))))
    for name, (impl, logits, conv) in impls.items():
      nv, _, budget, states[name] = impl.step(
          states[name], logits, *(conv(inputs[k]) for k in ("accepted", "labeled", "active")))
      nv = np.asarray(nv)
      if not np.array_equal(nv, np.asarray(plan.num_verified)) or budget != int(plan.budget):
        raise AssertionError(f"{name}: num_verified {nv} / budget {budget} != jax "
                             f"{np.asarray(plan.num_verified)} / {int(plan.budget)}")
      got = states[name] if name == "numpy" else to_numpy_state(states[name])
      for key, want in ref_state.items():
        diff = float(np.max(np.abs(np.asarray(got[key], np.float64) - want)))
        tol = 1e-4 * (1 + float(np.max(np.abs(want))))
        if not diff <= tol:
          raise AssertionError(f"{name}: state {key} differs by {diff}: {got[key]} vs {want}")
        worst[name] = max(worst[name], diff)
  return dict(steps=len(steps), refits=int(ref_state["estimator.num_refits"]),
              max_abs_state_diff=worst)


def bench_size(B, K, V, args) -> dict:
  cfg = config_for(B, K, args.policy)
  logits_j, steps = make_inputs(B, K, V)
  logits_np = np.array(logits_j)  # one host copy shared by NumPy and torch (zero-copy)
  logits_t = None if torch is None else torch.from_numpy(logits_np)
  agreement = check_agreement(cfg, logits_j, logits_np, logits_t, steps)

  decide, cost = cfg.jax_decision(), cfg.cost()
  fused = cfg.jax_decision(feature=logit_qmax_fused)
  impls = {"jax": lambda *args: decide.step(*args, cost),
           "jax_fused": lambda *args: fused.step(*args, cost),
           "numpy": NumpyDecision(cfg).step}
  states = {"jax": decide.init(B), "jax_fused": fused.init(B),
            "numpy": NumpyDecision(cfg).init(B)}
  jax_steps = [{k: jnp.asarray(v) for k, v in s.items()} for s in steps]
  inputs = {"jax": jax_steps, "jax_fused": jax_steps, "numpy": steps}
  logits = {"jax": logits_j, "jax_fused": logits_j, "numpy": logits_np}
  if torch is not None:
    impls["torch"] = TorchDecision(cfg).step
    states["torch"] = TorchDecision(cfg).init(B)
    inputs["torch"] = [{k: torch.from_numpy(v) for k, v in s.items()} for s in steps]
    logits["torch"] = logits_t
  gib = B * K * V * 4 / 2**30
  repeats = max(3, min(args.repeats, int(args.max_bytes_repeats / gib)))
  times = {k: [] for k in impls}
  traces_after_warmup = None
  for rep in range(args.warmup + repeats):  # interleaved: every repeat runs all of them
    if rep == args.warmup:
      traces_after_warmup = decide.num_traces() + fused.num_traces()
    for name, step in impls.items():
      x = inputs[name][rep % len(steps)]
      dt, out = time_once(lambda: jax.block_until_ready(step(
          states[name], logits[name], x["accepted"], x["labeled"], x["active"])))
      states[name] = out[-1]
      if rep >= args.warmup:
        times[name].append(dt)
  ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}

  # `sum_exp` (one max, one fused exp-sum: a plain logsumexp) is the cheapest exp-based
  # formula: how far it sits above `max` is the price of the exp itself on this CPU.
  passes = {"feature": jax.jit(logit_qmax), "feature_fused": jax.jit(logit_qmax_fused),
            "max": jax.jit(lambda x: jnp.max(x, axis=-1)),
            "sum_exp": jax.jit(lambda x: jnp.sum(jnp.exp(x - jnp.max(x, -1, keepdims=True)), -1))}
  pass_times = {k: [] for k in passes}
  for rep in range(args.warmup + repeats):
    for name, fn in passes.items():
      dt, _ = time_once(lambda: jax.block_until_ready(fn(logits_j)))
      if rep >= args.warmup:
        pass_times[name].append(dt)
  pass_ms = {k: 1e3 * statistics.median(v) for k, v in pass_times.items()}
  nbytes = B * K * V * 4
  refs = [k for k in ("numpy", "torch") if k in ms]
  result = dict(
      B=B, K=K, V=V, logits_gib=gib, repeats=repeats, ms=ms,
      ratios={f"{r}/{j}": ms[r] / ms[j] for j in ("jax", "jax_fused") for r in refs},
      pass_ms=pass_ms, pass_gbps={k: nbytes / v / 1e6 for k, v in pass_ms.items()},
      feature_over_max=pass_ms["feature"] / pass_ms["max"],
      feature_fused_over_max=pass_ms["feature_fused"] / pass_ms["max"],
      sum_exp_over_max=pass_ms["sum_exp"] / pass_ms["max"],
      hlo_passes={k: hlo_passes(passes[k], (B, K, V)) for k in passes},
      traces=decide.num_traces() + fused.num_traces(),
      retraces_after_warmup=decide.num_traces() + fused.num_traces() - traces_after_warmup,
      agreement=agreement)
  del logits_j, logits_np, logits_t, logits, states
  return result


def summary(r) -> str:
  ms, gbps = r["ms"], r["pass_gbps"]
  timing = " | ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
  ratios = ", ".join(f"{k} {v:.2f}x" for k, v in r["ratios"].items())
  passes = ", ".join(f"{k} {r['pass_ms'][k]:.2f} ms {gbps[k]:.1f} GB/s" for k in gbps)
  return (f"B={r['B']} K={r['K']} V={r['V']} ({r['logits_gib']:.3f} GiB, {r['repeats']} "
          f"repeats)\n  decision: {timing}\n  ratios: {ratios}\n  feature pass: {passes}; "
          f"feature/max {r['feature_over_max']:.2f}x, fused/max "
          f"{r['feature_fused_over_max']:.2f}x, sum_exp/max {r['sum_exp_over_max']:.2f}x; HLO {r['hlo_passes']}\n  traces {r['traces']}"
          f" (+{r['retraces_after_warmup']} after warm-up); agreement over "
          f"{r['agreement']['steps']} steps, {r['agreement']['refits']} refits, max state diff "
          f"{r['agreement']['max_abs_state_diff']}")


def main(argv=None):
  args = parse_args(argv)
  if torch is not None:  # one thread per usable core, so `taskset -c 0` means one core
    torch.set_num_threads(len(os.sched_getaffinity(0)))
  hw = hardware()
  print(f"# {hw['cpu']}, {hw['cores']} cores; jax {hw['jax']} ({hw['backend']}), "
        f"numpy {hw['numpy']}, torch {hw['torch']}; load avg {hw['load_avg_start']}")
  results = []
  for B, K, V in args.sizes:
    r = bench_size(B, K, V, args)
    results.append(r)
    print(summary(r), flush=True)
  hw["load_avg_end"] = os.getloadavg()
  if args.out:
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(dict(command=" ".join(["benchmarks/overhead.py"] + sys.argv[1:]),
                     hardware=hw, results=results), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
