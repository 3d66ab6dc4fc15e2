"""The policy's parts (`av_jax.policy`): each an `(init, update)` pair over its own state.

The estimator part (coefficients), the memory (what each request drafted last, and what
that predicts of its next step) and the explorer (labels at every depth, at a stated
share of step time). An ablation replaces one part (`make_policy(..., memory=...)`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

class Part(NamedTuple):
  """One part of the policy: pure functions over its own state."""
  init: Callable[..., Any]    # (num_slots, K) -> state
  # (state, step: StepOutcome, *, axis_name=None) -> state; `axis_name`: the mesh axis over
  # which data-parallel replicas sum what they fit (parts that fit nothing ignore it)
  update: Callable[..., Any]
  read: Callable[..., Any] | None = None  # (state) -> what the prediction takes from it
  # (state) -> [B, K] acceptance predicted for the next step, where the part makes its own
  # prediction (else the estimator's on `read`)
  predict: Callable[..., Any] | None = None


class StepOutcome(NamedTuple):
  """What a step did, as every part's `update` reads it."""
  features: jax.Array  # [B, K] float32, the drafted features (junk where not drafted)
  drafted: jax.Array   # [B, K] bool, positions drafted this step
  accepted: jax.Array  # [B, K] bool, verification outcome
  labeled: jax.Array   # [B, K] bool, positions with a label
  step_ms: jax.Array   # [] float32, priced time of the step
  explore_ms: jax.Array  # [] float32, priced time of this step's exploration (0: none)


class MemoryState(NamedTuple):
  latest: jax.Array  # [B, K] float32, each request's latest drafted feature per depth
  known: jax.Array   # [B, K] bool, `latest` holds one of the current request's features
  age: jax.Array     # [B, K] float32, steps since `latest` was drafted
  mean: jax.Array    # [K] float32, running mean feature per depth (all requests)
  seen: jax.Array    # [K] float32, features averaged into `mean` (capped)
  lag: Any = None     # the lagged estimator's state (`lagged_features`), else None


def latest_features(*, horizon: float = 256.0, decay: float = 0.8) -> Part:
  """Each request's features at its last drafted step, shrunk toward the depth's
  running mean (over the last ~`horizon` drafted features) by `decay` per step of age;
  where a request has none at a depth, that mean. Example: latest 2.0, mean 0.0, drafted
  3 steps ago, decay 0.8: predicted from 0.8**3 * 2.0 = 1.02."""

  def init(num_slots: int, K: int) -> MemoryState:
    return MemoryState(latest=jnp.zeros((num_slots, K), jnp.float32),
                       known=jnp.zeros((num_slots, K), bool),
                       age=jnp.zeros((num_slots, K), jnp.float32),
                       mean=jnp.zeros((K,), jnp.float32), seen=jnp.zeros((K,), jnp.float32))

  def update(state: MemoryState, step: StepOutcome, *, axis_name=None) -> MemoryState:
    del axis_name  # nothing summed across replicas
    d = step.drafted
    count = jnp.sum(d, axis=0).astype(jnp.float32)
    total = jnp.sum(jnp.where(d, step.features, 0.0), axis=0)
    seen = jnp.minimum(state.seen + count, horizon)
    mean = jnp.where(count > 0, state.mean + (total - count * state.mean)
                     / jnp.maximum(seen, 1.0), state.mean)
    return state._replace(latest=jnp.where(d, step.features, state.latest),
                          known=state.known | d, age=jnp.where(d, 0.0, state.age + 1.0),
                          mean=mean, seen=seen)

  def read(state: MemoryState) -> jax.Array:
    """`[B, K]`: the features predicted for each request's next step."""
    weight = jnp.where(state.known, jnp.float32(decay) ** state.age, 0.0)
    return state.mean[None, :] + weight * (state.latest - state.mean[None, :])

  return Part(init, update, read)


def lagged_features(estimator, **kwargs) -> Part:
  """`latest_features` (`kwargs`: `horizon`, `decay`) whose next-step acceptance is
  predicted by its own `estimator`, fitted on what the plan read (the memory before each
  step) against that step's outcomes: what a request's last features say of its next step.

  It reads the memory centred on each depth's running mean: an intercept is the acceptance
  of a request at the mean, the slope prices only a request's distance from it (raw
  log-odds near -3 make slope and intercepts collinear under separately damped refits).
  Example: features unrelated to the next step fit a slope near 0 (every request planned
  by sigmoid(intercept)); requests that stay easy or hard keep the drafts' slope."""
  part = latest_features(**kwargs)

  def init(num_slots, K):
    return part.init(num_slots, K)._replace(lag=estimator.init())

  centred = lambda state: part.read(state) - state.mean[None, :]

  def update(state, step, *, axis_name=None):
    lag = estimator.update(state.lag, centred(state), step.accepted, step.labeled,
                           axis_name=axis_name)
    return part.update(state, step)._replace(lag=lag)

  return Part(init, update, part.read, lambda state: estimator.predict(state.lag, centred(state)))


class ExploreState(NamedTuple):
  credit_ms: jax.Array  # [] float32, exploration time earned and not spent
  next_slot: jax.Array  # [] int32, round-robin pointer


# The exploration credit banks at most this many steps' time: a long stretch in which
# exploring cost more than the credit earned does not buy a burst of explorations later.
_MAX_BANKED_STEPS = 64.0


def explore_credit(share: float = 0.01) -> Part:
  """Exploration bounded to `share` of step time: each step earns `share` of its
  priced time; a step explores (one request drafts and verifies all K, round robin)
  when the credit covers the priced cost of doing so, which is then spent. Example: at
  share 0.01, 10 ms steps and an exploration priced 5 ms, one step in 50 explores."""
  if not 0.0 <= share < 1.0:
    raise ValueError(f"share: expected a number in [0, 1), got {share!r}")

  def init(num_slots: int, K: int) -> ExploreState:
    del num_slots, K
    return ExploreState(credit_ms=jnp.zeros((), jnp.float32),
                        next_slot=jnp.zeros((), jnp.int32))

  def update(state: ExploreState, step: StepOutcome) -> ExploreState:
    credit = state.credit_ms + share * step.step_ms - step.explore_ms
    B = step.drafted.shape[0]
    return ExploreState(credit_ms=jnp.minimum(credit, _MAX_BANKED_STEPS * step.step_ms),
                        next_slot=jnp.where(step.explore_ms > 0, (state.next_slot + 1) % B,
                                            state.next_slot))

  return Part(init, update)


def no_exploration() -> Part:
  """Ablation of `explore_credit`: never explores."""
  return explore_credit(0.0)


def estimator_part(estimator) -> Part:
  """The online estimator (`av_jax.estimator.online_estimator`) as a part."""
  return Part(lambda num_slots, K: estimator.init(),
              lambda state, step: estimator.update(state, step.features, step.accepted,
                                                   step.labeled))
