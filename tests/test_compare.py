"""`av_lab.compare` on tiny random models: two arms, wall and modelled clocks, the JSON's
schema, ratios computed from the records, and bad input refused by name (~1 min)."""

import json

import av_jax

import jax
import numpy as np
import pytest

from av_lab import cli
from av_lab import compare as C
from av_jax import models as M
from tests import _engine_fixtures as fx


def _pair(kind):
  cfg, drafter, params = fx.pair(kind)
  return M.ModelPair("tiny-random", cfg, None, params.target, drafter, params.drafter)


def _prompts(pair, workload, *, num, length, seed):
  rng = np.random.default_rng([seed, len(workload)])
  return rng.integers(1, fx.VOCAB, (num, min(length, 6))).tolist()


def _compare(clock, tmp_path):
  result = C.compare(drafters="block", workloads="code", concurrency=[2], arms="fixed:2,av",
                     repeats=2, clock=clock, max_draft=2, max_new=6, prompt_len=6,
                     requests_per_slot=2, steps_per_chunk=4, refit_interval=4,
                     context_len=256, pairs={"block": _pair("block")}, prompts=_prompts,
                     log=lambda line: None)
  path = tmp_path / "out.json"
  C.write_json(str(path), result)
  return json.loads(path.read_text())


@pytest.mark.parametrize("clock", ["wall", "h200:llama3-8b"])
def test_compare_json_schema_and_ratios(clock, tmp_path):
  out = _compare(clock, tmp_path)
  s = out["settings"]
  assert s["arms"] == ["fixed:2", "av"] and s["concurrency"] == [2] and s["clock"] == clock
  recs = {r["arm"]: r for r in out["results"]}
  assert set(recs) == {"fixed:2", "av"}
  for r in recs.values():
    for field in ("drafter", "workload", "concurrency", "arm", "clock", "tokens_per_s",
                  "per_request_tokens_per_s", "repeats"):
      assert field in r
    assert (r["drafter"], r["workload"], r["concurrency"], r["clock"]) == ("block", "code", 2,
                                                                            clock)
    per = [x["tokens_per_s"] for x in r["repeats"]]
    assert len(per) == 2 and r["tokens_per_s"] == pytest.approx(np.median(per))
    assert r["per_request_tokens_per_s"] == pytest.approx(
        np.median([x["per_request_tokens_per_s"] for x in r["repeats"]]))
    assert r["wall_tokens_per_s"] > 0 and r["per_request_tokens_per_s"] <= r["tokens_per_s"]
  av, fixed = recs["av"], recs["fixed:2"]
  assert av["best_static"] == "fixed:2"
  assert av["vs_best_static"] == pytest.approx(av["tokens_per_s"] / fixed["tokens_per_s"])
  assert av["vs"]["fixed:2"] == pytest.approx(av["tokens_per_s"] / fixed["tokens_per_s"])
  assert "vs" not in fixed and fixed["vs_best_static"] == pytest.approx(1.0)
  if clock == "wall":
    assert "clock_label" not in av
    for r in recs.values():  # the wall clock's figure is the wall figure
      assert r["tokens_per_s"] == pytest.approx(r["wall_tokens_per_s"])
      # Steady state: the chunks with every slot busy, a subset of the run's steps.
      assert r["steady_tokens_per_s"] > 0
      assert r["steady_tokens_per_s"] == pytest.approx(r["wall_steady_tokens_per_s"])
      for x in r["repeats"]:
        assert 0 < x["steady_steps"] <= x["steps"]
      # A parallel drafter runs one pass per drafting step: fixed K drafts on every step;
      # AV's share of drafting steps follows this machine's measured tables (it may be 0).
      assert 0 <= r["draft_passes_per_step"] <= 1.0
    assert fixed["draft_passes_per_step"] == pytest.approx(1.0)
    # Exploration's cost (the share of AV's priced step cost on drafting steps); a static
    # arm has no tables on the wall clock.
    assert 0.0 <= av["drafting_cost_share"] <= 1.0 and fixed["drafting_cost_share"] is None
    assert av["steady_vs_best_static"] == pytest.approx(
        av["steady_tokens_per_s"] / fixed["steady_tokens_per_s"])
  else:
    assert fixed["drafting_cost_share"] == pytest.approx(1.0)  # every busy step drafts
    assert av["clock_label"].startswith("modelled: h200, target llama3-8b, llama3-8b-dflash")
    assert s["drafter_shapes"] == {"block": "llama3-8b-dflash"} and s["context_len"] == 256
    for r in recs.values():  # modelled throughput from the modelled seconds
      for x in r["repeats"]:
        assert x["tokens_per_s"] == pytest.approx(x["tokens"] / x["modelled_seconds"])
        assert x["wall_tokens_per_s"] == pytest.approx(x["tokens"] / x["seconds"])


