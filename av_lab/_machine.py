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


def commit() -> str | None:
  """The source tree's git commit (short hash, `+` when it has uncommitted changes), or
  None outside a git checkout."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, timeout=10)
    if head.returncode != 0:
      return None
    dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=10).stdout.strip()
  except (OSError, subprocess.TimeoutExpired):
    return None
  return head.stdout.strip() + ("+" if dirty else "")
