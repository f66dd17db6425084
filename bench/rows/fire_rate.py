"""How often the clip fires on a real finetune: a model is trained first (on the built-in corpus, from random init),
then finetuned on another text (the built-in prompt/completion pairs) at a finetuning learning rate, both through
`offload-trainer train`; the finetune logs its gradient norm at every step. Or, with `--config`, any config (e.g.
configs/smollm2-135m-sft.yaml, the real SmolLM2-135M-Instruct) run once with a log per step.

    python bench/rows/fire_rate.py --out rows.jsonl [--hidden 512 --layers 8 --pretrain-steps 400 --finetune-steps 200]
    python bench/rows/fire_rate.py --config configs/smollm2-135m-sft.yaml --out rows.jsonl

One row: the norms, and the share of steps with a norm above max_grad_norm, over all steps and after the first
`--settle` (speculative clipping redoes those: the expected throughput is the never-clipping one / (1 + rate)).
"""
from __future__ import annotations

import argparse
import json
import os
import time

from row_helpers import finish_row, machine


def expected_speed(fired: list[bool], speculative: float, exact: float) -> float:
    """Tokens/s of a run whose steps clip as `fired` says, replaying the optimizer's ClipPolicy: a speculative step at
    `speculative` tok/s (its clip not firing), twice its time when it fires (redone), `exact` tok/s while the policy
    clips exactly. (The rollback's copy back of the weights overlaps the redo's forward: not counted.)"""
    from offload_trainer.engine.optim.speculation import ClipPolicy

    policy, seconds = ClipPolicy(), 0.0
    for f in fired:
        seconds += 1 / exact if policy.exact else (2 if f else 1) / speculative
        policy.record(f)
    return len(fired) / seconds


def norms_of(output_dir: str) -> list[float]:
    with open(os.path.join(output_dir, "trainer_state.json")) as f:
        return [h["grad_norm"] for h in json.load(f)["log_history"] if "grad_norm" in h]


def train(config: str, overrides: list[str]) -> None:
    from offload_trainer.cli import main

    rc = main(["train", config, *overrides])
    if rc:
        raise SystemExit(f"offload-trainer train {config} {' '.join(overrides)} exited with {rc}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None, help="one run of this config instead of pretrain + finetune")
    ap.add_argument("overrides", nargs="*", help="with --config: key=value overrides")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--pretrain-steps", type=int, default=400)
    ap.add_argument("--finetune-steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=2e-5, help="the finetune's learning rate")
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--settle", type=int, default=50, help="steps left out of the settled rate")
    ap.add_argument("--work", default="/tmp/fire_rate")
    ap.add_argument("--speeds", type=float, nargs=2, default=(0.922, 0.707), metavar=("SPECULATIVE", "EXACT"),
                    help="measured speeds (x native) of a step that does not clip and of exact clipping: the row's "
                         "expected speed replays the policy on this run's clips (8B on a held 24 GB card, run s36c)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--run-id", default=os.environ.get("RUN_ID", "adhoc"))
    a = ap.parse_args()
    import torch

    t0 = time.perf_counter()
    base = ["logging_steps=1", "save_strategy=no", "report_to=none", "eval_fraction=0", "eval_strategy=no",
            f"max_grad_norm={a.max_grad_norm}"]
    gpu = torch.cuda.is_available()
    dtype = ["torch_dtype=bfloat16"] if gpu else []
    if a.config:
        out = os.path.join(a.work, "run")
        train(a.config, [*base, *dtype, f"output_dir={out}", "overwrite_output_dir=true", *a.overrides])
        what, model = " ".join([a.config, *a.overrides]), a.config
    else:
        pre, fine = os.path.join(a.work, "pretrained"), os.path.join(a.work, "finetuned")
        shape = (f"model_overrides={{hidden_size: {a.hidden}, intermediate_size: {4 * a.hidden}, "
                 f"num_hidden_layers: {a.layers}, num_attention_heads: {a.hidden // 64}, "
                 f"num_key_value_heads: {a.hidden // 64}}}")
        # trained first: the built-in corpus from random init, clipped at 1.0 with a pretraining learning rate
        train("configs/tiny-cpu.yaml", [*base, *dtype, shape, f"max_steps={a.pretrain_steps}", "learning_rate=1e-3",
                                        f"output_dir={pre}", "overwrite_output_dir=true", "save_strategy=no"])
        # then finetuned on another text at a finetuning learning rate
        train("configs/tiny-cpu.yaml", [*base, *dtype, "model_config=", f"model_name_or_path={pre}",
                                        "dataset_path=builtin-sft", f"max_steps={a.finetune_steps}",
                                        f"learning_rate={a.lr}", "warmup_steps=10", f"output_dir={fine}",
                                        "overwrite_output_dir=true"])
        out, what, model = fine, "pretrain + finetune", f"tiny-llama {a.hidden}x{a.layers}"
    norms = norms_of(out)
    fired = [a.max_grad_norm / (n + 1e-6) < 1 for n in norms]  # (torch's clip coefficient under 1)
    settled = fired[a.settle:]
    row = dict(run_id=a.run_id, commit=os.environ.get("COMMIT", "unknown"), machine=machine(), model=model,
               method="full", system="fire_rate", gpus=int(gpu), gpu_cap_gib=None, seq_len=None, micro_batch=None,
               grad_accum=1, tokens_per_step=None, tok_per_s=None, step_s_median=None, peak_alloc_gib=None,
               peak_reserved_gib=None, host_peak_gib=None, pinned_gib=None, error=None,
               extra=dict(what=what, max_grad_norm=a.max_grad_norm, steps=len(norms), fire_rate=sum(fired) / len(fired),
                          settle=a.settle, fire_rate_settled=sum(settled) / len(settled) if settled else None,
                          expected_x_native=round(expected_speed(fired, *a.speeds), 3), speeds=list(a.speeds),
                          norms=[round(n, 4) for n in norms], lr=a.lr if not a.config else None,
                          wall_s=round(time.perf_counter() - t0, 1)))
    if gpu:
        finish_row(row, a.out)
    else:
        print("ROW " + json.dumps(row), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
