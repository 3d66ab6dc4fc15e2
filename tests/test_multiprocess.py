"""The engine under JAX's multi-controller runtime: 2 processes x 4 CPU devices, one mesh.

Each process (`tests/_multiprocess_worker.py`) starts `jax.distributed` over loopback with
4 fake CPU devices and decodes the same requests over one global (4 data x 2 model) mesh;
a process of its own first decodes them on one local device (the single-process run). Checks: the
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
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_PROCESSES = 2
TIMEOUT_S = 240


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run(tmp_path, name: str, argvs: list[list[str]]) -> None:
  """Runs the processes `argvs` together; returns when all exited 0, raises otherwise."""
  env = dict(os.environ)
  # The worker sets its own device count; other XLA flags (the test tiers' compile
  # settings) pass through.
  flags = [f for f in env.pop("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  procs, logs = [], []
  try:
    for i, argv in enumerate(argvs):
      logs.append(open(tmp_path / f"{name}{i}.log", "w"))
      procs.append(subprocess.Popen([sys.executable, "-m", "tests._multiprocess_worker", *argv],
                                    cwd=ROOT, env=env, stdout=logs[i], stderr=subprocess.STDOUT))
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
  # A process that failed by itself first, then those killed because of it.
  for i, p in sorted(enumerate(procs), key=lambda ip: ip[1].returncode < 0):
    if p.returncode != 0:
      log = (tmp_path / f"{name}{i}.log").read_text()
      log = "\n".join(l for l in log.splitlines() if not l.startswith("[Gloo]"))
      what = "was killed (timeout or another process failed)" if p.returncode < 0 else \
          f"exited with {p.returncode}"
      raise AssertionError(f"{name} {i} {what}:\n{log[-4000:]}")


def _run_workers(tmp_path) -> tuple[dict, list[dict]]:
  """The single-process reference (alone, first), then the workers; their JSON outputs."""
  ref_out = tmp_path / "reference.json"
  _run(tmp_path, "reference", [["--reference", str(ref_out)]])
  port = str(_free_port())
  outs = [tmp_path / f"worker{i}.json" for i in range(NUM_PROCESSES)]
  _run(tmp_path, "worker", [[str(i), str(NUM_PROCESSES), port, str(outs[i])]
                            for i in range(NUM_PROCESSES)])
  return json.loads(ref_out.read_text()), [json.loads(o.read_text()) for o in outs]


def test_multiprocess_generation_equals_single_process(tmp_path):
  reference, results = _run_workers(tmp_path)
  for i, r in enumerate(results):
    assert r["process_index"] == i
    assert (r["process_count"], r["local_devices"], r["global_devices"]) == (2, 4, 8)
    assert r["mesh_spans_processes"]
    assert not r["cache_fully_addressable"]     # each process holds only its slots
    assert r["cache_spec"] == "P(None, 'data', 'model', None, None)"

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


def test_barrier_refuses_bad_arguments_and_is_a_no_op_alone():
  from av_jax.engine import distributed
  with pytest.raises(ValueError, match="name"):
    distributed.barrier("")
  with pytest.raises(ValueError, match="timeout_s"):
    distributed.barrier("x", timeout_s=0)
  distributed.barrier("alone", timeout_s=1)     # one process: returns at once
