"""The step's time budget: where each millisecond of a profiled step goes, per system, and where ours differs from
the natives of the same device run.

    python bench/analysis/budget.py ROWS.jsonl [--md] [--json OUT.json]

ROWS holds rows of one device run written with a trace (`step_bench.py ... --trace T --profile-steps N`,
`trainer_bench.py ... --profile-steps N --trace T`: the row's `extra.trace` names it). Each traced row's step (the
profiled window over its steps; a Trainer's window runs from a step's beginning to the next's, its log and data
included) is cut into lines that add up to it:

  compute stream busy, by kernel family: matmul, attention, loss, optimizer update, gradient norm, copies and sets
      on the compute stream, other kernels (elementwise, norms, RoPE, casts, embedding...);
  compute stream idle, its next kernel already launched: waiting for another stream (our copy streams: h2d / d2h,
      the update stream, another), by the stream whose last activity before the kernel started is the latest;
  compute stream idle, its next kernel not yet launched (waiting for the CPU), by what the launching thread did
      meanwhile: in a host sync (stream / event / device synchronize, a blocking copy, `.item()`), in the CUDA
      runtime otherwise (launches, copies queued, events), in torch ops (dispatch, autograd), in Python outside any
      op (hooks, the Trainer's loop and logging, data);
  after the compute stream's last kernel until the window's end (waiting for the other streams to finish).

Each of ours (`offload_trainer*` systems) is put beside every reference of the same run, model and shape (`native`,
`native_8bit`: the bare loop; `trainer_native`, `trainer_native_8bit`: the stock Trainer): per line, ms per step in
each and the difference. The differences add up to the profiled windows' difference exactly; the check is against
the measured difference of the unprofiled steps (the rows' medians), printed with the residual (profiler overhead and
step-to-step spread).
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import re
from collections import defaultdict

from trace_gaps import _role, compute_gaps, load, merged, nest

FAMILIES = (  # (the first that matches a compute-stream kernel's name names its family)
    ("optimizer update", re.compile(r"adamw8bit|FusedOptimizer|FusedAdam|_update8bit", re.I)),
    # (torch's foreach norm: its functor's name falls past a trace's name length; fused AdamW's does not)
    ("gradient norm", re.compile(r"NormTwo|lpnorm|foreach_norm|LpNorm|norm_kernel|multi_tensor_apply_kernel", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|attn", re.I)),
    ("loss", re.compile(r"softmax|nll_loss|cross_entropy|logsumexp", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|splitk|wgmma|sm90_|sm80_|ampere_|Kernel2", re.I)),
    ("copies and sets", re.compile(r"^Memcpy|^Memset")),
)
OTHER_KERNELS = "other kernels"
SYNCS = re.compile(r"Synchronize|^cudaMemcpy$|^cuMemcpy[DH]toH?[DH]?$|^cudaMemcpy2D$|_local_scalar_dense|^aten::item$")
LINES = [f"compute: {name}" for name, _ in FAMILIES] + [
    f"compute: {OTHER_KERNELS}",
    "idle, waiting for stream: h2d", "idle, waiting for stream: d2h", "idle, waiting for stream: update",
    "idle, waiting for stream: other",
    "idle, waiting for the CPU: host sync", "idle, waiting for the CPU: CUDA runtime (launches, events)",
    "idle, waiting for the CPU: torch ops", "idle, waiting for the CPU: Python outside ops",
    "idle, after the last compute kernel"]
KERNEL_NAME, TOP_KERNELS = 90, 6  # (characters of a kernel's name that tell it apart; differences listed per reference)
REFERENCES = ("native", "native_8bit", "native_clip", "native_8bit_clip", "trainer_native", "trainer_native_8bit")


def family(name: str) -> str:
    for fam, pattern in FAMILIES:
        if pattern.search(name):
            return fam
    return OTHER_KERNELS


def _self_times(ops: list[dict], a: float, b: float, into: dict) -> None:
    """Add each op's own time inside [a, b] (its children excluded) to `into[op]` (op: the event dict)."""
    for op in ops:
        if op["e"] <= a or op["s"] >= b:
            continue
        own = min(b, op["e"]) - max(a, op["s"]) - sum(max(0.0, min(b, c["e"]) - max(a, c["s"])) for c in op["kids"])
        into[id(op)] = (op, into.get(id(op), (op, 0.0))[1] + own)
        _self_times(op["kids"], a, b, into)


