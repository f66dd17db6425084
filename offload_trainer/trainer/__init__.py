"""The Trainer shell: `OffloadMixin` / `OffloadTrainer` (mixin.py) wire the mechanisms into `transformers.Trainer`.

- `args.py`: `OffloadTrainingArguments` (our fields on `TrainingArguments`); `run_state.py`: what one run holds
  (plan, swap, optimizer, non-finite counters, interrupt); `wiring.py`: what the shell builds from the settings;
- `seams.py`: every seam into transformers / accelerate without a public hook, with its reason;
- `staging.py` / `checkpoint.py` / `outputs.py`: checkpoints and final saves, published atomically; `manifest.py`: the
  record of the names our saves published in a directory (only those are ever replaced or removed);
- `guards.py`: signals and non-finite steps; `run_logs.py`: throughput and memory in the logs; `run_history.py`:
  those figures saved beside the Trainer's log history (`run_history()` reads both back as one).
"""
__all__ = ["OffloadMixin", "OffloadTrainer"]


def __getattr__(name: str):
    # (loaded on first use: the command imports outputs.py from here before it needs transformers)
    if name in __all__:
        from . import mixin

        return getattr(mixin, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
