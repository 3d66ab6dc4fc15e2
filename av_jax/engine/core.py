"""The batched speculative-decoding step with Adaptive Verification, all on device.

One jitted `step(params, state) -> (state, StepInfo)`:

    draft K tokens -> features -> acceptance probabilities (online estimator or the
    drafter's confidence head) -> decision: num_verified per slot -> pack the verified
    tokens into a static bucket -> target forward on the packed tokens only (`lax.switch`
    over one program per bucket) -> rejection sample -> commit the emitted tokens to the
    caches and the sequence buffer -> estimator update.

`run_chunk` scans `step` over a fixed number of steps; the host touches the state only
between chunks (continuous batching in `av_jax.engine.generate`). Shapes are static:
B slots, K draft positions, M cache length, V vocabulary, T packed tokens (a bucket).

Positions: slot b's sequence buffer holds `length[b]` tokens (prompt + generated). The
target cache holds positions `0 .. length-2`; the newest token `tokens[b, length-1]`
(the "base token") is fed at position `length-1` together with the verified drafts.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from av_jax.arms import ARMS, Arm, get_arm, policy_for
from av_jax.decider import make_policy_decider
from av_jax.decision import Decider, DecisionState, make_decider
from av_jax.engine import protocols
from av_jax.engine.config import EngineConfig
from av_jax.engine.protocols import Target
from av_jax.estimator import EstimatorState
from av_jax.features import FEATURES, logit_qmax
from av_jax.models.config import ModelsConfig
from av_jax.models.drafters import Drafter
from av_jax.models.sampling import sample_tokens, sampling_probs
from av_jax.planner import PlannerConfig, PlannerState
from av_jax.rejection import RejectionResult, rejection_sample
from av_jax.sampling import sampling_log_probs
from av_jax.selection import CostModel, linear_cost_model

# Features recorded per draft token when `Programs.record_features` is on (studies):
# every registered feature, lossless and lossy, in this order along StepInfo.extra's last axis.
RECORDED_FEATURES = tuple(FEATURES)


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


def make_engine(config: EngineConfig, models: ModelsConfig | None = None,
                drafter: Drafter | None = None, *, target: Target | None = None) -> Engine:
  """Binds an engine config to a target and a drafter; picks the exact policy.

  Either av_jax's model set (`make_engine(config, models, drafter)`) or a target of the
  user's own (`make_engine(config, target=target, drafter=drafter)`, see
  `av_jax.engine.protocols` and docs/integration.md).

  Args:
    config: static settings.
    models: av_jax's model set config; its transformer becomes the target
      (`protocols.transformer_target`).
    drafter: the drafter's functions and kind (`av_jax.models.make_drafter`, or the
      user's own `Drafter`); steps draft for a subset of the rows where it can skip
      rows (`Drafter.skips_rows`, the `av` arm).
    target: a `protocols.Target`, instead of `models`.

  Raises:
    ValueError: neither or both of `models` and `target`, no drafter, a drafter whose
      fields do not fit together (`Drafter.check`), `av_head` with a drafter that has no
      confidence head, or a lossy policy requested explicitly for a drafter where it is
      not exact.

  Example:
    >>> engine = make_engine(EngineConfig(num_slots=4), target=my_target, drafter=my_drafter)
  """
  if (models is None) == (target is None):
    raise ValueError("make_engine: expected exactly one of `models` (av_jax's model set) "
                     "and `target` (a protocols.Target)")
  if drafter is None:
    raise ValueError("make_engine: expected a drafter")
  drafter.check()
  if target is None:
    target = protocols.transformer_target(models)
  if (target.verify_read is None) != (target.write is None):
    raise ValueError("target: expected both or neither of `verify_read` and `write`, got "
                     f"verify_read={target.verify_read!r}, write={target.write!r}")
  arm = get_arm(config.mode)
  if arm.head and drafter.kind != "block_head":
    raise ValueError(f"mode: 'av_head' needs a drafter with a confidence head, got "
                     f"{drafter.kind!r}")
  policy = policy_for(ARMS["av"], drafting=drafter.drafting, greedy=config.sampling.greedy,
                     requested=config.policy)
  if arm.name == "av":
    decider = make_policy_decider(config.max_draft, drafter_kind=drafter.drafting,
                                  greedy=config.sampling.greedy, gated=drafter.skips_rows,
                                  estimator=config.estimator)
  else:
    stop = {"confidence": "confidence"}.get(arm.stop, "none")
    planner = PlannerConfig(draft_stop=stop, **(
        {} if arm.threshold is None else {"confidence_threshold": arm.threshold}))
    decider = make_decider(
        config.max_draft, head=arm.head, estimator=config.estimator, planner=planner,
        policy=policy_for(arm, drafting=drafter.drafting, greedy=config.sampling.greedy,
                          requested=policy))
  return Engine(config=config, models=models, target=target, drafter=drafter, policy=policy,
                arm=arm, decider=decider)


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


def prefill(engine: Engine, params: Params, state: DecodeState, *, prompt: jax.Array,
            prompt_len: jax.Array, slot: jax.Array, max_new: jax.Array) -> DecodeState:
  """Starts a request in `slot`: prefill its prompt and draw its first output token.

  Args:
    engine: the engine.
    params: model parameters.
    state: the decode state; other slots are untouched.
    prompt: `[P]` int32 prompt padded to a static bucket length P.
    prompt_len: int32 scalar, real prompt length (1 <= prompt_len <= P).
    slot: int32 scalar slot index.
    max_new: int32 scalar, output-token limit (the first token counts).

  Returns:
    The state with the slot active (inactive again at once if max_new <= 1 or the first
    token is EOS).
  """
  cfg, target = engine.config, engine.target
  P = prompt.shape[0]
  valid = jnp.arange(P)[None] < prompt_len
  logits, hidden, cache = protocols.prefill_with_verify(
      target, params.target, target.init_cache(1, cfg.max_len), tokens=prompt, valid=valid[0])
  key, k_first = jax.random.split(state.key)
  last_logits = logits[prompt_len - 1]
  first = sample_tokens(k_first, last_logits, temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p)
  dstate = engine.drafter.start(
      params.drafter, params.target, prompt=prompt[None], prompt_hidden=hidden[None],
      next_token=first[None], K=cfg.max_draft, max_len=cfg.max_len,
      prompt_lens=prompt_len[None], width=engine.pending_width)
  row = jnp.zeros((cfg.max_len,), jnp.int32).at[:P].set(jnp.where(valid[0], prompt, 0))
  row = row.at[prompt_len].set(first)
  done = (max_new <= 1) | (first == cfg.eos_id)
  return state._replace(
      planner=engine.decider.admit(state.planner, slot),
      target_cache=protocols.insert_slot(target, state.target_cache, cache, slot),
      drafter=engine.drafter.insert_row(state.drafter, dstate, slot),
      tokens=state.tokens.at[slot].set(row),
      length=state.length.at[slot].set(prompt_len + 1),
      prompt_len=state.prompt_len.at[slot].set(prompt_len),
      max_new=state.max_new.at[slot].set(max_new),
      active=state.active.at[slot].set(~done),
      key=key)


def group_cache(engine: Engine, cache: Any) -> Any:
  """B -> (G, B/G) at the target cache's slot axis (av_jax's: `[L, B, H, M, Dh]` ->
  `[L, G, B/G, H, M, Dh]`): contiguous slot groups, a free reshape; with slots sharded in
  blocks over 'data', the group axis takes the slot sharding."""
  return protocols.group_cache(engine.target, cache, engine.config.groups)


def verify_forward(engine: Engine, target_params, cache: Any, *,
                   tokens: jax.Array, slot: jax.Array, positions: jax.Array,
                   valid: jax.Array, read: bool = False, width: int | None = None):
  """The verify program of one bucket: each group's packed forward and sampling probs.

  Each group runs `engine.target.verify` (`av_jax.engine.protocols.Target`) on its T_g
  packed tokens.

  Args:
    engine: the engine (temperature, top-p, target).
    target_params: target parameters.
    cache: target cache grouped at its slot axis (`group_cache`; av_jax's:
      `[L, G, B/G, H, M, Dh]`).
    tokens: `[G, T_g]` int32 packed tokens of each group.
    slot: `[G, T_g]` int32 slot of each token within its group (0 .. B/G - 1).
    positions: `[G, T_g]` int32 position of each token.
    valid: `[G, T_g]` bool, False for padding.

    read: run `target.verify_read` (the cache only read) instead of `verify`.
    width: the most valid tokens of one slot (default K + 1), passed on as `slot_width`
      to a `verify_read` that takes it (`Target.verify_read_width`), capped at T_g.

  Returns:
    `(probs [G, T_g, V], hidden [G, T_g, D], cache)`: the target's sampling distribution
    (temperature, top-p) and `hidden` of every packed token, and the grouped cache with
    the valid tokens written; with `read`, the tokens' `writes` (G at axis 0 of every
    leaf) in place of the cache.
  """
  cfg, target = engine.config, engine.target
  a = target.slot_axis  # of B; the group axis G takes its place in the grouped cache
  run = target.verify_read if read else target.verify
  out_a = 0 if read else a

  extra = {}
  if read and target.verify_read_width:
    extra = dict(slot_width=min(cfg.max_draft + 1 if width is None else width,
                                tokens.shape[-1]))

  def one(cache, tokens, slot, positions, valid):
    logits, hidden, cache = run(target_params, cache, tokens=tokens, slot=slot,
                                positions=positions, valid=valid, **extra)
    probs = sampling_probs(logits, temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p)
    return probs, hidden, cache

  if tokens.shape[0] == 1:  # one group: the plain packed program, no batch axis
    squeeze = lambda x: x[0]
    first = lambda x: jax.lax.index_in_dim(x, 0, a, keepdims=False)
    probs, hidden, new = one(jax.tree.map(first, cache),
                             *map(squeeze, (tokens, slot, positions, valid)))
    return probs[None], hidden[None], jax.tree.map(lambda x: jnp.expand_dims(x, out_a), new)
  return jax.vmap(one, in_axes=(a, 0, 0, 0, 0), out_axes=(0, 0, out_a))(
      cache, tokens, slot, positions, valid)


def _verify_packed(engine: Engine, target_params, cache, *, tokens, positions, valid,
                   finish=None, plain=None):
  """Runs the target on the valid entries of `[B, K+1]`, packed per verify group.

  The B slots form G = `verify_groups` contiguous groups of B/G. Each group packs its
  valid tokens into its own buffer; all groups use the smallest per-group bucket T_g that
  holds the fullest group, so the target runs on `[G, T_g]` tokens (`lax.switch` over one
  program per bucket) and each token attends to its slot's cache within its group. With
  the slots sharded in blocks over 'data' and G a multiple of its size, every group lives
  on one shard and verification needs no cross-shard traffic beyond the bucket choice (a
  scalar maximum). The target's sampling distribution (temperature, top-p) is computed
  on the packed rows, so its cost follows the bucket like the forward pass does.

  `finish` (optional): `probs [B, K+1, V] -> RejectionResult`, run inside each bucket's
  branch, so that no `[B, K+1, V]` tensor leaves the switch (forming and passing it is a
  `[B, K+1, V]` copy a step that drafts nothing does not need). `plain`
  (optional, with `finish`): `(use [] bool, probs [B, V] -> RejectionResult)`; where `use`
  holds the step runs the plain target pass on the base tokens `tokens[:, 0]` of the
  slots with `valid[:, 0]` (`_plain_pass`, the program of a target-only step) instead of
  any bucket, and writes nothing else.

  Returns dense `[B, K+1, V]` target sampling probabilities (`finish`'s or `plain`'s
  result instead, when given) and `[B, K+1, D]` hidden states (junk where not valid),
  the updated cache, and the bucket index (0 for the plain pass).
  """
  G = engine.config.groups
  B, K1 = tokens.shape
  base = (tokens[:, 0], positions[:, 0], valid[:, 0])
  sizes = engine.config.group_bucket_sizes()
  grouped = lambda x: x.reshape((G, B // G) + x.shape[1:])
  tokens, positions, valid = grouped(tokens), grouped(positions), grouped(valid)
  per_slot = jnp.sum(valid, axis=2)                                # [G, B/G]
  offsets = jnp.cumsum(per_slot, axis=1) - per_slot                # [G, B/G]
  index = offsets[..., None] + jnp.arange(K1)                      # [G, B/G, K+1]
  fullest = jnp.max(jnp.sum(per_slot, axis=1))
  bucket = jnp.minimum(jnp.searchsorted(jnp.asarray(sizes), fullest, side="left"),
                       len(sizes) - 1).astype(jnp.int32)
  slot_ids = jnp.broadcast_to(jnp.arange(B // G)[:, None], index.shape[1:])  # local slots
  flat_rows = lambda x: x.reshape(G, -1)

  target = engine.target
  read = target.verify_read is not None
  w = target.write_axis

  def branch(size):
    def run(cache):
      flat = flat_rows(jnp.where(valid, index, size))  # invalid -> out of range, dropped
      def pack(x, fill):  # [G, B/G, K+1] -> [G, T_g], one scatter per group
        row = lambda f, x: jnp.full((size,), fill, x.dtype).at[f].set(x, mode="drop")
        return jax.vmap(row)(flat, flat_rows(jnp.broadcast_to(x, index.shape)))
      probs, hidden, out = verify_forward(
          engine, target_params, group_cache(engine, cache), tokens=pack(tokens, 0),
          slot=pack(slot_ids, 0), positions=pack(positions, 0), valid=pack(valid, False),
          read=read)
      gather = flat_rows(jnp.clip(index, 0, size - 1))
      unpack = lambda x: jax.vmap(lambda row, i: row[i])(x, gather).reshape(
          (B, K1) + x.shape[2:])
      probs = unpack(probs) if finish is None else finish(unpack(probs))
      if not read:
        return probs, unpack(hidden), protocols.ungroup_cache(target, out)
      # [G, ..T_g at 1 + w..] -> [..B (K+1) at w..]: every bucket's writes in one shape
      entries = lambda x: jnp.moveaxis(
          unpack(jnp.moveaxis(x, 1 + w, 1)).reshape((B * K1,) + x.shape[1:1 + w]
                                                    + x.shape[2 + w:]), 0, w)
      return probs, unpack(hidden), jax.tree.map(entries, out)
    return run

  def plain_pass(cache):
    # The base tokens unpacked (a target-only step's program); their entries go to
    # column 0 of the [B, K+1] layout the buckets' writes have.
    probs, hidden, out = _plain_pass(engine, target_params, cache, base=base[0],
                                     position=base[1], active=base[2])
    column0 = lambda x: jnp.zeros((B, K1) + x.shape[1:], x.dtype).at[:, 0].set(x)
    if read:
      out = jax.tree.map(lambda x: jnp.moveaxis(
          column0(jnp.moveaxis(x, w, 0)).reshape((B * K1,) + x.shape[:w] + x.shape[w + 1:]),
          0, w), out)
    return plain[1](probs), column0(hidden), out

  # The switch reads the cache as stored (grouped inside each branch). A cache written
  # inside the branches comes back from the switch as a new buffer, which XLA copies whole
  # into the decode loop's state on every step of an engine that also switches on
  # drafting (subset drafting); with `verify_read` the branches return the tokens'
  # entries and the cache is written here, in place.
  branches = [branch(s) for s in sizes]
  if plain is not None:
    if finish is None:
      raise ValueError("plain: expected a `finish` too (the buckets' sampling)")
    use = plain[0]
    probs, hidden, out = jax.lax.switch(jnp.where(use, 0, 1 + bucket),
                                        [plain_pass] + branches, cache)
    bucket = jnp.where(use, 0, bucket).astype(jnp.int32)
    valid = valid & ((jnp.arange(K1) == 0) | ~use)  # the plain pass wrote column 0 only
  elif read and len(branches) == 1:
    # One bucket (fixed K): a conditional on "anything to verify", whose other branch runs
    # nothing, keeps the pass in a branch (see `_target_step`: at the loop body's top
    # level XLA copied the cache on every step).
    probs, hidden, out = jax.lax.cond(jnp.any(valid), branches[0], _idle(branches[0]), cache)
  else:
    probs, hidden, out = jax.lax.switch(bucket, branches, cache)
  if read:
    rows = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, K1))
    ungrouped = lambda x: x.reshape(B * K1)
    out = target.write(cache, out, slot=ungrouped(rows), positions=ungrouped(positions),
                       valid=ungrouped(valid))
  return probs, hidden, out, bucket


class Drafts(NamedTuple):
  """A step's drafts and their scores (placeholders when the step does not draft)."""
  tokens: jax.Array     # [B, K] int32
  probs: jax.Array      # [B, K, V] float32, q the drafts were drawn from
  features: jax.Array   # [B, K] float32, logit_qmax
  conf: jax.Array       # [B, K] float32, confidence-head probability (0 if none)
  finite: jax.Array     # [B] bool, draft logits finite at every drafted position
  extra: jax.Array      # [B, K, F] float32, recorded features
  state: Any            # drafter state to commit (None inside a gated step's switch)
  # [B, K] bool, positions that may be verified: drafted, and every position up to and
  # including it finite (the fallback decides position i from positions <= i only)
  usable: jax.Array
  depth: jax.Array      # [B] int32, depths drafted (K unless a drafting stop ended it)
  passes: jax.Array     # [] int32, drafter passes run
  top1: jax.Array       # [B, K] float32, top-1 draft probability (confidence stop; else 0)


