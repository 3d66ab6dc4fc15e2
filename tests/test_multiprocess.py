"""The engine under JAX's multi-controller runtime: 2 processes x 4 CPU devices, one mesh.

Each process (`tests/_multiprocess_worker.py`) starts `jax.distributed` over loopback with
4 fake CPU devices and decodes the same requests over one global (4 data x 2 model) mesh;
process 0 first decodes them on one local device (the single-process run). Checks: the
same tokens as the single-process run; after every chunk, bit-identical estimator
coefficients in every replica of both processes, equal (to float reassociation) to the
single-process coefficients, which needs the round statistics summed over the slots of
both processes; and refits did happen.
"""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_PROCESSES = 2
TIMEOUT_S = 240


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_workers(tmp_path) -> list[dict]:
  """Starts the processes, waits for all (bounded), returns their JSON outputs."""
  port = _free_port()
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the worker sets its own device count
  procs, logs, outs = [], [], []
  try:
    for i in range(NUM_PROCESSES):
      outs.append(tmp_path / f"worker{i}.json")
      logs.append(open(tmp_path / f"worker{i}.log", "w"))
      args = [sys.executable, "-m", "tests._multiprocess_worker", str(i),
              str(NUM_PROCESSES), str(port), str(outs[i])]
      if i == 0:
        args.append("--reference")
      procs.append(subprocess.Popen(args, cwd=ROOT, env=env, stdout=logs[i],
                                    stderr=subprocess.STDOUT))
    # Until all exit, one fails (the others would wait for it forever), or time runs out.
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
      codes = [p.poll() for p in procs]
      if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    for f in logs:
      f.close()
  # A worker that failed by itself first, then those killed because of it.
  for i, p in sorted(enumerate(procs), key=lambda ip: ip[1].returncode < 0):
    if p.returncode != 0:
      log = (tmp_path / f"worker{i}.log").read_text()
      log = "\n".join(l for l in log.splitlines() if not l.startswith("[Gloo]"))
      what = "was killed (timeout or another worker failed)" if p.returncode < 0 else \
          f"exited with {p.returncode}"
      raise AssertionError(f"worker {i} {what}:\n{log[-4000:]}")
  return [json.loads(o.read_text()) for o in outs]


def test_multiprocess_generation_equals_single_process(tmp_path):
  results = _run_workers(tmp_path)
  for i, r in enumerate(results):
    assert r["process_index"] == i
    assert (r["process_count"], r["local_devices"], r["global_devices"]) == (2, 4, 8)
    assert r["mesh_spans_processes"]
    assert not r["cache_fully_addressable"]     # each process holds only its slots
    assert r["cache_spec"] == "P(None, 'data', None, 'model', None)"

  reference = results[0]["reference"]
  runs = [r["sharded"] for r in results]
  # (a) Every request's tokens equal the single-process run with the same key.
  for run in runs:
    assert run["tokens"] == reference["tokens"]
    assert run["stats"] == runs[0]["stats"]
  assert all(len(t) > 0 for t in reference["tokens"])

  # (b) After every chunk: every replica in both processes holds the same coefficients.
  chunks = [run["chunks"] for run in runs]
  assert len(chunks[0]) == len(chunks[1]) == len(reference["chunks"])
  for c0, c1, ref in zip(*chunks, reference["chunks"]):
    replicas = c0["replicas"] + c1["replicas"]
    assert len(replicas) == 8                    # every device holds a replica
    assert all(r == replicas[0] for r in replicas)
    assert c0["num_refits"] == c1["num_refits"] == ref["num_refits"]
    # The sums run over the global batch (a fit on one process's slots alone would have
    # other damped steps), only reduced in another order.
    got = [replicas[0]["slope"]] + replicas[0]["intercepts"]
    want = [ref["replicas"][0]["slope"]] + ref["replicas"][0]["intercepts"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
  assert chunks[0][-1]["num_refits"] >= 3
  # The coefficients did move away from their start (slope 0.5, intercepts 1.5).
  assert chunks[0][-1]["replicas"][0]["intercepts"][0] != 1.5
