"""Checkpoints through the Trainer: the newest complete one found and checked before anything loads, the disk
checked for one, each written into a staging directory and published when complete (checkpoint.py), and the
streamed optimizer's states saved per rank and loaded memory-mapped, straight into its pinned buffers."""
from __future__ import annotations

import json
import logging
import os
import warnings

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..engine.sizes import state_bytes
from ..errors import CheckpointError, StorageError
from . import guards, manifest, resume_changes, run_history
from .checkpoint import (check_checkpoint, checkpoint_steps, clean_staging, load_optimizer_states,
                         newest_checkpoint_and_why, newest_complete_checkpoint, optimizer_shard_name,
                         write_checksums)
from .outputs import STAGING_PREFIX, check_space, free_bytes, publish, remove_staging, storage_limit
from .run_state import RunState
from .wiring import row_tokens

logger = logging.getLogger("offload_trainer")


def resolve_resume(trainer, run: RunState, resume):
    """True / 'true' -> the newest complete checkpoint in output_dir; a path -> checked before anything loads."""
    if isinstance(resume, str) and resume.strip().lower() in ("true", "latest", "false", "none", ""):
        resume = resume.strip().lower() in ("true", "latest")
    if trainer.args.should_save:
        clean_staging(trainer.args.output_dir)  # what a killed save left behind
    trainer.accelerator.wait_for_everyone()
    if resume is True:
        found, why = newest_checkpoint_and_why(trainer.args.output_dir, trainer.model)
        if found is None:  # the Trainer's own words first: scripts match on them
            if why is not None:  # (each was skipped, logged: the newest one's reason is the answer)
                names = ", ".join(checkpoint_steps(trainer.args.output_dir))
                raise CheckpointError(f"No valid checkpoint found in output directory ({trainer.args.output_dir}): "
                                      f"none of {names} can be resumed here; the newest: {why}")
            raise CheckpointError(f"No valid checkpoint found in output directory ({trainer.args.output_dir}): "
                                  f"resume_from_checkpoint: true, but it holds no complete checkpoint-N "
                                  f"directory. Start without resume_from_checkpoint.")
        logger.info("resuming from %s", found)
        _check_changes(trainer, run, found)
        return found
    if resume:
        check_checkpoint(str(resume), trainer.model)
        _check_changes(trainer, run, str(resume))
        return str(resume)
    return None


def _state_and_step(checkpoint: str) -> tuple[dict, int | None]:
    """A checkpoint's trainer_state.json and its global step ({}, None: missing or unreadable)."""
    try:
        with open(os.path.join(checkpoint, "trainer_state.json")) as f:
            state = json.load(f)
        return state, int(state["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}, None


def _check_changes(trainer, run: RunState, checkpoint: str) -> None:
    step = _state_and_step(checkpoint)[1]
    resume_changes.check(checkpoint, trainer.args, step, row_tokens(trainer, run), training_rows(trainer))


def finished_at(trainer, checkpoint: str) -> int | None:
    """The checkpoint's step where it is the last of the run now asked for: max_steps, or by epochs the steps they
    come to over this run's data and batch size (the checkpoint's own run may have stopped earlier, by max_steps)."""
    step = _state_and_step(checkpoint)[1]
    if step is None:
        return None
    target = trainer.args.max_steps
    if target <= 0:
        try:
            target = trainer.set_initial_training_values(trainer.args, trainer.get_train_dataloader())[-1]
        except (TypeError, ValueError):  # (no length: the Trainer itself asks for max_steps)
            return None
    return step if step == target else None  # (past it: resume_changes refuses)


def load_finished(trainer, checkpoint: str, step: int):
    """Resuming a checkpoint at the run's last step: its weights and state are loaded and nothing is trained. The
    Trainer would train one step past max_steps and make that the run's model; here what follows train() -- the
    final save -- writes the checkpoint's model, which completes a run whose own final save failed."""
    from transformers.trainer_callback import TrainerState
    from transformers.trainer_utils import TrainOutput

    trainer._load_from_checkpoint(checkpoint)
    trainer.state = TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))
    # what the Trainer's loop does with a resumed state before its first step: a best checkpoint since removed is
    # forgotten, the callbacks' saved states come back (restore_callback_states_from_checkpoint)
    if trainer.state.best_model_checkpoint is not None and not os.path.isdir(trainer.state.best_model_checkpoint):
        trainer.state.best_model_checkpoint = None
    trainer._load_callback_state()
    if trainer.state.train_batch_size is not None and trainer.args.auto_find_batch_size:
        trainer._train_batch_size = trainer.state.train_batch_size  # (as the Trainer's resume takes it back)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    logger.info("%s is at step %d, the run's last: its weights are loaded and nothing is trained (the Trainer would "
                "train one step past the end). Raise max_steps (or num_train_epochs) to train further.", checkpoint,
                step)
    return TrainOutput(step, sum(losses) / len(losses) if losses else float("nan"), {})


def training_rows(trainer) -> int | None:
    """Rows in the training data (None: a stream), recorded with each checkpoint for the resume's check."""
    try:
        return len(trainer.train_dataset)
    except TypeError:
        return None


