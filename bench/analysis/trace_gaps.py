"""Where a profiled step's time goes: the compute stream's idle gaps, split into waiting for the CPU and waiting
for other streams, and what the CPU was doing meanwhile.

    python bench/analysis/trace_gaps.py TRACE.json.gz [--top 15] [--bin-ms 5]
    python bench/analysis/trace_gaps.py TRACE.json.gz --against OTHER.json.gz   # the compute streams' kernels,
                                                                                 # side by side
    python bench/analysis/trace_gaps.py TRACE.json.gz --inside OP --steps N     # what ran inside OP's spans
    python bench/analysis/trace_gaps.py TRACE.json.gz --around K [--before-ms 30]  # every stream's work before
                                                                                 # and during the K-th largest gap
    python bench/analysis/trace_gaps.py TRACE.json.gz --by-launcher --steps N    # kernel time per step by the
                                                                                 # autograd node / op that launched it

TRACE is written by `step_bench.py --trace` (one profiled step). For every idle gap of the compute stream (the
stream that launches the most kernels), the kernel that ends it was launched by the CPU at some moment: the part
of the gap before that launch is time the GPU waited for the CPU ("cpu"); the rest is time the stream waited for
something else, an event of another stream ("dependency"). During the "cpu" parts, the CPU's own operators are
listed by self time (the deepest operator running at each moment), so a slow hook or a blocking call shows up.
Also: each stream's busy time and last activity, CUDA runtime calls that blocked, and a text timeline.
With --around: what each stream ran (its kernels and copies, consecutive ones of a name as one run) from
`before-ms` before the K-th largest gap of the compute stream (0: the largest) to its end, in ms from the gap's start,
and which stream's work ended last before the compute stream went on: the one it waited for, as a rule -- e.g. the
end of backward, where the next forward waits for the last updates.
With --against: where two traces of the same step (two tools, two settings) spend their compute stream's time
differently, kernel by kernel (count and ms in each), largest difference first -- an extra matmul per layer shows
up as one kernel name with 32 more calls.
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
from collections import defaultdict

GPU_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_KINDS = ("cuda_runtime", "cuda_driver")


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def merged(intervals: list[tuple[float, float]]) -> list[list[float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def self_time_in(ops: list[dict], a: float, b: float, into: dict) -> None:
    """Add to `into[name]` the self time (own time, children excluded) of each op inside [a, b]."""
    for op in ops:
        s, e = op["s"], op["e"]
        if e <= a or s >= b:
            continue
        own = min(b, e) - max(a, s) - sum(max(0.0, min(b, c["e"]) - max(a, c["s"])) for c in op["kids"])
        into[op["name"]] += own
        self_time_in(op["kids"], a, b, into)


def nest(ops: list[dict]) -> list[dict]:
    """CPU ops of one thread into a forest (each op's children: ops that start and end inside it)."""
    roots: list[dict] = []
    stack: list[dict] = []
    for op in sorted(ops, key=lambda o: (o["s"], -o["e"])):
        while stack and op["s"] >= stack[-1]["e"]:
            stack.pop()
        (stack[-1]["kids"] if stack else roots).append(op)
        stack.append(op)
    return roots


# A `record_function` range the profiler also draws on the GPU stream (`Optimizer.step#AdamW.step`): a span over
# kernels, gaps included, not a kernel. Traces written where torch did not tell it apart list it as a kernel.
ANNOTATION = re.compile(r"^[^\s(<]*#[^\s(<]*$")


def _events(trace: dict, kinds: tuple[str, ...]):
    """(stream or thread id, event) for each event of these activity kinds (GPU annotations are not kernels)."""
    names, kind_names = trace["names"], trace["kinds"]
    for ni, ki, rid, start, dur, corr in trace["events"]:
        if kind_names[ki] in kinds:
            if kind_names[ki] in GPU_KINDS and ANNOTATION.match(names[ni]):
                continue
            yield rid, {"name": names[ni], "s": start, "e": start + dur, "corr": corr, "kind": kind_names[ki]}


def gpu_streams(trace: dict) -> tuple[dict[int, list[dict]], int]:
    """The GPU events by stream, and the compute stream: the one that runs the most kernels."""
    streams: dict[int, list[dict]] = defaultdict(list)
    for rid, ev in _events(trace, GPU_KINDS):
        streams[rid].append(ev)
    if not streams:
        raise SystemExit("no GPU events in this trace")
    n_kernels = {sid: sum(ev["kind"] == "kernel" for ev in evs) for sid, evs in streams.items()}
    return dict(streams), max(n_kernels, key=n_kernels.get)


def compute_gaps(trace: dict) -> dict:
    """The compute stream's idle gaps, each split at the launch of the kernel that ends it (`cpu_ms`: the GPU waited
    for the CPU to launch it; `dependency_ms`: it was launched, and waited for an event of another stream), with the
    streams, the runtime calls and the CPU ops by thread that the analyses read."""
    streams, compute = gpu_streams(trace)
    launches: dict[int, dict] = {}  # correlation id -> runtime call
    runtime: list[dict] = []
    cpu_ops: dict[int, list[dict]] = defaultdict(list)
    for rid, ev in _events(trace, RUNTIME_KINDS + ("cpu_op",)):
        if ev["kind"] == "cpu_op":
            cpu_ops[rid].append(ev | {"kids": []})
        else:
            runtime.append(ev | {"tid": rid})
            launches[ev["corr"]] = ev | {"tid": rid}
    t_end = max(ev["e"] for evs in streams.values() for ev in evs)
    t_end = max(t_end, max((ev["e"] for ev in runtime), default=0.0))
    busy_of = {sid: merged([(ev["s"], ev["e"]) for ev in evs]) for sid, evs in streams.items()}
    kernels = sorted(streams[compute], key=lambda ev: ev["s"])
    starts = [ev["s"] for ev in kernels]
    busy = busy_of[compute]
    gaps = []
    edges = [(0.0, busy[0][0])] + [(busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1)]
    for a, b in edges:
        if b - a <= 0:
            continue
        nxt = kernels[bisect.bisect_left(starts, b)]
        launch = launches.get(nxt["corr"])
        launched = launch["e"] if launch is not None else a
        cpu = max(0.0, min(launched, b) - a)
        gaps.append({"start_ms": round(a / 1e3, 3), "ms": round((b - a) / 1e3, 3), "cpu_ms": round(cpu / 1e3, 3),
                     "dependency_ms": round((b - a - cpu) / 1e3, 3), "next": nxt["name"][:80],
                     "launch_tid": launch["tid"] if launch is not None else None, "_cpu": (a, a + cpu),
                     "_span": (a, b)})
    return {"streams": streams, "compute": compute, "busy": busy_of, "gaps": gaps, "runtime": runtime,
            "cpu_ops": cpu_ops, "t_end": t_end, "tail": t_end - busy[-1][1]}


def analyse(trace: dict, top: int = 15, bin_ms: float = 5.0) -> dict:
    found = compute_gaps(trace)
    streams, compute, runtime, cpu_ops = found["streams"], found["compute"], found["runtime"], found["cpu_ops"]
    gaps, t_end, tail = found["gaps"], found["t_end"], found["tail"]
    per_stream = {}
    for sid, evs in streams.items():
        busy = found["busy"][sid]
        per_stream[sid] = {"role": "compute" if sid == compute else _role(evs), "events": len(evs),
                           "busy_ms": round(sum(e - s for s, e in busy) / 1e3, 1),
                           "first_ms": round(busy[0][0] / 1e3, 1), "last_end_ms": round(busy[-1][1] / 1e3, 1),
                           "_busy": busy}

    # what the CPU did while the GPU waited for it (on the launching thread)
    forests = {tid: nest(ops) for tid, ops in cpu_ops.items()}
    during_cpu_waits: dict[str, float] = defaultdict(float)
    for g in gaps:
        a, b = g["_cpu"]
        if b > a and g["launch_tid"] in forests:
            self_time_in(forests[g["launch_tid"]], a, b, during_cpu_waits)
    blocking = defaultdict(lambda: [0, 0.0])
    for ev in runtime:
        if ev["e"] - ev["s"] >= 100.0:  # >= 0.1 ms: the call waited (a sync, or a full launch queue)
            blocking[ev["name"]][0] += 1
            blocking[ev["name"]][1] += (ev["e"] - ev["s"]) / 1e3

    def rounded(d: dict, n: int) -> dict:
        return {k: round(v / 1e3, 2) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]}

    for s in per_stream.values():
        s["timeline"] = _timeline(s.pop("_busy"), t_end, bin_ms * 1e3)
    gaps = [{k: v for k, v in g.items() if not k.startswith("_")} for g in gaps]
    return {
        "step_ms": round(t_end / 1e3, 1),
        "compute_stream": compute,
        "compute_idle_ms": round(sum(g["ms"] for g in gaps) + tail / 1e3, 1),
        "idle_waiting_for_cpu_ms": round(sum(g["cpu_ms"] for g in gaps), 1),
        "idle_waiting_for_other_streams_ms": round(sum(g["dependency_ms"] for g in gaps), 1),
        "tail_after_last_compute_kernel_ms": round(tail / 1e3, 1),
        "gaps_over_1ms": sum(g["ms"] >= 1 for g in gaps),
        "largest_gaps": sorted(gaps, key=lambda g: -g["ms"])[:top],
        "cpu_self_ms_while_gpu_waited": rounded(during_cpu_waits, top),
        "blocking_runtime_calls": {k: [n, round(ms, 1)] for k, (n, ms) in
                                   sorted(blocking.items(), key=lambda kv: -kv[1][1])[:top]},
        "streams": per_stream,
        "bin_ms": bin_ms,
    }


