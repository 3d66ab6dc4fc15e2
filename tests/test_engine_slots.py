"""The engine's subset drafting (the `av` arm leaves rows out of drafting), for every
drafter kind: greedy identity while slots start and stop drafting, catch-up of
autoregressive drafters, per-slot drafting into draft buckets, inert idle slots, no
recompiles, and a new request's fresh memory. The mechanics are driven by a decider that
drafts a fixed pattern of slots (`_SlotDecider`); `av` runs end to end."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from av_jax import engine as E
from av_jax.decision import Decider, make_decider
from av_jax.engine import batching as G
from av_jax.engine import core
from av_jax.planner import PlannerConfig
from av_jax.sampling import Sampling
from av_jax.selection import make_cost_model
from tests import _engine_fixtures as fx

PROMPTS = [[1, 2, 3], [4], list(range(5, 22)), [7, 7, 7, 7, 7, 7]]
MAX_NEW = [9, 14, 6, 11]


def _cost(B, K, draft_ms):
  return make_cost_model(np.full(B + 1, draft_ms), 1.0 + 0.02 * np.arange(B * (K + 1) + 1))


@functools.lru_cache(maxsize=None)
def _engine(kind, copy_target=False, **overrides):
  cfg, drafter, params = fx.pair(kind, copy_target)
  settings = dict(num_slots=3, max_draft=4, max_len=64, mode="av",
                  sampling=Sampling(temperature=0.0), programs=E.Programs(steps_per_chunk=4))
  settings.update(overrides)
  return E.make_engine(E.EngineConfig(**settings), cfg, drafter), params


class _SlotDecider(Decider):
  """A decider with the per-slot drafting contract (`draft_slots`, `plan(drafting=[B])`,
  `keep_drafting(slots=)`), drafting a fixed pattern: at planner step s the slots whose
  rank under a permutation is below s % (B + 1)."""
  gated = True

  def __hash__(self):
    return hash(("slots", tuple(self)))

  def __eq__(self, other):
    return type(other) is _SlotDecider and tuple(self) == tuple(other)

  def draft_slots(self, state, active):
    B = active.shape[0]
    rank = (jnp.arange(B) * 3) % B
    return active & (rank < (state.planner.step + B) % (B + 1))  # B, 0, 1, ..., B - 1, B, ...

  def plan(self, state, probs, cost, *, drafting=True, **kwargs):
    return super().plan(state, probs, cost, drafting=jnp.any(drafting), **kwargs)

  def keep_drafting(self, state, probs, drafted, depth, *, active, top1=None, slots=None,
                    cost=None, num_active=None):
    assert slots is not None and slots.shape == active.shape
    return super().keep_drafting(state, probs, drafted, depth, active=active, top1=top1)


@functools.lru_cache(maxsize=None)
def _slot_engine(kind, copy_target=False, **overrides):
  """`_engine` drafting `_SlotDecider`'s pattern, verifying by the budget rule."""
  engine, params = _engine(kind, copy_target, **overrides)
  decider = make_decider(engine.config.max_draft, policy=engine.policy,
                         estimator=engine.config.estimator,
                         planner=PlannerConfig(explore_every=0))
  return engine._replace(decider=_SlotDecider(*decider)), params


def _expected_slots(step, B):
  rank = (np.arange(B) * 3) % B
  return rank < (step + B) % (B + 1)


@pytest.mark.parametrize("kind", ["draft_lm", "eagle", "block"])
def test_gated_greedy_equals_target_only_greedy(kind):
  """Slots start and stop drafting by the pattern; autoregressive drafters catch up on
  the steps their slot skips. Output: exactly target-only greedy decoding; steps that
  draft for no slot run no drafter rows and no passes; `draft_tokens` counts the slots
  that drafted only."""
  engine, params = _slot_engine(kind)
  assert engine.decider.gated
  B, K = engine.config.num_slots, engine.config.max_draft
  want = [fx.greedy_reference(False, p, n) for p, n in zip(PROMPTS, MAX_NEW)]
  result = E.generate(engine, params, PROMPTS, max_new_tokens=MAX_NEW, key=fx.key(0),
                      cost=_cost(B, K, 0.1), keep_infos=True)
  assert [c.tokens for c in result.completions] == want
  drafting = np.concatenate([i.drafting for i in result.infos])
  active = np.concatenate([i.active for i in result.infos]) > 0
  assert drafting[active].any() and not drafting[active].all()
  rows = np.concatenate([i.draft_rows for i in result.infos])
  passes = np.concatenate([i.draft_passes for i in result.infos])
  assert (rows[~drafting] == 0).all() and (passes[~drafting] == 0).all()
  slots = np.concatenate([i.draft_slots for i in result.infos])
  depth = np.concatenate([i.drafted_depth for i in result.infos])
  assert result.stats["draft_tokens"] == (depth.sum() if engine.drafter.stepwise
                                          else K * slots.sum())


