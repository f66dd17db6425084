"""What one run of the Trainer shell holds, in one object owned by the mixin (`OffloadMixin._run`): the resolved
settings, the plan, the mechanisms built for the model (layer swap, the streamed optimizer, activation offload), the
non-finite counters, the interrupt, the log's counters and figures. The shell's modules (wiring, guards, run_logs,
staging, seams) read and change the run through it, never through the Trainer's attributes."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..engine.optim import StreamedAdamW8bit
from ..engine.fit import ResidencyFit
from ..engine.swap import LayerSwap
from ..planner import Plan
from ..settings import OffloadSettings


@dataclass
class NonFiniteSteps:
    """Optimizer steps skipped for a non-finite loss or gradient norm; `limit` in a row stop the run (0: never)."""

    check: bool = True
    limit: int = 0
    skipped: int = 0
    in_a_row: int = 0
    stopped: bool = False
    skip_this_step: bool = False  # a micro-batch of the current step was non-finite

    def step_ended(self) -> bool:
        """Count the step that ended; True when it was skipped."""
        skipped, self.skip_this_step = self.skip_this_step, False
        if not skipped:
            self.in_a_row = 0
            return False
        self.skipped += 1
        self.in_a_row += 1
        if self.limit and self.in_a_row >= self.limit:
            self.stopped = True
        return True


@dataclass
class LogCounters:
    """What the figures of the next training log are measured from (run_logs.py)."""

    tokens: int = 0
    since: float = field(default_factory=time.perf_counter)
    paused_s: float = 0.0  # saving and evaluating, left out of tok/s
    moved_bytes: int = 0
    stall_ms: float = 0.0
    trim_step: int | None = None
    clip_counts: dict | None = None


# Who writes each field after RunState made it (besides `new_train`, which resets what one train() measured), one
# module each but `plan`: the run's owner modules. Kept as one object, not split by owner, because the shell's
# modules read across them (the guards read the optimizer and the swap, the logs every mover): split, each would be
# handed several. tests/test_architecture.py checks this table against the code.
WRITERS = {
    "settings": ("fold",),  # folding nothing where it would change the result (fold.check)
    "plan": ("wiring", "fold"),  # made at train(); a plan the command made that folds is dropped by fold.check
    "streaming": ("mixin",), "not_streaming_why": ("mixin",), "activations": ("mixin",), "figures": ("mixin",),
    "step_batches": ("mixin",), "handed_back": ("mixin",),
    "swap": ("wiring",), "fit": ("wiring",), "optimizer": ("wiring",), "row_tokens": ("wiring",),
    "device_loss_filter": ("seams",), "interrupted": ("guards",), "staging_dir": ("staging",),
    "host_need_gib": ("guards",), "host_low": ("guards",),
    "fold": ("fold",), "fold_blockers": ("fold",),
    "nonfinite": (), "log": (), "said": (), "want_activations": (),
}


class RunState:
    def __init__(self, settings: OffloadSettings, plan: Plan | None = None):
        self.settings = settings
        self.plan = plan
        self.streaming, self.not_streaming_why = False, ""
        self.swap: LayerSwap | None = None
        self.fit: ResidencyFit | None = None  # layer_swap: auto on a GPU: the resident layers fitted to the peak
        self.optimizer: StreamedAdamW8bit | None = None
        self.activations = None  # the ActivationOffloader, once installed in this train()
        self.want_activations = False
        self.device_loss_filter = False
        self.nonfinite = NonFiniteSteps(check=settings.check_nonfinite, limit=settings.max_nonfinite_steps)
        self.interrupted: int | None = None  # the signal that asked training to stop
        self.log = LogCounters()
        self.figures: list[dict] = []  # each training log's figures ({"step": N, ...}: run_logs.py)
        self.staging_dir: str | None = None  # set while a checkpoint is written (staging.save_checkpoint)
        self.step_batches: list = []  # speculative clipping: this optimizer step's micro-batches, for a redo
        self.said: set[str] = set()  # one-time log lines already said
        self.row_tokens: tuple | None = None  # (the training dataset, its longest row): wiring.row_tokens
        self.fold = None  # the micro-batches run as one, once planned (fold.py), or None
        self.fold_blockers: list[str] = []  # why folding would change the result (fold.check)
        self.handed_back = False  # the model handed back (OffloadMixin.hand_back_model)
        self.host_need_gib: float | None = None  # host memory a save needs, kept available (guards.watch_host)
        self.host_low: tuple | None = None  # (GiB left, step) when it was not: the run saves and stops

    def first_time(self, line: str) -> bool:
        """True the first time it is asked for `line`: the log lines said once a run."""
        new = line not in self.said
        self.said.add(line)
        return new

    def decided(self, name: str) -> bool:
        """A switch as given, or, left unset, as the plan decided (off without a plan)."""
        return self.settings.decided(name, self.plan)

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step as they run: the Trainer's, less those run as one (fold.py)."""
        return self.settings.accumulation // (self.fold.size if self.fold is not None else 1)

    @property
    def sharded(self) -> bool:
        """Several ranks and the streamed optimizer: it reduces gradients and shards states itself."""
        return self.settings.world_size > 1 and self.streaming

    def new_train(self) -> None:
        """A train() starts: what one train() measured or installed is not the next one's."""
        self.activations = None
        self.want_activations = self.decided("activation_offload") and self.settings.checkpointing
        self.interrupted = None
        self.host_low = None
        self.log = LogCounters()
        self.nonfinite.in_a_row, self.nonfinite.stopped = 0, False
        if self.fold is not None:
            self.fold.clear()

    def movers(self) -> list:
        """The mechanisms that copy between host and GPU (their traffic and stalls go to the logs)."""
        return [m for m in (self.optimizer, self.swap, self.activations) if m is not None]

    def synchronize(self) -> None:
        """Updates may still be in flight on the update stream, copies of swapped layers on theirs."""
        if self.optimizer is not None:
            self.optimizer.synchronize()
        if self.swap is not None:
            self.swap.synchronize()
