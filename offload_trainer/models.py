"""Model and tokenizer loading: pretrained weights (`from_pretrained`) or a named architecture with
random init (benchmarks and tests need no download)."""
from __future__ import annotations

import copy
import functools
import os
import weakref
from importlib import resources
from typing import Any

import torch

# Shared by the Llama-3.2 Vision sizes (90B, 11B): Llama-3.1's long-context RoPE and the 40-layer vision encoder.
# (architecture_config deep-copies an entry before use.)
_LLAMA31_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)
_LLAMA32_VISION_ENCODER = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_global_layers=8,
                               attention_heads=16, image_size=560, patch_size=14, max_num_tiles=4,
                               vision_output_dim=7680, intermediate_layers_indices=[3, 7, 15, 23, 30])

# Shapes of real models (from their published configs), for random-init benchmarks and the planner.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(model_type="llama", hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                       max_position_embeddings=2048, tie_word_embeddings=False),
    "llama3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                        max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True),
    "llama3.2-3b": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                        num_attention_heads=24, num_key_value_heads=8, vocab_size=128256,
                        max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False),
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False),
    "qwen2.5-14b": dict(model_type="qwen2", hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                        max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=False),
    "llama3-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False),
    # Llama-3.2-90B-Vision (MllamaForConditionalGeneration): a 100-layer language model (80 self-attention layers
    # as Llama-3-70B's, 20 cross-attention layers reading the image) and a 40-layer vision encoder.
    "llama3.2-90b-vision": dict(
        model_type="mllama",
        text_config=dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=100, num_attention_heads=64,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                         rope_parameters=_LLAMA31_ROPE,
                         cross_attention_layers=list(range(3, 100, 5)), tie_word_embeddings=False),
        vision_config=_LLAMA32_VISION_ENCODER),
    # Llama-3.2-11B-Vision: Llama-3.1-8B's 32 self-attention layers with 8 cross-attention layers among them (40),
    # and the same vision encoder as the 90B.
    "llama3.2-11b-vision": dict(
        model_type="mllama",
        text_config=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=40, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                         rope_parameters=_LLAMA31_ROPE,
                         cross_attention_layers=list(range(3, 40, 5)), tie_word_embeddings=False),
        vision_config=_LLAMA32_VISION_ENCODER),
    # the same structure, small enough for CPU tests
    "tiny-mllama": dict(
        model_type="mllama",
        text_config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=5, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048,
                         cross_attention_layers=[1, 3], tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0),
        image_token_index=512,
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_global_layers=1,
                           attention_heads=4, image_size=28, patch_size=14, max_num_tiles=4,
                           vision_output_dim=192, intermediate_layers_indices=[0, 1])),
}

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def builtin_asset(name: str) -> str:
    """Path of a file shipped in offload_trainer/assets (the built-in corpus and tokenizer)."""
    return str(resources.files("offload_trainer") / "assets" / name)


def architecture_config(name: str, overrides: dict | None = None):
    """A transformers config for a named architecture, without touching any weights."""
    from transformers import AutoConfig

    if name not in ARCHITECTURES:
        import difflib

        close = difflib.get_close_matches(name, ARCHITECTURES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"model_config={name!r} is not a known architecture.{hint} "
                         f"Known: {', '.join(ARCHITECTURES)}")
    fields = copy.deepcopy(ARCHITECTURES[name])
    model_type = fields.pop("model_type")
    if overrides:
        _check_override_keys(name, AutoConfig.for_model(model_type, **fields), overrides)
    fields.update(overrides or {})
    return AutoConfig.for_model(model_type, **fields)


