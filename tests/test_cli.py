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
