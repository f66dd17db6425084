"""Every row of docs/bad-inputs.md: the message names the problem and the fix, no traceback for user errors,
nothing on disk is damaged. Rows and tests are matched by id: a row without a test (or the reverse) fails."""
import errno
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from cli_cases import Case, copy_run, expect
from offload_trainer import cli

DOC = Path(__file__).resolve().parent.parent / "docs" / "bad-inputs.md"


def doc_rows() -> dict[str, str]:
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("id", "---"):
            rows[cells[0]] = cells[-1]
    return rows


# ---------------------------------------------------------------------------------------------------- config
CONFIG_ROWS = {
    "malformed-yaml": ("max_steps: [1\n", "while parsing a flow sequence"),
    "unknown-key": ("learning_rat: 1e-3\n", "unknown key 'learning_rat'. Did you mean 'learning_rate'?"),
    "wrong-type": ("max_steps: ten\n", "key 'max_steps' = 'ten' (str) has the wrong type; expected int"),
    "missing-model-path": ("model_name_or_path: ./no/such/model\nmodel_config: null\n",
                           "directory './no/such/model' does not exist"),
    "unknown-architecture": ("model_config: llama9\n", "'llama9' is not a known architecture. Did you mean"),
    "missing-data": ("dataset_path: /nonexistent/data.jsonl\n", "'/nonexistent/data.jsonl' does not exist"),
    "optim-not-adamw": ("offload_optimizer: true\noptim: sgd\n",
                        "offload_optimizer=True streams 8-bit AdamW states, but optim='sgd'"),
    "activation-offload-without-checkpointing": ("activation_offload: true\n",
                                                 "set activation_checkpointing: true as well"),
    "layer-swap-without-checkpointing": ("layer_swap: auto\n", "set activation_checkpointing: true as well"),
    "tiled-layers-without-checkpointing": ("tiled_layers: true\n", "set activation_checkpointing: true as well"),
    "with-fsdp": ("fsdp: full_shard\n", "cannot run under fsdp"),
    "sequence-too-long": ("max_seq_length: 100000\n", "is longer than the model's 2048 positions"),
    "resume-missing-path": ("resume_from_checkpoint: /nonexistent\n",
                            "Can't find a valid checkpoint at /nonexistent: the directory does not exist"),
    "resume-nothing-to-resume": ("resume_from_checkpoint: true\n",
                                 "No valid checkpoint found in output directory"),
}


@pytest.mark.parametrize("row", list(CONFIG_ROWS))
def test_config_rows(row, tmp_path, capsys):
    body, needle = CONFIG_ROWS[row]
    expect(Case(tmp_path, body), capsys, 2, needle)


def test_with_deepspeed(tmp_path, capsys, no_model_load):
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2}}')
    expect(Case(tmp_path, f"deepspeed: {tmp_path / 'ds.json'}\n"), capsys, 2, "cannot run under deepspeed",
           "set offload_optimizer: false")


def test_missing_config(capsys, no_model_load):
    assert cli.main(["train", "nope.yaml"]) == 2
    assert "config file 'nope.yaml' does not exist" in capsys.readouterr().err


def test_bad_override(tmp_path, capsys, no_model_load):
    expect(Case(tmp_path), capsys, 2, "override 'max_steps' is not key=value", argv=["max_steps"])


def test_no_model(tmp_path, capsys, no_model_load):
    case = Case(tmp_path)
    case.config.write_text(case.config.read_text().replace("model_config: tiny-llama\n", ""))
    expect(case, capsys, 2, "give exactly one of `model_name_or_path`")


# ---------------------------------------------------------------------------------------------------- data
@pytest.mark.parametrize("row, content, needle", [
    ("empty-dataset", "", "no records (the file is empty)"),
    ("malformed-jsonl", '{"text": "a b c"}\n{"text": oops}\n', "data.jsonl:2: not valid JSON"),
    ("record-without-text", '{"title": "x"}\n', "records have columns ['title']; expected 'text'"),
])
def test_data_rows(row, content, needle, tmp_path, capsys, no_model_load):
    data = tmp_path / "data.jsonl"
    data.write_text(content)
    expect(Case(tmp_path, data=str(data)), capsys, 2, needle)


def tokenizer_without(tmp_path: Path, key: str) -> Path:
    """A copy of the built-in tokenizer with `key` removed from its config."""
    import json

    from offload_trainer.data.sources import builtin_asset

    tok_dir = tmp_path / "tok"
    shutil.copytree(builtin_asset("tokenizer"), tok_dir)
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    cfg.pop(key, None)
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tok_dir


def test_no_chat_template(tmp_path, capsys, no_model_load):
    data = tmp_path / "data.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    tok_dir = tokenizer_without(tmp_path, "chat_template")
    expect(Case(tmp_path, f"tokenizer_name_or_path: {tok_dir}\n", data=str(data)), capsys, 2,
           "need a tokenizer with a chat template")


def test_no_pad_token(tmp_path, capsys):
    tok_dir = tokenizer_without(tmp_path, "pad_token")
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tok_dir).pad_token is None
    case = Case(tmp_path, f"tokenizer_name_or_path: {tok_dir}\n")
    assert case.run(capsys)[0] == 0  # trains: EOS pads the last block
    assert (case.out / "checkpoint-2").is_dir()


# ---------------------------------------------------------------------------------------------------- machine
def test_gpu_limit_without_cuda(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    expect(Case(tmp_path, "gpu_memory_limit_gb: 24\n"), capsys, 2, "caps GPU memory, but PyTorch sees no CUDA GPU")


def test_several_gpus_one_process(tmp_path, capsys, monkeypatch, no_model_load):
    from transformers import TrainingArguments

    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 2))  # what a 2-GPU machine reports
    expect(Case(tmp_path), capsys, 2, "2 GPUs are visible to this one process", "torchrun --nproc_per_node 2",
           "CUDA_VISIBLE_DEVICES=0")


