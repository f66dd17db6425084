"""The LLaMA-Factory launcher, against LLaMA-Factory itself: `python -m offload_trainer.integrations.llamafactory
CONFIG.yaml` runs LLaMA-Factory's own `run_exp` (its parser, dataset registry, template, collator and trainer) with
the offload wiring on its trainer; what would clash is refused by name.

LLaMA-Factory pins its own transformers / peft / trl / datasets / accelerate and imports torchaudio (which must match
torch's version), so it lives in a virtual environment of its own and these tests skip elsewhere:
    bash scripts/llamafactory_venv.sh && .venv-llamafactory/bin/python -m pytest -q -m llamafactory tests/test_llamafactory.py
"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("llamafactory", reason="LLaMA-Factory lives in its own venv: scripts/llamafactory_venv.sh")

pytestmark = pytest.mark.llamafactory

sys.path.insert(0, os.path.dirname(__file__))
from helpers import SUM_ROWS, assert_same_course, readme_yaml, save_tiny_base  # noqa: E402

LAUNCHER = "offload_trainer.integrations.llamafactory"

# The launcher in a process of its own (LLaMA-Factory sets up logging and environment per process); a callback reports
# what was built.
RUN = """
import functools, json, sys
from transformers import TrainerCallback
import llamafactory.train.sft.workflow as sft
import llamafactory.train.tuner as tuner
import torch.utils.checkpoint as tuc

checkpoint, reentrant = tuc.checkpoint, set()

def spy(fn, *a, **k):  # the decoder layers' checkpointing (transformers hands each a partial of the layer's call)
    if isinstance(fn, functools.partial):
        reentrant.add(k.get("use_reentrant"))
    return checkpoint(fn, *a, **k)

tuc.checkpoint = spy  # (LLaMA-Factory imports it when it enables checkpointing)

class Report(TrainerCallback):
    def on_train_end(self, args, state, control, **kw):
        built["losses"] = [h["loss"] for h in state.log_history if "loss" in h]

built, run_exp = {}, tuner.run_exp

def run_reporting(args=None, callbacks=None):  # run_exp, noting the trainer that the SFT workflow builds
    cls = sft.CustomSeq2SeqTrainer
    class Spy(cls):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            built.update(trainer=[c.__name__ for c in cls.__mro__], args=type(self.args).__name__, me=self)
    sft.CustomSeq2SeqTrainer = Spy
    try:
        return run_exp(args, [Report()])
    finally:
        sft.CustomSeq2SeqTrainer = cls

tuner.run_exp = run_reporting
if sys.argv[1] == "ours":  # as `python -m offload_trainer.integrations.llamafactory CONFIG` runs it
    import runpy
    sys.argv = ["-m", *sys.argv[2:]]
    try:
        runpy.run_module("offload_trainer.integrations.llamafactory", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        rc = e.code
else:
    rc = run_reporting(json.load(open(sys.argv[2]))) or 0
me = built.pop("me", None)
run = getattr(me, "_run", None)
built.update(optimizer=type(run and run.optimizer).__name__, swapped=type(run and run.swap).__name__,
             activations=type(run and run.activations).__name__, reentrant=sorted(reentrant, key=str))
print("RESULT " + json.dumps({"rc": rc, **built}))
"""


def readme_lines() -> dict:
    """The README's LLaMA-Factory YAML (the keys a user adds), as a dict."""
    return readme_yaml("llamafactory")


def write_case(tmp_path, ours=True, **extra):
    base = tmp_path / "base"
    save_tiny_base(base)
    if not (tmp_path / "dataset_info.json").exists():
        (tmp_path / "sums.json").write_text(json.dumps(SUM_ROWS))
        (tmp_path / "dataset_info.json").write_text(json.dumps({"sums": {"file_name": "sums.json"}}))
    name = "ours" if ours else "theirs"
    cfg = {"model_name_or_path": str(base), "stage": "sft", "do_train": True, "finetuning_type": "full",
           "dataset": "sums", "dataset_dir": str(tmp_path), "template": "empty", "cutoff_len": 64,
           "overwrite_cache": True, "preprocessing_num_workers": 1, "output_dir": str(tmp_path / f"out-{name}"),
           "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "max_steps": 6,
           "learning_rate": 0.003, "lr_scheduler_type": "constant", "logging_steps": 1, "save_strategy": "no",
           "report_to": "none", "bf16": False, "seed": 42, "disable_shuffling": True,
           "optim": "adamw_torch", **(readme_lines() if ours else {}), **extra}
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(cfg))  # (JSON is YAML)
    return path


