"""Chunked LM-head + cross-entropy: the full (tokens x vocab) logits tensor is never materialised.

Training (gradients wanted): each chunk's gradients are computed in the forward pass with its loss and handed to
autograd by the backward, so nothing is recomputed (a checkpointed chunk runs its head matmul, cast and softmax
twice: 8B at 4 x 2048 with a 128k vocabulary, ~19 ms of a 1.05 s step). On CUDA one Triton kernel (`ce_kernel`)
turns a chunk's bf16 logits into their gradient in place: the chunk's logits are the only chunk-sized tensor. The
head's weight gradient is accumulated in its own dtype (one rounding per chunk; autograd's sum of per-chunk
gradients rounds twice) and lives from the loss to the start of backward, which is when autograd would build it.
Where the head's weight, the hidden states and autocast's dtype differ, each chunk runs under activation
checkpointing instead (recomputed in backward). Without gradients: the loss only.
At 4 x 2048 tokens and a 128k vocabulary, full fp32 logits are 3.9 GiB; 1024-token chunks of bf16 logits 0.25 GiB.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..settings import LOSS_CHUNK
from . import ce_kernel

IGNORE_INDEX = -100
_SUM = 2  # (aten's reduction enum: none, mean, sum)


def _chunk_loss_sum(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    logits = F.linear(h, weight, bias).float()
    return F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")


class _LossAndGrads(torch.autograd.Function):
    """The chunks' summed cross-entropy over `denom`, with its gradients for a unit gradient of that mean computed
    in forward (each chunk's sum gets 1 / denom, as DivBackward passes it) -- on CUDA by `ce_kernel`, over the
    logits in place, elsewhere by the aten kernels autograd runs for `_chunk_loss_sum` -- and scaled by the incoming
    gradient in backward (exact for the usual 1)."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, denom, chunk_size):
        need_h, need_w = h.requires_grad, weight.requires_grad
        need_b = bias is not None and bias.requires_grad
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b else None
        total = h.new_zeros((), dtype=torch.float32)
        scale = torch.ones((), dtype=torch.float32, device=h.device) / denom
        for start in range(0, h.shape[0], chunk_size):
            part, y = h[start:start + chunk_size], targets[start:start + chunk_size]
            d_logits = F.linear(part, weight, bias)  # (the logits, then their gradient)
            if ce_kernel.available(d_logits):
                loss = ce_kernel.loss_and_grad_(d_logits, y, scale, IGNORE_INDEX).sum()
            else:
                loss, d_logits = _loss_and_grad(d_logits, y, scale)
            total += loss
            if need_h:
                torch.mm(d_logits, weight, out=grad_h[start:start + chunk_size])
            if need_w:
                grad_w.addmm_(d_logits.t(), part)
            if need_b:
                grad_b += d_logits.sum(0)
            del d_logits  # (before the next chunk's logits)
        ctx.grads = (grad_h, grad_w, grad_b)  # (not saved tensors: they are outputs of this pass, not its inputs)
        return total / denom

    @staticmethod
    def backward(ctx, grad_total):
        grads, ctx.grads = ctx.grads, None
        if grads is None:  # (handed over by an earlier backward through the same loss)
            raise RuntimeError("a second backward through the chunked loss (retain_graph=True): its gradients were "
                               "computed once, with the loss, and the first backward took them. Set "
                               "loss_chunk_size: 0 (the model's own loss) to backward through it more than once.")
        return (*(None if g is None else g.mul_(grad_total) for g in grads), None, None, None)


def _loss_and_grad(logits: torch.Tensor, y: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's summed loss and its gradient (for `scale` times the sum) in the logits' dtype, by the aten kernels
    autograd runs for `_chunk_loss_sum` (where the Triton kernel does not run)."""
    logp = torch.log_softmax(logits.float(), -1)
    loss, count = torch.ops.aten.nll_loss_forward(logp, y, None, _SUM, IGNORE_INDEX)
    d_logp = torch.ops.aten.nll_loss_backward(scale, logp, y, None, _SUM, IGNORE_INDEX, count)
    d_logits = torch.ops.aten._log_softmax_backward_data(d_logp, logp, -1, torch.float32)
    del logp, d_logp  # (before the cast: one chunk's float32 tensors at a time, at most three)
    return loss, d_logits.to(logits.dtype)


def _fused(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the chunks' gradients can be computed with their loss: the head's tensors share one dtype that
    autocast (if on) would not change."""
    dtypes = {h.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
    device = h.device.type
    if torch.is_autocast_enabled(device):
        dtypes.add(torch.get_autocast_dtype(device))
    return len(dtypes) == 1


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
    if num_items_in_batch is None:
        denom = (targets != IGNORE_INDEX).sum().clamp(min=1)
    else:
        denom = num_items_in_batch
    if isinstance(denom, torch.Tensor):
        denom = denom.to(h.device)
    wants_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (h, weight, bias))
    if wants_grad and _fused(h, weight, bias):
        return _LossAndGrads.apply(h, weight, bias, targets, denom, chunk_size)
    return _checkpointed_sum(h, weight, bias, targets, chunk_size, wants_grad) / denom


def _checkpointed_sum(h, weight, bias, targets, chunk_size: int, wants_grad: bool) -> torch.Tensor:
    """The chunks' summed cross-entropy, each chunk checkpointed where gradients are wanted (recomputed in
    backward)."""
    total = h.new_zeros((), dtype=torch.float32)
    for start in range(0, h.shape[0], chunk_size):
        y = targets[start:start + chunk_size]  # (no skipping of all-ignored chunks: that would sync the GPU)
        part = h[start:start + chunk_size]
        if wants_grad:
            total = total + checkpoint(_chunk_loss_sum, part, weight, bias, y, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(part, weight, bias, y)
    return total