@pytest.mark.parametrize("backlog", [None, 5, 7])
def test_caught_up_drafter_accepts_every_draft_after_a_stretch(backlog):
  """The drafter is the target (draft_lm = target): after every stretch of steps its slot
  did not draft, the caught-up drafter's verified drafts are all accepted (a stale
  drafter state would not: tests/test_drafter_catchup.py's control). Backlogs: the
  default (4 (K + 1) = 20, absorbed when a slot drafts again), K + 1 = 5 (the eager
  catch-up) and 7 (filled and absorbed within stretches)."""
  want = [fx.greedy_reference(True, p, n) for p, n in zip(PROMPTS, [20, 25, 18, 22])]
  engine, params = _slot_engine("draft_lm", copy_target=True, programs=E.Programs(
      steps_per_chunk=4, drafter_backlog=backlog))
  B, K = engine.config.num_slots, engine.config.max_draft
  result = E.generate(engine, params, PROMPTS, max_new_tokens=[20, 25, 18, 22],
                      key=fx.key(0), cost=_cost(B, K, 1e-3), keep_infos=True)
  assert [c.tokens for c in result.completions] == want
  slots = np.concatenate([i.draft_slots for i in result.infos])
  accepted = np.concatenate([i.accepted for i in result.infos])
  labeled = np.concatenate([i.labeled for i in result.infos])
  after = slots & np.concatenate([np.zeros((1, B), bool), ~slots[:-1]])  # after a stretch
  assert labeled[after].sum() > 0
  np.testing.assert_array_equal(accepted[labeled], True)
  assert result.stats["acceptance_at"][0] == 1.0


@pytest.mark.parametrize("kind", ["eagle", "block"])
def test_subset_drafting_drafts_exactly_the_chosen_slots(kind):
  engine, params = _slot_engine(kind, num_slots=8, programs=E.Programs(steps_per_chunk=6))
  B = engine.config.num_slots
  assert engine.config.draft_bucket_sizes() == (1, 2, 4, 8)
  prompts = [[1 + b, 2, 3 + b] for b in range(B)]
  want = [fx.greedy_reference(False, p, 12) for p in prompts]
  result = E.generate(engine, params, prompts, max_new_tokens=12, key=fx.key(0),
                      keep_infos=True)
  assert [c.tokens for c in result.completions] == want
  slots = np.concatenate([i.draft_slots for i in result.infos])
  active = np.concatenate([i.slot_active for i in result.infos])
  rows = np.concatenate([i.draft_rows for i in result.infos])
  verified = np.concatenate([i.num_verified for i in result.infos])
  depth = np.concatenate([i.drafted_depth for i in result.infos])
  counts = set()
  for s in range(slots.shape[0]):
    expect = _expected_slots(s, B) & active[s]
    np.testing.assert_array_equal(slots[s], expect)
    n = int(expect.sum())
    counts.add(n)
    assert rows[s] == (0 if n == 0 else min(e for e in (1, 2, 4, 8) if e >= n))
    assert (verified[s][~expect] == 0).all() and (depth[s][~expect] == 0).all()
    assert (depth[s][expect] > 0).all()
  assert counts >= set(range(0, B + 1))  # every bucket and the no-draft branch ran


def test_draft_buckets_config():
  assert E.EngineConfig(num_slots=3).draft_bucket_sizes() == (1, 2, 3)
  assert E.EngineConfig(num_slots=64).draft_bucket_sizes() == (8, 16, 32, 64)
  assert E.EngineConfig(num_slots=8, programs=E.Programs(
      draft_buckets=(3, 1))).draft_bucket_sizes() == (1, 3, 8)
  for bad in ((), (0,), (9,), (2.5,), "4", (True,)):
    with pytest.raises(ValueError, match="draft_buckets"):
      E.EngineConfig(num_slots=8, programs=E.Programs(draft_buckets=bad))


def test_gated_idle_slots_inert_and_no_recompile():
  engine, params = _slot_engine("eagle", programs=E.Programs(steps_per_chunk=4, num_buckets=3))
  B, K = engine.config.num_slots, engine.config.max_draft
  cost = _cost(B, K, 100.0)
  prefill, chunk, init = G.compiled(engine)
  E.generate(engine, params, PROMPTS, max_new_tokens=MAX_NEW, key=fx.key(1), cost=cost)
  programs = G.decode_programs(engine)  # the quiet and the drafting program
  assert len(programs) == 2
  sizes = lambda: [p._cache_size() for p in programs] + [prefill._cache_size()]
  first = sizes()
  assert first[:2] == [1, 1]
  result = E.generate(engine, params, [[3, 1], [2] * 9, [5] * 20], max_new_tokens=[20, 3, 8],
                      key=fx.key(2), cost=cost)
  assert sizes() == first
  state = result.state
  new_state, info = chunk(params, jax.tree.map(jnp.copy, state))
  np.testing.assert_array_equal(new_state.tokens, state.tokens)
  np.testing.assert_array_equal(new_state.length, state.length)
  np.testing.assert_array_equal(new_state.target_cache.k, state.target_cache.k)
  for name in ("tokens", "hidden", "num_pending", "position"):
    np.testing.assert_array_equal(getattr(new_state.drafter, name),
                                  getattr(state.drafter, name))
  assert int(jnp.sum(info.emitted)) == 0 and not bool(jnp.any(info.draft_slots))
  assert int(jnp.sum(info.draft_rows)) == 0