def around(trace: dict, rank: int = 0, before_ms: float = 30.0) -> dict:
    """Every stream's GPU work from `before_ms` before the `rank`-th largest gap of the compute stream to its end,
    as runs of consecutive events of one name (whole events that overlap the window; ms from the gap's start), and
    the stream whose work ended last before the gap did."""
    found = compute_gaps(trace)
    gaps = sorted(found["gaps"], key=lambda g: -g["ms"])
    if rank >= len(gaps):
        raise SystemExit(f"the compute stream has {len(gaps)} gaps")
    gap = gaps[rank]
    a, b = gap["_span"]
    lo = a - before_ms * 1e3

    def rel(t: float) -> float:
        return round((t - a) / 1e3, 3)

    streams, last_end = {}, None
    for sid, evs in found["streams"].items():
        runs: list[dict] = []
        for ev in sorted((ev for ev in evs if ev["e"] > lo and ev["s"] < b), key=lambda ev: ev["s"]):
            name, ms = ev["name"][:80], (ev["e"] - ev["s"]) / 1e3
            if runs and runs[-1]["name"] == name:
                runs[-1].update(count=runs[-1]["count"] + 1, to_ms=rel(ev["e"]), busy_ms=runs[-1]["busy_ms"] + ms)
            else:
                runs.append({"name": name, "count": 1, "from_ms": rel(ev["s"]), "to_ms": rel(ev["e"]), "busy_ms": ms})
        for r in runs:
            r["busy_ms"] = round(r["busy_ms"], 3)
        ended = [ev["e"] for ev in evs if ev["e"] <= b]
        if sid != found["compute"] and ended and (last_end is None or max(ended) > last_end[1]):
            last_end = (sid, max(ended))
        streams[sid] = {"role": "compute" if sid == found["compute"] else _role(evs), "runs": runs}
    return {"gap": {k: v for k, v in gap.items() if not k.startswith("_")}, "before_ms": before_ms,
            "streams": streams, "last_to_end_before_it": None if last_end is None else
            {"stream": last_end[0], "role": streams[last_end[0]]["role"], "end_ms": rel(last_end[1])}}


