#!/usr/bin/env bash
# Run several step_bench.py rows in one GPU session (one process each) and collect them in one file.
#   bash bench/runs/run_all.sh OUTFILE "SYSTEM MODEL [opts]" ...
# Rows share RUN_ID, so ratios are taken inside one run. LAUNCH="torchrun --standalone --nproc_per_node 2"
# runs each row data-parallel (the default launcher is python3).
set -u
out=$1; shift
export RUN_ID=${RUN_ID:-$(date +%Y%m%d-%H%M%S)-$RANDOM}
export COMMIT=${COMMIT:-$(git describe --always --dirty --abbrev=7 --exclude="*" 2>/dev/null || echo unknown)}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
for spec in "$@"; do
  echo "=== $spec ($(date +%T))"
  # shellcheck disable=SC2086
  timeout "${ROW_TIMEOUT:-240}" ${LAUNCH:-python3} bench/rows/step_bench.py $spec --out "$out" || echo "row failed: $spec (rc $?)"
done