def test_gpu_too_small(tmp_path, capsys, no_model_load):
    expect(Case(tmp_path, "model_config: llama3-8b\nmodel_overrides: {}\ngpu_memory_limit_gb: 4\n"
                          "max_seq_length: 2048\n"), capsys, 2,
           "no plan fits. GPU: needs", "use LoRA")


def test_host_ram_too_small(tmp_path, capsys, monkeypatch, no_model_load):
    """Short of host memory the kernel's OOM killer would end the run (SIGKILL, no word): refused before the model
    loads, GPU cap or not, naming the machine it needs and the fix."""
    from offload_trainer import sysinfo

    monkeypatch.setattr(sysinfo, "host_available_gib", lambda: 16.0)
    body = ("model_config: llama3-8b\nmodel_overrides: {}\nmax_seq_length: 2048\ntorch_dtype: bfloat16\n"
            "per_device_train_batch_size: 4\nmax_grad_norm: 0\n")
    expect(Case(tmp_path, body + "gpu_memory_limit_gb: 24\n"), capsys, 2,
           "Host RAM: the plans that fit the GPU need 18.8 GiB", "but the host budget is 16.0 GiB (available on this "
           "machine): the kernel would kill the run. Use a 32 GB machine (~27.2 GiB available; this run needs 18.8; "
           "or 2.8 GiB more free on this one)", "or LoRA.")
    # the key: the lesser of it and what is available
    (tmp_path / "key").mkdir()
    monkeypatch.setattr(sysinfo, "host_available_gib", lambda: 120.0)
    expect(Case(tmp_path / "key", body + "gpu_memory_limit_gb: 24\nhost_memory_limit_gb: 12\n"), capsys, 2,
           "but the host budget is 12.0 GiB (host_memory_limit_gb)")
    # with no GPU cap, on the card's own memory: a GPU that does not fit only warns, a host that does not is refused
    from types import SimpleNamespace

    from offload_trainer.cli.recipe import run_plan
    from offload_trainer.errors import ConfigError
    from offload_trainer.models import architecture_config
    from offload_trainer.planner import run_budget
    from offload_trainer.settings import OffloadSettings

    settings = OffloadSettings(offload_optimizer=True, batch=4)
    data_args, model_args = SimpleNamespace(max_seq_length=2048), SimpleNamespace(torch_dtype="bfloat16")
    cfg = architecture_config("llama3-8b")
    with pytest.raises(ConfigError, match="host budget is 16.0 GiB"):
        run_plan(model_args, data_args, settings, run_budget(settings, gpu_gb=24.0, host_gb=16.0), cfg, strict=False)
    assert run_plan(model_args, data_args, settings, run_budget(settings, gpu_gb=8.0, host_gb=100.0), cfg,
                    strict=False) is None  # (the GPU short: warned, trained with the switches as given)


def test_speculative_clipping_short_of_host_ram(tmp_path, capsys, monkeypatch, no_model_load):
    from offload_trainer import sysinfo

    monkeypatch.setattr(sysinfo, "host_available_gib", lambda: 40.0)
    body = ("model_config: llama3-8b\nmodel_overrides: {}\ngpu_memory_limit_gb: 24\nmax_seq_length: 2048\n"
            "torch_dtype: bfloat16\nper_device_train_batch_size: 4\nmax_grad_norm: 1.0\n")
    expect(Case(tmp_path, body + "speculative_clipping: true\n"), capsys, 2, "speculative_clipping: true cannot run",
           "needs 48.9 GiB of host memory", "Set speculative_clipping: false")
    # left unset, the plan clips exactly and says why
    (tmp_path / "unset").mkdir()
    assert cli.main(["plan", str(Case(tmp_path / "unset", body).config)]) == 0
    out = capsys.readouterr().out
    assert "after backward, exact clipping" in out and "speculative clipping needs 48.9 GiB" in out


def test_speculative_clipping_with_data_parallel(tmp_path, monkeypatch):
    from helpers import tiny_setup
    from offload_trainer import OffloadTrainer, OffloadTrainingArguments
    from offload_trainer.errors import ConfigError

    import dataclasses

    from offload_trainer.settings import OffloadSettings

    model, tok, data = tiny_setup()
    args = OffloadTrainingArguments(output_dir=str(tmp_path), offload_optimizer=True, max_grad_norm=1.0,
                                    speculative_clipping=True, offload_device_states="0.5", report_to="none")
    two_ranks = dataclasses.replace(OffloadSettings.from_args(args), world_size=2)  # (as under torchrun)
    with pytest.raises(ConfigError, match="speculative_clipping with several ranks streams every 8-bit state"):
        OffloadTrainer(model=model, args=args, train_dataset=data, processing_class=tok, offload_settings=two_ranks)