def _check_override_keys(name: str, base, overrides: dict) -> None:
    """A config accepts any keyword (an unknown one becomes an attribute nobody reads): a typo in model_overrides
    would be ignored silently. Each key must be a field of the architecture's config."""
    import difflib
    import inspect

    known = set(base.to_dict()) | set(getattr(base, "attribute_map", {}))
    known |= set(inspect.signature(type(base).__init__).parameters) - {"self", "kwargs"}
    known |= set(ARCHITECTURES[name]) | {"rope_theta", "rope_scaling"}  # (read by __init__ through its **kwargs)
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            raise ValueError(f"model_overrides: {key!r} is not a field of {name}'s {type(base).__name__}"
                             + (f". Did you mean {close[0]!r}?" if close else ""))


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

    path = model_args.tokenizer_name_or_path
    if path is None:
        path = model_args.model_name_or_path if model_args.model_name_or_path else builtin_asset("tokenizer")
    tok = AutoTokenizer.from_pretrained(path, **hub_kwargs(model_args))
    if tok.pad_token is None:
        # Packed sequences are all full length; padding only pads the last block, masked out of the loss.
        tok.pad_token = tok.eos_token
    return tok


def random_init_device(config, dtype: torch.dtype, device: torch.device, budget_gib: float | None = None):
    """Where to build a random-init model: on `device` (a GPU) when its weights fit there, within `budget_gib` and
    the free memory, with 1 GiB to spare -- seconds, where initializing an 8B model on the CPU took over 4 minutes
    (H200 machine, 16 cores) -- else on the CPU. The same seed gives other weights on the GPU than on the CPU."""
    from .planner import ModelShape

    if device.type != "cuda":
        return torch.device("cpu")
    need = ModelShape.from_config(config).params * dtype.itemsize + 2**30
    free, _ = torch.cuda.mem_get_info(device)
    room = min(free, budget_gib * 2**30) if budget_gib else free
    return device if need <= room else torch.device("cpu")


def load_model(model_args, *, layerwise: bool = False,
               init_device: torch.device | None = None):
    """Load pretrained weights, or build a named architecture with random init, in the requested dtype.
    `layerwise` (layer swap): a 4-bit base is read and quantized one layer at a time and kept in CPU memory, so it
    may be bigger than the GPU. `init_device`: where a random-init model is built (default: the CPU; see
    `random_init_device`)."""
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
            from .config import ConfigError

            names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
            raise ConfigError(f"lora_target_modules={model_args.lora_target_modules!r} matches no module of the model;"
                              f" its linear modules are named {', '.join(names)} (or use all-linear)") from None
    if getattr(model.config, "vision_config", None) is not None:
        no_backward_into_a_frozen_vision_tower(model)
    return model


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


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
    forward = tower.forward

    @functools.wraps(forward)
    def forward_frozen(*args, **kwargs):
        if any(p.requires_grad for p in params):
            return forward(*args, **kwargs)
        with torch.no_grad():
            return forward(*args, **kwargs)

    tower.forward = forward_frozen  # (an instance attribute: the module's hooks still run around it)


# `lora_target_modules: all-linear` on a vision-language model: every linear layer of its language model.
VISION_LM_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def model_class(config):
    """The transformers auto class that builds a trainable LM for `config`: the image-text model for
    vision-language configs (e.g. Mllama), else the causal LM."""
    import transformers

    if getattr(config, "vision_config", None) is not None:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def layer_lists(model: torch.nn.Module) -> list[torch.nn.ModuleList]:
    """The stacks of repeated blocks, longest first (swap.layer_stacks: one definition)."""
    from .swap import layer_stacks

    return layer_stacks(model)


def random_init_4bit(cfg, device: str = "cuda", park: str | None = None):
    """A random-init model whose block linears are bitsandbytes NF4 (`Linear4bit`), built one block at a time
    on `device` from the meta device: a 70B shape needs one layer in bf16 at a time, never 140 GB.
    For benchmarks and tests of QLoRA on big shapes (`peft.get_peft_model` then picks its 4-bit LoRA layers).
    Causal LMs and vision-language models (Mllama: decoder and vision encoder layers are quantized; embeddings,
    heads and the projector stay bf16, as `BitsAndBytesConfig` leaves them). Initialised by the model's own
    `_init_weights`, except that the cross-attention gates (zero at init, which would cut the image off) are set
    to 0.1. `park`: where each decoder layer goes once built (e.g. "cpu", for a base bigger than the GPU)."""

    def fill(model, name: str, m) -> None:
        model._init_weights(m)
        for n, gate in m.named_parameters(recurse=False):
            if n.startswith("cross_attn_") and n.endswith("_gate"):
                gate.fill_(0.1)

    return _build_4bit(cfg, device, park, fill)