def _no_draft(engine: Engine, drafter_state: Any) -> Drafts:
  """Placeholder drafts of a step that drafts nothing, with `drafter_state` to commit."""
  cfg = engine.config
  B, K, V = cfg.num_slots, cfg.max_draft, engine.target.vocab_size
  F = len(RECORDED_FEATURES) if cfg.programs.record_features else 0
  return Drafts(tokens=jnp.zeros((B, K), jnp.int32), probs=jnp.zeros((B, K, V), jnp.float32),
                  features=jnp.zeros((B, K), jnp.float32), conf=jnp.zeros((B, K), jnp.float32),
                  finite=jnp.ones((B,), bool), extra=jnp.zeros((B, K, F), jnp.float32),
                  state=drafter_state, usable=jnp.ones((B, K), bool),
                  depth=jnp.zeros((B,), jnp.int32), passes=jnp.zeros((), jnp.int32),
                  top1=jnp.zeros((B, K), jnp.float32))


def _sound(logits: jax.Array, log_probs: jax.Array | None) -> jax.Array:
  """`[...]` bool: a draft distribution `[..., V]` is sound. A fault is a NaN or +inf
  logit, or a position with every token banned; -inf entries alone are banned tokens, a
  valid distribution. A drafter's own sampling distribution is checked too."""
  sound = (~jnp.any(jnp.isnan(logits) | (logits == jnp.inf), axis=-1)
           & jnp.any(logits > -jnp.inf, axis=-1))
  if log_probs is not None:
    sound &= ~jnp.any(jnp.isnan(log_probs), axis=-1)
  return sound


