"""The figures a training log gets beside the Trainer's (throughput, host and GPU memory, PCIe traffic, stalls,
skipped and clipped steps) and the one greppable line per log: `step N | loss | tok/s | ...` (on a CPU, what applies
there). They go to the callbacks with the Trainer's figures and into `run.figures` (run_history.py: saved beside
trainer_state.json, never in its log history)."""
from __future__ import annotations

import logging
import time

import torch

from ..sysinfo import rss_gib, trim_host_memory
from .run_state import RunState

logger = logging.getLogger("offload_trainer")

# A training log gives the C allocator's free pages back (sysinfo.trim_host_memory, ~5 ms) at most once in this many
# optimizer steps: with `logging_steps: 1` a trim at every step cost ~1% of a 3B step, spent while the GPU waits.
TRIM_EVERY_STEPS = 10


def add_run_figures(run: RunState, logs: dict, global_step: int) -> None:
    """A training log's figures added to `logs` and kept in `run.figures`, and the one line the run logs for it."""
    figures = run_figures(run, logs, global_step)
    logs.update(figures)
    run.figures.append({"step": global_step, **figures})


def run_figures(run: RunState, logs: dict, global_step: int) -> dict:
    """The figures of a training log (`logs`: the Trainer's, with its loss), and the one line the run logs for it."""
    c = run.log
    logs = dict(logs)  # (the line reads the Trainer's figures and ours; the figures alone are returned)
    given = set(logs)
    now = time.perf_counter()
    dt = max(now - c.since - c.paused_s, 1e-9)
    c.paused_s = 0.0
    logs["tok_per_s"] = round(c.tokens / dt, 1)
    if c.trim_step is None or global_step - c.trim_step >= TRIM_EVERY_STEPS:
        trim_host_memory()
        c.trim_step = global_step
    rss = rss_gib()
    if rss is not None:
        logs["host_rss_gib"] = round(rss, 3)
    if torch.cuda.is_available():
        logs["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    movers = run.movers()
    if torch.cuda.is_available() and movers:
        moved = sum(m.stats["h2d_bytes"] + m.stats["d2h_bytes"] for m in movers)
        logs["pcie_gb_per_s"] = round((moved - c.moved_bytes) / dt / 1e9, 2)
        pinned = sum(m.memory_stats()["pinned_bytes"] for m in movers)
        logs["host_pinned_gib"] = round(pinned / 2**30, 2)
        # time the GPU's compute stream waited for a layer's weights or an update, since the last log
        stall = sum(m.stall.total_ms() for m in movers if hasattr(m, "stall"))
        logs["gpu_stall_ms"] = round(stall - c.stall_ms, 1)
        c.moved_bytes, c.stall_ms = moved, stall
    if run.nonfinite.skipped:
        logs["nonfinite_skipped"] = run.nonfinite.skipped
    _clip_figures(run, logs)
    if "gpu_peak_gib" in logs:
        logger.info("step %d | loss %.4f | %.0f tok/s | gpu peak %s GiB | pcie %s GB/s | stall %s ms",
                    global_step, logs["loss"], logs["tok_per_s"], logs["gpu_peak_gib"],
                    logs.get("pcie_gb_per_s", "-"), logs.get("gpu_stall_ms", "-"))
    else:  # (no GPU: what applies here)
        logger.info("step %d | loss %.4f | %.0f tok/s | host rss %s GiB", global_step,
                    logs["loss"], logs["tok_per_s"], logs.get("host_rss_gib", "-"))
    if "clip_rate" in logs:
        logger.info("step %d | clipped %.0f%% of %d steps | redone %d | exact %d", global_step,
                    100 * logs["clip_rate"], logs["clip_steps"], logs["redone_steps"], logs["exact_clip_steps"])
    c.tokens = 0
    c.since = now
    return {k: v for k, v in logs.items() if k not in given}


def _clip_figures(run: RunState, logs: dict) -> None:
    """Speculative clipping, over the optimizer steps since the last log: the share whose clip fired (`clip_rate`),
    how many were redone, how many clipped exactly (the policy's fallback, or accumulation with host gradients)."""
    opt = run.optimizer
    if opt is None or not opt.speculative:
        return
    now, last = opt.clip_counts, run.log.clip_counts or {}
    delta = {k: v - last.get(k, 0) for k, v in now.items()}
    run.log.clip_counts = now
    if delta["steps"]:
        logs.update(clip_rate=round(delta["clipped"] / delta["steps"], 4), clip_steps=delta["steps"],
                    redone_steps=delta["redone"], exact_clip_steps=delta["exact"])
