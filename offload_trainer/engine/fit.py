"""Layer swap's resident layers fitted to the GPU's measured peak.

The planner's resident count is a prediction of the step's peak; the step itself can be measured. `ResidencyFit`
reads the allocator over each of the first `steps` optimizer steps (its peak, what the step left allocated, whether
the allocator had to give cached memory back to find room) and moves layers onto the GPU while the measured peak
leaves room for more, within the card's free memory less a margin, or off it when the step came closer to the limit
than the margin -- the way `auto_find_batch_size` measures instead of predicting, without the retry: the first step
runs the planner's count, planned with a margin, and every later one a count measured to fit.

A step counts only when its micro-batches were as large as the plan's (a shorter batch peaks lower than the longest
the data can give). Works from a bare loop: `start_step()` before the step's first forward, `saw_batch(tokens)` per
micro-batch, `end_step()` after `optimizer.step()` (once the optimizer's queued updates have run). Imports torch only;
the allocator's figures come from a `probe` (tests give a fake).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GiB = 2**30


@dataclass(frozen=True)
class StepMemory:
    """One optimizer step as the allocator saw it (bytes)."""

    peak_reserved: int  # the most the allocator held during the step
    peak_allocated: int  # the most live tensors took
    growth: int  # allocated at the step's end less at its start: what the next step holds on top (states made)
    retries: int  # times the allocator freed its cache to satisfy an allocation (it was at the limit)
    available: int  # what this process may hold in all: the card's free memory plus its own, within any cap


class CudaProbe:
    """The figures of torch's CUDA caching allocator on `device`, within `limit_bytes` (a per-process cap)."""

    def __init__(self, device, limit_bytes: int | None = None):
        self.device, self.limit = torch.device(device), limit_bytes
        self._allocated = self._retries = 0

    def start(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)
        self._allocated = torch.cuda.memory_allocated(self.device)
        self._retries = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)

    def end(self) -> StepMemory:
        stats = torch.cuda.memory_stats(self.device)
        free, _ = torch.cuda.mem_get_info(self.device)
        available = free + torch.cuda.memory_reserved(self.device)
        return StepMemory(peak_reserved=torch.cuda.max_memory_reserved(self.device),
                          peak_allocated=torch.cuda.max_memory_allocated(self.device),
                          growth=torch.cuda.memory_allocated(self.device) - self._allocated,
                          retries=stats.get("num_alloc_retries", 0) - self._retries,
                          available=min(available, self.limit) if self.limit else available)


def margin_bytes(available: int) -> int:
    """GPU memory kept free beyond the measured peak: the larger of 0.5 GiB and 3% of what the process may hold
    (steps of one shape peak within a few MiB of each other; the margin is for what the first steps did not show)."""
    return max(GiB // 2, int(0.03 * available))


def fitted(resident: int, n_layers: int, layer_bytes: int, m: StepMemory) -> tuple[int, str]:
    """The resident count the next step should run with, given this step's memory at `resident`, and why.

    What the next step needs: this step's peak plus what it left allocated. Without allocator retries the reserved
    peak bounds it (the allocator never had to give anything back); with retries the live tensors' peak is what is
    known, and the cache is already being given back: no layer more. A layer moved on takes `layer_bytes`; one moved
    off gives them back."""
    margin = margin_bytes(m.available)
    line = m.available - margin
    live = m.peak_allocated + max(0, m.growth)
    if live > line:
        off = min(resident, math.ceil((live - line) / layer_bytes))
        return resident - off, (f"live tensors peaked at {live / GiB:.1f} GiB, within {margin / GiB:.1f} GiB of the "
                                f"{m.available / GiB:.1f} GiB the GPU gives this process")
    if m.retries:
        return resident, (f"the allocator gave cached memory back {m.retries} times to find room (live tensors "
                          f"{live / GiB:.1f} GiB of {m.available / GiB:.1f})")
    need = m.peak_reserved + max(0, m.growth)
    on = min(n_layers - resident, max(0, (line - need) // layer_bytes))
    return resident + on, (f"peaked at {need / GiB:.1f} GiB reserved of the {m.available / GiB:.1f} GiB the GPU gives "
                           f"this process, {margin / GiB:.1f} GiB kept free")


class ResidencyFit:
    """Fit `swap`'s resident layers over the first `steps` full-size optimizer steps (see the module docstring).
    `full_tokens`: a micro-batch's tokens at the plan's batch and sequence length. `layer_bytes`: what moving one
    layer changes (default: the swap's largest layer). `say(line)` gets each decision."""

    def __init__(self, swap, full_tokens: int, *, layer_bytes: int | None = None, steps: int = 3, probe=None,
                 say=print):
        self.swap, self.full_tokens, self.steps = swap, full_tokens, steps
        self.layer_bytes = swap.layer_bytes if layer_bytes is None else layer_bytes
        self.probe = probe if probe is not None else CudaProbe(swap.device)
        self.say = say
        self.measured = 0  # full-size steps measured so far
        self.shrunk = False  # once layers moved off, none move on again (no oscillation)
        self._largest = 0
        self._step = 0

    @property
    def done(self) -> bool:
        return self.measured >= self.steps

    def start_step(self) -> None:
        if not self.done:
            self._largest = 0
            self.probe.start()

    def saw_batch(self, tokens: int) -> None:
        self._largest = max(self._largest, tokens)

    def end_step(self, before_move=None) -> int:
        """After the step: the resident count for the next one (moved there). `before_move()` runs first when layers
        move (e.g. the optimizer's `synchronize()`: no queued update may touch a layer while it moves)."""
        self._step += 1
        resident = self.swap.resident
        if self.done:
            return resident
        m = self.probe.end()
        if self._largest < self.full_tokens:
            self.say(f"layer swap: step {self._step} had {self._largest} tokens per micro-batch, fewer than the plan's "
                     f"{self.full_tokens}: not measured")
            return resident
        self.measured += 1
        new, why = fitted(resident, self.swap.n_layers, self.layer_bytes, m)
        if new > resident and self.shrunk:
            new = resident
        if new == resident:
            self.say(f"layer swap: step {self._step} {why}: {resident} of {self.swap.n_layers} decoder layers stay on "
                     f"the GPU")
            return resident
        if before_move is not None:
            before_move()
        self.swap.set_resident(new)
        self.shrunk = self.shrunk or new < resident
        self.say(f"layer swap: step {self._step} {why}: {resident} -> {new} of {self.swap.n_layers} decoder layers "
                 f"on the GPU ({(new - resident) * self.layer_bytes / GiB:+.2f} GiB)")
        return new
