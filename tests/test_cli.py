import json
import os

import pytest
import torch

from offload_trainer import cli
from offload_trainer.cli import recipe

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

    from offload_trainer.cli.report import history, series

    for name in ("loss.png", "throughput.png", "memory.png"):
        img = matplotlib.image.imread(out / name)
        assert img.shape[0] > 100 and img.std() > 0.01
    steps, values = series(history(str(out)), "loss")
    assert steps == [3, 6] and values == losses


def test_keys_lists_every_key_with_type_and_default(capsys):
    assert cli.main(["keys"]) == 0
    out = capsys.readouterr().out
    assert "offload_optimizer" in out and "bool | null = null\n      Keep AdamW states 8-bit" in out
    assert "  learning_rate" in out and "float = 5e-05" in out
    assert "max_length (max_seq_length)" in out  # the aliases


def test_the_shipped_keys_table_is_the_live_one():
    """assets/keys.json is what `keys` prints without importing transformers: it must equal the fields as they are
    (regenerate it with `python -m offload_trainer.cli.keys --write` when they change, or transformers does)."""
    from importlib import resources

    from offload_trainer.cli.keys import build_table

    shipped = json.loads((resources.files("offload_trainer") / "assets" / "keys.json").read_text())
    live = build_table()
    if shipped["transformers"] != live["transformers"]:
        pytest.fail(f"assets/keys.json is for transformers {shipped['transformers']}, this is "
                    f"{live['transformers']}: run python -m offload_trainer.cli.keys --write")
    assert shipped == json.loads(json.dumps(live))


@pytest.mark.parametrize("argv", [["--help"], ["keys"]])
def test_help_and_keys_answer_fast_and_print_no_warnings(argv):
    """A new process, as a user runs it: under 2 s on the CI machine (the heavy stack is not imported), nothing on
    stderr."""
    import subprocess
    import sys
    import time

    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "offload_trainer.cli", *argv], capture_output=True, text=True,
                       env={k: v for k, v in os.environ.items() if k != "TORCHAO_FORCE_SKIP_LOADING_SO_FILES"})
    took = time.perf_counter() - t0
    assert r.returncode == 0 and r.stdout.strip()
    assert r.stderr == "", r.stderr
    assert took < 2.0, f"{argv}: {took:.2f} s"


@pytest.mark.slow
def test_plan_prints_no_library_chatter():
    """`offload-trainer plan` in a new process: the table on stdout, nothing on stderr (bitsandbytes' note on its
    optional CPU kernels, torch's and torchao's import notices are not ours to act on)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "offload_trainer.cli", "plan", CONFIG, "model_config=llama3-8b",
                        "torch_dtype=bfloat16", "gpu_memory_limit_gb=24", "max_seq_length=2048",
                        "per_device_train_batch_size=4", "--host-gb", "64"], capture_output=True, text=True,
                       env={k: v for k, v in os.environ.items() if k != "TORCHAO_FORCE_SKIP_LOADING_SO_FILES"})
    assert r.returncode == 0 and "GPU peak" in r.stdout, r.stderr
    assert r.stderr == "", r.stderr


@pytest.mark.parametrize("key, hint", [
    ("base_model", "here it is model_name_or_path"), ("micro_batch_size", "per_device_train_batch_size"),
    ("sequence_len", "max_seq_length"), ("sample_packing", "packing"), ("train_on_inputs", "completion_only_loss"),
    ("val_set_size", "eval_fraction"), ("cutoff_len", "max_seq_length"), ("dtype", "torch_dtype"),
    ("use_peft", "lora_r"),
])
def test_keys_of_other_tools_get_our_name(key, hint, tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model_config: tiny-llama\n{key}: 1\n")
    assert cli.main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"unknown key {key!r} (a key of another fine-tuning tool); here it is" in err and hint in err


def test_aliases_with_the_same_meaning_are_accepted(tmp_path):
    from offload_trainer.cli.config import load_config, parse_args

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model_config: tiny-llama\nmax_length: 96\ntext_field: body\noutput_dir: {tmp_path}\n")
    _, data_args, _ = parse_args(load_config(str(cfg)))
    assert data_args.max_seq_length == 96 and data_args.dataset_text_field == "body"


def test_a_local_looking_model_path_that_is_not_there_is_reported_at_once(tmp_path, capsys, monkeypatch):
    """`outputs/smollm2-135m` before `example-model` ran: `outputs` is a directory here, so this is a path, not a Hub
    id (the Hub lookup waited 40 s for a network that is not there, then raised an OSError)."""
    import time

    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model_name_or_path: outputs/smollm2-135m\n")
    t0 = time.perf_counter()
    assert cli.main(["train", str(cfg)]) == 2
    assert time.perf_counter() - t0 < 5
    assert "directory 'outputs/smollm2-135m' does not exist -- `offload-trainer example-model` writes it" in \
        capsys.readouterr().err


def test_report_with_odd_checkpoint_names(tmp_path, capsys):
    """`report` on a directory whose checkpoint-* names are not checkpoint-N: they are not checkpoints (no
    traceback); the sentence says there is no trainer state."""
    (tmp_path / "checkpoint-final").mkdir()
    (tmp_path / "checkpoint-final" / "trainer_state.json").write_text("{}")
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "no trainer_state.json in" in capsys.readouterr().err


def test_report_prints_a_summary_and_says_what_to_do_without_a_state(tmp_path, capsys):
    from offload_trainer.cli.report import summary

    assert cli.main(["report", str(tmp_path)]) == 2
    assert "a Python run writes it with trainer.save_state()" in capsys.readouterr().err
    state = {"log_history": [{"step": 1, "loss": 5.0, "tok_per_s": 90.0, "host_rss_gib": 0.5},
                             {"step": 2, "loss": 4.0, "tok_per_s": 100.0, "host_rss_gib": 0.6},
                             {"step": 2, "eval_loss": 3.5}]}
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "train loss 5.0000 -> 4.0000" in out and "eval loss   3.5000" in out and "100 tok/s" in out
    assert summary(state) in out


def test_report_of_a_config_reads_its_output_dir(tmp_path, capsys, monkeypatch):
    """`report CONFIG.yaml` reports the run the config writes (its output_dir, relative to where the command runs, or
    the default); any other file is a sentence (was `no trainer_state.json in c.txt`)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 1, "loss": 2.5}]}))
    (tmp_path / "c.yaml").write_text("model_config: tiny-llama\noutput_dir: runs/a\n")
    assert cli.main(["report", "c.yaml"]) == 0
    out = capsys.readouterr().out
    assert "run runs/a (the output_dir of c.yaml)" in out and "train loss 2.5000" in out
    assert (tmp_path / "runs" / "a" / "loss.png").is_file()
    (tmp_path / "d.yml").write_text("model_config: tiny-llama\n")
    assert cli.main(["report", "d.yml"]) == 2
    assert "no trainer_state.json in outputs/run" in capsys.readouterr().err
    (tmp_path / "c.txt").write_text("x")
    assert cli.main(["report", "c.txt"]) == 2
    assert "report reads a run's output_dir, one of its checkpoints, or the config that trained it (.yaml): 'c.txt' " \
           "is another file" in capsys.readouterr().err


