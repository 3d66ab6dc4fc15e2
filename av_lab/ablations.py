"""Parts of the policy tried on the replay ground and not adopted (each with its decision
record): kept here, outside the library, so the record's figures can be reproduced.

`lagged_with_offsets`: docs/decisions/0010-per-request-offsets.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from av_jax.parts import Part, lagged_features


def lagged_with_offsets(estimator, *, prior: float = 4.0, forget: float = 0.95,
                        **kwargs) -> Part:
  """`lagged_features` (`kwargs`: `horizon`, `decay`) with a per-request offset to the
  plan's log-odds: what a request's own labels say that its features do not.

  The offset is one Newton step of the request's own intercept from 0, under a normal
  prior of precision `prior`, on the plan's shared prediction p at its labeled positions:
  `sum(w (y - p)) / (prior + sum(w p (1 - p)))`, each step's labels weighted `forget` **
  its age. A new request starts at 0 (its `known` all False). Example: shared p = 0.5 at
  both depths, a request accepted at both for 8 steps (`forget` 1): offset 8 / (4 + 4) = 1,
  predicted sigmoid(0 + 1) = 0.73; one rejected alike: 0.27."""
  part = lagged_features(estimator, **kwargs)

  def init(num_slots, K):
    state = part.init(num_slots, K)
    zero = jnp.zeros((num_slots,), jnp.float32)
    return state._replace(lag=(state.lag, zero, zero))

  def shared(state):  # the state `lagged_features` reads
    return state._replace(lag=state.lag[0])

  def update(state, step, *, axis_name=None):
    _, num, den = state.lag
    p = part.predict(shared(state))
    w = step.labeled.astype(jnp.float32)
    fresh = ~jnp.any(state.known, axis=1)
    num = (jnp.where(fresh, 0.0, forget * num)
           + jnp.sum(w * (step.accepted.astype(jnp.float32) - p), axis=1))
    den = jnp.where(fresh, 0.0, forget * den) + jnp.sum(w * p * (1.0 - p), axis=1)
    new = part.update(shared(state), step, axis_name=axis_name)
    return new._replace(lag=(new.lag, num, den))

  def predict(state):
    _, num, den = state.lag
    p = jnp.clip(part.predict(shared(state)), 1e-6, 1.0 - 1e-6)
    offset = jnp.where(jnp.any(state.known, axis=1), num / (prior + den), 0.0)
    return jax.nn.sigmoid(jnp.log(p) - jnp.log1p(-p) + offset[:, None])

  return Part(init, update, lambda state: part.read(shared(state)), predict)