def test_disk_too_small(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    expect(Case(tmp_path), capsys, 4, "not enough disk in", "GiB are free")


def test_out_of_disk_during_save(tmp_path, capsys, monkeypatch):
    import transformers.trainer as hf_trainer

    real_save = torch.save
    calls = {"n": 0}

    def full_disk(obj, f, *a, **k):
        if str(f).endswith("optimizer.pt"):
            calls["n"] += 1
            if calls["n"] == 2:  # the second checkpoint: the disk fills halfway through
                Path(f).write_bytes(b"PK\x03\x04 half an archive")
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(hf_trainer.torch, "save", full_disk)
    case = Case(tmp_path)
    rc, err = case.run(capsys)
    assert rc == 4
    assert "out of disk space while saving checkpoint-2" in err and "checkpoint-1 is intact" in err
    assert sorted(os.listdir(case.out)) == [".offload-trainer-files.json", "checkpoint-1"]  # nothing partial left,
    # nothing published (the record of what the run wrote lists checkpoint-1)
    from offload_trainer.trainer.checkpoint import check_checkpoint

    check_checkpoint(str(case.out / "checkpoint-1"))


# ---------------------------------------------------------------------------------------------------- checkpoints
def test_corrupted_checkpoint(trained, tmp_path, capsys):
    case = copy_run(trained, tmp_path)
    opt = case.out / "checkpoint-2" / "optimizer.pt"
    opt.write_bytes(opt.read_bytes()[: opt.stat().st_size // 2])
    expect(case, capsys, 2, "is damaged: optimizer.pt is not a complete archive",
           argv=[f"resume_from_checkpoint={case.out / 'checkpoint-2'}", "max_steps=4"])


def test_partial_checkpoint(trained, tmp_path, capsys):
    case = copy_run(trained, tmp_path)
    (case.out / "checkpoint-2" / "model.safetensors").unlink()
    expect(case, capsys, 2, "is incomplete, no model weights",
           argv=[f"resume_from_checkpoint={case.out / 'checkpoint-2'}", "max_steps=4"])


def test_checkpoint_of_another_model(trained, tmp_path, capsys):
    case = copy_run(trained, tmp_path)
    expect(case, capsys, 2, "is from a different model:", "has shape (512, 128) there but (512, 64) here",
           argv=[f"resume_from_checkpoint={case.out / 'checkpoint-2'}", "max_steps=4",
                 "model_overrides={num_hidden_layers: 2, hidden_size: 64}"])


@pytest.mark.parametrize("layers, needle", [(3, "are not in the checkpoint (e.g. 'model.layers.2."),
                                            (1, "are not here (e.g. 'model.layers.1.")])
def test_resume_with_another_layer_count(layers, needle, trained, tmp_path, capsys):
    case = copy_run(trained, tmp_path)
    expect(case, capsys, 2, "is from a different model:", needle, "another number of layers?",
           argv=[f"resume_from_checkpoint={case.out / 'checkpoint-2'}", "max_steps=4",
                 f"model_overrides={{num_hidden_layers: {layers}}}"])


def test_damaged_newest_checkpoint(trained, tmp_path, capsys):
    case = copy_run(trained, tmp_path)
    (case.out / "checkpoint-2" / "trainer_state.json").write_text("{ cut")
    rc, err = case.run(capsys, "resume_from_checkpoint=true", "max_steps=3")
    assert rc == 0
    assert "skipping checkpoint-2" in err and f"resuming from {case.out / 'checkpoint-1'}" in err
    assert (case.out / "checkpoint-3").is_dir()


# ---------------------------------------------------------------------------------------------------- training
def test_same_size_damage_in_a_checkpoint(trained, tmp_path, capsys):
    """One byte changed in the newest checkpoint's optimizer.pt (its size unchanged), or bytes cut from its middle:
    checksums.json (written at save time) finds it; resume_from_checkpoint: true falls back to the checkpoint
    before, with one line, and continues as a run never stopped would from there."""
    for how in ("flip", "cut"):
        (tmp_path / how).mkdir()
        case = copy_run(trained, tmp_path / how)
        opt = case.out / "checkpoint-2" / "optimizer.pt"
        data = bytearray(opt.read_bytes())
        mid = len(data) // 2
        if how == "flip":
            data[mid] ^= 0xFF
        else:
            del data[mid:mid + 64]
        opt.write_bytes(bytes(data))
        rc, err = case.run(capsys, "resume_from_checkpoint=true", "max_steps=3")
        assert rc == 0, err
        assert "skipping checkpoint-2: checkpoint" in err and "is damaged: optimizer.pt" in err
        assert "resuming from" in err and err.count("skipping checkpoint-2") == 1
        assert f"{case.out / 'checkpoint-1'}" in err.split("resuming from", 1)[1].splitlines()[0]


def test_resume_changes_a_hyperparameter(trained, tmp_path, capsys):
    """A resume whose arguments differ from the checkpoint's: refused where the saved optimizer / scheduler state
    would silently win (learning_rate), naming the value to set; said where the change applies (max_steps raised,
    gradient accumulation, the rows' length); refused below the checkpoint's step."""
    case = copy_run(trained, tmp_path)
    expect(case, capsys, 2, "with learning_rate 0.001 -> 0.002, which would not take effect",
           "Set learning_rate: 0.001 to continue the run",
           argv=["resume_from_checkpoint=true", "learning_rate=2e-3", "max_steps=3"])
    (case.out / "trainer_state.json").unlink()  # (a run stopped after checkpoint-2; a finished one has nothing to do)
    expect(case, capsys, 2, "max_steps=1 is below the step of", "Set max_steps to more than 2",
           argv=[f"resume_from_checkpoint={case.out / 'checkpoint-2'}", "max_steps=1"])
    rc, err = case.run(capsys, "resume_from_checkpoint=true", "max_steps=3", "gradient_accumulation_steps=2",
                       "max_seq_length=48")
    assert rc == 0, err
    assert "resume changes max_steps 2 -> 3: the learning-rate schedule is recomputed" in err
    assert "resume changes gradient_accumulation_steps 1 -> 2: each optimizer step takes another number" in err
    assert "resume changes max_seq_length 64 -> 48: rows hold another number of tokens" in err


def test_resume_with_other_data(trained, tmp_path, capsys):
    """A resume whose data file was replaced (more rows): said, since the rows already seen are skipped by count."""
    case = copy_run(trained, tmp_path)
    data = tmp_path / "more.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i} of other data, a little longer"}) + "\n" for i in range(134)))
    rc, err = case.run(capsys, "resume_from_checkpoint=true", "max_steps=3", f"dataset_path={data}")
    assert rc == 0, err
    assert re.search(r"resume changes training_rows \d+ -> \d+: the training data is not the checkpoint's", err), err


