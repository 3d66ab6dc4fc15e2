"""The target cache is updated in place: no step of a compiled decode chunk copies it.

A cache written inside a branch of `lax.switch` / `lax.cond` in the decode loop came
back as a new buffer that XLA copied whole into the loop state on every step (the
skip-drafting gate's switch made a gated-off step dearer than a target-only one). The
transformer target now verifies with `forward_packed_read` (the cache only read) and
the engine writes the entries after its branches (`protocols.Target.verify_read` /
`write`). These tests check that pass against the writing one, and the compiled
programs of every arm for copies of the cache inside the loop, with the old path as
the negative control the check must catch.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from av_jax import models as M
from av_jax.engine import batching, core, protocols
from av_jax.engine.config import Programs
from av_jax.models import layers
from av_jax.models import transformer as T
from av_jax.selection import make_cost_model

from tests._engine_fixtures import key, pair, tiny_config


def _random_cache(cfg, batch, max_len, seed):
  r = np.random.default_rng(seed)
  shape = (cfg.num_layers, batch, cfg.num_heads, max_len, cfg.head_dim)
  return T.KVCache(*(jnp.asarray(r.normal(size=shape), jnp.float32) for _ in range(2)))


@pytest.mark.parametrize("width", [None, 4])
@pytest.mark.parametrize("seed,B", [(0, 4), (1, 4), (2, 4), (3, 4), (4, 1), (5, 1)])
def test_the_read_pass_and_its_write_equal_the_writing_pass(seed, B, width):
  """Random slots, runs of positions per slot (over stale entries), padding anywhere;
  attention per token (`slot_width` None) and per slot (runs of <= 4 tokens); one slot
  (B = 1: the per-slot branches read the stacked cache without its slot axis) too."""
  cfg = tiny_config().target
  params = M.init_params(cfg, jax.random.PRNGKey(seed))
  r = np.random.default_rng(seed)
  M_, T_ = 24, 12
  cache = _random_cache(cfg, B, M_, seed)  # every entry is junk the pass must not read
  slot, pos, valid = [], [], []
  for b in r.permutation(B)[:3]:  # three slots, each a run of 1..4 tokens
    start, n = int(r.integers(0, M_ - 4)), int(r.integers(1, 5))
    slot += [b] * n
    pos += list(range(start, start + n))
    valid += [True] * n
  while len(slot) < T_:  # padding, at a random place in the packing
    at = int(r.integers(0, len(slot) + 1))
    slot.insert(at, int(r.integers(0, B)))
    pos.insert(at, int(r.integers(0, M_)))
    valid.insert(at, False)
  slot, pos, valid = (jnp.asarray(x) for x in (slot, pos, valid))
  tokens = jnp.asarray(r.integers(0, cfg.vocab_size, T_))
  ref = T.forward_packed(params, tokens, slot=slot, positions=pos, valid=valid, cache=cache,
                         cfg=cfg)
  out, writes = T.forward_packed_read(params, tokens, slot=slot, positions=pos, valid=valid,
                                      cache=cache, cfg=cfg, slot_width=width)
  written = T.write_packed(cache, writes, slot=slot, positions=pos, valid=valid)
  v = np.asarray(valid)
  np.testing.assert_allclose(np.asarray(out.logits)[v], np.asarray(ref.logits)[v],
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(out.hidden)[v], np.asarray(ref.hidden)[v],
                             rtol=1e-5, atol=1e-5)
  for a, b in ((written.k, ref.cache.k), (written.v, ref.cache.v)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  assert out.cache is None


@pytest.mark.parametrize("B", [1, 4])
def test_a_pass_with_one_token_per_slot_takes_the_one_row_branch(B):
  """No slot holds several tokens (a plain step's tokens through a verify layout of width
  4): the per-slot attention runs its E = 1 branch, whose later-token row is discarded,
  and equals the writing pass."""
  cfg = tiny_config().target
  params = M.init_params(cfg, jax.random.PRNGKey(7))
  assert layers.draft_rows(B) == tuple(sorted({1, B}))
  cache = _random_cache(cfg, B, 24, 7)
  slot = jnp.asarray(list(range(B)) + [0, 0])
  pos = jnp.asarray([5 + 3 * b for b in range(B)] + [0, 0])
  valid = jnp.asarray([True] * B + [False, False])
  tokens = jnp.asarray(np.random.default_rng(7).integers(0, cfg.vocab_size, B + 2))
  ref = T.forward_packed(params, tokens, slot=slot, positions=pos, valid=valid, cache=cache,
                         cfg=cfg)
  out, writes = T.forward_packed_read(params, tokens, slot=slot, positions=pos, valid=valid,
                                      cache=cache, cfg=cfg, slot_width=4)
  written = T.write_packed(cache, writes, slot=slot, positions=pos, valid=valid)
  v = np.asarray(valid)
  np.testing.assert_allclose(np.asarray(out.logits)[v], np.asarray(ref.logits)[v],
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(written.k), np.asarray(ref.cache.k), rtol=1e-5,
                             atol=1e-5)


def test_per_slot_attention_needs_its_width_to_bound_every_slot():
  """Negative control for the per-slot layout: a slot with 4 valid tokens read with
  `slot_width` 3 loses its last token (wrong outputs), and bad widths are refused."""
  cfg = tiny_config().target
  params = M.init_params(cfg, jax.random.PRNGKey(0))
  cache = _random_cache(cfg, 2, 16, 0)
  slot, pos = jnp.array([0, 1, 0, 0, 0]), jnp.array([2, 9, 3, 4, 5])
  valid, tokens = jnp.ones(5, bool), jnp.array([3, 4, 5, 6, 7])
  run = lambda width: np.asarray(T.forward_packed_read(
      params, tokens, slot=slot, positions=pos, valid=valid, cache=cache, cfg=cfg,
      slot_width=width)[0].logits)
  exact = run(None)
  np.testing.assert_allclose(run(4), exact, rtol=1e-5, atol=1e-5)
  assert np.abs(run(3)[4] - exact[4]).max() > 1e-3  # slot 0's fourth token
  np.testing.assert_allclose(run(3)[:4], exact[:4], rtol=1e-5, atol=1e-5)
  for bad in (0, True, -2):
    with pytest.raises(ValueError, match="slot_width"):
      run(bad)


def test_the_read_pass_ignores_stale_entries_at_the_positions_it_writes():
  """Negative control for the masks: junk at a written position changes the writing
  pass's inputs not at all, and must not change the read pass either."""
  cfg = tiny_config().target
  params = M.init_params(cfg, jax.random.PRNGKey(0))
  cache = _random_cache(cfg, 2, 16, 0)
  slot, pos = jnp.array([1, 1, 1]), jnp.array([5, 6, 7])
  valid, tokens = jnp.ones(3, bool), jnp.array([3, 4, 5])
  poisoned = T.KVCache(cache.k.at[:, 1, :, 6:8].set(1e3), cache.v.at[:, 1, :, 6:8].set(1e3))
  a, _ = T.forward_packed_read(params, tokens, slot=slot, positions=pos, valid=valid,
                               cache=cache, cfg=cfg)
  b, _ = T.forward_packed_read(params, tokens, slot=slot, positions=pos, valid=valid,
                               cache=poisoned, cfg=cfg)
  np.testing.assert_allclose(np.asarray(a.logits), np.asarray(b.logits), rtol=1e-6, atol=1e-6)
  # ... while junk below the run (position 4, a real cached entry) does change it.
  changed = T.KVCache(cache.k.at[:, 1, :, 4].set(1e3), cache.v.at[:, 1, :, 4].set(1e3))
  c, _ = T.forward_packed_read(params, tokens, slot=slot, positions=pos, valid=valid,
                               cache=changed, cfg=cfg)
  assert np.abs(np.asarray(a.logits) - np.asarray(c.logits)).max() > 1e-3


