"""The product path, timed: `offload-trainer train CONFIG [key=value ...]` in this process (CLI -> planner ->
OffloadTrainer -> HF Trainer's loop), then one row in the format of ../shared/reference/RESULTS.md from its logs.

    python bench/rows/trainer_bench.py configs/llama3-8b-full-24gb.yaml max_steps=10 --out rows.jsonl

step_bench.py times the mechanisms in a bare loop; this times what a user runs: the Trainer's data loader,
logging (every step with `logging_steps: 1`) and the allocator as the user gets it (this script sets no
PYTORCH_CUDA_ALLOC_CONF; the command sets expandable segments, in the running allocator too, unless one is set, and
the row records which).
tok/s and step time: the median of the logs after the first `--skip` (each log's tok/s covers the `logging_steps`
steps since the previous log; with 1, per-step figures), less the profiled steps. Memory: the process's peaks (host:
VmHWM, which includes the saves at the end).
--stock: the stock `transformers.Trainer` in OffloadTrainer's place (row system `trainer_native`): what a user with
a big GPU runs, same config, data and logging, e.g. `offload_optimizer=false optim=adamw_torch_fused
gpu_memory_limit_gb=` on the uncapped GPU.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import time

import torch

from transformers import TrainerCallback

from row_helpers import allocator_counts, cprofile_top, finish_row, machine, predicted, profile_summary


class ProfileSteps(TrainerCallback):
    """Profile `steps` optimizer steps of the Trainer's loop from step `first` on (CPU ops, and CUDA kernels and
    copies where there is a GPU), as step_bench.py profiles its bare loop: `summary` holds the same figures
    (compute-stream idle time, each stream's busy time, top CPU ops); `trace` is written for
    bench/analysis/trace_gaps.py and bench/analysis/budget.py. The window runs from one step's beginning to the
    beginning of the step `steps` later, so each profiled step brings its whole period: its log (with its syncs) and
    the next batch's loading included."""

    def __init__(self, first: int, steps: int, trace: str | None = None):
        self.first, self.steps, self.trace = first, steps, trace
        self.prof, self.summary, self._t0 = None, None, 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        if self.prof is None and state.global_step == self.first:
            self._start()
        elif self.prof is not None and self.summary is None and state.global_step == self.first + self.steps:
            self._stop()

    def on_train_end(self, args, state, control, **kwargs):  # (the run ended inside the window: its last steps)
        if self.prof is not None and self.summary is None:
            self.steps = max(1, state.global_step - self.first)
            self._stop()

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
        self.prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
        self.prof.__enter__()
        self._t0 = time.perf_counter()

    def _stop(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = (time.perf_counter() - self._t0) / self.steps
        self.prof.__exit__(None, None, None)
        self.summary = profile_summary(self.prof, wall, self.steps, self.trace)


class CProfileStep(TrainerCallback):
    """cProfile of the Trainer's loop from the beginning of step `at` to the beginning of the next (its data, forward,
    backward, optimizer step, logs and callbacks), the device synchronized at both ends: `summary` holds the functions
    with the most own and the most cumulative CPU time."""

    def __init__(self, at: int, top: int = 25):
        self.at, self.top, self.pr, self.summary = at, top, None, None

    def on_step_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available() and state.global_step in (self.at, self.at + 1):
            torch.cuda.synchronize()
        if state.global_step == self.at + 1 and self.pr is not None and self.summary is None:
            self.pr.disable()
            self.summary = {"own_ms": cprofile_top(self.pr, self.top, "own"),
                            "total_ms": cprofile_top(self.pr, self.top, "total")}
        elif state.global_step == self.at and self.pr is None:
            import cProfile

            self.pr = cProfile.Profile()
            self.pr.enable()


def stock_trainer_class(base):
    """`transformers.Trainer` as a user with a big GPU runs it (its own optimizer from `optim`, the model's own loss,
    no plan), built by the command in OffloadTrainer's place, so config, data, collator and model are the command's;
    its training logs get the command's figures (tok/s, memory: run_logs.add_run_figures), measured alike."""
    from offload_trainer.settings import OffloadSettings
    from offload_trainer.trainer import run_logs
    from offload_trainer.trainer.run_state import LogCounters, RunState

    class StockTrainer(base):
        def __init__(self, *args, offload_plan=None, offload_settings=None, **kwargs):
            super().__init__(*args, **kwargs)
            self._run = RunState(OffloadSettings())  # (its log counters; nothing of ours is built)

        def hand_back_model(self):  # (nothing of ours is on it)
            return self.model

        def train(self, *args, **kwargs):
            self._run.log = LogCounters()
            return super().train(*args, **kwargs)

        def training_step(self, model, inputs, num_items_in_batch=None):
            self._run.log.tokens += int(inputs["input_ids"].numel())
            return super().training_step(model, inputs, num_items_in_batch)

        def log(self, logs, start_time=None):
            if "loss" in logs:
                run_logs.add_run_figures(self._run, logs, self.state.global_step)
            super().log(logs, start_time)

    return StockTrainer


def row_from_logs(logs: list[dict], *, skip: int, tokens_per_step: int, leave_out: range = range(0)) -> dict:
    """tok/s and step time from the Trainer's training logs (those with a loss), after the first `skip` logs and but
    the steps in `leave_out` (profiled ones): each log's tok/s covers the steps since the previous one, so the logs
    must come at one interval (`logging_steps`; 1 gives per-step figures); the last log's pinned bytes and the
    largest GPU stall."""
    train = [x for x in logs if "loss" in x and "tok_per_s" in x]
    steps = [x["step"] for x in train]
    every = {b - a for a, b in zip(steps, steps[1:])}
    if len(every) > 1 or (train and steps[0] not in every | {1}):
        raise ValueError(f"the logs must come at one interval (logging_steps), logged at steps {steps}")
    timed = [x for x in train[skip:] if x["step"] not in leave_out]
    if not timed:
        raise ValueError(f"{len(train)} training logs, none after the first {skip}: run more steps")
    tok_s = statistics.median(x["tok_per_s"] for x in timed)
    return dict(tok_per_s=round(tok_s, 1), step_s_median=round(tokens_per_step / tok_s, 4),
                pinned_gib=timed[-1].get("host_pinned_gib"),
                extra=dict(steps_per_log=steps[0], tok_per_s_logged=[x["tok_per_s"] for x in train],
                           losses=[x["loss"] for x in train],
                           grad_norms=[x.get("grad_norm") for x in train],
                           clip_rates=[x.get("clip_rate") for x in train],
                           host_rss_logged_max_gib=max((x.get("host_rss_gib", 0.0) for x in train), default=None),
                           gpu_stall_ms_max=max((x.get("gpu_stall_ms", 0.0) for x in timed), default=None),
                           pcie_gb_per_s=statistics.median(x.get("pcie_gb_per_s", 0.0) for x in timed)))


class FitLines(logging.Handler):
    """The log's `layer swap:` lines (the fit's measurements and moves)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        if record.getMessage().startswith("layer swap:"):
            self.lines.append(record.getMessage())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--skip", type=int, default=2, help="step logs left out of the median (compilation, warm-up)")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="profile this many steps of the Trainer's loop after the --skip first (0: none)")
    ap.add_argument("--trace", default=None, help="with --profile-steps: write the events here (gzipped JSON)")
    ap.add_argument("--cprofile", action="store_true",
                    help="cProfile one step after the --skip first and the profiled ones: top Python functions")
    ap.add_argument("--system", default=None, help="the row's system (default: offload_trainer_cli[_noclip...]); e.g. "
                    "native_8bit for the same command with offload_optimizer=false optim=adamw_torch_8bit, uncapped")
    ap.add_argument("--stock", action="store_true",
                    help="the stock transformers.Trainer in OffloadTrainer's place (system trainer_native; give it "
                         "offload_optimizer=false and the optim to run, e.g. adamw_torch_fused, uncapped)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--run-id", default=os.environ.get("RUN_ID", "adhoc"))
    a = ap.parse_intermixed_args()  # (flags before or after the key=value overrides)

    from offload_trainer.cli import main as cli_main
    from offload_trainer.cli.config import load_config, parse_args
    from offload_trainer.trainer.run_history import run_history

    model_args, data_args, args = parse_args(load_config(a.config, a.overrides))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tokens = world * args.gradient_accumulation_steps * args.per_device_train_batch_size * data_args.max_seq_length
    clip = args.max_grad_norm and args.max_grad_norm > 0
    row = dict(run_id=a.run_id, commit=os.environ.get("COMMIT", "unknown"),
               machine=machine(),
               model=model_args.model_config or model_args.model_name_or_path,
               method="lora" if model_args.lora_r else "full",
               system="offload_trainer_cli" + ("" if clip else "_noclip") + ("_liger" if args.use_liger_kernel else ""),
               gpus=world,
               gpu_cap_gib=args.gpu_memory_limit_gb, seq_len=data_args.max_seq_length,
               micro_batch=args.per_device_train_batch_size, grad_accum=args.gradient_accumulation_steps,
               tokens_per_step=tokens, tok_per_s=None, step_s_median=None, peak_alloc_gib=None,
               peak_reserved_gib=None, host_peak_gib=None, pinned_gib=None, error=None,
               extra=dict(argv=" ".join([a.config, *a.overrides]), max_grad_norm=args.max_grad_norm))
    if a.stock:
        row["system"] = "trainer_native" + ("_8bit" if "8bit" in str(getattr(args.optim, "value", args.optim)) else "")
    if a.system:
        row["system"] = a.system
    said = FitLines()
    logging.getLogger("offload_trainer").addHandler(said)
    profiler = ProfileSteps(a.skip, a.profile_steps, a.trace) if a.profile_steps else None
    cprof = CProfileStep(a.skip + a.profile_steps) if a.cprofile else None
    callbacks = [c for c in (profiler, cprof) if c is not None]
    from offload_trainer import trainer as trainer_module

    plain = trainer_module.OffloadTrainer
    built = []
    if a.stock:
        import transformers

        base = stock_trainer_class(transformers.Trainer)
    else:
        base = plain

    class BenchTrainer(base):  # what `offload-trainer train` builds, kept (for its plan), with the profilers added
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)
            for c in callbacks:
                self.add_callback(c)

    trainer_module.OffloadTrainer = BenchTrainer
    t0 = time.perf_counter()
    try:
        rc = cli_main(["train", a.config, *a.overrides])
        if rc:
            row["error"] = f"offload-trainer exited with {rc}"
        else:
            logs = run_history(args.output_dir)  # (the Trainer's log history with our figures: tok/s, memory)
            extra = row["extra"]
            # (the profiled steps ran slower, and the next one writes the trace or runs under cProfile: left out)
            slowed = range(a.skip + 1, a.skip + 2 + a.profile_steps) if a.profile_steps or a.cprofile else range(0)
            row.update(row_from_logs(logs, skip=a.skip, tokens_per_step=tokens, leave_out=slowed))
            row["extra"]["steps_left_out"] = list(slowed)
            row["extra"] = {**extra, **row["extra"]}
    except torch.OutOfMemoryError as e:
        row["error"] = "OOM: " + str(e).split("\n")[0][:160]
    finally:
        trainer_module.OffloadTrainer = plain
    if built:
        row["extra"]["activation_offload"] = bool(built[0]._run.want_activations)  # (read by make_table)
        opt = built[0]._run.optimizer
        if opt is not None:  # (bytes over PCIe each way, updates queued)
            row["extra"]["optimizer_stats"] = dict(opt.stats)
        if opt is not None and opt.speculative:  # clipped speculatively: what the clip did over the run
            row["system"] = row["system"].replace("offload_trainer_cli", "offload_trainer_cli_speculative")
            row["extra"]["clip_counts"] = opt.clip_counts
        run = built[0]._run
        row["extra"]["fold"] = run.fold.size if run.fold is not None else 1  # (the micro-batches run as one)
        if run.plan is not None:  # the Trainer's own plan (its host peak counts a save's shard)
            row["predicted"] = predicted(run.plan)
        if run.swap is not None:  # layer swap: the plan's resident layers, those the fit moved to, and the plan's
            # prediction for the count the run ended with (the measured peaks are those of that count)
            final = run.swap.resident
            row["extra"]["resident_layers"] = {"planned": run.plan.resident_layers if run.plan else None, "final": final}
            row["extra"]["fit"] = said.lines
            if run.plan is not None and final != run.plan.resident_layers:
                from offload_trainer.planner import plan_at_resident, run_shape

                shape = run_shape(built[0].model.config, data_args.max_seq_length, model_args)
                row["predicted"] = {**predicted(plan_at_resident(run.plan, run.settings, shape, final)),
                                    "resident_layers": final}
    row["extra"]["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")  # (the command sets one if unset)
    if profiler is not None:  # (its steps are left out of the median: profiling slows them a little)
        row["extra"]["profile"] = profiler.summary
        row["extra"]["trace"] = a.trace
    if cprof is not None:
        row["extra"]["cprofile_top_ms"] = cprof.summary
    row["extra"]["wall_s"] = round(time.perf_counter() - t0, 1)
    if torch.cuda.is_available():  # over the whole run: a retry frees cached blocks after a device-wide sync
        row["extra"]["allocator"] = allocator_counts()
    finish_row(row, a.out)


if __name__ == "__main__":
    main()
