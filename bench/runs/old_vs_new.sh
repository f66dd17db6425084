#!/usr/bin/env bash
# Speed across a change that should not move it: one config through `offload-trainer train` from two checkouts,
# alternated (old, new, old, new, ...) on a card held to 24 GB, in one device run.
#   OLD=DIR bash bench/runs/old_vs_new.sh OUT.jsonl CONFIG [REPEATS] [key=value ...]
# DIR holds the old commit's `offload_trainer/` and `bench/` (e.g. `git archive OLD offload_trainer bench | tar x -C
# DIR`); each side runs with its own package first on PYTHONPATH and its own bench/rows/trainer_bench.py (bench/ of a
# checkout from before bench/ was grouped into folders: its trainer_bench.py at the top of bench/). Rows are named
# `old` / `new` in extra.side; COMMIT_OLD / COMMIT_NEW name the commits.
set -u
out=$1; config=$2; repeats=${3:-2}; shift 3 || shift $#
export RUN_ID=${RUN_ID:-$(date +%Y%m%d-%H%M%S)}
base=${PYTHONPATH:-}
. bench/runs/hold_card.sh && hold_card
for i in $(seq "$repeats"); do
  for side in old new; do
    if [ "$side" = old ]; then root=$OLD; commit=${COMMIT_OLD:-old}; else root=$PWD; commit=${COMMIT_NEW:-new}; fi
    echo "=== $side #$i $config $* ($(date +%T))"
    rm -rf /tmp/old_vs_new_out
    bench=$root/bench/rows/trainer_bench.py; [ -f "$bench" ] || bench=$root/bench/trainer_bench.py
    PYTHONPATH="$root${base:+:$base}" COMMIT=$commit timeout "${ROW_TIMEOUT:-240}" python3 "$bench" \
      "$config" gpu_memory_limit_gb= output_dir=/tmp/old_vs_new_out "$@" --out "$out.$side" \
      || echo "row failed: $side (rc $?)"
  done
done
kill $hold
for side in old new; do  # (each side's rows, marked, into OUT)
  [ -f "$out.$side" ] && python3 -c "
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line); r.setdefault('extra', {})['side'] = sys.argv[2]; print(json.dumps(r))" "$out.$side" "$side" >> "$out"
done
python3 - "$out" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
by = {s: [r["tok_per_s"] for r in rows if r["extra"].get("side") == s and not r.get("error")] for s in ("old", "new")}
print({s: v for s, v in by.items()})
if by["old"] and by["new"]:
    print(f"new / old: {statistics.median(by['new']) / statistics.median(by['old']):.4f}")
EOF
