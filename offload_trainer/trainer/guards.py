"""Runs that end cleanly: SIGINT / SIGTERM / SIGHUP finish the step, save and stop; optimizer steps with a non-finite
loss or gradient norm are skipped (the streamed optimizer drops their gradients), and too many in a row stop the run;
after train() returns, either ends the run with the exception the command turns into a sentence and an exit code.
A learning-rate warmup the run never finishes is said once, where the Trainer trains on silently. Host memory is
watched where a plan was made for it: a step that leaves less than a save needs saves and stops the run."""
from __future__ import annotations

import contextlib
import logging
import math
import signal

from .checkpoint import newest_complete_checkpoint
from ..errors import GpuOutOfMemory, TrainingInterrupted, TrainingStopped, stop_signals_call
from .run_state import RunState
from ..sysinfo import proc_gib

logger = logging.getLogger("offload_trainer")
NO_WARMUP_SCHEDULES = ("constant", "reduce_lr_on_plateau")  # (transformers' schedules that ignore the warmup)


@contextlib.contextmanager
def signals_stop_cleanly(run: RunState, trainer_state, output_dir: str | None = None):
    """SIGINT / SIGTERM / SIGHUP: finish the current step, save if save_on_interrupt, then stop; a second one: stop
    now, saying so (`TrainingInterrupted`, naming the last complete checkpoint in `output_dir`). (`trainer_state`:
    returns the Trainer's TrainerState when called, for the step named in the log: the Trainer makes a new one when
    its loop starts, so the one of the moment a signal arrives, never one held from before -- that said "finishing
    step 1" at any step.)"""
    def handler(signum, frame):
        state = trainer_state()
        name = signal.Signals(signum).name
        if run.interrupted is not None:
            ckpt = newest_complete_checkpoint(output_dir) if output_dir else None
            raise TrainingInterrupted(
                f"{name} during step {state.global_step + 1}, after {signal.Signals(run.interrupted).name}: stopped "
                f"at once, the step unfinished and not saved; "
                + (f"the last checkpoint is {ckpt} (continue with resume_from_checkpoint: true)" if ckpt
                   else "no checkpoint was saved"), signum, ckpt)
        run.interrupted = signum
        logger.warning("%s received: finishing step %d, then %s (again to stop at once)", name,
                       state.global_step + 1, "saving a checkpoint" if run.settings.save_on_interrupt else "stopping")

    with stop_signals_call(handler):  # (outside the main thread: nothing installed, as Python allows)
        yield


# what the host watch keeps free beyond a save's shard: the staging's small files and the allocator's growth in a step
HOST_WATCH_SLACK_GIB = 0.25
# a plan whose host peak is this close to its budget is said to fit only just, at the start
THIN_HOST_MARGIN_GIB = 2.0


def watch_host(run: RunState) -> None:
    """With a plan made for a host budget: the memory a checkpoint's save needs (its shard in host memory, and
    `HOST_WATCH_SLACK_GIB`), which `on_step_end` keeps available; said at the start where the plan fits only just."""
    plan = run.plan
    if plan is None or not plan.host_budget_gib or not plan.host_peak_gib:
        run.host_need_gib = None
        return
    run.host_need_gib = plan.save_shard_gib + HOST_WATCH_SLACK_GIB
    margin = plan.host_budget_gib - plan.host_peak_gib
    if margin < THIN_HOST_MARGIN_GIB and run.first_time("thin host margin"):
        logger.warning("host memory: the plan needs %.1f of the %.1f GiB it was made for, %.1f GiB to spare: if "
                       "less than the %.1f GiB a checkpoint's save needs is left after a step, the run saves a "
                       "checkpoint and stops, with a sentence (rather than the kernel ending it with no word)",
                       plan.host_peak_gib, plan.host_budget_gib, margin, run.host_need_gib)


def host_memory_left() -> float | None:
    """GiB the machine has available now (MemAvailable: free memory and the page cache it can reclaim)."""
    return proc_gib("/proc/meminfo", "MemAvailable")


def on_step_end(run: RunState, global_step: int, control) -> None:
    """After every callback's `on_step_end`: count a skipped step (stop at the limit), stop on an interrupt, save and
    stop when the host has less left than a save needs."""
    if run.host_need_gib is not None and run.host_low is None:
        left = host_memory_left()
        if left is not None and left < run.host_need_gib:
            run.host_low = (left, global_step)
            logger.warning("host memory: %.2f GiB left after step %d, under the %.2f GiB a checkpoint's save needs: "
                           "saving a checkpoint and stopping", left, global_step, run.host_need_gib)
            control.should_training_stop = True
            control.should_save = True
    nf = run.nonfinite
    if nf.step_ended():
        logger.warning("step %d: non-finite loss or gradient norm, update skipped (%d in a row)", global_step,
                       nf.in_a_row)
        if nf.stopped:
            control.should_training_stop = True
    if run.interrupted is not None:
        control.should_training_stop = True
        control.should_save = run.settings.save_on_interrupt


