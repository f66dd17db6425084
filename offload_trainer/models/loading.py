"""Model and tokenizer loading: pretrained weights (`from_pretrained`) or a named architecture with random init
(benchmarks and tests need no download), LoRA / QLoRA on top (peft)."""
from __future__ import annotations

import functools
import os
from typing import Any

import torch

from ..engine.wrap import wrap_forward
from ..errors import ConfigError
from .layerwise import pretrained_4bit_layerwise, random_init_4bit, random_init_layerwise
from .registry import DTYPES, VISION_LM_TARGETS, architecture_config, base_model, model_class

def hub_kwargs(model_args) -> dict:
    """from_pretrained's `trust_remote_code` and `revision`, as the config asks (absent: transformers' defaults)."""
    out = {}
    if getattr(model_args, "trust_remote_code", False):
        out["trust_remote_code"] = True
    if getattr(model_args, "revision", None):
        out["revision"] = model_args.revision
    return out


def load_tokenizer(model_args):
    from transformers import AutoTokenizer

    from ..data.sources import builtin_asset  # (here: the Trainer's import of models/ needs no data pipeline)

    path = model_args.tokenizer_name_or_path
    if path is None:
        path = model_args.model_name_or_path if model_args.model_name_or_path else builtin_asset("tokenizer")
    tok = AutoTokenizer.from_pretrained(path, **hub_kwargs(model_args))
    if tok.pad_token is None:
        # Packed sequences are all full length; padding only pads the last block, masked out of the loss.
        tok.pad_token = tok.eos_token
    return tok


def random_init_device(params: int, dtype: torch.dtype, device: torch.device, budget_gib: float | None = None):
    """Where to build a random-init model of `params` parameters (the caller counts them from the config: the
    planner's ModelShape): on `device` (a GPU) when its weights fit there, within `budget_gib` and the free memory,
    with 1 GiB to spare -- seconds, where initializing an 8B model on the CPU took over 4 minutes
    (H200 machine, 16 cores) -- else on the CPU. The same seed gives other weights on the GPU than on the CPU."""
    if device.type != "cuda":
        return torch.device("cpu")
    need = params * dtype.itemsize + 2**30
    free, _ = torch.cuda.mem_get_info(device)
    room = min(free, budget_gib * 2**30) if budget_gib else free
    return device if need <= room else torch.device("cpu")


def load_model(model_args, *, layerwise: bool = False,
               init_device: torch.device | None = None):
    """Load pretrained weights, or build a named architecture with random init, in the requested dtype.
    `layerwise` (layer swap): a 4-bit base is read and quantized one layer at a time and kept in CPU memory, so it
    may be bigger than the GPU; a random-init model is built one layer at a time on `init_device` when that is a GPU,
    each decoder layer parked in CPU memory for the swap to place. `init_device`: where a random-init model is built
    (default: the CPU; see `random_init_device`)."""
    dtype = DTYPES[model_args.torch_dtype]
    if getattr(model_args, "load_in_4bit", False):
        model = _load_4bit(model_args, dtype, layerwise=layerwise)
    elif model_args.model_name_or_path:
        kwargs: dict[str, Any] = dict(dtype=dtype, attn_implementation=model_args.attn_implementation,
                                      **hub_kwargs(model_args))
        path = model_args.model_name_or_path
        gguf = [f for f in os.listdir(path) if f.endswith(".gguf")] if os.path.isdir(path) else []
        if gguf and not os.path.exists(os.path.join(path, "config.json")):
            kwargs["gguf_file"] = gguf[0]
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, **{k: v for k, v in kwargs.items() if k not in (
            "dtype", "attn_implementation")})
        model = model_class(config).from_pretrained(path, **kwargs)
    else:
        config = architecture_config(model_args.model_config, model_args.model_overrides)
        config._attn_implementation = model_args.attn_implementation
        if layerwise and init_device is not None and init_device.type == "cuda":
            model = random_init_layerwise(config, init_device, park="cpu", dtype=dtype)
        else:
            with torch.device(init_device or "cpu"):
                model = model_class(config).from_config(config, dtype=dtype)
    # Training never reads a KV cache, and one built in forward turns off transformers' per-document masks of packed
    # rows (it detects packing from position_ids only without a cache).
    model.config.use_cache = False
    if model_args.lora_r:
        from peft import LoraConfig, get_peft_model

        vision = getattr(model.config, "vision_config", None) is not None
        targets = model_args.lora_target_modules
        if targets != "all-linear":
            targets = [t.strip() for t in targets.split(",")]
        elif vision:  # the language model's linear layers: the vision tower and its projector stay frozen
            targets = VISION_LM_TARGETS
        lora = LoraConfig(r=model_args.lora_r, lora_alpha=model_args.lora_alpha, lora_dropout=model_args.lora_dropout,
                          target_modules=targets, task_type=None if vision else "CAUSAL_LM")
        try:
            model = get_peft_model(model, lora)
        except ValueError as e:
            if "not found in the base model" not in str(e) and "No modules were targeted" not in str(e):
                raise

            names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
            raise ConfigError(f"lora_target_modules={model_args.lora_target_modules!r} matches no module of the model;"
                              f" its linear modules are named {', '.join(names)} (or use all-linear)") from None
    if getattr(model.config, "vision_config", None) is not None:
        no_backward_into_a_frozen_vision_tower(model)
    return model


