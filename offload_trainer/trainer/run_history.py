"""Our figures of each training log, kept out of the Trainer's log history and saved beside it.

They go to the callbacks with the Trainer's figures (the console, TensorBoard and W&B get one log: seams.
figures_to_callbacks) and to the run's `run_figures.json`, written with trainer_state.json (in each checkpoint and with
the model) and resumed with the checkpoint. `state.log_history` stays the Trainer's own, so a resumed run's history
equals the uninterrupted run's as the Trainer's does (measured figures differ between any two runs: tok/s, memory).
`run_history(trainer or output_dir)` gives the history with each training log's figures in it."""
from __future__ import annotations

import json
import os

from ..errors import CheckpointError
from .checkpoint import checkpoint_steps

FIGURES_NAME = "run_figures.json"


def save_figures(run, directory: str) -> None:
    """`run.figures` (a RunState's) as `directory`/run_figures.json. `directory` is a save's staging directory (a
    checkpoint's, or outputs.staged_save's), new: nothing is written through a link planted in output_dir."""
    with open(os.path.join(directory, FIGURES_NAME), "x") as f:
        json.dump({"figures": run.figures}, f)


def load_figures(directory: str) -> list[dict]:
    """The figures saved in `directory` (a checkpoint or output_dir); [] where there are none (a run of the plain
    Trainer, or an older one) or the file is unreadable (they are only figures: the run's history, weights and states
    come from trainer_state.json and the checkpoint's own files)."""
    try:
        with open(os.path.join(directory, FIGURES_NAME)) as f:
            figures = json.load(f)["figures"]
        return [dict(r) for r in figures if isinstance(r, dict) and isinstance(r.get("step"), int)]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def run_history(source) -> list[dict]:
    """The run's log history with each training log's figures in it (tok/s, memory, ...): `source` a Trainer (its
    live state) or an output directory (its trainer_state.json and run_figures.json, or the newest checkpoint's)."""
    if isinstance(source, (str, os.PathLike)):
        directory = _state_directory(str(source))
        history = _log_history(os.path.join(directory, "trainer_state.json"))
        figures = load_figures(directory)
    else:
        history = list(source.state.log_history)
        run = getattr(source, "_run", None)
        figures = run.figures if run is not None else []
    by_step = {r["step"]: r for r in figures}
    return [{**h, **by_step[h["step"]]} if "loss" in h and isinstance(h.get("step"), int) and h["step"] in by_step
            else dict(h) for h in history]


def _log_history(path: str) -> list[dict]:
    """The log history of a trainer_state.json; CheckpointError, naming the file, where it cannot be read as one."""
    try:
        with open(path) as f:
            history = json.load(f).get("log_history", [])
        if not isinstance(history, list):
            raise TypeError("its log_history is not a list")
    except (OSError, ValueError, AttributeError, TypeError) as e:
        why = "not a mapping" if isinstance(e, AttributeError) else str(e)
        raise CheckpointError(f"{path} cannot be read as a Trainer state ({why}): the file is damaged. Each "
                              f"checkpoint of the run holds the history up to its step (offload-trainer report "
                              f"OUTPUT_DIR/checkpoint-N).") from None
    return [h for h in history if isinstance(h, dict)]


def _state_directory(output_dir: str) -> str:
    """Where a run's state is: output_dir once the run saved its model, else its newest checkpoint."""
    if os.path.isfile(os.path.join(output_dir, "trainer_state.json")):
        return output_dir
    names = checkpoint_steps(output_dir) if os.path.isdir(output_dir) else {}
    found = [p for n in names if os.path.isfile(os.path.join(p := os.path.join(output_dir, n), "trainer_state.json"))]
    if not found:
        raise FileNotFoundError(f"no trainer_state.json in {output_dir} or its checkpoints: a Python run writes it "
                                f"with trainer.save_state() (offload-trainer train does), or read a live run with "
                                f"offload_trainer.run_history(trainer)")
    return found[-1]
