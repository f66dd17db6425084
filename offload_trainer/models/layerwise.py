"""Models built one block at a time on the GPU, each decoder layer parked in CPU memory once made: random-init
models for layer swap (seconds where the CPU took minutes), and QLoRA bases whose block linears are quantized to
bitsandbytes NF4 as each block is made (random init, or read from *.safetensors files without loading them whole), so
a base bigger than the GPU or the host's RAM never exists in bf16."""
from __future__ import annotations

import logging
import os
import time
import weakref

import torch

from .registry import layer_lists, model_class

logger = logging.getLogger("offload_trainer")
PROGRESS_EVERY_S = 5.0  # a build taking longer says how far it is at most this often

def random_init_4bit(cfg, device: str = "cuda", park: str | None = None):
    """A random-init model whose block linears are bitsandbytes NF4 (`Linear4bit`), built one block at a time
    on `device` from the meta device: a 70B shape needs one layer in bf16 at a time, never 140 GB.
    For benchmarks and tests of QLoRA on big shapes (`peft.get_peft_model` then picks its 4-bit LoRA layers).
    Causal LMs and vision-language models (Mllama: decoder and vision encoder layers are quantized; embeddings,
    heads and the projector stay bf16, as `BitsAndBytesConfig` leaves them). Initialised by the model's own
    `_init_weights`, except that the cross-attention gates (zero at init, which would cut the image off) are set
    to 0.1. `park`: where each decoder layer goes once built (e.g. "cpu", for a base bigger than the GPU)."""

    return _build(cfg, device, park, _random_fill, quantize=True)


def random_init_layerwise(cfg, device: str = "cuda", park: str | None = "cpu", dtype: torch.dtype = torch.bfloat16):
    """A random-init model built one block at a time on `device` (a GPU: an 8B model in seconds, where the CPU took
    minutes) from the meta device, each decoder layer parked on `park` once made, so the GPU holds the embeddings,
    the head and one layer at most: for layer swap, which pins the parked layers and moves the resident ones back.
    Initialised as `random_init_4bit` (the model's own `_init_weights`; cross-attention gates at 0.1)."""
    return _build(cfg, device, park, _random_fill, dtype=dtype, quantize=False)


def _random_fill(model, name: str, m) -> None:
    model._init_weights(m)
    for n, gate in m.named_parameters(recurse=False):
        if n.startswith("cross_attn_") and n.endswith("_gate"):
            gate.fill_(0.1)


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
        model = _build(cfg, device, park, fill, dtype=dtype, quantize=True)
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


def _build(cfg, device: str, park: str | None, fill, dtype: torch.dtype = torch.bfloat16, quantize: bool = True):
    """Build `cfg`'s model on the meta device, then materialise it module by module on `device`, each module's own
    tensors filled by `fill(model, module_name, module)`; with `quantize`, block linears become NF4 as each block is
    done. A build over `PROGRESS_EVERY_S` says how far it is."""
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
    total, done = sum(len(stack) for stack in blocks), 0
    start = said = time.perf_counter()
    for stack in blocks:
        for layer in stack:
            for m in layer.modules():
                materialise(m)
            if quantize:
                _quantize_linears(layer, device, dtype)
            if park is not None and park != device and stack is decoder:
                layer.to(park)
            done += 1
            if time.perf_counter() - said > PROGRESS_EVERY_S:
                said = time.perf_counter()
                logger.info("model: %d of %d blocks built (%.0f s)", done, total, said - start)
    if quantize:
        model.is_loaded_in_4bit = True  # peft picks its bitsandbytes LoRA layers from this flag
        for p in model.parameters():
            p.requires_grad_(False)
    return model


def _quantize_linears(layer, device: str, dtype: torch.dtype) -> None:
    """Every nn.Linear of `layer` replaced by a bitsandbytes NF4 `Linear4bit`, quantized on `device`."""
    import bitsandbytes as bnb
    from torch import nn

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