def no_backward_into_a_frozen_vision_tower(model: torch.nn.Module) -> None:
    """While nothing in the vision tower trains, it runs without autograd: no graph recorded, no backward into it.

    Hooks that make inputs require grad (peft's and the Trainer's `enable_input_require_grads`, for checkpointing
    with frozen embeddings) reach the vision embeddings too, so the tower recorded its whole graph (its saved
    tensors held through the step) and every backward ran through it for gradients nothing reads. Values and the
    trained parameters' gradients are unchanged (the projector still trains when unfrozen); unfreeze a tower
    parameter and autograd comes back.
    """
    inner = base_model(model)
    holder = getattr(inner, "model", inner)
    tower = getattr(holder, "vision_model", None) or getattr(holder, "vision_tower", None)
    if tower is None:
        return
    params = list(tower.parameters())

    def frozen(forward):
        @functools.wraps(forward)
        def forward_frozen(*args, **kwargs):
            if any(p.requires_grad for p in params):
                return forward(*args, **kwargs)
            with torch.no_grad():
                return forward(*args, **kwargs)
        return forward_frozen

    wrap_forward(tower, "frozen_tower", frozen)  # (unwrap() puts the tower's own forward back)


def local_weights(model_args) -> str:
    """The directory holding a model's *.safetensors files: the path itself, or for a Hub id its snapshot in the HF
    cache (fetched there if it is not yet, unless offline). Layer-by-layer loading reads the files directly."""
    path = model_args.model_name_or_path
    if os.path.isdir(path):
        return path
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(path, revision=getattr(model_args, "revision", None),
                                 allow_patterns=["*.safetensors", "*.json", "*.model", "*.txt", "*.jinja"])
    except Exception as e:  # (offline and not cached, unknown id, no network)
        raise FileNotFoundError(f"load_in_4bit with layer_swap reads {path!r}'s *.safetensors files layer by layer, "
                                f"and none could be had ({str(e).splitlines()[0][:160]}): download them first "
                                f"(`hf download {path}`) or give the local directory as model_name_or_path") from None


def _load_4bit(model_args, dtype, layerwise: bool = False):
    """The base model with bitsandbytes NF4 linears (QLoRA): random init layer by layer; pretrained weights layer
    by layer (`layerwise`, for layer swap: a base bigger than the GPU), or with from_pretrained onto the GPU."""
    import torch

    if model_args.model_name_or_path and layerwise:
        from transformers import AutoConfig

        path = local_weights(model_args)
        config = AutoConfig.from_pretrained(path, **hub_kwargs(model_args))
        config._attn_implementation = model_args.attn_implementation
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return pretrained_4bit_layerwise(path, config, device, park="cpu", dtype=dtype)
    if model_args.model_name_or_path is None:
        config = architecture_config(model_args.model_config, model_args.model_overrides)
        config._attn_implementation = model_args.attn_implementation
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return random_init_4bit(config, device, park="cpu")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                               bnb_4bit_use_double_quant=True)
    # NOTE: quantized onto the GPU as it loads: a base bigger than the card needs layerwise=True (layer swap).
    return AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, quantization_config=quant, dtype=dtype,
                                                **hub_kwargs(model_args),
                                                attn_implementation=model_args.attn_implementation,
                                                device_map={"": 0 if torch.cuda.is_available() else "cpu"})
