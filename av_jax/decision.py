"""The per-step AV decision as one pure function: draft logits -> `num_verified [B]`.

Every decode step the engine runs, on device and without a host round trip:

1. `logit_qmax` of the `[B, K, V]` draft logits (the feature pass, the only part that
   reads the logits);
2. `estimator.update` with the previous step's features and the labels its
   verification produced (accepted / labeled), refitting at the end of a round;
3. `estimator.predict` of this step's acceptance probabilities;
4. `planner.plan`: survival, budget (per the planner's policy), allocation, exploration.

The update runs before the predict so that a refit at the end of a round is used at
once; between refits the order does not matter (the coefficients are fixed within a
round). The previous step's features travel in the state, so the whole step is a pure
`state -> state` function that jits once per `(B, K, V)` and never retraces.

`make_decision` jits it, donating the state, and counts traces so callers can assert
that steps never recompile (benchmarks/overhead.py, tests/test_decision.py).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from av_jax import _checks
from av_jax.estimator import EstimatorState, OnlineEstimator
from av_jax.features import logit_qmax
from av_jax.planner import Plan, Planner, PlannerState


class DecisionState(NamedTuple):
  """Everything the per-step decision carries from one step to the next (a pytree)."""
  estimator: EstimatorState  # the online estimator's coefficients and round statistics
  planner: PlannerState      # lagged budget and step counter
  features: jax.Array        # [B, K] float32, last step's features (labelled this step)


class Decision(NamedTuple):
  """A jitted decision for fixed hyper-parameters; see `make_decision`."""
  init: Callable[[int], DecisionState]
  step: Callable[..., tuple[Plan, DecisionState]]
  num_traces: Callable[[], int]


def decision_step(
    state: DecisionState,
    logits: jax.typing.ArrayLike,
    accepted: jax.typing.ArrayLike,
    labeled: jax.typing.ArrayLike,
    active: jax.typing.ArrayLike,
    *,
    estimator: OnlineEstimator,
    planner: Planner,
    temperature: jax.typing.ArrayLike = 1.0,
    top_p: jax.typing.ArrayLike = 1.0,
    feature: Callable[..., jax.Array] = logit_qmax,
    axis_name: str | None = None,
) -> tuple[Plan, DecisionState]:
  """One AV decision: features, estimator update, predict, survival, budget, allocation.

  Args:
    state: the `DecisionState` returned by the previous step (or `init`).
    logits: `[B, K, V]` draft logits of this step (before temperature / top-p).
    accepted: `[B, K]` bool, previous step's verification outcome per position.
    labeled: `[B, K]` bool, which of `accepted` are labels (spec section 6: accepted
      positions and the first rejected one; all False at the first step).
    active: `[B]` bool, slots that are sampling this step.
    estimator: an `online_estimator(K, ...)`.
    planner: a `make_planner(cost, ...)`.
    temperature: drafting temperature (scalar or `[B, K]`), as in `logit_qmax`.
    top_p: drafting nucleus mass (scalar or `[B, K]`); 1 skips the nucleus sort.
    feature: `feature(logits, *, temperature, top_p) -> [B, K]`, a lossless feature with
      `logit_qmax`'s meaning (the estimator's coefficients are fitted to it); swap it
      only for an equivalent implementation.
    axis_name: mesh axis over which data-parallel replicas reduce the round's statistics.

  Returns:
    `(plan, new_state)`: `plan.num_verified [B]` int32 and `plan.mask [B, K]` bool say
    what to verify; `new_state.features` holds this step's features for the next update.

  Reference: ADAPTIVE_VERIFICATION.md, sections 2-4 and 7.

  Example:
    >>> est = online_estimator(K)
    >>> planner = make_planner(linear_cost_model(B, B * (K + 1)), policy="current")
    >>> state = init_decision_state(est, planner, batch_size=B)
    >>> plan, state = decision_step(state, logits, accepted, labeled, active,
    ...                             estimator=est, planner=planner)
  """
  logits = jnp.asarray(logits)
  _checks.rank("logits", logits, 3, "BKV")
  B, K, _ = logits.shape
  if K != estimator.num_positions:
    raise ValueError(f"logits: expected K={estimator.num_positions} draft positions, "
                     f"got shape {logits.shape}")
  _checks.shape("state.features", state.features, (B, K), "BK")
  features = feature(logits, temperature=temperature, top_p=top_p)
  est_state = estimator.update(state.estimator, state.features, accepted, labeled,
                               axis_name=axis_name)
  probs = estimator.predict(est_state, features)
  plan, planner_state = planner.plan(state.planner, probs, active=active)
  return plan, DecisionState(estimator=est_state, planner=planner_state, features=features)


def init_decision_state(estimator: OnlineEstimator, planner: Planner, *,
                        batch_size: int) -> DecisionState:
  """The state before the first step: fresh estimator and planner, zero features.

  Every leaf is its own buffer (`estimator.init()` shares one zeros array between
  several fields), so the state can be donated.
  """
  state = DecisionState(
      estimator=estimator.init(), planner=planner.init(),
      features=jnp.zeros((batch_size, estimator.num_positions), jnp.float32))
  return jax.tree.map(jnp.copy, state)


def make_decision(
    estimator: OnlineEstimator,
    planner: Planner,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    feature: Callable[..., jax.Array] = logit_qmax,
    donate: bool = True,
) -> Decision:
  """Jits `decision_step` for fixed hyper-parameters.

  The state is donated (its buffers are reused for the new state, which has the same
  shapes); the logits are not, since nothing in the output can reuse a `[B, K, V]`
  buffer. Each trace increments a counter read by `num_traces()`: after the first step
  of a `(B, K, V)` shape it must stay constant.

  Args:
    estimator: an `online_estimator(K, ...)`.
    planner: a `make_planner(...)`.
    temperature: drafting temperature (Python float: part of the compiled program).
    top_p: drafting nucleus mass (Python float; 1 compiles no sort).
    feature: the feature implementation (see `decision_step`).
    donate: donate the state argument to the step.

  Returns:
    `Decision(init, step, num_traces)` with `init(batch_size) -> DecisionState` and
    `step(state, logits, accepted, labeled, active) -> (Plan, DecisionState)`.

  Example:
    >>> decide = make_decision(online_estimator(4), make_planner(cost, policy="lagged"))
    >>> state = decide.init(8)
    >>> plan, state = decide.step(state, logits, accepted, labeled, active)
  """
  traces = [0]

  def step(state, logits, accepted, labeled, active):
    traces[0] += 1  # runs only while tracing
    return decision_step(state, logits, accepted, labeled, active, estimator=estimator,
                         planner=planner, temperature=temperature, top_p=top_p,
                         feature=feature)

  def init(batch_size: int) -> DecisionState:
    return init_decision_state(estimator, planner, batch_size=batch_size)

  jitted = jax.jit(step, donate_argnums=(0,) if donate else ())
  return Decision(init=init, step=jitted, num_traces=lambda: traces[0])
