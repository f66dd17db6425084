"""The helpers every benchmark row shares: the machine, the planner's prediction, peaks and where the row goes,
a profiled step's summary and trace, the allocator's counters, layer swap's figures (step_bench.py, trainer_bench.py,
qlora_bench.py, load_bench.py, fire_rate.py, integrations.py: the scripts of this folder, which import it by name,
Python putting a script's folder first on its path)."""
from __future__ import annotations

import json
import os
import time

import torch

from offload_trainer.sysinfo import peak_rss_gib


def gpu_idle_ms(step_fn, trace: str | None = None, steps: int = 1) -> dict:
    """Profile one step: time the compute stream sat idle (wall time minus the union of its kernels).
    `trace`: also write the step's events, compactly, to this gzipped JSON file (read by bench/analysis/trace_gaps.py).
    `steps` > 1: profile that many steps back to back, as `window` runs them (the loss read after each, one device
    sync at the end), so what one step overlaps with the next shows; figures are per step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = step_fn()
            if steps > 1:
                loss.item()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    return {**profile_summary(prof, wall, steps, trace), **({"trace": trace} if trace else {})}


def profile_summary(prof, wall: float, steps: int = 1, trace: str | None = None) -> dict:
    """What `gpu_idle_ms` reports, from a finished `torch.profiler.profile` of `steps` steps that took `wall` seconds
    each: the compute stream's idle time (wall minus the union of its kernels), each stream's busy time, the top CPU
    ops; `trace`: the events, written for bench/analysis/trace_gaps.py."""
    from torch.autograd import DeviceType

    events = list(prof.profiler.kineto_results.events())
    by_stream: dict[int, list[tuple[int, int]]] = {}
    kernels: dict[int, int] = {}
    for e in events:
        if e.device_type() == DeviceType.CUDA and e.duration_ns() > 0:
            sid = e.device_resource_id()
            by_stream.setdefault(sid, []).append((e.start_ns(), e.start_ns() + e.duration_ns()))
            kernels[sid] = kernels.get(sid, 0) + (_activity(e) == "kernel")

    def union(iv):
        iv.sort()
        total, cur_s, cur_e = 0, None, None
        for s, e in iv:
            if cur_e is None or s > cur_e:
                total += (cur_e - cur_s) if cur_e is not None else 0
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        return total + ((cur_e - cur_s) if cur_e is not None else 0)

    busy = {sid: union(iv) / 1e6 / steps for sid, iv in by_stream.items()}
    # the compute stream launches the most kernels (the busiest stream can be a copy stream on small batches)
    main = max(kernels, key=kernels.get) if kernels else None
    if trace:
        write_trace(events, trace)
    top = sorted(prof.key_averages(), key=lambda k: k.self_cpu_time_total, reverse=True)[:10]
    return {"top_self_cpu_ms": {k.key[:60]: [k.count, round(k.self_cpu_time_total / 1e3, 1)] for k in top},
            **({"profiled_steps": steps} if steps > 1 else {}),
            "profiled_step_ms": round(wall * 1e3, 1),
            "compute_stream": main,
            "compute_stream_busy_ms": round(busy.get(main, 0.0), 1),
            "gpu_idle_ms": round(wall * 1e3 - busy.get(main, 0.0), 1) if main is not None else None,
            "stream_busy_ms": {str(k): round(v, 1) for k, v in busy.items()}}


def _activity(e) -> str:
    """kineto's activity type (`kernel`, `gpu_memcpy`, `cuda_runtime`, `cpu_op`, `gpu_user_annotation`...); told from
    the device and name where torch does not expose it (2.11: bench/analysis/trace_gaps.py tells annotations by
    name)."""
    if hasattr(e, "activity_type"):
        return str(e.activity_type())
    if getattr(e, "is_user_annotation", lambda: False)() and e.device_type() != torch.autograd.DeviceType.CPU:
        return "gpu_user_annotation"
    from torch.autograd import DeviceType

    name = e.name()
    if e.device_type() == DeviceType.CUDA:
        return "gpu_memcpy" if name.startswith("Memcpy") else "gpu_memset" if name.startswith("Memset") else "kernel"
    return "cuda_runtime" if name.startswith("cu") and "::" not in name else "cpu_op"


def write_trace(events, path: str) -> None:
    """The profiled step's events as gzipped JSON: names once, then one row per event
    [name index, activity type index, stream or thread id, start us, duration us, correlation id]."""
    import gzip

    names: dict[str, int] = {}
    kinds: dict[str, int] = {}
    rows = []
    t0 = min((e.start_ns() for e in events), default=0)
    for e in events:
        name, kind = e.name()[:300], _activity(e)  # (templated kernel names: their functor can be far in)
        rows.append([names.setdefault(name, len(names)), kinds.setdefault(kind, len(kinds)), e.device_resource_id(),
                     round((e.start_ns() - t0) / 1e3, 2), round(e.duration_ns() / 1e3, 2), e.correlation_id()])
    with gzip.open(path, "wt") as f:
        json.dump({"names": list(names), "kinds": list(kinds), "events": rows}, f)


def timed(step) -> tuple[float, float, float]:
    """Seconds of one synchronized step, its loss, and the seconds until the CPU had queued it all."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    loss = step()
    queued = time.perf_counter() - t
    torch.cuda.synchronize()
    return time.perf_counter() - t, round(loss.item(), 4), queued


