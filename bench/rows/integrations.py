"""The integrations on a GPU, each tool with its own defaults: one checkpoint, one chat dataset and one batch shape
through `offload-trainer train`, TRL's `OffloadSFTTrainer` (assistant_only_loss), axolotl with the plugin (what
`axolotl train` runs) and LLaMA-Factory through our launcher. Each tool runs in this process, which only listens:
every log the Trainer writes is kept (with the allocator's peak at that moment), and the row is made from them.

    python bench/rows/integrations.py base BASE_DIR --model llama3-8b     # random-init checkpoint + chat tokenizer
    python bench/rows/integrations.py prepare BASE_DIR WORK [--seq 2048 --batch 4 --steps 10]
    python bench/rows/integrations.py run TOOL WORK --out rows.jsonl      # TOOL: ours, trl, axolotl, llamafactory,
                                                                     # ours-qlora, axolotl-qlora (prepare --qlora-base)
    python bench/rows/integrations.py table rows.jsonl                    # each tool against `ours`

The same settings everywhere, named in each tool's own keys: the step (batch x seq, every row truncated to seq, so
every tool trains the same tokens per step), bf16 weights, gradient checkpointing, learning rate, seed, logging every
step, no saves, our `offload_optimizer: true`, the same order of rows (axolotl's extra shuffle off), the Trainer's
linear schedule (axolotl's default is cosine). Left at each tool's default: max_grad_norm (1.0 in all four), warmup,
its chat template handling (each reads the tokenizer's template, which marks the assistant's turns; LLaMA-Factory
parses it into its own template format), truncation, gradient checkpointing's mode. tok/s and memory come from our
logs, which every tool gets through OffloadMixin (tok/s counts the tokens each step trained on).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
import time

# axolotl's own memory logs (its log() resets the allocator's peaks after reading them)
AXOLOTL_ALLOC, AXOLOTL_RESERVED = "memory/max_allocated (GiB)", "memory/device_reserved (GiB)"
TOOLS = ("ours", "trl", "axolotl", "llamafactory", "ours-qlora", "axolotl-qlora")
# the built-in tokenizer's template with the assistant's turns marked, as TRL's assistant_only_loss needs
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['role'] == 'assistant' %}{% generation %}"
                 "{{ m['content'] }}<|endoftext|>{% endgeneration %}"
                 "{% else %}{{ m['content'] }}<|endoftext|>{% endif %}"
                 "\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def make_base(path: str, model: str, config_only: bool = False) -> None:
    """A random-init checkpoint of a registry shape (built on the GPU where there is one) and the built-in tokenizer
    with a chat template that marks the assistant's turns; `config_only`: the config and tokenizer, no weights (for
    axolotl's `reinit_weights: true`, which builds the weights itself: a 70B checkpoint does not fit the GPU machine's
    disk)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from offload_trainer.data.sources import builtin_asset
    from offload_trainer.models.registry import architecture_config

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    config = architecture_config(model)
    if config_only:
        config.save_pretrained(path)
    else:
        with torch.device(device):
            m = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        m.save_pretrained(path)
        del m
    tok = AutoTokenizer.from_pretrained(builtin_asset("tokenizer"))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    with open(os.path.join(path, "bench_model.json"), "w") as f:
        json.dump(model, f)
    print(f"base: {model} {'config' if config_only else 'checkpoint'} saved to {path} "
          f"in {time.perf_counter() - t0:.0f} s")


def chat_rows(n: int, words: int) -> list[dict]:
    """n conversations whose answers run past `words` words (more tokens than the step's sequence: every tool
    truncates each row to the same length), each from its own place in the built-in corpus."""
    from importlib.resources import files

    corpus = (files("offload_trainer") / "assets" / "corpus.txt").read_text().split()
    rows = []
    for i in range(n):
        start = (i * 7919) % len(corpus)
        answer = " ".join(corpus[(start + j) % len(corpus)] for j in range(words))
        rows.append({"messages": [{"role": "user", "content": f"Tell me part {i} of the story."},
                                  {"role": "assistant", "content": answer}]})
    return rows


