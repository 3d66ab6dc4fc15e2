"""Compile time of the engine's decode programs: the `av` arm against a fixed-K engine.

    python benchmarks/compile_time.py --drafter eagle --slots 64 --max-draft 8

For each arm, builds the engine on the shipped `default` models (or `--config`), lowers
and compiles every decode program `generate` runs (`batching.decode_programs`: the quiet
and the drafting program of an engine that splits quiet steps, else the one chunk
program) and the prefill, and prints the seconds each took and the ratio of the totals
(`av` / `fixed`). Compile time does not depend on the weights: random ones are used.
Run on a quiet machine (`uptime` first); the load average is printed with the figures.
"""

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from av_jax import engine as E
from av_jax import models as M
from av_jax.engine import batching


def compile_seconds(models, drafter_kind: str, mode: str, *, slots: int, max_draft: int,
                    max_len: int, programs: E.Programs = E.Programs()) -> dict:
  """{program name: seconds to lower and compile} for one engine."""
  drafter = M.make_drafter(drafter_kind, models)
  engine = E.make_engine(E.EngineConfig(num_slots=slots, max_draft=max_draft,
                                        max_len=max_len, mode=mode, programs=programs),
                         models, drafter)
  params = E.Params(target=M.init_params(models.target, jax.random.PRNGKey(0)),
                    drafter=M.init_drafter_params(drafter_kind, models, jax.random.PRNGKey(1)))
  prefill, _, init = batching.compiled(engine)
  state = init(params, jax.random.PRNGKey(0), None)
  out = {}
  programs = batching.decode_programs(engine)
  names = ("quiet", "drafting") if len(programs) == 2 else ("chunk",)
  for name, program in zip(names, programs):
    args = (params, state) + ((np.int32(1),) if len(programs) == 2 else ())
    start = time.perf_counter()
    program.lower(*args).compile()
    out[name] = time.perf_counter() - start
  prompt = jnp.zeros((32,), jnp.int32)
  start = time.perf_counter()
  prefill.lower(params, state, prompt, jnp.int32(4), jnp.int32(0), jnp.int32(8)).compile()
  out["prefill"] = time.perf_counter() - start
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default="default", help="model set (av_jax/configs)")
  parser.add_argument("--drafter", default="eagle")
  parser.add_argument("--slots", type=int, default=64)
  parser.add_argument("--max-draft", type=int, default=8)
  parser.add_argument("--max-len", type=int, default=256)
  parser.add_argument("--draft-buckets", default=None,
                      help="comma-separated draft bucket sizes of the av engine (default: "
                           "the engine's)")
  parser.add_argument("--num-buckets", type=int, default=None,
                      help="verify buckets of the av engine (default: the engine's)")
  args = parser.parse_args()
  extra = {} if args.num_buckets is None else {"num_buckets": args.num_buckets}
  if args.draft_buckets:
    extra["draft_buckets"] = tuple(int(x) for x in args.draft_buckets.split(","))
  models = M.load_config(args.config)
  print(f"load average {os.getloadavg()[0]:.2f}; {args.config} models, {args.drafter}, "
        f"B = {args.slots}, K = {args.max_draft}, M = {args.max_len}, jax {jax.__version__}")
  totals = {}
  for mode in ("fixed", "av"):
    secs = compile_seconds(models, args.drafter, mode, slots=args.slots,
                           max_draft=args.max_draft, max_len=args.max_len,
                           programs=E.Programs(**(extra if mode == "av" else {})))
    totals[mode] = sum(secs.values())
    parts = ", ".join(f"{k} {v:.1f} s" for k, v in secs.items())
    print(f"{mode:6s}: {totals[mode]:.1f} s ({parts})")
  print(f"av / fixed: {totals['av'] / totals['fixed']:.2f}x "
        f"(load average {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
  main()
