"""QLoRA step benchmark on a big random-init shape: bitsandbytes NF4 base, LoRA on every linear layer.

    python bench/rows/qlora_bench.py [--model llama3-70b] [--bs 1] [--seq 2048] [--cap 24] [--resident N]
                                     [--out rows.jsonl]

The base model is built on the meta device and materialised one decoder layer at a time on the GPU (random
bf16 weights, quantized to NF4 there), so a 70B shape never needs 140 GB anywhere. With --resident N, the
layer-swap engine keeps N layers on the GPU and the rest (4-bit weights + quantization state) in pinned host
memory; the cap is set after the swapped layers left the GPU and the peak counters are reset. Without
--resident, everything stays on the (uncapped) GPU: the reference. LoRA r=16 (alpha 32) on all linear layers,
torch AdamW (fused) on the adapters, non-reentrant checkpointing, chunked loss. One JSON row per run.

Vision-language shapes (--model llama3.2-90b-vision, `MllamaForConditionalGeneration`): the vision encoder's
linears are NF4 too and stay on the GPU; LoRA goes on the language model's linears only; the decoder's
self- and cross-attention layers are swapped alike. Every sequence carries one random 4-tile image
(560 x 560 each), which the cross-attention layers read.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from row_helpers import finish_row, gpu_idle_ms, machine, swap_extra, timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--cap", type=float, default=0.0)
    ap.add_argument("--resident", type=int, default=None)
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--run-id", default=os.environ.get("RUN_ID", "adhoc"))
    a = ap.parse_args()

    from peft import LoraConfig, get_peft_model

    from offload_trainer.engine.loss import chunked_causal_lm_loss
    from offload_trainer.data.vision import random_image_text_batch
    from offload_trainer.models import architecture_config, layer_lists, random_init_4bit
    from offload_trainer.engine.swap import LayerSwap

    cfg = architecture_config(a.model)
    vision = getattr(cfg, "vision_config", None) is not None
    text_cfg = cfg.get_text_config()
    for c in {id(x): x for x in (cfg, text_cfg, getattr(cfg, "vision_config", None)) if x is not None}.values():
        c._attn_implementation = "sdpa"
    text_cfg.use_cache = cfg.use_cache = False
    system = "qlora_swap" if a.resident is not None else "qlora_native"
    row = dict(run_id=a.run_id, commit=os.environ.get("COMMIT", "unknown"),
               machine=machine(), model=a.model,
               method="qlora-nf4-r16", system=system, gpus=1, gpu_cap_gib=a.cap or None, seq_len=a.seq,
               micro_batch=a.bs, grad_accum=1, tokens_per_step=a.bs * a.seq, tok_per_s=None, step_s_median=None,
               peak_alloc_gib=None, peak_reserved_gib=None, host_peak_gib=None, pinned_gib=None, error=None,
               extra={})
    try:
        torch.manual_seed(0)
        t0 = time.perf_counter()
        model = random_init_4bit(cfg, "cuda")
        targets = (r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)" if vision
                   else "all-linear")
        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets,
                          task_type=None if vision else "CAUSAL_LM")
        model = get_peft_model(model, lora)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        inner = model.get_base_model()
        row["extra"]["build_s"] = round(time.perf_counter() - t0, 1)
        row["params"] = sum(p.numel() for p in model.parameters())
        trainable = [p for p in model.parameters() if p.requires_grad]
        row["extra"]["trainable_params"] = sum(p.numel() for p in trainable)
        swap = None
        if a.resident is not None:
            swap = LayerSwap(layer_lists(inner)[0], "cuda", resident=a.resident, prefetch=a.prefetch)
            row["extra"].update(resident_layers=a.resident, layers=text_cfg.num_hidden_layers, prefetch=a.prefetch)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        if a.cap:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(a.cap * 2**30 / total)
        opt = torch.optim.AdamW(trainable, lr=1e-4, fused=True)

        def step():
            if vision:
                batch = random_image_text_batch(cfg, a.bs, a.seq, "cuda")
            else:
                batch = dict(input_ids=torch.randint(0, cfg.vocab_size, (a.bs, a.seq), device="cuda"))
            h = inner.model(**batch)[0]
            loss = chunked_causal_lm_loss(h, batch["input_ids"], inner.lm_head.weight, chunk_size=1024)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        times, losses = [], []
        for i in range(a.warmup + a.steps):
            seconds, loss, _ = timed(step)
            times.append(seconds)
            losses.append(loss)
            print(f"{system} {a.model} step {i}: {times[-1]:.3f} s loss {losses[-1]}", flush=True)
        med = statistics.median(times[a.warmup:])
        row.update(tok_per_s=round(a.bs * a.seq / med, 1), step_s_median=round(med, 4))
        row["extra"].update(step_s=[round(t, 4) for t in times], losses=losses)
        if swap is not None:
            before, stall0 = dict(swap.stats), swap.stall.total_ms()
            row["extra"].update(gpu_idle_ms(step))
            torch.cuda.synchronize()
            row["extra"].update(swap_extra(swap, before, stall0))
            row["pinned_gib"] = round(swap.memory_stats()["pinned_bytes"] / 2**30, 2)
    except torch.OutOfMemoryError as e:
        row["error"] = "OOM: " + str(e).split("\n")[0][:160]
    finish_row(row, a.out)


if __name__ == "__main__":
    main()