def prepare(base: str, work: str, seq: int, batch: int, steps: int, model: str, bf16: bool = True,
            qlora_base: str | None = None, variants: list[str] = ()) -> None:
    """The dataset and each tool's configuration under `work` (bf16=False: a rehearsal on a CPU, where the Trainer
    refuses bf16). `variants`: 'NAME=TOOL:KEY=JSON', a run NAME (beginning with TOOL's name) of TOOL's configuration
    with KEY set, e.g. 'axolotl-re=axolotl:gradient_checkpointing_kwargs={"use_reentrant": true}' ('NAME=TOOL': as
    it is)."""
    os.makedirs(work, exist_ok=True)
    qlora_model = None
    if qlora_base:
        with open(os.path.join(qlora_base, "bench_model.json")) as f:
            qlora_model = json.load(f)
    with open(os.path.join(work, "bench.json"), "w") as f:  # (what the rows say of the run)
        json.dump({"model": model, "seq": seq, "batch": batch, "steps": steps, "qlora_model": qlora_model}, f)
    data = os.path.join(work, "chat.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in chat_rows(batch * steps, 2 * seq))
    with open(os.path.join(work, "dataset_info.json"), "w") as f:  # LLaMA-Factory's registry
        json.dump({"chat": {"file_name": "chat.jsonl", "formatting": "sharegpt", "columns": {"messages": "messages"},
                            "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                     "assistant_tag": "assistant"}}}, f)
    common = {"output_dir": None, "max_steps": steps, "per_device_train_batch_size": batch,
              "gradient_accumulation_steps": 1, "learning_rate": 1.0e-5, "logging_steps": 1, "save_strategy": "no",
              "report_to": "none", "seed": 42, "offload_optimizer": True, "overwrite_output_dir": True}
    configs = {
        "ours": {"model_name_or_path": base, "torch_dtype": "bfloat16", "dataset_path": data,
                 "assistant_only_loss": True, "max_seq_length": seq, "activation_checkpointing": True},
        "trl": {"model": base, "dataset": data, "max_length": seq, "assistant_only_loss": True,
                "gradient_checkpointing": True, "bf16": bf16, "model_init_kwargs": {"dtype": "bfloat16"}},
        "axolotl": {"base_model": base, "plugins": ["offload_trainer.integrations.axolotl.OffloadPlugin"],
                    "datasets": [{"path": data, "ds_type": "json", "type": "chat_template",
                                  "field_messages": "messages", "roles_to_train": ["assistant"]}],
                    "chat_template": "tokenizer_default", "sequence_len": seq, "excess_length_strategy": "truncate",
                    "dataset_prepared_path": os.path.join(work, "axolotl-prepared"), "val_set_size": 0,
                    "micro_batch_size": batch, "bf16": bf16, "gradient_checkpointing": True,
                    # (axolotl shuffles the dataset once more before the Trainer's seeded sampler: off, every tool
                    # sees the same rows in the same order; and its default schedule is cosine, the Trainer's linear:
                    # the others' -- the course only, not a speed setting)
                    "shuffle_merged_datasets": False, "lr_scheduler": "linear"},
        "llamafactory": {"model_name_or_path": base, "stage": "sft", "do_train": True, "finetuning_type": "full",
                         "dataset": "chat", "dataset_dir": work, "cutoff_len": seq,
                         "overwrite_cache": True, "bf16": bf16},  # (its checkpointing is on by default)
    }
    if qlora_base:  # QLoRA of a random-init base bigger than the card, with our layer swap: the command's and axolotl's
        configs["ours-qlora"] = {
            **configs["ours"], "model_name_or_path": None, "model_config": qlora_model,
            "tokenizer_name_or_path": qlora_base, "load_in_4bit": True, "lora_r": 16, "lora_alpha": 32,
            "lora_target_modules": "all-linear", "per_device_train_batch_size": 1, "learning_rate": 1.0e-4,
            "layer_swap": "auto" if bf16 else "1"}
        configs["axolotl-qlora"] = {
            **configs["axolotl"], "base_model": qlora_base, "reinit_weights": True, "adapter": "qlora",
            "load_in_4bit": True, "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "lora_target_linear": True,
            "micro_batch_size": 1, "learning_rate": 1.0e-4, "layer_swap": "auto",
            # (a CPU has no memory to plan for: one layer resident; axolotl's LoRA kernels call CUDA)
            **({} if bf16 else {"layer_swap": "1", "lora_mlp_kernel": False, "lora_qkv_kernel": False,
                                "lora_o_kernel": False})}
    for v in variants:  # 'NAME=TOOL' alone: TOOL's configuration as it is (a run under another environment)
        name, rest = v.split("=", 1)
        tool, _, setting = rest.partition(":")
        if not name.startswith(tool):
            raise SystemExit(f"variant {name!r}: its name begins with its tool's ({tool!r})")
        configs[name] = dict(configs[tool])
        if setting:
            key, value = setting.split("=", 1)
            configs[name][key] = json.loads(value)
    for tool, cfg in configs.items():
        cfg = {**common, **cfg, "output_dir": os.path.join(work, f"out-{tool}")}
        if tool == "ours-qlora":
            cfg.pop("model_name_or_path")
        if tool.startswith("axolotl"):  # (axolotl's name for the batch; it replaces an earlier run's output itself)
            cfg.pop("per_device_train_batch_size")
            cfg.pop("overwrite_output_dir")
        with open(os.path.join(work, f"{tool}.yaml"), "w") as f:
            json.dump(cfg, f, indent=1)  # (JSON is YAML)
    print(f"prepared {work}: {batch * steps} conversations, {batch} x {seq} tokens per step, {steps} steps")


def listen(path: str) -> None:
    """Every Trainer log appended to `path` with the time and the allocator's peaks so far."""
    import torch
    import transformers

    trainer_log = transformers.Trainer.log

    def log(self, logs, *args, **kwargs):
        t = time.perf_counter()
        done = trainer_log(self, logs, *args, **kwargs)  # (our figures join `logs` as the callbacks get it)
        rec = {**logs, "_step": self.state.global_step, "_t": t}
        swap = getattr(getattr(self, "_run", None), "swap", None)
        if swap is not None:  # (layer swap: decoder layers on the GPU now)
            rec["_resident"] = swap.resident
        if torch.cuda.is_available():
            rec["_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
            rec["_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return done

    transformers.Trainer.log = log


def run_tool(tool: str, work: str) -> None:
    """What a user of `tool` runs, in this process."""
    cfg_path = os.path.join(work, f"{tool}.yaml")
    if tool.startswith("ours"):
        from offload_trainer.cli import main

        rc = main(["train", cfg_path])
        if rc:
            raise SystemExit(rc)
    elif tool.startswith("trl"):  # a TRL user's script
        from datasets import load_dataset

        from offload_trainer.trl import OffloadSFTConfig, OffloadSFTTrainer

        cfg = json.load(open(cfg_path))
        model, data = cfg.pop("model"), cfg.pop("dataset")
        trainer = OffloadSFTTrainer(model=model, args=OffloadSFTConfig(**cfg),
                                    train_dataset=load_dataset("json", data_files=data, split="train"))
        trainer.train()
    elif tool.startswith("axolotl"):  # `axolotl train CONFIG`: what its launcher runs in the training process (the
        # environment it sets first: launcher_env)
        from axolotl.cli.train import do_cli

        sys.argv = [sys.argv[0]]  # (its own arguments parser reads them)
        do_cli(config=cfg_path)
    elif tool.startswith("llamafactory"):  # python -m offload_trainer.integrations.llamafactory CONFIG
        import runpy

        sys.argv = ["offload_trainer.integrations.llamafactory", cfg_path]
        try:
            runpy.run_module("offload_trainer.integrations.llamafactory", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            if e.code:
                raise
    else:
        raise SystemExit(f"unknown tool {tool!r}: one of {', '.join(TOOLS)}")


def make_row(tool: str, work: str, logs: list[dict], wall_s: float, error: str | None, skip: int) -> dict:
    import torch
    from row_helpers import allocator_counts, machine

    from offload_trainer.sysinfo import peak_rss_gib

    shape = json.load(open(os.path.join(work, "bench.json")))
    qlora = tool.endswith("-qlora")
    seq, batch = shape["seq"], 1 if qlora else shape["batch"]
    train = [r for r in logs if "loss" in r and "tok_per_s" in r]
    timed = train[skip:]
    steps = [b["_t"] - a["_t"] for a, b in zip(train[skip - 1:], timed)] if skip else []
    return dict(
        run_id=os.environ.get("RUN_ID", "local"), commit=os.environ.get("COMMIT", "unknown"), machine=machine(),
        model=shape["qlora_model"] if qlora else shape["model"], method="qlora" if qlora else "full",
        system=("offload_trainer" if tool in ("ours", "ours-qlora")
                else f"{tool.removesuffix('-qlora')}+offload_trainer"),
        gpus=1, gpu_cap_gib=None, seq_len=seq, micro_batch=batch, grad_accum=1, tokens_per_step=seq * batch,
        tok_per_s=round(statistics.median(r["tok_per_s"] for r in timed), 1) if timed and not error else None,
        step_s_median=round(statistics.median(steps), 3) if steps else None,
        # (the largest of the logs: axolotl's log() reads the peaks and resets them before the Trainer's log runs)
        peak_alloc_gib=round(max((r.get(k, 0.0) for r in logs for k in ("_alloc_gib", AXOLOTL_ALLOC)), default=0.0), 2),
        peak_reserved_gib=round(max((r.get(k, 0.0) for r in logs for k in ("_reserved_gib", AXOLOTL_RESERVED)),
                                    default=0.0), 2),
        host_peak_gib=round(peak_rss_gib() or float("nan"), 2),
        pinned_gib=max((r.get("host_pinned_gib", 0.0) for r in train), default=None), predicted=None, error=error,
        extra={"losses": [round(r["loss"], 4) for r in train], "tok_per_s_logs": [r["tok_per_s"] for r in train],
               "resident_layers": [r.get("_resident") for r in train],
               "adapters_written": os.path.exists(os.path.join(work, f"out-{tool}", "adapter_model.safetensors")),
               # (each log's tok/s times the time since the one before: every tool should train as many per step)
               "tokens_per_log": sorted({round(b["tok_per_s"] * (b["_t"] - a["_t"])) for a, b in
                                         zip(train, train[1:])})[:3],
               "host_rss_gib_max": max((r.get("host_rss_gib", 0.0) for r in train), default=None),
               # (the state copies over PCIe and the compute stream's wait for them, each timed step)
               "pcie_gb_per_s": [r.get("pcie_gb_per_s") for r in timed],
               "gpu_stall_ms": [r.get("gpu_stall_ms") for r in timed],
               "gpu_peak_gib_logged": max((r.get("gpu_peak_gib", 0.0) for r in train), default=None),
               "clip_rate": [r.get("clip_rate") for r in train if "clip_rate" in r][-1:],
               "logged_keys": sorted({k for r in train for k in r if not k.startswith("_")}),
               "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
               # (retries: an allocation failed, the cache was freed after a sync; device allocations / frees: with
               # expandable segments, pages mapped and unmapped)
               "allocator": allocator_counts() if torch.cuda.is_available() else {},
               # (each tool runs on its own pins: LLaMA-Factory's transformers is not the command's)
               "versions": {m: importlib.metadata.version(m) for m in ("torch", "transformers", "datasets")},
               "wall_s": round(wall_s, 1)})


def launcher_env(tool: str) -> None:
    """What the tool's own launcher sets before the training process imports torch. `axolotl train` (its click group,
    before `accelerate launch` starts the process that trains) sets the allocator's expandable segments on torch >=
    2.9 unless the user set a value; torch's allocator reads them when it starts, not later."""
    if tool.startswith("axolotl"):
        assert "torch" not in sys.modules, "the allocator's settings are read when torch starts"
        from axolotl.utils import set_misc_env, set_pytorch_cuda_alloc_conf

        set_pytorch_cuda_alloc_conf()
        set_misc_env()


def profile(first: int, steps: int, trace: str | None) -> list:
    """trainer_bench's profilers on every Trainer this process trains: `steps` steps under torch.profiler from step
    `first` on (the compute stream's idle time, each stream's busy time; the events written to `trace`), then one
    step under cProfile. The same callbacks whichever tool builds the Trainer."""
    import transformers
    from trainer_bench import CProfileStep, ProfileSteps

    profilers = [ProfileSteps(first, steps, trace), CProfileStep(first + steps)]
    trainer_train = transformers.Trainer.train

    def train(self, *args, **kwargs):
        for p in profilers:
            self.add_callback(p)
        return trainer_train(self, *args, **kwargs)

    transformers.Trainer.train = train
    return profilers


def run(tool: str, work: str, out: str | None, skip: int, profile_steps: int = 0, trace: str | None = None) -> None:
    launcher_env(tool)
    logs_path = os.path.join(work, f"logs-{tool}.jsonl")
    if os.path.exists(logs_path):
        os.remove(logs_path)
    listen(logs_path)
    profilers = profile(skip + 1, profile_steps, trace) if profile_steps else []
    t0, error = time.perf_counter(), None
    try:
        run_tool(tool, work)
    except BaseException as e:  # (a failed tool is a row too)
        error = f"{type(e).__name__}: {str(e)[:300]}"
        import traceback

        traceback.print_exc()
    logs = [json.loads(x) for x in open(logs_path)] if os.path.exists(logs_path) else []
    row = make_row(tool, work, logs, time.perf_counter() - t0, error, skip)
    if profilers:  # (the profiled steps are among the timed ones: profiling slows them a little)
        row["extra"].update(profile=profilers[0].summary, cprofile_top_ms=profilers[1].summary)
    print("ROW " + json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def table(path: str) -> None:
    """Each tool's tok/s and memory against `ours` of the same run: the command's row just before it (tools listed
    alternately, "ours axolotl ours axolotl", pair up in order), else the run's first."""
    rows = [json.loads(x) for x in open(path) if x.startswith("{")]
    for run_id in dict.fromkeys(r["run_id"] for r in rows):
        mine = [r for r in rows if r["run_id"] == run_id]
        print(f"run {run_id}")
        ours = [r for r in mine if r["system"] == "offload_trainer"]
        latest = {r["method"]: r for r in reversed(ours)}  # (the run's first, until a later one comes)
        for r in mine:
            if r["system"] == "offload_trainer":
                latest[r["method"]] = r
            ref = latest.get(r["method"])
            ratio = (f"{r['tok_per_s'] / ref['tok_per_s']:.3f}x" if ref and ref["tok_per_s"] and r["tok_per_s"]
                     else "-")
            same = [abs(a - b) for a, b in zip(r["extra"]["losses"], ref["extra"]["losses"])] if ref else []
            print(f"  {r['system']:28} {r['method']:5} {r['tok_per_s']} tok/s ({ratio}), "
                  f"reserved {r['peak_reserved_gib']} GiB, "
                  f"host {r['host_peak_gib']} GiB, losses {r['extra']['losses'][:3]}... (largest difference to "
                  f"offload_trainer's over {len(same)} steps: {max(same, default=float('nan')):.4f}), "
                  f"error {r['error']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("base")
    b.add_argument("dir")
    b.add_argument("--model", default="llama3-8b")
    b.add_argument("--config-only", action="store_true")
    pr = sub.add_parser("prepare")
    pr.add_argument("base")
    pr.add_argument("work")
    pr.add_argument("--seq", type=int, default=2048)
    pr.add_argument("--batch", type=int, default=4)
    pr.add_argument("--steps", type=int, default=10)
    pr.add_argument("--model", default="llama3-8b", help="the shape `base` built (for the rows)")
    pr.add_argument("--qlora-base", help="a config-only base (base --config-only) for axolotl-qlora")
    pr.add_argument("--cpu", action="store_true", help="a rehearsal on a CPU: bf16 off where the tools ask for it")
    pr.add_argument("--variant", action="append", default=[], metavar="NAME=TOOL:KEY=JSON",
                    help="a run NAME (beginning with TOOL) of TOOL's configuration with KEY set")
    r = sub.add_parser("run")
    r.add_argument("tool", help=f"{', '.join(TOOLS)}, or a variant's name")
    r.add_argument("work")
    r.add_argument("--out")
    r.add_argument("--skip", type=int, default=3, help="logs left out of the median (compile, warm-up)")
    r.add_argument("--profile-steps", type=int, default=0,
                   help="profile this many steps after the --skip first, then cProfile one (0: none)")
    r.add_argument("--trace", help="with --profile-steps: write the profiled steps' events here (gzipped JSON)")
    t = sub.add_parser("table")
    t.add_argument("rows")
    a = p.parse_args()
    if a.cmd == "base":
        make_base(a.dir, a.model, a.config_only)
    elif a.cmd == "prepare":
        prepare(a.base, a.work, a.seq, a.batch, a.steps, a.model, bf16=not a.cpu, qlora_base=a.qlora_base,
                variants=a.variant)
    elif a.cmd == "run":
        run(a.tool, a.work, a.out, a.skip, a.profile_steps, a.trace)
    else:
        table(a.rows)


if __name__ == "__main__":
    main()
