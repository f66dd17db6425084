#!/usr/bin/env bash
# The integrations on a held 24 GB card (issue 40): one Llama-3-8B-shaped checkpoint and chat dataset through each
# tool, `offload-trainer train` first in every call (each tool's ratio is to that row of the same call):
#   bash bench/integrations.sh OUT.jsonl "trl llamafactory"      (carry .whl .whl-trl .whl-llamafactory .gpu)
#   bash bench/integrations.sh OUT.jsonl "axolotl"               (carry .whl .whl-axolotl .whl-bnb .gpu)
# Wheels: ../shared/gpu/fetch-wheels.sh (.whl) and scripts/device_wheels.sh (one folder per tool). MODEL, SEQ, BATCH,
# STEPS change the shape (default llama3-8b, 4 x 2048, 10 steps).
set -u
out=$1; tools=$2
export RUN_ID=${RUN_ID:-$(date +%Y%m%d-%H%M%S)} COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 AXOLOTL_DO_NOT_TRACK=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" "$1"/*.whl; }
install .whl /tmp/site || exit 1
[ -d .whl-bnb ] && { install .whl-bnb /tmp/site || exit 1; }
for t in $tools; do [ -d ".whl-$t" ] && { install ".whl-$t" "/tmp/site-$t" || exit 1; }; done
base=/tmp/ib-base work=/tmp/ib-work
PYTHONPATH=/tmp/site:$PWD python3 bench/integrations.py base $base --model "${MODEL:-llama3-8b}" || exit 1
PYTHONPATH=/tmp/site:$PWD python3 bench/integrations.py prepare $base $work --model "${MODEL:-llama3-8b}" \
  --seq "${SEQ:-2048}" --batch "${BATCH:-4}" --steps "${STEPS:-10}" || exit 1
python3 .gpu/hold_gpu_memory.py 23.5 --seconds 3000 > /tmp/hold.log 2>&1 &
hold=$!
for _ in $(seq 60); do grep -q READY /tmp/hold.log && break; sleep 1; done
cat /tmp/hold.log
for t in ours $tools; do
  echo "=== $t ($(date +%T))"
  PYTHONPATH=/tmp/site-$t:/tmp/site:$PWD timeout "${ROW_TIMEOUT:-240}" python3 bench/integrations.py run "$t" $work \
    --out "$out" 2>&1 | grep -v "it/s]\|s/it]" || echo "row failed: $t"
  rm -rf "$work/out-$t"
done
kill $hold
PYTHONPATH=/tmp/site:$PWD python3 bench/integrations.py table "$out"
