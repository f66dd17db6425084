"""Streams, events and pinned host buffers, with a synchronous stand-in on CPU.

On CUDA the streamed optimizer runs three side streams (H2D copies, updates, D2H copies) ordered only
by events, so the CPU never blocks and the compute stream never waits except where it needs a result.
On CPU the same code runs with every stream being "now": copies and updates happen in program order.
"""
from __future__ import annotations

import contextlib
import weakref

import torch


class _NullEvent:
    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _NullStream:
    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


class Streams:
    """The compute device's streams: `h2d`, `update`, `d2h`; `compute()` is whatever is current."""

    def __init__(self, device: torch.device):
        self.device = device
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self.h2d = torch.cuda.Stream(device)
            # High priority: the next forward waits for these updates, and without priority the update kernels
            # get few SMs next to the forward's matmuls (measured 3.5x slower on 8B).
            self.update = torch.cuda.Stream(device, priority=-1)
            self.d2h = torch.cuda.Stream(device)
        else:
            self.h2d = self.update = self.d2h = _NullStream()

    def event(self):
        return torch.cuda.Event() if self.is_cuda else _NullEvent()

    def compute(self):
        return torch.cuda.current_stream(self.device) if self.is_cuda else _NullStream()

    def on(self, stream):
        return torch.cuda.stream(stream) if self.is_cuda else contextlib.nullcontext()

    def record(self, stream):
        """An event recorded now on `stream` (the point after all work queued on it so far)."""
        ev = self.event()
        if self.is_cuda:
            ev.record(stream)
        return ev

    def keep_alive(self, tensor: torch.Tensor, stream) -> None:
        """Tell the caching allocator that `stream` still uses `tensor` (freed on another stream)."""
        if self.is_cuda and tensor.is_cuda:
            tensor.record_stream(stream)

    def synchronize(self) -> None:
        if self.is_cuda:
            for s in (self.h2d, self.update, self.d2h):
                s.synchronize()


def pinned_empty(numel: int, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """A host buffer of exactly `numel` elements, page-locked when `pin`.

    NOTE: `pin_memory=True` goes through PyTorch's caching host allocator, which rounds every block up
    to a power of two (an 8 GB state buffer would take 16 GB). Registering a plain allocation with
    cudaHostRegister pins exactly what we use.
    """
    t = torch.empty(numel, dtype=dtype)
    if pin and numel > 0:
        nbytes = t.numel() * t.element_size()
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
        if int(err) != 0:  # fall back to the caching allocator rather than run unpinned (8x slower copies)
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        # The owner must keep this base tensor alive as long as any view of it is in use.
        weakref.finalize(t, torch.cuda.cudart().cudaHostUnregister, t.data_ptr())
    return t
