#!/usr/bin/env bash
# Wheels that bench/rows/integrations.py needs on the GPU machine, beyond what its image holds (torch 2.11, transformers
# 5.17, peft, accelerate, numpy, pandas, pyarrow, torchaudio...; no network there). One folder per tool, since axolotl
# and LLaMA-Factory each pin their own transformers / peft / trl / datasets: the device installs each with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-TOOL .whl-TOOL/*.whl
# and runs that tool with /tmp/site-TOOL first on PYTHONPATH, then /tmp/site (.whl: torchao 0.18, datasets, ...: the
# engine runs on the same torchao under every tool). The lists are each tool's pins (scripts/*_venv.sh) closed over
# their requirements as pip resolved them against the device's packages, less what a rehearsal on a CPU (a venv of the
# device's versions, bench/rows/integrations.py run TOOL) showed the training path never imports: axolotl's services
# (gradio, modal, cloud filesystems, lm_eval), GPU-only extras (xformers, liger, fla), hf_transfer, langdetect, optimum.
# axolotl runs on the device's transformers 5.17 (its pin is 5.16.1; rehearsed); LLaMA-Factory 0.9.5 does not (it calls
# gradient checkpointing with an argument 5.17 dropped), so its transformers 5.6.0 travels. Carried to the device, a
# call holds at most 64 MiB: axolotl + bnb + .whl is one call, llamafactory + trl + .whl another.
#   bash scripts/device_wheels.sh [axolotl|llamafactory|trl|bnb ...]        (PYVER=3.11 for a rehearsal here)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
pyver=${PYVER:-3.12}
declare -A sets
sets[trl]="trl==1.9.0"
sets[bnb]="bitsandbytes==0.50.2"
sets[axolotl]="axolotl==0.19.0 peft==0.20.0 accelerate==1.13.0 trl==1.9.0 datasets==4.8.4 dill==0.4.1
  multiprocess==0.70.19 fsspec==2026.2.0 pydantic==2.12.5 pydantic_core==2.41.5 annotated-types==0.8.0
  typing-inspection==0.4.5 typing_extensions==4.15.0 python-dotenv==1.0.1 zstandard==0.22.0 posthog==6.7.11
  backoff==2.2.1 distro==1.9.0 schedulefree==1.4.1 kernels==0.16.2 kernels-data==0.16.2 evaluate==0.4.1
  mistral_common==1.11.5 pycountry==26.2.16 pydantic-extra-types==2.11.1 immutabledict==4.2.0
  axolotl-contribs-lgpl==0.0.7 axolotl-contribs-mit==0.0.6 addict==2.4.0 fire==0.7.1 termcolor==3.3.0
  fastcore==2.2.41 six==1.17.0 platformdirs==4.14.9 wandb==0.31.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2
  opentelemetry-proto==1.45.2 opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-otlp-proto-http==1.45.2
  opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-http-transport==0.66b2
  opentelemetry-exporter-otlp-common==0.66b2 googleapis-common-protos==1.76.0 cwevals==0.0.1b1 sniffio==1.3.1"
sets[llamafactory]="llamafactory==0.9.5 transformers==5.6.0 peft==0.18.1 trl==0.24.0 datasets==4.0.0 dill==0.3.8
  multiprocess==0.70.16 fsspec==2025.3.0 accelerate==1.11.0 tokenizers==0.22.2 omegaconf==2.4.0
  fire==0.7.1 termcolor==3.3.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  tyro==0.8.14 docstring_parser==0.18.0 shtab==1.13.0"
for name in "${@:-axolotl llamafactory trl bnb}"; do
  for set in $name; do
    dir=.whl-$set; [ "$pyver" = 3.12 ] || dir=/tmp/whl$pyver-$set
    grep -qxF "/.whl-$set/" .git/info/exclude 2>/dev/null || echo "/.whl-$set/" >> .git/info/exclude
    mkdir -p "$dir"
    for pkg in ${sets[$set]}; do
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        --platform any -d "$dir" "$pkg" >/dev/null 2>&1 ||
        python3 -m pip wheel -q --no-deps -w "$dir" "$pkg"  # (a pure-Python package published as source only)
    done
    # bitsandbytes ships a library per CUDA / ROCm version (43 MB; the device's torch is CUDA 13: those kept); axolotl
    # imports wandb, which never starts here (no wandb_project): its service binaries (51 MB) left out
    for whl in "$dir"/bitsandbytes-*.whl "$dir"/wandb-*.whl; do
      [ -e "$whl" ] || continue
      python3 - "$whl" <<'PY'
import re, sys, zipfile
src = sys.argv[1]
drop = re.compile(r"bitsandbytes/libbitsandbytes_(cuda1[0-2]\d|rocm\d+)\.so$|^wandb/bin/")
with zipfile.ZipFile(src) as z:
    items = [(i, z.read(i)) for i in z.infolist() if not drop.search(i.filename)]
with zipfile.ZipFile(src, "w", zipfile.ZIP_DEFLATED) as z:
    for i, data in items:
        if i.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line for line in data.splitlines(keepends=True) if not drop.search(line.decode().split(",")[0]))
        z.writestr(i, data)
PY
    done
    du -sh "$dir"
  done
done
