"""Running the engine under JAX's multi-controller runtime (several processes, one mesh).

Every process runs the same program: the same `generate` call with the same prompts, key,
parameters and engine, over one global ('data', 'model') mesh that spans all processes'
devices (`global_mesh`). Each process holds only its addressable shards of the sharded
state (its slots' caches and sequences); everything the host loop reads between chunks is
gathered (`fetch`), so every process takes the same scheduling decisions.

    from av_jax.engine import distributed
    distributed.initialize("10.0.0.1:1234", num_processes=2, process_id=rank)
    mesh = distributed.global_mesh(model=2)           # data = devices / model
    with jax.set_mesh(mesh):
      result = E.generate(engine, params, prompts, max_new_tokens=64, key=key, mesh=mesh)

On TPU pods and SLURM/Open MPI GPU clusters `initialize()` without arguments finds the
coordinator itself (see `jax.distributed.initialize`). See `docs/scaling.md`.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax._src import distributed as _jax_distributed  # the coordination client (no public alias)
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from av_jax.engine import sharding


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_count: int | None = None,
               cpu_collectives: str = "gloo", initialization_timeout: int = 300) -> None:
  """Starts JAX's distributed runtime; call it first, before any other JAX call.

  Args:
    coordinator_address: `host:port` of process 0 (None: detected on TPU pods and
      SLURM / Open MPI clusters).
    num_processes: number of processes (None: detected).
    process_id: this process's rank in `[0, num_processes)` (None: detected).
    local_device_count: CPU only: fake this many CPU devices in this process (tests and
      development on one machine); ignored by accelerator backends.
    cpu_collectives: cross-process collectives of the CPU backend, "gloo" (TCP) or
      "mpi". Accelerators use their own interconnect (ICI/DCN, NCCL).
    initialization_timeout: seconds to wait for every process to connect.

  Raises:
    ValueError: `local_device_count` < 1 or an unknown `cpu_collectives`.
  """
  if cpu_collectives not in ("gloo", "mpi"):
    raise ValueError(f"cpu_collectives: expected 'gloo' or 'mpi', got {cpu_collectives!r}")
  if local_device_count is not None:
    if local_device_count < 1:
      raise ValueError(f"local_device_count: expected >= 1, got {local_device_count}")
    jax.config.update("jax_num_cpu_devices", local_device_count)
  jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax.distributed.initialize(coordinator_address, num_processes, process_id,
                             initialization_timeout=initialization_timeout)


def global_mesh(data: int | None = None, model: int = 1, *, explicit: bool = False) -> Mesh:
  """A ('data', 'model') mesh over every process's devices.

  Each 'model' group lies inside one process whenever `model` divides the local device
  count, so the per-layer model-parallel all-reduces stay on the fast intra-host links and
  only 'data' crosses hosts (the engine's per-step cross-host traffic is then a few small
  reductions; see docs/scaling.md).

  Args:
    data: size of the 'data' axis (slots); None = all devices / `model`.
    model: size of the 'model' axis (heads, MLP width).
    explicit: Explicit axis types (see `sharding.make_mesh`).

  Returns:
    The mesh; devices ordered by (process, local id), rows of `model` consecutive devices.

  Raises:
    ValueError: `data * model` is not the global device count.
  """
  n = jax.device_count()
  if model < 1 or n % model:
    raise ValueError(f"model: {model} does not divide the {n} devices of "
                     f"{jax.process_count()} processes")
  data = n // model if data is None else data
  if data * model != n:
    raise ValueError(f"data x model: {data} x {model} = {data * model}, expected the "
                     f"global device count {n}")
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  return sharding.make_mesh(data, model, explicit=explicit,
                            devices=np.asarray(devices, dtype=object).reshape(data, model))


def barrier(name: str, timeout_s: float = 300.0) -> None:
  """Waits until every process reaches the barrier `name` (the coordination service).

  No device collective runs: the wait goes through the distributed runtime's coordinator,
  whose timeout is `timeout_s`. A device collective across processes (Gloo on CPU) only
  waits its transport's connect timeout (tens of seconds) for a peer that is still busy,
  so processes whose work before their first collective can differ by more than that (one
  ran a check the others skipped, a slow compile) meet here first. Every process must
  call it with the same `name`, once per name. A no-op in a single process.

  Raises:
    ValueError: an empty `name` or a `timeout_s` that is not positive.
    RuntimeError: a process did not arrive within `timeout_s`.
  """
  if not isinstance(name, str) or not name:
    raise ValueError(f"name: expected a non-empty string, got {name!r}")
  if not timeout_s > 0:
    raise ValueError(f"timeout_s: expected > 0 seconds, got {timeout_s!r}")
  if jax.process_count() == 1:
    return
  client = _jax_distributed.global_state.client
  if client is None:
    raise RuntimeError("barrier: jax.distributed is not initialized (call initialize first)")
  try:
    client.wait_at_barrier(name, int(timeout_s * 1000))
  except Exception as e:  # noqa: BLE001 - the runtime's error type is not public
    raise RuntimeError(f"barrier {name!r}: not every process arrived within {timeout_s} s "
                       f"({e})") from e


def spans_processes(mesh: Mesh | None) -> bool:
  """Whether `mesh` holds devices of other processes (multi-controller)."""
  if mesh is None:
    return False
  me = jax.process_index()
  return any(d.process_index != me for d in mesh.devices.flat)


def fetch(tree: Any) -> Any:
  """Host NumPy copies of a pytree of arrays, gathering shards held by other processes.

  A fully addressable array (single process) is copied as it is; a global array that
  spans processes is all-gathered (`multihost_utils.process_allgather`), so every process
  receives the whole value. Every process must call this with the same arrays.
  """
  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
      return multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)
  return jax.tree.map(one, tree)