def _stepwise(engine: Engine) -> bool:
  """The drafting loop evaluates a drafting stop between depths (autoregressive
  drafters that support it, under an arm with a stop)."""
  return (engine.decider.stop != "none" and engine.drafter.stepwise
          and engine.drafter.drafting == "autoregressive")


def _keep_fn(engine: Engine, active: jax.Array, decision: DecisionState,
             slots: jax.Array | None = None):
  """The drafting stop evaluated after each depth j: scores S[b, 1..j] from the features
  of depths <= j (`decider.score`), then the planner's rule (`decider.keep_drafting`).
  A slot whose depth-j distribution is not sound stops (its later depths could not be
  verified). `active [E]` are the drafting rows, `slots [E]` their slots (None: all B
  in order). Returns `(keep_fn, aux0)` for `Drafter.draft`."""
  cfg, decider = engine.config, engine.decider
  B, K, V = active.shape[0], cfg.max_draft, engine.target.vocab_size
  uniform = -jnp.log(jnp.float32(V))

  def keep_fn(depth, logits, log_probs, aux):
    features, sound, top1 = aux
    ok = _sound(logits, log_probs)                                          # [B]
    if log_probs is None:
      log_probs = sampling_log_probs(jnp.where(ok[:, None], logits, 0.0),
                                     temperature=cfg.sampling.temperature,
                                     top_p=cfg.sampling.top_p)
    else:
      log_probs = jnp.where(ok[:, None], log_probs, uniform)
    column = depth - 1
    put = lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, column, axis=1)
    features = put(features, logit_qmax(log_probs[:, None, :])[:, 0])
    sound = put(sound, ok)
    top1 = put(top1, jnp.exp(jnp.max(log_probs, axis=-1)))
    drafted = (jnp.arange(K)[None] < depth) & (jnp.cumprod(sound, axis=1) > 0)
    probs = decider.score(decision, features)
    keep = decider.keep_drafting(decision, probs, drafted, depth, active=active, top1=top1,
                                 slots=slots)
    return keep & ok, (features, sound, top1)

  aux0 = (jnp.zeros((B, K), jnp.float32), jnp.zeros((B, K), bool),
          jnp.zeros((B, K), jnp.float32))
  return keep_fn, aux0