def test_yaml_1_1_numbers(tmp_path, capsys):
    """YAML 1.2 numbers: `010` is ten (YAML 1.1 read octal 8), `1:30` is text (1.1: sexagesimal 90) and refused
    where a number is wanted."""
    from offload_trainer.cli.config import load_config

    cfg = tmp_path / "c.yaml"
    cfg.write_text("model_config: tiny-llama\nmax_steps: 010\nlogging_steps: 0x2\n")
    got = load_config(str(cfg))
    assert (got["max_steps"], got["logging_steps"]) == (10, 2)
    expect(Case(tmp_path, "max_steps: 1:30\n"), capsys, 2, "key 'max_steps' = '1:30' (str) has the wrong type")


def test_env_var_in_a_path(tmp_path, capsys, monkeypatch):
    """`$VAR` in a path is expanded (as `~` is); one that is not set is refused, naming the key."""
    monkeypatch.setenv("OT_TEST_OUT", str(tmp_path / "expanded"))
    monkeypatch.delenv("OT_TEST_UNSET", raising=False)
    case = Case(tmp_path, "output_dir: $OT_TEST_UNSET/run\n")
    expect(case, capsys, 2, "output_dir = '$OT_TEST_UNSET/run': the environment variable in it is not set")
    assert not list(tmp_path.glob("$*"))
    rc, err = Case(tmp_path, "output_dir: ${OT_TEST_OUT}/run\nmax_steps: 1\n").run(capsys)
    assert rc == 0, err
    assert (tmp_path / "expanded" / "run" / "trainer_state.json").is_file() and not list(tmp_path.glob("$*"))


def test_chat_template_missing_file(tmp_path, capsys):
    case = Case(tmp_path, f"dataset_path: builtin-sft\nchat_template: {tmp_path / 'no-such-template.jinja'}\n")
    expect(case, capsys, 2, "chat_template: '", "is neither a Jinja template", "nor a file that exists")


def test_directory_of_mixed_data_files(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("some text\n" * 50)
    (data / "b.jsonl").write_text('{"text": "other text"}\n' * 50)
    expect(Case(tmp_path, data=str(data)), capsys, 2, "holds data files of several kinds (json, text)")


def test_directory_of_data_files_with_other_columns(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text('{"text": "some text"}\n' * 50)
    (data / "b.jsonl").write_text('{"prompt": "q", "completion": "a", "n": 3}\n' * 50)
    expect(Case(tmp_path, data=str(data)), capsys, 2, "cannot be loaded: Couldn't cast (the data files of a directory "
           "are read as one table: they must have the same columns; or name one file)")


@pytest.mark.parametrize("override", ["vocab_size: -5", "num_hidden_layers: 0"])
def test_model_override_sizes(override, tmp_path, capsys):
    key = override.split(":")[0]
    expect(Case(tmp_path, f"model_overrides: {{{override}}}\n"), capsys, 2, f"model_overrides: {key}=",
           "must be a positive whole number")
    capsys.readouterr()
    assert cli.main(["plan", str(tmp_path / "c.yaml")]) == 2
    assert "must be a positive whole number" in capsys.readouterr().err


def test_yaml_merge_key(tmp_path, capsys):
    """`<<: *anchor` (YAML's merge key) merges; the mapping's own keys win; a top-level anchor key is an unknown key."""
    from offload_trainer.cli.config import load_config

    cfg = tmp_path / "c.yaml"
    cfg.write_text("model_config: tiny-llama\nmodel_overrides:\n  <<: {num_hidden_layers: 2, hidden_size: 64}\n"
                   "  hidden_size: 128\n")
    assert load_config(str(cfg))["model_overrides"] == {"num_hidden_layers": 2, "hidden_size": 128}
    case = Case(tmp_path, "defaults: &d {max_steps: 1}\nrun:\n  <<: *d\n")
    expect(case, capsys, 2, "unknown key 'defaults'")


def test_eval_without_eval_data(tmp_path, capsys, no_model_load):
    """eval_strategy: steps with no held-out records and no test split: refused before the model loads."""
    expect(Case(tmp_path, "eval_strategy: steps\neval_steps: 1\neval_fraction: 0\n"), capsys, 2,
           "eval_strategy: steps evaluates, but there is no evaluation data: set eval_fraction")


def test_negative_token_id(tmp_path, capsys):
    data = tmp_path / "ids.jsonl"
    data.write_text('{"input_ids": [1, 2, 3, 4]}\n{"input_ids": [5, -7, 9]}\n')
    expect(Case(tmp_path, data=str(data)), capsys, 2, "row 2: input_ids holds a negative token id (-7)")


def test_bad_row_in_a_held_out_split(tmp_path, capsys):
    """eval_fraction shuffles the records before they are split: the error still names the row's line in the file."""
    data = tmp_path / "ids.jsonl"
    rows = [[1, 2, 3]] * 10
    rows[6] = [5, -3, 9]
    data.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    err = expect(Case(tmp_path, "eval_fraction: 0.2\n", data=str(data)), capsys, 2, "input_ids holds a negative token id")
    assert re.search(r"ids.jsonl \((train|eval)\) row 7: input_ids holds a negative token id \(-3\)", err), err


def test_data_rewritten_with_its_old_mtime(tmp_path):
    """A data file rewritten with its old modification time (same size, other text): the rows are the new ones, not
    the cache of the old file (datasets knows a file by its path and mtime)."""
    from transformers import AutoTokenizer

    from offload_trainer.cli.run_args import DataArguments
    from offload_trainer.data import build_datasets
    from offload_trainer.data.sources import builtin_asset

    tok = AutoTokenizer.from_pretrained(builtin_asset("tokenizer"))
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"text": "apple " * 20}) + "\n" for _ in range(30)))
    st = f.stat()
    before, _ = build_datasets(DataArguments(dataset_path=str(f), max_seq_length=32), tok, vocab_size=512)
    f.write_text("".join(json.dumps({"text": "zebra " * 20}) + "\n" for _ in range(30)))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns
    after, _ = build_datasets(DataArguments(dataset_path=str(f), max_seq_length=32), tok, vocab_size=512)
    want = tok("zebra " * 20, add_special_tokens=False)["input_ids"][:5]
    assert after[0]["input_ids"][:5].tolist() == want != before[0]["input_ids"][:5].tolist()


