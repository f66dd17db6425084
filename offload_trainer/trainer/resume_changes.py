"""What a resume does with arguments that differ from the checkpoint's. Each checkpoint records the training
hyperparameters it was made with (`hyperparameters.json`); a resume compares them with its own and, for each that
changed, says what follows -- or refuses, naming the value to set, where the checkpoint's state would silently win
(the optimizer's and the scheduler's saved states carry their learning rate, betas, epsilon and weight decay, so the
new values would not be used)."""
from __future__ import annotations

import json
import logging
import os

from ..errors import CheckpointError

logger = logging.getLogger("offload_trainer")

RECORD = "hyperparameters.json"

# key -> why a changed value cannot take effect on a resume (the checkpoint's saved state replaces it)
IGNORED = {
    "learning_rate": "the optimizer's and the scheduler's saved states carry the checkpoint's learning rate",
    "lr_scheduler_type": "the saved scheduler state continues the checkpoint's schedule",
    "warmup_steps": "the saved scheduler state continues the checkpoint's schedule",
    "adam_beta1": "the optimizer's saved state carries the checkpoint's betas",
    "adam_beta2": "the optimizer's saved state carries the checkpoint's betas",
    "adam_epsilon": "the optimizer's saved state carries the checkpoint's epsilon",
    "weight_decay": "the optimizer's saved state carries the checkpoint's weight decay",
}
# key -> what a changed value does from the resumed step on
APPLIED = {
    "max_steps": "the learning-rate schedule is recomputed for the new length, so the rate jumps from where it was",
    "num_train_epochs": "the learning-rate schedule is recomputed for the new length, so the rate jumps from where "
                        "it was",
    "per_device_train_batch_size": "each optimizer step takes another number of tokens, and the data already seen "
                                   "is skipped by steps: the run continues at another place in the data",
    "gradient_accumulation_steps": "each optimizer step takes another number of tokens, and the data already seen "
                                   "is skipped by steps: the run continues at another place in the data",
    "world_size": "each optimizer step takes another number of tokens, and the data already seen is skipped by "
                  "steps: the run continues at another place in the data",
    "max_grad_norm": "clipping uses the new value from the next step",
    "seed": "the data order follows the new seed, the random state the checkpoint's",
    "max_seq_length": "rows hold another number of tokens from the resumed step on (packed rows are packed anew), and "
                      "the data already seen is skipped by steps: the run continues at another place in the data",
    "training_rows": "the training data is not the checkpoint's (another number of rows): the rows already seen are "
                     "skipped by count, so the run continues at another place in other data. To train on new data, "
                     "start a new run from the checkpoint's model instead",
}


def _plain(value):
    return getattr(value, "value", value)  # (enums: their text)


def hyperparameters(args, longest_row: int | None = None, rows: int | None = None) -> dict:
    """The arguments' values of the recorded keys; `max_seq_length` is the longest row the training data gives (the
    data's own argument, which the Trainer's arguments do not hold), `training_rows` its number of rows (None: a
    stream, not known). (The same number of other rows goes unnoticed.)"""
    values = {key: _plain(getattr(args, key, None)) for key in (*IGNORED, *APPLIED)}
    values["max_seq_length"], values["training_rows"] = longest_row, rows
    return values


def record(checkpoint_dir: str, args, longest_row: int | None = None, rows: int | None = None) -> None:
    with open(os.path.join(checkpoint_dir, RECORD), "w") as f:
        json.dump(hyperparameters(args, longest_row, rows), f, indent=1)


def check(checkpoint: str, args, step: int | None, longest_row: int | None = None, rows: int | None = None) -> None:
    """Log what each changed hyperparameter does on this resume; CheckpointError where it could not take effect
    (`step`: the checkpoint's global step, for max_steps below it)."""
    path = os.path.join(checkpoint, RECORD)
    if not os.path.isfile(path):  # (a checkpoint written before these were recorded)
        return
    with open(path) as f:
        saved = json.load(f)
    now = hyperparameters(args, longest_row, rows)
    if step is not None and isinstance(now["max_steps"], int) and 0 < now["max_steps"] < step:
        raise CheckpointError(f"max_steps={now['max_steps']} is below the step of {checkpoint} ({step}): a resume "
                              f"would train past it. Set max_steps to more than {step}, or resume from an earlier "
                              f"checkpoint.")
    for key, new in now.items():
        old = saved.get(key, new)
        if old == new or old is None or new is None:  # (None: not known on one side)
            continue
        if key in IGNORED:
            raise CheckpointError(f"resuming {checkpoint} with {key} {old} -> {new}, which would not take effect: "
                                  f"{IGNORED[key]}. Set {key}: {old} to continue the run, or start a new one "
                                  f"(another output_dir) with {new}.")
        logger.warning("resume changes %s %s -> %s: %s", key, old, new, APPLIED[key])
