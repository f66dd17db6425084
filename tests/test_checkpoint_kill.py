"""Kill tests: SIGKILL at random points while checkpoints are written, and SIGTERM mid-run.

Each time, the newest complete checkpoint loads and the run resumed from it reaches the same losses as an
uninterrupted run (CPU: exactly)."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from offload_trainer.trainer.checkpoint import check_checkpoint, newest_complete_checkpoint

pytestmark = pytest.mark.slow  # (processes started for each test: run by .ci/run's second step)

CONFIG = """model_config: tiny-llama
model_overrides: {{num_hidden_layers: 2}}
torch_dtype: float32
dataset_path: random
random_num_samples: 128
max_seq_length: 64
output_dir: {out}
max_steps: {steps}
per_device_train_batch_size: 2
learning_rate: 1.0e-3
lr_scheduler_type: {sched}
logging_steps: 1
save_steps: {save}
report_to: none
seed: 0
"""


def start(tmp: Path, out: Path, *, steps=20, save=1, sched="cosine", resume=False) -> subprocess.Popen:
    cfg = tmp / f"c-{out.name}.yaml"
    cfg.write_text(CONFIG.format(out=out, steps=steps, save=save, sched=sched))
    argv = [sys.executable, "-m", "offload_trainer.cli", "train", str(cfg)]
    if resume:
        argv.append("resume_from_checkpoint=true")
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def losses(checkpoint: Path) -> list[float]:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return [h["loss"] for h in state["log_history"] if "loss" in h]


def finish(proc: subprocess.Popen, timeout=300) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out


def _train_in_child(argv: list[str]) -> None:
    """A child forked from the fork server: the imports are inherited, so a trial costs its training steps, not a
    Python start."""
    import torch

    from offload_trainer import cli

    torch.set_num_threads(1)
    os._exit(cli.main(argv))


def test_sigkill_during_20_saves_then_resume_gives_the_same_losses(tmp_path):
    """20 times: resume from the newest complete checkpoint, SIGKILL at a random point inside the next save."""
    import multiprocessing

    # NOTE: not plain fork: this pytest process has run torch's OpenMP thread pools in earlier tests, and a child
    # forked after that can deadlock in them (seen here). A fork server is a fresh process that only imports.
    fork = multiprocessing.get_context("forkserver")
    fork.set_forkserver_preload(["torch", "transformers", "offload_trainer.cli", "offload_trainer.trainer.mixin"])
    steps = 30

    def config(out: Path) -> str:
        cfg = tmp_path / f"c-{out.name}.yaml"
        cfg.write_text(CONFIG.format(out=out, steps=steps, save=1, sched="cosine"))
        return str(cfg)

    ref_out = tmp_path / "ref"
    child = fork.Process(target=_train_in_child, args=(["train", config(ref_out)],))
    child.start()
    child.join(timeout=300)
    assert child.exitcode == 0
    want = losses(ref_out / f"checkpoint-{steps}")
    assert len(want) == steps

    out, cfg = tmp_path / "run", config(tmp_path / "run")
    rng = random.Random(0)
    kills = []
    for target in range(1, 21):  # kill once inside each of saves 1..20 (the run before it resumes as it can)
        newest = newest_complete_checkpoint(str(out))
        child = fork.Process(target=_train_in_child,
                             args=(["train", cfg] + (["resume_from_checkpoint=true"] if newest else []),))
        child.start()
        staging = out / f".partial-checkpoint-{target}"
        deadline = time.time() + 120
        while not staging.exists() and child.exitcode is None and time.time() < deadline:
            time.sleep(0.0002)
        assert child.exitcode is None, "the run ended before the save to interrupt"
        time.sleep(rng.uniform(0, 0.03))  # somewhere inside the save (or just after it)
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        newest = newest_complete_checkpoint(str(out))
        assert newest is not None or target == 1  # (killed inside the very first save: nothing to resume yet)
        if newest is not None:
            check_checkpoint(newest)  # complete and readable
        assert not any(p.name.startswith("checkpoint-") and int(p.name.split("-")[1]) > target
                       for p in out.iterdir()), "a checkpoint newer than the interrupted save appeared"
        kills.append((target, Path(newest).name if newest else None))
    child = fork.Process(target=_train_in_child, args=(["train", cfg, "resume_from_checkpoint=true"],))
    child.start()
    child.join(timeout=300)
    assert child.exitcode == 0
    inside = sum(1 for target, kept in kills if kept != f"checkpoint-{target}")
    print(f"20 kills, {inside} before the save was published:", kills)
    assert inside >= 5  # kills must land inside saves, not only after them
    assert losses(out / f"checkpoint-{steps}") == want  # the resumed chain matches the uninterrupted run exactly


def test_sigterm_saves_and_resumes(tmp_path):
    out = tmp_path / "run"
    proc = start(tmp_path, out, steps=500, save=10_000, sched="constant")
    lines = []
    for line in proc.stdout:  # wait until training has made a few steps
        lines.append(line)
        if "| loss" in line and "step 3 " in line:
            break
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    text = "".join(lines) + rest
    assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert "interrupted: SIGTERM: stopped after step" in text and "Traceback" not in text
    ckpt = Path(newest_complete_checkpoint(str(out)))
    assert f"the last checkpoint is {ckpt}" in text
    step = int(ckpt.name.split("-")[1])
    assert step >= 3

    # resumed to step + 3 == an uninterrupted run of step + 3 steps (constant LR: same schedule); the two runs side by
    # side (their own directories)
    ref = tmp_path / "ref"
    runs = [start(tmp_path, out, steps=step + 3, save=10_000, sched="constant", resume=True),
            start(tmp_path, ref, steps=step + 3, save=10_000, sched="constant")]
    for run in runs:
        finish(run)
    got = json.loads((out / "trainer_state.json").read_text())["log_history"]
    want = json.loads((ref / "trainer_state.json").read_text())["log_history"]
    assert [h["loss"] for h in got if "loss" in h] == [h["loss"] for h in want if "loss" in h]
