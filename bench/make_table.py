"""Markdown table of benchmark rows, with throughput as a ratio to the native row of the same run and shape.

    python bench/make_table.py bench/results/*.json > bench/results/README.md
"""
import json
import sys


def planner_table(rows) -> None:
    """Predicted vs measured, for rows that carry the planner's prediction."""
    print("\n| model | batch x seq | GPU cap | act. offload | GPU peak pred / meas (err) | host pred / meas (err) | "
          "step s pred / meas (err) | planner said |")
    print("|" + " --- |" * 8)
    for r in rows:
        p = r.get("predicted")
        if not p:
            continue
        act = "yes" if r.get("extra", {}).get("activation_offload") else "no"
        if not p.get("fits", True):
            print(f"| {r['model']} | {r['micro_batch']} x {r['seq_len']} | {r['gpu_cap_gib']:g} | {act} | - / "
                  f"{r['peak_reserved_gib']} | - | - | does not fit: {p['reason'][:90]}... |")
            continue

        def cell(pred, meas):
            return f"{pred} / {meas} ({(pred - meas) / meas:+.1%})" if meas else f"{pred} / -"

        print(f"| {r['model']} | {r['micro_batch']} x {r['seq_len']} | {r['gpu_cap_gib']:g} | {act} | "
              f"{cell(p['gpu_peak_gib'], r['peak_reserved_gib'])} | {cell(p['host_peak_gib'], r['host_peak_gib'])} | "
              f"{cell(p['step_s'], r['step_s_median'])} | fits |")


def main(paths: list[str]) -> None:
    rows = [r for p in paths for r in json.load(open(p))]
    native = {(r["run_id"], r["model"], r["seq_len"], r["tokens_per_step"]): r["tok_per_s"]
              for r in rows if r["system"] in ("native", "native_8bit", "qlora_native") and r["tok_per_s"]}
    print("| run | commit | model | system | GPU cap | batch x seq | tok/s | vs native | step s | "
          "peak reserved GiB | host peak GiB | pinned GiB | GPU idle ms (profiled step) | note |")
    print("|" + " --- |" * 14)
    for r in rows:
        base = native.get((r["run_id"], r["model"], r["seq_len"], r["tokens_per_step"]))
        ratio = f"{r['tok_per_s'] / base:.3f}" if base and r["tok_per_s"] else "-"
        e = r.get("extra", {})
        note = r["error"] or ""
        if e.get("activation_offload"):
            note = "activation offload; " + note
        if "resident_layers" in e:
            note = (f"{e['resident_layers']}/{e['layers']} layers resident, {e['layers'] - e['resident_layers']} "
                    f"swapped, layer stall {e.get('layer_stall_ms', '-')} ms; ") + note
        if r["system"] == "native_8bit":
            note = "torchao AdamW8bit on the GPU (fp32 AdamW states do not fit 139 GiB); " + note
        if r["system"].endswith("noclip"):
            note = note + "updates during backward, no clipping"
        elif "offload_gradients" in e:
            note = note + "clip 1.0, " + ("grads in pinned CPU memory" if e["offload_gradients"] else "grads on GPU")
        cap = f"{r['gpu_cap_gib']:g}" if r["gpu_cap_gib"] else "-"
        print(f"| {r['run_id']} | {r['commit']} | {r['model']} | {r['system']} | {cap} | "
              f"{r['micro_batch']} x {r['seq_len']} | {r['tok_per_s'] or '-'} | {ratio} | "
              f"{r['step_s_median'] or '-'} | "
              f"{r['peak_reserved_gib']} | {r['host_peak_gib']} | {r['pinned_gib'] or '-'} | "
              f"{e.get('gpu_idle_ms', '-')} | {note} |")
    planner_table(rows)


if __name__ == "__main__":
    main(sys.argv[1:])
