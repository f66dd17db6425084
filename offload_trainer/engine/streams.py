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

    def query(self) -> bool:
        return True


class _NullStream:
    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _OnStream:
    """`torch.cuda.stream(s)` for a stream of the current device, without its generic device handling: a few C
    calls instead of ~10 us of Python per switch (the streamed optimizer switches streams several times per
    tensor, from backward hooks, on the thread that also launches backward's kernels)."""

    __slots__ = ("_ids", "_prev")

    def __init__(self, ids: tuple):
        self._ids = ids

    def __enter__(self):
        self._prev = torch._C._cuda_getCurrentStream(self._ids[1])
        if self._prev != self._ids:
            _set_stream(self._ids)

    def __exit__(self, *exc):
        if self._prev != self._ids:
            _set_stream(self._prev)


def _set_stream(ids: tuple) -> None:
    torch._C._cuda_setStream(stream_id=ids[0], device_index=ids[1], device_type=ids[2])


def _ids(stream) -> tuple:
    return (stream.stream_id, stream.device_index, stream.device_type)


class Streams:
    """The compute device's streams: `h2d`, `update`, `d2h`; `compute()` is whatever is current."""

    def __init__(self, device: torch.device, *, update_stream: bool = True, comm_streams: bool = False):
        self.device = device
        self.is_cuda = device.type == "cuda"
        # Data parallel (distributed.py): two streams that only wait for collectives -- gradient reductions
        # (`reduced`) and weight broadcasts (`published`) -- so their events mark exactly when each landed.
        self.reduced = self.published = None
        if self.is_cuda:
            if comm_streams:
                self.reduced, self.published = torch.cuda.Stream(device), torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)
            # High priority: the next forward waits for these updates, and without priority the update kernels
            # get few SMs next to the forward's matmuls (measured 3.5x slower on 8B).
            self.update = torch.cuda.Stream(device, priority=-1) if update_stream else None
            self.d2h = torch.cuda.Stream(device)
            self._index = self.h2d.device_index
            self._known = {}  # (stream id, device, type) -> Stream: the compute streams seen
        else:
            self.h2d = self.update = self.d2h = _NullStream()
            if comm_streams:
                self.reduced = self.published = _NullStream()

    def event(self):
        return torch.cuda.Event() if self.is_cuda else _NullEvent()

    def compute(self):
        if not self.is_cuda:
            return _NullStream()
        ids = torch._C._cuda_getCurrentStream(self._index)
        stream = self._known.get(ids)
        if stream is None:
            stream = self._known[ids] = torch.cuda.Stream(stream_id=ids[0], device_index=ids[1], device_type=ids[2])
        return stream

    def on(self, stream):
        if not self.is_cuda:
            return contextlib.nullcontext()
        if torch._C._cuda_getDevice() != self._index:  # another device is current: the generic context
            return torch.cuda.stream(stream)
        return _OnStream(_ids(stream))

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
            for s in (self.h2d, self.update, self.d2h, self.reduced, self.published):
                if s is not None:
                    s.synchronize()


class StallMeter:
    """Time the compute stream spends waiting for side-stream work (a layer's weights, an update).

    `wait(stream, event)` makes `stream` wait for `event`; if the event has not completed when the wait is
    queued, two timing events around the wait measure how long the stream actually sat there.
    """

    def __init__(self, streams: Streams):
        self._streams = streams
        self._pending: list = []
        self._ms = 0.0

    def wait(self, stream, event) -> None:
        if event is None:
            return
        if not self._streams.is_cuda or event.query():
            stream.wait_event(event)
            return
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(event)
        after.record(stream)
        self._pending.append((before, after))

    def total_ms(self) -> float:
        """Stall time so far (waits whose end the GPU has not reached yet are counted later)."""
        still = []
        for before, after in self._pending:
            if after.query():
                self._ms += before.elapsed_time(after)
            else:
                still.append((before, after))
        self._pending = still
        return self._ms


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