def test_a_failing_map_leaves_other_runs_files(tmp_path, monkeypatch):
    """A map that fails removes the temporary files it was writing, not those of another run (or test worker)
    tokenizing other data into the same cache at the same time."""
    import datasets

    from offload_trainer.data import _map

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path))
    ds = datasets.load_dataset("json", data_files=str(_rows(tmp_path)), split="train")
    other = _map(ds, lambda b: {"n": [len(t) for t in b["text"]]}, fingerprint="other", desc="other", num_proc=None)
    where = os.path.dirname(other.cache_files[0]["filename"])

    def fails(batch):
        open(os.path.join(where, "tmp-other-run-writing"), "w").close()  # the other run, at work meanwhile
        raise ValueError("a bad row")

    with pytest.raises(ValueError, match="a bad row"):
        _map(ds, fails, fingerprint="this", desc="this", num_proc=None)
    assert os.path.exists(os.path.join(where, "tmp-other-run-writing"))


def _rows(tmp_path):
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(8)))
    return f


def test_signal_outside_the_training_loop(tmp_path, capsys, monkeypatch):
    """SIGTERM while the run loads (before the Trainer's own handler), and Ctrl-C during the final save: a sentence
    with the exit code of the signal, naming the last complete checkpoint where there is one."""
    import signal
    import subprocess
    import sys
    import time

    from offload_trainer.cli import recipe

    case = Case(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "offload_trainer.cli", "train", str(case.config)],
                            stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)  # (in the imports and loading: the training loop is seconds away)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "interrupted: SIGTERM outside the training loop: no checkpoint was saved" in err and "Traceback" not in err

    def cut(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(recipe, "write_outputs", cut)  # (Ctrl-C while the final model is written)
    (tmp_path / "save").mkdir()
    expect(Case(tmp_path / "save"), capsys, 130, "interrupted: SIGINT outside the training loop: the last checkpoint is",
           "checkpoint-2 (continue with resume_from_checkpoint: true)", untouched=False)


@pytest.mark.slow
@pytest.mark.parametrize("to", ["main", "group"])
def test_ctrl_c_while_workers_tokenize(tmp_path, to):
    """Ctrl-C while `dataset_num_proc: 2` workers tokenize, sent to the command (`kill -INT`) or to its whole process
    group (a terminal): one sentence and 130, no worker tracebacks, no temporary files left in the cache. (The workers
    had inherited the command's SIGTERM handler, so the pool's SIGTERM raised in them instead of ending them, and the
    command waited for them forever.)"""
    import signal
    import subprocess
    import sys
    import time

    rows = [json.dumps({"text": f"row {i} " + "the quick brown fox jumps over the lazy dog " * 6}) for i in range(200000)]
    (tmp_path / "big.jsonl").write_text("\n".join(rows) + "\n")
    case = Case(tmp_path, "dataset_num_proc: 2\n", data=str(tmp_path / "big.jsonl"))
    cache, log = tmp_path / "cache", tmp_path / "err.txt"
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache)}
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "offload_trainer.cli", "train", str(case.config)], stderr=err,
                                env=env, start_new_session=True)
    deadline = time.time() + 120
    while "tokenizing (num_proc=2)" not in log.read_text() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(1.0)  # (the workers at work)
    assert proc.poll() is None, "the run ended before it could be interrupted: give it more rows"
    if to == "group":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the command hung after Ctrl-C")
    text = log.read_text()
    assert proc.returncode == 130, text[-2000:]
    assert "interrupted: SIGINT outside the training loop: no checkpoint was saved" in text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert not [f for f in (cache / "offload_trainer").rglob("tmp*")]


def test_finished_run_resumed(trained, tmp_path, capsys):
    """A finished run re-run with resume_from_checkpoint: true (also with save_total_limit: 1) trains nothing and
    changes nothing: the Trainer would train one step past max_steps and write that model over the finished one."""
    for extra in ([], ["save_total_limit=1"]):
        (tmp_path / f"run{len(extra)}").mkdir()
        case = copy_run(trained, tmp_path / f"run{len(extra)}")
        expect(case, capsys, 0, "holds a finished run (step 2, max_steps reached) and its model: nothing to train",
               argv=["resume_from_checkpoint=true", *extra])
    (tmp_path / "more").mkdir()
    case = copy_run(trained, tmp_path / "more")  # asking for more steps resumes and trains them
    rc, err = case.run(capsys, "resume_from_checkpoint=true", "max_steps=3")
    assert rc == 0 and "resuming from" in err and (case.out / "checkpoint-3").is_dir()


def test_resume_from_another_directory(trained, tmp_path, capsys):
    """A checkpoint of another run's directory starts a new run here: an earlier run in output_dir is refused as
    without resume (it would be replaced without a word)."""
    other = tmp_path / "other"
    shutil.copytree(trained, other)
    case = copy_run(trained, tmp_path)
    expect(case, capsys, 5, "holds checkpoints up to checkpoint-2 of an earlier run",
           argv=[f"resume_from_checkpoint={other / 'checkpoint-2'}", "max_steps=3"])


def test_output_dir_is_the_model(tmp_path, capsys):
    """output_dir naming the directory of the pretrained model it trains (pytorch_model.bin there) is refused."""
    from transformers import AutoModelForCausalLM

    from cli_cases import tree_hash
    from offload_trainer.models import architecture_config

    model_dir = tmp_path / "model"
    AutoModelForCausalLM.from_config(architecture_config("tiny-llama", {"num_hidden_layers": 2})).save_pretrained(
        model_dir, safe_serialization=False)
    from transformers import AutoTokenizer

    from offload_trainer.data.sources import builtin_asset

    AutoTokenizer.from_pretrained(builtin_asset("tokenizer")).save_pretrained(model_dir)
    before = tree_hash(model_dir)
    case = Case(tmp_path, f"model_config: null\nmodel_overrides: null\nmodel_name_or_path: {model_dir}\n"
                          f"output_dir: {model_dir}\n")
    for extra in ([], ["overwrite_output_dir=true"]):
        expect(case, capsys, 5, "is the directory of the model it trains (model_name_or_path)", argv=extra)
        assert tree_hash(model_dir) == before


