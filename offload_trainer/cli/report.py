"""A run's report: a text summary, and loss, throughput and memory over steps as PNG files in the output directory.

    offload-trainer report OUTPUT_DIR       (also written at the end of `offload-trainer train`)
    offload-trainer report CONFIG.yaml      (the run of the config's output_dir)

Reads `trainer_state.json` (the run's log history) and `run_figures.json` (our figures of each training log:
trainer/run_history.py): nothing else is needed, so it works on any finished or interrupted run, and on runs of the
plain Trainer too (fewer series). From Python, `summary(trainer)` and `write_report(output_dir, trainer)` read a live
Trainer's state instead (a run that never saved has no file).
"""
from __future__ import annotations

import logging

import os

from ..errors import ConfigError
from ..trainer.outputs import staged_save
from ..trainer.run_history import run_history

logger = logging.getLogger("offload_trainer")

SERIES = {
    "loss.png": [("loss", "train loss"), ("eval_loss", "eval loss")],
    "throughput.png": [("tok_per_s", "tokens / s")],
    "memory.png": [("gpu_peak_gib", "GPU peak GiB"), ("host_pinned_gib", "host pinned GiB"),
                   ("host_rss_gib", "host RSS GiB")],
}


def run_dir(path: str) -> str:
    """What `offload-trainer report PATH` reads: a run's output_dir (or a checkpoint of it) as given, or, for the
    config that trained it, the output_dir it names."""
    if not os.path.isfile(path):
        return path
    if not path.lower().endswith((".yaml", ".yml")):
        raise ConfigError(f"report reads a run's output_dir, one of its checkpoints, or the config that trained it "
                          f"(.yaml): {path!r} is another file")
    from .config import DEFAULT_OUTPUT_DIR
    from .earlier_run import configured_output_dir

    return configured_output_dir(path, []) or DEFAULT_OUTPUT_DIR


def history(source) -> list[dict]:
    """A run's log history with our figures in its training logs, from an output directory or a Trainer (its live
    state: run_history), or a trainer_state dict."""
    if isinstance(source, dict):
        return list(source.get("log_history", []))
    return run_history(source)


def summary(source) -> str:
    """A few lines on a run: steps, loss from first to last, evaluation, throughput, memory, PCIe, stalls."""
    import statistics

    logs = history(source)
    train = [h for h in logs if _number(h.get("loss"))]
    if not train:
        return "no training logs yet (logging_steps sets how often the Trainer logs)"
    lines = [f"steps       {train[-1].get('step', '?')}, train loss {train[0]['loss']:.4f} -> {train[-1]['loss']:.4f}"]
    evals = [h["eval_loss"] for h in logs if _number(h.get("eval_loss"))]
    if evals:
        lines.append(f"eval loss   {evals[-1]:.4f}" + (f" (first {evals[0]:.4f})" if len(evals) > 1 else ""))

    def median(key, skip_first=True):
        vals = [h[key] for h in train[1 if skip_first and len(train) > 1 else 0:] if _number(h.get(key))]
        return statistics.median(vals) if vals else None

    def peak(key):
        vals = [h[key] for h in train if _number(h.get(key))]
        return max(vals) if vals else None

    tok = median("tok_per_s")
    if tok is not None:
        lines.append(f"throughput  {tok:,.0f} tok/s (median of the logs after the first)")
    mem = [f"{label} {v:.2f} GiB" for label, v in (("GPU peak", peak("gpu_peak_gib")),
                                                      ("host RSS", peak("host_rss_gib")),
                                                      ("pinned", peak("host_pinned_gib"))) if v is not None]
    if mem:
        lines.append("memory      " + ", ".join(mem))
    pcie, stall = median("pcie_gb_per_s"), sum(h["gpu_stall_ms"] for h in train if _number(h.get("gpu_stall_ms")))
    if pcie is not None:
        lines.append(f"PCIe        {pcie:.1f} GB/s (median); the GPU waited {stall:.0f} ms in all for copies")
    skipped = peak("nonfinite_skipped")
    if skipped:
        lines.append(f"non-finite  {skipped} optimizer steps skipped")
    return "\n".join(lines)


def _number(x) -> bool:  # (a hand-edited or damaged history may hold anything: it is left out of the figures)
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def series(logs: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(h["step"], h[key]) for h in logs if _number(h.get(key)) and _number(h.get("step"))]
    return [s for s, _ in pts], [v for _, v in pts]


def write_report(output_dir: str, source=None) -> list[str]:
    """Write the PNGs that have data into `output_dir` (from its trainer_state.json and run_figures.json, or
    `source`: a Trainer or a state dict); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logs = history(source if source is not None else output_dir)
    title = os.path.basename(os.path.abspath(output_dir))
    written = []
    with staged_save(output_dir, "the plots") as staging:  # (moved into place, never written through a planted link)
        for name, keys in SERIES.items():
            lines = [(label, *series(logs, key)) for key, label in keys]
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


def log_summary_and_plots(output_dir: str) -> None:
    """The end of `offload-trainer train`: the run's summary in the log, and its plots written (each named)."""
    logger.info("run:\n%s", summary(output_dir))

    try:
        for path in write_report(output_dir):
            logger.info("plot: %s", path)
    except ImportError:
        logger.warning("no plots: matplotlib is not installed (pip install matplotlib)")
