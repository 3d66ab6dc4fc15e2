"""What machine a measurement ran on (for benchmark reports)."""

from __future__ import annotations

import os
import platform
import subprocess

import jax


def cpu_model() -> str:
  """The CPU's model name from `lscpu`, else `platform.processor()`."""
  model = platform.processor()
  try:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
      if line.startswith("Model name:"):
        model = line.split(":", 1)[1].strip()
  except OSError:
    pass
  return model


def describe() -> dict:
  """CPU, cores (all and usable), JAX backend and device, versions, load average."""
  return dict(cpu=cpu_model(), cores=os.cpu_count(), usable_cores=len(os.sched_getaffinity(0)),
              backend=jax.default_backend(), device=jax.devices()[0].device_kind,
              jax=jax.__version__, python=platform.python_version(),
              load_avg=list(os.getloadavg()))