def test_links_planted_in_output_dir(tmp_path, capsys):
    """A shared output_dir with a link planted at the name of every file the run writes there (lock, write probe,
    model, config, tokenizer, training_args.bin, trainer_state.json, run_figures.json, plots): the run replaces the
    links, and not one byte is written through them."""
    case = Case(tmp_path, "overwrite_output_dir: true\n")
    victims = tmp_path / "victims"
    victims.mkdir()
    case.out.mkdir()
    names = [".offload-trainer.lock", f".write-probe-{os.getpid()}", "model.safetensors", "config.json",
             "generation_config.json", "tokenizer.json", "tokenizer_config.json", "training_args.bin",
             "trainer_state.json", "run_figures.json", "loss.png", "throughput.png", "memory.png"]
    for name in names:
        (victims / name).write_text("not yours")
        (case.out / name).symlink_to(victims / name)
    rc, err = case.run(capsys)
    assert rc == 0, err
    assert {n: (victims / n).read_text() for n in names} == {n: "not yours" for n in names}
    written = [n for n in names if (case.out / n).exists()]
    assert not any((case.out / n).is_symlink() for n in written) and "model.safetensors" in written
    assert json.loads((case.out / "trainer_state.json").read_text())["global_step"] == 2


def test_staging_links_planted_in_output_dir(tmp_path, capsys):
    """Links planted at the staging names (`.partial-save`, `.partial-checkpoint-N`) pointing at someone's
    directories: the run removes the links (never what they point to), saves its checkpoints and model, and not one
    byte is written through them (was a raw FileExistsError, with no model and no first checkpoint)."""
    from cli_cases import tree_hash

    case = Case(tmp_path)
    case.out.mkdir()
    victims = tmp_path / "victims"
    for name in (".partial-save", ".partial-checkpoint-1", ".partial-checkpoint-2"):
        (victims / name).mkdir(parents=True)
        (victims / name / "keep.txt").write_text("not yours")
        (case.out / name).symlink_to(victims / name, target_is_directory=True)
    before = tree_hash(victims)
    rc, err = case.run(capsys)
    assert rc == 0, err
    assert tree_hash(victims) == before and len(before) == 3
    assert (case.out / "model.safetensors").is_file() and (case.out / "checkpoint-2").is_dir()
    assert not any(p.name.startswith(".partial-") for p in case.out.iterdir())


def test_secrets_stay_out_of_output_dir(tmp_path, capsys):
    """hub_token is not written into output_dir or its checkpoints (training_args.bin pickles the arguments)."""
    case = Case(tmp_path)
    rc, err = case.run(capsys, "hub_token=hf_NOT_A_REAL_SECRET_42")
    assert rc == 0, err
    files = [f for f in case.out.rglob("*") if f.is_file()]
    assert any(f.name == "training_args.bin" for f in files)
    assert [str(f) for f in files if b"hf_NOT_A_REAL_SECRET_42" in f.read_bytes()] == []


def test_nonfinite_steps(tmp_path, capsys):
    """A NaN loss at every step: each skipped, then the run stops (exit 3) with the weights untouched."""
    from offload_trainer import trainer as trainer_mod

    case = Case(tmp_path, "max_steps: 10\nmax_nonfinite_steps: 3\nsave_steps: 100\n")
    real = trainer_mod.OffloadMixin._offload_loss

    def nan_loss(self, *a, **k):
        return real(self, *a, **k) * float("nan")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer_mod.OffloadMixin, "_offload_loss", nan_loss)
        rc, err = case.run(capsys)
    assert rc == 3
    assert "stopped: 3 optimizer steps in a row had a non-finite loss" in err


def test_adam_epsilon_zero(tmp_path, capsys, no_model_load):
    """adam_epsilon: 0 passed the checks: step 1 wrote NaN into the embedding, later losses logged 0.0000 and the run
    exited 0 with a NaN model saved. Refused before loading, with the Python class too."""
    from offload_trainer import OffloadTrainingArguments

    expect(Case(tmp_path, "adam_epsilon: 0\n"), capsys, 2, "adam_epsilon = 0: must be positive and at most 1")
    with pytest.raises(ValueError, match="adam_epsilon = 0.0: must be positive"):
        OffloadTrainingArguments(output_dir=str(tmp_path), adam_epsilon=0.0)


def test_nonfinite_weights_are_not_saved(tmp_path, capsys, monkeypatch):
    """A finite loss but an update that made weights NaN (adam_epsilon 0, its check taken away here): the first save
    refuses (exit 3, the tensor named), no checkpoint or model of NaN is written."""
    import offload_trainer.limits as limits

    monkeypatch.delitem(limits._RULES, "adam_epsilon")
    case = Case(tmp_path, "adam_epsilon: 0\n")
    rc, err = case.run(capsys)
    assert rc == 3, err
    assert "after step 1 the weights hold non-finite values (NaN or inf) in model.embed_tokens.weight" in err
    assert "checkpoint-1 is not written" in err
    assert not list(case.out.glob("checkpoint-*")) and not (case.out / "model.safetensors").exists()


def test_optim_args_are_refused_before_the_model_loads(tmp_path, capsys, no_model_load):
    """`optim_args` is read only by the Trainer's own optimizer, which the streamed AdamW replaces: the command
    (which hands the Trainer no optimizer) refuses it before any weight loads (conflicts.check_trainer)."""
    expect(Case(tmp_path, "offload_optimizer: true\noptim_args: foo=1\n"), capsys, 2, "optim_args='foo=1' is read by "
           "the Trainer's own optimizer")