def _loop_copies(engine, params, B, max_len, field=lambda state: state.target_cache.k,
                 program=None):
  """Copies of an array shaped like `field(state)` (default the target cache) outside
  the entry computation of the compiled chunk (the decode loop's body and what it
  calls); `program(params, state)`: another decode program (default `run_chunk`)."""
  cost = make_cost_model(np.full(B + 1, 1e6), 1.0 + 0.01 * np.arange(B * 5 + 1))
  prefill, _, init = batching.compiled(engine)
  state = init(params, key(0), cost)
  for slot in range(B):
    state = prefill(params, state, jnp.arange(8, dtype=jnp.int32) % 7 + 1, jnp.int32(8),
                    jnp.int32(slot), jnp.int32(max_len))
  program = program or (lambda p, s: core.run_chunk(engine, p, s))
  text = jax.jit(program).lower(params, state).compile().as_text()
  dims = ",".join(str(d) for d in field(state).shape)
  pattern = re.compile(r"= f32\[(%s|%s)\]\S* copy\(" % (
      dims, dims.replace(",", ",1,", 1)))  # also the grouped [L, 1, B, ...] layout
  computation, copies = None, 0
  for line in text.splitlines():
    if line and not line.startswith(" ") and "{" in line:
      computation = line
    if pattern.search(line) and not computation.startswith("ENTRY"):
      copies += 1
  return copies


