"""Shared test fixtures: a jit/no-jit switch for pure functions; the `slow` tier; a bound
on the memory maps compiled code holds.

`tests/SLOW_TESTS.txt` names the tests that `make test` leaves to `make test-slow` (both
run in CI, `.ci/run`): they are marked `slow` here at collection. An entry that names no
collected test fails the run, so a renamed test cannot drop out of both tiers unseen.
"""

import gc
import os

import jax
import pytest

_SLOW_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "SLOW_TESTS.txt")


def _slow_ids() -> set[str]:
  with open(_SLOW_FILE, encoding="utf-8") as f:
    lines = (line.strip() for line in f)
    return {line for line in lines if line and not line.startswith("#")}


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: in tests/SLOW_TESTS.txt; run by make test-slow")


def pytest_collection_modifyitems(config, items):
  wanted, seen = _slow_ids(), set()
  for item in items:
    node = item.nodeid
    base = node.split("[", 1)[0]
    for name in (node, base):
      if name in wanted:
        item.add_marker(pytest.mark.slow)
        seen.add(name)
  # Only a run that collected a listed test's whole file can say the entry is stale.
  if config.option.keyword or any("::" in str(arg) for arg in config.args):
    return
  files = {item.nodeid.split("::", 1)[0] for item in items}
  stale = sorted(name for name in wanted - seen if name.split("::", 1)[0] in files)
  if stale:
    raise pytest.UsageError(f"tests/SLOW_TESTS.txt names tests that do not exist: {stale}")


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
  """Returns `jax.jit` or the identity, so each test runs both ways."""
  if request.param:
    return jax.jit
  return lambda fn, **kwargs: fn


def _memory_maps() -> tuple[int, int] | None:
  """(this process's memory maps, the kernel's per-process limit), Linux only."""
  try:
    with open("/proc/self/maps", "rb") as f:
      maps = sum(1 for _ in f)
    with open("/proc/sys/vm/max_map_count") as f:
      return maps, int(f.read())
  except (OSError, ValueError):
    return None


@pytest.fixture(autouse=True)
def _bound_memory_maps():
  """After each test, drops JAX's compiled-code caches when they hold over half of the
  per-process memory-map limit (per file was not enough: one slow file's engines reached
  the limit inside the file, CI 2026-12-05). Every compiled executable keeps its own maps (a v2 engine
  about 2,400 of the default limit of 65,530), an xdist worker runs many files, and LLVM's
  JIT fails with "Cannot allocate memory" at the limit: a studies run died that way, and
  it is the likely cause of the rare compiler aborts `make test` reruns (Makefile)."""
  yield
  counts = _memory_maps()
  if counts is not None and counts[0] > counts[1] // 2:
    jax.clear_caches()
    gc.collect()
