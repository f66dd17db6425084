"""Pictures of a run: loss, throughput and memory over steps, as PNG files in the output directory.

    offload-trainer report OUTPUT_DIR       (also written at the end of `offload-trainer train`)

Reads `trainer_state.json` (the run's log history): nothing else is needed, so it works on any finished or
interrupted run, and on runs of the plain Trainer too (fewer series).
"""
from __future__ import annotations

import glob
import json
import os

SERIES = {
    "loss.png": [("loss", "train loss"), ("eval_loss", "eval loss")],
    "throughput.png": [("tok_per_s", "tokens / s")],
    "memory.png": [("gpu_peak_gib", "GPU peak GiB"), ("host_pinned_gib", "host pinned GiB"),
                   ("host_rss_gib", "host RSS GiB")],
}


def trainer_state(output_dir: str) -> dict:
    path = os.path.join(output_dir, "trainer_state.json")
    if not os.path.isfile(path):  # an interrupted run: the newest checkpoint's state
        ckpts = sorted(glob.glob(os.path.join(output_dir, "checkpoint-*", "trainer_state.json")),
                       key=lambda p: int(p.split("checkpoint-")[-1].split(os.sep)[0]))
        if not ckpts:
            raise FileNotFoundError(f"no trainer_state.json in {output_dir} or its checkpoints")
        path = ckpts[-1]
    with open(path) as f:
        return json.load(f)


def series(state: dict, key: str) -> tuple[list[int], list[float]]:
    pts = [(h["step"], h[key]) for h in state.get("log_history", []) if key in h and "step" in h]
    return [s for s, _ in pts], [v for _, v in pts]


def write_report(output_dir: str) -> list[str]:
    """Write the PNGs that have data; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    state = trainer_state(output_dir)
    written = []
    for name, keys in SERIES.items():
        lines = [(label, *series(state, key)) for key, label in keys]
        lines = [ln for ln in lines if ln[1]]
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        for label, xs, ys in lines:
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title(f"{os.path.basename(os.path.abspath(output_dir))}: {name[:-4]}")
        fig.tight_layout()
        path = os.path.join(output_dir, name)
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written
