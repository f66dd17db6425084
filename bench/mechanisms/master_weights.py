"""Master-weight precision: bf16 weights with stochastic rounding vs round-to-nearest, against fp32 AdamW.

Trains the tiny Llama on the built-in corpus three ways from the same init and data order and reports the
held-out loss (CPU is enough: this measures arithmetic, not speed).

    python bench/mechanisms/master_weights.py [--steps 150] [--lr 1e-4]
"""
import argparse
import json
import os
import time

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

import torch  # noqa: E402

from offload_trainer.cli.run_args import DataArguments, ModelArguments  # noqa: E402
from offload_trainer.data import build_datasets  # noqa: E402
from offload_trainer.models import load_model, load_tokenizer  # noqa: E402
from offload_trainer.engine.optim import StreamedAdamW8bit  # noqa: E402


def run(kind: str, steps: int, lr: float, train, evald) -> dict:
    torch.manual_seed(0)
    margs = ModelArguments(model_config="tiny-llama", torch_dtype="float32")
    model = load_model(margs)
    if kind == "fp32_adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    else:
        model = model.to(torch.bfloat16)
        opt = StreamedAdamW8bit(model.parameters(), lr=lr, weight_decay=0.0,
                                bf16_stochastic_round=kind == "bf16_sr_8bit")
    g = torch.Generator().manual_seed(1)
    t0 = time.perf_counter()
    for _ in range(steps):
        idx = torch.randint(0, len(train), (8,), generator=g)
        batch = {k: torch.stack([train[int(i)][k] for i in idx]) for k in train[0]}
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    dt = (time.perf_counter() - t0) / steps
    with torch.no_grad():
        losses = [model(**{k: v[None] for k, v in evald[i].items()}).loss.item() for i in range(len(evald))]
    return {"kind": kind, "eval_loss": round(sum(losses) / len(losses), 4), "cpu_step_s": round(dt, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=1e-4)
    a = ap.parse_args()
    tok = load_tokenizer(ModelArguments(model_config="tiny-llama"))
    train, evald = build_datasets(DataArguments(max_seq_length=128, eval_fraction=0.05), tok, vocab_size=512)
    rows = [run(k, a.steps, a.lr, train, evald) for k in ("fp32_adamw", "bf16_sr_8bit", "bf16_rtn_8bit")]
    for r in rows:
        r.update(steps=a.steps, lr=a.lr, model="tiny-llama", data="builtin")
        print(json.dumps(r))


if __name__ == "__main__":
    main()
