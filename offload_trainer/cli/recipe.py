"""`offload-trainer train`, top to bottom, and nothing but the order: the config checked (config.py), the output
directory claimed (earlier_run.py), the plan made before any weight loads, the tokenizer, data, model and the
OffloadTrainer built (build.py) and run, and the outputs written (model, merged LoRA model, state, plots), each save
staged; a stop signal outside the loop answered (stops.py). `offload-trainer plan` is its first half."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

from .. import sysinfo
from ..errors import ConfigError
from ..planner import Machine, ModelShape, run_budget
from ..settings import OffloadSettings
from ..trainer import manifest
from ..trainer.outputs import OutputLock, check_output_dir, check_space, staged_save
from .build import build_trainer, model_config_of
from .config import load_config, parse_args
from .stops import leave_process_group, signals_say_where_the_run_stands
from .earlier_run import check_earlier_run, earlier_run_set_aside, finished_step, ours, refuse_busy_output_dir

logger = logging.getLogger("offload_trainer")


def train(config: str, overrides: list[str]) -> str:
    """Train from a YAML config; returns the output directory. A SIGINT / SIGTERM / SIGHUP outside the training loop
    (loading, tokenizing, the final save; inside it the Trainer saves and stops cleanly) ends it with a sentence naming
    the last complete checkpoint, as one inside it does."""
    refuse_busy_output_dir(config, overrides)  # in a fraction of a second: before transformers is imported
    with signals_say_where_the_run_stands(config, overrides):
        out = _train(config, overrides)
    leave_process_group()
    return out


def _train(config: str, overrides: list[str]) -> str:
    cfg = load_config(config, overrides)  # every check that needs no model happens here
    from ..trainer.args import streams_optimizer  # (transformers: loaded once the config is known good)
    from ..trainer.conflicts import check_trainer

    model_args, data_args, training_args = parse_args(cfg)  # (every switch and conflict checked as they are built)
    check_data_and_steps(data_args, training_args)
    out = training_args.output_dir
    main_rank = int(os.environ.get("RANK", "0")) == 0
    if main_rank:
        check_output_dir(out)
    with OutputLock(out) if main_rank else contextlib.nullcontext(), contextlib.ExitStack() as stack:
        if main_rank and check_earlier_run(training_args, model_args):  # (overwrite_output_dir: set aside till replaced)
            stack.enter_context(earlier_run_set_aside(out))
        done = finished_step(training_args)
        if done is not None:  # (every rank reads the same files: all return)
            logger.info("output_dir %s holds a finished run (step %d, max_steps reached) and its model: nothing to "
                        "train, nothing changed. Raise max_steps to train further, or choose another output_dir.",
                        out, done)
            return out
        model_config = model_config_of(model_args)  # (read once: a checkpoint's config.json may be remote)
        check_model_fits_data(model_args, data_args, model_config)
        settings = run_settings(training_args, model_config)
        check_trainer(settings, training_args, optimizer_given=False)  # (the arguments met check_settings as built)
        plan = None
        if (streams_optimizer(training_args, settings)[0] or model_args.lora_r) and (
                settings.gpu_memory_limit_gb or training_args.device.type == "cuda"):
            # the run's one plan, before any weights (refused if it cannot fit a cap; none on a CPU: it plans GPU
            # memory); with no cap, for this GPU's memory, as the Trainer would plan
            budget = run_budget(settings, gpu_gb=sysinfo.gpu_budget_gib(Machine().cuda_context_gib),
                                host_gb=sysinfo.host_available_gib())
            plan = run_plan(model_args, data_args, settings, budget, model_config, strict=False)
            if plan is not None:
                logger.info("plan:\n%s", plan.table())
        if main_rank:
            check_space(out, final_output_bytes(model_args, model_config), "the trained model")
            stack.enter_context(manifest.kept(out, ours(out)))  # (each name the run writes is recorded)
        trainer, tokenizer, eval_ds = build_trainer(model_args, data_args, training_args, settings, model_config, plan)
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        if eval_ds is not None:
            metrics = trainer.evaluate()
            logger.info("eval loss %.4f", metrics["eval_loss"])
        write_outputs(trainer, tokenizer, model_args)
        trainer.hand_back_model()  # (the run is over: nothing of ours stays on the model)
    logger.info("saved to %s", out)
    return out


def plan_command(config: str, overrides: list[str], as_json: bool, host_gb: float | None = None,
                 gpus: int | None = None) -> None:
    cfg = load_config(config, overrides)
    model_args, data_args, training_args = parse_args(cfg)
    model_config = model_config_of(model_args)
    settings = run_settings(training_args, model_config)
    if host_gb is not None:  # (--host-gb: the budget of the machine planned for, as the key is)
        settings = dataclasses.replace(settings, host_memory_limit_gb=host_gb)
    # no gpu_memory_limit_gb: on a machine with a GPU, plan for it, as the Trainer will; a host budget is planned for
    # on any machine (a 64 GB desktop's run planned from a laptop), else this machine's available memory
    budget = run_budget(settings, gpu_gb=sysinfo.gpu_budget_gib(Machine().cuda_context_gib),
                        host_gb=None if settings.host_memory_limit_gb else sysinfo.host_available_gib(), ranks=gpus)
    p = run_plan(model_args, data_args, settings, budget, model_config)
    if as_json:
        import json

        print(json.dumps(p.as_dict(), indent=1))
    else:
        print(p.table())


def run_settings(training_args, model_config) -> OffloadSettings:
    """The run's settings as the plan takes them: gradient accumulation folds nothing where the arguments or the model's
    config say that would change the result (the Trainer checks the rest once it is built)."""
    from ..trainer.fold import config_blockers, settings_for

    return settings_for(OffloadSettings.from_args(training_args), config_blockers(training_args, model_config))


def run_plan(model_args, data_args, settings, budget, model_config, strict: bool = True):
    """The run's plan (`planner.make_plan`, the call the Trainer makes too), None where `train` goes on without one,
    or ConfigError naming what to change (`strict`: `plan`, which refuses an architecture the planner does not
    know)."""
    from ..planner import PlanError, make_plan
    try:
        return make_plan(settings, budget, required=strict, config=model_config, seq=data_args.max_seq_length,
                         model_args=model_args)
    except PlanError as e:
        raise ConfigError(f"{e}") from None


def check_data_and_steps(data_args, training_args) -> None:
    evaluates = str(getattr(training_args.eval_strategy, "value", training_args.eval_strategy)) != "no"
    if evaluates and not data_args.eval_fraction and not data_args.dataset_test_split:
        raise ConfigError(f"eval_strategy: {getattr(training_args.eval_strategy, 'value', '')} evaluates, but there is "
                          f"no evaluation data: set eval_fraction (e.g. 0.05: records held out of the training data) "
                          f"or dataset_test_split, or eval_strategy: no")
    if data_args.streaming and training_args.max_steps <= 0:
        raise ConfigError("streaming: true reads a dataset whose length is not known up front: set max_steps (the "
                          "number of optimizer steps to train)")


def check_model_fits_data(model_args, data_args, model_config) -> None:
    text = getattr(model_config, "text_config", None) or model_config
    positions = getattr(text, "max_position_embeddings", None)
    if positions and data_args.max_seq_length > positions:
        raise ConfigError(f"max_seq_length={data_args.max_seq_length} is longer than the model's "
                          f"{positions} positions (max_position_embeddings): use max_seq_length <= {positions}")


def final_output_bytes(model_args, model_config) -> int:
    """Bytes the run writes at its end: the model; with LoRA the adapters (fp32, peft's default) and, but for QLoRA,
    the merged model beside them."""
    from ..models import DTYPES

    try:
        shape = ModelShape.from_config(model_config)
        params = shape.params
    except (AttributeError, TypeError):  # an architecture the planner does not know: no estimate
        return 0
    model = params * DTYPES[model_args.torch_dtype].itemsize
    if model_args.lora_r:
        adapters = 4 * shape.lora_params(model_args.lora_r, getattr(model_args, "lora_target_modules", "all-linear"))
        model = adapters + (0 if getattr(model_args, "load_in_4bit", False) else model)
    return int(model * 1.05) + 2**20


def write_outputs(trainer, tokenizer, model_args) -> None:
    """The trained model (adapters first with LoRA, each save staged so a failed one leaves nothing complete-looking),
    the trainer state, the plots; pushed to the Hub only once everything is written."""
    from ..planner import SAVE_SHARD_BYTES

    args = trainer.args
    push, args.push_to_hub = args.push_to_hub, False
    if args.should_save:  # again, now: the checkpoints took their share since the start
        check_space(args.output_dir, final_output_bytes(model_args, trainer.model.config), "the trained model")
    try:
        trainer.save_model()
        trainer.save_state()  # (ours: trainer_state.json and run_figures.json, written without following a link)
        if model_args.lora_r and getattr(model_args, "load_in_4bit", False):
            how = (f"into the bf16 base, one shard at a time: offload-trainer merge {args.output_dir} --base "
                   f"{model_args.model_name_or_path}" if model_args.model_name_or_path else
                   "(a random-init base has no checkpoint to merge into)")
            logger.info("QLoRA: the adapters are in %s. No merged model is written: merging into the NF4 weights "
                        "would round the update away. To merge %s", args.output_dir, how)
        elif model_args.lora_r and args.should_save:  # a merged model plain transformers loads: out/merged (one
            # process writes it: under torchrun every rank would share one staging directory)
            merged = os.path.join(args.output_dir, "merged")
            manifest.record(args.output_dir, ["merged"])  # (before it exists: ours, as each file in it)
            with manifest.kept(merged), staged_save(merged, "the merged model") as staging:
                trainer.model.merge_and_unload().save_pretrained(staging, max_shard_size=SAVE_SHARD_BYTES)
                tokenizer.save_pretrained(staging)
    finally:
        args.push_to_hub = push
    if push:
        trainer.push_to_hub(commit_message="End of training")
        manifest.record(args.output_dir, ["README.md"])  # (the Trainer writes its model card there to push it)
    if args.should_save:  # (the main process: it wrote trainer_state.json)
        from .report import log_summary_and_plots

        log_summary_and_plots(args.output_dir)
