"""Data-parallel replicas agree through the adapters' learning path.

Two replicas on a fake 2-device CPU mesh serve different requests through both adapters
(sampler, labels recovered from the stack's output with a `learn` mask, then the
estimator's `update(axis_name="data")`). JAX fixes its device count when it starts, so
the check runs in a fresh process (`tests/_adapters_dp_check.py`).
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_replicas_hold_identical_coefficients_after_every_refit():
  proc = subprocess.run([sys.executable, "-m", "tests._adapters_dp_check"], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
  r = json.loads(line[len("RESULT "):])
  assert all(r["differ"])              # the replicas labelled different requests
  assert r["refits"][-1] == 4          # 12 steps, a refit every 3
  assert r["moved"] > 0.01             # and the refits moved the coefficients
  assert all(r["identical"])           # bit-identical coefficients after every step
  assert all(r["matches"])             # equal to one estimator fed both replicas' labels
  # Negative control: without the sum over the mesh axis the replicas part at the first
  # refit (step 3) and stay apart.
  assert all(r["control_identical"][:2]) and not any(r["control_identical"][2:])
