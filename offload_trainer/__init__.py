"""offload_trainer: full-finetune LLMs on one small GPU.

The mechanisms import torch (and torchao) only and work from a bare training loop:
`StreamedAdamW8bit` (optim.py), `LayerSwap` (swap.py), `Sharding` (distributed.py, data parallel),
`ActivationOffloader` (activations.py),
`chunked_causal_lm_loss` (loss.py), `plan` (planner.py). The Trainer shell
(`OffloadTrainer`, `OffloadTrainingArguments`) is loaded on first use, so importing a
mechanism does not import transformers.
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
    "CheckpointError",
    "TrainingInterrupted",
    "TrainingStopped",
]

_WHERE = {
    "OffloadMixin": "trainer",
    "OffloadTrainer": "trainer",
    "OffloadTrainingArguments": "args",
    "OffloadSFTTrainer": "trl",
    "StreamedAdamW8bit": "optim",
    "forward_units": "optim",
    "chunked_causal_lm_loss": "loss",
    "LayerSwap": "swap",
    "Sharding": "distributed",
    "ActivationOffloader": "activations",
    "plan": "planner",
    "CheckpointError": "errors",
    "TrainingInterrupted": "errors",
    "TrainingStopped": "errors",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module 'offload_trainer' has no attribute {name!r}")
