"""LLaMA-Factory: `python -m offload_trainer.integrations.llamafactory CONFIG.yaml [key=value ...]` in place of
`llamafactory-cli train CONFIG.yaml [key=value ...]`, with our keys (`offload_optimizer`, `layer_swap`, ...;
`offload-trainer keys` lists them) beside LLaMA-Factory's in the same YAML. Several GPUs: `torchrun
--nproc_per_node N -m offload_trainer.integrations.llamafactory CONFIG.yaml`.

LLaMA-Factory 0.9 has no plugin API for its Trainer-based stages: its v1 registry (`OptimizerPlugin`) builds the
optimizer of its own training loop, which clips over `p.grad` after backward -- the gradients our streamed update has
already consumed. So this launcher runs LLaMA-Factory's own `run_exp` with two seams, both made in `_seams()` and
undone when the run ends:
- its parser's training-arguments class (`llamafactory.hparams.parser._TRAIN_ARGS`) gains our fields, so
  LLaMA-Factory's own parser reads and checks our keys (an unknown key is still an error);
- its pre-training and SFT workflows build their trainer with `OffloadMixin` before LLaMA-Factory's `CustomTrainer` /
  `CustomSeq2SeqTrainer` (its data, collators, callbacks and saving stay its own).
Two defaults differ, each unless the config says otherwise: a full or freeze finetune in bf16 on a GPU gets
`pure_bf16: true` (see `bf16_weights`), and checkpointing is non-reentrant (see `non_reentrant_checkpointing`).
What would move the same tensors a second way, or replace the optimizer or loss the mixin wires (DeepSpeed, its own
optimizers, the other stages), is refused by name before any model loads.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import sys
from typing import Any

from ..trainer.args import HAS_ACTIVATION_CHECKPOINTING, OffloadFields
from ..errors import ConfigError

__all__ = ["bf16_weights", "clashes", "main", "non_reentrant_checkpointing"]

PROG = "python -m offload_trainer.integrations.llamafactory"

STAGES = ("pt", "sft")  # the stages whose trainer is a transformers.Trainer stepping the Trainer's optimizer

# LLaMA-Factory key (refused when set) -> what to do instead
_CLASHES = {
    "deepspeed": "remove deepspeed: the launcher streams the optimizer states itself",
    **{k: f"remove {k}: it replaces AdamW, whose states the launcher streams (or run llamafactory-cli train)"
       for k in ("use_galore", "use_apollo", "use_badam", "loraplus_lr_ratio", "use_adam_mini", "use_muon")},
    "use_asft_loss": "remove use_asft_loss: its loss needs a reference model the launcher does not wire",
}


def clashes(cfg: dict[str, Any]) -> list[str]:
    """What in a LLaMA-Factory config cannot run with the offload wiring, each with what to do instead."""
    found = [f"{k}: {fix}" for k, fix in _CLASHES.items() if cfg.get(k) not in (None, False, "", 0)]
    stage = cfg.get("stage", "sft")
    if stage not in STAGES:
        found.append(f"stage: {stage}: the launcher wires the pt and sft stages only"
                     + ("; for DPO use OffloadDPOTrainer from Python (offload_trainer.trl)" if stage == "dpo" else ""))
    return found


@functools.lru_cache(maxsize=None)
def _classes() -> dict[str, type]:
    """LLaMA-Factory's training arguments with our fields, and its trainers with the offload wiring, by name."""
    from llamafactory.hparams.training_args import TrainingArguments
    from llamafactory.train.pt.trainer import CustomTrainer
    from llamafactory.train.sft.trainer import CustomSeq2SeqTrainer

    from ..trainer.mixin import OffloadMixin

    args = dataclasses.dataclass(type("OffloadLlamaFactoryArguments", (OffloadFields, TrainingArguments), {
        "__doc__": "LLaMA-Factory's TrainingArguments plus the offload switches (offload_trainer's launcher)."}))
    trainers = [type(f"Offload{base.__name__}", (OffloadMixin, base), {
        "__doc__": f"LLaMA-Factory's {base.__name__} with the offload wiring (offload_trainer's launcher)."})
        for base in (CustomTrainer, CustomSeq2SeqTrainer)]
    return {c.__name__: c for c in (args, *trainers)}


def __getattr__(name: str) -> type:
    # The classes are built on first use (they need LLaMA-Factory imported); pickle finds them by name here (the
    # Trainer saves its arguments with torch.save).
    if name.startswith("Offload") and name in _classes():
        return _classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@contextlib.contextmanager
def _seams():
    """Every seam into LLaMA-Factory, undone on the way out (see the module's docstring for why each is needed)."""
    from llamafactory.hparams import parser
    from llamafactory.train.pt import workflow as pt
    from llamafactory.train.sft import workflow as sft

    c = _classes()
    patches = [(parser, "_TRAIN_ARGS", [c["OffloadLlamaFactoryArguments"] if a is parser.TrainingArguments else a
                                        for a in parser._TRAIN_ARGS]),
               (pt, "CustomTrainer", c["OffloadCustomTrainer"]),
               (sft, "CustomSeq2SeqTrainer", c["OffloadCustomSeq2SeqTrainer"])]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    try:
        for mod, name, value in patches:
            setattr(mod, name, value)
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


