"""benchmarks/accelerator.py --quick: every file written, with the fields the summary needs."""

import importlib.util
import json
import os

import numpy as np

from av_jax import costs

_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "accelerator.py")
_MAX_FILES, _MAX_BYTES = 8, 16 * 2**20  # the device tool's limits on what comes back


def _load_script():
  spec = importlib.util.spec_from_file_location("accelerator", _SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_quick_run_writes_every_file(tmp_path):
  out = str(tmp_path / "acc")
  script = _load_script()
  assert script.main(["--out", out, "--quick"]) == 0
  names = sorted(os.listdir(out))
  assert names == ["compare.json", "decision.json", "device.json", "features.json",
                   "summary.md", "verify_table.json"]
  assert len(names) <= _MAX_FILES
  assert all(os.path.getsize(os.path.join(out, n)) <= _MAX_BYTES for n in names)
  load = lambda name: json.load(open(os.path.join(out, name)))
  device = load("device.json")
  assert device["quick"] and device["matmul_tflops"] > 0 and device["copy_gbps"] > 0
  rows = load("features.json")["rows"]
  assert {r["dtype"] for r in rows} == {"float32", "bfloat16"}
  for r in rows:
    assert r["feature_ms"] > 0 and r["max_ms"] > 0 and r["copy_ms"] > 0
    np.testing.assert_allclose(r["feature_gbps"], r["logits_bytes"] / r["feature_ms"] / 1e6)
    np.testing.assert_allclose(r["feature_fraction_of_copy"],
                               r["feature_gbps"] / device["copy_gbps"])
  assert all(r["decision_ms"] > 0 for r in load("decision.json")["rows"])
  # The verify table is a cost-table file the modelled clock can load.
  tables = costs.load_cost_table(os.path.join(out, "verify_table.json"))
  assert tables.buckets == script.QUICK_VERIFY_TOKENS
  assert np.all(tables.bucket_ms > 0) and tables.label.startswith("measured:")
  assert tables.draft_depth_ms.shape == (9, script.MAX_DRAFT)  # R = 0..8 requests
  assert np.all(tables.draft_depth_ms[0] == 0) and np.all(tables.draft_depth_ms[1:] > 0)
  # make_cost_model repairs a timing-noisy (falling) table to its running maximum.
  np.testing.assert_allclose(tables.cost.draft_ms,
                             np.maximum.accumulate(np.maximum(tables.draft_depth_ms.sum(1), 1e-6)),
                             rtol=1e-6)
  meta = load("verify_table.json")["metadata"]
  assert meta["layers_run"] == meta["layers_total"] == 2 and meta["complete"]
  compared = load("compare.json")
  assert compared["settings"]["clock"] == "wall" and compared["settings"]["concurrency"] == [2]
  assert {r["arm"] for r in compared["results"]} == {"fixed:2", "av"}
  assert all(r["tokens_per_s"] > 0 and r["clock"] == "wall" for r in compared["results"])
  summary = open(os.path.join(out, "summary.md")).read()
  assert "logit_qmax" in summary and "QUICK RUN" in summary and "| 64 |" in summary
  assert "## av-jax compare (wall clock, this device)" in summary
