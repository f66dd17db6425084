"""Every rule that refuses a combination -- of our switches, the Trainer's arguments, the launch, the model -- in one
place, each raising ConfigError (a ValueError) with the sentence that names the fix. The bounds of one value are the
settings' own (`OffloadSettings.__post_init__`); what is here is between values. Who calls what:

- `launch_conflict(args, asked)`: DeepSpeed / FSDP asked for. The arguments call it first of all (the Trainer's own
  checks would import DeepSpeed); the Trainer's constructor for a plain `TrainingArguments`.
- `check_settings(settings, args)`: what the settings and the arguments decide alone. The arguments call it as they
  are built (as `TrainingArguments` checks its own fields), so the command meets it before any weight loads; the
  Trainer's constructor calls it again, for a plain `TrainingArguments` and for settings it was handed.
- `check_trainer(settings, args, optimizer_given)`: what depends on an optimizer handed to the Trainer; in its
  constructor, and in the command (which hands none) before any weight loads.
- `check_layer_swap(...)`, `check_swapped_training(...)`: what needs the model, in the Trainer's constructor, before
  a layer is placed.

(The streamed optimizer's and the layer swap's own constructors check their arguments too, for a bare loop's
caller; nothing the rules here let through reaches those checks.)
"""
from __future__ import annotations

from ..errors import ConfigError
from ..settings import OffloadSettings

# `optim` values that name AdamW: the streamed optimizer runs in their place (AdamW with torchao's 8-bit states; the
# README's "What differs from Trainer" says so). Any other name runs the Trainer's own optimizer, nothing offloaded.
ADAMW_NAMES = ("adamw_torch", "adamw_torch_fused", "adamw_torch_8bit", "adamw_torch_4bit", "adamw_bnb_8bit",
               "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit")

# `accelerate launch` asks for DeepSpeed or FSDP (its flags, or distributed_type in an accelerate config file) only
# through these variables, which TrainingArguments and the Accelerator read in the training processes.
LAUNCHER_ENGINES = {"ACCELERATE_USE_DEEPSPEED": "DEEPSPEED", "ACCELERATE_USE_FSDP": "FSDP"}


def optim_name(args) -> str:
    return str(getattr(args.optim, "value", args.optim))


def _may_stream(settings: OffloadSettings, args) -> bool:
    """Whether the streamed AdamW may run in the Trainer's optimizer's place (not turned off, `optim` names AdamW)."""
    return settings.offload_optimizer is not False and optim_name(args) in ADAMW_NAMES


def launch_conflict(args, asked: bool | None) -> None:
    """`offload_optimizer` (`asked`: its value) under DeepSpeed or FSDP, asked for by the arguments or the launch."""
    if asked is False:
        return
    from accelerate.utils import parse_flag_from_env  # (read as accelerate reads them)

    launched = [t for var, t in LAUNCHER_ENGINES.items() if parse_flag_from_env(var)]
    if launched:
        raise ConfigError(
            f"offload_optimizer streams the optimizer states itself and cannot run under {' / '.join(launched)}, "
            f"which `accelerate launch` was asked for (its --use_deepspeed / --use_fsdp, or distributed_type: "
            f"{launched[0]} in the accelerate config): launch with `accelerate launch --multi_gpu --num_processes N` "
            f"(distributed_type: MULTI_GPU) or with one process, or set offload_optimizer: false to let "
            f"{' / '.join(launched)} handle the optimizer")
    engines = [k for k in ("deepspeed", "fsdp") if getattr(args, k, None)]
    if engines:
        raise ConfigError(f"offload_optimizer streams the optimizer states itself and cannot run under "
                          f"{' / '.join(engines)} (which shard or offload them their own way): remove "
                          f"{', '.join(engines)}, or set offload_optimizer: false")


# switch -> why it needs activation checkpointing
_NEEDS_CHECKPOINTING = {
    "activation_offload": "activation_offload offloads the inputs that gradient checkpointing keeps",
    "tiled_mlp": "tiled_mlp recomputes each MLP tile in backward, which gradient checkpointing's recompute feeds",
    "tiled_layers": "tiled_layers recomputes each tile of a decoder layer in backward, which gradient checkpointing's "
                    "recompute feeds",
    "layer_swap": "layer_swap fetches each swapped layer again for its recompute in backward",
}


