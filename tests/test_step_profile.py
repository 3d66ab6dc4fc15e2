"""benchmarks/step_profile.py: the trace it reads is attributed to the right program
and step, and the work only AV does shows up as AV's extra (a negative control: an arm
against itself has none)."""

import os
import sys

import pytest

from av_jax import models as M

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import step_profile  # noqa: E402


def test_instructions_key_by_source_path_and_shape():
  text = """
ENTRY %main {
  %wrapped_broadcast.7 = f32[16,8,4096]{2,1,0} fusion(%c), kind=kLoop, metadata={op_name="jit(<lambda>)/while/body/closed_call" stack_frame_id=1}
  ROOT %cond.45 = (f32[1,16,4096]{2,1,0}) conditional(%p, %a, %b), metadata={op_name="jit(<lambda>)/while/body/closed_call/cond/branch_0_fun/cond"}
  %x.1 = f32[2]{0} add(%a, %b), metadata={op_name="jit(<lambda>)/while/body/cond/branch_1_fun/jit(_where)/select_n"}
}"""
  got = step_profile.instructions(text)
  assert got["wrapped_broadcast.7"] == ("fusion", "f32[16,8,4096]", "closed_call")
  assert got["cond.45"][0] == "conditional"
  assert got["x.1"] == ("add", "f32[2]", "jit(_where)/select_n")


@pytest.fixture(scope="module")
def tiny_profile():
  return step_profile.profile(M.load_config("tiny"), drafter="block", concurrency=2,
                              max_len=48, prompt_len=8, steps=4, chunks=1, rounds=2)


def test_both_arms_traced_per_step(tiny_profile):
  for mode in ("target_only", "av"):
    r = tiny_profile[mode]
    assert r["executions"] == 2, mode  # one run id per traced chunk (1 x 2 rounds)
    assert r["wall_ms"] > 0 and r["thunks"] > 10 and r["thunk_ms"] > 0
    assert r["drafted"] == 0  # the plan drafted for no slot: quiet steps
  # AV's step runs the decision on top of the same target pass: more thunks per step.
  assert tiny_profile["av"]["thunks"] > tiny_profile["target_only"]["thunks"]


def test_extra_keys_find_avs_own_work_and_nothing_against_itself(tiny_profile):
  rows = step_profile.extra_keys(tiny_profile, top=1000)
  # The draft-probability placeholder [B, K, V] exists only in AV's program.
  vocab = M.load_config("tiny").target.vocab_size
  own = [r for r in rows if r["shape"] == f"f32[2,8,{vocab}]"]
  assert own and all(r["target_only_ms"] == 0.0 and r["extra_ms"] > 0 for r in own)
  # Negative control: target-only against itself has no extra on any key.
  same = dict(av=tiny_profile["target_only"], target_only=tiny_profile["target_only"])
  assert all(abs(r["extra_ms"]) < 1e-12 for r in step_profile.extra_keys(same, top=1000))


def test_bad_arguments_name_themselves():
  with pytest.raises(ValueError, match="max_len"):
    step_profile.profile(M.load_config("tiny"), drafter="block", concurrency=2, max_len=10,
                         prompt_len=8, steps=4)
  with pytest.raises(ValueError, match="steps, chunks, rounds"):
    step_profile.profile(M.load_config("tiny"), drafter="block", concurrency=2, steps=0)
