"""The engine's data: the configured `Engine`, its decode state and step records.

`Engine` binds the static config to a target, a drafter and a decider (`core.make_engine`
builds it); `DecodeState` is everything that changes between decode steps; `StepInfo`
is one step's record (`core.run_chunk` stacks them over a chunk); `init_state` makes a
state with every slot empty. Dimension letters as in `av_jax.engine.core`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from av_jax.arms import Arm
from av_jax.decision import Decider, DecisionState
from av_jax.engine.config import EngineConfig
from av_jax.engine.protocols import Target
from av_jax.estimator import EstimatorState
from av_jax.models.config import ModelsConfig
from av_jax.models.drafters import Drafter
from av_jax.planner import PlannerState
from av_jax.selection import CostModel, linear_cost_model


class EngineStats(NamedTuple):
  """Running totals since the state was created (device arrays)."""
  steps: jax.Array            # [] int32, decode steps run
  emitted: jax.Array          # [] int32, tokens emitted (after stops)
  verified: jax.Array         # [] int32, draft tokens verified
  draft_tokens: jax.Array     # [] int32, draft tokens proposed: K per active slot-step, or
                              # the depths drafted under a drafting stop
  accepted_at: jax.Array      # [K] int32, accepted drafts per position
  labeled_at: jax.Array       # [K] int32, labelled drafts per position
  bucket_hist: jax.Array      # [num_buckets] int32, steps per bucket
  nonfinite: jax.Array        # [] int32, slot-steps whose draft logits were not finite


class DecodeState(NamedTuple):
  """Everything that changes between decode steps (a pytree)."""
  target_cache: Any                  # target cache pytree (`Target.init_cache`; av_jax's:
                                     # KVCache [L, B, H, M, Dh])
  drafter: Any                       # the drafter's state (`Drafter.init_state`; av_jax's:
                                     # a DrafterState, caches and pending tokens)
  tokens: jax.Array                  # [B, M] int32 sequence buffer (prompt + output)
  length: jax.Array                  # [B] int32 tokens in the buffer
  prompt_len: jax.Array              # [B] int32 prompt tokens of the slot's request
  max_new: jax.Array                 # [B] int32 output-token limit of the request
  active: jax.Array                  # [B] bool, slot is decoding
  estimator: EstimatorState          # online acceptance estimator
  planner: PlannerState              # budget policy state
  cost: CostModel                    # step-cost tables the budget is chosen against
  key: jax.Array                     # PRNG key
  stats: EngineStats                 # running totals
  learn: jax.Array | None = None     # [B] bool, the slot's request teaches the estimator
                                     # (None: every request; `batching.generate(learn=)`)

  @property
  def decision(self) -> DecisionState:
    """The decision's state (estimator and planner) as the decider's verbs take it."""
    return DecisionState(estimator=self.estimator, planner=self.planner)


class StepInfo(NamedTuple):
  """Per-step record returned by `run_chunk` (stacked over the chunk's steps)."""
  budget: jax.Array        # [] int32, planner budget
  verified: jax.Array      # [] int32, draft tokens verified
  emitted: jax.Array       # [] int32, tokens emitted
  bucket: jax.Array        # [] int32, index of the packed bucket used
  active: jax.Array        # [] int32, active slots
  features: jax.Array      # [B, K] float32, logit_qmax of every draft
  probs: jax.Array         # [B, K] float32, predicted acceptance
  conf: jax.Array          # [B, K] float32, confidence-head probability (0 if none)
  accepted: jax.Array      # [B, K] bool
  labeled: jax.Array       # [B, K] bool
  slot_active: jax.Array   # [B] bool
  extra: jax.Array         # [B, K, F] float32, RECORDED_FEATURES (F = 0 unless recording)
  drafting: jax.Array      # [] bool, the step drafted (False: target-only step)
  num_verified: jax.Array  # [B] int32, drafts each slot fed to the target (the plan)
  # [] int32, drafter passes run this step: K for an autoregressive drafter drafting all
  # depths (fewer when a drafting stop ended the loop early), 1 for a parallel drafter,
  # 0 when nothing was drafted.
  draft_passes: jax.Array
  drafted_depth: jax.Array  # [B] int32, depths each slot drafted (0: inactive / none)
  draft_slots: jax.Array    # [B] bool, slots that drafted this step
  # [] int32, drafter rows that ran: the draft bucket E of a gated step, B of an ungated
  # step that drafted, 0 when nothing was drafted
  draft_rows: jax.Array
  # [B, K] float32, min(1, p(x) / q(x)) of every draft token given its draft prefix: the
  # probability the target accepts it once the positions before it are accepted (zeros
  # unless `record_features`; recorded streams replay it as the true acceptance).
  accept_probs: jax.Array


class Params(NamedTuple):
  target: Any   # target parameter pytree
  drafter: Any  # drafter parameter pytree


class Engine(NamedTuple):
  """A configured engine: static config and model functions (hashable, jit-static)."""
  config: EngineConfig
  models: ModelsConfig | None  # av_jax's model set, None for a target of the user's own
  target: Target     # what the engine calls on the target (`av_jax.engine.protocols`)
  drafter: Drafter
  policy: str        # the exact budget policy for this drafter and temperature
  arm: Arm           # what the engine drafts, scores and plans (`config.mode`)
  decider: Decider   # the per-step decision, built once (`av_jax.decision`)

  @property
  def buckets(self) -> tuple[int, ...]:
    return self.config.bucket_sizes()

  @property
  def pending_width(self) -> int:
    """The drafter state's pending columns: `EngineConfig.pending_width()` where a slot
    may skip drafting a drafter that keeps a backlog (`Drafter.backlog`, lazy catch-up),
    else K + 1."""
    gated = self.arm.drafts and self.decider.gated
    if gated and self.drafter.backlog:
      return self.config.pending_width()
    return self.config.max_draft + 1


def default_cost(cfg: EngineConfig) -> CostModel:
  """A synthetic affine cost model: right for correctness, not for throughput."""
  B, K = cfg.num_slots, cfg.max_draft
  return linear_cost_model(B, B * (K + 1), draft_fixed=0.1, verify_fixed=1.0,
                           verify_per_token=0.02)


def _empty_stats(cfg: EngineConfig) -> EngineStats:
  zero = jnp.zeros((), jnp.int32)
  zk = jnp.zeros((cfg.max_draft,), jnp.int32)
  return EngineStats(steps=zero, emitted=zero, verified=zero, draft_tokens=zero, accepted_at=zk,
                     labeled_at=zk, nonfinite=zero,
                     bucket_hist=jnp.zeros((len(cfg.bucket_sizes()),), jnp.int32))


def init_state(engine: Engine, params: Params, key: jax.Array,
               cost: CostModel | None = None) -> DecodeState:
  """An engine state with every slot empty (inactive).

  Args:
    engine: the engine.
    params: model parameters.
    key: PRNG key of the whole run.
    cost: measured step costs (`av_jax.engine.profile`); `default_cost` when None. Kept
      in the state as data, so a re-profiled table needs no recompile.
  """
  cfg = engine.config
  B, M = cfg.num_slots, cfg.max_len
  cost = default_cost(cfg) if cost is None else cost
  decision = engine.decider.init(B)
  return DecodeState(
      target_cache=engine.target.init_cache(B, M),
      drafter=_empty_drafter(engine, params, width=engine.pending_width),
      tokens=jnp.zeros((B, M), jnp.int32),
      length=jnp.ones((B,), jnp.int32),
      prompt_len=jnp.ones((B,), jnp.int32),
      max_new=jnp.zeros((B,), jnp.int32),
      active=jnp.zeros((B,), bool),
      estimator=decision.estimator,
      planner=decision.planner,
      cost=cost,
      key=key,
      stats=_empty_stats(cfg))


def _empty_drafter(engine: Engine, params: Params, *, width: int) -> Any:
  """The drafter state of B empty rows (a one-token prompt each) with `width` pending
  columns (`Drafter.start`)."""
  cfg = engine.config
  B = cfg.num_slots
  return engine.drafter.start(
      params.drafter, params.target, prompt=jnp.zeros((B, 1), jnp.int32),
      prompt_hidden=jnp.zeros((B, 1, engine.target.hidden_size), jnp.float32),
      next_token=jnp.zeros((B,), jnp.int32), K=cfg.max_draft, max_len=cfg.max_len,
      prompt_lens=jnp.ones((B,), jnp.int32), width=width)