"""Entry points for the tools fine-tuners already run (axolotl, LLaMA-Factory). Each imports its tool only when used."""


def optimizer_will_stream(*, on_gpu: bool, full_finetune: bool, offload_optimizer, optim) -> bool:
    """Whether the streamed optimizer will update a full finetune's weights, read from a tool's config before its
    model loads (the Trainer, which decides it with trainer/args.py's `streams_optimizer`, does not exist yet): a GPU,
    every weight training (LoRA keeps the Trainer's AdamW), offload_optimizer not false, an AdamW `optim`."""
    from ..trainer.conflicts import ADAMW_NAMES

    return on_gpu and full_finetune and offload_optimizer is not False and str(optim) in ADAMW_NAMES


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
