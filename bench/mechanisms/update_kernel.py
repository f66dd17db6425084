"""GPU time of one streamed 8-bit AdamW chunk update, in variants: where the update's GPU time goes.

    python bench/mechanisms/update_kernel.py [--numel 25165824] [--iters 20] [--beside] [--out rows.jsonl]

The states are on the GPU already (no PCIe): this times only the update kernels, which share the GPU with backward
when updates run during backward. (Older rows name some variants differently: bench/results/README.md, "The update
kernel alone".) Variants:
  ours                  offload_trainer.engine.optim.adamw8bit_chunk, compiled as the optimizer compiles it
  ours_no_asserts       without inductor's bounds asserts on the quantizer's table lookups (assert_indirect_indexing)
  ours_int32            torchao's binary-search quantizer rewritten with int32 codes (the same codes)
  ours_int32_no_asserts both
  ours_multi_kernel     inductor option triton.multi_kernel (persistent and looped reductions, picked at run time)
  ours_autotuned        inductor option coordinate_descent_tuning
  ours_no_guard         without the non-finite guard (plain copies into codes, scales and weights)
  ours_no_sr            bf16_stochastic_round=False
  fused                 offload_trainer.update_kernel.Update8bit: one Triton kernel, two-lookup quantizer (the default
                        since the fused update landed); fused_rows{2,8}, fused_warps8: its block shape
  fused_no_sr           the same, bf16_stochastic_round=False
  fused_fast_math       the same, eager_numerics=False (Triton's approximate division, contraction)
  torchao               torchao's single_param_adam on two OptimState8bit (what torchao AdamW8bit runs per tensor)
  torch_fused_bf16      torch._fused_adamw_ on bf16 weights and states (what the native rows run), for scale
Prints one JSON line per variant: GPU ms per call, ps per element, CPU microseconds per call, kernels per call.
`--beside`: also what the update costs the compute stream when it runs beside backward, as the streamed optimizer runs
it (its own stream at high priority): 300 memory-bound elementwise kernels (`silu_backward` of an 8B MLP's 4 x 2048
activations) timed alone and beside 3e9 values of updates; `beside_ps_per_element` is the compute stream's extra time
per updated value. On the H200 the fused update cost the compute stream about its own time alone: the two share the
SMs' issue slots, not only memory bandwidth (a plain copy of the same bytes cost 3.5 ps per value beside).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torchao.optim.adam import single_param_adam
from torchao.optim.subclass_8bit import OptimState8bit, get_qmap_signed, get_qmap_unsigned

from offload_trainer.engine.optim import adamw8bit_chunk, compile_update
from offload_trainer.engine.optim.kernel import Update8bit


def quantize_8bit_i32(input, qmap):
    """torchao's quantize_8bit_with_qmap with int32 codes: the same binary search and rounding, the same codes."""
    codes = (input >= qmap[128]).int() * 128
    for half in (64, 32, 16, 8, 4, 2, 1):
        codes += (input >= qmap[codes + half]).int() * half
    codes_up = (codes + 1).clip(max=255)
    val_down, val_up = qmap[codes], qmap[codes_up]
    return torch.where(input - val_down >= (val_up - val_down) * 0.5, codes_up, codes).to(torch.uint8)


def no_guard(*args):
    return adamw8bit_chunk(*args, guard=False)


def int32_quant(*args):
    return adamw8bit_chunk(*args, quantize=quantize_8bit_i32)


