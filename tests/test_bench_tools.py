"""The benchmark's trace analysis (bench/analysis/trace_gaps.py) on a hand-made trace with known gaps."""
import gzip
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path[:0] = [str(BENCH / "analysis"), str(BENCH / "rows")]  # (scripts of bench/, imported from their folders)

import trace_gaps  # noqa: E402

from offload_trainer.trainer.run_history import run_history  # noqa: E402


def test_gaps_split_at_the_launch_and_cpu_time_attributed(tmp_path):
    names = ["mm", "Memcpy HtoD (Pinned -> Device)", "cudaLaunchKernel", "AccumulateGrad", "hook"]
    kinds = ["kernel", "gpu_memcpy", "cuda_runtime", "cpu_op"]
    ms = 1000.0  # the trace is in microseconds
    events = [
        [0, 0, 7, 0 * ms, 10 * ms, 1],     # compute: 0-10, 20-30, 50-60 ms
        [0, 0, 7, 20 * ms, 10 * ms, 2],
        [0, 0, 7, 50 * ms, 10 * ms, 3],
        [1, 1, 13, 0 * ms, 40 * ms, 4],    # a copy stream, busy 0-40 ms
        [2, 2, 99, 0 * ms, 0.01 * ms, 1],  # launches: kernel 2 at 18 ms (gap 10-20: 8 ms CPU, 2 ms dependency)
        [2, 2, 99, 17.99 * ms, 0.01 * ms, 2],
        [2, 2, 99, 5 * ms, 0.01 * ms, 3],  # kernel 3 launched before its gap (30-50: 20 ms dependency)
        [3, 3, 99, 9 * ms, 10 * ms, 10],   # the CPU: AccumulateGrad 9-19 ms holding a 10-17 ms hook
        [4, 3, 99, 10 * ms, 7 * ms, 11],
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"names": names, "kinds": kinds, "events": events}, f)
    r = trace_gaps.analyse(trace_gaps.load(str(path)))
    assert r["compute_stream"] == 7 and r["streams"][13]["role"] == "h2d"
    assert r["idle_waiting_for_cpu_ms"] == 8.0
    assert r["idle_waiting_for_other_streams_ms"] == 22.0
    assert r["compute_idle_ms"] == 30.0 and r["gaps_over_1ms"] == 2
    assert r["cpu_self_ms_while_gpu_waited"] == {"hook": 7.0, "AccumulateGrad": 1.0}
    assert r["streams"][7]["busy_ms"] == 30.0 and r["streams"][13]["last_end_ms"] == 40.0
    assert r["streams"][7]["timeline"][:3] == "## " and len(r["streams"][7]["timeline"]) == 13


def test_kernel_diff_finds_the_extra_kernel_on_the_compute_stream():
    names, kinds = ["gemm_a", "gemm_b", "copy"], ["kernel", "gpu_memcpy"]

    def trace(extra):
        ev = [[0, 0, 7, 10.0 * i, 1000.0, i] for i in range(4 + extra)]  # gemm_a on the compute stream, 1 ms each
        ev += [[1, 0, 7, 100.0, 500.0, 9], [2, 1, 13, 0.0, 9000.0, 10]]  # gemm_b the same in both; a long copy
        return {"names": names, "kinds": kinds, "events": ev}

    rows = trace_gaps.kernel_diff(trace(0), trace(2))
    assert rows[0] == {"kernel": "gemm_a", "count": [4, 6], "ms": [4.0, 6.0]}
    assert rows[1] == {"kernel": "gemm_b", "count": [1, 1], "ms": [0.5, 0.5]} and len(rows) == 2  # (no copy stream)


