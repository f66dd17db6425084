import json
import os

import pytest
import torch

from offload_trainer import cli

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny-cpu.yaml")


def test_train_tiny_config_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # (so that the test's own setting is undone after it)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    import transformers

    def no_padding(self, features):  # the Trainer's default collator with a tokenizer: ~6 ms a 4 x 2048 batch
        raise AssertionError("the command's blocks have one length: stacking them needs no tokenizer padding")

    monkeypatch.setattr(transformers.DataCollatorWithPadding, "__call__", no_padding)
    out = tmp_path / "run"
    rc = cli.main(["train", CONFIG, "max_steps=6", "save_steps=6", "logging_steps=3", f"output_dir={out}"])
    assert rc == 0
    assert (out / "checkpoint-6" / "optimizer.pt").exists()
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 6
    losses = [h["loss"] for h in state["log_history"] if "loss" in h]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert (out / "model.safetensors").exists()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"  # (CUDA reads it at first use)
    # the plots of the run, read back: a real picture, and the series it drew is the logged one
    import matplotlib.image

    from offload_trainer.report import series, trainer_state

    for name in ("loss.png", "throughput.png", "memory.png"):
        img = matplotlib.image.imread(out / name)
        assert img.shape[0] > 100 and img.std() > 0.01
    steps, values = series(trainer_state(str(out)), "loss")
    assert steps == [3, 6] and values == losses


def test_keys_lists_our_fields_with_help(capsys):
    assert cli.main(["keys"]) == 0
    out = capsys.readouterr().out
    assert "offload_optimizer\n    Keep AdamW states 8-bit" in out
    assert "learning_rate\n    (TrainingArguments)" in out


def test_train_reads_the_model_config_once(tmp_path, monkeypatch):
    """The plan before any weight and the vision check share one read of the model's config (config.json of a
    checkpoint may be remote)."""
    import offload_trainer.models as models

    reads = []
    read = cli.model_config_of
    monkeypatch.setattr(cli, "model_config_of", lambda margs: reads.append(margs) or read(margs))

    class Loaded(Exception):
        pass

    def load_model(*a, **k):
        raise Loaded

    monkeypatch.setattr(models, "load_model", load_model)
    try:
        cli.train(CONFIG, [f"output_dir={tmp_path / 'run'}"])
    except Loaded:
        pass
    else:
        raise AssertionError("train() went past loading the model")
    assert len(reads) == 1


def test_train_sets_expandable_segments_in_the_running_allocator_unless_the_user_chose(tmp_path, monkeypatch):
    """torch may have read PYTORCH_CUDA_ALLOC_CONF before main() runs: the running allocator is told too. A user's
    setting is kept; under torchrun none is made."""
    missing = str(tmp_path / "missing.yaml")  # fails after the allocator setting, before anything is loaded
    told = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", told.append, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # (undone after the test)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert cli.main(["train", missing]) == 2
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert told == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:native")
    assert cli.main(["train", missing]) == 2
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "backend:native" and len(told) == 1
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["train", missing]) == 2
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and len(told) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cli_builds_a_random_init_model_on_the_gpu(tmp_path, monkeypatch):
    from offload_trainer import models

    where, real = [], models.load_model

    def load_model(*a, **k):
        model = real(*a, **k)
        where.append({p.device.type for p in model.parameters()})
        return model

    monkeypatch.setattr(models, "load_model", load_model)
    assert cli.main(["train", CONFIG, "max_steps=2", f"output_dir={tmp_path}", "save_steps=100",
                     "torch_dtype=bfloat16"]) == 0
    assert where == [{"cuda"}]
