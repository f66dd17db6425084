#!/usr/bin/env bash
# Gradient accumulation as users write it (micro-batch x gradient_accumulation_steps), on the user's machine, against
# both references in the same device run:
#   CONFIG=configs/llama3-8b-full-24gb.yaml MODEL=llama3-8b SEQ=2048 \
#     bash bench/runs/accumulation.sh OUT.jsonl 57 "1 4" "2 4" "4 1 ours"
# For each case "BATCH ACCUM": the stock Trainer (trainer_bench.py --stock, adamw_torch_fused, clip 1.0, the uncapped
# card) and the bare loop (native_clip --accum), then, with the card held to 24 GB and the host to LEAVE GiB
# (host_machine.sh), ours through `offload-trainer train` without clipping (max_grad_norm=0) and with clip 1.0 that
# never fires (max_grad_norm=1000: speculative clipping's step as a finetune gets it). A case ending in "ours" runs
# ours only, clip not firing (a row of the same call to compare with).
set -u
out=$1; leave=$2; shift 2
config=${CONFIG:-configs/llama3-8b-full-24gb.yaml}; model=${MODEL:-llama3-8b}; seq=${SEQ:-2048}; steps=${STEPS:-8}
export RUN_ID=${RUN_ID:-$(date +%Y%m%d-%H%M%S)} COMMIT=${COMMIT:-$(git describe --always --dirty --abbrev=7 --exclude="*" 2>/dev/null || echo unknown)}
natives=(); specs=()
for case in "$@"; do
  read -r bs k only <<< "$case"
  shape="per_device_train_batch_size=$bs gradient_accumulation_steps=$k max_steps=$steps max_seq_length=$seq"
  if [ "${only:-}" = ours ]; then
    specs+=("$config $shape max_grad_norm=1000")
    continue
  fi
  echo "=== stock Trainer $bs x $seq x $k ($(date +%T))"
  # shellcheck disable=SC2086
  timeout "${ROW_TIMEOUT:-240}" python3 bench/rows/trainer_bench.py "$config" --stock offload_optimizer=false \
    optim=adamw_torch_fused gpu_memory_limit_gb= max_grad_norm=1.0 $shape output_dir=/tmp/acc_stock --skip "${SKIP:-2}" \
    --out "$out" || echo "row failed: stock $bs x $k (rc $?)"
  rm -rf /tmp/acc_stock
  natives+=("native_clip $model $bs $seq $k")
  specs+=("$config $shape max_grad_norm=0" "$config $shape max_grad_norm=1000")
done
NATIVES=$(IFS=';'; echo "${natives[*]}") bash bench/runs/host_machine.sh "$out" "$leave" "${specs[@]}"
