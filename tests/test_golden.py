"""Behaviour is unchanged: fresh engine and simulator runs equal the recorded golden
outputs (tokens, estimator state after every chunk, every step's record, the engine's
statistics): tokens, counts and flags exactly, floats to a relative 1e-5 (`RTOL`). On the
machine that recorded them the floats agree bit for bit; XLA's CPU code for another CPU
model (e.g. one with AVX-512) differs in the last bits of a reduction (seen: 2-6 ulp in
the estimator's sums and the recorded features), which must not fail a behaviour check. `python -m tests.golden.make_golden --check` compares every
recorded case; this file compares a selection that covers every arm, drafter kind,
budget policy and temperature (~40 s on CPU)."""

import numpy as np
import pytest

from tests.golden import make_golden as golden

TINY = golden.load(golden.TINY_PATH)
SIMULATE = golden.load(golden.SIMULATE_PATH)
RTOL = 1e-5  # floats only; ~100x the cross-CPU differences seen, far below a changed decision


def test_the_fast_selection_covers_every_arm_kind_and_temperature():
  cases = [golden.TINY_CASES[name] for name in golden.FAST_CASES]
  assert {c["mode"] for c in cases} == {"target_only", "fixed", "av", "av_head", "oracle"}
  assert {c["kind"] for c in cases} == set(golden.KINDS)
  assert {c["temperature"] for c in cases} == {0.0, 1.0}
  assert set(TINY) == set(golden.TINY_CASES)


@pytest.mark.parametrize("name", golden.FAST_CASES)
def test_engine_matches_golden(name):
  assert golden.differences(TINY[name], golden.run_tiny(name), rtol=RTOL) == []


@pytest.mark.parametrize("mode", golden.SIMULATE_MODES)
def test_simulator_matches_golden(mode):
  assert golden.differences(SIMULATE[mode], golden.run_simulate(mode), rtol=RTOL) == []


def test_default_model_set_matches_golden():
  want = golden.load(golden.DEFAULT_PATH)
  if want["checkpoint_sha256"] != golden.default_hash(want["kind"]):
    pytest.fail("the shipped `default` checkpoints changed since tests/golden/default.json "
                f"was recorded; regenerate it with `{golden.REGENERATE} --default` (on a "
                "commit whose behaviour is trusted) and commit it with the new checkpoints")
  assert golden.differences(want, golden.run_default(), rtol=RTOL) == []


def test_a_changed_token_is_caught():
  """Negative control: one emitted token off is reported, with where."""
  want = TINY[golden.FAST_CASES[0]]
  assert golden.differences(want, golden.renamed(want)) == []
  got = dict(golden.renamed(want), tokens=[list(t) for t in want["tokens"]])
  got["tokens"][1][2] += 1
  diff = golden.differences(want, got)
  assert len(diff) == 1 and diff[0].startswith("/tokens[1]")
  got = golden.renamed(want)
  got = dict(got, steps=dict(got["steps"], probs=np.nextafter(
      np.asarray(want["steps"]["probs"], np.float32), np.float32(2)).tolist()))
  assert golden.differences(want, got)[0].startswith("/steps/probs[0]")
  assert golden.differences(want, got, rtol=RTOL) == []  # one ulp: within RTOL
  got = dict(got, steps=dict(got["steps"], probs=(
      np.asarray(want["steps"]["probs"], np.float32) * (1 + 1e-4)).tolist()))
  assert golden.differences(want, got, rtol=RTOL)[0].startswith("/steps/probs")
  got = dict(golden.renamed(want), tokens=[list(t) for t in want["tokens"]])
  got["tokens"][0][0] += 1
  assert golden.differences(want, got, rtol=RTOL)[0].startswith("/tokens")
