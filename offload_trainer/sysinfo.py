"""Host memory figures from /proc (Linux), and the current GPU's as a planner budget; None where unavailable."""
from __future__ import annotations


def proc_gib(path: str, key: str) -> float | None:
    """A kB field of a /proc file in GiB, e.g. proc_gib("/proc/self/status", "VmRSS")."""
    try:
        with open(path) as f:
            return next(int(line.split()[1]) / 2**20 for line in f if line.startswith(key + ":"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def host_available_gib() -> float | None:
    """The host memory this process may grow to: what the machine has available (MemAvailable: free memory and the
    page cache it can reclaim) plus what the process holds already."""
    available = proc_gib("/proc/meminfo", "MemAvailable")
    return None if available is None else available + (rss_gib() or 0.0)


def rss_gib() -> float | None:
    return proc_gib("/proc/self/status", "VmRSS")


def peak_rss_gib() -> float | None:
    return proc_gib("/proc/self/status", "VmHWM")


# Memory outside PyTorch's allocator that appears after the plan, once training starts: cuBLAS / cuBLASLt
# workspaces and the kernel modules of Triton, bitsandbytes and cuDNN as they load. The free memory read at the plan
# already excludes the CUDA context made to read it, but not these. On a held 24 GB H200 (hold_gpu_memory 23.5) the
# 90B-Vision QLoRA had 0.84 GiB outside the allocator when it ran out, where the bare context is ~0.5 GiB.
LATER_LIBRARIES_GIB = 0.4


def gpu_budget_gib(context_gib: float) -> float | None:
    """The current CUDA device as a planner budget (GiB): its free memory plus what this process's allocator already
    holds (the model, when it is on the GPU), less what libraries will take once training starts
    (`LATER_LIBRARIES_GIB`), plus `context_gib`, the CUDA context the planner takes off again (already out of the free
    figure). None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info()
    return (free + torch.cuda.memory_reserved()) / 2**30 + context_gib - LATER_LIBRARIES_GIB


def trim_host_memory() -> None:
    """Give the C allocator's free pages back to the OS (glibc `malloc_trim`; elsewhere nothing).

    Every step frees and reallocates the same host buffers (batches, small tensors); glibc keeps freed pages in
    its arenas, so RSS drifts by a few percent with no leak behind it. Trimmed at each log, RSS is live memory.
    """
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        pass
