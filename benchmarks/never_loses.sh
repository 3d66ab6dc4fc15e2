#!/usr/bin/env bash
# Issue 14's wall-clock sweep: `av-jax compare` of target_only, fixed:1,2,4,8 and av, one
# process per (drafter, concurrency) so a stopped sweep keeps what it finished. Each run
# writes OUT/<drafter>_B<concurrency>.json; benchmarks/never_loses_table.py tabulates them.
#   bash benchmarks/never_loses.sh OUT [CLOCK] [CONCURRENCIES] [DRAFTERS] [WORKLOADS]
# CLOCK: wall (default) or DEVICE:SHAPE (modelled, e.g. h200:llama3-8b).
set -euo pipefail
out=${1:?usage: never_loses.sh OUT [CLOCK] [CONCURRENCIES] [DRAFTERS] [WORKLOADS]}
clock=${2:-wall}
concurrencies=${3:-1,8,64,2,16,4,32}
drafters=${4:-block,eagle}
workloads=${5:-math,code,mixed}
python=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
for B in ${concurrencies//,/ }; do
  for drafter in ${drafters//,/ }; do
    json="$out/${drafter}_B${B}.json"
    [ -s "$json" ] && { echo "have $json"; continue; }
    PYTHONPATH=. "$python" -m av_jax.cli compare --models default --drafter "$drafter" \
      --workload "$workloads" --concurrency "$B" \
      --arms target_only,fixed:1,fixed:2,fixed:4,fixed:8,av --repeats 3 --clock "$clock" \
      --max-new 32 --requests-per-slot 2 --warm-start --json "$json"
  done
done