def _draft_kwargs(engine: Engine, decision: DecisionState, *, active: jax.Array,
                  slots: jax.Array | None = None) -> dict:
  """The keyword arguments of `Drafter.draft` for E rows (`active [E]` the ones that
  draft, `slots [E]` their slot ids, None: all B in order): K, temperature, top-p, and
  the drafting stop (`keep_fn`, `keep_init`) where the loop evaluates one."""
  cfg = engine.config
  kwargs = dict(K=cfg.max_draft, temperature=cfg.sampling.temperature,
                top_p=cfg.sampling.top_p)
  if _stepwise(engine):
    keep_fn, aux0 = _keep_fn(engine, active, decision, slots)
    kwargs.update(keep_fn=keep_fn, keep_init=aux0)
  return kwargs


def _draft(engine: Engine, params: Params, drafter_state: Any, key: jax.Array,
           decision: DecisionState, *, active: jax.Array,
           slots: jax.Array | None = None) -> Drafts:
  """Drafts for every row of `drafter_state` (`Drafter.draft`; `active`, `slots` as in
  `_draft_kwargs`) and scores the drafts (`_scored`)."""
  return _scored(engine, engine.drafter.draft(
      params.drafter, params.target, drafter_state, key,
      **_draft_kwargs(engine, decision, active=active, slots=slots)))


def _scored(engine: Engine, draft) -> Drafts:
  """The drafts of a `DraftOutput` of E rows and their scores; every output has E rows."""
  cfg = engine.config
  B, K = draft.tokens.shape[0], cfg.max_draft
  logits = draft.logits
  full = engine.drafter.drafting == "autoregressive"
  depth = jnp.full((B,), K, jnp.int32) if draft.depth is None else draft.depth
  passes = jnp.int32(K if full else 1) if draft.passes is None else draft.passes
  drafted = jnp.arange(K)[None] < depth[:, None]                          # [B, K]
  sound = _sound(logits, draft.log_probs) | ~drafted                      # [B, K]
  finite = jnp.all(sound, axis=1)
  # Fallback per position: position i may be verified only if positions 1..i are sound,
  # which reads nothing deeper than i (with an autoregressive drafter positions > i
  # depend on the draw at i, so a whole-slot check would make verifying i depend on that
  # draw). Unusable positions get placeholder distributions.
  ok = jnp.cumprod(sound, axis=1) > 0                                     # [B, K]
  usable = ok & drafted
  draft_logits = jnp.where(ok[..., None], logits, 0.0)
  # One top-p pass serves the draw, the feature (filtered entries are -inf, so logit_qmax
  # of the log-probs is the feature of the sampled distribution) and q for verification:
  # the drafter's own when it returns it.
  if draft.log_probs is not None:
    uniform = -jnp.log(jnp.float32(draft_logits.shape[-1]))  # unverified positions only
    log_probs = jnp.where(usable[..., None], draft.log_probs, uniform)
  else:
    log_probs = sampling_log_probs(draft_logits, temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p)
  if cfg.sampling.greedy:  # greedy drafting: q is the point mass on the arg-max
    probs = jax.nn.one_hot(jnp.argmax(draft_logits, -1), draft_logits.shape[-1])
  else:
    probs = jnp.exp(log_probs)
  conf = (jax.nn.sigmoid(draft.conf_logits) if draft.conf_logits is not None
          else jnp.zeros((B, K), jnp.float32))
  if cfg.programs.record_features:  # measured only, never used to prune (the lossy ones read tokens)
    extra = jnp.stack([FEATURES[name](log_probs, tokens=draft.tokens)
                       for name in RECORDED_FEATURES], axis=-1)
  else:
    extra = jnp.zeros((B, K, 0), jnp.float32)
  top1 = (jnp.exp(jnp.max(log_probs, axis=-1)) if engine.decider.stop == "confidence"
          else jnp.zeros((B, K), jnp.float32))
  if draft.keep_aux is not None and draft.log_probs is not None:
    # The stop computed each drafted depth's feature from the log-probs these are at a
    # usable position (`_keep_fn`); other positions hold the uniform row's feature, as
    # `logit_qmax(log_probs)` would give. Not recomputed over `[B, K, V]`.
    features = jnp.where(usable, draft.keep_aux[0],
                         logit_qmax(jnp.full((1, 1, log_probs.shape[-1]), uniform))[0, 0])
  else:
    features = logit_qmax(log_probs)
  return Drafts(tokens=draft.tokens, probs=probs, features=features, conf=conf,
                finite=finite, extra=extra, state=draft.state, usable=usable, depth=depth,
                passes=passes, top1=top1)


def _idle(run):
  """A branch with `run`'s output shapes that computes nothing (zeros)."""
  def idle(cache):
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(run, cache))
  return idle


