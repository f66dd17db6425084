"""The planner for a run: its shape (`run_shape`: the model config, its rows, LoRA / QLoRA) and budget (`run_budget`:
what the machine gives it) from the run's settings and facts, and `make_plan`, the one call the command and the
Trainer make."""
from __future__ import annotations

import dataclasses
import logging
import os

from ..settings import OffloadSettings
from .inputs import Budget, RunShape
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


def make_plan(settings: OffloadSettings, budget: Budget, *, required: bool, config, seq: int, model_args=None,
              lora_params: int | None = None, weight_bits: int | None = None) -> Plan | None:
    """The run's plan for the model of `config` on rows of `seq` tokens (`run_shape` says what the other keywords
    select), or None where the run goes on without one (said in the log): the one call the command and the Trainer
    make, and the one rule of when a PlanError stops a run. Raised where a plan is required: asked for (`required`:
    `offload-trainer plan`), a GPU cap to keep within, or host memory short of every plan (the kernel would end the
    run with SIGKILL, no word). Otherwise -- an architecture the planner does not know, a config it cannot read, no
    plan that fits the card's own memory with no cap asked for -- training tries with the switches as given, as the
    Trainer would."""
    try:
        shape = run_shape(config, seq, model_args, lora_params=lora_params, weight_bits=weight_bits)
        return plan_for_run(settings, shape, budget)
    except UnknownArchitecture as e:
        if required:
            raise
        logger.warning("no plan: %s", e)
    except PlanError as e:
        if required or settings.gpu_memory_limit_gb or isinstance(e, HostPlanError):
            raise
        logger.warning("the planner finds no plan that fits this GPU (%.1f GiB): %s", budget.gpu_gb or 0, e)
    except (AttributeError, TypeError):  # not a decoder-only LM config the planner reads
        if required:
            raise
        logger.info("no plan: the model's config has no shape the planner reads")
    return None


def plan_for_run(settings: OffloadSettings, shape: RunShape, budget: Budget) -> Plan:
    """`plan(shape, settings, budget)` for a run (raises PlanError): without a GPU budget a switch left to the plan
    is off and nothing folds (nothing to plan for)."""
    s = settings
    if not budget.gpu_gb:
        s = dataclasses.replace(
            s, activation_offload=bool(s.activation_offload), tiled_mlp=bool(s.tiled_mlp),
            tiled_layers=bool(s.tiled_layers), offload_gradients=bool(s.offload_gradients),
            speculative_clipping=bool(s.speculative_clipping), fold=s.fold or 1)
    return plan(shape, s, budget)


def run_shape(config, seq: int, model_args=None, *, lora_params: int | None = None,
              weight_bits: int | None = None) -> RunShape:
    """What a run trains (raises UnknownArchitecture, or AttributeError / TypeError for a config the planner does
    not read): the model of `config`, its rows of `seq` tokens; `model_args`' `lora_r`, `lora_target_modules` and
    `load_in_4bit` select LoRA / QLoRA, `torch_dtype` the weights' bytes, unless `lora_params` and `weight_bits` say
    what the built model has. The host peak includes a save's shard (`SAVE_SHARD_BYTES`, or the weights when
    smaller; with LoRA too: checkpoints hold the adapters, but `offload-trainer train` also writes the merged
    model)."""
    model = ModelShape.from_config(config)
    r = getattr(model_args, "lora_r", 0) or 0
    lora = model.lora_params(r, getattr(model_args, "lora_target_modules", "all-linear")) if r else 0
    lora = lora if lora_params is None else lora_params
    bits = (4 if getattr(model_args, "load_in_4bit", False) else 16) if weight_bits is None else weight_bits
    wb = dtype_bytes(getattr(model_args, "torch_dtype", None) or getattr(config, "dtype", None)
                     or getattr(config, "torch_dtype", None))
    return RunShape(model, seq, lora_params=lora, weight_bits=bits, weight_bytes=wb,
                    save_shard_bytes=min(SAVE_SHARD_BYTES, wb * model.params))


def run_budget(settings: OffloadSettings, *, gpu_gb: float | None = None, host_gb: float | None = None,
               ranks: int | None = None, other_models_gib: float = 0.0) -> Budget:
    """What this machine gives the run. `gpu_gb`: the GPU's own budget (e.g. the card's free memory): the plan is made
    for it, or for `gpu_memory_limit_gb` where that is less (or where the GPU is not known: planning from another
    machine). `other_models_gib`: GPU memory of models that only run forward beside the trained one (TRL's
    reference model), taken off it. `host_gb`: the host memory available; the plan is made for it, or for
    `host_memory_limit_gb` where that is less (or where this machine's is not given). `ranks`: data parallel
    processes on this node (default: the launcher's, `settings.world_size` and LOCAL_WORLD_SIZE; one process sees
    one GPU)."""
    gpu = min((g for g in (settings.gpu_memory_limit_gb, gpu_gb) if g), default=None)  # (a cap above the card is it)
    if gpu and other_models_gib:
        gpu -= other_models_gib
    host, source = host_budget(settings.host_memory_limit_gb, host_gb)
    if ranks is None:  # under torchrun / accelerate launch
        ranks = settings.world_size
        node_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
    else:
        node_ranks = ranks
    return Budget(gpu_gb=gpu, host_gb=host, host_source=source, ranks=ranks or 1, node_ranks=node_ranks)


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


def plan_at_resident(plan: Plan, settings: OffloadSettings, shape: RunShape, resident: int) -> Plan:
    """`plan` (made for `settings`) with `resident` decoder layers on the GPU, every other switch as it decided and
    no GPU budget, so a count over it is predicted rather than refused: the prediction for a run that ended with
    that count (layer_swap auto moves layers after measuring)."""
    fixed = dataclasses.replace(settings, gpu_memory_limit_gb=None, layer_swap=resident,
                                activation_offload=plan.activation_offload, offload_gradients=plan.offload_gradients,
                                tiled_mlp=plan.tiled_mlp,
                                tiled_layers=plan.tiled_layers, speculative_clipping=plan.speculative_clipping,
                                device_states=plan.device_state_gib, fold=plan.fold)
    return plan_for_run(fixed, shape, run_budget(fixed, host_gb=plan.host_budget_gib))
