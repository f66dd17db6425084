"""Where fine-tuners already work: the Trainer's experiment trackers receive our per-step figures, `accelerate launch`
runs what torchrun runs, and a DeepSpeed / FSDP launch is refused with the switch to turn off."""
import os
import re
import shlex
import subprocess
import sys

import pytest

from cli_cases import stderr_of
from offload_trainer import cli
from offload_trainer.trainer.run_history import run_history

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# Our figures in a training log (run_logs.add_run_figures: in the callbacks' logs and run_figures.json); on a GPU
# also gpu_peak_gib, pcie_gb_per_s, host_pinned_gib and gpu_stall_ms, from the same dict.
OURS = {"tok_per_s", "host_rss_gib", "gpu_peak_gib", "host_pinned_gib", "pcie_gb_per_s", "gpu_stall_ms",
        "nonfinite_skipped"}


def test_tensorboard_receives_the_run_figures_as_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    assert cli.main(["train", "configs/tiny-cpu.yaml", f"output_dir={out}", "max_steps=4", "logging_steps=2",
                     "save_strategy=no", "eval_fraction=0", "report_to=tensorboard"]) == 0
    # (transformers 5 writes under output_dir/runs/<time>; its logging_dir argument is gone)
    events = [os.path.join(d, f) for d, _, fs in os.walk(out / "runs") for f in fs if "tfevents" in f]
    assert events, "no TensorBoard event file written"
    acc = EventAccumulator(os.path.dirname(events[0]))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    logged = [h for h in run_history(str(out)) if "loss" in h]
    ours = OURS & set(logged[0])
    assert {"tok_per_s", "host_rss_gib"} <= ours  # (what a CPU run logs)
    assert {"train/loss", *(f"train/{k}" for k in ours)} <= tags, sorted(tags)
    steps = [e.step for e in acc.Scalars("train/tok_per_s")]
    assert steps == [h["step"] for h in logged] == [2, 4]
    assert [e.value for e in acc.Scalars("train/tok_per_s")] == pytest.approx([h["tok_per_s"] for h in logged])


