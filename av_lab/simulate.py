"""A synthetic speculative-decoding stream for demos and tests of the core.

No language model is involved: every step draws, for each slot and draft position, a
random target distribution p and a draft distribution q that is p's logits plus noise
growing with depth (a parallel drafter: q does not depend on the drawn tokens). The AV
decision then runs as the engine runs it, with the same verbs (`av_jax.decision`):
features -> score -> plan -> rejection sample -> learn, all in one `lax.scan` on device. Step cost is read
from a `CostModel`, so throughput is modelled, not timed.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from av_jax import metrics
from av_jax.arms import get_arm, policy_for
from av_jax.decision import DecisionState, make_decider
from av_jax.estimator import EstimatorConfig, EstimatorState
from av_jax.features import logit_qmax
from av_jax.rejection import rejection_sample
from av_jax.selection import CostModel


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticWorkload:
  num_slots: int = 64           # B, concurrent requests
  num_positions: int = 8        # K, maximum draft length
  vocab_size: int = 64          # V
  target_scale: float = 3.0     # median spread of target logits; larger = more predictable
  scale_spread: float = 0.7     # log-normal spread of that scale across tokens (easy vs hard)
  draft_noise: float = 1.0      # draft logit noise at position 1
  noise_growth: float = 0.25    # extra noise per deeper position


class StepStats(NamedTuple):
  emitted: jax.Array    # [] int32, tokens emitted this step
  verified: jax.Array   # [] int32, draft tokens verified this step
  cost: jax.Array       # [] float32, modelled step cost
  probs: jax.Array      # [B, K] float32, predicted acceptance
  accepted: jax.Array   # [B, K] bool
  labeled: jax.Array    # [B, K] bool


def _draw(key, w: SyntheticWorkload):
  B, K, V = w.num_slots, w.num_positions, w.vocab_size
  k_t, k_s, k_n, k_x = jax.random.split(key, 4)
  # Token difficulty varies: a peaked target is easy to draft, a flat one is not, which
  # is what makes the draft's confidence informative.
  scale = w.target_scale * jnp.exp(w.scale_spread * jax.random.normal(k_s, (B, K + 1, 1)))
  target_logits = scale * jax.random.normal(k_t, (B, K + 1, V))
  sigma = w.draft_noise + w.noise_growth * jnp.arange(K)
  draft_logits = target_logits[:, :K] + sigma[None, :, None] * jax.random.normal(k_n, (B, K, V))
  draft_tokens = jax.random.categorical(k_x, draft_logits).astype(jnp.int32)
  return draft_logits, draft_tokens, jax.nn.softmax(target_logits)


def run(key: jax.Array, workload: SyntheticWorkload, cost: CostModel, *, mode: str,
        num_steps: int, refit_interval: int = 20) -> tuple[StepStats, EstimatorState]:
  """Runs `num_steps` synthetic decode steps in one `lax.scan`.

  Args:
    key: PRNG key.
    workload: the synthetic stream's shape and difficulty.
    cost: step cost model.
    mode: an arm of `av_jax.arms.ARMS` other than `av_head`: "av" (online estimator,
      exact policy for a parallel drafter), "fixed" (verify all K), "target_only"
      (verify nothing), or "oracle" (verifies exactly the tokens that will be accepted,
      knowing the outcome: a ceiling for studies, not lossless).
    num_steps: steps to run.
    refit_interval: estimator round length.

  Returns:
    Per-step `StepStats` stacked along a leading `[num_steps]` axis, and the final
    estimator state.
  """
  B, K = workload.num_slots, workload.num_positions
  arm = get_arm(mode)
  if arm.head:
    raise ValueError(f"mode: the synthetic drafter has no confidence head, got {mode!r}")
  if arm.stop == "confidence":  # it would silently run as `fixed`
    raise ValueError(f"mode: the synthetic drafter drafts all K in one parallel pass, so a "
                     f"drafting stop does not apply; got {mode!r}")
  decider = make_decider(K, policy=policy_for(arm, drafting="parallel", greedy=False),
                         estimator=EstimatorConfig(refit_interval=refit_interval))

  def step(state: DecisionState, key):
    k_draw, k_verify = jax.random.split(key)
    draft_logits, draft_tokens, target_probs = _draw(k_draw, workload)
    features = logit_qmax(draft_logits)
    probs = decider.score(state, features)
    plan, state = decider.plan(state, probs, cost)
    draft_probs = jax.nn.softmax(draft_logits)
    result = rejection_sample(k_verify, draft_probs=draft_probs, draft_tokens=draft_tokens,
                              target_probs=target_probs, num_verified=plan.num_verified)
    num_verified = plan.num_verified
    if arm.hindsight:
      # Same randomness, hindsight: verify exactly the drafts that will be accepted.
      num_verified = result.num_accepted
      result = rejection_sample(k_verify, draft_probs=draft_probs, draft_tokens=draft_tokens,
                                target_probs=target_probs, num_verified=num_verified)
    state = decider.learn(state, features, result.accepted, result.labeled)
    verified = jnp.sum(num_verified)
    step_cost = cost.draft_cost(B) + cost.verify_cost(B + verified)
    stats = StepStats(emitted=jnp.sum(result.num_emitted), verified=verified, cost=step_cost,
                      probs=probs, accepted=result.accepted, labeled=result.labeled)
    return state, stats

  state, stats = jax.lax.scan(step, decider.init(), jax.random.split(key, num_steps))
  return stats, state.estimator


def summarize(stats: StepStats, *, warmup: int = 0) -> dict[str, float]:
  """Throughput and calibration figures of a run (host-side, after the scan)."""
  s = jax.tree.map(lambda x: x[warmup:], stats)
  emitted = float(jnp.sum(s.emitted))
  total_cost = float(jnp.sum(s.cost))
  return dict(
      tokens_per_step=emitted / s.emitted.shape[0],
      verified_per_step=float(jnp.mean(s.verified)),
      cost_per_step=total_cost / s.emitted.shape[0],
      tokens_per_cost=emitted / total_cost,
      ece=float(metrics.ece(s.probs, s.accepted, s.labeled)),
      auc=float(metrics.auc(s.probs, s.accepted, s.labeled)),
  )
