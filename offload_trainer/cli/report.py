"""A run's report: a text summary, and loss, throughput and memory over steps as PNG files in the output directory.

    offload-trainer report OUTPUT_DIR       (also written at the end of `offload-trainer train`)

Reads `trainer_state.json` (the run's log history): nothing else is needed, so it works on any finished or
interrupted run, and on runs of the plain Trainer too (fewer series). From Python, `summary(trainer)` and
`write_report(output_dir, trainer)` read a live Trainer's state instead (a run that never saved has no file).
"""
from __future__ import annotations

import json
import os

from ..trainer.checkpoint import checkpoint_steps
from ..trainer.outputs import staged_save

SERIES = {
    "loss.png": [("loss", "train loss"), ("eval_loss", "eval loss")],
    "throughput.png": [("tok_per_s", "tokens / s")],
    "memory.png": [("gpu_peak_gib", "GPU peak GiB"), ("host_pinned_gib", "host pinned GiB"),
                   ("host_rss_gib", "host RSS GiB")],
}


def trainer_state(output_dir: str) -> dict:
    path = os.path.join(output_dir, "trainer_state.json")
    if not os.path.isfile(path):  # an interrupted run: the newest checkpoint's state
        names = checkpoint_steps(output_dir) if os.path.isdir(output_dir) else {}
        ckpts = [s for n in names if os.path.isfile(s := os.path.join(output_dir, n, "trainer_state.json"))]
        if not ckpts:
            raise FileNotFoundError(f"no trainer_state.json in {output_dir} or its checkpoints: a Python run writes it "
                                    f"with trainer.save_state() (offload-trainer train does), or report from the "
                                    f"script with offload_trainer.cli.report.summary(trainer)")
        path = ckpts[-1]
    with open(path) as f:
        return json.load(f)


def _state_of(source) -> dict:
    """A trainer_state dict from an output directory, a Trainer (its live state) or a state dict."""
    if isinstance(source, str):
        return trainer_state(source)
    state = getattr(source, "state", source)
    return {"log_history": list(getattr(state, "log_history", None) or state.get("log_history", []))}


def summary(source) -> str:
    """A few lines on a run: steps, loss from first to last, evaluation, throughput, memory, PCIe, stalls."""
    import statistics

    history = _state_of(source).get("log_history", [])
    train = [h for h in history if "loss" in h]
    if not train:
        return "no training logs yet (logging_steps sets how often the Trainer logs)"
    lines = [f"steps       {train[-1].get('step', '?')}, train loss {train[0]['loss']:.4f} -> {train[-1]['loss']:.4f}"]
    evals = [h["eval_loss"] for h in history if "eval_loss" in h]
    if evals:
        lines.append(f"eval loss   {evals[-1]:.4f}" + (f" (first {evals[0]:.4f})" if len(evals) > 1 else ""))

    def median(key, skip_first=True):
        vals = [h[key] for h in train[1 if skip_first and len(train) > 1 else 0:] if key in h]
        return statistics.median(vals) if vals else None

    def peak(key):
        vals = [h[key] for h in train if key in h]
        return max(vals) if vals else None

    tok = median("tok_per_s")
    if tok is not None:
        lines.append(f"throughput  {tok:,.0f} tok/s (median of the logs after the first)")
    mem = [f"{label} {v:.2f} GiB" for label, v in (("GPU peak", peak("gpu_peak_gib")),
                                                      ("host RSS", peak("host_rss_gib")),
                                                      ("pinned", peak("host_pinned_gib"))) if v is not None]
    if mem:
        lines.append("memory      " + ", ".join(mem))
    pcie, stall = median("pcie_gb_per_s"), sum(h.get("gpu_stall_ms", 0) for h in train)
    if pcie is not None:
        lines.append(f"PCIe        {pcie:.1f} GB/s (median); the GPU waited {stall:.0f} ms in all for copies")
    skipped = peak("nonfinite_skipped")
    if skipped:
        lines.append(f"non-finite  {skipped} optimizer steps skipped")
    return "\n".join(lines)


def series(state: dict, key: str) -> tuple[list[int], list[float]]:
    pts = [(h["step"], h[key]) for h in state.get("log_history", []) if key in h and "step" in h]
    return [s for s, _ in pts], [v for _, v in pts]


def write_report(output_dir: str, source=None) -> list[str]:
    """Write the PNGs that have data into `output_dir` (from its trainer_state.json, or `source`: a Trainer or a
    state dict); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    state = _state_of(source if source is not None else output_dir)
    title = os.path.basename(os.path.abspath(output_dir))
    written = []
    with staged_save(output_dir, "the plots") as staging:  # (moved into place, never written through a planted link)
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
            ax.set_title(f"{title}: {name[:-4]}")
            fig.tight_layout()
            fig.savefig(os.path.join(staging, name))
            plt.close(fig)
            written.append(os.path.join(output_dir, name))
    return written
