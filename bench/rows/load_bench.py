"""Loading a pretrained NF4 base bigger than the GPU, layer by layer (`pretrained_4bit_layerwise`).

    python bench/rows/load_bench.py [--model llama3-8b] [--cap 5] [--resident 2] [--out rows.jsonl]

Writes a random-init bf16 checkpoint of the shape (safetensors shards, as transformers saves them) to --dir,
loads it with transformers' own 4-bit loading onto the uncapped GPU (the reference: it quantizes everything
onto the GPU), then, under a --cap GiB cap smaller than the 4-bit model, with the layer-wise loader (one layer
in bf16 at a time on the GPU, decoder layers parked in CPU memory) and the layer-swap engine; checks that both
give the same logits, then trains 3 QLoRA steps (r=16, all linears). One JSON row (RESULTS.md format).
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import time

import torch

from row_helpers import finish_row, machine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--cap", type=float, default=5.0)
    ap.add_argument("--resident", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--dir", default="/tmp/ckpt")
    ap.add_argument("--out", default=None)
    ap.add_argument("--run-id", default=os.environ.get("RUN_ID", "adhoc"))
    a = ap.parse_args()

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from offload_trainer.engine.loss import chunked_causal_lm_loss
    from offload_trainer.models import architecture_config, pretrained_4bit_layerwise
    from offload_trainer.engine.swap import LayerSwap
    from offload_trainer.sysinfo import peak_rss_gib, rss_gib

    cfg = architecture_config(a.model)
    row = dict(run_id=a.run_id, commit=os.environ.get("COMMIT", "unknown"),
               machine=machine(), model=a.model,
               method="qlora-nf4-r16", system="pretrained_layerwise_load", gpus=1, gpu_cap_gib=a.cap, seq_len=a.seq,
               micro_batch=1, grad_accum=1, tokens_per_step=a.seq, tok_per_s=None, step_s_median=None,
               peak_alloc_gib=None, peak_reserved_gib=None, host_peak_gib=None, pinned_gib=None, error=None, extra={})
    try:
        t0 = time.perf_counter()
        torch.manual_seed(0)
        with torch.device("cuda"):
            AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(a.dir)
        gc.collect()
        torch.cuda.empty_cache()
        row["extra"]["checkpoint_gb"] = round(sum(os.path.getsize(os.path.join(a.dir, f))
                                                  for f in os.listdir(a.dir)) / 1e9, 2)
        row["extra"]["save_s"] = round(time.perf_counter() - t0, 1)
        ids = torch.randint(0, cfg.vocab_size, (1, a.seq), device="cuda")

        t0 = time.perf_counter()
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                   bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=True)
        ref = AutoModelForCausalLM.from_pretrained(a.dir, quantization_config=quant, dtype=torch.bfloat16,
                                                   device_map={"": 0})
        row["extra"]["hf_4bit_load_s"] = round(time.perf_counter() - t0, 1)
        row["extra"]["hf_4bit_gpu_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
        with torch.no_grad():
            want = ref(input_ids=ids).logits.float().cpu()
        del ref
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(a.cap * 2**30 / total)

        with open("/proc/self/clear_refs", "w") as f:  # reset the peak RSS (VmHWM) to the current RSS
            f.write("5")
        row["extra"]["rss_before_load_gib"] = round(rss_gib(), 2)
        t0 = time.perf_counter()
        model = pretrained_4bit_layerwise(a.dir, device="cuda", park="cpu")
        row["extra"]["load_s"] = round(time.perf_counter() - t0, 1)
        row["extra"]["load_peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        row["extra"]["load_peak_rss_gib"] = round(peak_rss_gib(), 2)
        row["extra"]["rss_after_load_gib"] = round(rss_gib(), 2)
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        inner = model.get_base_model()
        swap = LayerSwap(inner.model.layers, "cuda", resident=a.resident)
        with torch.no_grad():
            got = inner(input_ids=ids).logits.float().cpu()  # LoRA B is zero: the base model's logits
        row["extra"]["logits_equal_to_transformers_4bit"] = bool(torch.equal(got, want))
        row["extra"]["logits_max_abs_diff"] = float((got - want).abs().max())
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        losses, times = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            h = inner.model(input_ids=ids)[0]
            loss = chunked_causal_lm_loss(h, ids, inner.lm_head.weight, chunk_size=512)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(round(loss.item(), 4))
            times.append(round(time.perf_counter() - t0, 3))
        row["extra"].update(losses=losses, step_s=times, resident_layers=a.resident,
                            layers=cfg.num_hidden_layers)
        row["pinned_gib"] = round(swap.memory_stats()["pinned_bytes"] / 2**30, 2)
        row["step_s_median"] = sorted(times)[1]
    except torch.OutOfMemoryError as e:
        row["error"] = "OOM: " + str(e).split("\n")[0][:160]
    finally:
        shutil.rmtree(a.dir, ignore_errors=True)
    finish_row(row, a.out)


if __name__ == "__main__":
    main()
