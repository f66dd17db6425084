"""What a run may replace or remove in its output_dir: only what a run of ours wrote (the record,
trainer/manifest.py), never through a link planted there. Each case through the command on the tiny model."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_cases import Case, copy_run, expect, tree_hash
from offload_trainer.trainer import manifest

USER_FILES = {"notes.txt": "mine", "README.md": "# my project", "runs/exp0/events": "tb of another experiment",
              "checkpoint-notes/plan.txt": "not a checkpoint", "checkpoint-best/model.txt": "my copy"}


def plant(root: Path, files: dict) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def texts(root: Path, files: dict) -> dict:
    return {n: (root / n).read_text() if (root / n).is_file() else None for n in files}


@pytest.mark.parametrize("overwrite", [False, True])
def test_planted_earlier_run_link_moves_nothing(overwrite, trained, tmp_path, capsys, no_model_load):
    """`.earlier-run -> elsewhere` planted in output_dir (an earlier run in it, or none): refused before loading; the
    earlier run's files were moved into the link's directory (overwrite), or every file of that directory moved into
    output_dir ("back as it was")."""
    victim = tmp_path / "victim"
    plant(victim, {"config.json": "someone's", "data.bin": "x"})
    case = copy_run(trained, tmp_path) if overwrite else Case(tmp_path)
    case.out.mkdir(exist_ok=True)
    (case.out / ".earlier-run").symlink_to(victim, target_is_directory=True)
    before = tree_hash(victim)
    expect(case, capsys, 5, ".earlier-run is a link to", "Remove it",
           argv=["overwrite_output_dir=true"] if overwrite else [])
    assert tree_hash(victim) == before


def test_planted_merged_link_is_refused_before_loading(tmp_path, capsys, no_model_load):
    """A LoRA run writes its merged model into output_dir/merged: a link planted there is refused before loading
    (the merged model was written into the directory it points to)."""
    victim = tmp_path / "victim"
    plant(victim, {"config.json": "someone's"})
    case = Case(tmp_path, "lora_r: 4\nlora_target_modules: all-linear\n")
    case.out.mkdir()
    (case.out / "merged").symlink_to(victim, target_is_directory=True)
    before = tree_hash(victim)
    expect(case, capsys, 5, "merged is a link to", "the link itself")
    assert tree_hash(victim) == before


def test_a_users_files_survive_runs_overwrites_and_rotation(tmp_path, capsys):
    """A project folder as output_dir: the user's config.json makes the run refuse before loading, naming it; without
    it, the user's README.md, notes, runs/ and checkpoint-* folders survive a run, an overwrite run and rotation
    (save_total_limit: the Trainer's rotation took every `checkpoint-*` directory), and only the run's own names are
    recorded."""
    case = Case(tmp_path, "save_total_limit: 1\nmax_steps: 3\n")
    case.out.mkdir()
    plant(case.out, {**USER_FILES, "config.json": '{"mine": true}'})
    expect(case, capsys, 5, "holds config.json, which this run would replace, and no run of ours wrote it")
    (case.out / "config.json").unlink()
    rc, err = case.run(capsys)
    assert rc == 0, err
    assert texts(case.out, USER_FILES) == {n: t for n, t in USER_FILES.items()}
    assert sorted(p.name for p in case.out.glob("checkpoint-[0-9]*")) == ["checkpoint-3"]
    recorded = manifest.read(str(case.out))
    assert "checkpoint-3" in recorded and "config.json" in recorded and not recorded & {"README.md", "runs",
                                                                                       "notes.txt", "checkpoint-best"}
    rc, err = case.run(capsys, "overwrite_output_dir=true", "max_steps=2")
    assert rc == 0, err
    assert texts(case.out, USER_FILES) == {n: t for n, t in USER_FILES.items()}
    assert sorted(p.name for p in case.out.glob("checkpoint-[0-9]*")) == ["checkpoint-2"]
    assert json.loads((case.out / "trainer_state.json").read_text())["global_step"] == 2
    # a LoRA run would replace README.md with peft's model card: refused, naming it
    expect(case, capsys, 5, "holds README.md, which this run would replace",
           argv=["overwrite_output_dir=true", "lora_r=4", "lora_target_modules=all-linear"])


def test_an_earlier_versions_run_keeps_the_users_runs_folder(trained, tmp_path, capsys):
    """A folder written before the record existed (no manifest): its checkpoints and the Trainer's files are the
    earlier run's and are replaced by overwrite_output_dir as before; a `runs/` folder is never taken for ours (it
    deleted the user's other experiments)."""
    case = copy_run(trained, tmp_path)
    (case.out / manifest.MANIFEST_NAME).unlink(missing_ok=True)
    plant(case.out, {"runs/exp0/events": "tb", "notes.txt": "mine"})
    rc, err = case.run(capsys, "overwrite_output_dir=true", "max_steps=1", "save_steps=1")
    assert rc == 0, err
    assert texts(case.out, {"runs/exp0/events": 0, "notes.txt": 0}) == {"runs/exp0/events": "tb", "notes.txt": "mine"}
    assert sorted(p.name for p in case.out.glob("checkpoint-*")) == ["checkpoint-1"]


def test_put_back_merges_a_directory_both_runs_wrote(tmp_path):
    """An overwrite run killed before its first checkpoint: the earlier run goes back, and a directory the new run
    had begun (a tracker's logs) is merged with the earlier one's entry by entry, not dropped."""
    from offload_trainer.cli.earlier_run import put_back_earlier_run

    out = tmp_path / "out"
    plant(out, {".earlier-run/runs/old/events": "earlier", ".earlier-run/config.json": "{}",
                "runs/new/events": "new"})
    put_back_earlier_run(str(out))
    assert texts(out, {"runs/old/events": 0, "runs/new/events": 0, "config.json": 0}) == {
        "runs/old/events": "earlier", "runs/new/events": "new", "config.json": "{}"}
    assert not (out / ".earlier-run").exists()


def test_report_beside_a_save_leaves_the_save_whole(trained, tmp_path):
    """`offload-trainer report` run again and again while a run's final save is being written into the same
    output_dir: both used one staging name, so the report removed the save's files (and left its own behind)."""
    from offload_trainer.trainer.outputs import staged_save

    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    import shutil

    shutil.copytree(trained, out)
    with staged_save(str(out), "the model") as staging:
        Path(staging, "model.safetensors").write_bytes(b"the new weights")
        for _ in range(2):
            r = subprocess.run([sys.executable, "-m", "offload_trainer.cli", "report", str(out)],
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr[-2000:]
        assert Path(staging, "model.safetensors").read_bytes() == b"the new weights"
    assert (out / "model.safetensors").read_bytes() == b"the new weights" and (out / "loss.png").is_file()
    assert not [n for n in os.listdir(out) if n.startswith(".partial-")]
