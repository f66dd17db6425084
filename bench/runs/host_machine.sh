#!/usr/bin/env bash
# The user's machine held for real: the card held to 24 GB and the host to LEAVE GiB available (57: a 64 GB machine),
# configs run through `offload-trainer train`, against natives in the same device run.
#   NATIVES="native llama3-8b 4 2048;native_8bit qwen2.5-14b 8 2048;native_clip llama3-8b 1 2048 4" \
#     bash bench/runs/host_machine.sh OUT.jsonl 57 "configs/llama3-8b-full-24gb.yaml" "configs/x.yaml max_seq_length=65536" ...
# Natives first (bench/rows/step_bench.py, the bare loop, on the uncapped card: "SYSTEM MODEL BATCH SEQ [ACCUM]", ';'
# between),
# then both holds and one row per spec (a config and its key=value overrides). Each row gets extra.host_available_min_gib
# (the least MemAvailable while it ran, bench/runs/host_watch.py) and extra.host_hold_alive (the kernel's OOM killer picks
# the largest process, which may be the hold: a row that passed the budget then looks fine, and this says it did not).
# A row the plan refuses ends with the exit code in `error` and the sentence in this script's output.
set -u
out=$1; leave=$2; shift 2
export RUN_ID=${RUN_ID:-$(date +%Y%m%d-%H%M%S)} COMMIT=${COMMIT:-$(git describe --always --dirty --abbrev=7 --exclude="*" 2>/dev/null || echo unknown)}
IFS=';' read -r -a natives <<< "${NATIVES:-}"
for n in "${natives[@]}"; do
  read -r sys model bs seq acc <<< "$n"
  echo "=== $sys $model $bs x $seq x ${acc:-1} ($(date +%T))"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "${ROW_TIMEOUT:-200}" python3 bench/rows/step_bench.py "$sys" \
    "$model" --bs "$bs" --seq "$seq" --accum "${acc:-1}" --steps "${NATIVE_STEPS:-6}" --out "$out" \
    || echo "row failed: $sys $model (rc $?)"
done
. bench/runs/hold_card.sh && hold_card && hold_host "$leave"
for spec in "$@"; do
  read -r -a words <<< "$spec"
  echo "=== ${words[*]} ($(date +%T))"
  before=$(cat "$out" 2>/dev/null | wc -l)
  python3 bench/runs/host_watch.py /tmp/host_low & watch=$!
  timeout "${ROW_TIMEOUT:-240}" python3 bench/rows/trainer_bench.py "${words[@]}" gpu_memory_limit_gb= \
    output_dir=/tmp/host_row --skip "${SKIP:-2}" --out "$out"
  rc=$?; kill $watch; rm -rf /tmp/host_row
  alive=true; kill -0 "$host_hold" 2>/dev/null || alive=false
  [ $rc = 0 ] || echo "row ended with rc $rc: ${words[*]}"
  python3 - "$out" "$(cat /tmp/host_low)" "$alive" "$leave" "$before" "$rc" "$spec" <<'PY'
import json, os, sys
path, low, alive, leave = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "true", float(sys.argv[4])
before, rc, spec = int(sys.argv[5]), sys.argv[6], sys.argv[7]
lines = open(path).read().splitlines() if os.path.exists(path) else []
if len(lines) == before:  # (killed: no row of its own)
    lines.append(json.dumps(dict(run_id=os.environ["RUN_ID"], commit=os.environ["COMMIT"], system="killed",
                                 model=spec, micro_batch=None, seq_len=None, tok_per_s=None, peak_reserved_gib=None,
                                 host_peak_gib=None, error=f"no row: exit code {rc}", extra=dict(argv=spec))))
row = json.loads(lines[-1])
row["extra"].update(host_available_min_gib=low, host_hold_alive=alive, host_left_gib=leave)
lines[-1] = json.dumps(row)
open(path, "w").write("\n".join(lines) + "\n")
print(f"host: {row['host_peak_gib']} GiB peak, {low} GiB least available, hold alive: {alive}")
PY
  $alive || { echo "the host hold was killed: the rows after this one are not on a $leave GiB host"; break; }
done
kill "$hold" "$host_hold" 2>/dev/null
python3 - "$out" <<'PY'
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    p = r.get("predicted") or {}
    print(r["system"], r["model"], r["micro_batch"], "x", r["seq_len"], r["tok_per_s"], "GPU", r["peak_reserved_gib"],
          "host", r["host_peak_gib"], "pred", p.get("host_peak_gib"), r["extra"].get("resident_layers"), r["error"])
PY
