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

from offload_trainer.checkpoint import check_checkpoint, newest_complete_checkpoint

CONFIG = """model_config: tiny-llama
model_overrides: {{num_hidden_layers: 2}}
torch_dtype: float32
dataset_path: builtin
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


def test_sigkill_during_saves_then_resume_gives_the_same_losses(tmp_path):
    ref_out = tmp_path / "ref"
    finish(start(tmp_path, ref_out))
    want = losses(ref_out / "checkpoint-20")
    assert len(want) == 20

    out = tmp_path / "run"
    rng = random.Random(0)
    kill_at = sorted(rng.sample(range(2, 20), 5))  # the saves to kill (of checkpoint-1 .. checkpoint-20)
    kills = []
    for target in kill_at + [None]:
        resume = newest_complete_checkpoint(str(out)) is not None
        proc = start(tmp_path, out, resume=resume)
        if target is None:
            finish(proc)
            break
        staging = out / f".partial-checkpoint-{target}"
        deadline = time.time() + 240
        while not staging.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.0005)
        assert proc.poll() is None, "the run ended before the save to interrupt"
        time.sleep(rng.uniform(0, 0.05))  # somewhere inside the save (or just after it)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        newest = newest_complete_checkpoint(str(out))
        assert newest is not None
        check_checkpoint(newest)  # complete and readable
        assert not [p for p in out.iterdir() if p.name.startswith("checkpoint-") and
                    int(p.name.split("-")[1]) > target], "a checkpoint newer than the killed save appeared"
        kills.append((target, Path(newest).name))
    assert len(kills) == 5
    print("killed during saves:", kills)
    assert losses(out / "checkpoint-20") == want  # the resumed chain matches the uninterrupted run exactly


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

    # resumed to step + 3 == an uninterrupted run of step + 3 steps (constant LR: same schedule)
    finish(start(tmp_path, out, steps=step + 3, save=10_000, sched="constant", resume=True))
    ref = tmp_path / "ref"
    finish(start(tmp_path, ref, steps=step + 3, save=10_000, sched="constant"))
    got = json.loads((out / "trainer_state.json").read_text())["log_history"]
    want = json.loads((ref / "trainer_state.json").read_text())["log_history"]
    assert [h["loss"] for h in got if "loss" in h] == [h["loss"] for h in want if "loss" in h]