@pytest.mark.parametrize("kind", ["eagle", "draft_lm"])
def test_a_gated_off_step_leaves_the_drafter_cache_alone_until_the_backlog_fills(kind):
  """Lazy catch-up in the engine: a step on which no slot drafts (drafting priced out of
  AV's plan) appends to each slot's backlog and runs no absorb (the drafter cache is
  bit-identical) until a backlog holds `pending_width` entries; with the eager catch-up
  (`programs.drafter_backlog` = K + 1, the negative control) such steps absorb every K + 1
  steps."""
  ran = {}
  for backlog in (None, 5):
    engine, params = _engine(kind, programs=E.Programs(steps_per_chunk=4,
                                                       drafter_backlog=backlog))
    B, K = engine.config.num_slots, engine.config.max_draft
    width = engine.pending_width
    assert width == (4 * (K + 1) if backlog is None else backlog)
    prefill, _, init = G.compiled(engine)
    state = init(params, fx.key(3), _cost(B, K, 1e6))
    for slot in range(B):
      state = prefill(params, state, jnp.arange(8, dtype=jnp.int32) % 7 + 1, jnp.int32(8),
                      jnp.int32(slot), jnp.int32(60))
    assert state.drafter.tokens.shape == (B, width)
    step = jax.jit(lambda p, s: core.step(engine, p, s))
    untouched, absorbed = 0, 0
    for _ in range(30):
      new, info = step(params, state)
      if not bool(info.drafting):
        full = bool(jnp.any(state.drafter.num_pending >= width))
        same = all(np.array_equal(a, b) for a, b in zip(
            jax.tree.leaves(new.drafter.cache), jax.tree.leaves(state.drafter.cache)))
        assert same or full  # the cache changes only when a backlog is full
        untouched += same
        absorbed += not same
      state = new
    ran[backlog] = (untouched, absorbed)
  # Lazy: most gated-off steps leave the cache alone (slots whose backlogs fill at
  # different steps absorb on different steps); eager: an absorb every K + 1 steps.
  assert ran[None][0] >= 20 and ran[5][1] >= 3 and ran[None][1] < ran[5][1]


def test_drafter_backlog_config():
  assert E.EngineConfig(max_draft=4).pending_width() == 20
  assert E.EngineConfig(max_draft=4, programs=E.Programs(drafter_backlog=5)).pending_width() == 5
  for bad in (4, 0, 2.5, True, "8"):
    with pytest.raises(ValueError, match="drafter_backlog"):
      E.EngineConfig(max_draft=4, programs=E.Programs(drafter_backlog=bad))
  cfg, drafter, _ = fx.pair("block")  # a parallel drafter keeps one-token blocks
  assert E.make_engine(E.EngineConfig(max_draft=4), cfg, drafter).pending_width == 5
  cfg, drafter, _ = fx.pair("eagle")
  assert E.make_engine(E.EngineConfig(max_draft=4), cfg, drafter).pending_width == 20
  assert E.make_engine(E.EngineConfig(max_draft=4, mode="fixed"), cfg,
                       drafter).pending_width == 5  # never gated


def test_drafter_with_a_cache_and_no_absorb_is_never_gated():
  cfg, drafter, _ = fx.pair("eagle")
  engine = E.make_engine(E.EngineConfig(), cfg, drafter._replace(absorb=None))
  assert not engine.decider.gated
  assert E.make_engine(E.EngineConfig(), cfg, drafter).decider.gated


@pytest.mark.parametrize("num_slots", [1, 3])
def test_a_new_request_starts_with_a_fresh_memory(num_slots):
  """A request admitted to a slot is not held to the features of the slot's last request:
  the slot's memory is empty again (its plan reads the position prior), every other
  slot's memory is kept."""
  engine, params = _engine("block", num_slots=num_slots)
  B, K = engine.config.num_slots, engine.config.max_draft
  prefill, _, init = G.compiled(engine)
  state = init(params, fx.key(0), _cost(B, K, 100.0))
  memory = state.planner.memory._replace(known=jnp.ones((B, K), bool),
                                         latest=jnp.full((B, K), 3.0, jnp.float32))
  state = state._replace(planner=state.planner._replace(memory=memory))
  slot = B - 1
  prompt = jnp.asarray([3, 1, 4, 1, 5, 0, 0, 0], jnp.int32)
  state = prefill(params, state, prompt, jnp.int32(5), jnp.int32(slot), jnp.int32(8))
  fresh = np.arange(B) == slot
  np.testing.assert_array_equal(np.asarray(state.planner.memory.known),
                                np.broadcast_to(~fresh[:, None], (B, K)))
  np.testing.assert_array_equal(np.asarray(state.planner.memory.latest)[~fresh], 3.0)