def check_disk(trainer, run: RunState) -> None:
    if getattr(trainer.args.save_strategy, "value", trainer.args.save_strategy) == "no" or not trainer.args.should_save:
        return
    weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    states = state_bytes(trainable) if run.streaming else 8 * trainable
    # a new checkpoint is written in full before the previous one can be rotated out
    check_space(trainer.args.output_dir, int((weights + states) * 1.05) + 2**20, "one checkpoint (weights and "
                "optimizer states; or set save_strategy: 'no', and save the model yourself)")


def save_checkpoint(trainer, run: RunState, model, trial, save) -> None:
    """The Trainer's checkpoint (`save`: its own `_save_checkpoint`), written into a staging directory and renamed
    into place when complete; a full disk becomes StorageError, the previous checkpoint intact."""
    run_dir = trainer._get_output_dir(trial)
    name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    run.synchronize()  # (the updates in flight land first: the weights checked are those the save writes)
    guards.refuse_nonfinite_weights(trainer.model, trainer.state.global_step, name, run_dir)
    staging = os.path.join(run_dir, STAGING_PREFIX + name)
    main = trainer.args.should_save  # several ranks write into one staging dir; the main one publishes it
    if main:
        remove_staging(staging)
        os.makedirs(staging)
    trainer.accelerator.wait_for_everyone()
    run.staging_dir = staging  # (the Trainer's _get_output_dir answers it while `save` runs)
    try:
        save(model, trial)
        trainer.accelerator.wait_for_everyone()  # every rank's optimizer shard and RNG state is written
        if main:
            run_history.save_figures(run, os.path.join(staging, name))  # (beside trainer_state.json, resumed with it)
            resume_changes.record(os.path.join(staging, name), trainer.args, row_tokens(trainer, run),
                                  training_rows(trainer))
            write_checksums(os.path.join(staging, name))
            publish(os.path.join(staging, name), os.path.join(run_dir, name))
        trainer.accelerator.wait_for_everyone()
    except Exception as e:  # torch.save and safetensors report a full disk in their own words
        why = storage_limit(e, run_dir)
        if not why:
            raise
        prev = newest_complete_checkpoint(run_dir)
        raise StorageError(f"{why} while saving {name} in {run_dir!r} "
                           f"({free_bytes(run_dir) / 2**30:.2f} GiB free); nothing was "
                           f"published. " + (f"The previous checkpoint {prev} is intact. " if prev else "")
                           + "Free some space (or raise the limit) and resume with resume_from_checkpoint: true"
                           + ("." if prev else ", or start again: no step was saved.")) from None
    finally:
        run.staging_dir = None
        if main:
            remove_staging(staging)
    best = trainer.state.best_global_step
    if best and os.path.isdir(os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best}")):
        trainer.state.best_model_checkpoint = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best}")
    if trainer.args.should_save:  # the Trainer rotated inside the staging directory: rotate the real one
        rotate(run_dir, trainer.args.save_total_limit, trainer.state.best_model_checkpoint)


def rotate(run_dir: str, limit: int | None, best: str | None) -> None:
    """save_total_limit: the oldest checkpoints removed, the newest and the best kept -- the Trainer's
    `rotate_checkpoints`, but over our own only: `checkpoint-N` directories the record lists (manifest.py; without a
    record -- the class alone, or an earlier version's run -- every `checkpoint-N`). Its glob takes any
    `checkpoint-*` directory (a user's `checkpoint-notes/`), and a link planted at a checkpoint's name is removed,
    never followed."""
    if not limit or limit <= 0:
        return
    recorded = manifest.read(run_dir)
    ours = [n for n in checkpoint_steps(run_dir) if recorded is None or n in recorded]
    paths = [os.path.join(run_dir, n) for n in ours]
    step = {p: i for i, p in enumerate(paths)}
    paths.sort(key=lambda p: (os.lstat(p).st_mtime, step[p]))  # (newest last, as the Trainer's use_mtime)
    keep = {paths[-1]} if paths else set()
    if best:
        keep.add(os.path.join(run_dir, os.path.basename(os.path.normpath(best))))
    extra = len(paths) - max(limit, len(keep))
    for path in [p for p in paths if p not in keep][:max(extra, 0)]:
        remove_staging(path)
        manifest.forget(run_dir, [os.path.basename(path)])


def save_optimizer_shard(trainer, run: RunState, output_dir) -> None:
    """Data parallel: each rank owns part of the states and writes its own shard (rank 0 the scheduler)."""
    os.makedirs(output_dir, exist_ok=True)
    torch.save(run.optimizer.state_dict(),
               os.path.join(output_dir, optimizer_shard_name(trainer.args.process_index, trainer.args.world_size)))
    if trainer.args.should_save:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))


def load_streamed_states(trainer, run: RunState, checkpoint) -> bool:
    """The streamed optimizer's states (and the scheduler) from `checkpoint`; False when there are none to load
    this way (the Trainer's own load then runs)."""
    states = load_optimizer_states(checkpoint) if checkpoint and run.optimizer is not None else None
    if states is None:
        return False
    # mmap: the states go from the file's pages straight into the pinned buffers, never a second copy in RAM;
    # with several ranks each keeps the tensors it owns, whatever the number of ranks that saved them
    run.optimizer.load_state_dict(states)
    sched = os.path.join(checkpoint, "scheduler.pt")
    if os.path.isfile(sched):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's "please also save the optimizer" notice
            trainer.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))
    return True
