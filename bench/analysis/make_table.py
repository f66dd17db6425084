"""Markdown table of benchmark rows, with throughput as a ratio to the native row of the same run and shape.

    python bench/analysis/make_table.py bench/results/*.json > bench/results/README.md
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
        if not p or r["gpus"] > 1 or not r["gpu_cap_gib"]:  # the planner plans one capped GPU
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
    natives = ("native", "native_8bit", "qlora_native")
    native = {(r["run_id"], r["model"], r["seq_len"], r["tokens_per_step"]): r["tok_per_s"]
              for r in rows if r["system"] in natives and r["tok_per_s"]}
    # A run that measured its native row more than once pairs each row with the native row before it; rows with
    # exact clipping (`offload_trainer`) pair with `native_clip` (fused AdamW + clip_grad_norm_) where the run has one
    bases, last, last_clip = [], {}, {}
    for r in rows:
        key = (r["run_id"], r["model"], r["seq_len"], r["tokens_per_step"])
        if r["system"] in natives and r["tok_per_s"]:
            last[key] = r["tok_per_s"]
        if r["system"] in ("native_clip", "native_8bit_clip") and r["tok_per_s"]:
            last_clip[key] = r["tok_per_s"]
        base = last.get(key, native.get(key))
        clipped = r["system"] in ("offload_trainer", "offload_trainer_cli")
        bases.append(last_clip.get(key, base) if clipped else base)
    print("| run | commit | model | system | GPU cap | batch x seq | tok/s | "
          "vs native (clip: native_clip or native_8bit_clip) | step s | peak reserved GiB | host peak GiB | "
          "pinned GiB | GPU idle ms (profiled step) | note |")
    print("|" + " --- |" * 14)
    for r, base in zip(rows, bases):
        ratio = f"{r['tok_per_s'] / base:.3f}" if base and r["tok_per_s"] else "-"
        e = r.get("extra", {})
        note = r["error"] + "; " if r["error"] else ""
        if e.get("activation_offload"):
            note = "activation offload; " + note
        argv = e.get("argv", "").split()
        if "--cpp-wrapper" in argv:
            note = "update compiled with inductor's C++ wrapper; " + note
        if "--backlog-gib" in argv:
            note = f"gradient backlog {argv[argv.index('--backlog-gib') + 1]} GiB (no back-pressure); " + note
        if e.get("fused_update") is False:  # (rows before the fused kernel have no such field)
            note = "torchao's compiled update (--unfused); " + note
        elif e.get("fused_update"):
            note = ("fused update, fast math; " if "--fast-math" in argv else "fused update; ") + note
        if "--programs" in argv:
            note = f"kernel grid capped at {argv[argv.index('--programs') + 1]} programs; " + note
        if "--update-priority" in argv:
            note = f"update stream priority {argv[argv.index('--update-priority') + 1]}; " + note
        if e.get("act_max_inflight"):
            note = f"at most {e['act_max_inflight']} activation copies in flight; " + note
        if e.get("device_state_gib"):
            note = f"{e['device_state_gib']:g} GiB of states on the GPU (model order: input embedding first); " + note
        if "window_step_s" in e:
            note = f"back to back {e['window_step_s']} s/step; " + note
        if e.get("launch_thread"):  # (rows without it queued the updates from backward's thread)
            note = "updates queued from the launch thread; " + note
        if "resident_layers" in e and "layers" in e:  # (the integrations bench logs a list per step instead)
            note = (f"{e['resident_layers']}/{e['layers']} layers resident, {e['layers'] - e['resident_layers']} "
                    f"swapped, layer stall {e.get('layer_stall_ms', '-')} ms; ") + note
        if r["gpus"] > 1:
            note = f"{r['gpus']} GPUs, data parallel, per GPU {r['micro_batch']} x {r['seq_len']}; " + note
        if e.get("pytorch_gib"):
            note = f"PyTorch limited to {e['pytorch_gib']:g} GiB (a real {r['gpu_cap_gib']:g} GiB card); " + note
        if e.get("defer_updates") is False:
            note = "step() queues every update (--eager-step); " + note
        if r["system"].startswith("native_8bit"):
            note = "torchao AdamW8bit on the GPU (fp32 AdamW states do not fit 139 GiB); " + note
        if r["system"].startswith("offload_trainer_cli"):
            note = (f"`offload-trainer train {e['argv']}` (HF Trainer, allocator "
                    f"{e.get('alloc_conf') or 'default'}); ") + note
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
    data_parallel_table(rows)


def data_parallel_table(rows) -> None:
    """Rows on several GPUs against the 1-GPU row of the same run, system, shape and micro-batch."""
    multi = [r for r in rows if r["gpus"] > 1]
    if not multi:
        return
    one = {(r["run_id"], r["model"], r["system"], r["seq_len"], r["micro_batch"]): r for r in rows if r["gpus"] == 1}
    print("\n| run | commit | model | system | GPUs | GPU cap | micro-batch x accum x seq | tokens/step | tok/s | "
          "vs 1 GPU | peak reserved GiB (max rank) | host peak GiB (node) | pinned GiB (node) | pinned GiB per rank | "
          "note |")
    print("|" + " --- |" * 15)
    for r in sorted(rows, key=lambda r: (r["run_id"], r["model"], r["system"], r["gpus"])):
        base = one.get((r["run_id"], r["model"], r["system"], r["seq_len"], r["micro_batch"]))
        if r["gpus"] == 1 and not any(m["run_id"] == r["run_id"] for m in multi):
            continue
        e = r.get("extra", {})
        ratio = f"{r['tok_per_s'] / base['tok_per_s']:.2f}x" if r["gpus"] > 1 and base and r["tok_per_s"] else "-"
        per_rank = " / ".join(f"{x['pinned']}" for x in e.get("per_rank", [])) or "-"
        match = e.get("loss_match_vs_1gpu")
        note = (f"losses vs 1 GPU over {match['steps']} steps: max rel. diff {match['max_rel_diff']:.1e}"
                if match else "")
        cap = f"{r['gpu_cap_gib']:g}" if r["gpu_cap_gib"] else "-"
        print(f"| {r['run_id']} | {r['commit']} | {r['model']} | {r['system']} | {r['gpus']} | {cap} | "
              f"{r['micro_batch']} x {r['grad_accum']} x {r['seq_len']} | {r['tokens_per_step']} | {r['tok_per_s']} | "
              f"{ratio} | {r['peak_reserved_gib']} | {r['host_peak_gib']} | {r['pinned_gib']} | {per_rank} | {note} |")


if __name__ == "__main__":
    main(sys.argv[1:])
