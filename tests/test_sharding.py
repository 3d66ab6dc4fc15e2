"""Sharded engine on 8 fake CPU devices equals the single-device engine.

JAX fixes its device count when it starts, so the check runs in a fresh process
(`tests/_sharding_check.py`) with `jax_num_cpu_devices = 8`.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sharded_generation_equals_single_device():
  proc = subprocess.run([sys.executable, "-m", "tests._sharding_check"], cwd=ROOT,
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
  results = json.loads(line[len("RESULT "):])
  assert len(results) == 1
  for name, r in results.items():
    assert r["equal"], name                      # same tokens for the same seed
    assert r["refits"] >= 2, name                # the estimator refit while sharded
    assert r["num_replicas"] == 8, name
    assert r["replicas_identical"], name         # bit-identical coefficients everywhere
    assert r["coef_equal"], name                 # and equal to the single-device fit
    assert r["cache_spec"] == "P(None, 'data', 'model', None, None)", name
