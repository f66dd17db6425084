#!/usr/bin/env bash
# Long context through `offload-trainer train` on a held 24 GB card, against native in the same device run:
#   bash bench/runs/long_context.sh OUT.jsonl "16384 32768 65536" [key=value ...]
# Native rows first, while the card is free: the same command and data with every switch off, uncapped, torchao's
# AdamW8bit on the GPU (`native_8bit`: fp32 AdamW states of an 8B model beside 64k tokens of activations pass even an
# H200). Then .gpu/hold_gpu_memory.py holds all but 23.5 GiB and each length runs as configured (SPECS: one run per
# space-separated spec, commas between its keys; default the config as it is). NO_NATIVE=1 skips the native rows.
# AROUND="2 -2": after a spec's row, one row per offset with `layer_swap` pinned at that row's final resident count
# plus the offset (auto against hand-picked counts around its choice, same call).
set -u
out=$1; lengths=$2; shift 2; extra=("$@")  # (key=value for every row)
config=${CONFIG:-configs/llama3.1-8b-32k-24gb.yaml}
export RUN_ID=${RUN_ID:-$(date +%Y%m%d-%H%M%S)} COMMIT=${COMMIT:-$(git describe --always --dirty --abbrev=7 --exclude="*" 2>/dev/null || echo unknown)}
steps() { if [ "$1" -ge 65536 ]; then echo 6; elif [ "$1" -ge 32768 ]; then echo 7; else echo 8; fi; }
if [ -z "${NO_NATIVE:-}" ]; then
  for s in $lengths; do
    echo "=== native_8bit $s ($(date +%T))"
    timeout "${ROW_TIMEOUT:-240}" python3 bench/rows/trainer_bench.py "$config" max_seq_length="$s" gpu_memory_limit_gb= \
      offload_optimizer=false optim=adamw_torch_8bit layer_swap=off activation_offload=false max_steps="$(steps "$s")" \
      output_dir=/tmp/long_native "$@" --skip 3 --system native_8bit --out "$out" || echo "row failed: native $s (rc $?)"
    rm -rf /tmp/long_native
  done
fi
. bench/runs/hold_card.sh && hold_card
# one held row: ours LENGTH [key=value ...] (the config's run at that length with the keys set)
ours() {
  local s=$1; shift
  echo "=== $s $* ($(date +%T))"
  timeout "${ROW_TIMEOUT:-240}" python3 bench/rows/trainer_bench.py "$config" max_seq_length="$s" gpu_memory_limit_gb= \
    max_steps="$(steps "$s")" output_dir=/tmp/long_ours "$@" "${extra[@]}" --skip 3 --out "$out" ||
    echo "row failed: $s $* (rc $?)"
  rm -rf /tmp/long_ours
}
for s in $lengths; do
  for spec in ${SPECS:-"-"}; do
    spec=${spec//,/ }; [ "$spec" = "-" ] && spec=""
    # shellcheck disable=SC2086
    ours "$s" $spec
    [ -n "${AROUND:-}" ] || continue
    final=$(tail -n1 "$out" | python3 -c "import json,sys; print(json.load(sys.stdin)['extra']['resident_layers']['final'])") ||
      { echo "no resident count from the row: nothing around it"; continue; }
    for d in $AROUND; do
      n=$((final + d)); [ "$n" -ge 1 ] || continue
      # shellcheck disable=SC2086
      ours "$s" $spec layer_swap="$n"  # (auto's final count plus d)
    done
  done
done
kill $hold
grep -h "^{" "$out" | python3 -c "import json,sys; [print(r[\"system\"], r[\"seq_len\"], r[\"tok_per_s\"], r[\"peak_reserved_gib\"], r.get(\"error\"), r[\"extra\"].get(\"resident_layers\")) for r in map(json.loads, sys.stdin)]" || true
