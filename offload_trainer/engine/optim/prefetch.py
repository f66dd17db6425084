"""The first unit's states copied to the GPU before its gradient exists, in memory that backward has freed.

Backward reaches the model's first unit (the input embedding: 525M values in Llama-3-8B) last, and the next forward
waits for its update first. Queued at its gradient hook, its chunks' states go through PCIe one after another while
the GPU has nothing else to do: 18 ms of an 8B 4 x 2048 step (bench/results/README.md, "The step's time budget").
Their copies do not depend on the gradient, only on the host states being final, so they can run earlier, while
backward still computes the last units: then the hook finds the states on the GPU and queues only the update kernels
and the copies back.

Where they are copied to: fresh GPU buffers (a chunk's two rows of codes and of scales), allocated on the compute
stream from what the allocator holds and nothing uses -- by then the activations of the units already through
backward are freed -- and never beyond the step's peak allocation so far, so the prefetch raises neither peak. A chunk
that does not fit goes through the staging slots at its hook, as without prefetching. The copies wait for the compute
stream to reach the hook: the allocator hands out a block as soon as the CPU frees it, which is safe for the stream it
was freed on only, and backward's kernels queued before the hook may still be reading it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .states import Chunk, HostStates


@dataclass
class Staged:
    """A chunk's states, copied to the GPU ahead of its update (from `bank`): what `UpdatePipeline._chunk` reads
    instead of a staging slot."""

    bank: int
    codes: Tensor  # (2, n) uint8
    scales: Tensor  # (2, n // block) fp32
    loaded: object  # event on the H2D stream: the copies are done


def cuda_room(device: torch.device) -> int:
    """Bytes a new allocation may take without the allocator reserving more from the card, nor the live tensors
    exceeding their peak since the last reset: the least of the two headrooms."""
    stats = torch.cuda.memory_stats(device)
    allocated = stats.get("allocated_bytes.all.current", 0)
    return min(stats.get("allocated_bytes.all.peak", 0), stats.get("reserved_bytes.all.current", 0)) - allocated


class StatePrefetch:
    """Stages the first unit's chunks while backward runs the `lead` units before it (units 1..lead, forward order).
    What it staged this step is in the step's plan (`StepPlan.staged`, `StepPlan.to_stage`), dropped with it.

    `reached(unit, wait_host_final)` is called at each gradient hook during backward; `take(chunk, bank)` by the
    pipeline. `room()`: the bytes that may be allocated now (`cuda_room` on CUDA; tests pass their own)."""

    def __init__(self, states: HostStates, streams, stats: dict, plan, *, lead: int, room=None):
        self.states, self.S, self.stats, self.plan, self.lead = states, streams, stats, plan, lead
        if room is None:  # (on CPU the copies are synchronous: nothing to win)
            room = (lambda: cuda_room(states.device)) if states.device.type == "cuda" else (lambda: 0)
        self.room = room
        self.targets: list[Tensor] = []  # the first unit's tensors (`attach`)

    def attach(self, first_unit: list[Tensor]) -> None:
        self.targets = list(first_unit) if self.lead > 0 else []

    def reached(self, unit: int | None, wait_host_final) -> None:
        """Backward reached `unit` (a gradient hook of one of its tensors). Within `lead` units of the first, stage
        the first unit's chunks while there is room. `wait_host_final(stream)`: makes the H2D stream wait until the
        host states are final (the last step's copies back)."""
        if not self.targets or unit is None or not 1 <= unit <= self.lead:
            return
        plan = self.plan
        if plan.to_stage is None:  # this backward's first hook within reach: what there is to stage
            plan.to_stage = [(p, c) for p in self.targets if p in self.states.offset
                             for c in self.states.host_chunks(p)]
        if not plan.to_stage:
            return
        room = self.room()
        bs, S, dev = self.states.block_size, self.S, self.states.device
        after_compute = False
        while plan.to_stage:
            p, chunk = plan.to_stage[0]
            n = chunk.end - chunk.start
            need = 2 * n + 8 * (n // bs)
            if need > room:
                return  # the next unit's hook tries again, with what backward freed since
            plan.to_stage.pop(0)
            room -= need
            bank = self.states.bank[p]  # the bank this step's update of `p` reads (committed only after it)
            codes = torch.empty(2, n, dtype=torch.uint8, device=dev)  # (on the compute stream: backward's free memory)
            scales = torch.empty(2, n // bs, dtype=torch.float32, device=dev)
            wait_host_final(S.h2d)
            if not after_compute:
                after_compute = True
                self.copies_after_compute()
            with S.on(S.h2d):
                for k in range(2):
                    codes[k].copy_(chunk.codes[bank][k], non_blocking=True)
                    scales[k].copy_(chunk.scales[bank][k], non_blocking=True)
            for stream in (S.h2d, S.update, S.d2h):  # freed on the compute stream once every use is queued
                S.keep_alive(codes, stream)
                S.keep_alive(scales, stream)
            plan.staged[chunk.flat_start] = Staged(bank, codes, scales, S.record(S.h2d))
            self.stats["h2d_bytes"] += need
            self.stats["prefetched_chunks"] += 1

    def copies_after_compute(self) -> None:
        """The H2D stream waits for the compute stream as it is now: the buffers just allocated may be memory that
        backward's kernels queued before this point still use (freed by the CPU, which runs ahead)."""
        self.S.h2d.wait_event(self.S.record(self.S.compute()))

    def take(self, chunk: Chunk, bank: int) -> Staged | None:
        """The chunk's staged states, if it was staged from `bank` (else None: it goes through a slot)."""
        staged = self.plan.staged.pop(chunk.flat_start, None)
        return staged if staged is not None and staged.bank == bank else None
