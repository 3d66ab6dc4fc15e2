"""What the draft buckets save on this machine: the drafter's K tokens at each bucket's E
rows, against the target-only engine's plain step at B slots.

A gated AV step drafting for n slots runs the drafter on the smallest draft bucket
E >= n rows (`EngineConfig.draft_bucket_sizes`: ceil(B/8), ceil(B/4), ceil(B/2), B); each
bucket is one more compiled copy of the drafter's loop (`benchmarks/compile_time.py`).
This prints what drafting E rows costs, so the compile each bucket adds can be set
against the step time it saves. Every program is compiled first; each round times each
entry in turn (interleaved), and the smallest time over the rounds is kept. Example:

    python benchmarks/draft_buckets.py --drafter eagle --slots 64 --max-draft 8

Random weights (the cost does not depend on them); every slot busy after a 32-token prompt.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
import step_profile as SP  # noqa: E402

from av_jax import models as M  # noqa: E402
from av_jax.engine import core  # noqa: E402
from av_jax.models import drafters as D  # noqa: E402


def measure(*, drafter: str, slots: int, max_draft: int, max_len: int, rounds: int,
            repeats: int, config: str = "default") -> dict:
  """{"plain": ms a target-only step, E: ms of drafting K tokens for E rows (K passes of an
  autoregressive drafter, one of a parallel one)}."""
  models = M.load_config(config)
  params = SP._params(models, drafter)  # pylint: disable=protected-access
  kind = M.make_drafter(drafter, models)
  B, K = slots, max_draft
  steps = 4
  plain_engine = core.make_engine(core.EngineConfig(mode="target_only", num_slots=B,
                                                    max_draft=K, max_len=max_len),
                                  models, kind)
  av = core.EngineConfig(mode="av", num_slots=B, max_draft=K, max_len=max_len)  # its buckets
  fixed = core.make_engine(core.EngineConfig(mode="fixed", num_slots=B, max_draft=K,
                                             max_len=max_len), models, kind)
  busy_state = SP._busy_state  # pylint: disable=protected-access
  busy = busy_state(fixed, params, prompt_len=32, key=jax.random.PRNGKey(0))
  plain_state = busy_state(plain_engine, params, prompt_len=32, key=jax.random.PRNGKey(0))
  chunk = jax.jit(lambda p, s: core.run_chunk(plain_engine, p, s, steps)[0])
  entries = {"plain": (lambda: chunk(params, plain_state), steps)}
  for E in av.draft_bucket_sizes():
    sub = D.take_slots(busy.drafter, jnp.arange(E))
    draft = jax.jit(lambda s, k: kind.draft(params.drafter, params.target, s, k, K=K,
                                            temperature=1.0, top_p=0.95).tokens)
    entries[E] = (lambda draft=draft, sub=sub: draft(sub, jax.random.PRNGKey(1)), 1)
  for run, _ in entries.values():
    jax.block_until_ready(run())  # compile and warm up
  times = {name: [] for name in entries}
  for _ in range(rounds):
    for name, (run, per) in entries.items():
      start = time.perf_counter()
      for _ in range(repeats):
        jax.block_until_ready(run())
      times[name].append((time.perf_counter() - start) / (repeats * per) * 1e3)
  return {name: min(t) for name, t in times.items()}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--drafter", default="eagle", help="drafter kind")
  p.add_argument("--slots", type=int, default=64, help="B, every slot busy")
  p.add_argument("--max-draft", type=int, default=8, help="K, tokens drafted a row")
  p.add_argument("--max-len", type=int, default=256, help="cache positions per slot")
  p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
  p.add_argument("--repeats", type=int, default=3, help="timed runs per entry and round")
  p.add_argument("--config", default="default", help="model set")
  args = p.parse_args(argv)
  print(f"load average {os.getloadavg()[0]:.2f}; {args.config} models, {args.drafter}, "
        f"B = {args.slots}, K = {args.max_draft}, M = {args.max_len}, jax {jax.__version__}")
  ms = measure(drafter=args.drafter, slots=args.slots, max_draft=args.max_draft,
               max_len=args.max_len, rounds=args.rounds, repeats=args.repeats,
               config=args.config)
  plain = ms.pop("plain")
  print(f"target-only plain step at B = {args.slots}: {plain:.2f} ms")
  for E, t in ms.items():
    print(f"  drafter, K = {args.max_draft} at E = {E:3d} rows: {t:8.2f} ms "
          f"({t / plain:.2f}x the plain step)")
  print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
  main()