@pytest.mark.parametrize("kind,mode", [("block", "target_only"), ("block", "fixed"),
                                       ("block", "av"), ("eagle", "av"),
                                       ("draft_lm", "av")])
def test_no_step_copies_the_target_cache(kind, mode):
  cfg, drafter, params = pair(kind)
  B, max_len = 4, 64
  engine = core.make_engine(core.EngineConfig(mode=mode, num_slots=B, max_draft=4, max_len=max_len,
                                              programs=Programs(steps_per_chunk=3)),
                            cfg, drafter)
  assert _loop_copies(engine, params, B, max_len) == 0


@pytest.mark.parametrize("B", [1, 2])
def test_the_profiled_verify_program_copies_no_target_cache(B):
  """The verify pass compiled on its own, as `engine.profile` times each bucket: no copy
  of the stacked cache. At B = 1 the per-slot branches take the cache without its size-1
  slot axis; given it whole, XLA copied it into every layer's branches (8 copies of K or
  V here; on the shipped target the T = 1 pass cost 1.5x a plain step)."""
  cfg, drafter, params = pair("block")
  max_len = 64
  engine = core.make_engine(core.EngineConfig(mode="fixed", num_slots=B, max_draft=4,
                                              max_len=max_len), cfg, drafter)
  state = core.init_state(engine, params, key(0))
  cache = core.group_cache(engine, state.target_cache)

  def verify(target, cache, tokens, slot, positions, valid):
    return core.verify_forward(engine, target, cache, tokens=tokens, slot=slot,
                               positions=positions, valid=valid, read=True)[0]

  t = jnp.arange(5 * B, dtype=jnp.int32)[None]
  text = jax.jit(verify).lower(params.target, cache, jnp.ones_like(t), t % B, 10 + t // B,
                               jnp.ones(t.shape, bool)).compile().as_text()
  dims = ",".join(str(d) for d in state.target_cache.k.shape)
  assert not re.findall(r"= f32\[%s\]\S* copy\(" % dims, text)


def test_the_copy_check_catches_a_target_that_writes_inside_the_switch():
  """Negative control: the same gated engine on a target without `verify_read` (each
  bucket's `verify` writes the cache) copies it inside the loop."""
  cfg, drafter, params = pair("block")
  B, max_len = 4, 64
  target = protocols.transformer_target(cfg)._replace(verify_read=None, write=None)
  engine = core.make_engine(core.EngineConfig(mode="av", num_slots=B, max_draft=4, max_len=max_len,
                                              programs=Programs(steps_per_chunk=3)),
                            target=target, drafter=drafter)
  assert _loop_copies(engine, params, B, max_len) > 0


def test_a_target_must_bring_both_verify_read_and_write():
  cfg, drafter, _ = pair("block")
  target = protocols.transformer_target(cfg)._replace(write=None)
  with pytest.raises(ValueError, match="target: expected both or neither of `verify_read`"):
    core.make_engine(core.EngineConfig(mode="av", num_slots=2), target=target,
                     drafter=drafter)


@pytest.mark.parametrize("kind", ["eagle", "draft_lm"])
def test_a_gated_off_step_copies_no_drafter_cache(kind):
  """Lazy catch-up writes an autoregressive drafter's cache after the draft-bucket switch
  (`drafters.read_window` / `write_window`): the only copies of it left in the loop are
  the two of the whole-batch drafting branch (its draft loop's carry), none on the path
  of a step that drafts nothing. Negative control: the eager catch-up (a backlog of
  K + 1) returns the cache from its branches and copies it on every step (10 here)."""
  cfg, drafter, params = pair(kind)
  B, max_len = 4, 64
  count = lambda backlog: _loop_copies(
      core.make_engine(core.EngineConfig(mode="av", num_slots=B, max_draft=4, max_len=max_len,
                                         programs=Programs(steps_per_chunk=3,
                                                           drafter_backlog=backlog)),
                       cfg, drafter),
      params, B, max_len, field=lambda state: state.drafter.cache.k)
  assert count(None) <= 2
  assert count(5) > 4
