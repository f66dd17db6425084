"""Every snippet of the README runs: the Python blocks on a tiny model, the `offload-trainer` command lines
in-process. (The quick-start install/test blocks are what CI itself runs.)"""
import os
import re
import shlex

import pytest
import torch

from helpers import tiny_setup
from offload_trainer import cli

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
README = open(os.path.join(ROOT, "README.md")).read()
PYTHON = re.findall(r"```python\n(.*?)```", README, re.S)
YAML = re.findall(r"```yaml\n(.*?)```", README, re.S)
BASH = [b for m, b in re.findall(r"(<!-- ci:\w+ -->\n)?```bash\n(.*?)```", README, re.S) if not m]


def commands(block: str):
    for line in block.replace("\\\n", " ").splitlines():
        line = line.split(" #")[0].strip()
        if line.startswith("offload-trainer"):
            yield shlex.split(line)[1:]


def test_readme_has_snippets():
    assert len(PYTHON) >= 2 and len(list(c for b in BASH for c in commands(b))) >= 3 and len(YAML) >= 4


CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
DATA = {  # the files the README's data examples name, in the format each says
    "corpus.jsonl": [{"text": "the cat sat on the mat"}] * 20,
    "chat.jsonl": [{"messages": CHAT}] * 20,
    "pairs.parquet": [{"prompt": "What is 2 plus 2?", "completion": " 4."}] * 20,
    "tokens.jsonl": [{"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]}] * 20,
}


@pytest.mark.parametrize("i", range(len(YAML)))
def test_yaml_snippet_trains(i, tmp_path, monkeypatch, capsys):
    """Each data example of the README, on the tiny model with the file it names, through the command."""
    import json

    import datasets

    monkeypatch.chdir(tmp_path)
    for name, records in DATA.items():
        if name.endswith(".parquet"):
            datasets.Dataset.from_list(records).to_parquet(name)
        else:
            (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model_config: tiny-llama\nmodel_overrides: {num_hidden_layers: 1}\ntorch_dtype: float32\n"
                   "max_seq_length: 32\nmax_steps: 1\nper_device_train_batch_size: 2\nsave_strategy: 'no'\n"
                   f"report_to: none\noutput_dir: {tmp_path / 'out'}\n" + YAML[i])
    assert cli.main(["train", str(cfg)]) == 0, capsys.readouterr().err[-3000:]


@pytest.mark.parametrize("i", range(len(PYTHON)))
def test_python_snippet_runs(i, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, tokenizer, train = tiny_setup(seq=32)
    train_ds = torch.utils.data.Subset(train, range(8))
    loader = torch.utils.data.DataLoader(train_ds, batch_size=4)
    before = [p.detach().clone() for p in model.parameters()]
    exec(compile(PYTHON[i], f"README python block {i}", "exec"),
         {"model": model, "tokenizer": tokenizer, "train_ds": train_ds, "loader": loader})
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # it trained


@pytest.mark.parametrize("argv", [c for b in BASH for c in commands(b)], ids=" ".join)
@pytest.mark.slow
def test_command_line_runs(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    if argv[0] == "train":
        argv = argv + [f"output_dir={tmp_path}"]
    assert cli.main(argv) == 0, capsys.readouterr().err