def test_inside_counts_what_ran_within_an_operators_spans():
    names = ["AccumulateGrad", "aten::copy_", "cudaMemcpyAsync", "aten::mm"]
    kinds = ["cpu_op", "cuda_runtime"]
    ev = [[0, 0, 1, 0.0, 100.0, 0], [0, 0, 1, 500.0, 300.0, 0],  # two hook spans on thread 1
          [1, 0, 1, 10.0, 20.0, 0], [1, 0, 1, 510.0, 20.0, 0], [2, 1, 1, 40.0, 6.0, 1],  # inside them
          [3, 0, 1, 200.0, 50.0, 0], [1, 0, 2, 20.0, 20.0, 0]]  # between the spans; inside in time, other thread
    r = trace_gaps.inside({"names": names, "kinds": kinds, "events": ev}, "AccumulateGrad", steps=2, top=5)
    assert r["spans_per_step"] == 1 and r["ms_per_step"] == 0.2
    assert r["inside_per_step"] == [{"name": "aten::copy_", "count": 1, "ms": 0.02},
                                    {"name": "cudaMemcpyAsync", "count": 0.5, "ms": 0.003}]


def test_around_a_gap_shows_what_each_stream_ran_and_what_ended_last():
    """Compute 0-10 and 30-40 ms (the gap: 10-30); an H2D stream copying, an update stream's kernels ending at 29 ms,
    the last before the compute stream went on; work long before the window is left out."""
    names = ["mm", "Memcpy HtoD (Pinned -> Device)", "_adamw8bit_kernel", "cudaLaunchKernel"]
    kinds = ["kernel", "gpu_memcpy", "cuda_runtime"]
    ms = 1000.0
    ev = [[0, 0, 7, 0, 5 * ms, 1], [0, 0, 7, 5 * ms, 5 * ms, 1], [0, 0, 7, 30 * ms, 5 * ms, 2],
          [0, 0, 7, 35 * ms, 5 * ms, 2],  # (the compute stream: the one with the most kernels)
          [1, 1, 13, -50 * ms, 5 * ms, 3],  # (before the window)
          [1, 1, 13, 5 * ms, 6 * ms, 4], [1, 1, 13, 11 * ms, 9 * ms, 5],
          [2, 0, 14, 12 * ms, 2 * ms, 6], [2, 0, 14, 16 * ms, 2 * ms, 7], [2, 0, 14, 26 * ms, 3 * ms, 8],
          [3, 2, 99, 9 * ms, 0.01 * ms, 2]]
    r = trace_gaps.around({"names": names, "kinds": kinds, "events": ev}, rank=0, before_ms=8)
    assert r["gap"]["start_ms"] == 10.0 and r["gap"]["ms"] == 20.0
    assert r["streams"][13]["runs"] == [{"name": "Memcpy HtoD (Pinned -> Device)", "count": 2, "from_ms": -5.0,
                                         "to_ms": 10.0, "busy_ms": 15.0}]
    assert r["streams"][14]["runs"] == [{"name": "_adamw8bit_kernel", "count": 3, "from_ms": 2.0, "to_ms": 19.0,
                                         "busy_ms": 7.0}]
    assert r["streams"][7]["role"] == "compute"
    assert r["streams"][7]["runs"] == [{"name": "mm", "count": 2, "from_ms": -10.0, "to_ms": 0.0, "busy_ms": 10.0}]
    assert r["last_to_end_before_it"] == {"stream": 14, "role": "kernels", "end_ms": 19.0}


