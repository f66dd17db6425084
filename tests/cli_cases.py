"""Driving `offload-trainer train` in-process on the tiny model: a config built from BASE, the exit code, the
message, and whether anything under output_dir changed (tests of bad inputs and faults)."""
import hashlib
import re
import shutil
from pathlib import Path

from offload_trainer import cli

BASE = """model_config: tiny-llama
model_overrides: {{num_hidden_layers: 2}}
torch_dtype: float32
dataset_path: {data}
max_seq_length: 64
output_dir: {out}
max_steps: 2
per_device_train_batch_size: 2
learning_rate: 1.0e-3
logging_steps: 1
save_steps: 1
report_to: none
seed: 0
offload_optimizer: true
"""


def tree_hash(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()} if path.exists() else {}


def with_keys(base: str, body: str) -> str:
    """`base` with the top-level keys that `body` sets replaced by body's (a config may not repeat a key)."""
    keys = set(re.findall(r"^(\w+):", body, re.M))
    kept = [line for line in base.splitlines(keepends=True) if line.split(":")[0] not in keys]
    return "".join(kept) + body


class Case:
    """One row: a config (BASE + body) run through `offload-trainer train`, its exit code and message."""

    def __init__(self, tmp_path: Path, body: str = "", data: str = "builtin"):
        self.tmp, self.out = tmp_path, tmp_path / "out"
        self.config = tmp_path / "c.yaml"
        self.config.write_text(with_keys(BASE.format(data=data, out=self.out), body))

    def run(self, capsys, *argv) -> tuple[int, str]:
        log_to_current_stderr()
        before = tree_hash(self.out)
        rc = cli.main(["train", str(self.config), *argv])
        err = stderr_of(capsys)
        self.unchanged = tree_hash(self.out) == before
        return rc, err


def stderr_of(capsys) -> str:
    """What the command printed on stderr, checked for tracebacks. (pytest closes each test's captured stderr; a
    library logger that kept an earlier one reports a "--- Logging error ---" with a traceback of its own: not ours,
    those blocks are dropped.)"""
    err = re.sub(r"--- Logging error ---.*?\nArguments: [^\n]*\n", "", capsys.readouterr().err, flags=re.S)
    assert "Traceback" not in err, err[-4000:]
    return err


def expect(case: Case, capsys, rc: int, *needles: str, argv=(), untouched=True) -> str:
    got_rc, err = case.run(capsys, *argv)
    assert got_rc == rc, err
    for n in needles:
        assert n in err, f"{n!r} not in {err!r}"
    if untouched:
        assert case.unchanged, "files under output_dir changed"
    return err


def log_to_current_stderr() -> None:
    """Library loggers keep the stderr of the test that first configured them; point them at the current one."""
    import logging
    import sys

    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    for lg in loggers:
        for h in lg.handlers:
            if type(h) is logging.StreamHandler:  # not pytest's own capture handlers
                h.stream = sys.stderr  # (setStream would flush the old, closed one)


def copy_run(trained: Path, tmp_path: Path) -> Case:
    case = Case(tmp_path)
    shutil.copytree(trained, case.out)
    return case
