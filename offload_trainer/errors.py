"""Errors that end a run with a sentence instead of a traceback (the CLI maps them to exit codes)."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from or written; the message says what is wrong and what to do."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C / SIGTERM stopped training after a clean step; `checkpoint` is the newest complete one (or None)."""

    def __init__(self, message: str, signum: int, checkpoint: str | None):
        super().__init__(message)
        self.signum, self.checkpoint = signum, checkpoint


class TrainingStopped(RuntimeError):
    """Training stopped itself: too many non-finite steps in a row."""
