"""Data parallel with the offloaded optimizer states sharded over ranks (ZeRO-1 over CPU memory).

Each trainable tensor has one owner rank, chosen so that every rank holds about the same number of
state values. During backward, as each gradient is ready, it is reduced (averaged) onto its owner only;
the owner streams that tensor's 8-bit states from its own pinned memory, updates it on its GPU, then
broadcasts the new weights to the other ranks. So a node's pinned state memory is the same as one GPU's
(each rank pins only its share), no rank ever holds the full gradient set, and the weights stay
replicated as the next forward needs them.

Two communicators keep the traffic apart: gradients travel on one, weights on the other, so a broadcast
that waits for its owner's update never holds back the reductions queued behind it. Collectives are
issued in the same order on every rank because the same backward fires the same hooks in the same order.
Imports torch only; works with NCCL (GPUs) and gloo (CPU, used by the tests).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Sharding", "assign_owners"]


def assign_owners(numels: list[int], world_size: int) -> list[int]:
    """Owner rank of each tensor: largest first, each to the rank holding the fewest values so far (so the
    ranks differ by less than the largest tensor, and usually by far less: an embedding is placed first).

    Deterministic (ties go to the earlier tensor and the lowest rank): every rank computes the same map.
    """
    load = [0] * world_size
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(world_size), key=lambda k: (load[k], k))
        owners[i] = r
        load[r] += numels[i]
    return owners


class Sharding:
    """The ranks of a process group and the collectives the streamed optimizer needs.

    Create it on every rank at the same point (it creates two communicators, a collective call).
    `group=None` uses all ranks of the default process group.
    """

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("Sharding needs torch.distributed initialised (torchrun / accelerate launch)")
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self.rank = dist.get_rank(group)
        self.world_size = len(ranks)
        self._global = ranks  # group rank -> global rank (what src= / dst= take)
        self.backend = dist.get_backend(group)
        # NOTE: dedicated communicators: the Trainer's own collectives (loss gathering) stay on the default one,
        # and a weight broadcast waiting for an update does not block the gradient reductions behind it.
        self.grad_group = dist.new_group(ranks)
        self.weight_group = dist.new_group(ranks)
        self.stats = {"reduce_bytes": 0, "broadcast_bytes": 0}

    def owners(self, params: list[Tensor]) -> dict[Tensor, int]:
        return dict(zip(params, assign_owners([p.numel() for p in params], self.world_size)))

    def reduce_mean(self, grad: Tensor, owner: int):
        """Queue the mean of `grad` over ranks into the owner's `grad` (others' are left unspecified).
        Returns the async work: `work.wait()` makes the current stream wait for it."""
        self.stats["reduce_bytes"] += grad.numel() * grad.element_size()
        if self.backend == "nccl":
            return dist.reduce(grad, dst=self._global[owner], op=dist.ReduceOp.AVG, group=self.grad_group,
                               async_op=True)
        grad.div_(self.world_size)  # gloo has no AVG: divide first, as DistributedDataParallel does
        return dist.reduce(grad, dst=self._global[owner], op=dist.ReduceOp.SUM, group=self.grad_group,
                           async_op=True)

    def broadcast(self, t: Tensor, owner: int):
        """Queue the owner's `t` into every rank's `t`. Returns the async work."""
        self.stats["broadcast_bytes"] += t.numel() * t.element_size()
        return dist.broadcast(t, src=self._global[owner], group=self.weight_group, async_op=True)

    def sum(self, t: Tensor) -> Tensor:
        """In-place sum over ranks (on the gradient communicator: after every reduction queued before it)."""
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.grad_group)
        return t

    def all_true(self, flag: bool, device: torch.device) -> bool:
        """True on every rank iff `flag` is true on every rank (one small collective)."""
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.grad_group)
        return bool(t.item())
