#!/usr/bin/env bash
# The virtual environment the LLaMA-Factory launcher is tested in (tests/test_llamafactory.py), on a CPU-only machine:
# LLaMA-Factory 0.9.5 with the versions it pins for transformers / peft / trl / datasets / accelerate, and this
# checkout. LLaMA-Factory imports torchaudio on every run, and torchaudio loads only with the torch it was built for:
# torch 2.11 with torchaudio 2.11 (the newest torchaudio on PyPI). Its services (gradio, the API server, modelscope)
# are left out: the training path does not import them. On a GPU machine `pip install 'offload-trainer[llamafactory]'`
# installs LLaMA-Factory with all of its own requirements instead.
#   bash scripts/llamafactory_venv.sh && .venv-llamafactory/bin/python -m pytest -q -m llamafactory tests/test_llamafactory.py
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
python3 -m venv .venv-llamafactory
pip=.venv-llamafactory/bin/pip
$pip install -q torch==2.11.0 torchaudio==2.11.0 torchvision==0.26.0
$pip install -q --no-deps llamafactory==0.9.5
$pip install -q transformers==5.6.0 peft==0.18.1 trl==0.24.0 datasets==4.0.0 accelerate==1.11.0 torchao==0.17.0 \
  bitsandbytes==0.50.2 pyyaml omegaconf fire pydantic einops numpy scipy sentencepiece tiktoken matplotlib pandas \
  protobuf "tyro<0.9.0" packaging safetensors "av<=16.0.0" pytest tensorboard
$pip install -q --no-deps -e .