def run(which, cfg_path):
    env = {**os.environ, "OMP_NUM_THREADS": "2", "DISABLE_VERSION_CHECK": "0"}
    r = subprocess.run([sys.executable, "-c", RUN, which, str(cfg_path)], capture_output=True, text=True, timeout=900,
                       env=env, cwd=os.path.dirname(cfg_path))
    result = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    return r, json.loads(result[0][7:]) if result else None


def test_the_readme_lines_are_our_keys():
    import dataclasses

    from offload_trainer.trainer.args import OffloadFields

    ours = {f.name for f in dataclasses.fields(OffloadFields)}
    assert readme_lines() and set(readme_lines()) <= ours


def test_llamafactory_trains_with_the_launcher_like_without_it(tmp_path):
    """The same LLaMA-Factory SFT config through `llamafactory-cli train`'s run_exp and through the launcher: with it,
    LLaMA-Factory's trainer carries the offload wiring and streams 8-bit AdamW, the first loss is the same (same
    weights, data, template and seed) and the course close (8-bit streamed AdamW against torch's fp32 AdamW); with
    layer swap, activation offload and offloaded gradients the launcher's losses equal its unswapped run's."""
    r, ours = run("ours", write_case(tmp_path))
    assert ours and ours["rc"] == 0, r.stderr[-4000:]
    r, theirs = run("theirs", write_case(tmp_path, ours=False))
    assert theirs and theirs["rc"] == 0, r.stderr[-4000:]
    assert ours["trainer"][:3] == ["OffloadCustomSeq2SeqTrainer", "OffloadMixin", "CustomSeq2SeqTrainer"]
    assert ours["args"] == "OffloadLlamaFactoryArguments" and theirs["trainer"][0] == "CustomSeq2SeqTrainer"
    assert ours["optimizer"] == "StreamedAdamW8bit" and theirs["optimizer"] == "NoneType"
    assert_same_course(ours["losses"], theirs["losses"])

    swap = {"layer_swap": 1, "activation_checkpointing": True, "activation_offload": True, "offload_gradients": True,
            "output_dir": str(tmp_path / "out-swap")}
    r, swapped = run("ours", write_case(tmp_path, **swap))
    assert swapped and swapped["rc"] == 0, r.stderr[-4000:]
    assert swapped["swapped"] == "LayerSwap" and swapped["activations"] == "ActivationOffloader"
    assert ours["swapped"] == ours["activations"] == "NoneType"
    assert swapped["losses"] == pytest.approx(ours["losses"], rel=1e-5)
    assert "offload_trainer: layer swap: 1 of 2 decoder layers" in r.stderr  # our log lines reach the user
    import torch

    saved = torch.load(tmp_path / "out-swap" / "training_args.bin", weights_only=False)  # (found by its module's name)
    assert type(saved).__name__ == "OffloadLlamaFactoryArguments" and saved.layer_swap == "1"


