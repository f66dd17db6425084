"""Entry points for the tools fine-tuners already run (axolotl, LLaMA-Factory). Each imports its tool only when used."""


def cast_trainable_weights(model, dtype) -> tuple[int, float]:
    """Cast the model's trainable fp32 weights to `dtype` (bf16) in place, where a tool upcasts them for its own
    mixed precision (axolotl: embeddings, head and norms of a full finetune) but the streamed optimizer keeps the
    weights in the load dtype and rounds its updates stochastically. Returns (tensors cast, GiB freed)."""
    import torch

    cast = [p for p in model.parameters() if p.requires_grad and p.dtype == torch.float32 and dtype != torch.float32]
    freed = sum(p.numel() for p in cast) * (4 - torch.empty((), dtype=dtype).element_size()) / 2**30
    for p in cast:
        p.data = p.data.to(dtype)
    return len(cast), freed
