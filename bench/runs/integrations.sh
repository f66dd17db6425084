#!/usr/bin/env bash
# The integrations on a held 24 GB card (issue 40), each tool's ratio taken to `offload_trainer` (the command) of the
# same call and method:
#   bash bench/runs/integrations.sh OUT.jsonl "ours trl llamafactory"        (carry .whl .whl-trl .whl-llamafactory .gpu)
#   bash bench/runs/integrations.sh OUT.jsonl "ours axolotl"                 (carry .whl .whl-axolotl .whl-bnb .gpu)
#   bash bench/runs/integrations.sh OUT.jsonl "ours axolotl ours axolotl"    (alternated: each pair in its order)
#   QLORA=llama3-70b bash bench/runs/integrations.sh OUT.jsonl "ours-qlora axolotl-qlora"   (same carry as axolotl)
#   VARIANTS='axolotl-re=axolotl:gradient_checkpointing_kwargs={"use_reentrant": true}' \
#     bash bench/runs/integrations.sh OUT.jsonl "ours axolotl axolotl-re"   (a tool's config with one key changed; ';' between)
#   VARIANTS='axolotl-de=axolotl' ENVS='axolotl-de=PYTORCH_ALLOC_CONF=expandable_segments:False' \
#     bash bench/runs/integrations.sh OUT.jsonl "ours axolotl axolotl-de"   (a run with NAME=VALUE set; ';' between)
#   VARIANTS='ours-lf=ours' SITES='ours-lf=llamafactory' \
#     bash bench/runs/integrations.sh OUT.jsonl "ours llamafactory ours-lf" (a run on another tool's wheels: its pins)
# Full finetunes share one Llama-3-8B-shaped checkpoint (MODEL) and chat dataset, 4 x 2048 tokens a step (BATCH, SEQ),
# STEPS steps (10); the QLoRA pair a random-init base of the QLORA shape built block by block (no checkpoint: a 70B one
# does not fit the machine's disk), 1 x SEQ. Wheels: ../shared/gpu/fetch-wheels.sh (.whl), scripts/device_wheels.sh.
# PROFILE=2 TRACES=DIR: each row profiles 2 steps after the first 3 (torch.profiler: the compute stream's idle time,
# each stream's busy time; the events to DIR/trace-TOOL.json.gz for bench/analysis/trace_gaps.py), then cProfiles one.
# CPU=1: a rehearsal on a CPU (tiny shapes, bf16 off, a fake hold script).
set -u
out=$1; tools=$2
# (COMMIT ends in -dirty where the files differ from it: a device copy can carry a newer tree than its git names)
export RUN_ID=${RUN_ID:-$(date +%Y%m%d-%H%M%S)} COMMIT=${COMMIT:-$(git describe --always --dirty --abbrev=7 --exclude="*" 2>/dev/null || echo unknown)}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 AXOLOTL_DO_NOT_TRACK=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" "$1"/*.whl; }
install .whl /tmp/site || exit 1
if [ -d .whl-bnb ]; then install .whl-bnb /tmp/site || exit 1; fi
# the wheels a run imports first: its tool's, or those SITES names ("NAME=TOOL", space-separated)
site() { local s; for s in ${SITES:-}; do [ "${s%%=*}" = "$1" ] && { echo "${s#*=}"; return; }; done; echo "${1%%-*}"; }
for t in $tools; do t=$(site "$t"); if [ -d ".whl-$t" ] && [ ! -d "/tmp/site-$t" ]; then install ".whl-$t" "/tmp/site-$t" || exit 1; fi; done
base=/tmp/ib-base qbase=/tmp/ib-qbase work=/tmp/ib-work
py() { PYTHONPATH=/tmp/site:$PWD python3 bench/rows/integrations.py "$@"; }
case " $tools " in *" ours "*|*" trl "*|*" axolotl "*|*" llamafactory "*) py base $base --model "${MODEL:-llama3-8b}" || exit 1;; esac
[ -n "${QLORA:-}" ] && { py base $qbase --model "$QLORA" --config-only || exit 1; }
mkdir -p $base
variants=(); IFS=';' read -ra vs <<< "${VARIANTS:-}"; for v in "${vs[@]}"; do variants+=(--variant "$v"); done
py prepare $base $work --model "${MODEL:-llama3-8b}" --seq "${SEQ:-2048}" --batch "${BATCH:-4}" \
  --steps "${STEPS:-10}" ${QLORA:+--qlora-base $qbase} ${CPU:+--cpu} "${variants[@]}" || exit 1
. bench/runs/hold_card.sh && hold_card
for t in $tools; do
  echo "=== $t ($(date +%T))"
  tenv=(); IFS=";" read -ra es <<< "${ENVS:-}"; for e in "${es[@]}"; do [ "${e%%=*}" = "$t" ] && tenv+=("${e#*=}"); done
  env "${tenv[@]}" PYTHONPATH=/tmp/site-$(site "$t"):/tmp/site:$PWD timeout "${ROW_TIMEOUT:-240}" python3 bench/rows/integrations.py run "$t" \
    $work --out "$out" ${PROFILE:+--profile-steps "$PROFILE" --trace "${TRACES:-/tmp}/trace-$t.json.gz"} 2>&1 |
    grep -v "it/s]\|s/it]" || echo "row failed: $t"
  rm -rf "$work/out-$t"
done
kill $hold
py table "$out"