class SafetensorsReader:
    """Tensors of a local safetensors checkpoint (one file or an index of shards), each read on demand with plain
    file reads into a fresh tensor: no file is memory-mapped, so host memory holds the tensor being read and
    nothing else of the checkpoint (a mapped shard would count in the process's RSS as it is read)."""

    _DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
               "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
               "BOOL": torch.bool}

    def __init__(self, path: str):
        import json

        self.path = path
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) if os.path.isdir(path) else []
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors weights (layer-wise loading reads safetensors only; "
                                    f"convert the checkpoint, or set layer_swap: off)")
        self.where: dict[str, tuple] = {}  # name -> (file, dtype, shape, byte offset, byte length)
        for fname in files:
            full = os.path.join(path, fname)
            with open(full, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                begin, stop = info["data_offsets"]
                if info["dtype"] not in self._DTYPES:
                    raise ValueError(f"{full}: tensor {name} has dtype {info['dtype']}, which layer-wise loading "
                                     f"does not read; set layer_swap: off")
                self.where[name] = (full, self._DTYPES[info["dtype"]], tuple(info["shape"]), 8 + n + begin,
                                    stop - begin)
        self._file = None

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        full, dtype, shape, offset, nbytes = self.where[name]
        if self._file is None or self._file.name != full:
            self.close()
            self._file = open(full, "rb")
        t = torch.empty(shape, dtype=dtype)
        if nbytes:
            self._file.seek(offset)
            if self._file.readinto(memoryview(t.reshape(-1).view(torch.uint8).numpy())) != nbytes:
                raise ValueError(f"{full}: tensor {name} is truncated")
        return t

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def pretrained_4bit_layerwise(path: str, cfg=None, device: str = "cuda", park: str | None = "cpu",
                              dtype: torch.dtype = torch.bfloat16):
    """A pretrained model with NF4 block linears, loaded one block at a time: each tensor is read from the
    safetensors shards straight into place, each decoder layer is quantized on `device` and then parked (e.g. on
    the CPU, where the layer-swap engine pins it), so neither the GPU nor host memory ever holds more than one
    layer in 16 bits -- a 70B base loads onto a 24 GiB card and ~40 GB of RAM. Same NF4 (double-quantized) as
    `from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
    bnb_4bit_use_double_quant=True))`. Checkpoint names must be the model's own (every HF causal LM saved by
    transformers), with or without its `base_model_prefix`."""
    from transformers import AutoConfig

    cfg = cfg if cfg is not None else AutoConfig.from_pretrained(path)
    reader = SafetensorsReader(path)
    missing: list[str] = []

    def fill(model, name: str, m) -> None:
        prefix = model.base_model_prefix + "."
        for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
            full = f"{name}.{n}" if name else n
            alt = full[len(prefix):] if full.startswith(prefix) else prefix + full
            key = full if full in reader else alt if alt in reader else None
            if key is not None:
                t.copy_(reader.get(key))
            elif n in m._parameters or n not in m._non_persistent_buffers_set:
                missing.append(full)

    try:
        model = _build_4bit(cfg, device, park, fill, dtype=dtype)
    finally:
        reader.close()
    if model.config.get_text_config().tie_word_embeddings:
        model.tie_weights()
        head = model.get_output_embeddings()
        missing = [n for n in missing if head is None or not n.startswith(_module_name(model, head))]
    if missing:
        raise ValueError(f"{path}: {len(missing)} tensors of the model are not in the checkpoint (e.g. "
                         f"{', '.join(missing[:3])}): its names differ from this transformers version's. "
                         f"Set layer_swap: off to load it with from_pretrained.")
    return model.eval()  # as from_pretrained returns it (bitsandbytes picks its CPU kernels by the mode)


def _module_name(model, module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def _build_4bit(cfg, device: str, park: str | None, fill, dtype: torch.dtype = torch.bfloat16):
    """Build `cfg`'s model on the meta device, then materialise it module by module on `device`, each module's own
    tensors filled by `fill(model, module_name, module)`; block linears become NF4 as each block is done."""
    import bitsandbytes as bnb
    from torch import nn

    with torch.device("meta"):
        model = model_class(cfg).from_config(cfg, dtype=dtype)
    blocks = layer_lists(model)
    in_blocks = {id(m) for stack in blocks for layer in stack for m in layer.modules()}
    names = {id(m): n for n, m in model.named_modules()}
    # meta parameter -> (it, its materialised one): tied weights are made once and shared. The materialised one is
    # held weakly (a block's 16-bit weights must go once quantized), the meta one strongly (its id stays unique).
    made: dict[int, tuple] = {}

    @torch.no_grad()
    def materialise(m: nn.Module) -> None:
        for n, t in list(m._parameters.items()):
            if t is not None and t.is_meta:
                new = made[id(t)][1]() if id(t) in made else None
                if new is None:
                    new = nn.Parameter(torch.empty_like(t, device=device), requires_grad=t.requires_grad)
                    made[id(t)] = (t, weakref.ref(new))
                m._parameters[n] = new
        for n, t in m.named_buffers(recurse=False):
            if t.is_meta:
                m._buffers[n] = torch.empty_like(t, device=device)
        fill(model, names[id(m)], m)
        if "RotaryEmbedding" in type(m).__name__:  # inv_freq is computed at construction, not stored
            with torch.device("cpu"):  # (on the CPU, as transformers does: the GPU's pow rounds differently)
                fresh = type(m)(config=m.config)
            for n, buf in fresh.named_buffers(recurse=False):
                getattr(m, n).copy_(buf)

    for m in model.modules():
        if id(m) not in in_blocks:
            materialise(m)
    decoder = blocks[0]
    for stack in blocks:
        for layer in stack:
            for m in layer.modules():
                materialise(m)
            for parent in list(layer.modules()):
                for name, child in list(parent.named_children()):
                    if type(child) is not nn.Linear:
                        continue
                    q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                          compute_dtype=dtype, quant_type="nf4", device="meta")
                    q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4", module=q)
                    if child.bias is not None:
                        q.bias = nn.Parameter(child.bias.data, requires_grad=False)
                    setattr(parent, name, q.to(device))  # quantizes on the GPU
            if park is not None and park != device and stack is decoder:
                layer.to(park)
    model.is_loaded_in_4bit = True  # peft picks its bitsandbytes LoRA layers from this flag
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def random_image_text_batch(cfg, batch: int, seq: int, device="cpu", generator=None) -> dict:
    """Random inputs for an Mllama-style model: one image of `max_num_tiles` tiles per sequence (the image token
    first, every text token attending to every tile), for benchmarks and tests. Labels are the input ids."""
    vc, tc = cfg.vision_config, cfg.text_config
    tiles = vc.max_num_tiles
    ids = torch.randint(0, tc.vocab_size, (batch, seq), generator=generator)
    ids[:, 0] = cfg.image_token_index
    pixels = torch.randn(batch, 1, tiles, vc.num_channels, vc.image_size, vc.image_size, generator=generator)
    ratios = [list(r) for r in vc.supported_aspect_ratios]
    square = next(r for r in ratios if r[0] * r[1] == tiles)  # e.g. 2 x 2 tiles
    out = dict(input_ids=ids, pixel_values=pixels.to(torch.bfloat16),
               aspect_ratio_ids=torch.full((batch, 1), ratios.index(square) + 1),
               aspect_ratio_mask=torch.ones(batch, 1, tiles, dtype=torch.long),
               cross_attention_mask=torch.ones(batch, seq, 1, tiles, dtype=torch.long))
    return {k: v.to(device) for k, v in out.items()}


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


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
