"""The drafting half of a decode step: drafts and their scores, on device.

A step drafts K tokens for its rows (`Drafter.draft`, or `Drafter.draft_rows` for the
draft buckets of a gated step, `_draft_branches`), checks each draft distribution is
sound, and scores the drafts (`_scored`: the features the decision reads, the draft
probabilities q that verification takes). Under a drafting stop the loop over depths
asks the decider after each depth (`_keep_fn`). Dimension letters as in
`av_jax.engine.core`; E rows of a draft bucket.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from av_jax.decision import DecisionState
from av_jax.engine.state import DecodeState, Engine, Params
from av_jax.features import FEATURES, logit_qmax
from av_jax.sampling import sampling_log_probs

# Features recorded per draft token when `Programs.record_features` is on (studies):
# every registered feature, lossless and lossy, in this order along StepInfo.extra's last axis.
RECORDED_FEATURES = tuple(FEATURES)


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
             slots: jax.Array | None = None, *, cost=None, num_active=None):
  """The drafting stop evaluated after each depth j: scores S[b, 1..j] from the features
  of depths <= j (`decider.score`), then the planner's rule (`decider.keep_drafting`).
  A slot whose depth-j distribution is not sound stops (its later depths could not be
  verified). `active [E]` are the drafting rows, `slots [E]` their slots (None: all B
  in order); `cost` (the step's `CostModel`) and `num_active` (the step's active
  requests) are what a priced stop reads. Returns `(keep_fn, aux0)` for `Drafter.draft`."""
  cfg, decider = engine.config, engine.decider
  B, K, V = active.shape[0], cfg.max_draft, engine.target.vocab_size
  uniform = -jnp.log(jnp.float32(V))

  def keep_fn(depth, logits, log_probs, aux):
    # `rows_depth [B]`: depths each row drafted (a row that stopped rides along in later
    # passes, but its outputs there are not drafts); `going [B]`: rows drafting `depth`.
    features, sound, top1, rows_depth, going = aux
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
    rows_depth = rows_depth + going.astype(jnp.int32)
    drafted = ((jnp.arange(K)[None] < rows_depth[:, None])
               & (jnp.cumprod(sound, axis=1) > 0))
    probs = decider.score(decision, features)
    keep = decider.keep_drafting(decision, probs, drafted, depth, active=active, top1=top1,
                                 slots=slots, cost=cost, num_active=num_active) & ok
    return keep, (features, sound, top1, rows_depth, going & keep)

  aux0 = (jnp.zeros((B, K), jnp.float32), jnp.zeros((B, K), bool),
          jnp.zeros((B, K), jnp.float32), jnp.zeros((B,), jnp.int32), jnp.ones((B,), bool))
  return keep_fn, aux0


def _draft_kwargs(engine: Engine, decision: DecisionState, *, active: jax.Array,
                  slots: jax.Array | None = None, cost=None, num_active=None) -> dict:
  """The keyword arguments of `Drafter.draft` for E rows (`active [E]` the ones that
  draft, `slots [E]` their slot ids, None: all B in order): K, temperature, top-p, and
  the drafting stop (`keep_fn`, `keep_init`) where the loop evaluates one."""
  cfg = engine.config
  kwargs = dict(K=cfg.max_draft, temperature=cfg.sampling.temperature,
                top_p=cfg.sampling.top_p)
  if _stepwise(engine):
    keep_fn, aux0 = _keep_fn(engine, active, decision, slots, cost=cost,
                             num_active=num_active)
    kwargs.update(keep_fn=keep_fn, keep_init=aux0)
  return kwargs


def _draft(engine: Engine, params: Params, drafter_state: Any, key: jax.Array,
           decision: DecisionState, *, active: jax.Array,
           slots: jax.Array | None = None, cost=None) -> Drafts:
  """Drafts for every row of `drafter_state` (`Drafter.draft`; `active`, `slots` as in
  `_draft_kwargs`) and scores the drafts (`_scored`)."""
  return _scored(engine, engine.drafter.draft(
      params.drafter, params.target, drafter_state, key,
      **_draft_kwargs(engine, decision, active=active, slots=slots, cost=cost)))


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


def _draft_phase(engine: Engine, params: Params, state: DecodeState, key: jax.Array,
                 decision: DecisionState) -> Drafts:
  """An ungated step's drafts for all B slots (placeholders for the target-only arm).
  Under a drafting stop the loop over depths ends per request and for the batch
  (`_keep_fn`)."""
  if not engine.arm.drafts:
    return _no_draft(engine, state.drafter)
  return _draft(engine, params, state.drafter, key, decision, active=state.active,
                cost=state.cost)


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
          **_draft_kwargs(engine, decision, active=keep, slots=idx, cost=state.cost,
                          num_active=jnp.sum(state.active, dtype=jnp.int32)))
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