#!/usr/bin/env bash
# Clipping through `offload-trainer train` on a held 24 GB card, against native in the same device run:
#   bash bench/runs/clip_bench.sh OUT.jsonl [CONFIG] [MODEL] [BS]      (default: configs/llama3-8b-full-24gb.yaml llama3-8b 4)
# Rows: native and native_clip (uncapped, fused AdamW, step_bench.py), then with .gpu/hold_gpu_memory.py holding all
# but 23.5 GiB (a real 24 GB card): speculative clipping whose clip never fires (max_grad_norm 1000), one whose clip
# fires on every step (max_grad_norm 1e-6: redone, then exact by the policy), exact clipping, and no clipping.
# NATIVE=native_8bit for layer-swap shapes (torchao AdamW8bit on the GPU, as their rows are compared).
set -u
out=$1; config=${2:-configs/llama3-8b-full-24gb.yaml}; model=${3:-llama3-8b}; bs=${4:-4}
export RUN_ID=${RUN_ID:-$(date +%Y%m%d-%H%M%S)} COMMIT=${COMMIT:-$(git describe --always --dirty --abbrev=7 --exclude="*" 2>/dev/null || echo unknown)}
steps=${STEPS:-10}
for sys in ${NATIVE:-native native_clip}; do
  echo "=== $sys $model ($(date +%T))"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "${ROW_TIMEOUT:-150}" python3 bench/rows/step_bench.py "$sys" \
    "$model" --bs "$bs" --steps 6 --out "$out" || echo "row failed: $sys (rc $?)"
done
. bench/runs/hold_card.sh && hold_card
for spec in "max_grad_norm=1000" "max_grad_norm=0.000001 max_steps=$((steps + 2))" \
            "max_grad_norm=1.0 speculative_clipping=false" "max_grad_norm=0" ${EXTRA_ROWS:-}; do
  spec=${spec//,/ }
  echo "=== $spec ($(date +%T))"
  # shellcheck disable=SC2086
  timeout "${ROW_TIMEOUT:-150}" python3 bench/rows/trainer_bench.py "$config" gpu_memory_limit_gb= max_steps=$steps \
    output_dir=/tmp/clip_bench_out $spec --out "$out" || echo "row failed: $spec (rc $?)"
  rm -rf /tmp/clip_bench_out
done
kill $hold
