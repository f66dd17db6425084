"""The run's output directory before training: another run holding it, an earlier run in it (refused, resumed,
finished, or set aside by overwrite_output_dir until this one replaces it), the trained model's own directory."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil

from ..errors import ConfigError, OutputBusy
from ..trainer.checkpoint import MODEL_FILES, WEIGHT_NAME, checkpoint_steps
from ..trainer import manifest
from ..trainer.outputs import LOCK_NAME, STAGING_PREFIX, OutputLock
from .config import load_yaml, parse_overrides

logger = logging.getLogger("offload_trainer")

def configured_output_dir(config: str, overrides: list[str]) -> str | None:
    """The output_dir a config names, read from the YAML alone (before it is checked; None where it cannot be read:
    load_config reports why)."""
    try:
        out = {**load_yaml(config), **parse_overrides(overrides)}.get("output_dir")
    except ConfigError:
        return None
    return os.path.expanduser(out) if isinstance(out, str) and out else None


def refuse_busy_output_dir(config: str, overrides: list[str]) -> None:
    """OutputBusy if another run holds the config's output_dir."""
    out = configured_output_dir(config, overrides)
    if out is not None and os.path.isdir(out):
        OutputLock(out).probe()


def resumes_here(training_args) -> bool:
    """The run continues one in its own output_dir (`resume_from_checkpoint: true`, or a checkpoint inside it); a
    checkpoint of another directory starts a new run in this one."""
    resume = training_args.resume_from_checkpoint
    if not resume or str(resume).strip().lower() in ("false", "none", ""):
        return False
    if str(resume).strip().lower() in ("true", "latest"):
        return True
    path, out = os.path.realpath(resume), os.path.realpath(training_args.output_dir)
    return path == out or path.startswith(out + os.sep)  # (output_dir itself: the resume says what to give instead)


