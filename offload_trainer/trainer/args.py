"""Arguments: `OffloadTrainingArguments` adds our own fields (`OffloadFields`) to `transformers.TrainingArguments`;
`offload_trainer.trl.OffloadSFTConfig` adds the same to TRL's `SFTConfig`. The rules that decide from arguments
(`streams_optimizer`) live here too; the rules that refuse a combination in conflicts.py. (`ModelArguments`,
`DataArguments`: run_args.py.)

Only the fields we add live here. Everything else is `TrainingArguments`, parsed by transformers'
own `HfArgumentParser` (see `config.py`).
"""
from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field

from transformers import TrainingArguments


# transformers 5.24 renamed gradient_checkpointing to activation_checkpointing (the old name warns, and goes in 6);
# 5.17, which the GPU machine has, knows only the old one. Configs and scripts write the new name on both: where
# TrainingArguments lacks it, OffloadFields adds it and turns the old one on.
HAS_ACTIVATION_CHECKPOINTING = "activation_checkpointing" in {f.name for f in dataclasses.fields(TrainingArguments)}

from ..limits import check_values
from .. import settings as S
from ..settings import OffloadSettings
from .conflicts import ADAMW_NAMES, check_settings, launch_conflict, optim_name

# With offload_optimizer unset, a model training at most this fraction of its parameters (LoRA, adapters) keeps the
# Trainer's AdamW: its states are small next to the weights, and streaming them costs time for no memory that matters
# (4.8M LoRA parameters on 2 CPU cores: ~2 s per step streamed against 0.04 s for torch's AdamW).
SMALL_TRAINABLE_FRACTION = 0.1


def streams_optimizer(args, settings: OffloadSettings, *, model=None) -> tuple[bool, str]:
    """(whether the streamed optimizer runs, why not when it does not), for a Trainer with no optimizer handed to it
    (one handed over runs, said by the caller). One rule for `TrainingArguments` and ours: `offload_optimizer` unset
    (None) streams when `optim` names AdamW, there is a GPU, and (given the `model`) more than
    SMALL_TRAINABLE_FRACTION of it trains; otherwise the Trainer's own optimizer runs (the caller logs the reason).
    True streams (conflicts.py refuses what contradicts it); False never streams."""
    asked = settings.offload_optimizer
    optim = optim_name(args)
    if asked is False:
        return False, "offload_optimizer is false"
    if optim not in ADAMW_NAMES:
        return False, f"optim={optim!r} is not AdamW"
    if asked or model is None:
        return True, ""
    if args.device.type == "cpu":
        return False, ("no GPU here: with everything in CPU memory there is nothing to offload, and torch's AdamW is "
                       "the fastest on a CPU (offload_optimizer: true streams 8-bit states anyway)")
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if total and trained <= SMALL_TRAINABLE_FRACTION * total:
        return False, (f"{trained / 1e6:.1f} M of {total / 1e6:.0f} M parameters train (LoRA or adapters): their AdamW "
                       f"states ({16 * trained / 2**30:.2f} GiB with the gradients and fp32 copies) stay on the GPU")
    return True, ""


