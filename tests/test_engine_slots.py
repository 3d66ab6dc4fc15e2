"""Engine under the skip-drafting gate, for every drafter kind: greedy identity while the
gate opens and closes, catch-up of autoregressive drafters, per-slot (subset) drafting
into draft buckets, inert idle slots and no recompiles."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from av_jax import engine as E
from av_jax import planner as planner_lib
from av_jax.decision import Decider
from av_jax.engine import batching as G
from av_jax.engine import core
from av_jax.selection import make_cost_model
from tests import _engine_fixtures as fx

PROMPTS = [[1, 2, 3], [4], list(range(5, 22)), [7, 7, 7, 7, 7, 7]]
MAX_NEW = [9, 14, 6, 11]


def _cost(B, K, draft_ms):
  return make_cost_model(np.full(B + 1, draft_ms), 1.0 + 0.02 * np.arange(B * (K + 1) + 1))


@functools.lru_cache(maxsize=None)
def _engine(kind, copy_target=False, **overrides):
  cfg, drafter, params = fx.pair(kind, copy_target)
  # The per-slot skip-drafting gate's mechanics: the `av-gate` arm (the previous decision).
  settings = dict(num_slots=3, max_draft=4, max_len=64, mode="av-gate", temperature=0.0,
                  steps_per_chunk=4, explore_every=2, draft_recheck_every=4)
  settings.update(overrides)
  return E.make_engine(E.EngineConfig(**settings), cfg, drafter), params


@pytest.mark.parametrize("kind", ["draft_lm", "eagle", "block"])
def test_gated_greedy_equals_target_only_greedy(kind):
  """Drafting never pays: only the re-check steps draft (steps 0 and 4, then 12: no slot
  paid at the re-check of step 4, so the interval backs off from 4 to 8), and the
  first step of the fourth request (admitted at a chunk boundary into a freed slot, it
  starts with a fresh verdict); the rest decode target-only and the
  autoregressive drafters catch up. Output: exactly target-only greedy decoding."""
  engine, params = _engine(kind)
  assert engine.decider.planner.gated
  B, K = engine.config.num_slots, engine.config.max_draft
  want = [fx.greedy_reference(False, p, n) for p, n in zip(PROMPTS, MAX_NEW)]
  result = E.generate(engine, params, PROMPTS, max_new_tokens=MAX_NEW, key=fx.key(0),
                      cost=_cost(B, K, 100.0), keep_infos=True)
  assert [c.tokens for c in result.completions] == want
  drafting = np.concatenate([i.drafting for i in result.infos])
  active = np.concatenate([i.active for i in result.infos]) > 0
  assert drafting[active].any() and not drafting[active].all()
  rechecks = np.isin(np.arange(drafting.size), (0, 4, 12))
  assert drafting[rechecks].all()
  # At most one more drafting step: the fourth request's first, at a chunk boundary
  # (where it is admitted; none when that is a re-check step), only its slot drafting.
  extra = np.flatnonzero(drafting & ~rechecks)
  assert extra.size <= 1
  draft_slots = np.concatenate([i.draft_slots for i in result.infos])
  for t in extra:
    assert t % engine.config.steps_per_chunk == 0 and draft_slots[t].sum() == 1
  rows = np.concatenate([i.draft_rows for i in result.infos])
  passes = np.concatenate([i.draft_passes for i in result.infos])
  assert (rows[~drafting] == 0).all() and (passes[~drafting] == 0).all()
  # draft_tokens counts the slots that drafted only.
  slots = np.concatenate([i.draft_slots for i in result.infos])
  depth = np.concatenate([i.drafted_depth for i in result.infos])
  assert result.stats["draft_tokens"] == (depth.sum() if engine.drafter.stepwise
                                          else K * slots.sum())


@pytest.mark.parametrize("backlog", [None, 5, 7])
def test_caught_up_drafter_accepts_like_a_never_gated_one(backlog):
  """The drafter is the target (draft_lm = target): a never-gated run accepts every
  verified draft; after every gated stretch the caught-up drafter still does (a stale
  drafter state would not: tests/test_drafter_catchup.py's control). Backlogs: the
  default (4 (K + 1) = 20, absorbed when a slot drafts again), K + 1 = 5 (the eager
  catch-up) and 7 (filled and absorbed within stretches, and settled at re-checks)."""
  want = [fx.greedy_reference(True, p, n) for p, n in zip(PROMPTS, [20, 25, 18, 22])]
  # An estimator that verifies little at first can make even free drafting "not pay", so
  # the never-gated run turns the gate off.
  for draft_ms, gated in ((100.0, True), (1e-3, False)):
    engine, params = _engine("draft_lm", copy_target=True, skip_unprofitable_drafts=gated,
                             drafter_backlog=backlog)
    B, K = engine.config.num_slots, engine.config.max_draft
    result = E.generate(engine, params, PROMPTS, max_new_tokens=[20, 25, 18, 22],
                        key=fx.key(0), cost=_cost(B, K, draft_ms), keep_infos=True)
    assert [c.tokens for c in result.completions] == want
    drafting = np.concatenate([i.drafting for i in result.infos])
    accepted = np.concatenate([i.accepted for i in result.infos])
    labeled = np.concatenate([i.labeled for i in result.infos])
    assert (~drafting).any() == gated
    after = drafting & np.concatenate([[False], ~drafting[:-1]])  # first step after a stretch
    assert labeled[after].sum() > (0 if gated else -1)
    np.testing.assert_array_equal(accepted[labeled], True)
    assert result.stats["acceptance_at"][0] == 1.0


class _SlotDecider(Decider):
  """A decider with the per-slot drafting contract (`draft_slots`, `plan(drafting=[B])`,
  `keep_drafting(slots=)`), drafting a fixed pattern: at planner step s the slots whose
  rank under a permutation is below s % (B + 1)."""

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

  def keep_drafting(self, state, probs, drafted, depth, *, active, top1=None, slots=None):
    assert slots is not None and slots.shape == active.shape
    return super().keep_drafting(state, probs, drafted, depth, active=active, top1=top1)


def _expected_slots(step, B):
  rank = (np.arange(B) * 3) % B
  return rank < (step + B) % (B + 1)


@pytest.mark.parametrize("kind", ["eagle", "block"])
def test_subset_drafting_drafts_exactly_the_chosen_slots(kind):
  base, params = _engine(kind, num_slots=8, steps_per_chunk=6)
  engine = base._replace(decider=_SlotDecider(*base.decider))
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
  assert E.EngineConfig(num_slots=8, draft_buckets=(3, 1)).draft_bucket_sizes() == (1, 3, 8)
  for bad in ((), (0,), (9,), (2.5,), "4", (True,)):
    with pytest.raises(ValueError, match="draft_buckets"):
      E.EngineConfig(num_slots=8, draft_buckets=bad)


def test_gated_idle_slots_inert_and_no_recompile():
  engine, params = _engine("eagle", num_buckets=3)
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
  """Lazy catch-up in the engine: a step on which no slot drafts appends to each slot's
  backlog and runs no absorb (the drafter cache is bit-identical) until a backlog holds
  `pending_width` entries; with the eager catch-up (`drafter_backlog` = K + 1, the
  negative control) gated-off steps absorb every K + 1 steps."""
  ran = {}
  for backlog in (None, 5):
    engine, params = _engine(kind, drafter_backlog=backlog)
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
  assert E.EngineConfig(max_draft=4, drafter_backlog=5).pending_width() == 5
  for bad in (4, 0, 2.5, True, "8"):
    with pytest.raises(ValueError, match="drafter_backlog"):
      E.EngineConfig(max_draft=4, drafter_backlog=bad)
  cfg, drafter, _ = fx.pair("block")  # a parallel drafter keeps one-token blocks
  assert E.make_engine(E.EngineConfig(max_draft=4), cfg, drafter).pending_width == 5
  cfg, drafter, _ = fx.pair("eagle")
  assert E.make_engine(E.EngineConfig(max_draft=4), cfg, drafter).pending_width == 20
  assert E.make_engine(E.EngineConfig(max_draft=4, mode="fixed"), cfg,
                       drafter).pending_width == 5  # never gated


def test_drafter_with_a_cache_and_no_absorb_is_never_gated():
  cfg, drafter, _ = fx.pair("eagle")
  engine = E.make_engine(E.EngineConfig(), cfg, drafter._replace(absorb=None))
  assert not engine.decider.planner.gated
  assert E.make_engine(E.EngineConfig(), cfg, drafter).decider.planner.gated


@pytest.mark.parametrize("num_slots", [1, 3])
def test_a_new_request_starts_with_a_fresh_verdict(num_slots):
  """A request admitted to a slot is not held to the verdict of the slot's last request:
  with no other request active, the slot's `slot_pays` is True again and its margin +inf
  (judged afresh at its first drafting step); every other slot keeps its verdict and
  margin. B = 1 included (its
  per-slot state has one entry, like a batch state, and is still per request)."""
  engine, params = _engine("block", num_slots=num_slots)
  B, K = engine.config.num_slots, engine.config.max_draft
  prefill, _, init = G.compiled(engine)
  state = init(params, fx.key(0), _cost(B, K, 100.0))
  closed = state.planner._replace(slot_pays=jnp.zeros((B,), bool),
                                  pay_margin=jnp.full((B,), -0.5, jnp.float32))
  state = state._replace(planner=closed)
  slot = B - 1
  prompt = jnp.asarray([3, 1, 4, 1, 5, 0, 0, 0], jnp.int32)
  state = prefill(params, state, prompt, jnp.int32(5), jnp.int32(slot), jnp.int32(8))
  want = np.arange(B) == slot
  np.testing.assert_array_equal(state.planner.slot_pays, want)
  np.testing.assert_array_equal(state.planner.pay_margin, np.where(want, np.inf, -0.5))
  # The next step drafts for the new request (the gate's own answer, before any step).
  np.testing.assert_array_equal(
      engine.decider.draft_slots(state.decision, state.active), want & np.asarray(state.active))


def test_a_batch_verdict_is_kept_at_admission():
  """A `[1]` (batch) verdict for B > 1 is not a request's: admission leaves it alone."""
  planner = core.PlannerState(budget=jnp.int32(0), step=jnp.int32(0),
                              slot_pays=jnp.zeros((1,), bool),
                              pay_margin=jnp.full((1,), -0.5, jnp.float32))
  kept = core._fresh_verdict(planner, jnp.int32(2), 3, jnp.ones((3,), bool))
  assert not bool(kept.slot_pays[0]) and float(kept.pay_margin[0]) == -0.5


def test_a_new_request_starts_with_the_batch_view():
  """Beside other active requests, a new one tries drafting iff drafting pays for one of
  them: where nothing pays (a large batch on a compute-bound device) an admission costs
  no drafting step; inactive slots' verdicts do not count."""
  B = 4
  base = core.PlannerState(budget=jnp.int32(0), step=jnp.int32(0),
                           slot_pays=jnp.asarray([False, False, True, False]),
                           pay_margin=jnp.asarray([-0.5, -0.5, 0.7, -0.5], jnp.float32))
  active = jnp.asarray([True, True, False, False])  # slot 2 (paying) is idle
  closed = core._fresh_verdict(base, jnp.int32(3), B, active)
  np.testing.assert_array_equal(closed.slot_pays, [False, False, True, False])
  np.testing.assert_allclose(closed.pay_margin, [-0.5, -0.5, 0.7, planner_lib.WAITING])
  opened = core._fresh_verdict(base, jnp.int32(3), B, active.at[2].set(True))
  np.testing.assert_array_equal(opened.slot_pays, [False, False, True, True])
  assert np.isinf(opened.pay_margin[3])
  # Alone in the batch: the batch's last verdict decides (None before any step: tried);
  # with B = 1 every request is tried.
  alone = core._fresh_verdict(base, jnp.int32(0), B, jnp.zeros((B,), bool))
  assert bool(alone.slot_pays[0]) and np.isinf(alone.pay_margin[0])
  unpaid = base._replace(drafting_pays=jnp.asarray(False))
  alone = core._fresh_verdict(unpaid, jnp.int32(0), B, jnp.zeros((B,), bool))
  assert not bool(alone.slot_pays[0]) and float(alone.pay_margin[0]) == planner_lib.WAITING
  one = core.PlannerState(budget=jnp.int32(0), step=jnp.int32(0),
                          drafting_pays=jnp.asarray(False), slot_pays=jnp.zeros((1,), bool),
                          pay_margin=jnp.full((1,), -0.5, jnp.float32))
  alone = core._fresh_verdict(one, jnp.int32(0), 1, jnp.zeros((1,), bool))
  assert bool(alone.slot_pays[0]) and np.isinf(alone.pay_margin[0])


@pytest.mark.parametrize("last", [False, True])
def test_a_burst_into_an_idle_batch_follows_the_last_verdict(last):
  """Beside active requests none of which is judged yet (margin +inf: a burst of
  admissions into an idle batch), an untried slot is no evidence: the batch's last
  verdict (`drafting_pays`) decides. Negative control: following the untried slot (the
  rule before) opened every slot of a burst although nothing had paid before."""
  B = 4
  base = core.PlannerState(budget=jnp.int32(0), step=jnp.int32(0),
                           drafting_pays=jnp.asarray(last),
                           slot_pays=jnp.asarray([True, False, False, False]),
                           pay_margin=jnp.asarray([np.inf, -0.5, -0.5, -0.5], jnp.float32))
  active = jnp.asarray([True, False, False, False])  # slot 0 admitted, untried
  state = core._fresh_verdict(base, jnp.int32(1), B, active)
  assert bool(state.slot_pays[1]) == last
  assert float(state.pay_margin[1]) == (np.inf if last else planner_lib.WAITING)
  # The next admission sees slot 1: waiting counts as not paying.
  state = core._fresh_verdict(state, jnp.int32(2), B, active.at[1].set(True))
  assert bool(state.slot_pays[2]) == last


@pytest.mark.parametrize("paid", [False, True])
def test_a_burst_into_an_idle_batch_drafts_only_where_drafting_paid(paid):
  """End to end: after a run in which no slot's drafts paid, B requests admitted into
  the idle batch at once draft for no slot on their first step (the first one admitted,
  alone in the batch when it came, follows the batch's last verdict too); they wait for
  a re-check. After a run in which drafting paid (the control) every one tries."""
  engine, params = _engine("block", num_slots=4)
  B, K = engine.config.num_slots, engine.config.max_draft
  prefill, _, init = G.compiled(engine)
  state = init(params, fx.key(0), _cost(B, K, 100.0))
  closed = state.planner._replace(slot_pays=jnp.zeros((B,), bool),
                                  pay_margin=jnp.full((B,), -0.5, jnp.float32),
                                  drafting_pays=jnp.asarray(paid))
  state = state._replace(planner=closed)
  prompt = jnp.asarray([3, 1, 4, 1, 5, 0, 0, 0], jnp.int32)
  for slot in range(B):
    state = prefill(params, state, prompt, jnp.int32(5), jnp.int32(slot), jnp.int32(8))
  np.testing.assert_array_equal(
      engine.decider.draft_slots(state.decision, state.active), np.full(B, paid))


@pytest.mark.parametrize("kind,copy_target", [("draft_lm", True), ("eagle", False),
                                              ("block", False)])
def test_the_outcome_check_reopens_slots_and_keeps_greedy_identity(kind, copy_target):
  """`outcome_check` (the gate's outcome check, `Planner.observe`) on: the estimator's
  prior predicts almost no acceptance (intercept -6, no refit within the run), so the
  plan judges every drafting slot closed; where its labelled drafts were accepted the
  slot reopens at the next step. Output: exactly target-only greedy decoding, with the
  check on or off. With the target as drafter (every draft accepted) the check reopens
  slots, so the run drafts on more steps and takes fewer; off, it drafts only on re-checks
  and admissions (the negative control)."""
  want = [fx.greedy_reference(copy_target, p, n) for p, n in zip(PROMPTS, MAX_NEW)]
  runs = {}
  for check in (True, False):
    engine, params = _engine(kind, copy_target, outcome_check=check, init_intercept=-6.0,
                             refit_interval=1000)
    assert engine.config.planner.outcome_check is check
    B, K = engine.config.num_slots, engine.config.max_draft
    result = E.generate(engine, params, PROMPTS, max_new_tokens=MAX_NEW, key=fx.key(0),
                        cost=_cost(B, K, 0.5), keep_infos=True)
    assert [c.tokens for c in result.completions] == want, f"outcome_check={check}"
    infos = result.infos
    active = np.concatenate([i.active for i in infos]) > 0
    runs[check] = (np.concatenate([i.drafting for i in infos])[active], active.sum())
  if copy_target:
    (on, steps_on), (off, steps_off) = runs[True], runs[False]
    assert on.sum() > off.sum(), (on.sum(), off.sum())
    assert steps_on < steps_off, (steps_on, steps_off)
