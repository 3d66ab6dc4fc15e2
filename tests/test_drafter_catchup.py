"""Drafter catch-up: after target-only steps an autoregressive drafter drafts as if it had
drafted all along (`av_jax.models.drafters.catch_up`); take_slots / put_slots."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from av_jax import models as M
from av_jax.models import drafters
from tests import _engine_fixtures as fx

K, MAX_LEN, P, EMITTED = 3, 40, 5, 2  # draft length, cache, prompt length, first commit
PROMPTS = ([1, 2, 3, 4, 5], [9, 8, 7, 6, 5])


@functools.partial(jax.jit, static_argnames="cfg")
def _forward(target_params, seq, *, cfg):
  positions = jnp.broadcast_to(jnp.arange(seq.shape[1]), seq.shape)
  out = M.forward(target_params, seq, positions, cfg=cfg)
  return out.logits, out.hidden


@functools.lru_cache(maxsize=None)
def _greedy(kind: str, length: int):
  """The target's greedy continuations of PROMPTS to `length` tokens and the target
  hidden state of every position (`hidden[:, t]` predicted token t + 1)."""
  cfg, _, params = fx.pair(kind)
  seq = np.zeros((len(PROMPTS), fx.PAD), np.int32)
  seq[:, :P] = PROMPTS
  for t in range(P, length):
    logits, _ = _forward(params.target, seq, cfg=cfg.target)
    seq[:, t] = np.argmax(np.asarray(logits)[:, t - 1], axis=-1)
  _, hidden = _forward(params.target, seq, cfg=cfg.target)
  return seq[:, :length], np.asarray(hidden)[:, :length]


def _prefilled(drafter, params, seq, hidden, lens):
  """A state re-prefilled from the committed sequences `seq[b, :lens[b]]`."""
  width = int(max(lens)) - 1
  return drafter.init_state(params.drafter, params.target, prompt=seq[:, :width],
                            prompt_hidden=hidden[:, :width],
                            next_token=seq[np.arange(len(lens)), np.asarray(lens) - 1],
                            K=K, max_len=MAX_LEN, prompt_lens=np.asarray(lens) - 1)


def _draft_logits(drafter, params, state):
  return np.asarray(drafter.draft(params.drafter, params.target, state, fx.key(0), K=K,
                                  temperature=0.0).logits)


def _fields(state, row):
  return [np.asarray(getattr(state, f))[row] for f in ("tokens", "hidden", "num_pending",
                                                       "position")]


def _committed_once(kind: str, n: int):
  """Prefill, then one draft + commit of EMITTED target tokens for both rows; the greedy
  sequence reaches n target-only tokens further."""
  _, drafter, params = fx.pair(kind)
  seq, hidden = _greedy(kind, P + 1 + EMITTED + n)
  state = _prefilled(drafter, params, seq, hidden, [P + 1, P + 1])
  out = drafter.draft(params.drafter, params.target, state, fx.key(1), K=K, temperature=0.0)
  emitted = np.full((2, K + 1), -1, np.int32)
  emitted[:, :EMITTED] = seq[:, P + 1:P + 1 + EMITTED]
  state = drafter.commit(out.state, emitted_tokens=emitted,
                         num_emitted=np.full((2,), EMITTED, np.int32),
                         target_hidden=hidden[:, P:P + K + 1])
  return drafter, params, seq, hidden, state


@pytest.mark.parametrize("kind", ["draft_lm", "eagle"])
@pytest.mark.parametrize("n", [1, 3, K + 2, 2 * K + 5])
def test_catch_up_drafts_like_a_state_that_saw_every_token(kind, n):
  drafter, params, seq, hidden, state = _committed_once(kind, n)
  stale = state
  # n target-only steps for row 0; row 1 is not in the mask.
  catch = jax.jit(drafters.catch_up, static_argnums=0)
  mask = np.array([True, False])
  committed = P + 1 + EMITTED
  for _ in range(n):
    before = state
    state = catch(drafter, params.drafter, params.target, state, token=seq[:, committed],
                  hidden=hidden[:, committed - 1], mask=mask)
    for a, b in zip(_fields(state, 1), _fields(before, 1)):
      np.testing.assert_array_equal(a, b)  # rows not in the mask: bit-identical
    committed += 1
  assert int(state.num_pending[0]) == (EMITTED + n - 1) % (K + 1) + 1

  got = _draft_logits(drafter, params, state)
  want = _draft_logits(drafter, params,
                       _prefilled(drafter, params, seq, hidden, [committed, P + 1 + EMITTED]))
  np.testing.assert_allclose(got, want, atol=1e-4)
  # Negative control: without catch-up the drafter's state is stale and drafts otherwise.
  stale_logits = _draft_logits(drafter, params, stale)
  assert not np.allclose(stale_logits[0], want[0], atol=1e-2)


WIDTH = 4 * (K + 1)  # a backlog of up to WIDTH pending entries (lazy catch-up)


@pytest.mark.parametrize("kind", ["draft_lm", "eagle"])
@pytest.mark.parametrize("n", [3, 2 * K + 5, WIDTH + 3])
def test_lazy_catch_up_absorbs_only_when_the_slot_drafts_and_drafts_the_same(kind, n):
  """A `widen`ed state keeps the target-only steps' tokens pending (the cache untouched
  until WIDTH are pending); `settle` then absorbs the backlog, and the slot drafts what
  the eager catch-up (absorb every K + 1) and a state that saw every token draft."""
  drafter, params, seq, hidden, state = _committed_once(kind, n)
  catch = jax.jit(drafters.catch_up, static_argnums=0)
  mask = np.array([True, False])
  eager, lazy = state, drafters.widen(state, WIDTH)
  assert lazy.tokens.shape == (2, WIDTH) and lazy.hidden.shape[1] == WIDTH
  committed = P + 1 + EMITTED
  for _ in range(n):
    args = dict(token=seq[:, committed], hidden=hidden[:, committed - 1], mask=mask)
    eager = catch(drafter, params.drafter, params.target, eager, **args)
    before = lazy
    lazy = catch(drafter, params.drafter, params.target, lazy, **args)
    if int(before.num_pending[0]) < WIDTH:  # no absorb: the cache is bit-identical
      for a, b in zip(jax.tree.leaves(lazy.cache), jax.tree.leaves(before.cache)):
        np.testing.assert_array_equal(a, b)
    committed += 1
  assert int(lazy.num_pending[0]) == (EMITTED + n - 1) % WIDTH + 1
  # Negative control of "untouched": the eager catch-up absorbed within these steps.
  assert any(not np.array_equal(a, b) for a, b in
             zip(jax.tree.leaves(eager.cache), jax.tree.leaves(state.cache)))

  settled = jax.jit(drafters.settle, static_argnums=0, static_argnames="width")(
      drafter, params.drafter, params.target, lazy, width=K + 1)
  assert settled.tokens.shape == (2, K + 1)
  assert int(settled.num_pending[0]) <= K + 1
  for a, b in zip(_fields(settled, 1), _fields(drafters.narrow(lazy, K + 1), 1)):
    np.testing.assert_array_equal(a, b)  # a slot without a backlog is only narrowed
  got = _draft_logits(drafter, params, settled)
  want = _draft_logits(drafter, params,
                       _prefilled(drafter, params, seq, hidden, [committed, P + 1 + EMITTED]))
  np.testing.assert_allclose(got, want, atol=1e-4)
  np.testing.assert_allclose(got, _draft_logits(drafter, params, eager), atol=1e-4)
  # Absorbed over the backlog's whole width (`settle_rows`' one compiled absorb): the same.
  whole = jax.jit(functools.partial(drafters.settle, whole=True), static_argnums=0,
                  static_argnames="width")(drafter, params.drafter, params.target, lazy,
                                           width=K + 1)
  np.testing.assert_allclose(_draft_logits(drafter, params, whole), want, atol=1e-4)
  # Negative control: narrowed without settling, the backlog is lost.
  if int(lazy.num_pending[0]) > K + 1:
    lost = _draft_logits(drafter, params, drafters.narrow(
        lazy._replace(num_pending=jnp.minimum(lazy.num_pending, K + 1)), K + 1))
    assert not np.allclose(lost[0], want[0], atol=1e-2)


def test_widen_narrow_and_settle_check_their_width():
  _, drafter, params = fx.pair("eagle")
  seq, hidden = _greedy("eagle", P + 2)
  state = _prefilled(drafter, params, seq, hidden, [P + 1, P + 1])
  with pytest.raises(ValueError, match="width"):
    drafters.widen(state, K)
  with pytest.raises(ValueError, match="width"):
    drafters.narrow(state, K + 2)
  assert drafters.widen(state, K + 1) is state
  with pytest.raises(ValueError, match="absorb"):
    drafters.settle(drafter._replace(absorb=None), params.drafter, params.target,
                    drafters.widen(state, WIDTH), width=K + 1)


def test_parallel_catch_up_is_a_one_token_commit():
  cfg, drafter, params = fx.pair("block")
  seq, hidden = _greedy("block", P + 2)
  state = _prefilled(drafter, params, seq, hidden, [P + 1, P + 1])
  new = drafters.catch_up(drafter, params.drafter, params.target, state,
                          token=seq[:, P + 1], hidden=hidden[:, P], mask=np.array([True, False]))
  emitted = np.full((2, K + 1), -1, np.int32)
  emitted[:, 0] = seq[:, P + 1]
  want = drafter.commit(state, emitted_tokens=emitted, num_emitted=np.ones((2,), np.int32),
                        target_hidden=np.repeat(hidden[:, P:P + 1], K + 1, axis=1))
  for f in ("num_pending", "position"):
    np.testing.assert_array_equal(getattr(new, f)[0], getattr(want, f)[0])
    np.testing.assert_array_equal(getattr(new, f)[1], getattr(state, f)[1])
  np.testing.assert_array_equal(new.tokens[0, 0], want.tokens[0, 0])
  np.testing.assert_array_equal(new.hidden[0, 0], want.hidden[0, 0])
  np.testing.assert_allclose(_draft_logits(drafter, params, new)[0],
                             _draft_logits(drafter, params, want)[0], atol=1e-6)


def test_catch_up_refuses_a_drafter_with_a_cache_and_no_absorb():
  _, drafter, params = fx.pair("eagle")
  bare = drafter._replace(absorb=None)
  assert not drafters.can_skip(bare) and drafters.can_skip(drafter)
  seq, hidden = _greedy("eagle", P + 2)
  state = _prefilled(drafter, params, seq, hidden, [P + 1, P + 1])
  with pytest.raises(ValueError, match="absorb"):
    drafters.catch_up(bare, params.drafter, params.target, state, token=seq[:, 0],
                      hidden=hidden[:, 0], mask=np.ones((2,), bool))


@pytest.mark.parametrize("kind", ["draft_lm", "block"])
def test_take_and_put_slots_round_trip(kind):
  _, drafter, params = fx.pair(kind)
  B = 4
  state = drafter.init_state(params.drafter, params.target,
                             prompt=jnp.arange(B * 3, dtype=jnp.int32).reshape(B, 3) % fx.VOCAB,
                             prompt_hidden=jax.random.normal(jax.random.key(0), (B, 3, 32)),
                             next_token=jnp.arange(B, dtype=jnp.int32), K=K, max_len=MAX_LEN)
  idx = jnp.array([2, 0], jnp.int32)
  sub = drafters.take_slots(state, idx)
  assert sub.tokens.shape == (2, K + 1)
  np.testing.assert_array_equal(sub.position, state.position[idx])
  changed = sub._replace(position=sub.position + 7,
                         cache=jax.tree.map(lambda x: x + 1, sub.cache))
  put = drafters.put_slots(state, changed, idx, jnp.array([True, False]))
  np.testing.assert_array_equal(put.position, state.position.at[2].add(7))
  if state.cache is not None:
    np.testing.assert_array_equal(put.cache.k[:, 2], state.cache.k[:, 2] + 1)
    for b in (0, 1, 3):
      np.testing.assert_array_equal(put.cache.k[:, b], state.cache.k[:, b])