@pytest.mark.parametrize("extra, reentrant", [
    ({}, [False]),
    ({"gradient_checkpointing": True}, [False]),  # the Trainer enables it again through LLaMA-Factory's method
    ({"use_reentrant_gc": True, "gradient_checkpointing": True}, [True]),  # the config's choice stays
])
def test_checkpointing_is_non_reentrant_unless_the_config_says(tmp_path, extra, reentrant):
    """LLaMA-Factory checkpoints reentrant by default, whose recompute reruns each layer's last matmul; through the
    launcher its decoder layers checkpoint non-reentrant, as `offload-trainer train` does, unless the config sets
    use_reentrant_gc. Reported is what each layer's checkpoint call was given."""
    r, ours = run("ours", write_case(tmp_path, **extra))
    assert ours and ours["rc"] == 0, r.stderr[-4000:]
    assert ours["reentrant"] == reentrant
    assert ("use_reentrant_gc: false" in r.stderr) == ("use_reentrant_gc" not in extra)


@pytest.mark.parametrize("extra, needle", [
    ({"deepspeed": "ds_z3_offload_config.json"}, "remove deepspeed"),
    ({"use_galore": True}, "remove use_galore: it replaces AdamW"),
    ({"loraplus_lr_ratio": 16.0}, "remove loraplus_lr_ratio"),
    ({"use_asft_loss": True}, "remove use_asft_loss"),
    ({"stage": "dpo"}, "for DPO use OffloadDPOTrainer"),
    ({"stage": "rm"}, "stage: rm: the launcher wires the pt and sft stages only"),
])
def test_what_would_clash_is_refused_by_name(tmp_path, capsys, extra, needle):
    from offload_trainer.integrations.llamafactory import main

    assert main([str(write_case(tmp_path, **extra))]) == 2
    err = capsys.readouterr().err
    assert "cannot run with" in err and needle in err
    assert not (tmp_path / "out-ours").exists()  # refused before anything ran


def test_our_keys_go_through_llamafactorys_parser_and_the_seams_are_undone(tmp_path):
    from llamafactory.hparams import get_train_args, parser
    from llamafactory.train.sft import workflow as sft

    from offload_trainer.integrations import llamafactory as launcher

    cfg = json.loads(write_case(tmp_path).read_text())
    with launcher._seams():
        args = get_train_args({**cfg, "layer_swap": "2", "activation_checkpointing": True})[2]
        assert type(args).__name__ == "OffloadLlamaFactoryArguments" and args.layer_swap == "2"
        with pytest.raises(ValueError, match="layer_swap='sideways': use off, auto, or a number"):
            get_train_args({**cfg, "layer_swap": "sideways"})
        with pytest.raises(ValueError, match="offload_optimiser"):  # a typo is still LLaMA-Factory's error
            get_train_args({**cfg, "offload_optimiser": True})
        assert sft.CustomSeq2SeqTrainer.__name__ == "OffloadCustomSeq2SeqTrainer"
    assert parser.TrainingArguments in parser._TRAIN_ARGS and sft.CustomSeq2SeqTrainer.__name__ == "CustomSeq2SeqTrainer"
    with pytest.raises(ValueError, match="offload_optimizer"):  # without the launcher its parser knows no such key
        get_train_args(cfg)


def test_torchrun_two_processes_match_one(tmp_path):
    """`torchrun --nproc_per_node 2 -m offload_trainer.integrations.llamafactory CONFIG` (gloo on CPU), 2 x 2 rows a
    step, against one process with 4 rows a step: the same losses (each rank streams its share of the states)."""
    def losses(out):
        with open(out / "trainer_state.json") as f:
            return [h["loss"] for h in json.load(f)["log_history"] if "loss" in h]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    two = tmp_path / "out-two"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", LAUNCHER, str(write_case(tmp_path)), f"output_dir={two}",
                        "per_device_train_batch_size=2", "ddp_backend=gloo"],
                       capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "data parallel over 2 ranks" in r.stderr
    r, one = run("ours", write_case(tmp_path))
    assert one and one["rc"] == 0, r.stderr[-4000:]
    assert losses(two) == pytest.approx(one["losses"], rel=1e-5) and len(one["losses"]) == 6
