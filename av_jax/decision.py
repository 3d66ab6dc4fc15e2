"""The per-step AV decision: three pure verbs over one state, used by every caller.

    probs = decider.score(state, features, conf=conf)              # [B, K] acceptance
    plan, state = decider.plan(state, probs, cost, active=active,  # what to verify
                               sound=sound, drafting=drafting)
    state = decider.learn(state, features, accepted, labeled)      # labels -> estimator

and `decider.draft_slots(state, active)`, the slots that draft (every active slot:
this decider drafts all of them; `av_jax.decider.PolicyDecider`, the `av` arm's,
chooses). The engine step of the static arms and `av_head`
(`av_jax.engine.core.step`), the synthetic simulator (`av_lab.simulate.run`), the
one-call `decision_step` and the overhead benchmark (`benchmarks/overhead.py`) all run
these verbs of a `Decider` built by `make_decider`. What differs between arms is an argument, not a code path: the
confidence head (`conf`, used when the decider was built with `head=True`), slots whose
draft logits were not finite (`sound`), a step that did not draft (`drafting`).

Order. The engine scores, plans, verifies and learns within one step. `decision_step`
serves a caller that has this step's draft logits and the previous step's labels: it
learns first (so a refit at the end of a round is used at once), then scores and plans.
Both run the estimator through the same sequence of updates and predictions. The
previous step's features travel in the state (`DecisionState.features`), so
`decision_step` is a pure `state -> state` function that jits once per `(B, K, V)`.

`make_decision` jits `decision_step`, donating the state, and counts traces so callers
can assert that steps never recompile (benchmarks/overhead.py, tests/test_decision.py).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from av_jax import _checks
from av_jax.estimator import EstimatorConfig, EstimatorState, OnlineEstimator, online_estimator
from av_jax.features import logit_qmax
from av_jax.planner import Plan, Planner, PlannerConfig, PlannerState, make_planner
from av_jax.selection import CostModel


class DecisionState(NamedTuple):
  """Everything the per-step decision carries from one step to the next (a pytree)."""
  estimator: EstimatorState  # the online estimator's coefficients and round statistics
  planner: PlannerState      # lagged budget and step counter
  # [B, K] float32, the last step's features awaiting their labels (`decision_step`);
  # None in the engine, which learns within the step that drafted.
  features: jax.Array | None = None


class Decider(NamedTuple):
  """The decision's verbs for fixed hyper-parameters (hashable, jit-static); see
  `make_decider`."""
  estimator: OnlineEstimator  # the online acceptance estimator
  planner: Planner            # the verification planner (policy, exploration)
  head: bool                  # scores are the drafter's confidence-head probabilities
  gated = False               # every active slot drafts (the engine's static view)

  @property
  def stop(self) -> str:
    """The drafting stop: "none" (all K) or "confidence" (`confstop:T`)."""
    return self.planner.stop

  @property
  def num_positions(self) -> int:
    """K, the maximum draft length."""
    return self.estimator.num_positions

  def init(self, batch_size: int | None = None) -> DecisionState:
    """A fresh state; with `batch_size` B, zero `[B, K]` features for `decision_step`
    and every leaf its own buffer (so the state can be donated)."""
    state = DecisionState(estimator=self.estimator.init(),
                          planner=self.planner.init(batch_size))
    if batch_size is None:
      return state
    state = state._replace(
        features=jnp.zeros((batch_size, self.num_positions), jnp.float32))
    return jax.tree.map(jnp.copy, state)

  def prepare(self, state: DecisionState, active: jax.typing.ArrayLike,
              cost: CostModel) -> DecisionState:
    """The step's plan before drafting: nothing to fix here (every active slot drafts
    all K and the budget is chosen in `plan`)."""
    del active, cost
    return state

  def admit(self, planner: PlannerState, slot: jax.typing.ArrayLike) -> PlannerState:
    """A new request in `slot`: nothing per request to reset."""
    del slot
    return planner

  def draft_slots(self, state: DecisionState, active: jax.typing.ArrayLike) -> jax.Array:
    """`[B] bool`: which slots draft this step: every active one."""
    del state
    active = jnp.asarray(active)
    _checks.rank("active", active, 1, "B")
    _checks.boolean("active", active)
    return active

  def drafts(self, state: DecisionState) -> jax.Array:
    """`[] bool`, the batch view of `draft_slots`: always True."""
    del state
    return jnp.asarray(True)

  def score(self, state: DecisionState, features: jax.typing.ArrayLike, *,
            conf: jax.typing.ArrayLike | None = None) -> jax.Array:
    """`[B, K]` acceptance probabilities of this step's drafts.

    Args:
      state: the decision state.
      features: `[B, K]` lossless features of the drafts (`logit_qmax`).
      conf: `[B, K]` confidence-head probabilities; the scores when the decider was
        built with `head=True` (then required), ignored otherwise.
    """
    if self.head:
      if conf is None:
        raise ValueError("conf: expected [B, K] confidence-head probabilities for a "
                         "decider built with head=True, got None")
      return jnp.asarray(conf)
    return self.estimator.predict(state.estimator, features)

  def keep_drafting(self, state: DecisionState, probs: jax.typing.ArrayLike,
                    drafted: jax.typing.ArrayLike, depth: jax.typing.ArrayLike, *,
                    active: jax.typing.ArrayLike,
                    top1: jax.typing.ArrayLike | None = None,
                    slots: jax.typing.ArrayLike | None = None, cost: CostModel | None = None,
                    num_active: jax.typing.ArrayLike | None = None) -> jax.Array:
    """`[B] bool`: whether each request drafts depth `depth + 1` (the planner's drafting
    stop, `PlannerConfig.draft_stop`: all K, or the confidence stop; `cost` and
    `num_active`, what a priced stop reads, are not read).

    Reads depths 1..`depth` of its inputs only, so the drafting loop can call it after
    each depth with buffers whose deeper entries are not drafted yet.

    Args:
      state: the decision state.
      probs: `[B, K]` acceptance probabilities (`score`) of the depths drafted so far.
      drafted: `[B, K]` bool, positions drafted so far (a prefix per slot).
      depth: int scalar, depths drafted so far (traced).
      active: `[B]` bool, slots decoding (and sound) this step.
      top1: `[B, K]` top-1 probability of each draft distribution (confidence stop).
      slots: `[E] int32`, the slot of each row when the rows are a gathered subset.
    """
    del cost, num_active
    return self.planner.keep_drafting(state.planner, probs, drafted, depth, active=active,
                                      top1=top1, slots=slots)

  def plan(self, state: DecisionState, probs: jax.typing.ArrayLike, cost: CostModel, *,
           active: jax.typing.ArrayLike | None = None,
           sound: jax.typing.ArrayLike | None = None,
           drafting: jax.typing.ArrayLike = True,
           drafted: jax.typing.ArrayLike | None = None,
           top1: jax.typing.ArrayLike | None = None) -> tuple[Plan, DecisionState]:
    """What to verify this step: survival, budget, allocation, exploration.

    Args:
      state: the decision state.
      probs: `[B, K]` acceptance probabilities (`score`).
      cost: the step-cost tables the budget is chosen against (data, never static).
      active: `[B]` bool, slots that are decoding (all when None).
      sound: `[B]` bool, slots whose draft logits were finite; the others verify nothing
        this step (a target-only step for them). All when None.
      drafting: `[] bool` (every slot) or `[B] bool` (per slot, normally
        `draft_slots`'s answer), which slots drafted this step; a slot that did not
        verifies nothing, and a step on which none did leaves the lagged budget as it
        was.
      drafted: `[B, K]` bool, positions drafted (a prefix per slot; a drafting stop or a
        non-finite position ends it); None: all. Only drafted positions are ranked,
        allocated and verified, and the next budget is computed over them.
      top1: `[B, K]` top-1 draft probabilities (required by the confidence stop).

    Returns:
      `(plan, new_state)`.
    """
    plan, planner = self.planner.plan(state.planner, probs, cost, active=active,
                                      sound=sound, drafting=drafting, drafted=drafted,
                                      top1=top1)
    return plan, state._replace(planner=planner)

  def learn(self, state: DecisionState, features: jax.typing.ArrayLike,
            accepted: jax.typing.ArrayLike, labeled: jax.typing.ArrayLike, *,
            axis_name: str | None = None) -> DecisionState:
    """Adds the labels verification produced to the estimator (refitting when a round
    ends).

    Args:
      state: the decision state.
      features: `[B, K]` features of the drafts the labels belong to.
      accepted: `[B, K]` bool, verification outcome per position.
      labeled: `[B, K]` bool, which of `accepted` are labels (accepted positions and the
        first rejected one; docs/algorithm.md section 6).
      axis_name: mesh axis over which data-parallel replicas sum the round's statistics.
    """
    return state._replace(estimator=self.estimator.update(
        state.estimator, features, accepted, labeled, axis_name=axis_name))


def make_decider(num_positions: int, *, policy: str, head: bool = False,
                 estimator: EstimatorConfig | None = None,
                 planner: PlannerConfig | None = None) -> Decider:
  """Builds the decision's verbs; one object per distinct set of hyper-parameters.

  The result is cached, so an engine and a benchmark built from the same settings hold
  the very same functions (and a jit keyed on the engine compiles once).

  Args:
    num_positions: K, the maximum draft length.
    policy: the planner's budget policy (`av_jax.planner.POLICIES`; the exact one for an
      arm and drafter is `av_jax.arms.policy_for`).
    head: score with the drafter's confidence head instead of the estimator.
    estimator: the estimator's hyper-parameters (`EstimatorConfig()` when None).
    planner: the planner's hyper-parameters (`PlannerConfig()` when None).

  Example:
    >>> decider = make_decider(4, policy="current")
    >>> state = decider.init()
    >>> probs = decider.score(state, features)
    >>> plan, state = decider.plan(state, probs, cost, active=active)
    >>> state = decider.learn(state, features, accepted, labeled)
  """
  return _decider(num_positions, policy, bool(head), estimator or EstimatorConfig(),
                  planner or PlannerConfig())


@functools.lru_cache(maxsize=None)
def _decider(num_positions: int, policy: str, head: bool, estimator: EstimatorConfig,
             planner: PlannerConfig) -> Decider:
  # Positional and normalized, so equal settings however spelled share one entry.
  return Decider(estimator=online_estimator(num_positions, estimator),
                 planner=make_planner(planner, policy=policy), head=head)


class Decision(NamedTuple):
  """A jitted `decision_step` for one decider; see `make_decision`."""
  init: Callable[[int], DecisionState]
  step: Callable[..., tuple[Plan, DecisionState]]
  num_traces: Callable[[], int]
  decider: Decider


def decision_step(
    state: DecisionState,
    logits: jax.typing.ArrayLike,
    accepted: jax.typing.ArrayLike,
    labeled: jax.typing.ArrayLike,
    active: jax.typing.ArrayLike,
    cost: CostModel,
    *,
    decider: Decider,
    temperature: jax.typing.ArrayLike = 1.0,
    top_p: jax.typing.ArrayLike = 1.0,
    feature: Callable[..., jax.Array] = logit_qmax,
    axis_name: str | None = None,
) -> tuple[Plan, DecisionState]:
  """One AV decision from draft logits: features, learn (last step's labels), score, plan.

  Args:
    state: the `DecisionState` returned by the previous step (or `decider.init(B)`).
    logits: `[B, K, V]` draft logits of this step (before temperature / top-p).
    accepted: `[B, K]` bool, previous step's verification outcome per position.
    labeled: `[B, K]` bool, which of `accepted` are labels (accepted positions and the
      first rejected one, docs/algorithm.md section 6; all False at the first step).
    active: `[B]` bool, slots that are sampling this step.
    cost: the step-cost tables (`av_jax.make_cost_model`).
    decider: the verbs (`make_decider`).
    temperature: drafting temperature (scalar or `[B, K]`), as in `logit_qmax`.
    top_p: drafting nucleus mass (scalar or `[B, K]`); 1 skips the nucleus sort.
    feature: `feature(logits, *, temperature, top_p) -> [B, K]`, a lossless feature with
      `logit_qmax`'s meaning (the estimator's coefficients are fitted to it); swap it
      only for an equivalent implementation.
    axis_name: mesh axis over which data-parallel replicas reduce the round's statistics.

  Returns:
    `(plan, new_state)`: `plan.num_verified [B]` int32 and `plan.mask [B, K]` bool say
    what to verify; `new_state.features` holds this step's features for the next update.

  Reference: docs/algorithm.md, sections 2 (feature), 4 (budget, allocation) and 7
  (estimator).

  Example:
    >>> decider = make_decider(K, policy="current")
    >>> state = decider.init(B)
    >>> plan, state = decision_step(state, logits, accepted, labeled, active, cost,
    ...                             decider=decider)
  """
  logits = jnp.asarray(logits)
  _checks.rank("logits", logits, 3, "BKV")
  B, K, _ = logits.shape
  if K != decider.num_positions:
    raise ValueError(f"logits: expected K={decider.num_positions} draft positions, "
                     f"got shape {logits.shape}")
  if state.features is None:
    raise ValueError("state.features: expected [B, K] features; build the state with "
                     "decider.init(batch_size)")
  _checks.shape("state.features", state.features, (B, K), "BK")
  features = feature(logits, temperature=temperature, top_p=top_p)
  state = decider.learn(state, state.features, accepted, labeled, axis_name=axis_name)
  probs = decider.score(state, features)
  plan, state = decider.plan(state, probs, cost, active=active)
  return plan, state._replace(features=features)


def make_decision(
    decider: Decider,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    feature: Callable[..., jax.Array] = logit_qmax,
    donate: bool = True,
) -> Decision:
  """Jits `decision_step` for one decider.

  The state is donated (its buffers are reused for the new state, which has the same
  shapes); the logits are not, since nothing in the output can reuse a `[B, K, V]`
  buffer. A donated state is consumed: always continue from the state a step returned.
  Passing the old one again fails with (on CPU and GPU)

      ValueError: INVALID_ARGUMENT: Invalid buffer passed to Execute() as argument 0 to
      replica 0: INVALID_ARGUMENT: Buffer has been deleted or donated.

  and reading one of its leaves raises `RuntimeError: Array has been deleted with
  shape=...`. Build with `donate=False` to keep old states alive (one copy per step). The cost tables are a traced argument (a re-profiled table needs no
  recompile). Each trace increments a counter read by `num_traces()`: after the first
  step of a `(B, K, V)` shape it must stay constant.

  Args:
    decider: the verbs (`make_decider`).
    temperature: drafting temperature (Python float: part of the compiled program).
    top_p: drafting nucleus mass (Python float; 1 compiles no sort).
    feature: the feature implementation (see `decision_step`).
    donate: donate the state argument to the step.

  Returns:
    `Decision(init, step, num_traces, decider)` with `init(batch_size) -> DecisionState`
    and `step(state, logits, accepted, labeled, active, cost) -> (Plan, DecisionState)`.

  Example:
    >>> decide = make_decision(make_decider(4, policy="lagged"))
    >>> state = decide.init(8)
    >>> plan, state = decide.step(state, logits, accepted, labeled, active, cost)
  """
  traces = [0]

  def step(state, logits, accepted, labeled, active, cost):
    traces[0] += 1  # runs only while tracing
    return decision_step(state, logits, accepted, labeled, active, cost, decider=decider,
                         temperature=temperature, top_p=top_p, feature=feature)

  jitted = jax.jit(step, donate_argnums=(0,) if donate else ())
  return Decision(init=decider.init, step=jitted, num_traces=lambda: traces[0],
                  decider=decider)
