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

The step's parts live beside this module: the engine's data (`state`: `Engine`,
`DecodeState`, `StepInfo`, `init_state`), drafting and scoring (`drafting`) and the
target's packed verify pass (`verify`); this module binds an engine (`make_engine`),
starts requests (`prefill`) and assembles the step and its programs (`step`,
`run_chunk`, `run_mode`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from av_jax.arms import ARMS, get_arm, policy_for
from av_jax.decider import make_policy_decider
from av_jax.decision import DecisionState, make_decider
from av_jax.engine import protocols
from av_jax.engine.config import EngineConfig
from av_jax.engine.drafting import Drafts, _draft_branches, _draft_phase, _stepwise
from av_jax.engine.protocols import Target
from av_jax.engine.state import DecodeState, Engine, EngineStats, Params, StepInfo
from av_jax.engine.verify import _Verdict, _verify_phase
from av_jax.models.config import ModelsConfig
from av_jax.models.drafters import Drafter
from av_jax.models.sampling import sample_tokens
from av_jax.planner import PlannerConfig
from av_jax.rejection import RejectionResult

# Re-exported: the engine's names other modules and tests reach through `core`
# (`core.init_state`, `core.verify_forward`, `core._verify_packed`, ...).
from av_jax.engine.drafting import RECORDED_FEATURES, _draft, _keep_fn  # noqa: F401
from av_jax.engine.state import _empty_drafter, default_cost, init_state  # noqa: F401
from av_jax.engine.verify import _verify_packed, group_cache, verify_forward  # noqa: F401


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
                                  estimator=config.estimator, stepwise=drafter.stepwise)
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
  first = sample_tokens(k_first, last_logits, temperature=cfg.sampling.temperature,
                        top_p=cfg.sampling.top_p)
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


class _Stops(NamedTuple):
  """The emitted tokens that survive the stops, written into the sequence buffer."""
  num_kept: jax.Array  # [B] int32, tokens appended to each slot
  done: jax.Array      # [B] bool, the slot's request finished this step
  tokens: jax.Array    # [B, M] int32, the sequence buffer with them written


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
                drafting_only: bool = False, decision=None) -> tuple[DecodeState, StepInfo]:
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
  and verification through the packed buckets alone. `decision`: `_prepared(engine,
  state)` where the caller has it already (`run_mode`), so the plan is made once a step.
  """
  cfg, decider, active, drafter = engine.config, engine.decider, state.active, engine.drafter
  B, K = cfg.num_slots, cfg.max_draft
  decision = _prepared(engine, state) if decision is None else decision
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


def next_drafts(engine: Engine, state: DecodeState, decision=None) -> jax.Array:
  """[] bool: the next step of a gated engine drafts for some slot (its plan,
  `decider.draft_slots`, a function of the state alone; `decision`: that plan,
  `_prepared(engine, state)`, where the caller has made it)."""
  decision = _prepared(engine, state) if decision is None else decision
  return jnp.any(engine.decider.draft_slots(decision, state.active))


def quiet_step(engine: Engine, params: Params, state: DecodeState,
               decision=None) -> tuple[DecodeState, StepInfo]:
  """The step of a gated engine on which no slot drafts (`next_drafts` False), in its own
  program: what `step` computes there, without the drafting branches and the verify
  switch (a target-only step's pass, the drafter's catch-up and the decision's
  bookkeeping). Run only where `next_drafts` is False (`run_mode` checks it)."""
  if not (engine.arm.drafts and engine.decider.gated):
    raise ValueError(f"engine: a quiet step needs a gated engine (the av arm with subset "
                     f"drafting), got mode {engine.config.mode!r}")
  key, k_draft, k_verify = jax.random.split(state.key, 3)
  return _gated_step(engine, params, state, key=key, k_draft=k_draft, k_verify=k_verify,
                     quiet=True, decision=decision)


def drafting_step(engine: Engine, params: Params, state: DecodeState,
                  decision=None) -> tuple[DecodeState, StepInfo]:
  """The step of a gated engine on which some slot drafts (`next_drafts` True), in its
  own program: what `step` computes there, without the branches of a step that drafts
  for no slot (no plain target pass, no backlog-only absorb). Run only where
  `next_drafts` is True (`run_mode` checks it)."""
  if not (engine.arm.drafts and engine.decider.gated):
    raise ValueError(f"engine: a drafting step needs a gated engine (the av arm with "
                     f"subset drafting), got mode {engine.config.mode!r}")
  key, k_draft, k_verify = jax.random.split(state.key, 3)
  return _gated_step(engine, params, state, key=key, k_draft=k_draft, k_verify=k_verify,
                     drafting_only=True, decision=decision)


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
  one = quiet_step if quiet else drafting_step
  # The step is traced once: its records' shapes and the loop body come from one jitted
  # function (a call with the argument types of an earlier call reuses that trace).
  advance = jax.jit(lambda params, state, decision: one(engine, params, state, decision))
  shapes = jax.eval_shape(advance, params, state, _prepared(engine, state))[1]
  records = jax.tree.map(lambda x: jnp.zeros((n,) + x.shape, x.dtype), shapes)
  limit = jnp.minimum(jnp.asarray(limit, jnp.int32), n)
  # The plan of the next step is made once: the loop's condition reads it, and the step
  # runs on it (a plan is a function of the state alone, so it is the one the step would
  # make; making it again would add the decision's cost to every step a second time).

  def go_on(carry):
    i, state, decision, _ = carry
    drafts = next_drafts(engine, state, decision)
    return (i < limit) & (~drafts if quiet else drafts)

  def body(carry):
    i, state, decision, records = carry
    state, info = advance(params, state, decision)
    return (i + 1, state, _prepared(engine, state),
            jax.tree.map(lambda r, x: r.at[i].set(x), records, info))

  count, state, _, records = jax.lax.while_loop(
      go_on, body, (jnp.zeros((), jnp.int32), state, _prepared(engine, state), records))
  return state, records, count


def run_chunk(engine: Engine, params: Params, state: DecodeState,
              num_steps: int | None = None) -> tuple[DecodeState, StepInfo]:
  """`lax.scan` of `step` over `num_steps` (default `steps_per_chunk`) decode steps."""
  num_steps = num_steps or engine.config.programs.steps_per_chunk
  return jax.lax.scan(lambda s, _: step(engine, params, s), state, None, length=num_steps)
