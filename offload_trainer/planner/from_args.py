"""The planner for a run: its resolved settings (settings.py) and a model config."""
from __future__ import annotations

import dataclasses
import logging
import os

from ..settings import OffloadSettings
from .search import plan
from .shape import HostPlanError, ModelShape, PlanError, UnknownArchitecture
from .table import Plan

logger = logging.getLogger("offload_trainer")

# The Trainer's saves (and the command's merged LoRA model) are split into shards of at most this size. safetensors
# copies every tensor of a shard to host memory before writing it, and transformers 5's default (50GB) makes an 8B
# model one shard: each save then took 15 GiB of host memory beside the pinned optimizer states (measured: host peak
# 30.8 GiB against 15.9 during training; 46.7 against 32.3 with exact clipping) -- more than
# a 32 GB machine has. With 2 GB shards (measured) the final save raised the host peak by 1.9 GiB, one shard.
SAVE_SHARD_BYTES = 2 * 10**9


def plan_or_none(settings: OffloadSettings, config, seq: int, *, required: bool, **kw) -> Plan | None:
    """`plan_for_run(settings, config, seq, **kw)`, or None where the run goes on without a plan (said in the log):
    the one rule of when a PlanError stops a run, for the command and the Trainer. Raised where a plan is required:
    asked for (`required`: `offload-trainer plan`), a GPU cap to keep within, or host memory short of every plan
    (the kernel would end the run with SIGKILL, no word). Otherwise -- an architecture the planner does not know, no
    plan that fits the card's own memory with no cap asked for -- training tries with the switches as given, as the
    Trainer would."""
    try:
        return plan_for_run(settings, config, seq, **kw)
    except UnknownArchitecture as e:
        if required:
            raise
        logger.warning("no plan: %s", e)
    except PlanError as e:
        if required or settings.gpu_memory_limit_gb or isinstance(e, HostPlanError):
            raise
        logger.warning("the planner finds no plan that fits this GPU (%.1f GiB): %s", kw.get("gpu_gb") or 0, e)
    return None


def plan_for_run(settings: OffloadSettings, config, seq: int, *, host_gb: float | None = None,
                 gpu_gb: float | None = None, model_args=None, lora_params: int | None = None,
                 weight_bits: int | None = None, ranks: int | None = None, other_models_gib: float = 0.0) -> Plan:
    """The planner for a run's resolved `settings` and a model config (raises PlanError).
    `gpu_gb`: the GPU's own budget (e.g. the card's free memory): the plan is made for it, or for
    `gpu_memory_limit_gb` where that is less (or where the GPU is not known: planning from another machine); without
    either, a switch left to the plan is off (nothing to plan for).
    `model_args`: its `lora_r`, `lora_target_modules` and `load_in_4bit` select LoRA / QLoRA.
    `other_models_gib`: GPU memory of models that only run forward beside the trained one (TRL's reference model),
    taken off the budget.
    `ranks`: data parallel processes on this node (default: the launcher's, `settings.world_size` and
    LOCAL_WORLD_SIZE; one process sees one GPU).
    `host_gb`: the host memory this machine has for the run (what is available); the plan is made for it, or for
    `host_memory_limit_gb` where that is less (or where this machine's is not given: planning for another machine).
    The host peak includes a save's shard (`SAVE_SHARD_BYTES`, or the bf16 weights when smaller; with LoRA too:
    checkpoints hold the adapters, but `offload-trainer train` also writes the merged model)."""
    s = settings
    gpu = min((g for g in (s.gpu_memory_limit_gb, gpu_gb) if g), default=None)  # (a cap above the card is the card)
    host, source = host_budget(s.host_memory_limit_gb, host_gb)
    if gpu and other_models_gib:
        gpu -= other_models_gib
    shape = ModelShape.from_config(config)
    r = getattr(model_args, "lora_r", 0) or 0
    lora = shape.lora_params(r, getattr(model_args, "lora_target_modules", "all-linear")) if r else 0
    lora = lora if lora_params is None else lora_params
    bits = (4 if getattr(model_args, "load_in_4bit", False) else 16) if weight_bits is None else weight_bits
    if ranks is None:  # under torchrun / accelerate launch
        ranks = s.world_size
        node_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
    else:
        node_ranks = ranks
    wb = dtype_bytes(getattr(model_args, "torch_dtype", None) or getattr(config, "dtype", None)
                     or getattr(config, "torch_dtype", None))
    saved = wb * shape.params  # the weights (LoRA too: the command saves a merged model)

    def left_to_plan(value):  # (None lets the planner choose, which needs a budget)
        return value if gpu else bool(value)

    return plan(config, batch=s.batch, seq=seq, gpu_memory_limit_gb=gpu, host_memory_gb=host,
                host_budget_source=source, workers=s.data_workers,
                max_grad_norm=s.max_grad_norm, loss_chunk=s.loss_chunk_size, chunk_numel=s.chunk_numel,
                inflight=s.inflight_chunks, fused_update=s.fused_update is not False, device_states=s.device_states,
                activation_offload=left_to_plan(s.activation_offload), tiled_mlp=left_to_plan(s.tiled_mlp),
                tiled_layers=left_to_plan(s.tiled_layers),
                offload_gradients=left_to_plan(s.offload_gradients),
                speculative=left_to_plan(s.speculative_clipping), layer_swap=s.layer_swap, lora_params=lora,
                weight_bits=bits, accum=s.accumulation, fold=s.fold if s.fold is not None or gpu else 1,
                ranks=ranks or 1, node_ranks=node_ranks,
                save_shard_bytes=min(SAVE_SHARD_BYTES, saved), weight_bytes=wb)


def host_budget(limit_gb: float | None, available_gb: float | None) -> tuple[float | None, str]:
    """The host budget a plan is made for, and where it comes from (for the table): the lesser of
    `host_memory_limit_gb` and what this machine has available."""
    if limit_gb and (not available_gb or limit_gb <= available_gb):
        return limit_gb, "host_memory_limit_gb"
    if available_gb:
        return available_gb, ("available on this machine, less than host_memory_limit_gb" if limit_gb
                              else "available on this machine")
    return None, ""


def dtype_bytes(dtype) -> int:
    """Bytes per value of a model dtype ('float32', torch.float32, None: bf16's 2)."""
    return 4 if str(dtype).replace("torch.", "") in ("float32", "float", "fp32") else 2


def plan_at_resident(plan: Plan, settings: OffloadSettings, config, seq: int, resident: int, *,
                     model_args=None) -> Plan:
    """`plan` (made for `settings`) with `resident` decoder layers on the GPU, every other switch as it decided and
    no GPU budget, so a count over it is predicted rather than refused: the prediction for a run that ended with
    that count (layer_swap auto moves layers after measuring)."""
    fixed = dataclasses.replace(settings, gpu_memory_limit_gb=None, layer_swap=resident,
                                activation_offload=plan.activation_offload, offload_gradients=plan.offload_gradients,
                                tiled_mlp=plan.tiled_mlp,
                                tiled_layers=plan.tiled_layers, speculative_clipping=plan.speculative_clipping,
                                device_states=plan.device_state_gib, fold=plan.fold)
    return plan_for_run(fixed, config, seq, host_gb=plan.host_budget_gib, model_args=model_args)
