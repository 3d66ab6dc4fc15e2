"""The command line refuses bad flags with an argparse error that names the flag and says
what was expected (exit status 2, before any model is loaded: fast)."""

import json
import sys

import jax
import pytest

from av_jax import _flags, cli
from av_jax.studies import report as R
from av_jax.studies.settings import Settings


@pytest.mark.parametrize("argv,message", [
    ("generate --prompt x --models nosuch", "argument --models: unknown model set 'nosuch'; "
                                            "available: default"),
    ("profile --models nosuch", "available: default"),
    ("demo --models nosuch", "available: default"),
    ("generate --prompt x --slots 0", "argument --slots: expected an integer >= 1, got '0'"),
    ("generate --prompt x --k 0", "argument --k: expected an integer >= 1"),
    ("generate --prompt x --k two", "argument --k: expected an integer >= 1, got 'two'"),
    ("generate --prompt x --top-p 0", "argument --top-p: expected a nucleus mass in (0, 1]"),
    ("generate --prompt x --top-p 1.5", "argument --top-p: expected a nucleus mass in (0, 1]"),
    ("generate --prompt x --temperature -1", "argument --temperature: expected a finite"),
    ("generate --prompt x --max-len 8", "argument --max-len: expected >= --k + 3 = 11"),
    ("profile --k 4 --max-len 6", "argument --max-len: expected >= --k + 3 = 7"),
    ("generate --prompt x --max-new 0", "argument --max-new: expected an integer >= 1"),
    ("demo --requests 0", "argument --requests: expected an integer >= 1, got '0'"),
    ("demo --slots 0", "argument --slots: expected an integer >= 1"),
    ("demo --top-p 0", "argument --top-p: expected a nucleus mass"),
    ("demo --clock nowhere:x", "argument --clock: clock: unknown device"),
    ("generate --prompt x --cost guessed", "argument --cost: invalid choice"),
    ("bench --skip foo", "argument --skip: unknown studies ['foo']; known: labels, "
                         "throughput, per_workload, modelled, overhead"),
    ("bench --skip labels,foo,bar", "unknown studies ['bar', 'foo']"),
    ("bench --repeats 0", "argument --repeats: expected an integer >= 1"),
])
def test_bad_flags_are_argparse_errors_naming_the_flag(argv, message, capsys, monkeypatch):
  called = []
  monkeypatch.setattr(cli, "_build", lambda *a, **k: called.append(a))  # never reached
  with pytest.raises(SystemExit) as exit_:
    cli.main(argv.split())
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert message in err, err
  assert "Traceback" not in err and not called


def test_good_flags_parse_and_reach_the_command(monkeypatch):
  seen = []
  monkeypatch.setattr(cli, "cmd_profile", lambda args: seen.append(args))
  cli.main("profile --slots 2 --k 3 --max-len 6 --top-p 1 --temperature 0".split())
  (args,) = seen
  assert (args.slots, args.k, args.max_len, args.top_p, args.temperature) == (2, 3, 6, 1.0, 0.0)
  assert "default" in _flags.model_sets()


def test_generate_help_explains_budget_and_verified(capsys):
  with pytest.raises(SystemExit):
    cli.main(["generate", "--help"])
  out = " ".join(capsys.readouterr().out.split())
  assert "budget = draft tokens the planner chose to verify" in out
  assert "verified = draft tokens actually fed to the target" in out
  assert "compilation excluded" in out


def _minimal_results():
  return dict(command="test", settings={}, hardware=dict(
      cpu="x", usable_cores=2, backend="cpu", device="cpu", jax=jax.__version__,
      python="3", load_avg_start=[0.0, 0.0, 0.0]), timings=dict(total_s=1.0))