def _plain_pass(engine: Engine, target_params, cache, *, base, position, active):
  """The target pass of a step with no drafts: each verify group runs its B/G base
  tokens through the target (the smallest bucket, no packing).

  Returns `(probs [B, V], hidden [B, D], out)`: the target's sampling distribution and
  hidden state at each slot's base token, and with `verify_read` the tokens' entries
  (token axis B at `write_axis`) for `target.write`, else the written cache (ungrouped).
  """
  cfg, target = engine.config, engine.target
  B, G = cfg.num_slots, cfg.groups
  grouped = lambda x: x.reshape(G, B // G)
  # With `verify_read` the pass reads the cache and the caller writes it after, as a
  # gated step does (`_verify_packed`), so target-only decoding runs the same attention
  # program.
  read = target.verify_read is not None
  run = lambda cache: verify_forward(
      engine, target_params, group_cache(engine, cache), tokens=grouped(base),
      slot=grouped(jnp.tile(jnp.arange(B // G, dtype=jnp.int32), G)),
      positions=grouped(position), valid=grouped(active), read=read, width=1)
  if not read:
    probs, hidden, out = run(cache)
    return probs.reshape(B, -1), hidden.reshape(B, -1), protocols.ungroup_cache(target, out)
  # A batch with no active slot runs no target pass (the drain's last steps). The
  # conditional also keeps XLA from copying the whole cache on every step: a read-only
  # pass followed by its write at the top level of the decode loop's body was compiled
  # with two copies of the cache per step, the same pass inside a branch with none
  # (`tests/test_engine_inplace.py` checks the compiled chunk).
  probs, hidden, out = jax.lax.cond(jnp.any(active), run, _idle(run), cache)
  w = target.write_axis  # [G, ..B/G at 1 + w..] -> [..B at w..]
  merge = lambda x: jnp.moveaxis(jnp.moveaxis(x, 1 + w, 1).reshape((B,) + x.shape[1:1 + w]
                                                                     + x.shape[2 + w:]), 0, w)
  return probs.reshape(B, -1), hidden.reshape(B, -1), jax.tree.map(merge, out)


def _target_step(engine: Engine, target_params, cache, key, *, base, position, active):
  """Verification of a step with no drafts: one target token per slot, sampled.

  The same law as `rejection_sample` with nothing verified (a draw from the target's
  sampling distribution), at the cost of a target-only step (`_plain_pass`): it samples
  on `[B, V]`; no `[B, K+1, V]` tensor is formed.

  Returns `(RejectionResult, hidden [B, K+1, D], cache, bucket index 0)`.
  """
  cfg, target = engine.config, engine.target
  B, K = cfg.num_slots, cfg.max_draft
  probs, hidden, out = _plain_pass(engine, target_params, cache, base=base,
                                   position=position, active=active)
  if target.verify_read is not None:
    out = target.write(cache, out, slot=jnp.arange(B, dtype=jnp.int32), positions=position,
                       valid=active)
  # probs is the sampling distribution (one-hot when greedy): a categorical draw from its
  # log is the target's token either way.
  full = jnp.zeros((B, K + 1) + hidden.shape[1:], hidden.dtype).at[:, 0].set(hidden)
  return _plain_result(key, probs, K), full, out, jnp.zeros((), jnp.int32)


def _plain_result(key: jax.Array, probs: jax.Array, K: int) -> RejectionResult:
  """A step that verified nothing: one token per slot drawn from the target's sampling
  distribution `probs [B, V]` (one-hot when greedy: a categorical draw from its log is
  the target's token either way), the law of `rejection_sample` with nothing verified."""
  B = probs.shape[0]
  token = jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)
  zeros = jnp.zeros((B, K), bool)
  return RejectionResult(
      tokens=jnp.full((B, K + 1), -1, jnp.int32).at[:, 0].set(token),
      num_emitted=jnp.ones((B,), jnp.int32), num_accepted=jnp.zeros((B,), jnp.int32),
      accepted=zeros, labeled=zeros)


class _Verdict(NamedTuple):
  """What verification decided: the rejection sampler's result and the target's pass."""
  result: RejectionResult          # emitted tokens, accepted / labelled drafts
  target_hidden: jax.Array         # [B, K+1, D] target hidden states of the fed tokens
  target_cache: Any                # the target cache with the fed tokens written
  bucket: jax.Array                # [] int32, index of the packed bucket that ran
  # [B, K] float32, min(1, p/q) of every draft (recording engines only; else None)
  accept_probs: jax.Array | None = None


class _Stops(NamedTuple):
  """The emitted tokens that survive the stops, written into the sequence buffer."""
  num_kept: jax.Array  # [B] int32, tokens appended to each slot
  done: jax.Array      # [B] bool, the slot's request finished this step
  tokens: jax.Array    # [B, M] int32, the sequence buffer with them written


def _draft_phase(engine: Engine, params: Params, state: DecodeState, key: jax.Array,
                 decision: DecisionState) -> Drafts:
  """An ungated step's drafts for all B slots (placeholders for the target-only arm).
  Under a drafting stop the loop over depths ends per request and for the batch
  (`_keep_fn`)."""
  if not engine.arm.drafts:
    return _no_draft(engine, state.drafter)
  return _draft(engine, params, state.drafter, key, decision, active=state.active)


def _scatter_drafts(engine: Engine, sub: Drafts, idx: jax.Array, keep: jax.Array, *,
                    whole: bool) -> Drafts:
  """The drafts of E bucket rows (`idx [E]` their slots, `keep [E]` the rows that
  drafted) as `[B, ...]` drafts: slots that did not draft get placeholders and no usable
  position. `whole`: the rows are all B slots in order. The drafter state is not among
  them (`state` None): the bucket's `Drafter.draft_rows` update carries it."""
  cfg = engine.config
  base = _no_draft(engine, None)._replace(
      usable=jnp.zeros((cfg.num_slots, cfg.max_draft), bool))

  def put(b, x):
    k = keep.reshape(keep.shape + (1,) * (x.ndim - 1))
    if whole:
      return jnp.where(k, x, b)
    return b.at[idx].set(jnp.where(k, x, b[idx]))

  fields = {name: put(getattr(base, name), getattr(sub, name))
            for name in ("tokens", "probs", "features", "conf", "finite", "extra", "usable",
                         "depth", "top1")}
  return Drafts(**fields, state=None, passes=sub.passes)


def _verify_phase(engine: Engine, params: Params, state: DecodeState, drafts: Drafts,
                  num_verified: jax.Array, key: jax.Array, *, packed) -> _Verdict:
  """The base token and the verified drafts, packed, in one target pass; then rejection
  sampling. `packed` False: a step that drafted nothing in a program that never drafts,
  a plain target step (no `[B, K+1, V]`). `packed` a traced `[]` bool (a gated step):
  where it is False the verify switch runs the plain pass of a target-only step and the
  target's own draw (`_plain_result`: the law and the draw of a plain step), else a
  packed bucket and rejection sampling inside its branch. The target cache is written
  after the switch (`verify_read`): a cache returned by a conditional inside the decode
  loop is copied whole on every step (XLA's copy insertion), and a step without drafts
  that ran the smallest packed bucket would form `[B, K+1, V]` target probabilities it
  does not need."""
  B, K = engine.config.num_slots, engine.config.max_draft
  base = state.tokens[jnp.arange(B), state.length - 1]
  if packed is False:
    return _Verdict(*_target_step(engine, params.target, state.target_cache, key, base=base,
                                  position=state.length - 1, active=state.active))
  tokens = jnp.concatenate([base[:, None], drafts.tokens], axis=1)        # [B, K+1]
  j = jnp.arange(K + 1)[None, :]
  positions = state.length[:, None] - 1 + j
  valid = state.active[:, None] & (j <= num_verified[:, None])
  reject = lambda target_probs: rejection_sample(
      key, draft_probs=drafts.probs, draft_tokens=drafts.tokens, target_probs=target_probs,
      num_verified=num_verified)
  record = engine.config.programs.record_features
  if record:
    reject = lambda target_probs, reject=reject: (
        reject(target_probs), _accept_probs(drafts, target_probs))
  plain_result = lambda probs: _plain_result(key, probs, K)
  if record:
    plain_result = lambda probs, plain_result=plain_result: (
        plain_result(probs), jnp.zeros((B, K), jnp.float32))
  plain = None if packed is True else (~packed, plain_result)
  finished, hidden, cache, bucket = _verify_packed(
      engine, params.target, state.target_cache, tokens=tokens, positions=positions,
      valid=valid, finish=reject, plain=plain)
  if record:
    return _Verdict(finished[0], hidden, cache, bucket, accept_probs=finished[1])
  return _Verdict(finished, hidden, cache, bucket)


def _accept_probs(drafts: Drafts, target_probs: jax.Array) -> jax.Array:
  """`[B, K]`: min(1, p(x) / q(x)) of every draft token, its acceptance probability given
  the draft prefix before it (`target_probs [B, K+1, V]` conditioned on that prefix)."""
  K = drafts.tokens.shape[1]
  token = jnp.clip(drafts.tokens, 0, drafts.probs.shape[-1] - 1)[..., None]
  q_x = jnp.take_along_axis(drafts.probs, token, axis=-1)[..., 0]
  p_x = jnp.take_along_axis(target_probs[:, :K], token, axis=-1)[..., 0]
  return jnp.where(q_x > 0, jnp.minimum(1.0, p_x / jnp.maximum(q_x, 1e-30)), 0.0)


def _apply_stops(cfg: EngineConfig, state: DecodeState, result: RejectionResult) -> _Stops:
  """Keeps the emitted tokens up to EOS, the request's output limit and the cache."""
  B, K = cfg.num_slots, cfg.max_draft
  j = jnp.arange(K + 1)[None, :]
  emitted = result.tokens                                                   # [B, K+1]
  is_eos = (emitted == cfg.eos_id) & (j < result.num_emitted[:, None])
  first_eos = jnp.min(jnp.where(is_eos, j, K + 1), axis=1)
  generated = state.length - state.prompt_len
  # The next step feeds positions up to length - 1 + K, which must stay below M.
  room = jnp.minimum(state.max_new - generated, cfg.max_len - K - state.length)
  n = jnp.minimum(jnp.minimum(result.num_emitted, first_eos + 1), jnp.maximum(room, 0))
  n = jnp.where(state.active, n, 0)
  done = state.active & ((first_eos < n) | (n >= room))
  write = jnp.where(j < n[:, None], state.length[:, None] + j, cfg.max_len)
  tokens = state.tokens.at[jnp.arange(B)[:, None], write].set(jnp.maximum(emitted, 0),
                                                              mode="drop")
  return _Stops(num_kept=n, done=done, tokens=tokens)


def _commit_phase(engine: Engine, state: DecodeState, drafts: Drafts,
                  verdict: _Verdict) -> Any:
  """The emitted tokens and the target's hidden states become the drafter's pending
  block; inactive slots keep theirs. A target-only arm never runs the drafter."""
  if not engine.arm.drafts:
    return state.drafter
  drafter = engine.drafter
  committed = drafter.commit_rows(drafts.state, emitted_tokens=verdict.result.tokens,
                                  num_emitted=verdict.result.num_emitted,
                                  target_hidden=verdict.target_hidden)
  return drafter.keep_rows(committed, state.drafter, state.active)


def _gated_commit_phase(engine: Engine, params: Params, state: DecodeState, drafts: Drafts,
                        verdict: _Verdict, slots: jax.Array) -> Any:
  """A gated step's drafter state: the drafting `slots` commit as usual; the other active
  slots emitted one target token without drafting and catch up (`Drafter.catch_up_rows`:
  av_jax's drafters append the token and the base token's target hidden state to the
  pending block); inactive slots keep theirs."""
  drafter, active = engine.drafter, state.active
  caught = drafter.catch_up_rows(params.drafter, params.target, drafts.state,
                                 token=verdict.result.tokens[:, 0],
                                 hidden=verdict.target_hidden[:, 0], mask=active & ~slots,
                                 K=engine.config.max_draft)
  committed = drafter.commit_rows(drafts.state, emitted_tokens=verdict.result.tokens,
                                  num_emitted=verdict.result.num_emitted,
                                  target_hidden=verdict.target_hidden)
  # The rows that did not draft take the catch-up, the others the commit (a DrafterState's
  # cache is the catch-up's, whole: `Drafter.keep_rows`).
  merged = drafter.keep_rows(caught, committed, ~slots)
  return drafter.keep_rows(merged, state.drafter, active)


def _count(engine: Engine, stats: EngineStats, *, state: DecodeState, drafts: Drafts,
           verdict: _Verdict, stops: _Stops, verified: jax.Array, labeled: jax.Array,
           slots: jax.Array) -> EngineStats:
  """The running totals after this step (`slots [B]`: the slots that drafted)."""
  K = engine.config.max_draft
  accepted = verdict.result.accepted
  return EngineStats(
      steps=stats.steps + 1,
      emitted=stats.emitted + jnp.sum(stops.num_kept),
      verified=stats.verified + jnp.sum(verified),
      draft_tokens=stats.draft_tokens + (
          jnp.sum(jnp.where(slots, drafts.depth, 0)) if _stepwise(engine)
          else K * jnp.sum(slots, dtype=jnp.int32)),
      accepted_at=stats.accepted_at + jnp.sum(accepted & labeled, 0, dtype=jnp.int32),
      labeled_at=stats.labeled_at + jnp.sum(labeled, 0, dtype=jnp.int32),
      bucket_hist=stats.bucket_hist.at[verdict.bucket].add(1),
      nonfinite=stats.nonfinite + jnp.sum(slots & ~drafts.finite))


def _decide_and_verify(engine: Engine, params: Params, state: DecodeState,
                       decision: DecisionState, drafts: Drafts, *, key: jax.Array,
                       k_verify: jax.Array, slots: jax.Array, drafting: jax.Array,
                       plan_drafting: jax.Array, rows: jax.Array, packed,
                       commit) -> tuple[DecodeState, StepInfo]:
  """The phases after drafting: decide -> verify -> stops -> `commit(drafts, verdict)`
  to the drafter -> learn and count. `slots [B]`: the slots that drafted; `drafting []`:
  the step drafted; `plan_drafting`: what `decider.plan` takes as `drafting`; `rows []`:
  the drafter rows that ran (StepInfo.draft_rows); `packed`: verify through the packed
  buckets (False: a target-only step; a traced bool: chosen per step)."""
  decider, active = engine.decider, state.active
  # Decide over the usable positions: drafted, and finite up to and including them (a
  # slot whose first draft is not finite, or that did not draft, verifies nothing).
  probs = decider.score(decision, drafts.features, conf=drafts.conf)
  plan, decision = decider.plan(decision, probs, state.cost, active=active,
                                sound=drafts.usable[:, 0], drafting=plan_drafting,
                                drafted=drafts.usable, top1=drafts.top1)
  verdict = _verify_phase(engine, params, state, drafts, plan.num_verified, k_verify,
                          packed=packed)
  result = verdict.result
  # The oracle's hindsight accounting: only the accepted drafts were needed.
  verified = result.num_accepted if engine.arm.hindsight else plan.num_verified
  stops = _apply_stops(engine.config, state, result)
  drafter_state = commit(drafts, verdict)

  # Learn from the labels verification produced anyway, and count.
  labeled = result.labeled & active[:, None] & drafts.usable
  # A request whose target applies a transform its drafter never sees (`learn` False)
  # teaches the estimator nothing (`PolicyDecider.learn`).
  decision = decider.learn(decision, drafts.features, result.accepted, labeled,
                           **({} if state.learn is None else dict(learn=state.learn)))
  stats = _count(engine, state.stats, state=state, drafts=drafts, verdict=verdict,
                 stops=stops, verified=verified, labeled=labeled, slots=slots)
  new_state = state._replace(
      target_cache=verdict.target_cache, drafter=drafter_state, tokens=stops.tokens,
      length=state.length + stops.num_kept, active=active & ~stops.done,
      estimator=decision.estimator, planner=decision.planner, key=key, stats=stats)
  info = StepInfo(budget=plan.budget, verified=jnp.sum(verified),
                  emitted=jnp.sum(stops.num_kept), bucket=verdict.bucket,
                  active=jnp.sum(active, dtype=jnp.int32), features=drafts.features,
                  probs=probs, conf=drafts.conf, accepted=result.accepted, labeled=labeled,
                  slot_active=active, extra=drafts.extra, drafting=jnp.asarray(drafting),
                  num_verified=plan.num_verified,
                  draft_passes=jnp.where(jnp.any(slots), drafts.passes, 0).astype(jnp.int32),
                  drafted_depth=jnp.where(slots, drafts.depth, 0),
                  draft_slots=slots, draft_rows=jnp.asarray(rows, jnp.int32),
                  accept_probs=(verdict.accept_probs if verdict.accept_probs is not None
                                else jnp.zeros(drafts.features.shape, jnp.float32)))
  return new_state, info


def _prepared(engine: Engine, state: DecodeState) -> DecisionState:
  """The decision state with this step's plan (`decider.prepare`: who drafts and how
  deep, from earlier steps only)."""
  return engine.decider.prepare(state.decision, state.active, state.cost)


def _gated_step(engine: Engine, params: Params, state: DecodeState, *, key: jax.Array,
                k_draft: jax.Array, k_verify: jax.Array, quiet: bool = False,
                drafting_only: bool = False) -> tuple[DecodeState, StepInfo]:
  """A step under subset drafting: only the slots the decider's plan names draft.

  With n drafting slots, the drafting slots (then other slots as padding, whose outputs
  are discarded and whose state is not written back) are gathered into the smallest
  draft bucket E >= n (`EngineConfig.draft_bucket_sizes`, `lax.switch` over one program
  per bucket, `_draft_branches`); the top bucket E = B drafts every row in place. n = 0
  runs no drafter pass: the target runs a target-only step's plain pass on the B base
  tokens and draws each slot's token from its own distribution, and the drafter only
  catches up (for a drafter with a backlog the token joins it, absorbed when the slot
  drafts again or when the backlog is full: lazy catch-up). Slots that did not draft
  catch up (`Drafter.catch_up_rows`).

  `quiet` (static): the program of a step on which the decider lets no slot draft
  (`next_drafts` False; the caller's guarantee, `run_mode`): no drafting branches, and
  verification is a target-only step's (`_target_step`, no verify switch), with the
  values of this step's branch 0. `drafting_only` (static): the program of a step on
  which some slot drafts (`next_drafts` True, `run_mode`): only the drafting branches,
  and verification through the packed buckets alone.
  """
  cfg, decider, active, drafter = engine.config, engine.decider, state.active, engine.drafter
  B, K = cfg.num_slots, cfg.max_draft
  decision = _prepared(engine, state)
  slots = (jnp.zeros((B,), bool) if quiet
           else decider.draft_slots(decision, active))                    # [B] bool
  # Lazy catch-up: a slot whose backlog is full (`Drafter.full_rows`) absorbs it in this
  # step's draft bucket (without drafting), so the catch-up never absorbs; on a step that
  # drafts for no slot the full backlogs are absorbed by their own branch (no drafter
  # pass). None: the drafter's catch-up absorbs a full block itself.
  due = drafter.full_rows(state.drafter, K=K)
  windowed = due is not None
  full = active & ~slots & due if windowed else jnp.zeros_like(slots)
  branches, branch, sizes = _draft_branches(engine, params, state, decision, k_draft,
                                            slots=slots, full=full, quiet=quiet)
  # Only drafting differs by branch (branch 0: nothing drafted); one decide-and-verify
  # program serves them all, and the target cache never passes through this switch:
  # a cache returned by a branch of a `lax.cond` inside the decode loop was copied whole
  # on every step (XLA's copy insertion), which would make a step without drafts dearer
  # than a target-only one. Verification chooses between a plain and a packed target step in
  # its own `lax.cond` whose operand is the cache (`_verify_phase`). The branches return
  # the drafter's update (`Drafter.draft_rows`), written after the switch
  # (`Drafter.write_back`): with a `KVCache` drafter cache and a backlog, only the cache
  # entries its rows wrote, so the cache is written in place.
  if drafting_only:  # some slot drafts: neither branch 0 nor an absorb-only branch
    drafts, update = jax.lax.switch(branch - 1, branches[1:1 + len(sizes)])
  else:
    drafts, update = (branches[0]() if quiet and not windowed
                      else jax.lax.switch(branch, branches))
  drafts = drafts._replace(state=drafter.write_back(state.drafter, update, K=K))
  drafting = jnp.any(slots)
  # The draft bucket that ran for drafting slots (0: none drafted; a bucket that only
  # absorbed backlogs is not a drafting step).
  rows = (jnp.zeros((), jnp.int32) if quiet else
          jnp.where(drafting, jnp.asarray((0,) + tuple(sizes), jnp.int32)[branch], 0))
  commit = lambda drafts, verdict: _gated_commit_phase(engine, params, state, drafts,
                                                       verdict, slots)
  return _decide_and_verify(engine, params, state, decision, drafts, key=key,
                            k_verify=k_verify, slots=slots, plan_drafting=slots,
                            drafting=drafting, rows=rows,
                            packed=False if quiet else True if drafting_only else drafting,
                            commit=commit)


def _draft_branches(engine: Engine, params: Params, state: DecodeState,
                    decision: DecisionState, key: jax.Array, *, slots: jax.Array,
                    full: jax.Array, quiet: bool):
  """The gated step's drafting branches and the one this step takes: `(branches, branch,
  sizes)`. Each branch returns `(drafts, update)`: the drafts scattered to B rows (their
  `state` None) and the drafter's update of its state (`Drafter.draft_rows`). Branch 0
  drafts nothing; then one per draft bucket E in `sizes` (the drafting slots `slots [B]`
  and the full backlogs `full [B]` gathered first, in slot order, then other slots as
  padding); then, where some backlog can be full, the absorb-only branches of a step
  that drafts for no slot (the smallest bucket and B). `quiet`: no drafting branches
  (`sizes` empty)."""
  cfg, drafter = engine.config, engine.drafter
  B, K = cfg.num_slots, cfg.max_draft
  windowed = drafter.full_rows(state.drafter, K=K) is not None
  work = slots | full
  sizes = cfg.draft_bucket_sizes()
  count = jnp.sum(work, dtype=jnp.int32)
  branch = jnp.where(count == 0, 0,
                     1 + jnp.searchsorted(jnp.asarray(sizes), count, side="left"))
  order = jnp.argsort(~work, stable=True).astype(jnp.int32)
  rows_of = lambda E: (None, jnp.arange(B, dtype=jnp.int32)) if E == B else (order[:E],) * 2

  def skip():
    return _no_draft(engine, None), drafter.unchanged(state.drafter, K=K)

  def subset(E):
    def run():
      rows, idx = rows_of(E)
      keep = slots[idx]
      out, update = drafter.draft_rows(
          params.drafter, params.target, state.drafter, key, rows=rows, keep=work[idx],
          **_draft_kwargs(engine, decision, active=keep, slots=idx))
      return _scatter_drafts(engine, _scored(engine, out), idx, keep,
                             whole=rows is None), update
    return run

  def absorb_only(E):
    # The full backlogs gathered into E rows (all B when E = B): one absorb, no drafter
    # pass; only the full rows keep it (the entries of the others are not written).
    def run():
      rows, idx = rows_of(E)
      return _no_draft(engine, None), drafter.settle_rows(
          params.drafter, params.target, state.drafter, rows=rows, keep=full[idx], K=K)
    return run

  # A step that drafts for no slot and has full backlogs absorbs them in the smallest
  # bucket (up to `sizes[0]` full rows) or over the whole batch.
  absorbers = sorted({sizes[0], B}) if windowed else []
  if windowed:
    nfull = jnp.sum(full, dtype=jnp.int32)
    branch = jnp.where(jnp.any(full) & ~jnp.any(slots),
                       1 + len(sizes) + (nfull > sizes[0]).astype(jnp.int32)
                       * (len(absorbers) - 1), branch)
  if quiet:  # branch 0 or an absorb: the drafting branches are never taken
    branch = jnp.maximum(branch - len(sizes), 0)
    sizes = ()
  branches = [skip] + [subset(E) for E in sizes] + [absorb_only(E) for E in absorbers]
  return branches, branch, sizes


def step(engine: Engine, params: Params, state: DecodeState) -> tuple[DecodeState, StepInfo]:
  """One speculative-decoding step for every active slot (see the module docstring).

  Phases: prepare (the plan) -> draft and score -> decide -> verify -> stops -> commit
  to the drafter -> learn and count. The decision (`engine.decider`: `prepare`,
  `draft_slots`, `score`, `plan`, `learn`) is `av_jax.decider.PolicyDecider` for the
  `av` arm, `av_jax.decision.Decider` for the others. Under subset drafting only the
  slots the plan names draft (`_gated_step`).
  """
  decider, active = engine.decider, state.active
  key, k_draft, k_verify = jax.random.split(state.key, 3)
  if engine.arm.drafts and decider.gated:
    return _gated_step(engine, params, state, key=key, k_draft=k_draft, k_verify=k_verify)
  decision = _prepared(engine, state)
  # Ungated: every step drafts for all B slots (target-only decoding: none).
  drafting = jnp.asarray(engine.arm.drafts) & decider.drafts(decision)
  drafts = _draft_phase(engine, params, state, k_draft, decision)
  slots = drafting & active
  commit = lambda drafts, verdict: _commit_phase(engine, state, drafts, verdict)
  return _decide_and_verify(
      engine, params, state, decision, drafts, key=key, k_verify=k_verify, slots=slots,
      drafting=drafting, plan_drafting=drafting,
      rows=jnp.where(jnp.any(slots), engine.config.num_slots, 0), packed=engine.arm.drafts,
      commit=commit)


def splits_quiet(engine: Engine) -> bool:
  """The engine runs its steps that draft for no slot in a program of their own
  (`run_mode`): a gated engine (the `av` arm with subset drafting) with `quiet_program`."""
  return bool(engine.arm.drafts and engine.decider.gated
              and engine.config.programs.quiet_program)


def next_drafts(engine: Engine, state: DecodeState) -> jax.Array:
  """[] bool: the next step of a gated engine drafts for some slot (its plan,
  `decider.draft_slots`, a function of the state alone)."""
  return jnp.any(engine.decider.draft_slots(_prepared(engine, state), state.active))


def quiet_step(engine: Engine, params: Params,
               state: DecodeState) -> tuple[DecodeState, StepInfo]:
  """The step of a gated engine on which no slot drafts (`next_drafts` False), in its own
  program: what `step` computes there, without the drafting branches and the verify
  switch (a target-only step's pass, the drafter's catch-up and the decision's
  bookkeeping). Run only where `next_drafts` is False (`run_mode` checks it)."""
  if not (engine.arm.drafts and engine.decider.gated):
    raise ValueError(f"engine: a quiet step needs a gated engine (the av arm with subset "
                     f"drafting), got mode {engine.config.mode!r}")
  key, k_draft, k_verify = jax.random.split(state.key, 3)
  return _gated_step(engine, params, state, key=key, k_draft=k_draft, k_verify=k_verify,
                     quiet=True)


def drafting_step(engine: Engine, params: Params,
                  state: DecodeState) -> tuple[DecodeState, StepInfo]:
  """The step of a gated engine on which some slot drafts (`next_drafts` True), in its
  own program: what `step` computes there, without the branches of a step that drafts
  for no slot (no plain target pass, no backlog-only absorb). Run only where
  `next_drafts` is True (`run_mode` checks it)."""
  if not (engine.arm.drafts and engine.decider.gated):
    raise ValueError(f"engine: a drafting step needs a gated engine (the av arm with "
                     f"subset drafting), got mode {engine.config.mode!r}")
  key, k_draft, k_verify = jax.random.split(state.key, 3)
  return _gated_step(engine, params, state, key=key, k_draft=k_draft, k_verify=k_verify,
                     drafting_only=True)


def run_mode(engine: Engine, params: Params, state: DecodeState, limit: jax.Array, *,
             quiet: bool, num_steps: int | None = None
             ) -> tuple[DecodeState, StepInfo, jax.Array]:
  """Up to `limit` (traced, <= `num_steps`, default `steps_per_chunk`) steps of one kind
  (a `lax.while_loop`): `quiet` runs `quiet_step` while the next step drafts for no slot,
  else `drafting_step` while it drafts for some (either possibly none).

  The decisions are the state's, so a chunk run as a sequence of these (switching kind
  where one stops short, `batching.generate`) computes what `run_chunk` does, step for
  step. Returns the state, the step records stacked over `num_steps` (rows at and past
  the count are zeros) and the count of steps run.
  """
  n = num_steps or engine.config.programs.steps_per_chunk
  one = (lambda s: quiet_step(engine, params, s)) if quiet else (
      lambda s: drafting_step(engine, params, s))
  shapes = jax.eval_shape(lambda s: one(s)[1], state)
  records = jax.tree.map(lambda x: jnp.zeros((n,) + x.shape, x.dtype), shapes)
  limit = jnp.minimum(jnp.asarray(limit, jnp.int32), n)

  def go_on(carry):
    i, state, _ = carry
    drafts = next_drafts(engine, state)
    return (i < limit) & (~drafts if quiet else drafts)

  def body(carry):
    i, state, records = carry
    state, info = one(state)
    return i + 1, state, jax.tree.map(lambda r, x: r.at[i].set(x), records, info)

  count, state, records = jax.lax.while_loop(go_on, body, (jnp.zeros((), jnp.int32), state,
                                                           records))
  return state, records, count


def run_chunk(engine: Engine, params: Params, state: DecodeState,
              num_steps: int | None = None) -> tuple[DecodeState, StepInfo]:
  """`lax.scan` of `step` over `num_steps` (default `steps_per_chunk`) decode steps."""
  num_steps = num_steps or engine.config.programs.steps_per_chunk
  return jax.lax.scan(lambda s, _: step(engine, params, s), state, None, length=num_steps)
