"""The values a run's arguments may hold: every number finite, counts positive, rates and probabilities in range,
paths with `~` expanded. Checked before anything loads, for a config (cli/config.py) and for
`OffloadTrainingArguments` built from Python (trainer/args.py). A value out of range would otherwise fail late (after
the model loaded, as a traceback) or, worse, train silently wrong (a NaN learning rate gives NaN weights and exit 0).
The offload switches' own bounds are settings.py's, checked when the arguments are built (also before any load)."""
from __future__ import annotations

import math
import os
from typing import Any, Callable

# key -> (test, what the value must be)
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {}


def _rule(test: Callable[[Any], bool], what: str, *keys: str) -> None:
    for k in keys:
        _RULES[k] = (test, what)


_rule(lambda v: v >= 1, "a positive whole number", "per_device_train_batch_size", "per_device_eval_batch_size",
      "gradient_accumulation_steps", "random_num_samples", "eval_accumulation_steps")
_rule(lambda v: v > 0, "positive (a number of steps, or below 1 a fraction of the run)", "logging_steps",
      "save_steps", "eval_steps")
_rule(lambda v: v >= 0, "zero or more", "learning_rate", "weight_decay", "warmup_steps", "max_grad_norm",
      "lora_alpha", "save_total_limit", "dataloader_num_workers", "label_smoothing_factor")
# AdamW divides by sqrt(v) + epsilon: at 0, a weight whose gradient is 0 (an embedding row no batch used) becomes
# 0 / 0 = NaN at the first step; above 1 the update is no longer Adam's (it shrinks to a tiny SGD step)
_rule(lambda v: 0 < v <= 1, "positive and at most 1 (AdamW divides by sqrt(v) + adam_epsilon: 0 makes NaN of every "
      "weight whose gradient is 0; the usual value is 1e-8)", "adam_epsilon")
_rule(lambda v: 0 <= v < 1, "at least 0 and below 1", "adam_beta1", "adam_beta2", "lora_dropout", "eval_fraction")
_rule(lambda v: 0 <= v < 2**32, "from 0 to 4294967295 (numpy's and torch's seed range)", "seed", "data_seed")
_rule(lambda v: v == -1 or v > 0, "-1 (num_train_epochs decides) or a positive count: 0 would train nothing",
      "max_steps")
_rule(lambda v: v > 0, "positive: 0 would train nothing", "num_train_epochs")
_rule(lambda v: v >= 8, "at least 8 tokens", "max_seq_length")

PATH_KEYS = ("output_dir", "logging_dir", "dataset_path", "model_name_or_path", "tokenizer_name_or_path",
             "resume_from_checkpoint", "deepspeed")


def _numbers(value: Any):
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _numbers(v)


def check_values(cfg: dict[str, Any]) -> list[str]:
    """Problems with the values of a merged config, one sentence each (empty: none); expands `~` in paths in place."""
    problems = []
    for key, value in cfg.items():
        if any(isinstance(x, float) and not math.isfinite(x) for x in _numbers(value)):
            problems.append(f"{key} = {value!r}: every number in a config must be finite (a NaN or infinite "
                            f"{key} trains NaN weights or never ends)")
            continue
        rule = _RULES.get(key)
        if rule is not None and isinstance(value, (int, float)) and not isinstance(value, bool) and not rule[0](value):
            problems.append(f"{key} = {value!r}: must be {rule[1]}")
        if key == "output_dir" and (not isinstance(value, str) or not value.strip()):
            problems.append("output_dir is empty: name the directory the run writes to, e.g. output_dir: outputs/run")
        if key in PATH_KEYS and isinstance(value, str) and ("~" in value[:1] or "$" in value):
            expanded = os.path.expandvars(os.path.expanduser(value))
            if "$" in expanded:  # (expandvars leaves a variable that is not set as it is written)
                problems.append(f"{key} = {value!r}: the environment variable in it is not set (export it, or "
                                f"write the path out)")
            cfg[key] = expanded
    if cfg.get("num_train_epochs") is not None and cfg.get("max_steps", -1) > 0:
        problems = [p for p in problems if not p.startswith("num_train_epochs =")]  # max_steps decides instead
    return problems