def _role(evs: list[dict]) -> str:
    copies = defaultdict(int)
    for ev in evs:
        if ev["kind"] == "gpu_memcpy":
            copies["h2d" if "HtoD" in ev["name"] else "d2h" if "DtoH" in ev["name"] else "copy"] += 1
    if copies and sum(copies.values()) >= len(evs) / 2:
        return max(copies, key=copies.get)
    return "kernels"


def compute_kernels(trace: dict) -> dict[str, list]:
    """The compute stream's GPU work by kernel name: [count, ms]."""
    streams, compute = gpu_streams(trace)
    by: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for ev in streams[compute]:
        by[ev["name"]][0] += 1
        by[ev["name"]][1] += (ev["e"] - ev["s"]) / 1e3
    return dict(by)


def kernel_diff(a: dict, b: dict, top: int = 15) -> list[dict]:
    """Kernels whose compute-stream time differs most between traces `a` and `b`."""
    ka, kb = compute_kernels(a), compute_kernels(b)
    rows = [{"kernel": k, "count": [ka.get(k, [0, 0.0])[0], kb.get(k, [0, 0.0])[0]],
             "ms": [round(ka.get(k, [0, 0.0])[1], 1), round(kb.get(k, [0, 0.0])[1], 1)]} for k in set(ka) | set(kb)]
    rows.sort(key=lambda r: (-abs(r["ms"][1] - r["ms"][0]), r["kernel"]))  # (ties by name: the same order each run)
    return rows[:top]