def budget(trace: dict, steps: int = 1) -> dict:
    """ms per step of one trace (of `steps` steps), by line of `LINES`; the lines add up to `step_ms`."""
    found = compute_gaps(trace)
    streams, compute = found["streams"], found["compute"]
    us = defaultdict(float)
    by_kernel = defaultdict(lambda: [0, 0.0])  # compute-stream kernel name -> [calls, us]
    for ev in streams[compute]:
        us[f"compute: {family(ev['name'])}"] += ev["e"] - ev["s"]
        k = by_kernel[ev["name"][:KERNEL_NAME]]
        k[0] += 1
        k[1] += ev["e"] - ev["s"]
    # (kernels of one stream never overlap; should the profiler's clock make two touch, the union is the busy time)
    overlap = sum(ev["e"] - ev["s"] for ev in streams[compute]) - sum(e - s for s, e in found["busy"][compute])
    us[f"compute: {OTHER_KERNELS}"] -= overlap
    roles = {sid: _role(evs) if sid != compute else "compute" for sid, evs in streams.items()}
    # the update stream launches kernels only (our fused update): kernels off the compute stream
    roles = {sid: ("update" if r == "kernels" else r if r in ("h2d", "d2h") else "other") for sid, r in roles.items()}
    ends = {sid: sorted(e for _, e in found["busy"][sid]) for sid in streams if sid != compute}
    threads = defaultdict(list)
    for ev in found["runtime"]:
        threads[ev["tid"]].append(ev | {"kids": []})
    for tid, ops in found["cpu_ops"].items():
        threads[tid].extend(ops)
    forests = {tid: nest([dict(op, kids=[]) for op in ops]) for tid, ops in threads.items()}
    syncs = 0
    for ev in found["runtime"]:
        syncs += bool(SYNCS.search(ev["name"]))
    for g in found["gaps"]:
        a, b = g["_span"]
        c0, c1 = g["_cpu"]
        dep = (b - a) - (c1 - c0)
        if dep > 0:  # waited for an event: of the stream whose activity ended last before the kernel started
            latest, who = -1.0, "other"
            for sid, e in ends.items():
                i = bisect.bisect_right(e, b) - 1
                if i >= 0 and e[i] > latest:
                    latest, who = e[i], roles[sid]
            us[f"idle, waiting for stream: {who}"] += dep
        if c1 > c0:
            own: dict = {}
            if g["launch_tid"] in forests:
                _self_times(forests[g["launch_tid"]], c0, c1, own)
            inside = 0.0
            for op, t in own.values():
                inside += t
                if SYNCS.search(op["name"]):
                    us["idle, waiting for the CPU: host sync"] += t
                elif op["kind"] in ("cuda_runtime", "cuda_driver"):
                    us["idle, waiting for the CPU: CUDA runtime (launches, events)"] += t
                else:
                    us["idle, waiting for the CPU: torch ops"] += t
            us["idle, waiting for the CPU: Python outside ops"] += max(0.0, (c1 - c0) - inside)
    us["idle, after the last compute kernel"] += found["tail"]
    lines = {k: round(us.get(k, 0.0) / 1e3 / steps, 2) for k in LINES}
    busy_other = {roles[sid]: 0.0 for sid in streams if sid != compute}
    for sid in streams:
        if sid != compute:
            busy_other[roles[sid]] += sum(e - s for s, e in merged([(ev["s"], ev["e"]) for ev in streams[sid]]))
    # (of the compute lines: time the compute stream ran while an update kernel ran beside it -- the two share the
    # GPU's SMs and memory, so a kernel there can take longer than alone)
    beside = merged([iv for sid in streams if roles[sid] == "update" for iv in found["busy"][sid]])
    shared = _overlap(found["busy"][compute], beside)
    return {"step_ms": round(found["t_end"] / 1e3 / steps, 2), "lines": lines,
            "compute_beside_update_kernels_ms": round(shared / 1e3 / steps, 1),
            "other_streams_busy_ms": {k: round(v / 1e3 / steps, 1) for k, v in busy_other.items()},
            "runtime_syncs_per_step": round(syncs / steps, 1),
            "kernels": {k: [round(n / steps, 1), round(t / 1e3 / steps, 2)] for k, (n, t) in by_kernel.items()}}


def _overlap(a: list, b: list) -> float:
    """Length of the intersection of two sorted lists of disjoint intervals."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _steps_of(row: dict) -> int:
    prof = row.get("extra", {}).get("profile") or row.get("extra", {})
    return int(prof.get("profiled_steps", 1) or 1)


def clips(row: dict) -> bool:
    """Whether the row's run clipped by global norm (a Trainer row's `max_grad_norm`; a bare loop's system)."""
    if "max_grad_norm" in row.get("extra", {}):
        return bool(row["extra"]["max_grad_norm"])
    return row["system"].endswith("_clip") or row["system"] == "offload_trainer"


def _case(row: dict) -> tuple:
    return row["run_id"], row["model"], row["seq_len"], row["micro_batch"], row.get("grad_accum", 1), clips(row)


