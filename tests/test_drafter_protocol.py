"""A drafter of the user's own written against the `Drafter` protocol alone: its state is a
plain pytree whose leaves hold their rows on declared axes (`slot_axis`), it catches up
with a `catch_up` of its own, and it uses none of av_jax's drafter internals. The engine
serves it with subset drafting (the `av` arm, `Drafter.skips`) through the protocol's
verbs: greedy output equals the target's own greedy decoding, and a drafter equal to the
target has every verified draft accepted, also right after its rows skipped drafting
(a stale state, not caught up, would draft the wrong tokens there)."""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from av_jax import engine as E
from av_jax.sampling import Sampling
from av_jax.decision import make_decider
from av_jax.engine.protocols import Target, TargetOutput
from av_jax.models.drafters import DraftOutput, Drafter
from av_jax.planner import PlannerConfig
from tests.test_engine_slots import _SlotDecider, _cost

V, B, K = 16, 4, 3
PROMPTS = [[1, 2], [3], [4, 5, 6], [7, 8], [9, 10, 11]]  # 5 requests, 4 slots
MAX_NEW = [24, 17, 30, 21, 12]


def _bigram_target() -> Target:
  """A bigram table as the target; its cache is the slots' token history."""
  def verify(table, cache, *, tokens, slot, positions, valid):
    cache = cache.at[slot, jnp.where(valid, positions, cache.shape[1])].set(tokens, mode="drop")
    hidden = jax.nn.one_hot(tokens, V)
    return TargetOutput(hidden @ table, hidden, cache)

  return Target(name=f"bigram-{V}", vocab_size=V, hidden_size=V,
                init_cache=lambda num_slots, max_len: jnp.zeros((num_slots, max_len), jnp.int32),
                verify=verify, slot_axis=0)


class _Rows(NamedTuple):
  """The bigram drafter's state."""
  block: jax.Array  # [K+1, B] int32, the last committed block of each row (rows on axis 1)
  size: jax.Array   # [B] int32, its valid entries


@functools.lru_cache(maxsize=None)
def _bigram_drafter() -> Drafter:
  """A bigram drafter drafting from the last committed token of each row (`_Rows`)."""

  def init_state(table, target_table, *, prompt, prompt_hidden, next_token, K, max_len,
                 prompt_lens=None):
    del table, target_table, prompt_hidden, max_len, prompt_lens
    n = prompt.shape[0]
    return _Rows(block=jnp.zeros((K + 1, n), jnp.int32).at[0].set(next_token),
                 size=jnp.ones((n,), jnp.int32))

  def last(state):
    return jnp.take_along_axis(state.block, state.size[None] - 1, 0)[0]

  def draft(table, target_table, state, key, *, K, temperature, top_p):
    del target_table, top_p  # draws from the temperature-scaled logits (the test: greedy)
    def one(token, key):  # draft i + 1 reads the drawn token i
      logits = table[token]
      drawn = jnp.where(temperature > 0, jax.random.categorical(
          key, logits / jnp.maximum(temperature, 1e-6)), jnp.argmax(logits, -1))
      return drawn.astype(jnp.int32), (logits, drawn.astype(jnp.int32))
    _, (logits, tokens) = jax.lax.scan(one, last(state), jax.random.split(key, K))
    return DraftOutput(logits=logits.swapaxes(0, 1), tokens=tokens.T, conf_logits=None,
                       state=state)

  def commit(state, *, emitted_tokens, num_emitted, target_hidden):
    del target_hidden
    return _Rows(block=jnp.maximum(emitted_tokens, 0).T.astype(jnp.int32),
                 size=jnp.asarray(num_emitted, jnp.int32))

  def catch_up(table, target_table, state, *, token, hidden, mask):
    del table, target_table, hidden
    block = jnp.where(mask[None], jnp.zeros_like(state.block).at[0].set(token), state.block)
    return _Rows(block=block, size=jnp.where(mask, 1, state.size))

  return Drafter(kind="bigram", drafting="autoregressive", init_state=init_state,
                 draft=draft, commit=commit, skips=True,
                 slot_axis=_Rows(block=1, size=0), catch_up=catch_up)


def _tables():
  table = 4.0 * jax.random.normal(jax.random.key(2), (V, V))
  return table, table + 1.5 * jax.random.normal(jax.random.key(3), (V, V))


def _greedy(table, prompt, n):
  out = [prompt[-1]]
  for _ in range(n):
    out.append(int(jnp.argmax(table[out[-1]])))
  return out[1:]