def test_two_overrides_in_one_argument(tmp_path, capsys, no_model_load):
    """`'output_dir=runs/x max_steps=1'` as one shell argument made a directory "x max_steps=1" and ignored
    max_steps; a value with spaces and an `=` that names no key (a text) stays a value."""
    from offload_trainer.cli.config import parse_overrides

    expect(Case(tmp_path), capsys, 2, "override 'output_dir=runs/x max_steps=1' holds a second key=value "
           "(max_steps=...): give each as its own argument", argv=["output_dir=runs/x max_steps=1"])
    assert not (tmp_path / "runs").exists()
    assert parse_overrides(["system_prompt=answer as x=1 would"]) == {"system_prompt": "answer as x=1 would"}


def test_yaml_alias_bomb(tmp_path, capsys, no_model_load):
    """Aliases nested inside aliases (a "billion laughs") under model_overrides: a few hundred bytes that expand
    exponentially; the run hung checking the values. Refused at once."""
    import time

    lines = ["model_overrides:", "  a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    t0 = time.perf_counter()
    expect(Case(tmp_path, "\n".join(lines) + "\n"), capsys, 2, "holds more than 100,000 values once its YAML "
           "aliases (*name) are expanded")
    assert time.perf_counter() - t0 < 30


def test_fifo_in_a_checkpoint_or_the_data(trained, tmp_path, capsys):
    """A FIFO where a checkpoint file should be (or as the data file): the resume hung on it, and the stop signal's
    message hung again. Now the checkpoint is skipped or refused, the data refused, each with a sentence."""
    case = copy_run(trained, tmp_path)
    fifo = case.out / "checkpoint-2" / "scheduler.pt"
    fifo.unlink()
    os.mkfifo(fifo)
    expect(case, capsys, 2, "holds scheduler.pt, which is not a regular file (a FIFO, a device or a socket)",
           argv=[f"resume_from_checkpoint={case.out / 'checkpoint-2'}", "max_steps=4"])
    data = tmp_path / "rows.jsonl"
    os.mkfifo(data)
    (tmp_path / "d").mkdir()
    expect(Case(tmp_path / "d", f"dataset_path: {data}\n"), capsys, 2,
           "is not a regular file (a FIFO, a device or a socket)")


def test_utf16_or_semicolon_data(tmp_path, capsys, no_model_load):
    """Data saved as UTF-16 (Windows' "Unicode") was read as UTF-8 and blamed on line 2 as "not valid JSON"; a CSV
    delimited by ';' read as one column and got the hint of a JSON field. Each names what it is and the fix."""
    u16 = tmp_path / "rows.jsonl"
    u16.write_bytes('{"text": "hello world"}\n'.encode("utf-16"))
    expect(Case(tmp_path, f"dataset_path: {u16}\n"), capsys, 2, "is UTF-16 text, not UTF-8: save the data as UTF-8")
    semi = tmp_path / "rows.csv"
    semi.write_text("text;label\nhello world;1\nsecond row;0\n")
    expect(Case(tmp_path, f"dataset_path: {semi}\n"), capsys, 2, "looks delimited by ';', not commas: read it with "
           "dataset_kwargs: {sep: \";\"}")


def test_resume_across_full_and_lora(trained, tmp_path, capsys):
    """A full finetune's checkpoints resumed as a LoRA run: named as such (it said "another number of layers?", then
    "holds no complete checkpoint-N directory")."""
    case = copy_run(trained, tmp_path)
    expect(case, capsys, 2, "none of checkpoint-1, checkpoint-2 can be resumed here",
           "was saved by a full finetune run (its weights are the whole model), and this run trains LoRA adapters",
           argv=["resume_from_checkpoint=true", "max_steps=4", "lora_r=4", "lora_target_modules=all-linear"])


def test_planted_pickle_in_a_checkpoint(trained, tmp_path, capsys):
    """A pickle planted in a checkpoint (checksums rewritten to match): a weights-only load refuses it, so no code
    ran, but the resume ended in an UnpicklingError traceback. Now a sentence, before anything loads."""
    from offload_trainer.trainer.checkpoint import CHECKSUMS, write_checksums

    case = copy_run(trained, tmp_path)
    ckpt = case.out / "checkpoint-2"
    torch.save({"x": _Planted()}, ckpt / "rng_state.pth")
    (ckpt / CHECKSUMS).unlink()
    write_checksums(str(ckpt))
    err = expect(case, capsys, 2, "rng_state.pth holds",
                 "not what a run saves there, and not loaded (nothing in it ran)",
                 argv=[f"resume_from_checkpoint={ckpt}", "max_steps=4"])
    assert "a planted pickle ran" not in err


class _Planted:
    def __reduce__(self):
        return (print, ("a planted pickle ran",))


@pytest.mark.parametrize("ext", [".jsonl", ".json"])
def test_json_nested_too_deep(ext, tmp_path, capsys, no_model_load):
    """A record holding a value nested 20,000 deep: the Arrow reader segfaulted (exit 139, no output). Refused with a
    sentence (the limit: 1000 levels); brackets and escaped quotes inside strings do not count."""
    deep = "[" * 20000 + "]" * 20000
    fine = json.dumps({"text": '"[[[' * 2000 + "\\"})  # (4000 brackets, all inside one string)
    data = tmp_path / f"rows{ext}"
    data.write_text(f'{fine}\n{{"text": "a", "x": {deep}}}\n' if ext == ".jsonl" else
                    f'[{fine}, {{"text": "a", "x": {deep}}}]')
    expect(Case(tmp_path, f"dataset_path: {data}\n"), capsys, 2, "holds a JSON value nested more than 1000 levels deep")
    from offload_trainer.data.sources import check_source

    data.write_text(f"{fine}\n" if ext == ".jsonl" else f"[{fine}]")
    check_source(str(data))


@pytest.mark.parametrize("body, limit, needle", [
    ("{{ 'x' * 2000000 }}", {}, "a two-message conversation writes 2,000,0"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", {"TEMPLATE_SECONDS": 1.0},
     "the probe's and the dataset's first conversations runs longer than 1 s"),
    ("{% set big = 'x' * 1000000000 %}{{ big | length }}", {"TEMPLATE_MEMORY": 256 << 20}, "needs more than 0.25 GiB"),
], ids=["output", "time", "memory"])
def test_chat_template_limits(body, limit, needle, tmp_path, capsys, monkeypatch, no_model_load):
    """A chat template is code: `'x' * 10**8` per record, a loop of 10^10 steps or a 10 GB string hung or exhausted
    the run before any word. Rendered once on a two-message conversation in a child process, under limits (20 s,
    1,000,000 characters, 4 GiB; lowered here to be quick)."""
    from offload_trainer.data import formats

    for key, value in limit.items():
        monkeypatch.setattr(formats, key, value)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}" + body)
    expect(Case(tmp_path, f"dataset_path: builtin-sft\nchat_template: {template}\n"), capsys, 2,
           "chat_template: rendering ", needle)


