"""Wall time per step of an AV engine's quiet program (`core.run_mode(quiet=True)`, what
`generate` runs while the plan drafts for no slot) against a target-only engine's chunk.

Both engines hold B busy slots (prefilled, drafting priced out: `step_profile._busy_state`);
each round times 4 chunks of 8 steps of each arm, the arms interleaved, median of the
rounds. Example (ratio near 1.0: AV costs what target-only does when it does not draft):

    .venv/bin/python benchmarks/quiet_overhead.py --concurrency 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
import step_profile as SP  # noqa: E402

from av_jax import models as M  # noqa: E402
from av_jax.engine import core  # noqa: E402
from av_jax.engine.config import Programs  # noqa: E402
from av_jax.sampling import Sampling  # noqa: E402


def measure(*, concurrency: int, drafter: str = "block", config: str = "default",
            max_len: int = 256, steps: int = 8, rounds: int = 5) -> dict:
  models = M.load_config(config)
  params = SP._params(models, drafter)
  kind = M.make_drafter(drafter, models)
  runs = {}
  for mode in ("target_only", "av"):
    cfg = core.EngineConfig(mode=mode, num_slots=concurrency, max_draft=8, max_len=max_len,
                            sampling=Sampling(temperature=1.0, top_p=0.95),
                            programs=Programs(steps_per_chunk=steps))
    engine = core.make_engine(cfg, models, kind)
    state = SP._busy_state(engine, params, prompt_len=32, key=jax.random.PRNGKey(0))
    if mode == "av":
      run = jax.jit(lambda p, s, e=engine: core.run_mode(e, p, s, jnp.int32(steps),
                                                         quiet=True)[0])
    else:
      run = jax.jit(lambda p, s, e=engine: core.run_chunk(e, p, s, steps)[0])
    fresh = lambda state=state: jax.block_until_ready(jax.tree.map(jnp.copy, state))
    jax.block_until_ready(run(params, fresh()))  # compile and warm up
    runs[mode] = (run, fresh)
  times = {m: [] for m in runs}
  for _ in range(rounds):
    for mode, (run, fresh) in runs.items():
      state = fresh()
      start = time.perf_counter()
      for _ in range(4):
        state = run(params, state)
      jax.block_until_ready(state)
      times[mode].append((time.perf_counter() - start) / (4 * steps) * 1e3)
  out = {m: statistics.median(t) for m, t in times.items()}
  out["ratio"] = out["av"] / out["target_only"]
  return out


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--concurrency", type=int, default=1)
  p.add_argument("--drafter", default="block")
  p.add_argument("--config", default="default")
  p.add_argument("--rounds", type=int, default=5)
  args = p.parse_args(argv)
  r = measure(concurrency=args.concurrency, drafter=args.drafter, config=args.config,
              rounds=args.rounds)
  print(f"B = {args.concurrency}: target-only {r['target_only']:.3f} ms/step, AV quiet "
        f"{r['av']:.3f} ms/step, ratio {r['ratio']:.3f}")


if __name__ == "__main__":
  main()