@functools.lru_cache(maxsize=None)
def _engine(pattern: bool) -> E.Engine:
  """The `av` engine serving the bigram drafter; `pattern`: its decider drafts a fixed
  pattern of rows (`_SlotDecider`: all, none, and every subset size in turn)."""
  engine = E.make_engine(E.EngineConfig(num_slots=B, max_draft=K, max_len=64, mode="av",
                                        sampling=Sampling(temperature=0.0),
                                        programs=E.Programs(steps_per_chunk=4)),
                         target=_bigram_target(), drafter=_bigram_drafter())
  if pattern:
    decider = make_decider(K, policy=engine.policy, estimator=engine.config.estimator,
                           planner=PlannerConfig(explore_every=0))
    engine = engine._replace(decider=_SlotDecider(*decider))
  return engine


@pytest.mark.parametrize("pattern", [True, False])
@pytest.mark.parametrize("copy", [True, False])
def test_own_drafter_is_served_with_subset_drafting(pattern, copy):
  engine = _engine(pattern)
  assert engine.decider.gated and engine.pending_width == K + 1
  table, close = _tables()
  params = E.Params(target=table, drafter=table if copy else close)
  result = E.generate(engine, params, PROMPTS, max_new_tokens=MAX_NEW, key=jax.random.key(0),
                      cost=_cost(B, K, 0.1), keep_infos=True)
  assert [c.tokens for c in result.completions] == [
      _greedy(table, p, n) for p, n in zip(PROMPTS, MAX_NEW)]
  infos = jax.tree.map(lambda *x: np.concatenate(x), *result.infos)
  assert result.stats["verified"] > 0
  if pattern:  # rows drafted in draft buckets smaller than B, and skipped and caught up
    some = infos.draft_slots.any(1) & ~(infos.draft_slots == infos.slot_active).all(1)
    assert some.any() and (infos.draft_rows[some] < B).any()
  if copy:  # the drafter is the target: every verified draft is accepted
    assert (infos.accepted == infos.labeled).all() and infos.labeled.any()


def test_protocol_fields_are_checked():
  drafter = _bigram_drafter()
  config = E.EngineConfig(num_slots=B, max_draft=K, max_len=32)
  for bad, match in ((drafter._replace(catch_up=None), "needs `catch_up`"),
                     (drafter._replace(absorb=lambda *a: a), "`absorb` is for a DrafterState"),
                     (drafter._replace(slot_axis=None), "`catch_up` is for a state"),
                     (drafter._replace(drafting="sideways"), "drafting must be"),
                     (drafter._replace(slot_axis={"block": 1, "size": 0}), "hashable")):
    with pytest.raises(ValueError, match=match):
      E.make_engine(config, target=_bigram_target(), drafter=bad)
  # Not declared `skips`: every step drafts every row (no subset drafting).
  plain = E.make_engine(config, target=_bigram_target(), drafter=drafter._replace(skips=False))
  assert not plain.decider.gated and drafter.skips_rows and not plain.drafter.skips_rows


def test_row_verbs_follow_the_declared_slot_axes():
  drafter = _bigram_drafter()
  state = _Rows(block=jnp.arange(4 * (K + 1)).reshape(K + 1, 4), size=jnp.arange(4))
  rows = drafter.take_rows(state, jnp.array([2, 0]))
  np.testing.assert_array_equal(rows.block, state.block[:, [2, 0]])
  np.testing.assert_array_equal(rows.size, [2, 0])
  changed = jax.tree.map(lambda x: x + 100, rows)
  put = drafter.put_rows(state, changed, jnp.array([2, 0]), jnp.array([True, False]))
  np.testing.assert_array_equal(put.block[:, 2], state.block[:, 2] + 100)
  np.testing.assert_array_equal(put.block[:, [0, 1, 3]], state.block[:, [0, 1, 3]])
  np.testing.assert_array_equal(put.size, [0, 1, 102, 3])
  one = _Rows(block=jnp.full((K + 1, 1), -1), size=jnp.full((1,), -1))  # a prefill's row
  inserted = drafter.insert_row(state, one, jnp.int32(3))
  np.testing.assert_array_equal(inserted.block[:, 3], -1)
  np.testing.assert_array_equal(inserted.size, [0, 1, 2, -1])
  kept = drafter.keep_rows(changed, rows, jnp.array([False, True]))
  np.testing.assert_array_equal(kept.size, [2, 100])
