"""A gated engine's quiet program: the steps on which no slot drafts run
in a program of their own, a target-only step's with the decision's bookkeeping, and
`generate` switches between it and the drafting program on the host.

The decisions are the state's (rule 2), so a run split that way must compute what the
one-program chunk computes, step for step: the tests compare tokens and records bit for
bit (the estimator's float state to a few ulp), for
every drafter kind, greedy and sampled, with gated stretches long enough that an
autoregressive drafter's backlog fills and is absorbed inside the quiet program. The
negative control: the quiet step run where the gate lets a slot draft is not the step
the engine must run there, so the switch's guard is what keeps the runs equal.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from av_jax import engine as E
from av_jax.engine import batching as G
from av_jax.engine import core
from av_jax.estimator import EstimatorConfig
from av_jax.sampling import Sampling
from av_jax.selection import make_cost_model

from tests import _engine_fixtures as fx
from tests.test_engine_inplace import _loop_copies

PROMPTS = [[1, 2, 3], [4], list(range(5, 22)), [7, 7, 7, 7, 7, 7], [9, 3]]
MAX_NEW = [40, 30, 6, 33, 12]


def _cost(B, K, draft_ms):
  return make_cost_model(np.full(B + 1, draft_ms), 1.0 + 0.02 * np.arange(B * (K + 1) + 1))


def _engine(kind, quiet_program, *, mode="av", temperature=0.0, drafter_backlog=None):
  # The estimator refits every 4 steps, so what it learns changes the plan within a run
  # of ~40 steps (with the default 100 the plan stays at its prior: all steps or none).
  cfg, drafter, _ = fx.pair(kind)
  config = E.EngineConfig(num_slots=3, max_draft=4, max_len=64, mode=mode,
                          sampling=Sampling(temperature=temperature),
                          estimator=EstimatorConfig(refit_interval=4),
                          programs=E.Programs(steps_per_chunk=4, quiet_program=quiet_program,
                                              drafter_backlog=drafter_backlog))
  return E.make_engine(config, cfg, drafter)


def _run(kind, quiet_program, price, key=0, **overrides):
  engine = _engine(kind, quiet_program, **overrides)
  params = fx.pair(kind)[2]
  B, K = engine.config.num_slots, engine.config.max_draft
  return E.generate(engine, params, PROMPTS, max_new_tokens=MAX_NEW, key=fx.key(key),
                    cost=_cost(B, K, price), keep_infos=True)


def _records(result):
  return jax.tree.map(lambda *x: np.concatenate(x), *result.infos)


@pytest.mark.parametrize("kind,temperature,backlog,price", [
    ("block", 1.0, None, 2.0), ("eagle", 0.0, 6, 3.0), ("draft_lm", 1.0, None, 3.0),
    ("eagle", 1.0, 6, 3.0), ("draft_lm", 0.0, 6, 3.0), ("block", 0.0, None, 0.5)])
def test_a_run_split_into_quiet_and_drafting_programs_is_the_one_program_run(
    kind, temperature, backlog, price):
  """Tokens, every step record and the running totals are bit-identical with and without
  the quiet program; the estimator's and the decision's float state to 4 ulp. Prices 2-3:
  drafting pays for some requests and steps, so both kinds of step occur (with a backlog of
  6 (K + 2) an autoregressive drafter's full backlogs are absorbed on quiet steps); 0.5: drafting
  pays and most steps draft (the drain's steps are quiet)."""
  overrides = dict(temperature=temperature, drafter_backlog=backlog)
  one, split = (_run(kind, q, price, **overrides) for q in (False, True))
  assert [c.tokens for c in split.completions] == [c.tokens for c in one.completions]
  a, b = _records(one), _records(split)
  for name, x, y in zip(a._fields, a, b):
    np.testing.assert_array_equal(y, x, err_msg=name)
  drafting = a.drafting[a.active > 0]
  assert drafting.any() and not drafting.all() if price > 1 else drafting.mean() > 0.5
  assert 0 < a.num_verified.sum()
  for x, y in zip(jax.tree.leaves((one.state.estimator, one.state.planner)),
                  jax.tree.leaves((split.state.estimator, split.state.planner))):
    x, y = np.asarray(x), np.asarray(y)
    if np.issubdtype(x.dtype, np.floating):
      # The refit's sums run in two different programs, whose reductions XLA may fuse
      # in another order: a few ulp apart, never more.
      np.testing.assert_array_max_ulp(y, x, maxulp=4)
    else:
      np.testing.assert_array_equal(y, x)
  assert split.stats == one.stats
  assert split.chunk_seconds and len(split.chunk_seconds) == len(one.chunk_seconds)


def test_the_comparison_sees_a_different_run():
  """Power of the equality above: a run with another key (sampled) differs in its tokens
  and its records."""
  a, b = (_run("block", True, 100.0, key=k, temperature=1.0) for k in (0, 1))
  assert [c.tokens for c in a.completions] != [c.tokens for c in b.completions]


def _busy(engine, params, price):
  B, K = engine.config.num_slots, engine.config.max_draft
  prefill, _, init = G.compiled(engine)
  state = init(params, fx.key(5), _cost(B, K, price))
  for slot, prompt in enumerate(PROMPTS[:B]):
    padded = np.zeros((32,), np.int32)
    padded[:len(prompt)] = prompt
    state = prefill(params, state, padded, np.int32(len(prompt)), np.int32(slot),
                    np.int32(40))
  return state


def _regime(engine, state, name):
  """`state` whose next plan drafts every slot ("full") or none ("skip")."""
  return state._replace(planner=engine.decider.regime(state.planner, name))


@pytest.mark.parametrize("kind", ["block", "eagle"])
def test_each_program_stops_where_the_kind_of_step_changes(kind):
  """Each program runs no step where the next one is of the other kind, and both stop at
  their limit. The plans are set by `decider.regime`."""
  engine = _engine(kind, True, temperature=1.0)
  params = fx.pair(kind)[2]
  quiet, drafting = G.compiled_modes(engine)
  n = engine.config.programs.steps_per_chunk
  state = _regime(engine, _busy(engine, params, 0.5), "full")
  assert bool(core.next_drafts(engine, state))
  state, _, count = quiet(params, state, np.int32(n))
  assert int(count) == 0
  state, records, count = drafting(params, state, np.int32(n))
  count = int(count)
  assert 1 <= count <= n and bool(np.asarray(records.drafting)[:count].all())
  assert count == n or not bool(core.next_drafts(engine, state))
  assert not np.asarray(records.drafting)[count:].any()  # rows past the count are zeros
  state = _regime(engine, state, "skip")
  assert not bool(core.next_drafts(engine, state))
  _, _, none = drafting(params, jax.tree.map(jnp.copy, state), np.int32(n))
  assert int(none) == 0
  state, records, count = quiet(params, state, np.int32(n))
  assert int(count) == n and not np.asarray(records.drafting).any()
  assert np.asarray(records.active)[:n].min() == engine.config.num_slots
  state = _regime(engine, state, "full")
  state, records, count = drafting(params, state, np.int32(1))
  assert int(count) == 1 and bool(np.asarray(records.drafting)[0])


def test_the_quiet_step_where_a_slot_drafts_is_not_the_engines_step():
  """Negative control: where the plan lets a slot draft, the quiet step computes something
  else than `step` (it drafts nothing and learns nothing), so the programs' guard
  (`next_drafts`) is what makes the split run equal the one-program run."""
  engine = _engine("block", True, temperature=1.0)
  params = fx.pair("block")[2]
  state = _regime(engine, _busy(engine, params, 0.5), "full")
  assert bool(core.next_drafts(engine, state))
  fresh = lambda: jax.tree.map(jnp.copy, state)
  a, info_a = jax.jit(lambda p, s: core.step(engine, p, s))(params, fresh())
  b, info_b = jax.jit(lambda p, s: core.quiet_step(engine, p, s))(params, fresh())
  assert bool(info_a.drafting) and not bool(info_b.drafting)
  assert int(info_a.verified) > 0 and int(info_b.verified) == 0
  assert int(a.stats.labeled_at.sum()) > 0 and int(b.stats.labeled_at.sum()) == 0
  assert not np.array_equal(np.asarray(a.planner.memory.latest),
                            np.asarray(b.planner.memory.latest))


def test_the_drafting_step_where_no_slot_drafts_is_not_the_engines_step():
  """Negative control: where the plan lets no slot draft, the drafting step computes
  something else than `step` (it verifies the base tokens through a packed bucket and
  rejection sampling, not a target-only step's pass and draw: other tokens from the same
  cache entries), so `next_drafts` is what makes the split run equal the one-program
  run."""
  engine = _engine("block", True, temperature=1.0)
  params = fx.pair("block")[2]
  state = _regime(engine, _busy(engine, params, 0.5), "skip")
  assert not bool(core.next_drafts(engine, state))
  fresh = lambda: jax.tree.map(jnp.copy, state)
  a, info_a = jax.jit(lambda p, s: core.step(engine, p, s))(params, fresh())
  b, info_b = jax.jit(lambda p, s: core.drafting_step(engine, p, s))(params, fresh())
  assert not bool(info_a.drafting) and not bool(info_b.drafting)
  assert not np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  # Both passes write the same base tokens' keys (to rounding: the packed pass may sum in
  # another order), so the draw is what differs.
  np.testing.assert_allclose(np.asarray(a.target_cache.k), np.asarray(b.target_cache.k),
                             rtol=1e-5, atol=1e-5)


def test_a_quiet_step_needs_a_gated_engine():
  engine = _engine("block", True, mode="fixed")
  with pytest.raises(ValueError, match="engine: a quiet step needs a gated engine"):
    core.quiet_step(engine, fx.pair("block")[2], None)
  with pytest.raises(ValueError, match="engine: a drafting step needs a gated engine"):
    core.drafting_step(engine, fx.pair("block")[2], None)
  assert not core.splits_quiet(engine)
  assert not core.splits_quiet(_engine("block", False))
  assert core.splits_quiet(_engine("block", True))
  assert len(G.decode_programs(_engine("block", False))) == 1


@pytest.mark.parametrize("kind", ["block", "eagle"])
def test_the_quiet_program_copies_no_cache(kind):
  """In place, as `run_chunk` is (tests/test_engine_inplace.py): no copy of the target
  cache inside either program's loop, nor of an autoregressive drafter's cache inside the
  quiet program's."""
  cfg, drafter, params = fx.pair(kind)
  B, max_len = 4, 64
  engine = core.make_engine(E.EngineConfig(mode="av", num_slots=B, max_draft=4,
                                           max_len=max_len,
                                           programs=E.Programs(steps_per_chunk=3)),
                            cfg, drafter)
  program = lambda p, s: core.run_mode(engine, p, s, 3, quiet=True)
  assert _loop_copies(engine, params, B, max_len, program=program) == 0
  drafting = lambda p, s: core.run_mode(engine, p, s, 3, quiet=False)
  assert _loop_copies(engine, params, B, max_len, program=drafting) == 0
  if kind == "eagle":
    assert _loop_copies(engine, params, B, max_len, program=program,
                        field=lambda state: state.drafter.cache.k) == 0


@pytest.mark.parametrize("quiet", [True, False])
def test_a_mode_program_traces_its_step_once(quiet, monkeypatch):
  """The loop body and its records' shapes come from one trace of the step (tracing is
  most of an AV program's lowering time)."""
  engine = _engine("eagle", True)
  params = fx.pair("eagle")[2]
  traces = []
  step = core._gated_step
  monkeypatch.setattr(core, "_gated_step", lambda *a, **k: traces.append(1) or step(*a, **k))
  state = jax.eval_shape(lambda: G.compiled(engine)[2](params, fx.key(0), None))
  jax.eval_shape(lambda p, s: core.run_mode(engine, p, s, 3, quiet=quiet), params, state)
  assert len(traces) == 1


@pytest.mark.parametrize("compile_ahead", [True, False])
def test_generate_compiles_the_drafting_program_before_its_first_chunk(compile_ahead,
                                                                       monkeypatch):
  """A server's first drafting step must not stall on a compile: `generate` compiles the
  quiet and the drafting program before its first chunk, even in a run that never drafts
  (drafting priced out). The negative control (`compile_ahead=False`: the compile step
  removed) must leave the drafting program uncompiled, so the count read is the jit's
  own. Each case builds an engine of its own length, so no other test compiled it."""
  if not compile_ahead:
    monkeypatch.setattr(G._ChunkRunner, "compile", lambda self, params, state: state)
  cfg, drafter, params = fx.pair("block")
  config = E.EngineConfig(num_slots=2, max_draft=3, max_len=41 + compile_ahead, mode="av",
                          sampling=Sampling(temperature=0.0),
                          programs=E.Programs(steps_per_chunk=4, quiet_program=True))
  engine = E.make_engine(config, cfg, drafter)
  result = E.generate(engine, params, [[1, 2, 3], [4, 5]], max_new_tokens=6, key=fx.key(0),
                      cost=_cost(2, 3, 1e6), keep_infos=True)
  assert not _records(result).drafting.any()
  quiet, drafting = G.compiled_modes(engine)
  assert quiet._cache_size() == 1  # pylint: disable=protected-access
  assert drafting._cache_size() == int(compile_ahead)  # pylint: disable=protected-access