def bf16_weights(cfg: dict[str, Any], on_gpu: bool) -> str | None:
    """Set `pure_bf16: true` in `cfg` where the streamed optimizer will update trainable weights that LLaMA-Factory
    would otherwise cast to fp32 (its mixed precision for full / freeze finetunes: the weights on the GPU twice the
    size, 32 GiB for an 8B model, before the first step). The streamed optimizer keeps bf16 weights, rounded
    stochastically (`master_weights`), as `offload-trainer train` and the axolotl plugin do. Returns the log line, or
    None where nothing changes: LoRA (small adapters, upcast as LLaMA-Factory does), no GPU (LLaMA-Factory refuses
    pure_bf16 there and the Trainer's AdamW runs), fp32 / fp16 runs, offload_optimizer: false, or pure_bf16 given."""
    from . import optimizer_will_stream

    full = cfg.get("finetuning_type", "lora") in ("full", "freeze")  # (LoRA, LLaMA-Factory's default, upcasts adapters)
    streams = optimizer_will_stream(on_gpu=on_gpu, full_finetune=full, offload_optimizer=cfg.get("offload_optimizer"),
                                    optim=cfg.get("optim", "adamw_torch"))
    if not streams or "pure_bf16" in cfg or not cfg.get("bf16") or cfg.get("fp16"):
        return None
    cfg["pure_bf16"] = True
    return ("pure_bf16: true (the streamed optimizer updates bf16 weights with stochastic rounding, as "
            "offload-trainer train does; LLaMA-Factory's fp32 upcast would double the weights' GPU memory). "
            "Set pure_bf16: false to keep its fp32 weights.")


def non_reentrant_checkpointing(cfg: dict[str, Any]) -> str | None:
    """Set `use_reentrant_gc: false` in `cfg` where LLaMA-Factory would checkpoint reentrant (its default). A reentrant
    recompute reruns each layer's whole forward, its last projection included, which non-reentrant checkpointing (the
    command's, transformers' default) stops before: for 8B at 4 x 2048 one 8192 x 14336 x 4096 matmul per layer, 40 ms
    of a 1.4 s step on a held 24 GB card, the whole of LLaMA-Factory's gap to the command (bench/results/README.md,
    "Integrations"). Where the config also turns on the Trainer's own checkpointing (`gradient_checkpointing` /
    `activation_checkpointing`), the Trainer enables it a second time through LLaMA-Factory's method, which reads
    missing kwargs as reentrant: the kwargs are set to the same choice. Returns the log line, or None where nothing
    changes: checkpointing off, unsloth's, or `use_reentrant_gc` given."""
    if cfg.get("disable_gradient_checkpointing") or cfg.get("use_unsloth_gc"):
        return None
    note = None
    if "use_reentrant_gc" not in cfg:
        cfg["use_reentrant_gc"] = False
        note = ("use_reentrant_gc: false (non-reentrant checkpointing, as offload-trainer train runs it: the recompute "
                "stops before each layer's last matmul). Set use_reentrant_gc: true to keep LLaMA-Factory's default.")
    given = "gradient_checkpointing_kwargs" in cfg or "activation_checkpointing_kwargs" in cfg
    if (cfg.get("gradient_checkpointing") or cfg.get("activation_checkpointing")) and not given:
        key = "activation_checkpointing_kwargs" if HAS_ACTIVATION_CHECKPOINTING else "gradient_checkpointing_kwargs"
        cfg[key] = {"use_reentrant": bool(cfg["use_reentrant_gc"])}
    return note


def _read(argv: list[str]) -> dict[str, Any]:
    """The config as `llamafactory-cli train` reads it (its YAML / JSON plus `key=value` overrides)."""
    from llamafactory.hparams.parser import read_args

    if not argv or not argv[0].endswith((".yaml", ".yml", ".json")):
        raise ConfigError(f"give a LLaMA-Factory config: {PROG} CONFIG.yaml [key=value ...]")
    saved, sys.argv = sys.argv, [sys.argv[0], *argv]  # (read_args reads the command line itself)
    try:
        return read_args()
    finally:
        sys.argv = saved


def main(argv: list[str] | None = None) -> int:
    """Train a LLaMA-Factory config with the offload wiring; exit codes as `offload-trainer train`'s (2: a config
    that cannot run)."""
    from ..cli.main import exit_code_of, show_our_log_lines, use_expandable_segments

    show_our_log_lines()  # (LLaMA-Factory sets up its own loggers and transformers', not ours)
    use_expandable_segments()
    return exit_code_of(lambda: _train(list(sys.argv[1:] if argv is None else argv)), prog=PROG)


def _train(argv: list[str]) -> None:
    from llamafactory.train.tuner import run_exp

    cfg = _read(argv)
    found = clashes(cfg)
    if found:
        raise ConfigError("offload_trainer's LLaMA-Factory launcher cannot run with: " + "; ".join(found))
    import torch

    for note in (bf16_weights(cfg, torch.cuda.is_available()), non_reentrant_checkpointing(cfg)):
        if note:
            logging.getLogger("offload_trainer").info(note)
    with _seams():
        run_exp(cfg)


if __name__ == "__main__":  # (the importable module's main: its classes, which pickle finds by that module's name)
    from offload_trainer.integrations.llamafactory import main as _main

    sys.exit(_main())