def test_make_table_pairs_clipping_rows_with_native_clip(tmp_path, capsys):
    import make_table

    def row(system, tok):
        return dict(run_id="r", commit="c", model="m", system=system, gpus=1, gpu_cap_gib=24, seq_len=2048,
                    micro_batch=4, tokens_per_step=8192, tok_per_s=tok, step_s_median=1.0, peak_reserved_gib=1.0,
                    host_peak_gib=1.0, pinned_gib=1.0, error=None, extra={})

    rows = [row("native", 1000.0), row("offload_trainer_noclip", 900.0), row("native_clip", 800.0),
            row("offload_trainer", 600.0), row("offload_trainer_noclip", 850.0),
            dict(row("native_8bit", 500.0), run_id="r2"), dict(row("native_8bit_clip", 400.0), run_id="r2"),
            dict(row("offload_trainer", 300.0), run_id="r2"),
            dict(row("offload_trainer_cli", 700.0), extra={"argv": "c.yaml"}),
            dict(row("offload_trainer_cli_noclip", 800.0), extra={"argv": "c.yaml max_grad_norm=0"})]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    make_table.main([str(path)])
    out = capsys.readouterr().out.splitlines()
    ratios = [line.split(" | ")[7] for line in out if line.startswith(("| r |", "| r2 |"))]
    # clipping vs native_clip (or torchao's 8-bit AdamW on the GPU with clipping), the others vs native
    assert ratios == ["1.000", "0.900", "0.800", "0.750", "0.850", "1.000", "0.800", "0.750", "0.875", "0.800"]
    cli_row = next(line for line in out if "| offload_trainer_cli_noclip |" in line)
    assert "`offload-trainer train c.yaml max_grad_norm=0` (HF Trainer, allocator default)" in cli_row


@pytest.mark.slow
def test_trainer_bench_row_comes_from_the_trainers_step_logs(tmp_path, monkeypatch, capsys):
    import trainer_bench

    out, rows = tmp_path / "out", tmp_path / "rows.jsonl"
    trace = tmp_path / "trace.json.gz"
    monkeypatch.setattr(sys, "argv", ["trainer_bench.py", "configs/tiny-cpu.yaml", "max_steps=9", "logging_steps=1",
                                      f"output_dir={out}", "save_steps=100", "eval_fraction=0", "--out", str(rows),
                                      "--profile-steps", "2", "--trace", str(trace), "--cprofile"])
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # (the command sets it; undone after the test)
    from offload_trainer import trainer as trainer_module

    plain = trainer_module.OffloadTrainer
    trainer_bench.main()
    assert trainer_module.OffloadTrainer is plain
    row = json.loads(rows.read_text())
    logs = [x for x in run_history(str(out)) if "tok_per_s" in x]
    assert [x["step"] for x in logs] == list(range(1, 10))
    # steps 3-4 profiled, the trace written and step 5 under cProfile in the next: left out of the median
    middle = sorted(x["tok_per_s"] for x in logs[5:])[1:3]
    assert row["tok_per_s"] == round(sum(middle) / 2, 1) and row["extra"]["steps_left_out"] == [3, 4, 5]
    assert row["step_s_median"] == pytest.approx(1024 / row["tok_per_s"], abs=2e-4) and row["error"] is None
    assert row["system"] == "offload_trainer_cli" and row["extra"]["losses"] == [x["loss"] for x in logs]
    assert row["host_peak_gib"] > 0
    # the Trainer plans GPU memory and time: on a GPU the row carries its plan, here (no GPU) there is none
    assert ("predicted" in row) == torch.cuda.is_available()
    assert row["extra"]["activation_offload"] is False  # (tiny-cpu.yaml: no gradient checkpointing to offload)
    # steps 3 and 4 profiled (CPU only here): the Trainer's own calls are among the top CPU ops, the trace written
    prof = row["extra"]["profile"]
    assert prof["profiled_steps"] == 2 and prof["profiled_step_ms"] > 0 and prof["gpu_idle_ms"] is None
    assert any("aten::" in k for k in prof["top_self_cpu_ms"]) and trace.stat().st_size > 0
    # step 5 under cProfile: the Trainer's training step is among the functions with the most cumulative time
    top = row["extra"]["cprofile_top_ms"]
    assert any(k.endswith(" training_step") for k in top["total_ms"]), list(top["total_ms"])
    assert all(len(v) == 3 and v[2] >= v[1] >= 0 for v in top["own_ms"].values())


