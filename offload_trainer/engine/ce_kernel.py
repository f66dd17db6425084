"""One chunk's cross-entropy and its gradient in one Triton kernel, written over the logits in place (CUDA).

The chunked loss (`loss.py`) takes each chunk's gradient with its loss. In torch ops that is five passes over the
chunk's logits in float32 (the cast, log-softmax, the loss's backward into a zeroed tensor, log-softmax's backward, the
cast back: 8B at 4 x 2048 with a 128k vocabulary, ~12 ms a step) and three chunk-sized float32 tensors at once. This
kernel reads a row of bf16 logits twice (the log-sum-exp, online; then the gradient) and writes the gradient over
them: `d = (softmax - onehot(target)) * scale`, zero on ignored rows, and the row's loss `lse - logit[target]`, all
in float32 until the final store. The arithmetic is log-softmax's, in another summation order and with the GPU's
`exp` / `log`, so values match torch's to float32 rounding and the gradients to their dtype's (tests/test_loss.py).
"""
from __future__ import annotations

import torch
from torch import Tensor

try:  # Triton ships with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["available", "loss_and_grad_"]

BLOCK = 4096  # vocabulary entries per iteration of a row


def available(logits: Tensor) -> bool:
    """Whether the kernel runs on these logits: CUDA with Triton, half or bfloat16, rows contiguous."""
    return (triton is not None and logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float16)
            and logits.dim() == 2 and logits.stride(1) == 1)


if triton is not None:

    @triton.jit
    def _ce_grad_kernel(logits_ptr, row_stride, targets_ptr, scale_ptr, loss_ptr, V, IGNORE: tl.constexpr,
                        BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * row_stride
        cols = tl.arange(0, BLOCK)
        m = tl.full((BLOCK,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, V, BLOCK):  # per lane: running max and sum of exp (online softmax)
            x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
            s = tl.where(m_new == float("-inf"), 0.0, s)
            m = m_new
        top = tl.max(m, axis=0)
        lse = top + tl.log(tl.sum(s * tl.exp(m - top), axis=0))
        target = tl.load(targets_ptr + row)
        valid = target != IGNORE
        safe = tl.where(valid, target, 0)
        x_t = tl.load(base + safe).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(valid, lse - x_t, 0.0))
        g = tl.where(valid, tl.load(scale_ptr), 0.0)
        for start in range(0, V, BLOCK):  # the gradient over the logits
            idx = start + cols
            x = tl.load(base + idx, mask=idx < V, other=0.0).to(tl.float32)
            d = tl.exp(x - lse) * g - tl.where(idx == target, g, 0.0)
            tl.store(base + idx, d.to(logits_ptr.dtype.element_ty), mask=idx < V)


def loss_and_grad_(logits: Tensor, targets: Tensor, scale: Tensor, ignore_index: int) -> Tensor:
    """Each row's cross-entropy against `targets` (0 where ignored), float32; `logits` is overwritten with the
    gradient of `scale * sum(losses)` (`scale`: a 0-dim float32 tensor on the same device)."""
    rows, vocab = logits.shape
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _ce_grad_kernel[(rows,)](logits, logits.stride(0), targets, scale, losses, vocab, IGNORE=ignore_index,
                                 BLOCK=BLOCK, num_warps=8)
    return losses