def _timeline(busy: list[list[float]], t_end: float, bin_us: float) -> str:
    """One character per bin: how busy the stream was (' ' idle, then . : - = #)."""
    n = max(1, int(t_end // bin_us) + 1)
    frac = [0.0] * n
    for s, e in busy:
        i = int(s // bin_us)
        while s < e and i < n:
            edge = min(e, (i + 1) * bin_us)
            frac[i] += (edge - s) / bin_us
            s, i = edge, i + 1
    return "".join(" .:-=#"[min(5, int(f * 5 + 0.999))] if f > 0 else " " for f in frac)


def inside(trace: dict, name: str, steps: int, top: int) -> dict:
    """What the CPU ran inside the spans of operator `name` (on the thread that runs it: e.g. the gradient hooks,
    inside `torch::autograd::AccumulateGrad`), per step: the spans' count and time, and each operator or runtime call
    that starts inside one, by count and time (nested ones too: the lines overlap and do not add up)."""
    spans = defaultdict(list)
    for rid, ev in _events(trace, ("cpu_op",)):
        if ev["name"] == name:
            spans[rid].append((ev["s"], ev["e"]))
    if not spans:
        raise SystemExit(f"no operator named {name!r} in this trace")
    for rid in spans:
        spans[rid].sort()
    count, us = defaultdict(int), defaultdict(float)
    for rid, ev in _events(trace, ("cpu_op",) + RUNTIME_KINDS):
        if rid not in spans or ev["name"] == name:
            continue
        starts = spans[rid]
        i = bisect.bisect_right(starts, (ev["s"], float("inf"))) - 1
        if i >= 0 and ev["s"] < starts[i][1]:
            count[ev["name"]] += 1
            us[ev["name"]] += ev["e"] - ev["s"]
    durations = sorted(e - s for v in spans.values() for s, e in v)
    lines = sorted(us, key=us.get, reverse=True)[:top]
    return {"spans_per_step": len(durations) / steps, "ms_per_step": round(sum(durations) / steps / 1e3, 3),
            "median_span_us": durations[len(durations) // 2],
            "inside_per_step": [{"name": k, "count": round(count[k] / steps, 1), "ms": round(us[k] / steps / 1e3, 3)}
                                for k in lines]}


AUTOGRAD_NODE = "autograd::engine::evaluate_function: "


def launched_by(trace: dict, steps: int, top: int) -> list[dict]:
    """The compute stream's kernel time by what launched each kernel, per step: in backward, the autograd node
    (`backward: NllLossBackward0`; a forward op under it is a recompute); elsewhere, the outermost aten op on the
    launching thread (`forward: aten::linear`). A node's lines are split by kernel name, largest first."""
    found = compute_gaps(trace)  # (its runtime calls by thread and CPU ops by thread, as the budget reads them)
    launches = {ev["corr"]: (ev["tid"], ev["s"]) for ev in found["runtime"]}
    forests = {tid: nest(ops) for tid, ops in found["cpu_ops"].items()}

    starts: dict[int, list[float]] = {}  # (each sibling list's start times, once)

    def path(nodes: list[dict], t: float) -> list[str]:
        out = []
        while nodes:
            if id(nodes) not in starts:
                starts[id(nodes)] = [n["s"] for n in nodes]
            i = bisect.bisect_right(starts[id(nodes)], t) - 1
            if i < 0 or nodes[i]["e"] < t:
                break
            out.append(nodes[i]["name"])
            nodes = nodes[i]["kids"]
        return out

    by: dict[tuple, list] = defaultdict(lambda: [0, 0.0])
    for ev in found["streams"][found["compute"]]:
        rid, t = launches.get(ev["corr"], (None, None))
        names = path(forests.get(rid, []), t) if rid is not None else []
        node = next((n for n in names if n.startswith(AUTOGRAD_NODE)), None)
        if node is not None:
            key = "backward: " + node[len(AUTOGRAD_NODE):]
        else:
            key = "forward: " + next((n for n in names if n.startswith("aten::")), names[-1] if names else "?")
        line = by[(key, ev["name"][:80])]
        line[0] += 1
        line[1] += ev["e"] - ev["s"]
    rows = [{"launched_by": k, "kernel": name, "count": round(n / steps, 1), "ms": round(us / steps / 1e3, 3)}
            for (k, name), (n, us) in by.items()]
    rows.sort(key=lambda r: (-r["ms"], r["launched_by"], r["kernel"]))
    return rows[:top]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--bin-ms", type=float, default=5.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--against", help="a second trace: compare the compute streams' kernels")
    ap.add_argument("--inside", metavar="OPERATOR", help="what ran inside this operator's spans (per step)")
    ap.add_argument("--steps", type=int, default=1, help="steps the trace holds (--inside gives figures per step)")
    ap.add_argument("--around", type=int, metavar="K", help="every stream's work before and during the K-th largest "
                                                            "gap of the compute stream (0: the largest)")
    ap.add_argument("--before-ms", type=float, default=30.0, help="with --around: how far before the gap to look")
    ap.add_argument("--by-launcher", action="store_true", help="the compute stream's kernel time by the autograd node "
                                                                "or forward op that launched it (per step)")
    a = ap.parse_args()
    if a.by_launcher:
        for r in launched_by(load(a.trace), a.steps, a.top):
            print(f"{r['ms']:9.3f} ms  x{r['count']:<7g} {r['launched_by'][:60]:60s} {r['kernel']}")
        return
    if a.around is not None:
        r = around(load(a.trace), a.around, a.before_ms)
        if a.json:
            print(json.dumps(r, indent=1))
            return
        g = r["gap"]
        print(f"gap at {g['start_ms']} ms: {g['ms']} ms ({g['cpu_ms']} waiting for the CPU, {g['dependency_ms']} for "
              f"other streams), then {g['next']}; last to end before it: {r['last_to_end_before_it']}")
        for sid, st in sorted(r["streams"].items(), key=lambda kv: kv[1]["role"] != "compute"):
            print(f"  {st['role']} {sid}:")
            for run in st["runs"]:
                print(f"    {run['from_ms']:9.3f} .. {run['to_ms']:9.3f} ms  x{run['count']:<4d} "
                      f"busy {run['busy_ms']:8.3f}  {run['name']}")
        return
    if a.inside:
        print(json.dumps(inside(load(a.trace), a.inside, a.steps, a.top), indent=1))
        return
    if a.against:
        rows = kernel_diff(load(a.trace), load(a.against), a.top)
        if a.json:
            print(json.dumps(rows, indent=1))
            return
        print("compute stream, first trace | second: count, ms, kernel")
        for r in rows:
            print(f"{r['count'][0]:6d} {r['ms'][0]:9.1f} | {r['count'][1]:6d} {r['ms'][1]:9.1f}  {r['kernel'][:100]}")
        return
    r = analyse(load(a.trace), a.top, a.bin_ms)
    if a.json:
        print(json.dumps(r, indent=1))
        return
    print(f"step {r['step_ms']} ms; compute stream {r['compute_stream']} idle {r['compute_idle_ms']} ms: "
          f"{r['idle_waiting_for_cpu_ms']} waiting for the CPU, {r['idle_waiting_for_other_streams_ms']} for other "
          f"streams, {r['tail_after_last_compute_kernel_ms']} after its last kernel; {r['gaps_over_1ms']} gaps >= 1 ms")
    print(f"timeline ({r['bin_ms']} ms per character):")
    for sid, s in sorted(r["streams"].items(), key=lambda kv: kv[1]["role"] != "compute"):
        print(f"  {s['role']:>8} {sid:>3} |{s['timeline']}| busy {s['busy_ms']} ms, last end {s['last_end_ms']} ms")
    print("largest gaps (start ms, ms, cpu part, dependency part, kernel after):")
    for g in r["largest_gaps"]:
        print(f"  {g['start_ms']:9.3f} {g['ms']:7.3f} {g['cpu_ms']:7.3f} {g['dependency_ms']:7.3f}  {g['next']}")
    print("CPU self time (ms) while the GPU waited for it:", r["cpu_self_ms_while_gpu_waited"])
    print("runtime calls >= 0.1 ms (count, ms):", r["blocking_runtime_calls"])


if __name__ == "__main__":
    main()