@pytest.mark.parametrize("where, needle", [
    ("{% if messages[0].role == 'system' %}{{ 'x' * 2000000 }}{% endif %}", "the probe's conversation 2 of 3"),
    ("{% if 'Paris' in messages[0].content %}{{ 'x' * 2000000 }}{% endif %}", "the dataset's record 1"),
], ids=["system-prompt-only", "first-record-only"])
def test_chat_template_limits_past_the_first_probe(where, needle, tmp_path, capsys, no_model_load):
    """A template that does its heavy work only for a system prompt, or only for what the data holds, passed the
    two-message probe and then hung the run on the records: it renders the probe's conversations and the dataset's
    first records under the limits."""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}" + where)
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "What is the capital of France? Paris?"},
                                             {"role": "assistant", "content": "Paris."}]}) + "\n")
    expect(Case(tmp_path, f"dataset_path: {data}\nchat_template: {template}\n"), capsys, 2,
           f"chat_template: rendering {needle} writes 2,000,0")


def test_every_row_has_a_test():
    rows = doc_rows()
    assert len(rows) >= 20
    here = "".join((Path(__file__).parent / f).read_text()
                   for f in ("test_bad_inputs.py", "test_faults.py", "test_qlora_outputs.py", "data/test_vision.py",
                             "data/test_data.py", "test_dropin.py", "test_cli.py", "test_output_records.py"))
    from test_faults import DATA_ROWS, MODEL_ROWS, ROWS as FAULT_ROWS, TRAINS

    tested = set(CONFIG_ROWS) | set(FAULT_ROWS) | set(MODEL_ROWS) | set(DATA_ROWS) | set(TRAINS)
    tested |= set(re.findall(r'\("([a-z0-9-]+)", ', here)) | {
        name[len("test_"):].replace("_", "-") for name in re.findall(r"^def (test_\w+)", here, re.M)}
    tested.add("interrupted")  # tests/test_checkpoint_kill.py::test_sigterm_saves_and_resumes
    missing = set(rows) - tested
    assert not missing, f"rows without a test: {sorted(missing)}"


@pytest.mark.parametrize("kwargs, needle", [
    (dict(learning_rate=float("inf")), "learning_rate = inf: every number in a config must be finite"),
    (dict(max_grad_norm=float("nan")), "max_grad_norm = nan: every number in a config must be finite"),
    (dict(weight_decay=-0.1), "weight_decay = -0.1: must be zero or more"),
    (dict(adam_beta2=1.0), "adam_beta2 = 1.0: must be at least 0 and below 1"),
])
def test_python_arguments_out_of_range(kwargs, needle, tmp_path):
    """OffloadTrainingArguments built from Python refuse what the command refuses in a config (a NaN clip norm or an
    infinite learning rate trained NaN weights, logging losses of 0.0); the defaults pass."""
    from offload_trainer import OffloadTrainingArguments

    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        OffloadTrainingArguments(output_dir=str(tmp_path), **kwargs)
    assert OffloadTrainingArguments(output_dir=str(tmp_path)).learning_rate > 0


def test_file_size_limit_at_the_first_checkpoint(tmp_path):
    """`ulimit -f` smaller than a checkpoint: the save fails with EFBIG after a step trained (a raw traceback, not
    recognised as storage). Now exit 4 and a sentence naming the limit; nothing published."""
    import resource
    import subprocess
    import sys

    case = Case(tmp_path, "max_steps: 1\n")
    limit = 1 << 20  # (the tiny model's weights alone are 2 MB)

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    r = subprocess.run([sys.executable, "-m", "offload_trainer.cli", "train", str(case.config)], capture_output=True,
                       text=True, timeout=300, preexec_fn=small_files, env={**os.environ, "HF_DATASETS_CACHE":
                                                                           str(tmp_path / "cache")})
    assert r.returncode == 4, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert "over the file-size limit (ulimit -f) while saving checkpoint-1" in r.stderr
    assert "or start again: no step was saved" in r.stderr
    assert not list(case.out.glob("checkpoint-*"))


def test_output_dir_too_long(tmp_path, capsys, no_model_load):
    """An output_dir within the system's path limit whose checkpoint files are not (4051 characters): a step trained,
    then `OSError: File name too long` at the first checkpoint. Refused before loading."""
    n = 4060 - len(str(tmp_path)) - 1
    parts = []
    while n > 0:
        parts.append("f" * min(250, n))
        n -= len(parts[-1]) + 1
    out = tmp_path.joinpath(*parts)
    expect(Case(tmp_path, f"output_dir: {out}\n"), capsys, 4, "characters long: the files a run writes inside it",
           "Choose a shorter output_dir")