def beside_bench(dev):
    """fn, numel -> what the updates cost 300 elementwise kernels on the compute stream when they run beside them on a
    high-priority stream (as `engine.streams` makes it), 3e9 values of them: the compute stream's extra picoseconds
    per updated value, both spans, and whether the updates finished before the elementwise kernels did (else the
    figure holds the updates' own tail); median of three."""
    update_stream = torch.cuda.Stream(priority=-1)
    x = torch.randn(8192, 14336, device=dev, dtype=torch.bfloat16)
    y = torch.randn_like(x)

    def timed(fn=None, calls=0):
        torch.cuda.synchronize()
        start, end, first, last = (torch.cuda.Event(enable_timing=True) for _ in range(4))
        start.record()
        update_stream.wait_event(start)
        with torch.cuda.stream(update_stream):
            first.record()
            for _ in range(calls):
                fn()
            last.record()
        for _ in range(300):
            torch.ops.aten.silu_backward(y, x)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end), first.elapsed_time(last)

    timed()  # (warm-up)
    alone = sorted(timed()[0] for _ in range(3))[1]

    def beside(fn, numel):
        calls = int(3e9 // numel)
        timed(fn, calls)
        with_updates, span = sorted(timed(fn, calls) for _ in range(3))[1]
        return {"beside_ps_per_element": round((with_updates - alone) * 1e9 / (calls * numel), 2),
                "elementwise_alone_ms": round(alone, 2), "elementwise_beside_ms": round(with_updates, 2),
                "update_span_beside_ms": round(span, 2), "update_finished_inside": span < with_updates}

    return beside


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=3072 * 8192)  # a Llama-3.2-3B MLP weight
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--only", default=None, help="comma-separated variants")
    ap.add_argument("--beside", action="store_true", help="also the cost to compute-stream work running beside")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    n, bs, dev = a.numel, 256, "cuda"
    torch.manual_seed(0)
    p = torch.randn(n, device=dev, dtype=torch.bfloat16) * 0.02
    grad = torch.randn(n, device=dev, dtype=torch.bfloat16) * 1e-3
    codes = torch.randint(0, 256, (2, n), device=dev, dtype=torch.uint8)
    scales = torch.rand(2, n // bs, device=dev) * 1e-3
    qmaps = [torch.tensor(get_qmap_signed(), device=dev), torch.tensor(get_qmap_unsigned(), device=dev)]
    step, lr = torch.tensor(10.0), torch.tensor(1e-5)
    hyper = (lr, 0.9, 0.999, 0.01, 1e-8)
    states = [OptimState8bit(codes[k].clone(), scales[k].clone(), qmaps[k], signed, dtype=torch.bfloat16)
              for k, signed in enumerate((True, False))]
    native = [p.clone(), torch.zeros_like(p), torch.zeros_like(p), torch.tensor(10.0, device=dev)]

    no_asserts = {"assert_indirect_indexing": False}

    def call(fn, sr=True):
        return lambda: fn(p, grad, codes, scales, *qmaps, step, *hyper, sr)

    variants = {
        "ours": call(compile_update(adamw8bit_chunk)),
        "ours_no_asserts": call(compile_update(adamw8bit_chunk, no_asserts)),
        "ours_int32": call(compile_update(int32_quant)),
        "ours_int32_no_asserts": call(compile_update(int32_quant, no_asserts)),
        "ours_multi_kernel": call(compile_update(adamw8bit_chunk, {"triton.multi_kernel": 1})),
        "ours_autotuned": call(compile_update(adamw8bit_chunk, {"coordinate_descent_tuning": True})),
        "ours_no_guard": call(compile_update(no_guard)),
        "ours_no_sr": call(compile_update(adamw8bit_chunk), sr=False),
        "fused": call(Update8bit(torch.device(dev))),
        "fused_rows2": call(Update8bit(torch.device(dev), rows=2)),
        "fused_rows8": call(Update8bit(torch.device(dev), rows=8)),
        "fused_warps8": call(Update8bit(torch.device(dev), rows=8, num_warps=8)),
        "fused_no_sr": call(Update8bit(torch.device(dev)), sr=False),
        "fused_fast_math": call(Update8bit(torch.device(dev), eager_numerics=False)),
        "torchao": (lambda f: lambda: f(p, grad, step, states[0], states[1], None, *hyper, True, True))(
            torch.compile(single_param_adam, fullgraph=True, dynamic=False)),
        "torch_fused_bf16": lambda: torch._fused_adamw_([native[0]], [grad], [native[1]], [native[2]], [], [native[3]],
                                                        lr=1e-5, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
                                                        amsgrad=False, maximize=False),
    }
    wanted = a.only.split(",") if a.only else list(variants)
    beside = beside_bench(dev) if a.beside else None
    for name in wanted:
        fn = variants[name]
        try:
            for _ in range(3):  # compile + warm up
                fn()
        except Exception as e:  # one variant failing to compile must not lose the others
            print(json.dumps({"variant": name, "error": repr(e)[:300]}), flush=True)
            continue
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            fn()
        cpu_us = (time.perf_counter() - t0) * 1e6 / a.iters  # launch cost (the GPU queue never fills at 20 calls)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / a.iters
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = {}
        for e in prof.key_averages():
            if e.device_time_total > 0:
                kernels[e.key[:70]] = round(e.device_time_total / 1e3, 3)
        row = {"variant": name, "numel": n, "ms_per_call": round(ms, 3), "ps_per_element": round(ms * 1e9 / n, 1),
               "cpu_us_per_call": round(cpu_us, 1),
               **(beside(fn, n) if beside else {}),
               "kernel_ms": kernels, "commit": os.environ.get("COMMIT", "unknown"), "gpu": torch.cuda.get_device_name()}
        print(json.dumps(row), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
