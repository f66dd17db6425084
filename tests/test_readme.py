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
BASH = [b for m, b in re.findall(r"(<!-- ci:\w+ -->\n)?```bash\n(.*?)```", README, re.S) if not m]


def commands(block: str):
    for line in block.replace("\\\n", " ").splitlines():
        line = line.split(" #")[0].strip()
        if line.startswith("offload-trainer"):
            yield shlex.split(line)[1:]


def test_readme_has_snippets():
    assert len(PYTHON) >= 2 and len(list(c for b in BASH for c in commands(b))) >= 3


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
def test_command_line_runs(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    if argv[0] == "train":
        argv = argv + [f"output_dir={tmp_path}"]
    assert cli.main(argv) == 0, capsys.readouterr().err
