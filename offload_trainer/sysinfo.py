"""Host memory figures from /proc (Linux); None where unavailable."""
from __future__ import annotations


def proc_gib(path: str, key: str) -> float | None:
    """A kB field of a /proc file in GiB, e.g. proc_gib("/proc/self/status", "VmRSS")."""
    try:
        with open(path) as f:
            return next(int(line.split()[1]) / 2**20 for line in f if line.startswith(key + ":"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def host_memory_gib() -> float | None:
    return proc_gib("/proc/meminfo", "MemTotal")


def rss_gib() -> float | None:
    return proc_gib("/proc/self/status", "VmRSS")


def peak_rss_gib() -> float | None:
    return proc_gib("/proc/self/status", "VmHWM")
