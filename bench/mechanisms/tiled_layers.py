"""GPU memory of a decoder layer's backward at long context, by tiling: a two-layer Llama-3.1-8B-shaped stack (vocab
1024, bf16, sdpa) under activation offload's checkpoint, forward then backward, with each MLP tiled
(engine/tiled_mlp.py) or each layer but its attention tiled (models/tiled_layers.py); and torch's sdpa (causal,
GQA 32/8 heads of 128) forward and backward alone. Peaks over what was allocated before, in GiB and in units of one
whole-sequence hidden tensor (T x 4096 x 2 bytes), and seconds per forward + backward. No allocator settings: the
reserved figure includes the default allocator's fragmentation (the command runs with expandable segments).

    python3 bench/mechanisms/tiled_layers.py 65536,131072 tiled_mlp,tiled_layers [--out rows.jsonl]

The planner's constants for tiled layers start from these (planner/estimate.py), and its whole-sequence count is
checked against the command's runs (bench/analysis/planner_check.py).
"""
import argparse
import json
import time

import torch
from transformers import AutoConfig, AutoModel

from offload_trainer.engine.activations import enable_activation_offload
from offload_trainer.engine.tiled_mlp import tile_mlps
from offload_trainer.models.tiled_layers import tile_decoder_layers

GiB = 2**30
TILE = 8192


def build(layers: int = 2):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=1024,
                               max_position_embeddings=131072, rope_theta=500000.0)
    cfg._attn_implementation = "sdpa"
    with torch.device("cuda"):
        m = AutoModel.from_config(cfg, dtype=torch.bfloat16)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.config.use_cache = False
    m.train()
    return m


def sdpa_alone(T: int) -> dict:
    torch.cuda.empty_cache()
    q = torch.randn(1, 32, T, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 8, T, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    fwd = torch.cuda.max_memory_allocated() - base
    g = torch.randn_like(o)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o.backward(g)
    torch.cuda.synchronize()
    bwd = torch.cuda.max_memory_allocated() - base
    unit = T * 4096 * 2
    return dict(case="sdpa", T=T, fwd_units=round(fwd / unit, 2), bwd_units=round(bwd / unit, 2),
                bwd_gib=round(bwd / GiB, 2))


def stack(T: int, mode: str, steps: int = 2) -> dict:
    m = build()
    tile_mlps(m.layers, TILE)
    if mode == "tiled_layers":
        tile_decoder_layers(m.layers, TILE)
    enable_activation_offload(m)
    ids = torch.randint(0, 1024, (1, T), device="cuda")
    times = []
    for _ in range(steps):
        for p in m.parameters():
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = m(input_ids=ids).last_hidden_state
        torch.cuda.synchronize()
        fwd = torch.cuda.max_memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        out.backward(torch.ones_like(out) * 1e-3)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        bwd = torch.cuda.max_memory_allocated() - base
        del out
    unit = T * 4096 * 2
    row = dict(case=mode, T=T, fwd_units=round(fwd / unit, 2), bwd_units=round(bwd / unit, 2),
               bwd_gib=round(bwd / GiB, 2), grads_gib=round(sum(p.numel() * 2 for p in m.parameters()) / GiB, 2),
               reserved_gib=round(torch.cuda.max_memory_reserved() / GiB, 2), s=[round(t, 3) for t in times])
    del m
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lengths", help="tokens per sequence, comma-separated")
    ap.add_argument("modes", help="tiled_mlp and/or tiled_layers, comma-separated")
    ap.add_argument("--out", help="append the rows here (JSON lines)")
    a = ap.parse_args()
    lines = []
    for T in (int(x) for x in a.lengths.split(",")):
        lines.append(json.dumps(sdpa_alone(T)))
        print(lines[-1], flush=True)
        for mode in a.modes.split(","):
            try:
                lines.append(json.dumps(stack(T, mode)))
            except torch.OutOfMemoryError as e:
                lines.append(json.dumps(dict(case=mode, T=T, oom=str(e)[:200])))
                torch.cuda.empty_cache()
            print(lines[-1], flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write("".join(line + "\n" for line in lines))


if __name__ == "__main__":
    main()
