#!/usr/bin/env bash
# A CPU stand-in for the GPU machine's Python, to rehearse a device call before spending device time on it: the
# versions its image holds (.library/device/KINDS.md: transformers 5.17.0, peft 0.21.0, accelerate 1.15.0, triton
# 3.6.0 and the rest; no pydantic, datasets, torchao, trl, bitsandbytes: those travel as wheels), with this machine's
# CPU torch 2.13 standing in for 2.11 + CUDA 13, and a placeholder torchaudio (LLaMA-Factory imports it; the device has
# the real one). Then, in a scratch copy of the checkout:
#   PYVER=3.11 bash scripts/device_wheels.sh axolotl llamafactory      # -> /tmp/whl3.11-TOOL (Python 3.11 builds)
#   cp -r /tmp/whl3.11-axolotl .whl-axolotl; ...; and a .gpu/hold_gpu_memory.py that prints READY and sleeps
#   PATH=$PWD/.venv-device/bin:$PATH CPU=1 MODEL=tiny-llama QLORA=tiny-llama SEQ=64 BATCH=2 STEPS=4 \
#     bash bench/runs/integrations.sh rows.jsonl "ours axolotl ours-qlora axolotl-qlora"
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
python3 -m venv .venv-device
pip=.venv-device/bin/pip
$pip install -q torch==2.13.0
$pip install -q transformers==5.17.0 peft==0.21.0 accelerate==1.15.0 triton==3.6.0 huggingface_hub tokenizers \
  safetensors sentencepiece tiktoken pyarrow pandas numpy scipy einops colorama numba jinja2 pyyaml requests rich \
  psutil tqdm regex fsspec hf-xet matplotlib tensorboard typer protobuf xxhash click packaging pillow aiohttp httpx \
  filelock pytest
$pip uninstall -y -q pydantic pydantic_core typing-inspection annotated-types  # (typer pulls them; the device lacks them)
site=$(.venv-device/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir -p "$site/torchaudio"
echo "# placeholder for the rehearsal: the GPU machine has torchaudio 2.11" > "$site/torchaudio/__init__.py"