def test_report_reads_the_figures_beside_the_trainer_state(tmp_path, capsys):
    """A run of ours: the Trainer's log history in trainer_state.json, our figures in run_figures.json (by step). The
    report puts them together; an unreadable figures file leaves the summary without them, not a traceback."""
    state = {"log_history": [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}, {"step": 2, "eval_loss": 3.5}]}
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    figures = {"figures": [{"step": 1, "tok_per_s": 90.0, "host_rss_gib": 0.5},
                           {"step": 2, "tok_per_s": 100.0, "host_rss_gib": 0.625}]}
    (tmp_path / "run_figures.json").write_text(json.dumps(figures))
    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "100 tok/s" in out and "host RSS 0.62 GiB" in out and (tmp_path / "throughput.png").is_file()
    (tmp_path / "run_figures.json").write_text('{"figures": [{"step"')
    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "train loss 5.0000 -> 4.0000" in out and "tok/s" not in out


@pytest.mark.parametrize("text", ["{ cut", "[1, 2]", '{"log_history": 5}'])
def test_report_of_a_damaged_trainer_state(tmp_path, capsys, text):
    """trainer_state.json cut short, not a mapping, or a history that is not a list: a sentence naming the file and
    where else the history is (was a raw JSONDecodeError / AttributeError)."""
    (tmp_path / "trainer_state.json").write_text(text)
    assert cli.main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "trainer_state.json cannot be read as a Trainer state" in err and "checkpoint-N" in err
    assert "Traceback" not in err


def test_report_leaves_out_values_that_are_not_numbers(tmp_path, capsys):
    """A hand-edited history with a string where a figure should be: those values are left out of the summary and
    the plots (was a raw ValueError from the format)."""
    state = {"log_history": [{"step": 1, "loss": "x"}, {"step": 2, "loss": 2.0, "tok_per_s": "fast"},
                             {"step": "3", "loss": 1.5}, {"step": [5], "loss": 1.2},
                             {"step": 4, "loss": 1.0, "tok_per_s": 50.0}]}
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    (tmp_path / "run_figures.json").write_text(json.dumps({"figures": [{"step": 4, "host_rss_gib": 0.25}]}))
    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "train loss 2.0000 -> 1.0000" in out and "50 tok/s" in out and "host RSS 0.25 GiB" in out


def test_train_reads_the_model_config_once(tmp_path, monkeypatch):
    """The plan before any weight and the vision check share one read of the model's config (config.json of a
    checkpoint may be remote)."""
    import offload_trainer.models as models

    reads = []
    read = recipe.model_config_of
    monkeypatch.setattr(recipe, "model_config_of", lambda margs: reads.append(margs) or read(margs))

    class Loaded(Exception):
        pass

    def load_model(*a, **k):
        raise Loaded

    monkeypatch.setattr(models, "load_model", load_model)
    try:
        recipe.train(CONFIG, [f"output_dir={tmp_path / 'run'}"])
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
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.setenv(name, "")  # (undone after the test)
        monkeypatch.delenv(name)
    assert cli.main(["train", missing]) == 2
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert told == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:native")
    assert cli.main(["train", missing]) == 2
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "backend:native" and len(told) == 1
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")  # (torch >= 2.9's name)
    assert cli.main(["train", missing]) == 2
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and len(told) == 1
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
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


def test_final_output_bytes_count_the_lora_targets():
    """The disk a LoRA run's end needs counts the adapters of the modules it targets (it summed every linear,
    whatever lora_target_modules said), as the planner's ModelShape.lora_params does."""
    from types import SimpleNamespace

    from offload_trainer.cli.recipe import final_output_bytes
    from offload_trainer.models import architecture_config
    from offload_trainer.planner import ModelShape

    cfg = architecture_config("llama3-8b")
    shape = ModelShape.from_config(cfg)
    args = dict(lora_r=16, torch_dtype="bfloat16", load_in_4bit=True)
    qv = final_output_bytes(SimpleNamespace(**args, lora_target_modules="q_proj,v_proj"), cfg)
    every = final_output_bytes(SimpleNamespace(**args, lora_target_modules="all-linear"), cfg)
    assert qv == int(4 * shape.lora_params(16, "q_proj,v_proj") * 1.05) + 2**20 and qv < every / 3
