#!/usr/bin/env bash
# Follows docs/integration.md as a new user would: a fresh venv, a non-editable
# `pip install .`, then the doc's Python blocks verbatim (ci/run_doc_blocks.py), run from
# outside the checkout so that only the installed package can be imported. Every
# subpackage must import with the runtime dependencies alone (chex, matplotlib are extras).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
python="${PYTHON:-python3}"
venv="${INTEGRATION_VENV:-$root/.venv-integration}"

rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "$root"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
"$venv/bin/python" - "$venv" <<'PY'
import os, sys
import av_jax
import av_lab.cli, av_jax.engine, av_jax.models, av_lab.studies  # no test extras needed
where = os.path.realpath(av_jax.__file__)
assert where.startswith(os.path.realpath(sys.argv[1])), f"av_jax imported from {where}, not the venv"
print("integration: av_jax", av_jax.__version__, "installed at", os.path.dirname(where))
PY
"$venv/bin/python" "$root/ci/run_doc_blocks.py" "$root/docs/integration.md"
