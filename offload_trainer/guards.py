"""Runs that end cleanly: SIGINT / SIGTERM finish the step, save and stop; optimizer steps with a non-finite loss or
gradient norm are skipped (the streamed optimizer drops their gradients), and too many in a row stop the run; after
train() returns, either ends the run with the exception the command turns into a sentence and an exit code."""
from __future__ import annotations

import contextlib
import logging
import signal
import threading

from .checkpoint import newest_complete_checkpoint
from .errors import TrainingInterrupted, TrainingStopped

logger = logging.getLogger("offload_trainer")


@contextlib.contextmanager
def signals_stop_cleanly(trainer):
    """SIGINT / SIGTERM: finish the current step, save if save_on_interrupt, then stop; twice: stop now."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if trainer._interrupted is not None:
            raise KeyboardInterrupt
        trainer._interrupted = signum
        logger.warning("%s received: finishing step %d, then %s (again to stop at once)",
                       signal.Signals(signum).name, trainer.state.global_step + 1,
                       "saving a checkpoint" if trainer._flag("save_on_interrupt") else "stopping")

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def on_step_end(trainer, control) -> None:
    nf = trainer._nonfinite
    if trainer._skip_step:
        nf["skipped"] += 1
        nf["in_a_row"] += 1
        logger.warning("step %d: non-finite loss or gradient norm, update skipped (%d in a row)",
                       trainer.state.global_step, nf["in_a_row"])
        limit = trainer._nonfinite_limit
        if limit and nf["in_a_row"] >= limit:
            nf["stopped"] = True
            control.should_training_stop = True
    else:
        nf["in_a_row"] = 0
    trainer._skip_step = False
    if trainer._interrupted is not None:
        control.should_training_stop = True
        control.should_save = bool(trainer._flag("save_on_interrupt"))


def nonfinite_step(trainer) -> None:
    """This optimizer step is skipped: the streamed optimizer drops its gradients instead of updating."""
    trainer._skip_step = True
    if trainer._offload_opt is not None:
        trainer._offload_opt.skip_next_step()


def raise_if_stopped(trainer) -> None:
    """After the Trainer's loop: a signal or the non-finite limit stopped it -- say so, naming the last checkpoint."""
    if trainer._interrupted is not None:
        ckpt = newest_complete_checkpoint(trainer.args.output_dir)
        name = signal.Signals(trainer._interrupted).name
        raise TrainingInterrupted(
            f"{name}: stopped after step {trainer.state.global_step}; "
            + (f"the last checkpoint is {ckpt} (continue with resume_from_checkpoint: true)" if ckpt
               else "no checkpoint was saved (save_on_interrupt is off and none was due)"),
            trainer._interrupted, ckpt)
    nf = trainer._nonfinite
    if nf["stopped"]:
        ckpt = newest_complete_checkpoint(trainer.args.output_dir)
        raise TrainingStopped(
            f"{nf['in_a_row']} optimizer steps in a row had a non-finite loss or gradient norm "
            f"(all skipped: weights and optimizer states are those of the last finite step, "
            f"{trainer.state.global_step - nf['in_a_row']}). Lower learning_rate, check the data, or "
            f"raise max_nonfinite_steps. " + (f"Last checkpoint: {ckpt}." if ckpt else ""))
