"""A stop signal outside the training loop (loading, tokenizing, the final save; inside it the Trainer saves and
stops cleanly, trainer/guards.py): the run ends with a sentence naming the last complete checkpoint. And the end of
a torchrun launch: its process group taken down while the interpreter is whole."""
from __future__ import annotations

import contextlib
import signal

from ..errors import TrainingInterrupted, stop_signals_call
from ..trainer.checkpoint import newest_complete_checkpoint
from .earlier_run import configured_output_dir


def leave_process_group() -> None:
    """torchrun: every rank finished, so its process group is taken down here, while the interpreter is whole. Left
    to exit, gloo's worker threads can be destroyed still joinable and the process aborts (SIGABRT, "terminate called
    without an active exception", pytorch/pytorch#190489), failing a finished run. Not after a failure: a rank that
    raised while others are in a collective would wait in it forever."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class _Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised as Ctrl-C is, so that the same clean-up runs."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def signals_say_where_the_run_stands(config: str, overrides: list[str]):
    def terminated(signum, frame):
        raise _Terminated(signum)

    try:
        with stop_signals_call(terminated, with_sigint=False, children_die=True):
            yield
    except KeyboardInterrupt as e:
        if isinstance(e, TrainingInterrupted):
            raise
        signum = e.signum if isinstance(e, _Terminated) else signal.SIGINT
        out = configured_output_dir(config, overrides)
        ckpt = newest_complete_checkpoint(out) if out else None
        raise TrainingInterrupted(
            f"{signal.Signals(signum).name} outside the training loop: "
            + (f"the last checkpoint is {ckpt} (continue with resume_from_checkpoint: true)" if ckpt else
               "no checkpoint was saved"), signum, ckpt) from None