@pytest.mark.slow
def test_accelerate_launch_two_processes_matches_one_process_accumulating(tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2 -m offload_trainer.cli train ...` (its torch.distributed
    launcher; gloo on a CPU machine) trains the same losses as one process accumulating the same global batch, each
    rank holding its share of the states, as under torchrun."""
    from test_distributed import KEYS, _losses

    keys = [k for k in KEYS if not k.startswith("save_steps")] + ["save_strategy=no"]
    readme = open(os.path.join(ROOT, "README.md")).read()
    line = re.search(r"^accelerate launch .*$", readme, re.M).group(0)  # the README's own command
    argv = shlex.split(line)[2:]
    # (the launcher's remaining questions answered as `accelerate config` would; a free port for parallel runs)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", "0", *argv, f"output_dir={tmp_path / 'two'}", *keys]
    r = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "data parallel over 2 ranks" in r.stderr
    assert cli.main(["train", "configs/tiny-cpu.yaml", f"output_dir={tmp_path / 'one'}", *keys,
                     "gradient_accumulation_steps=2"]) == 0
    want = _losses(tmp_path / "one")
    assert _losses(tmp_path / "two") == want and len(want) == 6


@pytest.mark.parametrize("var, engine", [("ACCELERATE_USE_DEEPSPEED", "DEEPSPEED"), ("ACCELERATE_USE_FSDP", "FSDP")])
def test_accelerate_launch_with_deepspeed_or_fsdp_is_refused_naming_the_launch_to_use(var, engine, tmp_path,
                                                                                       monkeypatch, capsys):
    """What `accelerate launch --use_deepspeed / --use_fsdp` (or such an accelerate config) sets in the processes:
    a sentence before any weight is loaded, from the command and from a script's Trainer alike."""
    monkeypatch.setenv(var, "true")
    rc = cli.main(["train", "configs/tiny-cpu.yaml", f"output_dir={tmp_path / 'out'}", "max_steps=1"])
    err = stderr_of(capsys)
    assert rc != 0 and f"cannot run under {engine}" in err and "accelerate launch --multi_gpu" in err, err[-2000:]
    assert "offload_optimizer: false" in err and not (tmp_path / "out").exists()
    if engine == "FSDP":  # (TrainingArguments under DeepSpeed's variable needs DeepSpeed installed)
        from transformers import TrainingArguments

        from helpers import tiny_setup
        from offload_trainer import OffloadTrainer
        from offload_trainer.errors import ConfigError

        model, _, train = tiny_setup()
        with pytest.raises(ConfigError, match="cannot run under FSDP"):
            OffloadTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / "s"), report_to="none"),
                           train_dataset=train)


FULL_BF16 = {"finetuning_type": "full", "bf16": True}


@pytest.mark.parametrize("cfg, on_gpu, set_", [
    (FULL_BF16, True, True),
    ({**FULL_BF16, "finetuning_type": "freeze"}, True, True),
    (FULL_BF16, False, False),  # LLaMA-Factory refuses pure_bf16 without a GPU; the Trainer's AdamW runs there
    ({"bf16": True}, True, False),  # LoRA (LLaMA-Factory's default): small adapters keep its fp32 upcast
    ({**FULL_BF16, "pure_bf16": False}, True, False),  # the user's word stands
    ({**FULL_BF16, "offload_optimizer": False}, True, False),
    ({**FULL_BF16, "optim": "sgd"}, True, False),
    ({"finetuning_type": "full", "fp16": True}, True, False),
])
def test_llamafactory_full_finetunes_keep_bf16_weights_where_the_optimizer_streams(cfg, on_gpu, set_):
    """LLaMA-Factory casts the trainable weights of a full finetune to fp32 (16 GiB more on the GPU for 8B: a held
    24 GB card ran out of memory in that cast before the first step); where our optimizer streams, the launcher keeps
    them bf16 as the command does, and says so."""
    from offload_trainer.integrations.llamafactory import bf16_weights

    cfg = dict(cfg)
    note = bf16_weights(cfg, on_gpu)
    assert (cfg.get("pure_bf16") is True) == set_ and bool(note) == set_
    if set_:
        assert "pure_bf16: false" in note


@pytest.mark.parametrize("cfg, reentrant_gc, kwargs", [
    ({}, False, None),
    ({"gradient_checkpointing": True}, False, {"use_reentrant": False}),  # the Trainer's second enable, same choice
    ({"use_reentrant_gc": True}, True, None),  # the user's word stands
    ({"use_reentrant_gc": True, "gradient_checkpointing": True}, True, {"use_reentrant": True}),
    ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}}, False,
     {"use_reentrant": True}),  # given kwargs stay
    ({"disable_gradient_checkpointing": True}, None, None),
    ({"use_unsloth_gc": True}, None, None),  # its own offloaded checkpointing, not torch's
])
def test_llamafactory_checkpoints_non_reentrant_unless_the_config_says(cfg, reentrant_gc, kwargs):
    """LLaMA-Factory's reentrant default reruns each layer's last matmul in the recompute (the whole of its gap to
    the command on a held 24 GB card); the launcher picks non-reentrant, for both ways LLaMA-Factory enables
    checkpointing, where the config leaves it open, and says so."""
    from offload_trainer.integrations.llamafactory import non_reentrant_checkpointing
    from offload_trainer.trainer.args import HAS_ACTIVATION_CHECKPOINTING

    cfg = dict(cfg)
    given = dict(cfg)
    note = non_reentrant_checkpointing(cfg)
    assert cfg.get("use_reentrant_gc") == reentrant_gc
    ours = "activation_checkpointing_kwargs" if HAS_ACTIVATION_CHECKPOINTING else "gradient_checkpointing_kwargs"
    key = "gradient_checkpointing_kwargs" if "gradient_checkpointing_kwargs" in given else ours
    assert cfg.get(key) == kwargs
    assert bool(note) == ("use_reentrant_gc" not in given and reentrant_gc is not None)
    if note:
        assert "use_reentrant_gc: true" in note


def test_trainable_fp32_weights_cast_to_the_load_dtype_frozen_ones_left():
    """The axolotl plugin's cast: a full finetune's upcast fp32 weights back to bf16 (what the streamed optimizer
    updates), frozen ones and bf16 ones untouched, the GiB freed counted."""
    import torch

    from offload_trainer.integrations import cast_trainable_weights

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256).to(torch.bfloat16),
                                torch.nn.Linear(256, 256))
    model[2].requires_grad_(False)
    before = model[0].weight.detach().clone()
    n, gib = cast_trainable_weights(model, torch.bfloat16)
    assert n == 2 and gib == pytest.approx((256 * 256 + 256) * 2 / 2**30)
    assert model[0].weight.dtype == model[1].weight.dtype == torch.bfloat16 and model[2].weight.dtype == torch.float32
    assert torch.equal(model[0].weight.float(), before.to(torch.bfloat16).float())


def test_a_model_keeps_saving_in_shards_across_the_trainers_own_saves(tmp_path):
    """The axolotl plugin's save seam: axolotl saves the finished model with `model.save_pretrained`, so the model
    itself carries the Trainer's shard size (a whole 8B model in one default 50 GB shard was gathered in host memory
    at once); the Trainer's own saves, which set the same seam for their duration, leave it in place."""
    import json

    from helpers import tiny_setup
    from offload_trainer.trainer.seams import saving_in_shards, smaller_shards

    model = tiny_setup()[0]
    model.save_pretrained = ours = saving_in_shards(model, 200_000)
    with smaller_shards(model, 300_000):
        assert model.save_pretrained is not ours
    assert model.save_pretrained is ours
    model.save_pretrained(tmp_path / "m")
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    shards = {os.path.getsize(tmp_path / "m" / f) for f in set(index["weight_map"].values())}
    assert len(shards) > 1 and max(shards) < 2 * 200_000  # (a tensor bigger than the size gets a shard of its own)
    model.save_pretrained(tmp_path / "whole", max_shard_size="1GB")  # the caller's size still wins
    assert (tmp_path / "whole" / "model.safetensors").exists()