def test_bad_names_list_the_known_ones():
  with pytest.raises(ValueError, match=r"arms: .*known arms: \('target_only'"):
    C.parse_arms("target_only,fixd:2")
  with pytest.raises(ValueError, match="each arm at most once"):
    C.parse_arms("av,av")
  with pytest.raises(ValueError, match=r"clock: unknown device 'h300'; known: \['h100'"):
    C.parse_clock("h300:llama3-8b")
  with pytest.raises(ValueError, match="clock: unknown shape 'llama9'; known:"):
    C.parse_clock("h200:llama9")
  with pytest.raises(ValueError, match="workload: unknown"):
    C.compare(workloads="poetry", pairs={"block": _pair("block")}, prompts=_prompts)
  with pytest.raises(ValueError, match="concurrency: expected"):
    C.compare(concurrency="4,x", pairs={"block": _pair("block")}, prompts=_prompts)
  for argv, word in ((["--arms", "av,bogus"], "arms"), (["--clock", "tpu9:llama3-8b"], "clock"),
                     (["--workload", "poetry"], "workload"), (["--repeats", "0"], "repeats")):
    with pytest.raises(SystemExit):
      cli.main(["compare"] + argv)


def test_arm_names_come_from_the_registry():
  arms = C.parse_arms("target_only,fixed:4,av,oracle:3", max_draft=6)
  assert [(a.mode, a.k) for a in arms] == [("target_only", 1), ("fixed", 4), ("av", 6),
                                           ("oracle", 3)]
  assert [a.static for a in arms] == [True, True, False, False]


