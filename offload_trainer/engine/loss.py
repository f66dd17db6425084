"""Chunked LM-head + cross-entropy: the full (tokens x vocab) logits tensor is never materialised.

Each chunk of hidden states goes through the head and the loss under activation checkpointing, so only
one chunk's fp32 logits exist at a time, in forward and again in backward (recomputed).
At 4 x 2048 tokens and a 128k vocabulary, full fp32 logits are 3.9 GiB; 1024-token chunks are 0.5 GiB.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..settings import LOSS_CHUNK

IGNORE_INDEX = -100


def _chunk_loss_sum(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    logits = F.linear(h, weight, bias).float()
    return F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_causal_lm_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    chunk_size: int = LOSS_CHUNK,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Next-token cross-entropy of `hidden @ weight.T (+ bias)` against `labels`, as HF's causal-LM loss.

    hidden: (batch, seq, d); labels: (batch, seq), not yet shifted, IGNORE_INDEX where no loss is taken.
    Mean over predicted tokens, or sum / num_items_in_batch when given (gradient accumulation).
    """
    # shift: position t predicts labels[t + 1]; the last position predicts nothing
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    h = hidden.reshape(-1, hidden.shape[-1])
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, h.shape[0], chunk_size):
        y = targets[start:start + chunk_size]  # (no skipping of all-ignored chunks: that would sync the GPU)
        part = h[start:start + chunk_size]
        if torch.is_grad_enabled() and part.requires_grad:
            total = total + checkpoint(_chunk_loss_sum, part, weight, bias, y, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(part, weight, bias, y)
    if num_items_in_batch is None:
        denom = (targets != IGNORE_INDEX).sum().clamp(min=1)
    else:
        denom = num_items_in_batch
    if isinstance(denom, torch.Tensor):
        denom = denom.to(total.device)
    return total / denom
