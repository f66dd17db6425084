"""A few device values read on the host without the copy engine.

`tensor.tolist()` copies device -> host with cudaMemcpy, which queues behind every copy already waiting in the same
direction on the copy engine: the streamed optimizer keeps gigabytes of 8-bit states (and backups) flowing back to
the host, and a profiled 8B step showed a one-value read waiting 266 ms behind them, the GPU idle. The read of the
global gradient norm at the end of backward, which runs while the last states are copied back, goes this way.
Here a one-block Triton kernel on the current stream stores the values into pinned host memory (reachable from the
GPU through unified addressing), and the CPU waits on an event after it: it waits for the stream's own work only.
Where Triton cannot run (a CPU, no Triton) it is `tolist()`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import kernel

if kernel.triton is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def _store_kernel(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask).to(tl.float32), mask=mask)

_BLOCK = 16
_buffers: dict[int, Tensor] = {}  # device index -> pinned float32 landing buffer
_broken: set[int] = set()  # devices where the kernel could not reach host memory: tolist() there


def read_floats(values: Tensor) -> list[float]:
    """The values of a small 1-D device tensor (at most 16), as Python floats, once the current stream computed
    them."""
    dev = values.device
    if dev.type != "cuda" or not kernel.runnable(dev) or values.numel() > _BLOCK or dev.index in _broken:
        return values.float().tolist()
    buf = _buffers.get(dev.index)
    if buf is None:
        buf = _buffers[dev.index] = torch.empty(_BLOCK, dtype=torch.float32, pin_memory=True)
    try:
        _store_kernel[(1,)](values.contiguous(), buf, values.numel(), BLOCK=_BLOCK)
    except (ValueError, RuntimeError):  # (a driver that does not map pinned memory for kernels)
        _broken.add(dev.index)
        return values.float().tolist()
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return buf[: values.numel()].tolist()