def test_trainer_bench_takes_logs_at_one_interval_only():
    import trainer_bench

    logs = [{"step": s, "loss": 1.0, "tok_per_s": t} for s, t in ((2, 1.0), (4, 10.0), (6, 20.0), (8, 30.0))]
    row = trainer_bench.row_from_logs(logs, skip=1, tokens_per_step=8)  # each log's tok/s covers its two steps
    assert row["tok_per_s"] == 20.0 and row["step_s_median"] == 0.4 and row["extra"]["steps_per_log"] == 2
    for steps in ((1, 2, 4), (2, 3, 4)):
        logs = [{"step": s, "loss": 1.0, "tok_per_s": 10.0} for s in steps]
        with pytest.raises(ValueError, match="one interval"):
            trainer_bench.row_from_logs(logs, skip=1, tokens_per_step=8)


@pytest.mark.slow
def test_integrations_bench_rows_for_the_command_and_trl(tmp_path):
    """bench/rows/integrations.py end to end on a CPU for the two tools this environment has: the command and TRL's
    OffloadSFTTrainer read the same chat records with the same template and seed, so each step trains the same tokens
    (every row truncated to the step's length) and the losses are equal; the rows carry what the table compares."""
    import os
    import subprocess

    bench = str(BENCH / "rows" / "integrations.py")
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "2"}
    base, work, out = tmp_path / "base", tmp_path / "work", tmp_path / "rows.jsonl"

    def started(*args):
        return subprocess.Popen([sys.executable, bench, *map(str, args)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def finished(proc):
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        return stdout

    def bench_cmd(*args):
        return finished(started(*args))

    bench_cmd("base", base, "--model", "tiny-llama")
    bench_cmd("prepare", base, work, "--seq", 48, "--batch", 2, "--steps", 3, "--cpu", "--model", "tiny-llama")
    # the two tools side by side, each to its own rows file; the table reads both, ours first
    runs = {tool: started("run", tool, work, "--out", tmp_path / f"{tool}.jsonl", "--skip", 1)
            for tool in ("ours", "trl")}
    for run in runs.values():
        finished(run)
    out.write_text("".join((tmp_path / f"{tool}.jsonl").read_text() for tool in runs))
    ours, trl = [json.loads(x) for x in out.read_text().splitlines()]
    assert (ours["system"], trl["system"]) == ("offload_trainer", "trl+offload_trainer")
    for r in (ours, trl):
        assert r["error"] is None and r["tok_per_s"] > 0 and len(r["extra"]["losses"]) == 3
        assert r["tokens_per_step"] == 96
    assert trl["extra"]["losses"] == pytest.approx(ours["extra"]["losses"], rel=1e-4)
    assert "largest difference to offload_trainer's over 3 steps" in bench_cmd("table", out)


def _write_trace(path, names, kinds, events):
    with gzip.open(path, "wt") as f:
        json.dump({"names": names, "kinds": kinds, "events": events}, f)
    return str(path)


def test_budget_lines_add_up_to_the_step_and_name_what_the_gpu_waited_for(tmp_path):
    import budget

    ms = 1000.0
    names = ["sm90_xmma_gemm_bf16", "flash_fwd_kernel", "vectorized_elementwise_kernel", "Memcpy HtoD (Pinned -> Device)",
             "cudaLaunchKernel", "cudaStreamSynchronize", "aten::add", "Optimizer.step#AdamW.step", "_adamw8bit_kernel"]
    kinds = ["kernel", "gpu_memcpy", "cuda_runtime", "cpu_op"]
    events = [
        [0, 0, 7, 0 * ms, 10 * ms, 1], [1, 0, 7, 20 * ms, 10 * ms, 2], [2, 0, 7, 50 * ms, 10 * ms, 3],  # compute
        [3, 1, 13, 0 * ms, 45 * ms, 4],                  # a copy stream, busy 0-45 ms
        [4, 2, 99, 0 * ms, 0.01 * ms, 1],                # kernel 2 launched at 18 ms: gap 10-20 is 8 ms CPU, 2 ms not
        [4, 2, 99, 17.99 * ms, 0.01 * ms, 2],
        [4, 2, 99, 5 * ms, 0.01 * ms, 3],                # kernel 3 launched long before its gap (30-50): the copy's
        [5, 2, 99, 10 * ms, 4 * ms, 20],                 # the CPU in a sync 10-14 ms,
        [6, 3, 99, 14 * ms, 2 * ms, 21],                 # an op 14-16 ms launching for 0.5 ms, then Python 16-18 ms
        [4, 2, 99, 15 * ms, 0.5 * ms, 22],
        [7, 0, 7, 0 * ms, 60 * ms, 23],                  # an annotation drawn on the compute stream: not a kernel
        [8, 0, 14, 2 * ms, 3 * ms, 24],                  # our update kernel, 2-5 ms, beside the first matmul
    ]
    b = budget.budget(budget.load(_write_trace(tmp_path / "ours.json.gz", names, kinds, events)))
    lines = b["lines"]
    assert b["step_ms"] == 60.0 and sum(lines.values()) == pytest.approx(60.0, abs=0.05)
    assert (lines["compute: matmul"], lines["compute: attention"], lines["compute: other kernels"]) == (10, 10, 10)
    assert lines["idle, waiting for stream: h2d"] == 20.0 and lines["idle, waiting for stream: update"] == 2.0
    assert b["compute_beside_update_kernels_ms"] == 3.0 and b["other_streams_busy_ms"]["update"] == 3.0
    assert lines["idle, waiting for the CPU: host sync"] == 4.0
    assert lines["idle, waiting for the CPU: torch ops"] == 1.5
    assert lines["idle, waiting for the CPU: CUDA runtime (launches, events)"] == pytest.approx(0.51, abs=0.01)
    assert lines["idle, waiting for the CPU: Python outside ops"] == pytest.approx(1.99, abs=0.01)

    # ours beside a bare loop of the same case: the differences add up to the profiled steps' difference
    native = _write_trace(tmp_path / "native.json.gz", names, kinds,
                          [[0, 0, 7, 0, 10 * ms, 1], [1, 0, 7, 10 * ms, 10 * ms, 2], [2, 0, 7, 20 * ms, 10 * ms, 3]])

    def row(system, step_s, trace):
        return dict(run_id="r", model="m", seq_len=8, micro_batch=1, grad_accum=1, system=system, error=None,
                    tok_per_s=8 / step_s, step_s_median=step_s, extra={"trace": trace, "argv": system})

    rows = [row("native", 0.031, native), row("offload_trainer_cli_noclip", 0.062, str(tmp_path / "ours.json.gz")),
            row("native_clip", 0.031, native)]  # (a clipping reference: another case)
    (entry,) = budget.tables(rows)
    (ref,) = entry["references"]
    assert ref["system"] == "native" and ref["profiled_difference_ms"] == 30.0
    assert sum(ref["difference_ms"].values()) == pytest.approx(30.0, abs=0.05)
    assert ref["measured_difference_ms"] == 31.0 and ref["residual_ms"] == 1.0
    assert "| idle, waiting for stream: h2d | 20.0 | 0.0 | +20.0 |" in budget.markdown(entry)


def test_trainer_bench_stock_runs_the_plain_trainer_with_the_commands_logs(tmp_path, monkeypatch):
    import trainer_bench
    import transformers

    from offload_trainer.trainer import OffloadMixin

    rows, made = tmp_path / "rows.jsonl", []
    make = trainer_bench.stock_trainer_class
    monkeypatch.setattr(trainer_bench, "stock_trainer_class", lambda base: made.append(make(base)) or made[-1])
    built, train = [], transformers.Trainer.train
    monkeypatch.setattr(transformers.Trainer, "train", lambda self, *a, **k: built.append(self) or train(self, *a, **k))
    monkeypatch.setattr(sys, "argv", ["trainer_bench.py", "configs/tiny-cpu.yaml", "--stock", "offload_optimizer=false",
                                      "optim=adamw_torch", "max_steps=4", "logging_steps=1", "max_grad_norm=0",
                                      f"output_dir={tmp_path / 'out'}", "save_steps=100", "eval_fraction=0",
                                      "--skip", "1", "--out", str(rows)])
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    trainer_bench.main()
    row = json.loads(rows.read_text())
    assert row["system"] == "trainer_native" and row["error"] is None and row["tok_per_s"] > 0
    assert row["extra"]["max_grad_norm"] == 0 and len(row["extra"]["losses"]) == 4
    # the Trainer that trained: the stock one (none of ours in its classes), its optimizer torch's own AdamW
    (trainer,) = built
    assert isinstance(trainer, made[0]) and not isinstance(trainer, OffloadMixin)
    assert type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer) \
        is torch.optim.AdamW


def test_every_bench_path_named_exists_and_every_script_is_in_bench_readme():
    """bench/ is grouped by kind (runs, rows, mechanisms, analysis): the commands and prose that tell how to run it
    (READMEs, docs, scripts, configs, tests and bench/ itself) name files that exist, and bench/README.md lists every
    script."""
    import re
    import subprocess

    root = BENCH.parent
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    texts = [p for p in tracked if p.split("/")[0] in ("bench", "docs", "scripts", "configs", "tests", "README.md")
             and p.endswith((".md", ".py", ".sh", ".yaml", ".ipynb")) and not p.startswith("bench/results/20")]
    # (a path under another root, such as `$root/bench/...` of an older checkout, is not this checkout's)
    named = {m for p in texts for m in re.findall(r"(?<![\w/.$-])bench/[\w/]+\.(?:py|sh)\b", (root / p).read_text())}
    assert len(named) > 20 and {n for n in named if not (root / n).is_file()} == set()
    scripts = {p.removeprefix("bench/") for p in tracked if p.startswith("bench/") and p.endswith((".py", ".sh"))}
    listed = (BENCH / "README.md").read_text()
    assert {s for s in scripts if f"`{s}`" not in listed} == set()


def test_by_launcher_names_the_autograd_node_that_recomputed_a_forward_op():
    """Kernel time by what launched it: a matmul launched in forward under aten::linear, the same matmul launched
    again inside a loss node's backward (a recompute), and a softmax kernel there; per step over two steps."""
    names = ["gemm", "softmax_bwd", "cudaLaunchKernel", "aten::linear", "aten::mm",
             "autograd::engine::evaluate_function: NllLossBackward0"]
    kinds = ["kernel", "cuda_runtime", "cpu_op"]
    ev = [[0, 0, 7, 100.0, 4000.0, 1], [0, 0, 7, 5000.0, 4000.0, 2], [1, 0, 7, 9500.0, 1000.0, 3],  # compute stream
          [2, 1, 1, 10.0, 5.0, 1], [2, 1, 1, 60.0, 5.0, 2], [2, 1, 1, 80.0, 5.0, 3],  # launches on thread 1
          [3, 2, 1, 0.0, 20.0, 0], [4, 2, 1, 5.0, 12.0, 0],  # forward: aten::linear > aten::mm
          [5, 2, 1, 50.0, 40.0, 0], [3, 2, 1, 55.0, 15.0, 0], [4, 2, 1, 57.0, 10.0, 0]]  # backward node > linear > mm
    rows = trace_gaps.launched_by({"names": names, "kinds": kinds, "events": ev}, steps=2, top=5)
    assert rows == [
        {"launched_by": "backward: NllLossBackward0", "kernel": "gemm", "count": 0.5, "ms": 2.0},
        {"launched_by": "forward: aten::linear", "kernel": "gemm", "count": 0.5, "ms": 2.0},
        {"launched_by": "backward: NllLossBackward0", "kernel": "softmax_bwd", "count": 0.5, "ms": 0.5}]
