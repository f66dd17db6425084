"""The streamed 8-bit AdamW, as collaborating parts, one module each:

- `streamed.py`: `StreamedAdamW8bit`, the `torch.optim.Optimizer` that wires the others (read it first), with its
  mixins `backward.py` (each gradient as backward reaches it), `clipping.py` (the global norm, exact or
  speculative) and `state_io.py` (the state dict);
- `speculation.py`: what a speculative step keeps to roll back (weights' backups, the other bank of states);
- `host_read.py`: a value read from the GPU without queueing behind the state copies;
- `update.py`: torchao's AdamW arithmetic on a chunk of 8-bit states (and the norms for clipping);
- `kernel.py`: the same update as one Triton kernel per chunk (CUDA);
- `states.py`: where the states live (pinned host buffers, GPU slots, those kept on the GPU);
- `pipeline.py`: one tensor's update queued on side streams (H2D -> update -> D2H), the step's bookkeeping;
- `grads.py`: gradients waiting in pinned host memory (clipping, accumulation);
- `schedule.py`: hooks, the deferred launch order, each layer's wait for its own update;
- `sharded.py`: data parallel (states sharded over ranks, gradients reduced to their owner).
They import torch and torchao only.
"""
from .schedule import LAUNCH_AHEAD, forward_units
from ..sizes import state_bytes
from .streamed import StreamedAdamW8bit
from .update import adamw8bit_chunk, compile_update

__all__ = ["StreamedAdamW8bit", "forward_units", "state_bytes", "adamw8bit_chunk", "compile_update", "LAUNCH_AHEAD"]
