"""One training-step benchmark row: a random-init model shape, one system, on one GPU.

    python bench/rows/step_bench.py SYSTEM MODEL [--bs 4] [--seq 2048] [--cap 24] [--steps 6] [--out rows.jsonl]

SYSTEM:
  native               all on the GPU, torch fused AdamW, full-logits loss (no cap)
  native_clip          the same with clip_grad_norm_(1.0) (what HF Trainer does by default)
  native_8bit          all on the GPU, torchao AdamW8bit (for shapes whose fp32 AdamW states exceed the GPU)
  native_8bit_clip     the same with clip_grad_norm_(1.0)
  offload_trainer      StreamedAdamW8bit, exact clipping at 1.0, gradients offloaded, chunked loss
  offload_trainer_noclip  StreamedAdamW8bit, updates during backward (max_grad_norm 0), chunked loss
  torchao_cpu_offload  torchao CPUOffloadOptimizer(AdamW fused, offload_gradients=True)

All systems: bf16 weights, SDPA, non-reentrant gradient checkpointing, random tokens, labels = inputs.
--liger (native systems): Liger's kernels on the model as use_liger_kernel applies them; the row's system gets
"_liger" (native_liger: the stock run a Liger user compares with).
--resident N|auto (offload_trainer systems): keep N decoder layers on the GPU and swap the others (swap.py);
auto asks the planner. The model is built on the GPU before the cap is set, then the swapped layers move to
pinned host memory and the peak counters are reset: what a user gets by loading on the CPU, faster to set up.
Every system runs in its own process (run_all.sh), so caps and allocator state do not leak between rows.

Data parallel: launch with `torchrun --nproc_per_node N bench/rows/step_bench.py offload_trainer...`; each rank
takes its own micro-batches of the step (`--accum` per rank) and owns a shard of the optimizer states
(distributed.py). Batches are drawn from a generator seeded by the step, so a 1-process run with
`--accum N` sees exactly the micro-batches of an N-process run with `--accum 1` (the loss-match check).
The cap applies per GPU; host and pinned figures are summed over the node's ranks.
Writes one JSON row per run in the format of RESULTS.md (bench/results/).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

from offload_trainer.sysinfo import peak_rss_gib
from row_helpers import allocator_counts, cprofile_top, finish_row, gpu_idle_ms, machine, predicted, swap_extra, timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("system")
    ap.add_argument("model")
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--cap", type=float, default=0.0)
    ap.add_argument("--pytorch-gib", type=float, default=None,
                    help="with --cap: PyTorch's share of the emulated card (default: the whole cap). A real card of "
                         "--cap GiB leaves PyTorch less, its CUDA context taking the rest (the planner assumes 0.7)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--loss-chunk", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=2**25, help="offload_trainer: elements per streamed chunk")
    ap.add_argument("--grads-on-gpu", action="store_true", help="offload_trainer: keep gradients on the GPU")
    ap.add_argument("--act-offload", action="store_true", help="offload_trainer: offload checkpointed activations")
    ap.add_argument("--act-inflight", type=int, default=None,
                    help="act. offload: pending copies to the host before forward's CPU waits (default: the library's,"
                         " 3; 0: no bound)")
    ap.add_argument("--resident", default=None, help="offload_trainer: decoder layers kept on the GPU (N or auto)")
    ap.add_argument("--prefetch", type=int, default=1, help="layer swap: layers fetched ahead")
    ap.add_argument("--soak", action="store_true", help="record host RSS, pinned and GPU reserved after every step")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (per rank)")
    ap.add_argument("--seeded-data", action="store_true", help="batches from a generator seeded by the step "
                    "(identical across process counts; slower to draw than on the GPU)")
    ap.add_argument("--backlog-gib", type=float, default=None,
                    help="offload_trainer: GPU gradients waiting for updates before the CPU waits (default: its own)")
    ap.add_argument("--cpp-wrapper", action="store_true", help="offload_trainer: inductor's C++ wrapper for the update")
    ap.add_argument("--window", action="store_true", help="then time --steps more steps back to back, one device "
                    "sync at the end (extra.tok_per_s_window)")
    ap.add_argument("--fast-math", action="store_true",
                    help="offload_trainer: the fused kernel with Triton's approximate division and contraction")
    ap.add_argument("--device-states", default="auto",
                    help="offload_trainer: GiB of 8-bit states kept on the GPU, or auto (the planner: the input "
                         "embedding's when the cap leaves room) or off")
    ap.add_argument("--unfused", action="store_true",
                    help="offload_trainer: torchao's compiled update instead of the fused kernel (fused=False)")
    ap.add_argument("--cprofile", action="store_true", help="run one more step under cProfile: top Python functions")
    ap.add_argument("--trace", default=None, help="write the profiled step's events here (gzipped JSON; any system)")
    ap.add_argument("--profile-steps", type=int, default=1,
                    help="profile this many steps back to back (with clipping, the updates overlap the next forward)")
    ap.add_argument("--liger", action="store_true", help="Liger's kernels on the model (RMSNorm, SwiGLU, RoPE, fused "
                    "linear cross-entropy in the model's loss), as the Trainer's use_liger_kernel applies them")
    ap.add_argument("--out", default=None)
    ap.add_argument("--run-id", default=os.environ.get("RUN_ID", "adhoc"))
    a = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from offload_trainer.engine.loss import chunked_causal_lm_loss
    from offload_trainer.models import architecture_config
    from offload_trainer.engine.optim import StreamedAdamW8bit

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    shard = None
    if world > 1:
        import torch.distributed as dist

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    cfg = architecture_config(a.model, {"max_position_embeddings": max(8192, a.seq)})
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    torch.manual_seed(0)
    row = dict(run_id=a.run_id, commit=os.environ.get("COMMIT", "unknown"),
               machine=machine(),
               model=a.model, method="full", system=a.system, gpus=world, gpu_cap_gib=a.cap or None, seq_len=a.seq,
               micro_batch=a.bs, grad_accum=a.accum, tokens_per_step=world * a.accum * a.bs * a.seq, tok_per_s=None,
               step_s_median=None,
               peak_alloc_gib=None, peak_reserved_gib=None, host_peak_gib=None, pinned_gib=None, error=None,
               extra={"argv": " ".join(argv_without_output())})
    opt = swap = None
    try:
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        if a.liger:
            from liger_kernel.transformers import _apply_liger_kernel_to_instance

            _apply_liger_kernel_to_instance(model=model)
            row["system"] += "_liger"
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        offloader = None
        if a.act_offload:
            from offload_trainer.engine.activations import enable_activation_offload

            bound = {} if a.act_inflight is None else {"max_inflight": a.act_inflight or None}  # 0: no bound
            offloader = enable_activation_offload(model, **bound)
            row["extra"]["activation_offload"] = True
            row["extra"]["act_max_inflight"] = offloader.max_inflight
        row["params"] = sum(p.numel() for p in model.parameters())
        noclip = a.system.endswith("noclip")
        if a.resident is not None:
            from offload_trainer import plan
            from offload_trainer.engine.swap import LayerSwap

            resident = a.resident if a.resident != "auto" else plan(
                cfg, batch=a.bs, seq=a.seq, gpu_memory_limit_gb=a.cap or None, max_grad_norm=0.0 if noclip else 1.0,
                loss_chunk=a.loss_chunk, chunk_numel=a.chunk, activation_offload=a.act_offload,
                layer_swap=None).resident_layers
            swap = LayerSwap(model.model.layers, "cuda", resident=int(resident), prefetch=a.prefetch)
            row["extra"].update(resident_layers=int(resident), layers=cfg.num_hidden_layers, prefetch=a.prefetch)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        if a.cap:
            total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            torch.cuda.set_per_process_memory_fraction((a.pytorch_gib or a.cap) * 2**30 / total)
            if a.pytorch_gib:
                row["extra"]["pytorch_gib"] = a.pytorch_gib
        clip = None
        if a.system in ("native", "native_clip"):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
            clip = 1.0 if a.system == "native_clip" else None
        elif a.system in ("native_8bit", "native_8bit_clip"):
            from torchao.optim import AdamW8bit

            opt = AdamW8bit(model.parameters(), lr=1e-5)
            clip = 1.0 if a.system == "native_8bit_clip" else None
        elif a.system == "torchao_cpu_offload":
            from torchao.optim import CPUOffloadOptimizer

            opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=True, fused=True,
                                      lr=1e-5)
        elif a.system in ("offload_trainer", "offload_trainer_noclip"):
            if world > 1:
                from offload_trainer.engine.distributed import Sharding

                shard = Sharding()
            from offload_trainer.engine.optim import kernel as update_kernel
            from offload_trainer import plan
            from offload_trainer.planner import PlanError
            from offload_trainer.settings import parse_device_states

            offload_grads = (not noclip or a.accum > 1) and not a.grads_on_gpu
            fused = False if a.unfused else {"eager_numerics": False} if a.fast_math else None
            states = parse_device_states(a.device_states)
            try:
                p = plan(cfg, batch=a.bs, seq=a.seq, gpu_memory_limit_gb=a.cap or None, max_grad_norm=0.0 if noclip
                         else 1.0, loss_chunk=a.loss_chunk, chunk_numel=a.chunk, activation_offload=a.act_offload,
                         offload_gradients=offload_grads if not noclip or a.accum > 1 else None,
                         layer_swap=int(row["extra"]["resident_layers"]) if swap else False, accum=a.accum,
                         fused_update=fused is not False and update_kernel.available(torch.device("cuda")),
                         device_states=states)
                row["predicted"] = predicted(p)
                device_state_gib = p.device_state_gib
            except PlanError as e:
                row["predicted"] = dict(fits=False, reason=str(e)[:300])
                device_state_gib = 0.0 if states == "auto" else states
            opt = StreamedAdamW8bit(model.parameters(), lr=1e-5, update_in_backward=noclip,
                                    offload_gradients=offload_grads, chunk_numel=a.chunk, sharding=shard,
                                    compile={"cpp_wrapper": True} if a.cpp_wrapper else None,
                                    grad_backlog_bytes=None if a.backlog_gib is None else int(a.backlog_gib * 2**30),
                                    fused=fused, device_state_bytes=int(device_state_gib * 2**30))
            row["extra"].update(offload_gradients=opt.offload_gradients, chunk_numel=a.chunk,
                                fused_update=opt._fused is not None, device_state_gib=round(device_state_gib, 3))
            opt.attach(model)
            if swap is not None:
                opt.set_residency(swap.touch, ahead=swap.prefetch)
            opt.sync_weights()
            clip = None if noclip else 1.0
        else:
            raise SystemExit(f"unknown system {a.system}")
        chunked = a.system.startswith("offload_trainer")

        step_no = [0]

        def micro_batches():
            if not a.seeded_data:
                return [torch.randint(0, cfg.vocab_size, (a.bs, a.seq), device="cuda") for _ in range(a.accum)]
            gen = torch.Generator().manual_seed(1000 + step_no[0])
            every = [torch.randint(0, cfg.vocab_size, (a.bs, a.seq), generator=gen) for _ in range(world * a.accum)]
            return [x.cuda() for x in every[rank * a.accum:(rank + 1) * a.accum]]

        def step():
            total = 0.0
            for k, x in enumerate(micro_batches()):
                last = k == a.accum - 1
                with contextlib.nullcontext() if last or not isinstance(opt, StreamedAdamW8bit) else opt.no_update():
                    if chunked:
                        h = model.model(input_ids=x)[0]
                        loss = chunked_causal_lm_loss(h, x, model.lm_head.weight, chunk_size=a.loss_chunk)
                    else:
                        loss = model(input_ids=x, labels=x).loss
                    (loss / a.accum).backward()
                total = total + loss.detach() / a.accum
            step_no[0] += 1
            loss = total
            if world > 1:  # the mean over ranks, as the Trainer logs it
                torch.distributed.all_reduce(loss)
                loss = loss / world
            if clip is not None:
                if isinstance(opt, StreamedAdamW8bit):
                    opt.clip_grad_norm_(clip)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
            return loss

        times, losses, series = [], [], {"rss_gib": [], "pinned_gib": [], "reserved_gib": []}
        cpu_side, alloc_before = [], {}
        for i in range(a.warmup + a.steps):
            if i == a.warmup:
                alloc_before = allocator_counts()
            seconds, loss, launched = timed(step)
            times.append(seconds)
            cpu_side.append(launched)
            losses.append(loss)
            if a.soak:
                from offload_trainer.sysinfo import rss_gib

                series["rss_gib"].append(round(rss_gib(), 3))
                series["pinned_gib"].append(round(pinned_bytes(opt, swap, offloader) / 2**30, 3))
                series["reserved_gib"].append(round(torch.cuda.memory_reserved() / 2**30, 3))
            if not a.soak or i % 25 == 0:
                print(f"{a.system} {a.model} step {i}: {times[-1]:.3f} s loss {losses[-1]}", flush=True)
        if a.soak:  # flat after warm-up: spread of each series over steps 20.. as a fraction of its minimum
            row["extra"]["soak_series"] = series
            row["extra"]["soak_spread_after_step_20"] = {
                k: round((max(v[20:]) - min(v[20:])) / max(min(v[20:]), 1e-9), 4) for k, v in series.items()}
        measured = times[a.warmup:]
        med = statistics.median(measured)
        row.update(tok_per_s=round(row["tokens_per_step"] / med, 1), step_s_median=round(med, 4))
        # Allocator events over the timed steps (retries = the cap was hit: cached blocks freed after a device-wide
        # sync), and how long the CPU took to queue a step (close to the step time when the CPU is the bottleneck --
        # or when it is held back: by a sync, or by a full kernel launch queue, as in native rows)
        row["extra"]["allocator_over_timed_steps"] = {k: v - alloc_before.get(k, 0)
                                                      for k, v in allocator_counts().items()}
        row["extra"]["cpu_queue_s_median"] = round(statistics.median(cpu_side[a.warmup:]), 4)
        if a.window and not a.soak:  # (after the allocator counts, which cover the timed steps only)
            row["extra"].update(window(step, a.steps, row["tokens_per_step"]))
        row["extra"].update(step_s=[round(t, 4) for t in times], losses=losses, first_step_s=round(times[0], 2),
                            tok_per_s_best=round(row["tokens_per_step"] / min(measured), 1))
        if swap is not None:
            swap_before, layer_stall_before = dict(swap.stats), swap.stall.total_ms()
        if isinstance(opt, StreamedAdamW8bit):
            before, update_stall_before = dict(opt.stats), opt.stall.total_ms()
            # (the profiler's own buffers raise the process's peak RSS by ~0.4 GiB with --trace --profile-steps 2)
            row["extra"]["host_peak_before_profile_gib"] = round(peak_rss_gib() or float("nan"), 2)
            try:
                if world == 1:  # (with several ranks, time one more plain step for the byte counts)
                    row["extra"].update(gpu_idle_ms(step, a.trace, a.profile_steps))
                else:
                    comm_before = dict(shard.stats)
                    row["extra"]["profiled_step_ms"] = round(timed(step)[0] * 1e3, 1)
                    row["extra"].update({f"{k.replace('_bytes', '')}_gb_per_step_rank0":
                                         round((shard.stats[k] - comm_before[k]) / 1e9, 2) for k in shard.stats})
            except Exception as e:  # the profile is extra information, not the measurement
                row["extra"]["profile_error"] = repr(e)[:200]
            if a.cprofile:
                row["extra"]["cprofile_top_ms"] = python_profile(step)
            prof_s = row["extra"].get("profiled_step_ms", med * 1e3) / 1e3
            nprof = a.profile_steps if world == 1 else 1  # steps since `before` (the cProfile step aside)
            nprof += 1 if a.cprofile else 0
            moved = {k: (opt.stats[k] - before[k]) / nprof for k in ("h2d_bytes", "d2h_bytes")}
            row["extra"].update(h2d_gb_per_step=round(moved["h2d_bytes"] / 1e9, 2),
                                d2h_gb_per_step=round(moved["d2h_bytes"] / 1e9, 2),
                                pcie_gb_per_s=round((moved["h2d_bytes"] + moved["d2h_bytes"]) / prof_s / 1e9, 1))
            row["pinned_gib"] = round(pinned_bytes(opt, swap, offloader) / 2**30, 2)
            torch.cuda.synchronize()
            # GPU stall of the profiled step: the compute stream waiting for an update / a layer's weights
            row["extra"]["update_stall_ms"] = round((opt.stall.total_ms() - update_stall_before) / nprof, 1)
            if swap is not None:
                row["extra"].update(swap_extra(swap, swap_before, layer_stall_before))
        elif a.trace:  # other systems are profiled only when asked
            row["extra"].update(gpu_idle_ms(step, a.trace, a.profile_steps))
    except torch.OutOfMemoryError as e:
        row["error"] = "OOM: " + str(e).split("\n")[0][:160]
    if world > 1:
        row = per_node(row, opt, swap)
        if rank:
            return
    finish_row(row, a.out)


def per_node(row: dict, opt, swap) -> dict:
    """Data parallel: host RSS and pinned bytes summed over the ranks, GPU peaks the largest of any rank
    (collected into rank 0's row; each rank's own in extra)."""
    import torch.distributed as dist

    mine = dict(rss=peak_rss_gib() or 0.0, pinned=pinned_bytes(opt, swap) / 2**30,
                reserved=torch.cuda.max_memory_reserved() / 2**30, alloc=torch.cuda.max_memory_allocated() / 2**30,
                error=row["error"])
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    row["extra"]["per_rank"] = [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in m.items()}
                                for m in every]
    row["error"] = next((m["error"] for m in every if m["error"]), None)
    row["pinned_gib"] = round(sum(m["pinned"] for m in every), 2)
    row["_node"] = dict(host=sum(m["rss"] for m in every), reserved=max(m["reserved"] for m in every),
                        alloc=max(m["alloc"] for m in every))
    return row


def pinned_bytes(*movers) -> int:
    """Host memory pinned by our optimizer, layer swap and activation offloader (None / torch optimizers: 0)."""
    return sum(m.memory_stats()["pinned_bytes"] for m in movers if hasattr(m, "memory_stats"))


def window(step, steps: int, tokens_per_step: int) -> dict:
    """`steps` steps back to back, as a training loop runs them: the loss read after each (the Trainer's NaN filter
    does, which waits for the compute stream only), the whole device synchronized once, at the end."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step().item()
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - t) / steps
    return {"window_steps": steps, "window_step_s": round(per_step, 4),
            "tok_per_s_window": round(tokens_per_step / per_step, 1)}


def argv_without_output() -> list[str]:
    """This row's command-line arguments, less where it is written (--out, --run-id)."""
    args, skip = [], False
    for x in sys.argv[1:]:
        if skip or x in ("--out", "--run-id"):
            skip = not skip
            continue
        args.append(x)
    return args


def python_profile(step, top: int = 25) -> dict:
    """One step under cProfile: the functions with the most own CPU time ("file:line name": [calls, own, total ms])."""
    import cProfile

    pr = cProfile.Profile()
    torch.cuda.synchronize()
    pr.enable()
    step()
    torch.cuda.synchronize()
    pr.disable()
    return cprofile_top(pr, top)


if __name__ == "__main__":
    main()