def test_every_adaptive_arm_plans_with_profiled_tables():
  """`av` plans with the engine's profiled tables, not the default ones, and the oracle is
  charged with the same tables."""
  pair = _pair("block")
  runner = C.Runner(temperature=1.0, top_p=1.0, max_len=24, refit_interval=4,
                    steps_per_chunk=4, log=lambda line: None)
  prompts = _prompts(pair, "code", num=2, length=6, seed=0)
  tables = {}
  for name in ("oracle", "fixed:2", "av"):
    arm = C.parse_arms(name, max_draft=2)[0]
    _, cost = runner.engine(pair, 2, arm, prompts)
    profiled = runner.profile(pair, 2, arm)
    if name == "fixed:2":
      assert profiled is None and cost is None
    else:
      assert profiled is not None and cost is not None
      assert np.asarray(cost.verify_ms).shape[0] > 1
      tables[name] = cost
  # One profile (the AV engine's) prices both arms: the same hardware tables.
  for a, b in zip(jax.tree.leaves(tables["av"]), jax.tree.leaves(tables["oracle"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_confidence_thresholds_reach_the_engine():
  """`confstop:0.5` and `confstop:0.8` are two engines with their own T (the mode used to
  be the bare arm name, so every confstop arm ran at the default T = 0.5)."""
  from av_jax import engine as E
  arms = C.parse_arms("confstop:0.5,confstop:0.8,confstop,av", max_draft=4)
  assert [a.mode for a in arms] == ["confstop:0.5", "confstop:0.8", "confstop:0.5", "av"]
  for arm, want in zip(arms[:3], (0.5, 0.8, 0.5)):
    config = E.EngineConfig(num_slots=2, max_draft=arm.k, max_len=24, mode=arm.mode)
    engine = E.make_engine(config, *fx.pair("eagle")[:2])
    assert engine.arm.threshold == want
    assert engine.decider.planner.config.confidence_threshold == want


def test_num_buckets_reaches_every_engine_and_the_cli_parses_it():
  """`compare(num_buckets=N)` / `av-jax compare --num-buckets N`: every engine's config
  carries N (a static arm keeps its one bucket); None keeps the engine's default; a
  non-positive N is refused naming the flag."""
  import argparse
  from av_lab import cli
  from av_jax import engine as E
  arm_av, arm_fixed = C.parse_arms("av,fixed:4", max_draft=8)
  for n, want in ((None, E.Programs().num_buckets), (6, 6)):
    runner = C.Runner(temperature=1.0, top_p=1.0, max_len=24, refit_interval=4,
                      num_buckets=n, log=lambda *_: None)
    config = runner._config(1, arm_av)
    assert config.programs.num_buckets == want
    assert runner._config(1, arm_fixed).bucket_sizes() == (5,)
  assert E.EngineConfig(num_slots=1, max_draft=8, programs=E.Programs(
      num_buckets=6)).bucket_sizes() == (1, 2, 4, 6, 9)
  parser = argparse.ArgumentParser()
  cli._compare_args(parser)
  assert parser.parse_args(["--num-buckets", "6"]).num_buckets == 6
  assert parser.parse_args([]).num_buckets is None
  with pytest.raises(SystemExit):
    parser.parse_args(["--num-buckets", "0"])


def test_steps_per_chunk_reaches_compare_from_the_cli(monkeypatch):
  """`av-jax compare --steps-per-chunk N` hands N to `compare` (a freed slot is refilled
  only between chunks: 1 admits every step); the default stays 8; 0 is refused."""
  import argparse
  seen = {}
  monkeypatch.setattr(C, "compare", lambda **kw: seen.update(kw) or {"results": []})
  cli.main(["compare", "--steps-per-chunk", "1", "--concurrency", "2"])
  assert seen["steps_per_chunk"] == 1
  parser = argparse.ArgumentParser()
  cli._compare_args(parser)
  assert parser.parse_args([]).steps_per_chunk == 8
  with pytest.raises(SystemExit):
    parser.parse_args(["--steps-per-chunk", "0"])


def test_wall_cost_picks_the_tables_av_plans_with_on_the_wall_clock(monkeypatch):
  """`--wall-cost modelled` hands `compare` a `wall_cost` that returns
  `machine_tables(models, drafter kind, engine config).cost`; the default (profiled)
  hands None, so `compare` profiles; another value is refused."""
  import argparse
  import types
  seen, asked = {}, []
  monkeypatch.setattr(C, "compare", lambda **kw: seen.update(kw) or {"results": []})
  monkeypatch.setattr(C, "machine_tables", lambda models, kind, config: asked.append(
      (models, kind, config)) or types.SimpleNamespace(cost="the modelled cost"))
  cli.main(["compare", "--concurrency", "2"])
  assert seen["wall_cost"] is None
  cli.main(["compare", "--concurrency", "2", "--wall-cost", "modelled"])
  pair = types.SimpleNamespace(drafter=types.SimpleNamespace(kind="eagle"))
  engine = types.SimpleNamespace(config="the engine's config")
  assert seen["wall_cost"](pair, engine) == "the modelled cost"
  assert asked == [("default", "eagle", "the engine's config")]
  parser = argparse.ArgumentParser()
  cli._compare_args(parser)
  with pytest.raises(SystemExit):
    parser.parse_args(["--wall-cost", "guessed"])


def test_a_comparison_without_a_static_arm_still_prints():
  """No static arm (e.g. `--arms av,oracle`): no best static arm,
  and the table still prints (it crashed after the timing, losing the results)."""
  row = dict(drafter="eagle", workload="mixed", concurrency=4, clock="wall", k=8, repeat=0,
             tokens_per_s=10.0, per_request_tokens_per_s=2.5, wall_tokens_per_s=10.0,
             wall_per_request_tokens_per_s=2.5, tokens_per_step=2.0, verified_per_step=1.0,
             acceptance=0.5, drafted_share=1.0, draft_passes_per_step=3.0)
  recs = C.records([dict(row, arm="av", mode="av"),
                    dict(row, arm="oracle", mode="oracle", tokens_per_s=8.0)])
  assert all(r["vs_best_static"] is None for r in recs)
  text = C.format_group(recs)
  assert "av: no static arm" in text and "oracle" in text


def test_a_warm_start_fits_only_adaptive_arms():
  """Under warm_start only an adaptive arm decodes the warm-up prompts and continues from
  its state (the estimator it fitted); a static arm warms up with a short compile run and
  every run of it starts fresh, so a sweep does not decode every prompt once more per
  static arm (the accelerator-scale study's time)."""
  pair = _pair("block")
  runner = C.Runner(temperature=1.0, top_p=1.0, max_len=40, refit_interval=4,
                    steps_per_chunk=4, warm_start=True, log=lambda line: None)
  runner.warm_tokens = 8
  prompts = _prompts(pair, "code", num=4, length=6, seed=0)
  fixed, av = C.parse_arms("fixed:2,av", max_draft=2)
  runner.engine(pair, 2, fixed, prompts)
  runner.engine(pair, 2, av, prompts)
  assert ("block", 2, fixed) not in runner._states
  warm = runner._states[("block", 2, av)]
  # Every warm-up prompt decoded (each one's first token comes from its prefill).
  assert int(jax.device_get(warm.stats.emitted)) == 4 * (8 - 1)
  rows = {arm.name: runner.run(pair, 2, arm, prompts, max_new=6, repeat=0) for arm in (fixed, av)}
  # Each run counts its own tokens only (the warm-up's are subtracted for the adaptive arm).
  assert rows["fixed:2"]["tokens"] == rows["av"]["tokens"] == 4 * (6 - 1)
  assert ("block", 2, fixed) not in runner._states
  assert runner._states[("block", 2, av)] is not warm


def test_depth_cap_runs_av_on_the_engine_of_the_chosen_cap(monkeypatch):
  """`compare(depth_cap=True)`: after the av arm's warm-up on its K = 4 engine,
  `policy.depth_cap` gets the running requests' predicted survival curves after every
  chunk of it, each weighted by the tokens its request emitted in the chunk, and one
  table per cap 1..4, priced as a block
  drafter's plan prices its drafting (every drafting row to the deepest depth); the timed runs are on
  the engine of the cap it returns, warmed up in turn; a static arm is untouched.
  Without a warm start (no fitted estimator) it is refused."""
  from av_jax import policy as P
  seen = {}

  def fake(survival, costs, *, num_slots, weights, shared_passes):
    seen.update(shape=np.shape(survival), caps=[np.shape(c.draft_depth_ms) for c in costs],
                num_slots=num_slots, weights=np.asarray(weights), shared_passes=shared_passes)
    return P.DepthCap(cap=2, rates=np.asarray([1.0, 2.0, 1.5, 1.2]))

  monkeypatch.setattr(C.P, "depth_cap", fake)
  lines = []
  result = C.compare(drafters="block", workloads="code", concurrency=[2], arms="fixed:1,av",
                     repeats=1, clock="h200:llama3-8b", max_draft=4, max_new=10, prompt_len=6,
                     requests_per_slot=2, steps_per_chunk=1, refit_interval=4,
                     warm_start=True, depth_cap=True, pairs={"block": _pair("block")},
                     prompts=_prompts, log=lines.append)
  # One curve per request and chunk after its first, weighted by the tokens it emitted
  # in the chunk (1 to K + 1: one step a chunk).
  assert seen["shape"][0] >= 2 and seen["shape"][1] == 4
  assert seen["weights"].shape == seen["shape"][:1]
  assert np.all((seen["weights"] >= 1) & (seen["weights"] <= 5))
  assert seen["num_slots"] == 2
  assert [c[1] for c in seen["caps"]] == [1, 2, 3, 4]
  assert seen["shared_passes"] is True  # a block drafter drafts its whole block
  ks = {r["arm"]: r["k"] for r in result["results"]}
  assert ks == {"fixed:1": 1, "av": 2}
  assert any("depth cap block B=2 av: K = 2" in line for line in lines)
  assert result["settings"]["depth_cap"] is True
  with pytest.raises(ValueError, match="depth_cap"):
    C.compare(drafters="block", workloads="code", concurrency=[2], arms="av", repeats=1,
              clock="h200:llama3-8b", max_draft=2, max_new=4, prompt_len=6,
              steps_per_chunk=4, depth_cap=True, pairs={"block": _pair("block")},
              prompts=_prompts, log=lambda line: None)


def test_drafting_cost_share_by_hand():
  """Steps priced `draft_cost(rows) + verify_cost(active + verified)`: two busy steps, one
  drafting (rows 1, 2 tokens verified), one not; an idle step is not counted."""
  cost = av_jax.make_cost_model(np.array([0.0, 1.0, 2.0]), np.arange(7, dtype=float))
  engine = type("E", (), {"config": type("C", (), {"num_slots": 2})()})()
  active, verified = np.array([2, 2, 0]), np.array([2, 0, 0])
  drafted, rows, busy = np.array([True, False, False]), np.array([1, 0, 0]), active > 0
  # drafting step 1 + 4, plain step 2: 5 / 7
  assert C._drafting_cost_share(cost, engine, active, verified, drafted, rows,
                                busy) == pytest.approx(5 / 7)
  assert C._drafting_cost_share(cost, engine, active, verified, drafted & False, rows,
                                busy) == 0.0
  assert C._drafting_cost_share(None, engine, active, verified, drafted, rows, busy) is None


def test_compiling_ahead_in_threads_changes_no_modelled_figure():
  """`compile_workers=2` builds and warms every engine of a modelled sweep in two threads
  before any run; the modelled figures (priced by tables, decoded with fixed keys) are
  those of one-at-a-time compiles, and every compile precedes the first group's table."""
  out = {}
  for workers in (1, 2):
    lines = []
    result = C.compare(drafters="block", workloads="code", concurrency=[1, 2],
                       arms="fixed:2,av", repeats=1, clock="h200:llama3-8b", max_draft=2,
                       max_new=6, prompt_len=6, requests_per_slot=2, steps_per_chunk=4,
                       refit_interval=4, warm_start=True, pairs={"block": _pair("block")},
                       prompts=_prompts, log=lines.append, compile_workers=workers)
    out[workers] = {(r["concurrency"], r["arm"]): (r["tokens_per_s"], r["repeats"][0]["tokens"],
                                                   r["repeats"][0]["steps"])
                    for r in result["results"]}
    compiled = [i for i, line in enumerate(lines) if line.startswith("  compiled")]
    tables = [i for i, line in enumerate(lines) if line.startswith("block / code")]
    assert len(compiled) == 4 and len(tables) == 2
    if workers == 2:
      assert max(compiled) < min(tables)
    else:
      assert min(tables) < max(compiled)  # the second group compiles after the first's runs
  assert out[1] == out[2] and len(out[1]) == 4
