"""Faults beyond a plain bad value, driven through the real command (`cli.main`, in-process): config files as
editors and users produce them, out-of-range and non-finite numbers, broken model directories, output directories
that are files, read-only, foreign or busy, incomplete checkpoints, and disks that really fill (a small tmpfs).

After each: a sentence without a traceback, the exit code of its kind (2 input, 4 storage, 5 busy), nothing under
output_dir changed, and where a checkpoint is involved the run resumed to the same losses. Each `ROWS` id (and each
test named after an id) is a row of docs/bad-inputs.md."""
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from cli_cases import Case, copy_run, expect, log_to_current_stderr, stderr_of
from offload_trainer import cli

# id -> (config body, exit code, excerpt of the message); run with weights never loaded
ROWS = {
    "yaml-tab-indent": ("model_overrides:\n\t num_hidden_layers: 2\n", 2, "malformed YAML at line"),
    "nan-learning-rate": ("learning_rate: .nan\n", 2, "learning_rate = nan: every number in a config must be finite"),
    "inf-learning-rate": ("learning_rate: .inf\n", 2, "learning_rate = inf: every number in a config must be finite"),
    "nan-weight-decay": ("weight_decay: .nan\n", 2, "weight_decay = nan: every number"),
    "nan-max-grad-norm": ("max_grad_norm: .nan\n", 2, "max_grad_norm = nan: every number"),
    "inf-epochs": ("num_train_epochs: .inf\nmax_steps: -1\n", 2, "num_train_epochs = inf: every number"),
    "zero-epochs": ("num_train_epochs: 0\nmax_steps: -1\n", 2, "num_train_epochs = 0: must be positive"),
    "zero-max-steps": ("max_steps: 0\n", 2, "max_steps = 0: must be -1 (num_train_epochs decides) or a positive"),
    "zero-batch-size": ("per_device_train_batch_size: 0\n", 2, "per_device_train_batch_size = 0: must be a positive"),
    "negative-batch-size": ("per_device_train_batch_size: -2\n", 2, "per_device_train_batch_size = -2: must be"),
    "zero-accumulation": ("gradient_accumulation_steps: 0\n", 2, "gradient_accumulation_steps = 0: must be"),
    "negative-learning-rate": ("learning_rate: -1.0e-3\n", 2, "learning_rate = -0.001: must be zero or more"),
    "beta-above-one": ("adam_beta1: 1.5\n", 2, "adam_beta1 = 1.5: must be at least 0 and below 1"),
    "seed-out-of-range": ("seed: 5000000000\n", 2, "seed = 5000000000: must be from 0 to 4294967295"),
    "zero-sequence-length": ("max_seq_length: 0\n", 2, "max_seq_length = 0: must be at least 8 tokens"),
    "override-typo": ("model_overrides: {num_hidden_layer: 2}\n", 2,
                      "model_overrides: 'num_hidden_layer' is not a field of tiny-llama's LlamaConfig. Did you mean "
                      "'num_hidden_layers'?"),
    "override-the-config-refuses": ("model_overrides: {hidden_size: 63}\n", 2,  # (was a raw validation traceback)
                                    "model_overrides {'hidden_size': 63}: The hidden size (63) is not a multiple of "
                                    "the number of attention heads (4)."),
    "override-heads-not-a-multiple": ("model_overrides: {num_key_value_heads: 3}\n", 2,  # (was a RuntimeError at the
                                      # first forward)
                                      "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    "empty-output-dir": ("output_dir: ''\n", 2, "output_dir is empty"),
    "tracker-not-installed": ("report_to: wandb\n", 2, "report_to: 'wandb' is not installed (pip install wandb)"),
    "unknown-tracker": ("report_to: tensorbored\n", 2, "report_to: 'tensorbored' is not a tracker the Trainer knows"),
    "unknown-attention": ("attn_implementation: flash\n", 2, "attn_implementation='flash' is not one transformers has"),
    "hub-id-offline": ("model_name_or_path: some-org/no-such-model\nmodel_config: null\n", 2,
                       "model_name_or_path 'some-org/no-such-model': cannot load its config"),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_rows(row, tmp_path, capsys, no_model_load):
    body, rc, needle = ROWS[row]
    expect(Case(tmp_path, body), capsys, rc, needle)


def write_config(tmp_path: Path, content: bytes) -> Path:
    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    return path


def run_config(path: Path, capsys, *argv) -> tuple[int, str]:
    log_to_current_stderr()
    rc = cli.main(["train", str(path), *argv])
    return rc, stderr_of(capsys)


def test_yaml_duplicate_key(tmp_path, capsys, no_model_load):
    case = Case(tmp_path)
    case.config.write_text(case.config.read_text() + "learning_rate: 0.1\n")  # (the last would win silently)
    rc, err = run_config(case.config, capsys)
    assert rc == 2 and "duplicate key 'learning_rate' (first at line 9; the last would win silently)" in err, err


@pytest.mark.parametrize("row, text, needle", [
    ("yaml-complex-key", b"model_config: tiny-llama\n? [a, b]\n: 1\n", "a key must be one value (a name), not a list"),
    ("yaml-number-key", b"model_config: tiny-llama\n5: 1\n", "every top-level key is a name, and 5 (int) is not"),
    ("yaml-null-key", b"model_config: tiny-llama\n~: 1\n", "every top-level key is a name, and None (NoneType)"),
    ("yaml-nested-too-deeply", b"model_config: tiny-llama\nmodel_overrides: " + b"[" * 5000 + b"]" * 5000 + b"\n",
     "nested too deeply to read"),
])
def test_yaml_keys_and_depth(row, text, needle, tmp_path, capsys, no_model_load):
    """Keys that are not names (a list, a number, null) and nesting past the parser's depth: one sentence, exit 2
    (were a raw TypeError from the "Did you mean" suggestion, and a RecursionError)."""
    rc, err = run_config(write_config(tmp_path, text), capsys)
    assert rc == 2 and needle in err, err


def test_yaml_top_level_list(tmp_path, capsys, no_model_load):
    rc, err = run_config(write_config(tmp_path, b"- model_config: tiny-llama\n"), capsys)
    assert rc == 2 and "the top level must be a mapping of key: value, not list" in err


def test_yaml_empty_file(tmp_path, capsys, no_model_load):
    rc, err = run_config(write_config(tmp_path, b""), capsys)
    assert rc == 2 and "the config is empty" in err


def test_config_not_utf8(tmp_path, capsys, no_model_load):
    rc, err = run_config(write_config(tmp_path, "model_config: tiny-llama\n# caf\xe9\n".encode("latin-1")), capsys)
    assert rc == 2 and "not UTF-8 text" in err


def test_config_is_a_directory(tmp_path, capsys, no_model_load):
    rc, err = run_config(tmp_path, capsys)
    assert rc == 2 and "is a directory: give the YAML file inside it" in err


def test_plan_negative_gpus(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", str(write_config(tmp_path, b"model_config: tiny-llama\n")), "--gpus", "-2"])
    assert e.value.code == 2 and "-2 is not a positive number of GPUs" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-5", "0", "nan"])
def test_plan_host_gb_not_positive(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", str(write_config(tmp_path, b"model_config: tiny-llama\n")), "--host-gb", value])
    assert e.value.code == 2 and f"{value} is not a positive number of GiB" in capsys.readouterr().err


def test_example_model_into_a_directory_of_other_files(tmp_path, capsys):
    """`example-model DIR` where DIR holds a user's files: refused before the conversion, nothing written (was a raw
    OSError from the final rename, after the conversion, with DIR.partial left beside it)."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    assert cli.main(["example-model", str(tmp_path / "mine")]) == 2
    assert "holds other files (notes.txt), not a model written here before" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"] and (tmp_path / "mine" / "notes.txt").read_text() \
        == "keep" and len(list((tmp_path / "mine").iterdir())) == 1


def test_config_with_bom_and_crlf_trains(tmp_path, capsys):
    """A config saved by a Windows editor: a byte-order mark and CRLF line ends (a path with a space and non-ASCII
    letters too)."""
    case = Case(tmp_path)
    out = tmp_path / "sortie été"
    text = case.config.read_text().replace(str(case.out), str(out)).replace("max_steps: 2", "max_steps: 1")
    case.config.write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    rc, err = run_config(case.config, capsys)
    assert rc == 0, err
    assert (out / "model.safetensors").exists()


def test_tilde_in_paths(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "data.txt").write_text("a few words of text\n" * 50)
    case = Case(tmp_path, "dataset_path: ~/data.txt\noutput_dir: ~/run\nmax_steps: 1\nsave_strategy: 'no'\n")
    rc, err = run_config(case.config, capsys)
    assert rc == 0, err
    assert (tmp_path / "run" / "model.safetensors").exists() and not (Path.cwd() / "~").exists()


# ---------------------------------------------------------------------------------------------------- data
# id -> (file name, its bytes, config body, exit code, excerpt of the message)
DATA_ROWS = {
    "data-null-text": ("d.jsonl", b'{"text": null}\n{"text": "x"}\n', "", 2,
                       "row 1: 'text' is null (or missing), not a string"),
    "data-list-as-text": ("d.jsonl", b'{"text": ["a", "b"]}\n', "", 2, "row 1: 'text' is a list, not a string"),
    "data-dict-as-text": ("d.jsonl", b'{"text": {"a": 1}}\n', "", 2, "row 1: 'text' is a dict, not a string"),
    "data-number-as-text": ("d.jsonl", b'{"text": "a b"}\n{"text": 5}\n', "", 2, "row 2: 'text' is a number"),
    "data-null-prompt": ("d.jsonl", b'{"prompt": null, "completion": "x"}\n', "", 2,
                         "row 1: prompt is null (or missing) and completion a string; both must be strings"),
    "data-message-without-role": ("d.jsonl", b'{"messages": [{"content": "hi"}]}\n', "", 2,
                                  "row 1: message 1 is {'content': 'hi'}"),
    "data-null-chat-content": ("d.jsonl", b'{"messages": [{"role": "user", "content": null}, {"role": "assistant", '
                               b'"content": "x"}]}\n', "", 2, "row 1: message 1 (user) has no content (null)"),
    "data-csv-duplicate-column": ("d.csv", b"text,text\nhello,world\n", "", 2,
                                  "its header names the column 'text' twice"),
    "data-messages-not-a-list": ("d.jsonl", b'{"messages": "hello"}\n', "", 2,
                                 "row 1: messages is a string, not a list of {role, content} messages"),
    "data-empty-conversation": ("d.jsonl", b'{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": []}\n', "",
                                2, "row 2: messages is an empty list: a conversation needs its messages"),
    "data-all-texts-empty": ("d.jsonl", b'{"text": ""}\n{"text": "   "}\n', "", 2,
                             "no records with text (the dataset is empty, or every text is empty)"),
    "data-not-utf8": ("d.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "", 2, "d.jsonl:2: not UTF-8 text"),
    "data-bad-token-ids": ("d.jsonl", b'{"input_ids": "abc"}\n', "", 2, "row 1: input_ids must be a list of token ids"),
    "data-missing-split": ("d.jsonl", b'{"text": "a"}\n', "dataset_test_split: validation\n", 2,
                           "has no split 'validation'; it has train"),
    "data-unknown-column": ("d.jsonl", b'{"text": "a"}\n', "dataset_text_field: body\n", 2,
                            "records have columns ['text']; expected 'body' (dataset_text_field)"),
    "data-assistant-only-without-messages": ("d.jsonl", b'{"text": "a"}\n', "assistant_only_loss: true\n", 2,
                                             "assistant_only_loss needs conversational 'messages' records"),
    "data-streaming-without-max-steps": ("d.jsonl", b'{"text": "a"}\n', "streaming: true\nmax_steps: -1\n", 2,
                                         "streaming: true reads a dataset whose length is not known up front"),
    "data-streaming-with-eval-fraction": ("d.jsonl", b'{"text": "a"}\n', "streaming: true\neval_fraction: 0.1\n",
                                          2, "eval_fraction needs the whole dataset"),
    "data-name-and-path": ("d.jsonl", b'{"text": "a"}\n', "dataset_name: org/other\n", 2,
                           "name two datasets: give one"),
    "data-directory-without-data": (None, b"", "", 2, "cannot be loaded"),
}


@pytest.mark.parametrize("row", list(DATA_ROWS))
def test_data_rows(row, tmp_path, capsys, no_model_load):
    name, content, body, rc, needle = DATA_ROWS[row]
    path = tmp_path / "data"
    path.mkdir()
    if name:
        path = path / name
        path.write_bytes(content)
    expect(Case(tmp_path, body, data=str(path)), capsys, rc, needle)


# id -> (file name, its bytes, config body): data users produce that must train
TRAINS = {
    "data-bom-and-crlf-jsonl": ("d.jsonl", b'\xef\xbb\xbf{"text": "one two"}\r\n{"text": "three"}\r\n', ""),
    "data-bom-txt": ("d.txt", b"\xef\xbb\xbfhello world\r\nsecond line\r\n", ""),
    "data-record-of-several-mb": ("d.jsonl", json.dumps({"text": "lorem ipsum dolor " * 200_000}).encode() + b"\n",
                                  ""),
    "data-smaller-than-one-batch": ("d.jsonl", b'{"text": "just one record"}\n', "per_device_train_batch_size: 8\n"),
    "data-path-with-spaces-and-accents": ("mes données/d é.jsonl", b'{"text": "bonjour"}\n', ""),
    "data-streaming": ("d.jsonl", b'{"text": "a b c d"}\n' * 20, "streaming: true\n"),
}


@pytest.mark.parametrize("row", list(TRAINS))
@pytest.mark.slow
def test_data_that_trains(row, tmp_path, capsys):
    name, content, body = TRAINS[row]
    path = tmp_path / "data" / name
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    case = Case(tmp_path, body + "max_steps: 1\nsave_strategy: 'no'\n", data=str(path))
    rc, err = case.run(capsys)
    assert rc == 0, err[-3000:]
    assert (case.out / "model.safetensors").exists()
    if row == "data-record-of-several-mb":
        assert "were cut off" in err


def test_data_bom_is_not_a_token(tmp_path):
    from offload_trainer.cli.run_args import DataArguments, ModelArguments
    from offload_trainer.data import build_datasets
    from offload_trainer.models import load_tokenizer

    tok = load_tokenizer(ModelArguments(model_config="tiny-llama"))
    path = tmp_path / "d.txt"
    path.write_bytes(TRAINS["data-bom-txt"][1])
    train, _ = build_datasets(DataArguments(dataset_path=str(path), max_seq_length=64, packing=False), tok,
                              vocab_size=512)
    assert [tok.decode(r["input_ids"]) for r in train] == ["hello world<|endoftext|>", "second line<|endoftext|>"]


@pytest.mark.slow
def test_data_file_unreadable(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n')
    data.chmod(0)
    case = Case(tmp_path, "", data=str(data))
    if os.geteuid():
        return expect(case, capsys, 2, "cannot be read (permission denied)")
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv (util-linux): cannot drop the permission override")
    code = f"import sys; from offload_trainer import cli; sys.exit(cli.main(['train', {str(case.config)!r}]))"
    r = subprocess.run(["setpriv", "--bounding-set", "-dac_override,-dac_read_search", sys.executable, "-c", code],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "cannot be read (permission denied)" in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr


# ---------------------------------------------------------------------------------------------------- the model
def model_dir(tmp_path: Path, trained: Path, *, drop=(), damage=None) -> Path:
    """A copy of a trained model directory (config, weights, tokenizer) with files removed or damaged."""
    d = tmp_path / "model"
    shutil.copytree(trained / "checkpoint-2", d)
    for name in drop:
        (d / name).unlink()
    if damage:
        name, fn = damage
        (d / name).write_bytes(fn((d / name).read_bytes()))
    return d


MODEL_ROWS = {
    "empty-model-dir": (dict(drop=None), "cannot load its config"),
    "corrupt-model-config": (dict(damage=("config.json", lambda b: b[:40])), "cannot load its config"),
    "missing-model-weights": (dict(drop=("model.safetensors",)), "cannot load the weights"),
    "truncated-model-weights": (dict(damage=("model.safetensors", lambda b: b[: len(b) // 3])),
                                "cannot load the weights"),
    "missing-tokenizer": (dict(drop=("tokenizer.json", "tokenizer_config.json")), "cannot load the tokenizer"),
}


@pytest.mark.parametrize("row", list(MODEL_ROWS))
def test_model_rows(row, trained, tmp_path, capsys):
    kw, needle = MODEL_ROWS[row]
    if kw.get("drop", ()) is None:
        d = tmp_path / "model"
        d.mkdir()
    else:
        d = model_dir(tmp_path, trained, **kw)
    expect(Case(tmp_path, f"model_name_or_path: {d}\nmodel_config: null\nmodel_overrides: null\n"), capsys, 2,
           f"model_name_or_path '{d}'", needle)


def test_lora_targets_match_nothing(tmp_path, capsys):
    expect(Case(tmp_path, "lora_r: 4\nlora_target_modules: qq_proj\n"), capsys, 2,
           "lora_target_modules='qq_proj' matches no module of the model; its linear modules are named", "q_proj")


# ---------------------------------------------------------------------------------------------------- output_dir
def test_output_dir_is_a_file(tmp_path, capsys, no_model_load):
    (tmp_path / "out").write_text("notes")
    expect(Case(tmp_path), capsys, 4, "is a file, not a directory")
    assert (tmp_path / "out").read_text() == "notes"


@contextlib.contextmanager
def mounted_tmpfs(path: Path, size: str, *options: str):
    """A tmpfs of `size` at `path` (mounting needs root or CAP_SYS_ADMIN; else the test is skipped, saying so)."""
    path.mkdir(parents=True, exist_ok=True)
    opts = ",".join((f"size={size}", *options))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}): needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_output_dir_read_only_filesystem(tmp_path, capsys, no_model_load):
    with mounted_tmpfs(tmp_path / "ro", "1m", "ro"):
        case = Case(tmp_path, f"output_dir: {tmp_path / 'ro' / 'run'}\n")
        expect(case, capsys, 4, "cannot write to output_dir", "the filesystem is read-only")


@pytest.mark.slow
def test_output_dir_not_writable_by_the_user(tmp_path, capsys):
    """As a user who may not write there. Root writes anywhere: as root the command runs in a process without the
    capabilities that override file permissions (setpriv), which then apply to it as to any user."""
    out = tmp_path / "theirs"
    out.mkdir()
    out.chmod(0o555)
    case = Case(tmp_path, f"output_dir: {out}\n")
    if os.geteuid():
        return expect(case, capsys, 4, "cannot write to output_dir", "permission denied")
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv (util-linux): cannot drop the permission override")
    code = f"import sys; from offload_trainer import cli; sys.exit(cli.main(['train', {str(case.config)!r}]))"
    r = subprocess.run(["setpriv", "--bounding-set", "-dac_override,-dac_read_search", sys.executable, "-c", code],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 4, r.stderr[-3000:]
    assert "cannot write to output_dir" in r.stderr and "permission denied" in r.stderr
    assert "Traceback" not in r.stderr and not any(out.iterdir())


def hold_lock(out: Path):
    """Another process holding output_dir's lock, as a running `offload-trainer train` does."""
    out.mkdir(parents=True, exist_ok=True)
    code = ("import fcntl, os, sys, time\n"
            f"fd = os.open({str(out / '.offload-trainer.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, str(os.getpid()).encode())\n"
            "print('held', flush=True); time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_output_dir_busy(tmp_path, capsys):
    """A second `offload-trainer train` on a directory in use refuses at once: measured as a new process, the
    command's whole run including Python's start."""
    case = Case(tmp_path)
    holder = hold_lock(case.out)
    try:
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "offload_trainer.cli", "train", str(case.config)],
                           capture_output=True, text=True, timeout=60)
        took = time.perf_counter() - t0
        rc, err = case.run(capsys)  # and in-process, the same answer
    finally:
        holder.kill()
    assert r.returncode == 5 and f"is in use by another run (pid {holder.pid})" in r.stderr, r.stderr[-2000:]
    assert took < 1.0, f"took {took:.2f} s"
    assert rc == 5 and "is in use by another run" in err and case.unchanged


def test_output_dir_holds_an_earlier_run(trained, tmp_path, capsys):
    case = copy_run(trained, tmp_path)
    expect(case, capsys, 5, "holds checkpoints up to checkpoint-2 of an earlier run",
           "resume_from_checkpoint: true", "overwrite_output_dir: true")


def test_overwrite_output_dir(trained, tmp_path, capsys):
    case = copy_run(trained, tmp_path)
    before = json.loads((case.out / "checkpoint-2" / "trainer_state.json").read_text())
    rc, err = case.run(capsys, "overwrite_output_dir=true", "max_steps=1", "save_steps=1")
    assert rc == 0 and "overwrite_output_dir: removed checkpoint-1, checkpoint-2" in err
    assert sorted(p.name for p in case.out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-1"]
    assert before["global_step"] == 2


def test_overwrite_output_dir_keeps_what_is_not_a_runs_output(trained, tmp_path, capsys):
    """overwrite_output_dir replaces the earlier run only: a user's files and folders beside it (notes, data, a home
    directory's dot-files) stay as they were, and the log names them."""
    from cli_cases import tree_hash

    case = copy_run(trained, tmp_path)
    (case.out / "NOTES.md").write_text("my notes\n")
    (case.out / ".bashrc").write_text("export X=1\n")
    (case.out / "mydata").mkdir()
    (case.out / "mydata" / "rows.jsonl").write_text('{"text": "mine"}\n')
    (case.out / "Documents").mkdir()
    (case.out / "Documents" / "letter.txt").write_text("dear\n")
    mine = {n: tree_hash(case.out / n) if (case.out / n).is_dir() else (case.out / n).read_bytes()
            for n in ("NOTES.md", ".bashrc", "mydata", "Documents")}
    rc, err = case.run(capsys, "overwrite_output_dir=true", "max_steps=1", "save_steps=1")
    assert rc == 0 and "overwrite_output_dir: removed checkpoint-1, checkpoint-2" in err
    assert "kept what is not a run's output" in err and ".bashrc, Documents, NOTES.md, mydata" in err
    assert {n: tree_hash(case.out / n) if (case.out / n).is_dir() else (case.out / n).read_bytes()
            for n in mine} == mine
    assert not (case.out / ".earlier-run").exists()
    assert sorted(p.name for p in case.out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-1"]


def test_overwrite_output_dir_keeps_the_earlier_run_until_replaced(trained, tmp_path, capsys):
    """overwrite_output_dir with a data file whose bad row stops the new run before its first checkpoint: the
    earlier run is back as it was; a kill (SIGKILL) at the same point leaves it set aside, and the next start puts it
    back."""
    from cli_cases import tree_hash

    case = copy_run(trained, tmp_path)
    before = tree_hash(case.out)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": \n')
    rc, err = case.run(capsys, "overwrite_output_dir=true", f"dataset_path={bad}")
    assert rc == 2 and "not valid JSON" in err and "the earlier run in" in err and "is back as it was" in err
    assert tree_hash(case.out) == before
    aside = case.out / ".earlier-run"  # as a SIGKILL after setting aside would leave it
    aside.mkdir()
    for p in list(case.out.iterdir()):
        if p.name != ".earlier-run":
            p.rename(aside / p.name)
    rc, err = case.run(capsys, "resume_from_checkpoint=true", "max_steps=2")
    assert rc == 0 and "is back as it was" in err and "holds a finished run (step 2" in err
    assert tree_hash(case.out) == before


# ---------------------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("row, name", [("checkpoint-without-optimizer", "optimizer.pt"),
                                       ("checkpoint-without-scheduler", "scheduler.pt"),
                                       ("checkpoint-without-rng-state", "rng_state.pth")])
def test_checkpoint_missing_a_file(row, name, trained, tmp_path, capsys):
    case = copy_run(trained, tmp_path)
    (case.out / "checkpoint-2" / name).unlink()
    expect(case, capsys, 2, "is incomplete: its", f"({name}) is missing",
           argv=[f"resume_from_checkpoint={case.out / 'checkpoint-2'}", "max_steps=4"])


def test_resume_from_a_run_directory(trained, tmp_path, capsys):
    case = copy_run(trained, tmp_path)
    expect(case, capsys, 2, "it is a run's output directory, not one of its checkpoints",
           argv=[f"resume_from_checkpoint={case.out}", "max_steps=4"])


def losses(out: Path, step: int) -> list[float]:
    state = json.loads((out / f"checkpoint-{step}" / "trainer_state.json").read_text())
    return [h["loss"] for h in state["log_history"] if "loss" in h]


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory) -> Path:
    """The uninterrupted reference: 4 steps, checkpoints every step."""
    case = Case(tmp_path_factory.mktemp("four"))
    log_to_current_stderr()
    assert cli.main(["train", str(case.config), "max_steps=4"]) == 0
    return case.out


def shard_weights(ckpt: Path) -> None:
    """Re-save a checkpoint's model.safetensors one tensor per shard with an index, as transformers' own resume tests
    do (`convert_to_sharded_checkpoint`)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    names = [f"model-{i + 1:05d}-of-{len(tensors):05d}.safetensors" for i in range(len(tensors))]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": dict(zip(tensors, names))}))
    for (key, t), name in zip(tensors.items(), names):
        save_file({key: t}, ckpt / name)


@pytest.mark.slow
def test_resharded_checkpoint_resumes_as_the_trainer_does(four_steps, tmp_path, capsys):
    """A checkpoint whose weights were re-saved in another layout (sharded, with an index) resumes, with a line saying
    so, to the losses of the run never stopped; a cut-short shard is still refused."""
    case = copy_run(four_steps, tmp_path)
    (case.out / "trainer_state.json").unlink()
    for n in ("checkpoint-3", "checkpoint-4"):
        shutil.rmtree(case.out / n)
    shard_weights(case.out / "checkpoint-2")
    (tmp_path / "cut").mkdir()
    cut = copy_run(case.out, tmp_path / "cut")
    shard = sorted((cut.out / "checkpoint-2").glob("model-*.safetensors"))[3]
    shard.write_bytes(shard.read_bytes()[:-8])
    rc, err = case.run(capsys, f"resume_from_checkpoint={case.out / 'checkpoint-2'}", "max_steps=4")
    assert rc == 0, err
    assert "its weights are not the files saved with it" in err and "the rest of the checkpoint matches" in err
    assert losses(case.out, 4) == losses(four_steps, 4)
    expect(cut, capsys, 2, "is damaged", f"{shard.name} cannot be read",
           argv=[f"resume_from_checkpoint={cut.out / 'checkpoint-2'}", "max_steps=4"])


@pytest.mark.parametrize("row, name, content", [
    ("newest-checkpoint-empty-scheduler", "scheduler.pt", b""),
    ("newest-checkpoint-empty-rng-state", "rng_state.pth", b""),
    ("newest-checkpoint-empty-trainer-state", "trainer_state.json", b"{}"),
    ("newest-checkpoint-without-checksums", "checksums.json", None),
    ("newest-checkpoint-malformed-checksums", "checksums.json", b'{"model.safetensors": 5}'),
    ("newest-checkpoint-checksums-not-json", "checksums.json", b"[1, 2"),
    ("newest-checkpoint-malformed-hyperparameters", "hyperparameters.json", b'{"learning_rate": '),
    ("newest-checkpoint-hyperparameters-not-a-mapping", "hyperparameters.json", b"[]"),
])
@pytest.mark.slow
def test_damaged_newest_checkpoint_is_skipped(row, name, content, four_steps, tmp_path, capsys):
    case = copy_run(four_steps, tmp_path)
    (case.out / "trainer_state.json").unlink()  # (stopped after checkpoint-4: a finished run has nothing to resume)
    if content is None:
        (case.out / "checkpoint-4" / name).unlink()
    else:
        (case.out / "checkpoint-4" / name).write_bytes(content)
    rc, err = case.run(capsys, "resume_from_checkpoint=true", "max_steps=4")
    assert rc == 0, err
    assert "skipping checkpoint-4" in err and f"resuming from {case.out / 'checkpoint-3'}" in err
    assert losses(case.out, 4) == losses(four_steps, 4)  # step 4 trained again from checkpoint-3: the same run
    if name in ("checksums.json", "hyperparameters.json"):  # named by its path: one sentence, nothing changed
        shutil.rmtree(case.out / "checkpoint-4")
        shutil.copytree(four_steps / "checkpoint-4", case.out / "checkpoint-4")
        if content is None:
            (case.out / "checkpoint-4" / name).unlink()
        else:
            (case.out / "checkpoint-4" / name).write_bytes(content)
        expect(case, capsys, 2, f"checkpoint-4' is damaged: its {name}",
               argv=[f"resume_from_checkpoint={case.out / 'checkpoint-4'}", "max_steps=5"])


# ---------------------------------------------------------------------------------------------------- a real full disk
@pytest.mark.slow
def test_disk_full_during_a_checkpoint(tmp_path, capsys):
    """8 MiB hold two 3.2 MB checkpoints of the tiny model, not a third: the run stops with a sentence (exit 4), the
    last complete checkpoint is intact, and with room again the run resumes to the losses of one never stopped."""
    disk = tmp_path / "disk"
    with mounted_tmpfs(disk, "8m"):
        case = Case(tmp_path, f"output_dir: {disk / 'run'}\nmax_steps: 8\nsave_steps: 2\n")
        rc, err = case.run(capsys)
        assert rc == 4 and "out of disk space while saving checkpoint-6" in err, err[-2000:]
        assert "The previous checkpoint" in err and "checkpoint-4 is intact" in err
        assert sorted(p.name for p in (disk / "run").iterdir() if not p.name.startswith(".")) == [
            "checkpoint-2", "checkpoint-4"]
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        rc, err = case.run(capsys, "resume_from_checkpoint=true")
        assert rc == 0, err[-2000:]
        resumed = losses(disk / "run", 8)
    (tmp_path / "ref").mkdir()
    ref = Case(tmp_path / "ref", "max_steps: 8\nsave_steps: 2\n")
    assert ref.run(capsys)[0] == 0
    assert resumed == losses(ref.out, 8)


def test_disk_full_during_the_final_save(tmp_path, capsys):
    """The checkpoints fit, the final model does not: exit 4 with the sentence, no model file in output_dir, the
    last checkpoint intact; with room again, resuming it finishes the run (same losses, the model written)."""
    disk = tmp_path / "disk"
    with mounted_tmpfs(disk, "8m"):
        case = Case(tmp_path, f"output_dir: {disk / 'run'}\nmax_steps: 4\nsave_steps: 2\n")
        rc, err = case.run(capsys)
        run = disk / "run"
        assert rc == 4 and "for the trained model" in err, err[-2000:]
        assert not (run / "model.safetensors").exists() and not (run / "config.json").exists()
        before = losses(run, 4)
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        rc, err = case.run(capsys, "resume_from_checkpoint=true")
        assert rc == 0, err[-2000:]
        assert (run / "model.safetensors").exists() and losses(run, 4) == before
        # the model written is checkpoint-4's: no step past max_steps (the Trainer's resume would train step 5)
        assert json.loads((run / "trainer_state.json").read_text())["global_step"] == 4
        assert not (run / "checkpoint-5").exists() and "nothing is trained" in err


def test_save_strategy_no_still_checks_the_disk_for_the_model(tmp_path, capsys):
    disk = tmp_path / "disk"
    with mounted_tmpfs(disk, "1m"):
        expect(Case(tmp_path, f"output_dir: {disk / 'run'}\nsave_strategy: 'no'\n"), capsys, 4,
               "not enough disk in", "for the trained model")


@pytest.mark.parametrize("swap, fix", [("2", "2 of 4 decoder layers were on the GPU (as configured): set layer_swap: 0"),
                                       ("off", "no layer swap: set layer_swap: auto")], ids=["swap", "no_swap"])
@pytest.mark.slow
def test_gpu_out_of_memory_in_a_step(swap, fix, tmp_path, capsys, monkeypatch):
    """A step that runs out of GPU memory (torch's error raised inside step 3's forward and backward) ends with a
    sentence, exit 6: the allocation that failed, what was on the GPU and the switch that makes room, the last
    checkpoint (intact: resuming from it trains on)."""
    import torch
    from transformers import Trainer

    real = Trainer.training_step

    def oom_at_step_3(self, *args, **kwargs):
        if self.state.global_step == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                         "of 23.50 GiB of which 1.21 GiB is free.")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "training_step", oom_at_step_3)
    case = Case(tmp_path, f"max_steps: 4\nsave_steps: 2\nlayer_swap: {swap}\nactivation_checkpointing: true\n"
                          "model_overrides: {num_hidden_layers: 4}\n")
    rc, err = case.run(capsys)
    assert rc == 6, err[-2000:]
    assert ("out of GPU memory: step 3 ran out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB)"
            in err), err[-2000:]
    assert fix in err and f"the last checkpoint is {case.out / 'checkpoint-2'}" in err
    monkeypatch.setattr(Trainer, "training_step", real)
    rc, err = case.run(capsys, "resume_from_checkpoint=true")
    assert rc == 0, err[-2000:]


def test_gpu_limit_above_the_card(monkeypatch, caplog):
    """apply_gpu_memory_limit: a cap at or above the card's memory caps nothing (it refused before, so the shipped
    24 GB configs failed on a real 24 GB card); below it, the fraction of the card."""
    import logging


    import torch

    from offload_trainer.trainer import wiring

    fractions = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(total_memory=25_757_220_864))  # an RTX 4090: 23.99 GiB
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", fractions.append)
    with caplog.at_level(logging.INFO, logger="offload_trainer"):
        wiring.apply_gpu_memory_limit(24)
    assert fractions == [] and "is not below this GPU's 23.99 GiB: no cap" in caplog.text
    wiring.apply_gpu_memory_limit(12)
    assert fractions == [pytest.approx(12 * 2**30 / 25_757_220_864)]


def test_sighup_stops_cleanly(tmp_path):
    """SIGHUP (a closed terminal or SSH session) inside the training loop is a request to stop, as SIGTERM is: the
    step finishes and the run stops (it exited 129 with no save and no sentence); outside the loop, one sentence
    naming it."""
    import signal

    from offload_trainer.cli import stops
    from offload_trainer.settings import OffloadSettings
    from offload_trainer.trainer import guards
    from offload_trainer.trainer.run_state import RunState

    run, state = RunState(OffloadSettings()), SimpleNamespace(global_step=4)
    before = signal.getsignal(signal.SIGHUP)
    with guards.signals_stop_cleanly(run, lambda: state, str(tmp_path)):
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.05)
    assert run.interrupted == signal.SIGHUP and signal.getsignal(signal.SIGHUP) == before
    with pytest.raises(KeyboardInterrupt) as e:
        with stops.signals_say_where_the_run_stands(str(tmp_path / "c.yaml"), [f"output_dir={tmp_path}"]):
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.05)
    assert e.value.signum == signal.SIGHUP and "SIGHUP outside the training loop" in str(e.value)


def test_a_second_signal_stops_at_once(tmp_path):
    """A second SIGTERM while the first one's step finishes stops at once, saying which signals, the unfinished step
    and the last checkpoint, with the signal's exit code (it said 'SIGINT outside the training loop', 130)."""
    import signal

    from offload_trainer.cli.main import exit_code_of
    from offload_trainer.errors import TrainingInterrupted
    from offload_trainer.settings import OffloadSettings
    from offload_trainer.trainer import guards
    from offload_trainer.trainer.run_state import RunState

    run, state = RunState(OffloadSettings()), SimpleNamespace(global_step=6)

    def train():
        with guards.signals_stop_cleanly(run, lambda: state, str(tmp_path)):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)

    with pytest.raises(TrainingInterrupted, match=r"SIGTERM during step 7, after SIGTERM: stopped at once, the step "
                                                  r"unfinished and not saved; no checkpoint was saved"):
        train()
    run.interrupted = None
    assert exit_code_of(train) == 128 + signal.SIGTERM


