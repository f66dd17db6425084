"""Errors that end a run with a sentence instead of a traceback. The command maps each kind to its own exit code
(cli/main.py, `ENDINGS`), so a script can tell a bad input from a full disk from a busy output directory."""
from __future__ import annotations

import contextlib as _contextlib
import os as _os
import signal as _signal
import threading as _threading


class ConfigError(ValueError):
    """A user error in a config, an override or the Trainer's arguments: the message names the key and what to
    change."""


class DataError(ValueError):
    """Bad training data: the message names the file (or dataset), the line (or row) and what to change."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message says what is wrong and what to do."""


class MergeError(ValueError):
    """LoRA adapters that do not fit the base they are merged into (names, shapes), or a directory lacking what the
    merge reads."""


class StorageError(OSError):
    """The run cannot write its outputs: the disk is full (or would be), or output_dir is not writable. Nothing
    complete-looking is left half-written; the message names the path, the bytes needed and the fix."""


class OutputBusy(RuntimeError):
    """output_dir belongs to another run: one still running (its lock is held), or an earlier one whose checkpoints
    this run would silently replace."""


# The signals that ask a run to stop: Ctrl-C, `kill` / a scheduler's preemption, a closed terminal or SSH session.
STOP_SIGNALS = tuple(getattr(_signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(_signal, n))


@_contextlib.contextmanager
def stop_signals_call(handler, *, with_sigint: bool = True, children_die: bool = False):
    """Within: `handler(signum, frame)` answers the stop signals (Ctrl-C too, unless `with_sigint` is False: Python's
    own KeyboardInterrupt then); after, the handlers before. Signal handlers belong to the main thread: elsewhere,
    nothing changes.

    A process forked within (a tokenizing pool's worker, a data loader's) inherits the handlers, but it is not the one
    they stop: there Ctrl-C is ignored (a terminal sends it to the whole group; the parent answers for all, and the
    workers print no tracebacks), and SIGTERM / SIGHUP end it as by default with `children_die` (a pool stopping its
    workers sends SIGTERM and waits for them: raising there instead left `dataset_num_proc` > 1 hanging after
    Ctrl-C), else are ignored too (a data loader's workers keep serving the step the parent finishes and saves)."""
    owner = _os.getpid()

    def guarded(signum, frame):
        if _os.getpid() == owner:
            own = handler if with_sigint or signum != _signal.SIGINT else _signal.default_int_handler
            return own(signum, frame)
        if children_die and signum != _signal.SIGINT:
            _signal.signal(signum, _signal.SIG_DFL)
            _os.kill(_os.getpid(), signum)

    main = _threading.current_thread() is _threading.main_thread()
    old = {s: _signal.signal(s, guarded) for s in (STOP_SIGNALS if main else ())}
    try:
        yield
    finally:
        for s, h in old.items():
            _signal.signal(s, h)


@_contextlib.contextmanager
def stop_signals_deferred():
    """Within: a stop signal is held, then sent again on the way out, to the handlers of before. For the first import
    of torch and transformers: their modules run Python called from C++ (pybind11), where the exception a handler
    raises cannot unwind -- `terminate called after throwing an instance of 'pybind11::error_already_set'`, SIGABRT,
    no sentence (a SIGTERM a second into a run). Outside the main thread, nothing changes."""
    if _threading.current_thread() is not _threading.main_thread():
        yield
        return
    held: list[int] = []
    old = {s: _signal.signal(s, lambda signum, frame: held.append(signum)) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            _signal.signal(s, h)
        if held:
            _os.kill(_os.getpid(), held[0])


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C / SIGTERM stopped training after a clean step; `checkpoint` is the newest complete one (or None)."""

    def __init__(self, message: str, signum: int, checkpoint: str | None):
        super().__init__(message)
        self.signum, self.checkpoint = signum, checkpoint


class GpuOutOfMemory(RuntimeError):
    """A training step ran out of GPU memory: what was on the GPU, what the plan predicted, and the switch that makes
    room. Updates may already have run during that step's backward, so the run ends there; the last checkpoint is
    intact."""


class TrainingStopped(RuntimeError):
    """Training stopped itself: too many non-finite steps in a row."""
