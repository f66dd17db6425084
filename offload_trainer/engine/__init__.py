"""The mechanisms: they import torch (and torchao) only, never transformers, and work from a bare training loop.

- `optim/`: `StreamedAdamW8bit`, 8-bit AdamW states in pinned host memory, updated during backward;
- `swap.py`: `LayerSwap`, decoder layers kept in pinned host memory and fetched one ahead of use; `fit.py`:
  `ResidencyFit`, how many stay on the GPU, from the first steps' measured peaks; `layers.py`: finding the stacks
  of layers and pointing a layer's tensors elsewhere;
- `activations.py`: `ActivationOffloader`, checkpointed layer inputs in pinned host memory;
- `loss.py`: `chunked_causal_lm_loss`, the LM head and cross-entropy without full logits;
- `distributed.py`: `Sharding`, data parallel ranks each owning a share of the states;
- `streams.py`: the side streams and stall counters the others share; `sizes.py`: the 8-bit states' size.
Nothing is imported here, so that the planner can read `sizes` without importing torch.
"""