def warmup_past_the_run(args, max_steps: int) -> None:
    """Warn when the warmup lasts as long as the run or longer: the learning rate never reaches `learning_rate`."""
    warmup = args.get_warmup_steps(max_steps)
    schedule = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    if max_steps > 0 and warmup >= max_steps and schedule not in NO_WARMUP_SCHEDULES:
        logger.warning("warmup: %d steps, the run %d: the learning rate stays below learning_rate=%g throughout. "
                       "Set warmup_steps (or warmup_ratio) lower if that is not meant", warmup, max_steps,
                       args.learning_rate)


def nonfinite_step(run: RunState) -> None:
    """This optimizer step is skipped: the streamed optimizer drops its gradients instead of updating."""
    run.nonfinite.skip_this_step = True
    if run.optimizer is not None:
        run.optimizer.skip_next_step()


def raise_if_stopped(run: RunState, output_dir: str, global_step: int) -> None:
    """After the Trainer's loop: a signal or the non-finite limit stopped it -- say so, naming the last checkpoint."""
    if run.interrupted is not None:
        ckpt = newest_complete_checkpoint(output_dir)
        name = signal.Signals(run.interrupted).name
        raise TrainingInterrupted(
            f"{name}: stopped after step {global_step}; "
            + (f"the last checkpoint is {ckpt} (continue with resume_from_checkpoint: true)" if ckpt
               else "no checkpoint was saved (save_on_interrupt is off and none was due)"),
            run.interrupted, ckpt)
    if run.host_low is not None:
        left, step = run.host_low
        ckpt = newest_complete_checkpoint(output_dir)
        raise TrainingStopped(
            f"host memory ran low: {left:.2f} GiB left after step {step}, under the {run.host_need_gib:.2f} GiB a "
            f"checkpoint's save needs; stopped before the kernel would end the run with no word. "
            + (f"Saved {ckpt}: free memory on this machine (other programs) and resume with "
               f"resume_from_checkpoint: true, " if ckpt else "No checkpoint could be saved: free memory on this "
               "machine, ")
            + "or set host_memory_limit_gb to what it can give, so that the plan keeps within it.")
    nf = run.nonfinite
    if nf.stopped:
        ckpt = newest_complete_checkpoint(output_dir)
        raise TrainingStopped(
            f"{nf.in_a_row} optimizer steps in a row had a non-finite loss or gradient norm "
            f"(all skipped: weights and optimizer states are those of the last finite step, "
            f"{global_step - nf.in_a_row}). Lower learning_rate, check the data, or "
            f"raise max_nonfinite_steps. " + (f"Last checkpoint: {ckpt}." if ckpt else ""))


def refuse_nonfinite_weights(model, step: int, what: str, output_dir: str) -> None:
    """No save writes a model of NaN: `TrainingStopped` when a trained weight holds a NaN or an infinity (the loss
    can stay finite while an update makes some weights NaN -- an embedding row no batch used, under a zero
    adam_epsilon -- and later losses log 0.0: the run exited 0 with a NaN model saved). One reduction per trained
    tensor, where it lives."""
    import torch

    bad = [n for n, p in model.named_parameters()
           if p.requires_grad and p.is_floating_point() and not bool(torch.isfinite(p.detach()).all())]
    if not bad:
        return
    ckpt = newest_complete_checkpoint(output_dir)
    shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    raise TrainingStopped(f"after step {step} the weights hold non-finite values (NaN or inf) in {shown}: {what} is "
                          f"not written. An update made them so: lower learning_rate, keep adam_epsilon at its 1e-8, "
                          f"check the data. " + (f"Last checkpoint: {ckpt} (its weights are finite)." if ckpt
                                                 else "No checkpoint was saved."))


def out_of_memory(run: RunState, step: int, error: BaseException, output_dir: str) -> GpuOutOfMemory:
    """A step that ran out of GPU memory, said with what was on the GPU and the switch that frees at least 1 GiB
    (torch's own message names the allocation that failed; the planner's prediction shows how far off it was)."""
    what = str(error).split("\n")[0].split(". GPU")[0]  # ("CUDA out of memory. Tried to allocate 2.00 GiB")
    swap, plan = run.swap, run.plan
    if swap is not None and swap.resident > 0:
        fewer = max(0, swap.resident - max(1, math.ceil(2**30 / max(swap.layer_bytes, 1))))
        chosen = "chosen by layer_swap: auto" if run.settings.layer_swap is None else "as configured"
        fix = (f"{swap.resident} of {swap.n_layers} decoder layers were on the GPU ({chosen}): set layer_swap: "
               f"{fewer}")
    elif swap is None:
        fix = "no layer swap: set layer_swap: auto (decoder layers then wait in pinned CPU memory)"
    else:
        fix = ("every decoder layer already waits in CPU memory: set activation_offload: true, tiled_mlp: true or "
               "tiled_layers: true, or lower max_seq_length / per_device_train_batch_size")
    predicted = f"; the plan predicted a {plan.gpu_peak_gib:.1f} GiB peak" if plan is not None else ""
    ckpt = newest_complete_checkpoint(output_dir)
    return GpuOutOfMemory(f"step {step} ran out of GPU memory ({what}){predicted}. {fix}. Updates of this step may "
                          f"have run, so the run stops here; " + (f"the last checkpoint is {ckpt} (resume with "
                          f"resume_from_checkpoint: true)" if ckpt else "no checkpoint was saved"))
