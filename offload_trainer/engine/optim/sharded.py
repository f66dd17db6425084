"""Data parallel (ZeRO-1 over CPU memory): each rank keeps and updates only the states of the tensors it owns;
gradients are averaged onto their owner as they are ready, and the owner broadcasts the updated weights."""
from __future__ import annotations

import torch
from torch import Tensor

from ..distributed import Sharding
from .pipeline import StepPlan


class ShardedUpdates:
    """`owner[p]`: the rank that keeps `p`'s states. `dev_sum[p]`: on the owner, the sum of earlier micro-batches'
    means of a small tensor (big ones sum on the host, grads.py)."""

    def __init__(self, shard: Sharding, params: list[Tensor], streams, plan: StepPlan, schedule, device):
        self.shard, self.S, self.plan, self.schedule, self.device = shard, streams, plan, schedule, device
        self.owner = shard.owners(params)
        self.dev_sum: dict[Tensor, Tensor] = {}
        self.residency = None  # (set with the optimizer's, see StreamedAdamW8bit.set_residency)

    def owns(self, p: Tensor) -> bool:
        return self.owner[p] == self.shard.rank

    def reduce(self, p: Tensor, final: bool = True):
        """Queue the mean over ranks of `p.grad` onto `p`'s owner. On the owner: returns the event after which
        `p.grad` holds it; elsewhere the gradient is dropped and None returned. `final`: the step's last reduction
        of `p` (recorded for the updates and the norm)."""
        S, grad, owner = self.S, p.grad, self.owner[p]
        work = self.shard.reduce_mean(grad, owner)  # NCCL starts after the compute stream's work so far
        if final:
            self.plan.reduced.append(p)
        with S.on(S.reduced):
            work.wait()  # the stream waits, not the CPU (gloo: the CPU waits)
            S.keep_alive(grad, S.reduced)  # not reused by the allocator before the reduction has read it
        if owner != self.shard.rank:
            p.grad = None
            return None
        return S.record(S.reduced)

    def publish(self, p: Tensor, residency) -> None:
        """`p`'s update is queued: broadcast it from its owner (every rank calls this for every reduced tensor, in
        the same order); then mark its unit's next forward ready.

        The broadcast waits for the owner's update stream, and on a non-owner for the compute stream as it is now
        (at the gradient hook, or in `step()` after backward): kernels of this backward that still read `p` (e.g.
        the input gradient of its layer) are queued before it, so they read the old weights."""
        S = self.S
        with residency(p, S.published):  # a swapped layer: receive into (or send from) its GPU slot
            S.published.wait_stream(S.update if self.owns(p) else S.compute())
            with S.on(S.published):
                self.shard.broadcast(p.detach(), self.owner[p]).wait()
        self.schedule.unit_done(p, S.published)

    def reduce_micro_batch(self, p: Tensor, host_grads, on_host: bool) -> None:
        """A micro-batch before the last (with `offload_gradients`): average `p.grad` onto its owner now, as ZeRO-2
        does, so that no rank keeps a gradient set between micro-batches; the owner adds the mean to its running
        sum (pinned host memory for big tensors, the device for small ones). The sum of the means is the mean of
        the sums, associated differently (equal to rounding)."""
        ready = self.reduce(p, final=False)
        if ready is None:  # not ours: dropped
            return
        if on_host:
            host_grads.stash(p, ready)
            return
        S, grad = self.S, p.grad
        with S.on(S.reduced):
            prev = self.dev_sum.get(p)
            self.dev_sum[p] = grad if prev is None else prev.add_(grad)
        S.keep_alive(grad, S.reduced)
        p.grad = None

    def add_sums(self, p: Tensor, ready, host_grads, on_host: bool):
        """The owner's gradient after its last reduction: + the sum of earlier micro-batches' means, if any."""
        if on_host:
            return host_grads.add_sum(p, ready)
        prev = self.dev_sum.pop(p, None)
        if prev is None:
            return ready
        S = self.S
        with S.on(S.reduced):
            p.grad = prev.add_(p.grad)  # (on the stream where both were made)
        return S.record(S.reduced)

    def gather_norms(self, own: dict, order: list[Tensor]) -> dict:
        """Every rank gets every reduced tensor's norm (each owner measured its own), in model order, so the
        global norm is computed from the same values in the same order as on one GPU: the same bits."""
        reduced = set(self.plan.reduced)
        ordered = [p for p in order if p in reduced]
        if not ordered:
            return {}
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        vec = torch.stack([own[p].float() if p in own else zero for p in ordered])
        vec = self.shard.sum(vec)  # one value per tensor, the others' zeros: the sum is exact
        return {p: vec[i].to(own[p].dtype if p in own else p.dtype) for i, p in enumerate(ordered)}

    @torch.no_grad()
    def sync_weights(self, params: list[Tensor], src: int, is_cuda: bool) -> None:
        """Make every rank's trainable weights rank `src`'s (as DistributedDataParallel does at construction).
        Swapped layers' host copies go through a GPU buffer."""
        for p in params:
            t = p.detach()
            staged = t.to(self.device) if t.device != self.device else t
            self.shard.broadcast(staged, src).wait()
            if staged is not t:
                t.copy_(staged)
        if is_cuda:
            torch.cuda.current_stream(self.device).synchronize()