@dataclass
class OffloadFields:
    """The offload switches, added to a `TrainingArguments` (or TRL's `SFTConfig`) by `OffloadTrainingArguments` and
    `OffloadSFTConfig`; checked after the base class's own checks."""

    if not HAS_ACTIVATION_CHECKPOINTING:
        activation_checkpointing: bool = field(
            default=False, metadata={"help": "Recompute each layer in backward (transformers 5.24's name for "
                                             "gradient_checkpointing, also on older versions)."})

    offload_optimizer: bool | None = field(
        default=None,
        metadata={"help": "Keep AdamW states 8-bit in pinned CPU memory and stream them to the GPU layer by "
                          "layer for the update (saves ~2 bytes/param of GPU memory vs 8-bit AdamW on the GPU, "
                          "costs ~4 bytes/param/step of PCIe traffic, hidden behind backward). Unset: on when optim "
                          "names AdamW (the default) and no optimizer is passed to the Trainer; otherwise the "
                          "Trainer's own optimizer runs, said in the log. True: required (an error otherwise). "
                          "False: the Trainer's own optimizer."},
    )
    offload_gradients: bool | None = field(
        default=None,
        metadata={"help": "Gradients that must wait -- for the global norm (max_grad_norm > 0), or for the next "
                          "micro-batch (gradient_accumulation_steps > 1, summed there) -- wait in pinned CPU memory "
                          "(saves 2 bytes/param of GPU memory, costs 4 bytes/param of PCIe traffic per step, and per "
                          "micro-batch when accumulating; needed for 8B on 24 GiB). Unset: the planner decides, for "
                          "gpu_memory_limit_gb or else the GPU's own memory; without a GPU, on when accumulating with "
                          "swapped trained layers, off otherwise."},
    )
    speculative_clipping: bool | None = field(
        default=None,
        metadata={"help": "With max_grad_norm > 0: updates run during backward, before the global gradient norm is "
                          "known; a step whose norm clips (or is not finite) is rolled back exactly and run again with "
                          "the clip coefficient -- exact clipping's result at the speed of max_grad_norm: 0 while the "
                          "clip rarely fires (a finetune). Costs 4 bytes/param more pinned host memory (a second bank "
                          "of 8-bit states, the weights' backup) and 2 bytes/param of D2H per step; a step that clips "
                          "runs twice, and while most steps clip they clip exactly instead, said in the log. Unset: "
                          "the planner decides (on where it predicts a faster step and host RAM allows it; off "
                          "without a plan, and with several ranks unless true); false: exact clipping, updates wait "
                          "for the norm."},
    )
    activation_offload: bool | None = field(
        default=None,
        metadata={"help": "Keep checkpointed layer inputs in pinned CPU memory, copied on side streams and "
                          "prefetched before each layer's recompute (saves layers x tokens x hidden x 2 bytes of "
                          "GPU memory; needs activation_checkpointing). Unset: the planner decides, for "
                          "gpu_memory_limit_gb or else the GPU's own memory; without a GPU, off."},
    )
    tiled_mlp: bool | None = field(
        default=None,
        metadata={"help": f"Run each decoder layer's MLP over the sequence in tiles of {S.MLP_TILE_TOKENS} tokens, "
                          f"each recomputed in backward: its intermediate activations exist for one tile at a time "
                          f"(an 8B layer at 64k tokens: ~7 GiB less), for one more MLP forward per backward. Needs "
                          f"activation_checkpointing. Unset: the planner turns it on only where no plan fits "
                          f"without it (long sequences); without a plan, off."},
    )
    tiled_layers: bool | None = field(
        default=None,
        metadata={"help": f"Run each decoder layer over the sequence in tiles of {S.MLP_TILE_TOKENS} tokens around "
                          f"its attention (norms, projections, rotary embedding, residuals and the MLP), each tile "
                          f"recomputed in backward: whole-sequence tensors are left only around the attention (an 8B "
                          f"layer's backward at 128k tokens: ~8.5 GiB less than with tiled_mlp), for one more "
                          f"forward of the projections and MLP per backward. Llama, Qwen2 and Qwen3 layers (others run "
                          f"whole, said in the log). Needs activation_checkpointing. Unset: the planner turns it on "
                          f"only where no plan fits without it; without a plan, off."},
    )
    offload_chunk_numel: int = field(
        default=S.CHUNK_NUMEL,
        metadata={"help": "Elements per streamed chunk of optimizer state (a multiple of the 8-bit block size). "
                          "Larger: fewer launches; smaller: less GPU memory in flight."},
    )
    offload_inflight_chunks: int = field(
        default=S.INFLIGHT_CHUNKS,
        metadata={"help": "GPU staging slots for streamed chunks (bounded pool with back-pressure). "
                          "GPU memory in flight ~ slots x chunk x (2 bytes, +2 with max_grad_norm > 0)."},
    )
    offload_fused_update: bool | None = field(
        default=None,
        metadata={"help": "Update streamed states with one Triton kernel per chunk (torchao's codes and arithmetic, "
                          "~2.5x faster on the GPU). None: where Triton runs (CUDA); false: torchao's compiled "
                          "update."},
    )
    offload_device_states: str = field(
        default=S.DEVICE_STATES,
        metadata={"help": "8-bit AdamW states kept on the GPU instead of streamed, for the tensors backward reaches "
                          "last (their copies could not overlap anything). 'auto': the input embedding's when the "
                          "plan for gpu_memory_limit_gb (or the GPU's own memory) leaves room, then the next "
                          "tensors' while max(1 GiB, 5%) of the budget stays free (a 3B model on 24 GiB keeps them "
                          "all); without clipping or with speculative clipping, and activation_offload unset, where "
                          "there is no room, the layer inputs are offloaded to make it when that is predicted faster "
                          "(8B on 24 GiB); a number: that many GiB (the model's first tensors that fit); 0: every "
                          "state streamed."},
    )
    master_weights: str = field(
        default=S.MASTER_WEIGHTS[0],
        metadata={"help": "How bf16 weights absorb tiny updates: 'bf16_sr' (stochastic rounding, default, no "
                          "extra memory) or 'bf16' (round to nearest: updates below 1/256 of a weight are lost)."},
    )
    loss_chunk_size: int = field(
        default=S.LOSS_CHUNK,
        metadata={"help": "Tokens per chunk of the LM-head + cross-entropy, so full logits are never "
                          "materialised (0 = the model's own loss). Saves ~batch*seq*vocab*4 bytes."},
    )
    layer_swap: str = field(
        default=S.LAYER_SWAP,
        metadata={"help": "Keep only some decoder layers on the GPU; the others live in pinned CPU memory and are "
                          "fetched into reused GPU slots one layer ahead, overlapped with compute (for models whose "
                          "weights do not fit: 14B full finetune, 70B QLoRA on 24 GiB). 'off', 'auto' (the planner "
                          "keeps as many as fit gpu_memory_limit_gb, or the card), or a number of resident layers. "
                          "Needs activation_checkpointing."},
    )
    layer_swap_prefetch: int = field(
        default=S.LAYER_SWAP_PREFETCH, metadata={"help": "Swapped layers fetched ahead of use (GPU slots = prefetch + 2)."},
    )
    fold_accumulation: str = field(
        default=S.FOLD,
        metadata={"help": "With gradient_accumulation_steps > 1: run that many of an optimizer step's micro-batches as "
                          "one micro-batch (concatenated, padded on the right), which computes the same loss, "
                          "gradients and update when the loss is a sum over the step's tokens divided by their count "
                          "(the Trainer's num_items_in_batch); every micro-batch's gradients otherwise cross PCIe to "
                          "be summed in host memory. What the Trainer counts and calls (steps, epoch, tokens seen, "
                          "callbacks, checkpoints) is unchanged. 'auto': the planner's choice, the fastest that fits "
                          "the GPU and host (none without a plan); 'off': each micro-batch runs as the Trainer hands "
                          "it; a number: that many (a divisor of gradient_accumulation_steps). Never where the result "
                          "would differ (a model without num_items_in_batch, dropout, NEFTune, an MoE auxiliary loss, "
                          "images, a trainer's own compute_loss): said in the log."},
    )
    save_on_interrupt: bool = field(
        default=True,
        metadata={"help": "On Ctrl-C / SIGTERM, finish the current step, save a checkpoint, and stop with a "
                          "message naming it (a second Ctrl-C stops at once)."},
    )
    max_nonfinite_steps: int = field(
        default=S.MAX_NONFINITE_STEPS,
        metadata={"help": "Skip an optimizer step whose loss or gradient norm is NaN/inf (weights and optimizer "
                          "states unchanged); stop after this many in a row. 0: no check (one GPU sync less per "
                          "step)."},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "`offload-trainer train` refuses an output_dir that holds an earlier run's checkpoints or "
                          "model unless this is true (that run's checkpoints, model and other outputs are then set aside, and "
                          "removed once the new run writes its first checkpoint; files of yours there stay) or "
                          "resume_from_checkpoint is set. (transformers 4.x had this key; from Python the Trainer "
                          "writes wherever it is told, as before.)"},
    )
    gpu_memory_limit_gb: float | None = field(
        default=None,
        metadata={"help": "Cap this process's GPU memory (GiB), e.g. 24 to emulate a 24 GB card on a bigger one."},
    )
    host_memory_limit_gb: float | None = field(
        default=None,
        metadata={"help": "The host RAM (GiB) the run may use, e.g. 57 for a 64 GB machine (64e9 bytes are 59.6 GiB, "
                          "of which the OS and a desktop keep 2-3). The plan keeps within the lesser of it and the "
                          "memory available when training starts (clipping exactly instead of speculatively where "
                          "that is what fits), or refuses before the model loads, naming the machine it needs. "
                          "`offload-trainer plan` plans for it on any machine. Unset: what is available."},
    )

    def __getstate__(self) -> dict:
        """Pickled -- the Trainer writes `training_args.bin` into output_dir and every checkpoint -- without secrets:
        `hub_token` (any `*_token` text) is None there. Copies keep it (`__copy__`, `__deepcopy__`)."""
        return {k: None if k.endswith("_token") and isinstance(v, str) else v for k, v in self.__dict__.items()}

    def __copy__(self):
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo):
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def __post_init__(self) -> None:
        launch_conflict(self, self.offload_optimizer)  # (before the Trainer's checks, which would import DeepSpeed)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not self.use_cpu and not _cuda_available():
            # torchrun on a machine without CUDA: without use_cpu the Trainer would run each process on its own
            self.use_cpu = True
        if not HAS_ACTIVATION_CHECKPOINTING and self.activation_checkpointing:
            self.gradient_checkpointing = True
        super().__post_init__()
        problems = check_values({k: v for k, v in vars(self).items() if isinstance(v, (int, float))})
        if problems:  # (a NaN learning rate or clip norm would train NaN weights and log losses of 0)
            raise ValueError("; ".join(problems))
        # Every bound and conflict of our switches (ValueError), as TrainingArguments checks its own fields: this
        # value is thrown away. The run's own is made by whoever runs it (the Trainer, or the command that hands it
        # to the Trainer), so that a field set after the arguments were built counts, and nothing is kept on them
        # (they pickle into training_args.bin). The fields stay as the user wrote them.
        check_settings(OffloadSettings.from_args(self), self)


@dataclass
class OffloadTrainingArguments(OffloadFields, TrainingArguments):
    """`TrainingArguments` plus the offload switches. Every other field is the Trainer's own."""


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