def tables(rows: list[dict], root: str = ".") -> list[dict]:
    """For each of ours with a trace: its budget beside each reference's of the same case."""
    traced = []
    for r in rows:
        path = r.get("extra", {}).get("trace")
        if not path or r.get("error"):
            continue
        if not os.path.exists(path):
            path = os.path.join(root, os.path.basename(path))
        if os.path.exists(path):
            traced.append((r, budget(load(path), _steps_of(r))))
    out = []
    for r, b in traced:
        if not r["system"].startswith("offload_trainer"):
            continue
        refs = [(q, c) for q, c in traced if q["system"] in REFERENCES and _case(q) == _case(r)]
        entry = {"case": dict(zip(("run_id", "model", "seq_len", "micro_batch", "grad_accum", "clips"), _case(r))),
                 "ours": {"system": r["system"], "argv": r["extra"].get("argv"), "tok_per_s": r["tok_per_s"],
                          "step_s_median": r["step_s_median"], **b},
                 "references": []}
        for q, c in refs:
            measured = (r["step_s_median"] - q["step_s_median"]) * 1e3
            profiled = b["step_ms"] - c["step_ms"]
            entry["references"].append({
                "system": q["system"], "argv": q["extra"].get("argv"), "tok_per_s": q["tok_per_s"],
                "step_s_median": q["step_s_median"], "ratio": round(r["tok_per_s"] / q["tok_per_s"], 4), **c,
                "difference_ms": {k: round(b["lines"][k] - c["lines"][k], 2) for k in LINES},
                "profiled_difference_ms": round(profiled, 2), "measured_difference_ms": round(measured, 2),
                "residual_ms": round(measured - profiled, 2),
                "residual_of_measured_step": round((measured - profiled) / (r["step_s_median"] * 1e3), 4),
                "kernel_differences": _kernel_differences(b["kernels"], c["kernels"])})
        out.append(entry)
    return out


def _kernel_differences(ours: dict, ref: dict, top: int = TOP_KERNELS) -> list:
    """The compute-stream kernels whose time per step differs most: [name, ms difference, (calls, ms) ours, ref]."""
    names = sorted(set(ours) | set(ref), key=lambda k: -abs(ours.get(k, [0, 0])[1] - ref.get(k, [0, 0])[1]))
    return [[k, round(ours.get(k, [0, 0])[1] - ref.get(k, [0, 0])[1], 1), ours.get(k, [0, 0]), ref.get(k, [0, 0])]
            for k in names[:top]]


def markdown(entry: dict) -> str:
    c, o, refs = entry["case"], entry["ours"], entry["references"]
    head = (f"**{c['model']} {c['micro_batch']} x {c['seq_len']}, {o['system']}** (run {c['run_id']}; "
            f"`{o['argv']}`)\n\n| ms per step | ours | " + " | ".join(
                f"{q['system']} | ours - {q['system']}" for q in refs) + " |\n|---|---:|" + "---:|---:|" * len(refs))
    rows = [head]
    for k in LINES:
        if o["lines"][k] == 0 and all(q["lines"][k] == 0 for q in refs):
            continue
        rows.append(f"| {k} | {o['lines'][k]:.1f} | " + " | ".join(
            f"{q['lines'][k]:.1f} | {q['difference_ms'][k]:+.1f}" for q in refs) + " |")
    rows.append(f"| **profiled step** | **{o['step_ms']:.1f}** | " + " | ".join(
        f"**{q['step_ms']:.1f}** | **{q['profiled_difference_ms']:+.1f}**" for q in refs) + " |")
    rows.append(f"| measured step (median, unprofiled) | {o['step_s_median'] * 1e3:.1f} | " + " | ".join(
        f"{q['step_s_median'] * 1e3:.1f} | {q['measured_difference_ms']:+.1f}" for q in refs) + " |")
    rows.append(f"| residual (measured - profiled difference) | | " + " | ".join(
        f" | {q['residual_ms']:+.1f} ({100 * q['residual_of_measured_step']:+.1f}% of the step)" for q in refs) + " |")
    rows.append(f"| tok/s (ratio) | {o['tok_per_s']:.0f} | " + " | ".join(
        f"{q['tok_per_s']:.0f} | {q['ratio']:.3f}x" for q in refs) + " |")
    for label, key in (("other streams busy", "other_streams_busy_ms"),
                       ("(of the compute lines) beside our update kernels", "compute_beside_update_kernels_ms"),
                       ("host syncs (runtime calls) per step", "runtime_syncs_per_step")):
        rows.append(f"| {label} | {o[key]} | " + " | ".join(f"{q[key]} | " for q in refs) + " |")
    for q in refs:  # (what the compute lines' differences are made of)
        rows.append(f"\nKernels that differ most against {q['system']} (ms per step; calls per step, ms: ours / "
                    f"{q['system']}):")
        rows += [f"- {d:+.1f} ms: {a[0]:g} calls {a[1]:.1f} ms / {b[0]:g} calls {b[1]:.1f} ms `{k[:70]}`"
                 for k, d, a, b in q.get("kernel_differences", [])]
    return "\n".join(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rows", nargs="+", help="rows (JSON lines or a JSON list) of one device run, with traces")
    ap.add_argument("--traces", default=".", help="where to look for a trace by its file name, if not at its path")
    ap.add_argument("--json", default=None, help="write the budgets here")
    a = ap.parse_args(argv)
    rows = []
    for path in a.rows:
        text = open(path).read().strip()
        rows += json.loads(text) if text.startswith("[") else [json.loads(x) for x in text.splitlines() if
                                                                 x.startswith("{")]
    out = tables(rows, a.traces)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    for entry in out:
        print(markdown(entry) + "\n")
    if not out:
        print("no traced row of ours with a traced reference of the same case")


if __name__ == "__main__":
    main()
