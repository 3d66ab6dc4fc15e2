# Two entry points on a fresh machine: `make demo` (main job) and `make test` (test suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench-overhead clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m av_jax.cli demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal tests

bench-overhead: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) *.egg-info
