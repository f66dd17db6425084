#!/usr/bin/env bash
# The step's time budget of one case, on the device: the bare loop (`native`), the stock Trainer (`trainer_native`)
# and `offload-trainer train` each profiled in one device run, then bench/analysis/budget.py on the traces.
#   bash bench/runs/budget.sh OUTDIR "noclip clip" [key=value ...]
# Natives first, while the card is free (uncapped, fused fp32 AdamW: NATIVE=native_8bit for shapes whose fp32 states
# do not fit); then .gpu/hold_gpu_memory.py holds all but 23.5 GiB and the command runs the config as it is. Modes:
# noclip (max_grad_norm 0 everywhere) and clip (the natives clip at 1.0; ours at 1000: speculative, the clip never
# fires). CONFIG (default configs/llama3-8b-full-24gb.yaml), MODEL / BS / SEQ: the bare loop's shape (the config's);
# NATIVE=none where the bare loop has no such model (vision): the stock Trainer is then the only reference.
# Rows to OUTDIR/rows.jsonl, traces to OUTDIR/*.json.gz, the budget to OUTDIR/budget.json and stdout. ROW_TIMEOUT
# (default 200 s) bounds each row: the command's profiled run at 32k needs ~230 s (ROW_TIMEOUT=300).
set -u
dir=$1; modes=$2; shift 2
mkdir -p "$dir"
config=${CONFIG:-configs/llama3-8b-full-24gb.yaml}; model=${MODEL:-llama3-8b}; bs=${BS:-4}; seq=${SEQ:-2048}
native=${NATIVE:-native}; optim=${OPTIM:-adamw_torch_fused}
export RUN_ID=${RUN_ID:-$(date +%Y%m%d-%H%M%S)} COMMIT=${COMMIT:-$(git describe --always --dirty --abbrev=7 --exclude="*" 2>/dev/null || echo unknown)}
out=$dir/rows.jsonl; prof=(--skip 3 --profile-steps 3); steps=13  # (6 timed steps: 4-7 are profiled or write the trace)
clipkey() { [ "$1" = clip ] && echo "max_grad_norm=$2" || echo "max_grad_norm=0"; }
for m in $modes; do
  sys=$native; [ "$m" = clip ] && sys=${native}_clip
  [ "$native" = none ] || {
    echo "=== $sys ($(date +%T))"
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "${ROW_TIMEOUT:-200}" python3 bench/rows/step_bench.py \
      "$sys" "$model" --bs "$bs" --seq "$seq" --steps 6 --profile-steps 3 --trace "$dir/$sys.json.gz" --out "$out" ||
      echo "row failed: $sys (rc $?)"
  }
  echo "=== trainer_native $m ($(date +%T))"
  timeout "${ROW_TIMEOUT:-200}" python3 bench/rows/trainer_bench.py "$config" --stock offload_optimizer=false optim="$optim" \
    gpu_memory_limit_gb= layer_swap=off activation_offload=false "$(clipkey "$m" 1.0)" max_steps=$steps \
    output_dir=/tmp/budget_out "$@" "${prof[@]}" --trace "$dir/trainer_native_$m.json.gz" --out "$out" ||
    echo "row failed: trainer_native $m (rc $?)"
  rm -rf /tmp/budget_out
done
. bench/runs/hold_card.sh && hold_card
for m in $modes; do
  echo "=== ours $m ($(date +%T))"
  timeout "${ROW_TIMEOUT:-200}" python3 bench/rows/trainer_bench.py "$config" gpu_memory_limit_gb= "$(clipkey "$m" 1000)" \
    max_steps=$steps output_dir=/tmp/budget_out "$@" "${prof[@]}" --trace "$dir/ours_$m.json.gz" --out "$out" ||
    echo "row failed: ours $m (rc $?)"
  rm -rf /tmp/budget_out
done
kill $hold
python3 bench/analysis/budget.py "$out" --traces "$dir" --json "$dir/budget.json"
