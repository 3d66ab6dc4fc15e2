"""Per-step cost of the decision (`av_jax.policy`: plan, the choice made again after each
pass of an autoregressive drafter, verify, learn), jitted.

    python benchmarks/policy_overhead.py --slots 64 --max-draft 8

Prints the median-of-rounds milliseconds per step for a parallel and an autoregressive
drafter's policy, priced by the modelled H200 / llama3-8b tables. Compare with a step of
the engine at the same B (BENCHMARKS.md).
"""

import argparse
import time

import jax
import jax.numpy as jnp

from av_jax import policy as P
from av_lab import replay as R


def time_policy(kind: str, drafter: str, B: int, K: int, *, rounds: int = 5,
                steps: int = 50) -> float:
  policy = P.make_policy(K, drafter_kind=kind)
  cost = R.deployment_cost("h200", drafter, B, K, K)
  active = jnp.ones((B,), bool)
  features = jax.random.normal(jax.random.key(0), (B, K))
  j = jnp.arange(K)[None]

  @jax.jit
  def one(state, features):
    plan = policy.plan(state, active, cost)
    drafted = j < plan.depth[:, None]
    if kind == "autoregressive":  # K - 1 choices made again, one after each pass
      probs = policy.estimator.predict(state.estimator, features)
      going, drafted = plan.draft & active, jnp.zeros((B, K), bool)
      for d in range(K):
        drafted = drafted.at[:, d].set(going)
        if d + 1 < K:
          going = policy.keep_drafting(state, plan, probs, drafted, d + 1, active=active,
                                       cost=cost)
    draft_ms = cost.draft(jnp.sum(drafted, 0, dtype=jnp.int32))
    num = (jnp.sum(drafted, 1, dtype=jnp.int32) if kind == "autoregressive"
           else policy.verify(state, plan, features, active, cost, draft_ms))
    outcome = P.StepOutcome(features, drafted, j < (num // 2)[:, None], j < num[:, None],
                            draft_ms + 1.0, plan.explore_ms)
    return policy.learn(state, outcome), num

  state = policy.init(B)
  state, num = one(state, features)
  jax.block_until_ready(num)
  best = float("inf")
  for _ in range(rounds):
    start = time.perf_counter()
    for _ in range(steps):
      state, num = one(state, features)
    jax.block_until_ready(num)
    best = min(best, (time.perf_counter() - start) / steps)
  return 1e3 * best


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--slots", type=int, default=64)
  parser.add_argument("--max-draft", type=int, default=8)
  args = parser.parse_args()
  for kind, drafter in (("parallel", "block"), ("autoregressive", "eagle")):
    ms = time_policy(kind, drafter, args.slots, args.max_draft)
    print(f"{kind:15s} B={args.slots} K={args.max_draft}: {ms:.3f} ms a step (best of rounds)")


if __name__ == "__main__":
  main()