def test_bench_keeps_its_results_without_matplotlib(tmp_path, monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
  R.write(str(tmp_path), _minimal_results(), Settings())
  assert json.loads((tmp_path / "studies.json").read_text())["command"] == "test"
  assert (tmp_path / "studies.md").exists()
  out = capsys.readouterr().out
  assert "plots skipped" in out and "studies.json" in out and "--render-only" in out


@pytest.mark.parametrize("gaps,expected", [
    ([-0.187, -0.199], "trails it at every position (AUC gaps -0.187, -0.199"),
    ([0.02, -0.005, -0.1], "beats it at position 2 and ties it (within 0.01) at position 3 "
                           "and trails it at position 4"),
    ([0.003, 0.05], "beats it at position 3 and ties it (within 0.01) at position 2"),
])
def test_report_words_the_head_comparison_from_the_gaps(gaps, expected):
  text = R.versus_head(gaps)
  assert expected in text
  if all(g < -R.TIE for g in gaps):
    assert "ties" not in text and "beats" not in text


def _demo_results():
  """Records as `compare` returns them: concurrency 1 (speculation pays on both clocks)
  and 32 (it pays on the modelled clock only)."""
  def records(figures):
    out = []
    for c, arms in figures.items():
      best = max((a for a in arms if a != "av"), key=lambda a: arms[a])
      for arm, tok_s in arms.items():
        mode = "av" if arm == "av" else ("fixed" if arm.startswith("fixed") else arm)
        out.append(dict(concurrency=c, arm=arm, mode=mode, tokens_per_s=tok_s, best_static=best,
                        vs_best_static=tok_s / arms[best], drafted_share=0.5))
    return dict(results=out)
  modelled = {1: {"target_only": 100.0, "fixed:2": 150.0, "fixed:4": 160.0, "av": 168.0},
              32: {"target_only": 1000.0, "fixed:2": 1100.0, "fixed:4": 1050.0, "av": 1080.0}}
  wall = {1: {"target_only": 100.0, "fixed:2": 120.0, "fixed:4": 90.0, "av": 110.0},
          32: {"target_only": 200.0, "fixed:2": 150.0, "fixed:4": 100.0, "av": 190.0}}
  return dict(modelled=records(modelled), wall=records(wall))


def test_demo_paragraph_says_where_speculation_paid_from_the_numbers():
  from av_jax.engine import demo
  text = demo.summary(_demo_results(), clock="h200:llama3-8b")
  modelled, wall = text.split("On this machine's wall clock")
  assert "speculation paid at concurrency 1 (fixed:4 at 1.60x" in modelled
  assert "and 32 (fixed:2 at 1.10x" in modelled and "did not" not in modelled
  assert "1.05x the best static arm (fixed:4) at concurrency 1" in modelled
  assert "0.98x the best static arm (fixed:2) at concurrency 32" in modelled
  assert "speculation paid at concurrency 1 (fixed:2 at 1.20x" in wall
  assert "it did not at 32 (fixed:2 at 0.75x the target alone)" in wall
  only_lost = _demo_results()
  only_lost["wall"]["results"] = [r for r in only_lost["wall"]["results"] if r["concurrency"] == 32]
  assert "speculation did not pay at concurrency 32" in demo.summary(only_lost, clock="h200")
  assert "0.95x the best static arm (target_only) at concurrency 32" in wall


def test_demo_tables_put_both_clocks_side_by_side():
  from av_jax.engine import demo
  table = demo.format_tables(_demo_results(), clock="h200:llama3-8b")
  rows = {line.split()[0]: line.split() for line in table.splitlines()
          if line.startswith("  ") and line.split()[0] in ("target_only", "fixed:2", "fixed:4", "av")}
  assert len([l for l in table.splitlines() if l.startswith("concurrency")]) == 2
  # The last table (concurrency 32): fixed:2 best on the modelled clock, target only on the wall.
  assert rows["fixed:2"][1:4] == ["1100.0", "1.100", "*"]
  assert rows["target_only"][-3:] == ["200.0", "1.000", "*"]
  assert rows["av"][1:3] == ["1080.0", "1.080"] and rows["av"][3:5] == ["190.0", "0.950"]


def test_generate_starts_from_modelled_costs_and_plain_tokens(monkeypatch):
  seen = []
  monkeypatch.setattr(cli, "cmd_generate", lambda args: seen.append(args))
  cli.main(["generate", "--prompt", "x"])
  cli.main(["generate", "--prompt", "x", "--cost", "profiled", "--plain-tokens", "0"])
  assert (seen[0].cost, seen[0].plain_tokens, seen[0].slots) == ("modelled", 16, 1)
  assert (seen[1].cost, seen[1].plain_tokens) == ("profiled", 0)
