"""benchmarks/accelerator_scale.py: the presets and the goal verdicts it reports (from
records built by `av_lab.compare.records`, so the verdicts are the ones a run prints)."""

import importlib.util
import os

import pytest

from av_lab import compare as C

_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "accelerator_scale.py")
_spec = importlib.util.spec_from_file_location("accelerator_scale", _SCRIPT)
scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scale)


def _rows(table):
  """{(B, arm): (tokens/s, per-request tokens/s)} -> engine-shaped rows, one repeat."""
  rows = []
  for (b, arm), (tok, per) in table.items():
    mode, _, k = arm.partition(":")
    rows.append(dict(drafter="block", workload="mixed", concurrency=b, arm=arm, mode=mode,
                     k=int(k or 8), repeat=0, clock="h200:llama3-8b", tokens_per_s=tok,
                     per_request_tokens_per_s=per, steady_tokens_per_s=tok,
                     steady_per_request_tokens_per_s=per))
  return C.records(rows)


def _verdicts(table):
  return {g["goal"]: (g["met"], g["figures"]) for g in scale.goals(_rows(table))}


def test_goals_met_and_missed_from_the_records():
  # B = 16: AV 0.99x fixed:8 (met: >= 0.98), on the frontier by per-request speed; B = 64: AV 1.2x fixed:8 but 0.9x fixed:2 and
  # dominated by it (off the frontier); B = 256: AV 1.35x fixed:2.
  table = {(16, "fixed:2"): (900, 60), (16, "fixed:8"): (1000, 70), (16, "av"): (990, 71),
           (64, "fixed:2"): (2000, 40), (64, "fixed:8"): (1500, 30), (64, "av"): (1800, 35),
           (256, "fixed:2"): (3000, 12), (256, "fixed:8"): (1000, 5), (256, "av"): (4050, 16)}
  v = _verdicts(table)
  assert v["AV on the frontier at >= 2 of 3 concurrencies"][0]
  assert "off at B=64 (best static fixed:2, AV 0.900x)" in v[
      "AV on the frontier at >= 2 of 3 concurrencies"][1]
  assert v["AV >= 0.98x the best fixed K at concurrency 1-16"] == (True,
                                                                  "B=16: 0.990x (fixed:8)")
  assert v["AV >= 1.15x fixed K=8 at concurrency 64"] == (True, "1.200x")
  assert v["AV >= 1.3x the best fixed K at concurrency 256"] == (True, "1.350x (fixed:2)")
  # The same run with AV a little slower at 16 and 256: both goals turn to missed.
  table[(16, "av")] = (970, 71)
  table[(256, "av")] = (3800, 16)
  v = _verdicts(table)
  assert v["AV >= 0.98x the best fixed K at concurrency 1-16"][0] is False
  assert v["AV >= 1.3x the best fixed K at concurrency 256"][0] is False


def test_goals_say_not_run_for_missing_concurrencies():
  v = _verdicts({(4, "fixed:8"): (100, 25), (4, "av"): (100, 25)})
  assert v["AV >= 1.15x fixed K=8 at concurrency 64"] == (False, "not run")
  assert v["AV >= 1.3x the best fixed K at concurrency 256"] == (False, "not run")


@pytest.mark.parametrize("flags,want", [([], scale.FULL), (["--quick"], scale.QUICK)])
def test_presets_fill_what_the_flags_leave(flags, want):
  args = scale.parse_args(["--out", "x"] + flags)
  assert args.max_new is None and args.requests_per_slot is None  # the preset decides
  assert want["max_new"] >= 16 and want["requests_per_slot"] >= 1 and want["min_requests"] >= 8
  assert "av" in want["arms"].split(",") and len(want["concurrency"]) >= 4
  assert scale.parse_args(["--out", "x", "--max-new", "40"] + flags).max_new == 40
