"""The planner from a run's arguments (a TrainingArguments-like object and a model config), and the parsing of the
offload switches the planner takes (`layer_swap`, `offload_device_states`, the model dtype): once, here."""
from __future__ import annotations

import os

from .search import plan
from .shape import ModelShape
from .table import Plan

# The Trainer's saves (and the command's merged LoRA model) are split into shards of at most this size. safetensors
# copies every tensor of a shard to host memory before writing it, and transformers 5's default (50GB) makes an 8B
# model one shard: each save then took 15 GiB of host memory beside the pinned optimizer states (measured: host peak
# 30.8 GiB against 15.9 during training; 46.7 against 32.3 with exact clipping) -- more than
# a 32 GB machine has. With 2 GB shards (measured) the final save raised the host peak by 1.9 GiB, one shard.
SAVE_SHARD_BYTES = 2 * 10**9


def plan_from_args(args, config, seq: int, *, host_gb: float | None = None, gpu_gb: float | None = None,
                   model_args=None, lora_params: int | None = None, weight_bits: int | None = None,
                   ranks: int | None = None, other_models_gib: float = 0.0) -> Plan:
    """The planner for a TrainingArguments-like object and a model config (raises PlanError).
    `gpu_gb`: the GPU budget when `gpu_memory_limit_gb` is unset (e.g. the card's free memory).
    `model_args`: its `lora_r`, `lora_target_modules` and `load_in_4bit` select LoRA / QLoRA.
    `other_models_gib`: GPU memory of models that only run forward beside the trained one (TRL's reference model),
    taken off the budget.
    `ranks`: data parallel processes on this node (default: the launcher's, from `args.world_size` and
    LOCAL_WORLD_SIZE; one process sees one GPU). The host peak includes a save's shard (`SAVE_SHARD_BYTES`, or the
    bf16 weights when smaller; with LoRA too: checkpoints hold the adapters, but `offload-trainer train` also writes
    the merged model)."""
    gpu = getattr(args, "gpu_memory_limit_gb", None) or gpu_gb
    if gpu and other_models_gib:
        gpu -= other_models_gib
    shape = ModelShape.from_config(config)
    r = getattr(model_args, "lora_r", 0) or 0
    lora = shape.lora_params(r, getattr(model_args, "lora_target_modules", "all-linear")) if r else 0
    lora = lora if lora_params is None else lora_params
    bits = (4 if getattr(model_args, "load_in_4bit", False) else 16) if weight_bits is None else weight_bits
    if ranks is None:  # under torchrun / accelerate launch
        ranks = int(getattr(args, "world_size", 1) or 1)
        node_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
    else:
        node_ranks = ranks
    wb = dtype_bytes(getattr(model_args, "torch_dtype", None) or getattr(config, "dtype", None)
                     or getattr(config, "torch_dtype", None))
    saved = wb * shape.params  # the weights (LoRA too: the command saves a merged model)
    return plan(config, batch=args.per_device_train_batch_size, seq=seq, gpu_memory_limit_gb=gpu,
                host_memory_gb=host_gb, max_grad_norm=args.max_grad_norm or 0.0,
                loss_chunk=getattr(args, "loss_chunk_size", 1024),
                chunk_numel=getattr(args, "offload_chunk_numel", 2**25),
                inflight=getattr(args, "offload_inflight_chunks", 4),
                fused_update=getattr(args, "offload_fused_update", None) is not False,
                device_states=device_state_setting(getattr(args, "offload_device_states", 0)),
                activation_offload=getattr(args, "activation_offload", None) if gpu else
                bool(getattr(args, "activation_offload", False)),
                offload_gradients=getattr(args, "offload_gradients", None) if gpu else
                bool(getattr(args, "offload_gradients", False)),
                speculative=getattr(args, "speculative_clipping", None) if gpu else
                bool(getattr(args, "speculative_clipping", False)),
                layer_swap=layer_swap_setting(getattr(args, "layer_swap", "off")), lora_params=lora, weight_bits=bits,
                accum=max(1, int(getattr(args, "gradient_accumulation_steps", 1) or 1)), ranks=ranks or 1,
                node_ranks=node_ranks, save_shard_bytes=min(SAVE_SHARD_BYTES, saved), weight_bytes=wb)


def dtype_bytes(dtype) -> int:
    """Bytes per value of a model dtype ('float32', torch.float32, None: bf16's 2)."""
    return 4 if str(dtype).replace("torch.", "") in ("float32", "float", "fp32") else 2


def device_state_setting(value) -> str | float:
    """The `offload_device_states` argument ('auto', or GiB; 'off' / None: 0) as `plan(device_states=...)`; raises
    ValueError on anything else (OffloadTrainingArguments checks its value with this)."""
    text = str(value).strip().lower()
    if value is None or value is False or text in ("off", "false", "no", "none"):
        return 0.0
    if text == "auto":
        return "auto"
    try:
        gib = float(text)
    except ValueError:
        gib = -1.0
    if gib < 0:
        raise ValueError(f"offload_device_states={text!r}: use auto, off, or a number of GiB of optimizer states to "
                         f"keep on the GPU")
    return gib


def layer_swap_setting(value) -> bool | int | None:
    """The `layer_swap` argument ('off', 'auto' or a number of resident layers) as `plan(layer_swap=...)`."""
    if value in (None, "off", False, "false", "False"):
        return False
    if value in ("auto", True, "true", "True"):
        return None
    return int(value)