def machine() -> str:
    """The row's `machine`: the GPU and how many, and the CPU cores."""
    if not torch.cuda.is_available():
        return f"CPU, {os.cpu_count()} cores"
    return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, {os.cpu_count()} cores"


def predicted(p) -> dict:
    """The row's `predicted`: a plan's GPU peak, host peak and step time (make_table compares them with the row's)."""
    return dict(gpu_peak_gib=round(p.gpu_peak_gib, 2), host_peak_gib=round(p.host_peak_gib, 2),
                step_s=round(p.step_s, 3), fits=True, host_budget_gib=p.host_budget_gib,
                host_breakdown={k: round(v, 2) for k, v in p.host_breakdown.items()},
                speculative_clipping=p.speculative_clipping)


def cprofile_top(pr, top: int = 25, by: str = "own") -> dict:
    """A finished cProfile.Profile's functions with the most own (`by="own"`) or cumulative (`"total"`) CPU time:
    {"file:line name": [calls, own ms, total ms]}."""
    import pstats

    stats = pstats.Stats(pr).stats
    rows = sorted(stats.items(), key=lambda kv: kv[1][2 if by == "own" else 3], reverse=True)[:top]
    return {f"{os.path.basename(f)}:{line} {name}"[:80]: [calls, round(tt * 1e3, 1), round(ct * 1e3, 1)]
            for (f, line, name), (_, calls, tt, ct, _) in rows}


def allocator_counts() -> dict:
    """The caching allocator's event counters (cumulative since the process started)."""
    st = torch.cuda.memory_stats()
    return {k: int(st.get(k, 0)) for k in ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc",
                                            "num_device_free", "num_ooms")}


def swap_extra(swap, before: dict, stall_before: float) -> dict:
    """What the layer swap did since `before` (its stats then) and `stall_before` (its stall ms then)."""
    moved = {k: swap.stats[k] - before[k] for k in swap.stats}
    return dict(swap_h2d_gb_per_step=round(moved["h2d_bytes"] / 1e9, 2),
                swap_d2h_gb_per_step=round(moved["d2h_bytes"] / 1e9, 2),
                swap_loads_per_step=moved["loads"], swap_reloads_for_update=moved["reloads_for_update"],
                layer_stall_ms=round(swap.stall.total_ms() - stall_before, 1),
                swap_gpu_slot_gib=round(swap.memory_stats()["gpu_slot_bytes"] / 2**30, 2))


def finish_row(row: dict, out: str | None) -> None:
    """Peak memory figures, then print the row and append it to `out`."""
    node = row.pop("_node", None)  # data parallel: figures over the node's ranks (per_node)
    row["peak_alloc_gib"] = round(node["alloc"] if node else torch.cuda.max_memory_allocated() / 2**30, 2)
    row["peak_reserved_gib"] = round(node["reserved"] if node else torch.cuda.max_memory_reserved() / 2**30, 2)
    row["host_peak_gib"] = round(node["host"] if node else peak_rss_gib() or float("nan"), 2)
    print("ROW " + json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