def finished_step(training_args) -> int | None:
    """The step a finished run in output_dir ended at, when this one resumes it and asks for no more steps: its
    trainer_state.json (written with the final model) at or past max_steps, no newer checkpoint. The Trainer would
    otherwise train one more step and write its model over the finished one."""
    path = os.path.join(training_args.output_dir, "trainer_state.json")
    if not resumes_here(training_args) or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            state = json.load(f)
        step, planned = int(state["global_step"]), int(state["max_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    target = training_args.max_steps if training_args.max_steps > 0 else planned
    steps = checkpoint_steps(training_args.output_dir).values()
    return step if step >= target and max(steps, default=0) <= step else None


def check_earlier_run(training_args, model_args) -> bool:
    """An output_dir holding an earlier run is refused unless this run resumes it or asks to start over (True: it
    holds one and overwrite_output_dir asks to replace it): the new run's checkpoints would silently replace and
    interleave with the old ones. The model's own directory is refused always (its weights would be replaced), and so
    is any name the run would replace that no run of ours wrote, or a link planted where it writes."""
    out = training_args.output_dir
    base = model_args.model_name_or_path
    put_back_earlier_run(out)  # (left set aside by a run killed before its first checkpoint)
    if base and os.path.isdir(out) and os.path.realpath(base) == os.path.realpath(out):
        raise OutputBusy(f"output_dir {out!r} is the directory of the model it trains (model_name_or_path): the run "
                         f"would write its checkpoints and model over the weights. Choose another output_dir.")
    if not os.path.isdir(out):
        return False
    check_foreign_names(out, lora=bool(model_args.lora_r), tracker="tensorboard" in (training_args.report_to or []))
    if resumes_here(training_args):
        return False
    ckpts = list(checkpoint_steps(out))
    finished = _finished_files(out)
    if not ckpts and not finished:
        return False
    if training_args.overwrite_output_dir:
        return True
    what = f"checkpoints up to {ckpts[-1]}" if ckpts else f"a finished run ({finished[0]})"
    raise OutputBusy(f"output_dir {out!r} holds {what} of an earlier run. Continue it with resume_from_checkpoint: "
                     f"true, start over with overwrite_output_dir: true (the earlier run is replaced once this one "
                     f"writes a checkpoint), or choose another output_dir.")


def _finished_files(out: str) -> list[str]:
    return [n for n in ("trainer_state.json", *MODEL_FILES) if os.path.lexists(os.path.join(out, n))]


EARLIER_RUN = ".earlier-run"  # inside output_dir: an earlier run set aside by overwrite_output_dir

# What a run writes into its output_dir (the Trainer's saves, ours): checkpoints, a LoRA run's merged model, the
# weights (whole or sharded), the model's, tokenizer's and Trainer's files, our figures and plots. (A LoRA run also
# writes peft's README.md; a tracker writes into runs/, adding a directory of its own.)
RUN_NAMES = re.compile(
    r"^(checkpoint-\d+|merged"
    r"|" + WEIGHT_NAME.pattern.strip("^$") +  # weights, whole or sharded
    r"|config\.json|generation_config\.json|adapter_config\.json"
    r"|tokenizer(_config)?\.json|tokenizer\.model|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)"
    r"|merges\.txt|chat_template\.(jinja|json)|(pre)?processor_config\.json|video_preprocessor_config\.json"
    r"|trainer_state\.json|run_figures\.json|training_args\.bin|(train|eval|all)_results\.json"
    r"|(loss|throughput|memory)\.png)$")
WRITTEN_INTO = ("merged", "runs", EARLIER_RUN)  # directories a run (or its tracker) writes files into


def ours(out: str) -> set[str]:
    """The entries of `out` a run of ours wrote: those its record lists (trainer/manifest.py). A directory written by
    an earlier version has no record: when it holds an earlier run, the names that run writes are its own (peft's
    README.md beside adapters; a tracker's runs/ never: it may hold other experiments), else none."""
    recorded = manifest.read(out)
    if recorded is not None:
        return recorded
    if not checkpoint_steps(out) and not _finished_files(out):
        return set()
    names = {n for n in os.listdir(out) if RUN_NAMES.match(n)}
    if "adapter_config.json" in names and os.path.lexists(os.path.join(out, "README.md")):
        names.add("README.md")
    return names


def check_foreign_names(out: str, lora: bool, tracker: bool) -> None:
    """OutputBusy, before anything loads, when the run would replace a name in `out` that no run of ours wrote (a
    user's config.json, README.md, checkpoint copy) -- nothing is replaced or deleted that a run did not write -- or
    a link stands where it writes into a directory (the files would land wherever the link points)."""
    mine = ours(out)
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name)
        if name in WRITTEN_INTO and (lora or name != "merged") and (tracker or name != "runs") \
                and (os.path.islink(path) or not os.path.isdir(path)) and os.path.lexists(path):
            what = f"a link to {os.readlink(path)!r}" if os.path.islink(path) else "not a directory"
            raise OutputBusy(f"output_dir {out!r}: {name} is {what}, where the run writes files into a directory of "
                             f"its own. Remove it (the link itself: what it points to is not ours), or choose another "
                             f"output_dir.")
        writes = RUN_NAMES.match(name) or (lora and name == "README.md")
        if writes and name not in mine:
            raise OutputBusy(f"output_dir {out!r} holds {name}, which this run would replace, and no run of ours "
                             f"wrote it (the record of what our runs wrote there, {manifest.MANIFEST_NAME}, does not "
                             f"list it): nothing a run did not write is replaced or deleted. Move it away, or choose "
                             f"another output_dir.")


@contextlib.contextmanager
def earlier_run_set_aside(out: str):
    """overwrite_output_dir: the earlier run's files wait in output_dir/.earlier-run while this run starts; they are
    deleted once it has written a checkpoint or its model, and put back if it stops before (a bad data row, a
    signal): a run that fails early never leaves output_dir with neither run."""
    aside = os.path.join(out, EARLIER_RUN)
    mine, names, kept = ours(out), [], []
    for n in sorted(os.listdir(out)):
        if n in (LOCK_NAME, EARLIER_RUN, manifest.MANIFEST_NAME) or n.startswith(STAGING_PREFIX):
            continue
        (names if n in mine else kept).append(n)
    ckpts = ", ".join(checkpoint_steps(out)) or "the files"
    os.mkdir(aside)  # (check_foreign_names refused anything already at that name)
    for n in names:
        os.rename(os.path.join(out, n), os.path.join(aside, n))  # (a link is moved as a link, never followed)
    manifest.forget(out, names)
    logger.info("overwrite_output_dir: the earlier run in %s is set aside until this one writes a checkpoint", out)
    if kept:
        shown = ", ".join(kept[:8]) + (f" and {len(kept) - 8} more" if len(kept) > 8 else "")
        logger.info("overwrite_output_dir: kept what is not a run's output in %s: %s", out, shown)
    try:
        yield
    finally:
        if _holds_a_run(out):
            logger.warning("overwrite_output_dir: removed %s of the earlier run in %s", ckpts, out)
        put_back_earlier_run(out)


def _move_back(src: str, dst: str) -> None:
    """Every entry of `src` into `dst`; a directory both hold (a tracker's logs this run began) merged entry by entry,
    so nothing of the earlier run's is dropped."""
    for n in os.listdir(src):
        s, d = os.path.join(src, n), os.path.join(dst, n)
        if os.path.isdir(d) and not os.path.islink(d) and os.path.isdir(s) and not os.path.islink(s):
            _move_back(s, d)
        else:
            os.replace(s, d)


def _holds_a_run(out: str) -> bool:
    return bool(checkpoint_steps(out)) or any(os.path.exists(os.path.join(out, n)) for n in MODEL_FILES)


def put_back_earlier_run(out: str) -> None:
    """An earlier run set aside (`earlier_run_set_aside`) goes back into output_dir when no later run replaced it
    (it stopped first, or was killed before its first checkpoint); otherwise what is left of it is removed."""
    aside = os.path.join(out, EARLIER_RUN)
    if not os.path.lexists(aside):
        return
    if os.path.islink(aside) or not os.path.isdir(aside):
        what = f"a link to {os.readlink(aside)!r}" if os.path.islink(aside) else "not a directory"
        raise OutputBusy(f"output_dir {out!r}: {EARLIER_RUN} is {what}, not an earlier run this command set aside: "
                         f"nothing is moved through it. Remove it (the link itself), or choose another output_dir.")
    if _holds_a_run(out):
        shutil.rmtree(aside, ignore_errors=True)
        return
    names = os.listdir(aside)
    _move_back(aside, out)
    manifest.record(out, names)
    shutil.rmtree(aside, ignore_errors=True)
    logger.warning("overwrite_output_dir: this run stopped before its first checkpoint; the earlier run in %s is "
                   "back as it was", out)