def check_settings(settings: OffloadSettings, args) -> None:
    """Every rule between our switches and the Trainer's arguments that needs no model (ConfigError)."""
    s = settings
    if s.fold is not None and s.accumulation % s.fold:
        raise ConfigError(f"fold_accumulation={s.fold}: each optimizer step's {s.accumulation} micro-batches "
                          f"(gradient_accumulation_steps) must split into groups of that many; use a divisor of "
                          f"{s.accumulation}, auto or off")
    if not s.checkpointing:
        for name, why in _NEEDS_CHECKPOINTING.items():
            value = getattr(s, name)
            if value if name != "layer_swap" else value is not False:
                raise ConfigError(f"{why}: set activation_checkpointing: true as well")
    if (s.speculative_clipping and s.clips and s.world_size > 1 and s.offload_optimizer is not False
            and s.device_states != "auto" and s.device_states > 0):
        raise ConfigError("speculative_clipping with several ranks streams every 8-bit state (each rank must know "
                          "which updates speculate), but offload_device_states keeps some on the GPU: set "
                          "offload_device_states: off, or speculative_clipping: false")
    if s.offload_optimizer:
        optim = optim_name(args)
        if optim not in ADAMW_NAMES:
            raise ConfigError(f"offload_optimizer=True streams 8-bit AdamW states, but optim={optim!r}. Set optim to "
                              f"one of {', '.join(ADAMW_NAMES)}, or leave offload_optimizer unset (or false) to "
                              f"train with {optim!r} on the GPU.")
    n = getattr(args, "n_gpu", 1)
    if n > 1 and _may_stream(s, args):
        raise ConfigError(f"{n} GPUs are visible to this one process, where the Trainer would use "
                          f"torch.nn.DataParallel; the offloaded optimizer works one process per GPU. For data "
                          f"parallel launch `torchrun --nproc_per_node {n} ...`; for one GPU set "
                          f"CUDA_VISIBLE_DEVICES=0.")


def check_trainer(settings: OffloadSettings, args, optimizer_given: bool) -> None:
    """What depends on whether an optimizer is handed to the Trainer (`optimizer_given`; the command hands none, and
    asks before any weight loads): one beside `offload_optimizer: true`; without one, `optim_args`, which only the
    Trainer's own optimizer reads."""
    if optimizer_given:
        if settings.offload_optimizer:
            raise ConfigError("offload_optimizer=True streams its own AdamW, but an optimizer was passed to the "
                              "Trainer (optimizers=... or optimizer_cls_and_kwargs=...): pass neither, or set "
                              "offload_optimizer: false to train with yours")
        return
    if _may_stream(settings, args) and getattr(args, "optim_args", None):
        raise ConfigError(f"optim_args={args.optim_args!r} is read by the Trainer's own optimizer, which the streamed "
                          f"AdamW replaces: use adam_beta1 / adam_beta2 / adam_epsilon / weight_decay, or set "
                          f"offload_optimizer: false")


def check_layer_swap(settings: OffloadSettings, *, model_init, layers, streaming: bool) -> None:
    """`layer_swap` on for this model (`layers`: its decoder layers, or None) and optimizer (`streaming`)."""
    if model_init is not None:
        raise ConfigError("layer_swap places the layers of the model the Trainer is built with, but model_init "
                          "builds a new model at every train(): pass model=... instead of model_init")
    if layers is None:
        raise ConfigError("layer_swap needs a model whose decoder layers are an nn.ModuleList (every HF causal LM)")
    if settings.world_size > 1 and not streaming:
        raise ConfigError("layer_swap with several processes needs offload_optimizer: true (the streamed optimizer "
                          "reduces gradients itself; DistributedDataParallel cannot wrap swapped layers)")


def check_swapped_training(trainable_swapped: bool, streaming: bool) -> None:
    """Swapped layers that train, with the Trainer's own optimizer (the resident count is known once planned)."""
    if trainable_swapped and not streaming:
        raise ConfigError("layer_swap with trainable swapped layers (full finetune) needs offload_optimizer: true: "
                          "the streamed optimizer updates each swapped layer while it is on the GPU. (With LoRA "
                          "only the frozen base weights are swapped and any optimizer works.)")
