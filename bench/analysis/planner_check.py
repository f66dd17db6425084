"""The planner's predictions against measured peaks: for each case (a row of bench/results, the resident layers it ran
with), the plan the command makes for that run -- its config and overrides, on the held 24 GB card's budget -- at that
resident count, beside the row's measured GPU peak (reserved) and host peak.

    python bench/analysis/planner_check.py            # the table, and the worst error against the bound

For a `layer_swap: auto` row (resident "final") the host peak is also predicted at the count the run started with,
and the larger taken: the measured host peak is a high-water mark, and the start pinned the most layers.
Bound (issue 37): within 5% or 0.5 GiB, whichever is larger. A row whose allocator gave memory back (retries) peaked
at the card's limit: its reserved peak is the limit, and what the step would have held with more room is at least
that (the allocator frees its cache only when it cannot grow). Such a row bounds the prediction from below only: it
passes when not under the limit by more than the bound (shown as ">="), and its allocated peak is shown beside it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "..", "results")
HELD_GIB = 23.2879  # what the planner saw of the held card (hold_gpu_memory.py 23.5, the CUDA context taken)
HOST_GIB = 125.0  # the device machine's RAM

# (label, results file, run id, system, seq_len, resident layers the row ran with; None: all[, model where the run
# has rows of several models with that system and length[, words its command line has where several rows are left]])
CASES = [
    ("Llama-3-8B 4 x 2048, speculative", "2026-12-01-s36.json", "20261201-s36c", "offload_trainer_cli_speculative",
     2048, None),
    ("Llama-3-8B 4 x 2048, exact clipping", "2026-12-01-s36.json", "20261201-s36c", "offload_trainer_cli", 2048, None),
    ("Llama-3-8B 4 x 2048, no clipping", "2026-12-01-s36.json", "20261201-s36c", "offload_trainer_cli_noclip", 2048,
     None),
    ("Qwen2.5-14B 8 x 2048, layer swap", "2026-12-01-s38.json", "20261201-s38c", "offload_trainer_cli_noclip", 2048, 17),
    ("Llama-3-70B QLoRA 1 x 2048", "2026-12-01-s33c-qlora70b.json", "20261201-s33c", "offload_trainer_cli_qlora", 2048,
     29),
    ("Llama-3.2-90B-Vision QLoRA 1 x 2048, auto", "2026-12-02-s45.json", "20261202-s45b", "offload_trainer_cli", 2048,
     "final"),
    ("Llama-3.2-11B-Vision full FT 2 x 2048", "2026-12-02-s45.json", "20261202-s45b", "offload_trainer_cli_noclip",
     2048, "final"),
    ("Llama-3.2-11B-Vision full FT 2 x 2048", "2026-12-02-s45.json", "20261202-s45d", "offload_trainer_cli_noclip",
     2048, "final"),
    ("Llama-3.1-8B 1 x 16384", "2026-12-02-s39.json", "20261202-s39a", "offload_trainer_cli", 16384, "final"),
    ("Llama-3.1-8B 1 x 32768", "2026-12-02-s39.json", "20261202-s39a", "offload_trainer_cli", 32768, "final"),
    ("Llama-3.1-8B 1 x 65536, tiled MLP", "2026-12-02-s39.json", "20261202-s39c", "offload_trainer_cli", 65536,
     "final"),
    ("Llama-3.1-8B 1 x 32768, auto", "2026-12-02-s46.json", "20261202-s46a", "offload_trainer_cli", 32768, "final"),
    ("Llama-3.1-8B 1 x 32768, layer_swap 13", "2026-12-02-s46.json", "20261202-s46a", "offload_trainer_cli", 32768, 13),
    ("Llama-3.1-8B 1 x 32768, layer_swap 9", "2026-12-02-s46.json", "20261202-s46a", "offload_trainer_cli", 32768, 9),
    ("Llama-3.1-8B 1 x 65536, tiled MLP, auto", "2026-12-02-s46.json", "20261202-s46b", "offload_trainer_cli", 65536,
     "final"),
    ("Llama-3.1-8B 1 x 65536, tiled MLP, layer_swap 8", "2026-12-02-s46.json", "20261202-s46b", "offload_trainer_cli",
     65536, 8),
    ("Llama-3.2-11B-Vision full FT 2 x 2048, auto", "2026-12-02-s46.json", "20261202-s46b", "offload_trainer_cli_noclip",
     2048, "final"),
    ("Llama-3.2-11B-Vision full FT 2 x 2048, layer_swap 28", "2026-12-02-s46.json", "20261202-s46d",
     "offload_trainer_cli_noclip", 2048, 28),
    ("Qwen2.5-14B 8 x 2048, layer swap, auto", "2026-12-03-s47.json", "20261203-s47a", "offload_trainer_cli_noclip",
     2048, "final"),
    ("Qwen2.5-14B 8 x 2048, layer_swap 16", "2026-12-03-s47.json", "20261203-s47a", "offload_trainer_cli_noclip", 2048,
     16),
    ("Qwen2.5-14B 8 x 2048, layer_swap 12", "2026-12-03-s47.json", "20261203-s47a", "offload_trainer_cli_noclip", 2048,
     12),
    ("Llama-3.1-8B 1 x 65536, tiled MLP, auto", "2026-12-03-s47.json", "20261203-s47b", "offload_trainer_cli", 65536,
     "final"),
    ("Llama-3.1-8B 1 x 65536, tiled MLP, layer_swap 4", "2026-12-03-s47.json", "20261203-s47b", "offload_trainer_cli",
     65536, 4),
    ("Llama-3.1-8B 1 x 16384, auto", "2026-12-03-s48.json", "20261203-s48b", "offload_trainer_cli", 16384, "final"),
    ("Llama-3.1-8B 1 x 16384, layer_swap 23", "2026-12-03-s48.json", "20261203-s48b", "offload_trainer_cli", 16384,
     23),
    # the host held to 57 GiB available too (a 64 GB machine: bench/runs/host_machine.sh)
    ("Llama-3-8B 4 x 2048, speculative, 64 GB host", "2026-12-03-s56-host64.json", "20261203-s56a",
     "offload_trainer_cli_speculative", 2048, None),
    ("Qwen2.5-14B 8 x 2048, auto, 64 GB host", "2026-12-03-s56-host64.json", "20261203-s56a",
     "offload_trainer_cli_noclip", 2048, "final"),
    ("Llama-3.1-8B 1 x 32768, auto, 64 GB host", "2026-12-03-s56-host64.json", "20261203-s56a", "offload_trainer_cli",
     32768, "final"),
    ("Llama-3.1-8B 1 x 65536, no clipping, auto, 64 GB host", "2026-12-03-s56-host64.json", "20261203-s56b",
     "offload_trainer_cli_noclip", 65536, "final"),
    ("Llama-3.2-90B-Vision QLoRA 1 x 2048, auto, 64 GB host", "2026-12-03-s56-host64.json", "20261203-s56b",
     "offload_trainer_cli", 2048, "final", "llama3.2-90b-vision"),
    ("Llama-3.2-11B-Vision full FT 2 x 2048, auto, 64 GB host", "2026-12-03-s56-host64.json", "20261203-s56b",
     "offload_trainer_cli_noclip", 2048, "final"),
    ("Llama-3-70B QLoRA 1 x 2048, auto, 64 GB host", "2026-12-03-s56-host64.json", "20261203-s56b",
     "offload_trainer_cli", 2048, "final", "llama3-70b"),
    # exact against speculative clipping, in one run each
    ("Llama-3.1-8B 1 x 16384, exact clipping, auto", "2026-12-03-s58.json", "20261203-s58a", "offload_trainer_cli",
     16384, "final"),
    ("Llama-3.1-8B 1 x 16384, speculative, auto", "2026-12-03-s58.json", "20261203-s58a",
     "offload_trainer_cli_speculative", 16384, "final"),
    ("Llama-3.1-8B 1 x 32768, exact clipping, auto", "2026-12-03-s58.json", "20261203-s58b", "offload_trainer_cli",
     32768, "final"),
    ("Llama-3.1-8B 1 x 32768, speculative, auto", "2026-12-03-s58.json", "20261203-s58b",
     "offload_trainer_cli_speculative", 32768, "final"),
    # the config as it is (clip 1.0), beside both references
    ("Llama-3.1-8B 1 x 32768, auto", "2026-12-03-s59.json", "20261203-s59d", "offload_trainer_cli", 32768, "final"),
    ("Llama-3.1-8B 1 x 65536, tiled MLP, auto", "2026-12-03-s59.json", "20261203-s59c", "offload_trainer_cli", 65536,
     "final"),
    # tiled layers: 128k (the plan the planner takes there), and 64k beside the planner's own (tiled MLP) in one call
    ("Llama-3.1-8B 1 x 131072, tiled layers, none resident", "2026-12-04-s60.json", "20261204-s60b",
     "offload_trainer_cli", 131072, 0),
    ("Llama-3.1-8B 1 x 65536, tiled MLP, auto", "2026-12-04-s60.json", "20261204-s60c", "offload_trainer_cli", 65536,
     "final", None, "max_steps=7 gpu_memory_limit_gb="),
    ("Llama-3.1-8B 1 x 65536, tiled layers, auto", "2026-12-04-s60.json", "20261204-s60c", "offload_trainer_cli",
     65536, "final", None, "tiled_layers=true"),
    ("Llama-3.1-8B 1 x 32768, auto", "2026-12-04-s60.json", "20261204-s60c", "offload_trainer_cli", 32768, "final"),
    # 14B and 11B-Vision beside both references
    ("Qwen2.5-14B 8 x 2048, auto", "2026-12-04-s61.json", "20261204-s61a", "offload_trainer_cli_noclip", 2048, "final",
     "qwen2.5-14b"),
    ("Llama-3.2-11B-Vision full FT 2 x 2048, auto", "2026-12-04-s61.json", "20261204-s61a",
     "offload_trainer_cli_noclip", 2048, "final", "llama3.2-11b-vision"),
    ("Llama-3.2-90B-Vision QLoRA 1 x 2048, auto", "2026-12-04-s61.json", "20261204-s61b", "offload_trainer_cli", 2048,
     "final", "llama3.2-90b-vision"),
    ("Llama-3-70B QLoRA 1 x 2048, auto", "2026-12-04-s61.json", "20261204-s61b", "offload_trainer_cli", 2048, "final",
     "llama3-70b"),
    # the input embedding's states on the GPU, the layer inputs offloaded for them (the planner's choice since 20fd8c8)
    ("Llama-3-8B 4 x 2048, no clipping, embedding's states on the GPU", "2026-12-04-s66.json", "20261204-s66c",
     "offload_trainer_cli_noclip", 2048, None),
    # gradient accumulation as users write it: 4 x (1 x 2048) folded into one micro-batch; 4 x (2 x 2048) and
    # 16 x (1 x 2048) run as micro-batches of 4 x 2048 that accumulate (at the allocator's limit: retries)
    ("Llama-3-8B 1 x 2048 x 4, no clipping, folded", "2026-12-04-s69.json", "20261204-s69a",
     "offload_trainer_cli_noclip", 2048, None),
    ("Llama-3-8B 1 x 2048 x 4, speculative, folded", "2026-12-04-s69.json", "20261204-s69a",
     "offload_trainer_cli_speculative", 2048, None, None, "gradient_accumulation_steps=4"),
    ("Llama-3-8B 2 x 2048 x 4, no clipping, 2 folded", "2026-12-04-s69.json", "20261204-s69b",
     "offload_trainer_cli_noclip", 2048, None, None, "gradient_accumulation_steps=4"),
    ("Llama-3-8B 2 x 2048 x 4, speculative, 2 folded", "2026-12-04-s69.json", "20261204-s69b",
     "offload_trainer_cli_speculative", 2048, None, None, "gradient_accumulation_steps=4"),
    ("Llama-3-8B 1 x 2048 x 16, no clipping, 4 folded", "2026-12-04-s69.json", "20261204-s69b",
     "offload_trainer_cli_noclip", 2048, None, None, "gradient_accumulation_steps=16"),
    ("Llama-3-8B 1 x 2048 x 16, speculative, 4 folded", "2026-12-04-s69.json", "20261204-s69b",
     "offload_trainer_cli_speculative", 2048, None, None, "gradient_accumulation_steps=16"),
]

# Cases known to be outside the bound, (run id, label) -> why; the test holds this to be exactly the cases outside, so
# a case that returns inside (or a new one that leaves) shows
OUTSIDE = {
    ("20261204-s60c", "Llama-3.1-8B 1 x 65536, tiled MLP, auto"):
        "GPU over-predicted by 1.29 GiB (+5.9%): the same prediction was +4.9% against s59c's run of the same plan; "
        "the reserved peak moved 0.21 GiB between the calls. Not refitted at the submitted head (a planner change needs "
        "the GPU suite run on it, and no device time was left)",
    ("20261204-s61b", "Llama-3.2-90B-Vision QLoRA 1 x 2048, auto"):
        "GPU over-predicted by 1.11 GiB (+5.1%): the same plan was +4.7% and +4.8% against s45b and s56b, whose peaks "
        "were 0.06-0.08 GiB higher. With 1 layer resident (s45b's first step) it was within 0.2 GiB (15.3 predicted, "
        "15.1 measured), so what is over-predicted is the growth to 19 resident: 0.41 GiB a layer predicted, about "
        "0.36 measured, which no constant fitted so far explains; not refitted blind",
}


def ran_speculative(row: dict) -> bool:
    """Whether the row's run clipped speculatively: the plan it recorded says, else (older rows) its system's name."""
    recorded = (row.get("predicted") or {}).get("speculative_clipping")
    return recorded if recorded is not None else row["system"].endswith("_speculative")


def find_row(fname: str, run_id: str, system: str, seq: int, resident, model: str | None = None,
             argv_has: str = "") -> dict:
    """The case's row: "final" an auto row (no count pinned on its command line), a count a row pinned at it where
    the run pinned several, else the run's last row of that system and length (and `model`, and `argv_has` in its
    command line)."""
    rows = [r for r in json.load(open(os.path.join(RESULTS, fname))) if r["run_id"] == run_id
            and r["system"] == system and r["seq_len"] == seq and r["tok_per_s"] and model in (None, r["model"])
            and "layer_swap=off" not in r["extra"].get("argv", "") and argv_has in r["extra"].get("argv", "")]
    pinned = [r for r in rows if "layer_swap=" in r["extra"].get("argv", "")]
    if resident == "final" and pinned:
        rows = [r for r in rows if r not in pinned]
    elif isinstance(resident, int) and pinned:
        rows = [r for r in pinned if f"layer_swap={resident}" in r["extra"]["argv"].split()]
    if not rows:
        raise LookupError(f"{fname}: no row {run_id} {system} {seq} at {resident}")
    return rows[-1]


def predict(row: dict, *counts, clipping: str = "ran") -> list[dict]:
    """The plan of the row's command, at each of `counts` resident layers (None: the plan's own count). `clipping`:
    "ran" plans the clipping the row ran with, "planner" lets the planner choose it."""
    from offload_trainer.cli.config import load_config, parse_args
    from offload_trainer.models import architecture_config
    from offload_trainer.planner import plan_at_resident, plan_for_run, run_budget, run_shape
    from offload_trainer.settings import OffloadSettings

    config, *overrides = row["extra"]["argv"].split()
    # (a pinned count is asked for below: the plan search itself refuses a count it predicts not to fit)
    keep = [o for o in overrides if not o.startswith(("output_dir=", "model_name_or_path=", "model_config=",
                                                      "layer_swap="))]
    model_args, data_args, args = parse_args(load_config(os.path.join(HERE, "..", "..", config), keep))
    # (the clipping the run had: the planner's choice between exact and speculative has changed since some rows; and
    # a run without activation offload is planned so: without clipping the planner now offloads the layer inputs
    # where that leaves room for the input embedding's states)
    settings = dataclasses.replace(OffloadSettings.from_args(args), speculative_clipping=ran_speculative(row)
                                   if clipping == "ran" else None)
    if clipping == "ran" and row["extra"].get("activation_offload") is False and settings.activation_offload is None:
        settings = dataclasses.replace(settings, activation_offload=False)
    cfg = architecture_config(row["model"] if not row["model"].startswith("/") else model_args.model_config)
    seq = data_args.max_seq_length
    # the switches the run's plan decided (on the held card), then that plan at each resident count the run ran with
    # (on the host the run had: its plan's budget where the row records it, a held host's)
    host = (row.get("predicted") or {}).get("host_budget_gib") or HOST_GIB
    shape = run_shape(cfg, seq, model_args)
    run_plan = plan_for_run(settings, shape, run_budget(settings, host_gb=host, gpu_gb=HELD_GIB))
    plans = {n: run_plan if n is None or n == run_plan.resident_layers else
             plan_at_resident(run_plan, settings, shape, n) for n in set(counts)}
    return [dict(gpu=p.gpu_peak_gib, host=p.host_peak_gib, resident=p.resident_layers, layers=p.layers, step=p.step_s,
                 speculative=p.speculative_clipping, notes=p.notes)
            for p in map(plans.get, counts)]


def within(pred: float, meas: float, at_limit: bool = False) -> bool:
    """`at_limit`: `meas` is a lower bound of the need (see the module docstring)."""
    bound = max(0.5, 0.05 * meas)
    return pred >= meas - bound if at_limit else abs(pred - meas) <= bound


def table() -> list[dict]:
    out = []
    for label, fname, run_id, system, seq, resident, *model in CASES:
        row = find_row(fname, run_id, system, seq, resident, *model)
        start = resident
        if resident == "final":
            start, resident = (row["extra"]["resident_layers"][k] for k in ("planned", "final"))
        p, at_start = predict(row, resident, start)
        # the host peak is a high-water mark: layer swap pinned the starting count's layers first
        p["host"] = max(p["host"], at_start["host"])
        retries = (row["extra"].get("allocator") or {}).get("num_alloc_retries") or 0
        out.append(dict(label=label, run=run_id, row=row, pred=p, retries=retries,
                        gpu_ok=within(p["gpu"], row["peak_reserved_gib"], at_limit=retries > 0),
                        host_ok=within(p["host"], row["host_peak_gib"])))
    return out


def main() -> None:
    print("| run | case | resident | GPU peak pred / meas (err) | host peak pred / meas (err) | within bound |")
    print("|" + " --- |" * 6)
    for c in table():
        r, p = c["row"], c["pred"]

        def cell(a, b):
            return f"{a:.2f} / {b:.2f} ({(a - b) / b:+.1%})"

        at_limit = f"; allocator at the limit, need >= it ({c['retries']} retries, {r['peak_alloc_gib']:.2f} " \
            "allocated)" if c["retries"] else ""
        verdict = "yes" if c["gpu_ok"] and c["host_ok"] else "NO (known)" if (c["run"], c["label"]) in OUTSIDE else "NO"
        print(f"| {c['run']} | {c['label']} | {p['resident']} of {p['layers']} | "
              f"{cell(p['gpu'], r['peak_reserved_gib'])}{at_limit} | {cell(p['host'], r['host_peak_gib'])} | "
              f"{verdict} |")


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(HERE, "..", ".."))
    main()
