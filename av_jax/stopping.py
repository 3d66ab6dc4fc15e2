"""The confidence stop of autoregressive drafting, `confstop:T` (vLLM's
`DraftConfidenceStop`), as pure functions: the rule the `confstop:T` arm drafts and
verifies by, and the reference its engine path is tested against.

The batch drafts depth j + 1 while some request's drafts so far all have top-1
probability >= T; every active request then verifies the same count,
`clip(L, 1, K)` with L the longest such leading run in the batch. The count reads the
draft distributions of depths 1..i only to decide whether position i is verified, never
a drawn token's acceptance, so the output stays target-distributed.

Example (T = 0.6, two requests, K = 4): top-1 probabilities [[0.9, 0.7, 0.4, 0.99],
[0.3, 0.99, 0.99, 0.99]] -> request 0's chain clears depths 1-2, request 1's none, so
the round runs 3 depths and both requests verify 2 drafts.

AV's own drafting depth is part of its priced plan (`av_jax.policy`), not a stop rule.

Shapes: B slots, K draft depths. Depths are 1-based counts.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from av_jax import _checks


class ConfidenceStop(NamedTuple):
  """Outcome of one `confstop:T` draft round."""
  num_verified: jax.Array  # [B] int32, drafts each slot verifies (the same for all active)
  depths_run: jax.Array    # [] int32, drafter passes the round launched


def _scalar_int(name, x):
  x = jnp.asarray(x)
  _checks.rank(name, x, 0)
  _checks.integer(name, x)
  return x.astype(jnp.int32)


def confidence_alive(top1_probs: jax.typing.ArrayLike, alive: jax.typing.ArrayLike,
                     threshold: jax.typing.ArrayLike) -> jax.Array:
  """One depth of `confstop:T`: a chain stays alive while every draft has top-1 >= T.

  vLLM's `DraftConfidenceStop` (vllm/v1/worker/gpu/spec_decode/confidence_stop.py)
  keeps per-request chain state: after depth j, `alive[b]` iff the drafter's top-1
  probability was >= T at every depth 1..j. A dead chain stays dead even if the drafter
  becomes confident again. Padded / inactive rows enter dead and never keep the batch
  drafting. Pass `alive = active` at depth 1.

  Args:
    top1_probs: `[B]` top-1 probability of each request's depth-j draft distribution.
    alive: `[B]` bool, chains alive after depth j - 1 (`active` at j = 1).
    threshold: scalar T.

  Returns:
    `[B]` bool, chains alive after depth j.
  """
  top1_probs = jnp.asarray(top1_probs, jnp.float32)
  _checks.rank("top1_probs", top1_probs, 1, "B")
  alive = jnp.asarray(alive)
  _checks.shape("alive", alive, top1_probs.shape, "B")
  _checks.boolean("alive", alive)
  return alive & (top1_probs >= jnp.asarray(threshold, jnp.float32))


def confidence_num_verified(depths_run: jax.typing.ArrayLike, any_alive: jax.typing.ArrayLike,
                            active: jax.typing.ArrayLike) -> jax.Array:
  """Drafts every active request verifies after a `confstop:T` round.

  The round launches depth j + 1 while some chain is alive after depth j (j < K). All
  rows run every launched depth, so every active request verifies the same count: with
  no chain alive after the last launched depth `d`, `max(1, d - 1)` (that depth's drafts
  were all below T, except that the first draft is always kept); with a chain still
  alive (only possible at d = K), K. Equivalently, with `L = max_b` (number of leading
  drafts of b with top-1 >= T): `depths_run = min(K, L + 1)` and
  `num_verified = clip(L, 1, K)`. Verification is fixed: no budget, no allocation.

  Args:
    depths_run: int scalar, depths the round launched (>= 1).
    any_alive: `[]` bool, whether a chain is alive after the last launched depth.
    active: `[B]` bool.

  Returns:
    `[B]` int32 (0 for inactive slots).
  """
  depths_run = _scalar_int("depths_run", depths_run)
  active = jnp.asarray(active)
  _checks.rank("active", active, 1, "B")
  _checks.boolean("active", active)
  count = jnp.where(jnp.asarray(any_alive), depths_run, jnp.maximum(depths_run - 1, 1))
  return jnp.where(active, count, 0).astype(jnp.int32)


def confidence_stop(top1_probs: jax.typing.ArrayLike, threshold: jax.typing.ArrayLike, *,
                    active: jax.typing.ArrayLike | None = None) -> ConfidenceStop:
  """A whole `confstop:T` round (vLLM's `DraftConfidenceStop`), batch level.

  Composes `confidence_alive` depth by depth (depth j + 1 is launched only while some
  chain is alive after depth j; top-1 probabilities of depths not launched are never
  read) and `confidence_num_verified`. Lossless: the count reads draft distributions
  of depths 1..i only to decide whether position i is verified, never drawn tokens.

  Args:
    top1_probs: `[B, K]` top-1 probability of each depth's draft distribution.
    threshold: scalar T.
    active: optional `[B]` bool.

  Returns:
    `ConfidenceStop(num_verified [B] int32, depths_run [] int32)`.

  Example:
    >>> confidence_stop(jnp.array([[0.9, 0.7, 0.4, 0.9], [0.3, 0.99, 0.99, 0.99]]), 0.6)
    ConfidenceStop(num_verified=Array([2, 2], ...), depths_run=Array(3, ...))
  """
  top1_probs = jnp.asarray(top1_probs, jnp.float32)
  _checks.rank("top1_probs", top1_probs, 2, "BK")
  B, K = top1_probs.shape
  if active is None:
    active = jnp.ones((B,), bool)
  active = jnp.asarray(active)
  _checks.shape("active", active, (B,), "B")
  _checks.boolean("active", active)

  def body(carry, probs_j):
    alive, depths_run, launched = carry
    new_alive = jnp.where(launched, confidence_alive(probs_j, alive, threshold), alive)
    depths_run = depths_run + launched.astype(jnp.int32)
    return (new_alive, depths_run, launched & jnp.any(new_alive)), None

  init = (active, jnp.zeros((), jnp.int32), jnp.asarray(True))
  (alive, depths_run, _), _ = jax.lax.scan(body, init, top1_probs.T)
  return ConfidenceStop(num_verified=confidence_num_verified(depths_run, jnp.any(alive), active),
                        depths_run=depths_run)
