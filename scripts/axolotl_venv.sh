#!/usr/bin/env bash
# The virtual environment the axolotl plugin is tested in (tests/test_axolotl.py), on a CPU-only machine: axolotl
# with the versions it pins for transformers / peft / trl / datasets / accelerate / torchao, and this checkout.
# axolotl's GPU-only requirements (xformers, flash-linear-attention, liger-kernel, fla-core) and its services
# (gradio, modal, lm_eval, cloud filesystems) are left out: the plugin path does not import them. On a GPU machine
# `pip install 'offload-trainer[axolotl]'` installs axolotl with all of its own requirements instead.
#   bash scripts/axolotl_venv.sh && .venv-axolotl/bin/python -m pytest -q -m axolotl tests/test_axolotl.py
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
python3 -m venv .venv-axolotl
pip=.venv-axolotl/bin/pip
$pip install -q torch==2.13.0
$pip install -q --no-deps axolotl==0.19.0
$pip install -q transformers==5.16.1 peft==0.20.0 trl==1.9.0 datasets==4.8.4 accelerate==1.13.0 \
  huggingface_hub==1.17.0 tokenizers==0.23.1 torchao==0.17.0 bitsandbytes==0.50.2 pydantic==2.12.5 PyYAML==6.0.3 \
  packaging==26.0 typing-extensions==4.15.0 python-dotenv==1.0.1 zstandard==0.22.0 posthog==6.7.11 \
  nvidia-ml-py==12.560.30 typer==0.25.1 schedulefree==1.4.1 "kernels>=0.16,<0.17" evaluate==0.4.1 optimum==1.16.2 \
  mistral-common==1.11.5 immutabledict==4.2.0 langdetect==1.0.9 axolotl-contribs-lgpl==0.0.7 \
  axolotl-contribs-mit==0.0.6 addict fire requests einops colorama "numpy<3" scipy sentencepiece fastcore art \
  tensorboard hf_transfer numba triton wandb matplotlib pytest
$pip install -q --no-deps -e .
