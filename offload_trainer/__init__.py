"""offload_trainer: full-finetune LLMs on one small GPU.

Three layers, each importing only those below it:
- `engine/`: the mechanisms, torch and torchao only, usable from a bare loop (`StreamedAdamW8bit`, `LayerSwap`,
  `ActivationOffloader`, `Sharding`, `chunked_causal_lm_loss`); `planner/` predicts their memory and speed.
- `trainer/`: the Trainer shell (`OffloadTrainer`, `OffloadMixin`, `OffloadTrainingArguments`) wiring them into
  `transformers.Trainer` from one `OffloadSettings` (settings.py: every switch, its default and bounds, resolved once).
- `cli/`: the `offload-trainer` command; `data/` and `models/` are what it loads.
`integrations/` holds TRL (public path `offload_trainer.trl`), axolotl and LLaMA-Factory; `errors.py` every error.
Names are loaded on first use, so importing a mechanism does not import transformers.
"""
from importlib import import_module

__version__ = "0.1.0"
__all__ = [
    "OffloadMixin",
    "OffloadTrainer",
    "OffloadTrainingArguments",
    "OffloadSFTTrainer",
    "StreamedAdamW8bit",
    "chunked_causal_lm_loss",
    "forward_units",
    "LayerSwap",
    "Sharding",
    "ActivationOffloader",
    "plan",
    "run_history",
    "CheckpointError",
    "TrainingInterrupted",
    "TrainingStopped",
]

_WHERE = {
    "OffloadMixin": "trainer",
    "OffloadTrainer": "trainer",
    "OffloadTrainingArguments": "trainer.args",
    "OffloadSFTTrainer": "trl",
    "StreamedAdamW8bit": "engine.optim",
    "forward_units": "engine.optim",
    "chunked_causal_lm_loss": "engine.loss",
    "LayerSwap": "engine.swap",
    "Sharding": "engine.distributed",
    "ActivationOffloader": "engine.activations",
    "plan": "planner.keywords",
    "run_history": "trainer.run_history",
    "CheckpointError": "errors",
    "TrainingInterrupted": "errors",
    "TrainingStopped": "errors",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module 'offload_trainer' has no attribute {name!r}")
