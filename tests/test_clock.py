"""The modelled clock charges exactly the sum of the tables' entries for what each step did
(recomputed here from StepInfo, loop by loop), and `generate(clock=...)` decides with them."""

import numpy as np
import pytest

from av_jax import costs
from av_jax import engine as E
from av_jax.engine import clock as CL
from tests import _engine_fixtures as fx

B, K = 4, 3


def _tables(kind: str, buckets=None):
  return costs.roofline_costs("llama3-8b", "llama3-8b-eagle3" if kind == "eagle" else
                              "llama3-8b-dflash", "h200", drafter_kind=kind, num_slots=B,
                              max_draft=K, context_len=512, buckets=buckets)


def _run(kind: str, mode: str, tables):
  cfg, drafter, params = fx.pair(kind)
  config = E.EngineConfig(num_slots=B, max_draft=K, max_len=32, mode=mode,
                          programs=E.Programs(steps_per_chunk=4))
  engine = E.make_engine(config, cfg, drafter)
  rng = np.random.default_rng(0)
  prompts = rng.integers(1, fx.VOCAB, (6, 5)).tolist()
  result = E.generate(engine, params, prompts, max_new_tokens=[9, 5, 12, 3, 7, 10],
                      key=fx.key(0), keep_infos=True, clock=tables)
  return engine, result


def _expected_ms(infos, tables, engine, verify):
  """Per-step charges, by hand: a loop over steps and depths."""
  out = []
  for info in infos:
    for s in range(len(info.active)):
      r, passes = int(info.active[s]), int(info.draft_passes[s])
      if r == 0:
        out.append(0.0)
        continue
      draft = sum(float(tables.draft_depth_ms[r, d]) for d in range(passes))
      if verify == "tokens":
        fed = int(np.sum(info.slot_active[s] * (1 + info.num_verified[s])))
        check = float(tables.cost.verify_ms[fed])
      else:
        check = float(tables.bucket_ms[int(info.bucket[s])])
      out.append(draft + check)
  return np.asarray(out)


@pytest.mark.parametrize("kind,mode", [("eagle", "av"), ("block", "av"), ("block", "fixed"),
                                       ("block", "target_only")])
def test_clock_charges_exactly_the_table_entries(kind, mode):
  cfg, drafter, _ = fx.pair(kind)
  config = E.EngineConfig(num_slots=B, max_draft=K, max_len=32, mode=mode,
                          programs=E.Programs(steps_per_chunk=4))
  buckets = E.make_engine(config, cfg, drafter).buckets
  tables = _tables(kind, buckets)
  engine, result = _run(kind, mode, tables)
  infos = result.infos
  passes = np.concatenate([i.draft_passes for i in infos])
  drafting = np.concatenate([i.drafting for i in infos])
  any_active = np.concatenate([np.any(i.slot_active, axis=-1) for i in infos])
  ran = drafting & any_active
  if kind == "eagle" and mode == "av":  # survival stop: 1..K passes, fewer when it stopped
    assert np.all(passes[ran] >= 1) and np.all(passes[ran] <= K)
    np.testing.assert_array_equal(passes[~ran], 0)
  else:
    np.testing.assert_array_equal(passes, np.where(ran, K if kind == "eagle" else 1, 0))
  if mode == "target_only":
    assert not drafting.any()
  else:
    assert drafting.any()
  for verify in ("tokens", "bucket"):
    ms = CL.step_ms(infos, tables, verify=verify, engine_buckets=engine.buckets)
    np.testing.assert_allclose(ms, _expected_ms(infos, tables, engine, verify), rtol=1e-12)
  # generate's figures are the "tokens" charges of the same steps.
  expected = _expected_ms(infos, tables, engine, "tokens")
  m = result.modelled
  assert m["seconds"] == pytest.approx(expected.sum() / 1e3, rel=1e-12)
  assert m["tokens_per_s"] == pytest.approx(result.stats["emitted"] / m["seconds"])
  active = np.concatenate([i.active for i in infos])
  assert m["per_request_tokens_per_s"] == pytest.approx(
      m["tokens_per_s"] / active[active > 0].mean())
  assert m["label"].startswith("modelled: h200") and result.wall_s > 0


def test_the_planner_decides_with_the_clock_tables():
  tables = _tables("block")
  _, result = _run("block", "av", tables)
  np.testing.assert_array_equal(np.asarray(result.state.cost.verify_ms), tables.cost.verify_ms)
  np.testing.assert_array_equal(np.asarray(result.state.cost.draft_ms), tables.cost.draft_ms)


def test_bad_clock_input_is_refused_by_name():
  tables = _tables("block")
  with pytest.raises(ValueError, match="clock: 'modelled' needs cost="):
    _run("block", "av", "modelled")
  with pytest.raises(ValueError, match="clock: expected"):
    _run("block", "av", "h200")
  rec = CL.ClockRecord(*(np.array([1]) for _ in CL.ClockRecord._fields))
  with pytest.raises(ValueError, match="verify: expected"):
    CL.step_ms(rec, tables, verify="padded")
  with pytest.raises(ValueError, match="buckets"):
    CL.step_ms(rec, tables, verify="bucket", engine_buckets=(5, 16))
  big = rec._replace(active=np.array([B + 1]))
  with pytest.raises(ValueError, match="draft_depth_ms has rows"):
    CL.step_ms(big, tables)
