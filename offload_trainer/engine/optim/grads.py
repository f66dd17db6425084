"""Gradients that must wait -- for the global norm (clipping) or for the next micro-batch (accumulation) -- in pinned
host memory (`offload_gradients`): copied out during backward on the D2H stream, summed on the GPU as each
micro-batch's gradient is made (on the H2D stream: the compute stream never waits), and brought back when needed."""
from __future__ import annotations

import torch
from torch import Tensor

from .pipeline import Backlog, StepPlan
from .states import HostStates


class HostGradients:
    """`sums[p]`: the event after which `p`'s running sum of earlier micro-batches has landed in the host buffer."""

    def __init__(self, states: HostStates, streams, stats: dict, plan: StepPlan, backlog: Backlog):
        self.states, self.S, self.stats, self.plan, self.backlog = states, streams, stats, plan, backlog
        self.sums: dict[Tensor, object] = {}
        self.prev_h2d_done = None  # event: the last step's host gradients were read (the buffer may be reused)

    def offload(self, p: Tensor, grad_ready, held: int | None = None):
        """Queue the copy of `p.grad` into its slice of the pinned host buffer; frees it. Returns the event.
        `held`: GPU bytes that wait for the copy (default: the gradient's)."""
        S = self.S
        S.d2h.wait_event(grad_ready)
        if self.prev_h2d_done is not None:  # the host buffer still holds last step's grads until read
            S.d2h.wait_event(self.prev_h2d_done)
            self.prev_h2d_done = None
        off, n = self.states.offset[p], p.numel()
        with S.on(S.d2h):
            self.states.host_grads[off:off + n].copy_(p.grad.view(-1), non_blocking=True)
        S.keep_alive(p.grad, S.d2h)
        nbytes = n * p.grad.element_size()
        self.stats["d2h_bytes"] += nbytes
        p.grad = None
        landed = S.record(S.d2h)
        self.backlog.hold(landed, nbytes if held is None else held)
        return landed

    def stash(self, p: Tensor, grad_ready=None) -> None:
        """A micro-batch before the last: add `p.grad` to its running sum in pinned host memory, free it."""
        S = self.S
        held = p.grad.numel() * p.grad.element_size() * (2 if p in self.sums else 1)  # + the sum's H2D copy
        ready = self.add_sum(p, grad_ready if grad_ready is not None else S.record(S.compute()))
        self.sums[p] = self.offload(p, ready, held)

    def add_sum(self, p: Tensor, grad_ready):
        """If earlier micro-batches left a sum of `p`'s gradients on the host, `p.grad` becomes that sum plus
        `p.grad`, computed on the H2D stream (the compute stream never waits for it). Returns the event after
        which `p.grad` is final. The addition is autograd's own (old + new, in the gradient's dtype): the
        same bits as accumulating on the device."""
        host_ready = self.sums.pop(p, None)
        if host_ready is None:
            return grad_ready
        S, grad = self.S, p.grad
        total = self.to_device(p, host_ready)
        S.h2d.wait_event(grad_ready)
        with S.on(S.h2d):
            total.add_(grad)
        S.keep_alive(grad, S.h2d)
        p.grad = total
        self.plan.merged_params.add(p)
        self.plan.merged = S.record(S.h2d)
        return self.plan.merged

    def to_device(self, p: Tensor, host_ready) -> Tensor:
        """A new device tensor holding `p`'s gradient sum from the host, copied on the H2D stream once `host_ready`
        (its last copy out) has passed. The compute stream may scale it in place later (clipping)."""
        S, off, n = self.S, self.states.offset[p], p.numel()
        S.h2d.wait_event(host_ready)
        with S.on(S.h2d):
            total = torch.empty(p.shape, dtype=self.states.host_grads.dtype, device=self.states.device)
            total.view(-1).copy_(self.states.host_grads[off:off + n], non_blocking=True)
        S.keep_alive(total, S.compute())
        self.stats["h2d_bytes"] += n * total.element_size()
        return total

    def flush(self) -> None:
        """After backward: a tensor that got no gradient in the last micro-batch still has its sum on the host.
        Bring it back as its gradient (the compute stream waits for every host sum added this step)."""
        S = self.S
        for p, host_ready in list(self.sums.items()):
            self.sums.pop(p)
            p.grad = self.to_device(p, host_ready)
            self.plan.merged = S.record(S.h2d)
        if self.plan.merged is not None:
            S.compute().wait_event(self.plan.merged)
