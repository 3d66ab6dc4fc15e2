# Two entry points on a fresh machine: `make demo` (main job) and `make test` (test suite).
# `make test-next` tests a second JAX generation (Python 3.12, ci/constraints-next.txt) in
# its own venv; `.ci/run` runs both, then ci/integration_check.sh.
PYTHON ?= python3
# Extra pytest arguments, e.g. `make test PYTEST_ARGS=--durations=20`.
PYTEST_ARGS ?=
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Second generation: the JAX that serving stacks pin, on the Python they run.
PYTHON_NEXT ?= $(shell ci/find-python 3.12 2>/dev/null)
VENV_NEXT ?= .venv-next
PY_NEXT := $(VENV_NEXT)/bin/python
STAMP_NEXT := $(VENV_NEXT)/.installed
# The core and engine tests (the models, data, studies and multi-host tests run on the
# primary generation only, to keep CI under 25 minutes on 2 cores).
NEXT_TESTS := $(wildcard tests/test_core_*.py) tests/test_decision.py tests/test_rejection.py \
  tests/test_lossless.py tests/test_verify_groups.py $(wildcard tests/test_engine*.py) \
  tests/test_policy.py \
  tests/test_faults.py tests/test_sharding.py tests/test_profiling.py tests/test_examples.py

.PHONY: demo test test-slow test-all test-next bench-overhead clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

$(STAMP_NEXT): pyproject.toml ci/constraints-next.txt
	@test -n "$(PYTHON_NEXT)" || { echo "test-next: no Python 3.12 found (set PYTHON_NEXT)" >&2; exit 1; }
	$(PYTHON_NEXT) -m venv $(VENV_NEXT)
	$(PY_NEXT) -m pip install -q --upgrade pip
	$(PY_NEXT) -m pip install -q -c ci/constraints-next.txt -e '.[test]'
	touch $(STAMP_NEXT)

demo: $(STAMP)
	$(PY) -m av_lab.cli demo

# A test whose worker process crashed (jaxlib 0.10.2's CPU compiler has aborted at random
# inside `backend_compile_and_load`, a different test each time, never reproducible alone;
# likely the memory-map limit, which tests/conftest.py now bounds after each test)
# is run once more, as is one whose compile failed for memory (LLVM's "Failed to materialize
# symbols"); a test that fails is not (`--only-rerun` matches these reports only).
RERUN := --reruns 1 --only-rerun "crashed while running" --only-rerun "Failed to materialize symbols"
# XLA's persistent compilation cache: an engine program compiled once (by either xdist
# worker, in either tier) is read from disk by every later test that builds it. Keys are
# the program's HLO, the compile options and the JAX version, so a changed program or a
# second JAX generation never reads another's entry. `make test JAX_CACHE=` runs without.
JAX_CACHE ?= $(CURDIR)/.cache/jax
# A size bound turns on JAX's file lock, so one worker never reads an entry the other is
# still writing.
TEST_ENV := $(if $(JAX_CACHE),JAX_COMPILATION_CACHE_DIR=$(JAX_CACHE) \
  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0.5 JAX_COMPILATION_CACHE_MAX_SIZE=8000000000,)
# The tests are compile-bound (tiny models, many engine programs): the primary tiers
# compile with LLVM at -O0 and XLA's classic CPU fusion emitters, which compile about twice
# as fast and compute the same values to rounding; `make test-next` and the integration check keep
# XLA's defaults, so the optimised code users run is tested too. `make test TEST_XLA_FLAGS=`
# runs with the defaults; a user's own XLA_FLAGS are kept after these.
TEST_XLA_FLAGS ?= --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false
FAST_ENV := $(TEST_ENV) XLA_FLAGS="$(strip $(TEST_XLA_FLAGS) $(XLA_FLAGS))"
# `make test` leaves the tests named in tests/SLOW_TESTS.txt (engine and model tests of
# >= 12 s each at XLA's default flags: compile-bound) to `make test-slow`; CI runs both; `make test-all` is both.
test: $(STAMP)
	$(FAST_ENV) $(PY) -m pytest -q -n 2 --dist worksteal $(RERUN) -m "not slow" $(PYTEST_ARGS) tests

test-slow: $(STAMP)
	$(FAST_ENV) $(PY) -m pytest -q -n 2 --dist worksteal $(RERUN) -m slow $(PYTEST_ARGS) tests

test-all: $(STAMP)
	$(FAST_ENV) $(PY) -m pytest -q -n 2 --dist worksteal $(RERUN) $(PYTEST_ARGS) tests

test-next: $(STAMP_NEXT)
	$(PY_NEXT) -c "import sys, jax, flax; print('test-next: Python', sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__)"
	$(TEST_ENV) $(PY_NEXT) -m pytest -q -n 2 --dist worksteal $(RERUN) -m "not slow" $(PYTEST_ARGS) $(NEXT_TESTS)

# The bench extra asks for torch>=2.13; installing this build first keeps pip from taking a
# newer (CUDA, several GB) wheel for the range. Override with TORCH=... elsewhere.
TORCH ?= torch==2.13.0
bench-overhead: $(STAMP)
	$(PY) -m pip install -q '$(TORCH)'
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) $(VENV_NEXT) .venv-integration build *.egg-info
