"""One process of the multi-process engine run (see test_multiprocess.py).

    python -m tests._multiprocess_worker PROCESS_ID NUM_PROCESSES PORT OUT_JSON
    python -m tests._multiprocess_worker --reference OUT_JSON

Starts JAX's distributed runtime with 4 fake CPU devices in this process, decodes the
requests over one global (4 data x 2 model) mesh spanning every process, and writes to
OUT_JSON the tokens and, after every chunk, the estimator coefficients of each of this
process's replicas. With `--reference` it decodes the same requests on one local device
(the single-process run) without the distributed runtime, and writes those.

The reference runs in a process of its own, before the workers: run inside worker 0 it
kept worker 1 waiting at its first cross-process collective for as long as the reference
took, and under load that outlasted Gloo's connect timeout (a CI failure). The workers
also meet at a coordinator barrier before decoding.
"""

import json
import sys

from av_jax.engine import distributed

LOCAL_DEVICES = 4

REFERENCE = sys.argv[1] == "--reference"

if __name__ == "__main__" and not REFERENCE:
  # Before anything touches a JAX backend.
  _pid, _num, _port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
  distributed.initialize(f"127.0.0.1:{_port}", num_processes=_num, process_id=_pid,
                         local_device_count=LOCAL_DEVICES, initialization_timeout=120)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from av_jax import engine as E  # noqa: E402
from av_jax.estimator import EstimatorConfig  # noqa: E402
from av_jax.sampling import Sampling  # noqa: E402
from tests import _engine_fixtures as fx  # noqa: E402

PROMPTS = [[1, 2, 3], [4], list(range(5, 16)), [7] * 6, [3, 9], [2] * 11, [8, 1, 8],
           [5, 5], [10, 11, 12, 13], [6], [9, 3, 1], [2, 4, 6, 8]]
MAX_NEW = 10
SEED = 3


def make_engine():
  cfg, drafter, params = fx.pair("block")
  engine = E.make_engine(E.EngineConfig(num_slots=8, max_draft=3, max_len=32, mode="av",
                                        sampling=Sampling(temperature=1.0),
                                        estimator=EstimatorConfig(refit_interval=2),
                                        programs=E.Programs(steps_per_chunk=4, num_buckets=2)),
                         cfg, drafter)
  return engine, params


def recorder(chunks: list):
  """An `on_chunk` callback recording every replica's coefficients after each chunk."""
  def on_chunk(state, info):
    del info
    est = state.estimator
    replicas = [dict(slope=float(np.asarray(s.data)),
                     intercepts=np.asarray(i.data).tolist())
                for s, i in zip(est.slope.addressable_shards, est.intercepts.addressable_shards)]
    chunks.append(dict(num_refits=int(np.asarray(est.num_refits.addressable_data(0))),
                       replicas=replicas))
  return on_chunk


def decode(engine, params, mesh=None):
  chunks = []
  result = E.generate(engine, params, PROMPTS, max_new_tokens=MAX_NEW, key=fx.key(SEED),
                      mesh=mesh, on_chunk=recorder(chunks))
  return dict(tokens=[c.tokens for c in result.completions], chunks=chunks,
              stats=result.stats), result.state


def main() -> None:
  engine, params = make_engine()
  if REFERENCE:
    reference, _ = decode(engine, params)             # one local device, no mesh
    with open(sys.argv[2], "w") as f:
      json.dump(reference, f)
    return
  out_path = sys.argv[4]
  out = dict(process_index=jax.process_index(), process_count=jax.process_count(),
             local_devices=len(jax.local_devices()), global_devices=jax.device_count())
  mesh = distributed.global_mesh(model=2)
  distributed.barrier("av_jax_test_decode", timeout_s=300)
  with jax.set_mesh(mesh):
    out["sharded"], state = decode(engine, params, mesh=mesh)
  cache = state.target_cache.k
  out["cache_spec"] = str(cache.sharding.spec)
  out["cache_fully_addressable"] = bool(cache.is_fully_addressable)
  out["mesh_spans_processes"] = distributed.spans_processes(mesh)
  with open(out_path, "w") as f:
    json.dump(out, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
