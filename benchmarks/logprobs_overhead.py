"""Time `rejection_sample` with log-probabilities off and on, side by side.

Each repeat times the off program, then the on programs, interleaved, so load on a shared
machine lands on all of them alike; the ratio is of the medians.

  python benchmarks/logprobs_overhead.py --batch 64 --draft 8 --vocab 32000
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from av_jax.rejection import rejection_sample


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=64, help="B requests")
  parser.add_argument("--draft", type=int, default=8, help="K draft positions")
  parser.add_argument("--vocab", type=int, default=32000, help="V vocabulary")
  parser.add_argument("--top", type=int, default=5, help="n top log-probabilities of the second 'on' program")
  parser.add_argument("--repeats", type=int, default=30, help="interleaved timed rounds")
  args = parser.parse_args()
  B, K, V = args.batch, args.draft, args.vocab
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  draft_probs = jax.nn.softmax(2.0 * jax.random.normal(k1, (B, K, V)), axis=-1)
  target_probs = jax.nn.softmax(2.0 * jax.random.normal(k2, (B, K + 1, V)), axis=-1)
  draft_tokens = jax.random.categorical(k3, jnp.log(draft_probs)).astype(jnp.int32)
  num_verified = jnp.full((B,), K, jnp.int32)

  def program(logprobs, ranks=False):
    return jax.jit(lambda key, q, x, p, n: rejection_sample(
        key, draft_probs=q, draft_tokens=x, target_probs=p, num_verified=n, logprobs=logprobs,
        logprob_ranks=ranks))

  programs = {"off": program(None), "on (n=0)": program(0),
              "on (n=0, ranks)": program(0, True), f"on (n={args.top})": program(args.top)}
  times = {name: [] for name in programs}
  keys = jax.random.split(jax.random.key(1), args.repeats + 2)
  for i, key in enumerate(keys):
    for name, fn in programs.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(key, draft_probs, draft_tokens, target_probs, num_verified))
      if i >= 2:  # compile and warm-up rounds
        times[name].append((time.perf_counter() - start) * 1e3)
  medians = {name: float(np.median(t)) for name, t in times.items()}
  report = dict(B=B, K=K, V=V, repeats=args.repeats, median_ms=medians,
                ratio={name: medians[name] / medians["off"] for name in medians},
                load_average=os.getloadavg(), device=jax.devices()[0].device_kind,
                jax=jax.__version__)
  print(json.dumps(report, indent=1))


if __name__ == "__main__":
  main()
