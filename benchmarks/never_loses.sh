#!/usr/bin/env bash
# Issue 14's wall-clock sweep: `av-jax compare` of target_only, fixed:1,2,4,8 and av, one
# process per (drafter, concurrency) so a stopped sweep keeps what it finished. Each run
# writes OUT/<drafter>_B<concurrency>.json; benchmarks/never_loses_table.py tabulates them.
#   bash benchmarks/never_loses.sh OUT [CLOCK] [CONCURRENCIES] [DRAFTERS] [WORKLOADS]
# CLOCK: wall (default) or DEVICE:SHAPE (modelled, e.g. h200:llama3-8b).
# MIN_REQUESTS=N (environment): at least N requests a run, max(2, ceil(N / B)) per slot
# (default 2 per slot: at B = 1-8 a run is then 2-16 requests, which a few unlucky draws swing
# by 10-20%). STEPS_PER_CHUNK=N (environment): decode steps between host syncs, where a
# freed slot is refilled (default 8, the engine's; 1 admits every step, as a serving
# scheduler does).
set -euo pipefail
out=${1:?usage: never_loses.sh OUT [CLOCK] [CONCURRENCIES] [DRAFTERS] [WORKLOADS]}
clock=${2:-wall}
concurrencies=${3:-1,8,64,2,16,4,32}
drafters=${4:-block,eagle}
workloads=${5:-math,code,mixed}
python=${PYTHON:-.venv/bin/python}
min_requests=${MIN_REQUESTS:-0}
steps_per_chunk=${STEPS_PER_CHUNK:-8}
mkdir -p "$out"
for B in ${concurrencies//,/ }; do
  for drafter in ${drafters//,/ }; do
    json="$out/${drafter}_B${B}.json"
    [ -s "$json" ] && { echo "have $json"; continue; }
    per_slot=$(( (min_requests + B - 1) / B ))
    (( per_slot < 2 )) && per_slot=2
    PYTHONPATH=. "$python" -m av_lab.cli compare --models default --drafter "$drafter" \
      --workload "$workloads" --concurrency "$B" \
      --arms target_only,fixed:1,fixed:2,fixed:4,fixed:8,av --repeats 3 --clock "$clock" \
      --max-new 32 --requests-per-slot "$per_slot" \
      --steps-per-chunk "$steps_per_chunk" --warm-start --json "$json"
  done
done