def test_a_signal_names_the_step_it_arrives_in(tmp_path, capsys):
    """SIGTERM during step 3 of a run: the log says it finishes step 3 and the run stops after it (the handler held
    the TrainerState of before the loop, and said "finishing step 1" at any step)."""
    import signal

    from transformers import TrainerCallback

    from cli_cases import Case
    from offload_trainer.cli import recipe

    class SignalAtStep3(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    real = recipe.build_trainer

    def with_callback(*a, **k):
        trainer, tok, ev = real(*a, **k)
        trainer.add_callback(SignalAtStep3)
        return trainer, tok, ev

    case = Case(tmp_path, "max_steps: 6\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(recipe, "build_trainer", with_callback)
        rc, err = case.run(capsys)
    assert rc == 128 + signal.SIGTERM, err
    assert "SIGTERM received: finishing step 3, then saving a checkpoint" in err
    assert "stopped after step 3" in err


def test_a_stop_signal_during_the_stacks_import_waits_for_it(tmp_path):
    """A SIGTERM while torch and transformers first import (a second into a run) was answered inside their modules'
    Python, called from C++: the handler's exception could not unwind there (`terminate called after throwing an
    instance of 'pybind11::error_already_set'`, SIGABRT, no sentence). It is held through those imports and answered
    right after them."""
    import signal

    from offload_trainer.errors import stop_signals_call, stop_signals_deferred

    seen = []
    with stop_signals_call(lambda signum, frame: seen.append(signum)):
        with stop_signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            assert seen == []  # (held)
        time.sleep(0.05)
        assert seen == [signal.SIGTERM]  # (answered on the way out, by the handler of before)


def _host_planned_run(tmp_path, host_gb_above_peak=None, **kw):
    """A tiny streamed run with a plan made for a host budget: far above its peak, or `host_gb_above_peak` over it."""
    from helpers import tiny_setup
    from offload_trainer import OffloadTrainer, OffloadTrainingArguments, plan

    model, tok, train = tiny_setup(seq=32, layers=1)
    args = OffloadTrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2,
                                    offload_optimizer=True, max_grad_norm=0.0, logging_steps=1, save_strategy="no",
                                    report_to="none", **kw)
    roomy = plan(model.config, batch=2, seq=32, max_grad_norm=0.0, host_memory_gb=1000.0)
    budget = 1000.0 if host_gb_above_peak is None else roomy.host_peak_gib + host_gb_above_peak
    the_plan = plan(model.config, batch=2, seq=32, max_grad_norm=0.0, host_memory_gb=budget)
    return OffloadTrainer(model=model, args=args, train_dataset=train, offload_plan=the_plan)


@pytest.mark.slow
def test_host_memory_running_low_saves_a_checkpoint_and_stops(tmp_path, monkeypatch, caplog):
    """Where a plan was made for a host budget, the run reads the memory left after each step: when it falls under
    what a checkpoint's save needs (its shard and a margin), the run saves a checkpoint and stops with a sentence
    (`TrainingStopped`, the command's exit 3), where the kernel would have ended it with SIGKILL and nothing saved. A
    plan that fits only just is said at the start; a roomy one is not."""
    import logging

    from offload_trainer.errors import TrainingStopped
    from offload_trainer.trainer import guards

    left = iter([50.0, 0.01])
    monkeypatch.setattr(guards, "host_memory_left", lambda: next(left))
    trainer = _host_planned_run(tmp_path / "low")
    with caplog.at_level(logging.WARNING, logger="offload_trainer"), \
            pytest.raises(TrainingStopped, match=r"host memory ran low: 0\.01 GiB left after step 2, under the") as e:
        trainer.train()
    assert "Saved " in str(e.value) and "checkpoint-2" in str(e.value)
    assert (tmp_path / "low" / "checkpoint-2" / "model.safetensors").exists()
    assert trainer.state.global_step == 2
    assert "the plan needs" not in caplog.text  # (a roomy plan: nothing said at the start)

    monkeypatch.setattr(guards, "host_memory_left", lambda: 50.0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="offload_trainer"):
        _host_planned_run(tmp_path / "thin", host_gb_above_peak=0.5).train()
    assert "host memory: the plan needs" in caplog.text and "0.5 GiB to spare" in caplog.text
