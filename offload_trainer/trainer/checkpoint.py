"""Checkpoints that survive a kill: written into a staging directory, then published (outputs.publish: fsync, then
rename into place).

A directory named `checkpoint-N` therefore only ever exists complete. `newest_complete_checkpoint` also
checks what it picks (trainer state readable, weights' header readable, optimizer, scheduler and RNG archives
present and intact), so a checkpoint damaged later (a disk error, a hand copy cut short) is skipped with a warning
instead of failing the resume; `check_checkpoint` explains what is wrong with one given explicitly,
including a checkpoint of another model (parameter names or shapes differ).
"""
from __future__ import annotations

import json
import logging
import os
import re
import zipfile

from ..digest import ALGORITHM, files_digest
from ..errors import CheckpointError
from .outputs import STAGING_PREFIX, remove_staging
from .resume_changes import RECORD

logger = logging.getLogger("offload_trainer")

CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
_SHARD = re.compile(r"^optimizer-rank(\d+)-of-(\d+)\.pt$")
_RNG = re.compile(r"^rng_state(_\d+)?\.pth$")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors",
                "pytorch_model.bin")
MODEL_FILES = (*WEIGHT_FILES, "pytorch_model.bin.index.json")  # (what a saved model is recognised by)
# Any layout transformers saves and loads weights in: whole, or sharded with an index.
WEIGHT_NAME = re.compile(r"^(model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")


def index_shards(index: str) -> list[str]:
    """The shard files a weights index (`*.index.json`) names, each a file of the index's own directory: an absolute
    name, a `..` or a subdirectory would read (and a merge write) outside it. ValueError says what is wrong."""
    try:
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index}: not a weights index ({type(e).__name__}: {e}); transformers writes it with a "
                         f"weight_map of tensor name -> shard file") from None
    for name in names:
        if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name or "/" in name \
                or "\\" in name:
            raise ValueError(f"{index} names the shard {name!r}, which is not a file of "
                             f"{os.path.dirname(index)!r}: shards are read from the model's directory only")
    return names


def checkpoint_steps(run_dir: str) -> dict[str, int]:
    """The checkpoint-N entries of `run_dir` (name -> N), in step order; other names are not checkpoints."""
    found = {n: int(m.group(1)) for n in os.listdir(run_dir) if (m := CHECKPOINT_NAME.match(n))}
    return dict(sorted(found.items(), key=lambda kv: kv[1]))


def clean_staging(run_dir: str) -> None:
    """Remove what an interrupted save left behind (never a published checkpoint)."""
    if not os.path.isdir(run_dir):
        return
    for name in os.listdir(run_dir):
        if name.startswith(STAGING_PREFIX):
            remove_staging(os.path.join(run_dir, name))


CHECKSUMS = "checksums.json"


def _hash(file: str) -> str:
    return f"{ALGORITHM}:{files_digest([file])}"


def write_checksums(path: str) -> None:
    """Record every file of the checkpoint at `path` (size and hash) in checksums.json, as saved: `check_checkpoint`
    compares them, so a file damaged afterwards -- even one of the same size -- is found before a resume reads it."""
    files = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            files[os.path.relpath(full, path)] = {"bytes": os.path.getsize(full), "hash": _hash(full)}
    with open(os.path.join(path, CHECKSUMS), "w") as f:
        json.dump(files, f, indent=0, sort_keys=True)


def _check_checksums(path: str) -> None:
    listed = os.path.join(path, CHECKSUMS)
    if not os.path.isfile(listed):
        if os.path.isfile(os.path.join(path, RECORD)):  # (written after checksums were: they went missing since)
            raise CheckpointError(f"checkpoint {path!r} is damaged: its {CHECKSUMS} is missing (every checkpoint "
                                  f"with a {RECORD} was written with one), so its files cannot be checked. Resume "
                                  f"from an earlier checkpoint.")
        return  # (a checkpoint written before checksums were kept)
    try:
        with open(listed) as f:
            files = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path!r} is damaged: its {CHECKSUMS} cannot be read ({e}). Resume from an "
                              f"earlier checkpoint.") from None
    if not isinstance(files, dict) or not all(
            isinstance(rel, str) and not os.path.isabs(rel) and not os.path.normpath(rel).startswith("..")
            and isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("hash"), str)
            for rel, v in files.items()):
        raise CheckpointError(f"checkpoint {path!r} is damaged: its {CHECKSUMS} is not a record of its files (each "
                              f"file of the checkpoint: bytes and hash). Resume from an earlier checkpoint.")
    # Weights re-saved in another layout (sharded, or whole again) load as the Trainer loads them: each file is then
    # checked as readable (`_weights_shapes`), not against the hashes of files that are no longer there.
    saved = {rel for rel in files if WEIGHT_NAME.match(rel)}
    now = {n for n in os.listdir(path) if WEIGHT_NAME.match(n)}
    relaid = saved != now and bool(now)
    for rel, want in files.items():
        if relaid and rel in saved:
            continue
        full = os.path.join(path, rel)
        size = os.path.getsize(full) if os.path.isfile(full) else None
        why = ("is missing" if size is None else f"has {size} bytes, {want['bytes']} when saved"
               if size != want["bytes"] else "differs from what was saved (its hash)"
               if _hash(full) != want["hash"] else None)
        if why:
            raise CheckpointError(f"checkpoint {path!r} is damaged: {rel} {why}. Resume from an earlier checkpoint.")
    if relaid:
        logger.warning("checkpoint %s: its weights are not the files saved with it (%s now, %s then): resumed from "
                       "them as the Trainer would; the rest of the checkpoint matches what was saved", path,
                       _names(now), _names(saved))


def _names(names: set) -> str:
    return ", ".join(sorted(names)[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def check_checkpoint(path: str, model=None) -> None:
    """Raise CheckpointError if `path` cannot be resumed from (incomplete, damaged, or another model's)."""
    # The Trainer's own words first where it has them ("Can't find a valid checkpoint at"): scripts match on them.
    if not os.path.isdir(path):
        raise CheckpointError(f"Can't find a valid checkpoint at {path}: the directory does not exist "
                              f"(resume_from_checkpoint: true picks the newest complete one in output_dir)")
    if any(CHECKPOINT_NAME.match(n) and os.path.isdir(os.path.join(path, n)) for n in os.listdir(path)):
        raise CheckpointError(f"Can't find a valid checkpoint at {path}: it is a run's output directory, not one of "
                              f"its checkpoints. Use resume_from_checkpoint: true (its newest complete checkpoint), "
                              f"or the path of one checkpoint-N in it.")
    _check_regular_files(path)
    _check_trainer_state(path)
    weights = [f for f in WEIGHT_FILES if os.path.exists(os.path.join(path, f))]
    if not weights:
        raise CheckpointError(f"Can't find a valid checkpoint at {path}: it is incomplete, no model weights "
                              f"({', '.join(WEIGHT_FILES)}). Resume from an earlier checkpoint.")
    shapes = _weights_shapes(path, weights[0])
    if shapes is not None and model is not None:
        _check_same_model(shapes, model, path)
    # Without these the Trainer resumes anyway -- with a fresh optimizer, a restarted schedule or other random
    # numbers -- and says nothing: a checkpoint lacking one is refused (and skipped by resume_from_checkpoint: true).
    opts = optimizer_files(path)
    rng = sorted(n for n in os.listdir(path) if _RNG.match(n))
    for label, files in (("optimizer state (optimizer.pt)", opts),
                         ("learning-rate schedule (scheduler.pt)", [os.path.join(path, "scheduler.pt")]),
                         ("random-number state (rng_state.pth)", [os.path.join(path, n) for n in rng])):
        if not files or not all(os.path.exists(f) for f in files):
            raise CheckpointError(f"checkpoint {path!r} is incomplete: its {label} is missing, so a resumed run would "
                                  f"not continue the same training. Resume from an earlier checkpoint.")
        for f in files:
            _check_archive(f, path)
    _check_hyperparameters(path)
    _check_checksums(path)


def _check_regular_files(path: str) -> None:
    """Every file of a checkpoint is a regular file (a link to one is read as it): a FIFO planted at a file's name
    made the resume hang on it, and the stop signal's message hang again looking for the last checkpoint."""
    import stat

    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            try:
                mode = os.stat(full).st_mode
            except OSError as e:  # (a dangling link)
                raise CheckpointError(f"checkpoint {path!r} is damaged: {os.path.relpath(full, path)} cannot be read "
                                      f"({e.strerror}). Resume from an earlier checkpoint.") from None
            if not stat.S_ISREG(mode):
                raise CheckpointError(f"checkpoint {path!r} holds {os.path.relpath(full, path)}, which is not a "
                                      f"regular file (a FIFO, a device or a socket): reading it would wait forever. "
                                      f"Remove it, or resume from an earlier checkpoint.")


def _check_hyperparameters(path: str) -> None:
    """The hyperparameters a checkpoint recorded (resume_changes.py reads them) must be readable, or absent (older)."""
    record = os.path.join(path, RECORD)
    if not os.path.exists(record):
        return
    try:
        with open(record) as f:
            ok = isinstance(json.load(f), dict)
    except (OSError, ValueError):
        ok = False
    if not ok:
        raise CheckpointError(f"checkpoint {path!r} is damaged: its {RECORD} is not a mapping of hyperparameters. "
                              f"Resume from an earlier checkpoint.")


def _check_trainer_state(path: str) -> None:
    try:
        with open(os.path.join(path, "trainer_state.json")) as f:
            state = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path!r} is incomplete or damaged: trainer_state.json unreadable "
                              f"({type(e).__name__}). Resume from an earlier checkpoint.") from None
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        raise CheckpointError(f"checkpoint {path!r} is damaged: trainer_state.json holds no global_step. Resume from "
                              f"an earlier checkpoint.")


def _check_archive(file: str, path: str) -> None:
    """torch.save's archive is a zip: a cut-short or emptied file has no central directory. And it loads as the resume
    will load it, weights only (memory-mapped: its tensors are not read): a pickle planted there, refused by that
    load, ran no code but ended the resume in a traceback."""
    import pickle

    import torch

    try:
        with zipfile.ZipFile(file) as z:
            z.namelist()
    except (zipfile.BadZipFile, OSError) as e:
        raise CheckpointError(f"checkpoint {path!r} is damaged: {os.path.basename(file)} is not a complete "
                              f"archive ({e}). Resume from an earlier checkpoint.") from None
    from transformers.trainer_pt_utils import safe_globals  # (numpy's RNG state: what the Trainer allows too)

    try:
        with safe_globals():
            torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        what = f"a call of {found.group(1)}" if found else "objects a weights-only load refuses"
        raise CheckpointError(f"checkpoint {path!r}: {os.path.basename(file)} holds {what}: not what a run saves "
                              f"there, and not loaded (nothing in it ran). Resume from a checkpoint you trust."
                              ) from None
    except (RuntimeError, EOFError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path!r} is damaged: {os.path.basename(file)} cannot be loaded "
                              f"({str(e).splitlines()[0][:160]}). Resume from an earlier checkpoint.") from None


def optimizer_shard_name(rank: int, world_size: int) -> str:
    """Data parallel: each rank saves the states it owns in its own file (one rank: optimizer.pt)."""
    return "optimizer.pt" if world_size == 1 else f"optimizer-rank{rank}-of-{world_size}.pt"


def optimizer_files(path: str) -> list[str]:
    """The optimizer state files of a checkpoint: optimizer.pt, or every rank's shard (all must be there)."""
    shards = sorted((int(m.group(1)), int(m.group(2)), name) for name in os.listdir(path)
                    if (m := _SHARD.match(name)))
    if shards:
        world = shards[0][1]
        if sorted(r for r, w, _ in shards if w == world) != list(range(world)) or len(shards) != world:
            raise CheckpointError(f"checkpoint {path!r} is incomplete: it holds optimizer shards "
                                  f"{[n for _, _, n in shards]}, not ranks 0..{world - 1} of {world}. Resume from an "
                                  f"earlier checkpoint.")
        return [os.path.join(path, n) for _, _, n in shards]
    single = os.path.join(path, "optimizer.pt")
    return [single] if os.path.exists(single) else []


def load_optimizer_states(path: str) -> dict | None:
    """The optimizer state of a checkpoint as one state dict (every rank's shard merged: each holds the states
    of the tensors its rank owned, under the same ids), memory-mapped so nothing is read twice into RAM. Any
    number of ranks can load it: each keeps what it owns (re-sharding)."""
    import torch

    files = optimizer_files(path)
    if not files:
        return None
    merged = None
    for f in files:
        sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        if merged is None:
            merged = sd
        else:
            merged["state"].update(sd["state"])
    return merged


def _weights_shapes(path: str, first: str) -> dict[str, tuple] | None:
    """The tensor shapes of a checkpoint's safetensors weights, whole or sharded (every shard its index names read:
    a missing, cut-short or garbled one is refused); None for pickled weights."""
    if not first.endswith((".safetensors", ".safetensors.index.json")):
        return None
    if first.endswith(".safetensors"):
        return _safetensors_shapes(os.path.join(path, first), path)
    try:
        shards = index_shards(os.path.join(path, first))
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path!r} is damaged: {e}. Resume from an earlier checkpoint.") from None
    shapes = {}
    for shard in shards:
        if not os.path.isfile(os.path.join(path, shard)):
            raise CheckpointError(f"checkpoint {path!r} is incomplete: {shard}, named by {first}, is missing. Resume "
                                  f"from an earlier checkpoint.")
        shapes.update(_safetensors_shapes(os.path.join(path, shard), path))
    return shapes


def _safetensors_shapes(file: str, path: str) -> dict[str, tuple]:
    from safetensors import safe_open

    try:
        with safe_open(file, "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise CheckpointError(f"checkpoint {path!r} is damaged: {os.path.basename(file)} cannot be read "
                              f"({str(e)[:120]}). Resume from an earlier checkpoint.") from None


def _check_same_model(saved: dict[str, tuple], model, path: str) -> None:
    saved_lora, lora_here = any("lora" in k for k in saved), hasattr(model, "get_base_model")
    if saved_lora != lora_here:  # (the names differ wholesale: "another number of layers?" misled)
        raise CheckpointError(
            f"checkpoint {path!r} was saved by a {'LoRA' if saved_lora else 'full finetune'} run (its weights are "
            f"{'adapters' if saved_lora else 'the whole model'}), and this run "
            f"{'trains LoRA adapters' if lora_here else 'is a full finetune'}: resume it "
            f"{'with the lora_r it trained with' if saved_lora else 'without lora_r'}, or start this run in another "
            f"output_dir without resume_from_checkpoint.")
    inner = model  # (a LoRA model against adapters: names as peft saves them, both sides)
    # Parameters only: what the optimizer's states belong to must match; buffers are the model's own business (a
    # model may grow one and accept it in its load_state_dict), left to the load itself.
    ours = {k: tuple(v.shape) for k, v in inner.named_parameters()}
    for k, shape in saved.items():
        if k in ours and ours[k] != shape:
            raise CheckpointError(f"checkpoint {path!r} is from a different model: {k} has shape {shape} there "
                                  f"but {ours[k]} here. Use the model_config / model_name_or_path it was trained "
                                  f"with, or start without resume_from_checkpoint.")
    common = set(saved) & set(ours)
    if saved and not common:
        raise CheckpointError(f"checkpoint {path!r} is from a different model: none of its {len(saved)} tensor "
                              f"names exist here (e.g. {next(iter(saved))!r}).")
    if saved_lora:  # (adapters: their names are peft's business)
        return
    buffers = {k for k, _ in inner.named_buffers()}  # (a buffer is the model's own business, see above)
    only_saved = sorted(k for k in set(saved) - set(ours) - buffers if k.endswith((".weight", ".bias")))
    only_ours = sorted(k for k, v in inner.named_parameters() if v.requires_grad and k not in saved)
    if only_saved or only_ours:  # e.g. another number of layers: the load would fail, or leave layers untrained
        k, where = (only_saved[0], "here") if only_saved else (only_ours[0], "in the checkpoint")
        raise CheckpointError(f"checkpoint {path!r} is from a different model: {len(only_saved or only_ours)} "
                              f"tensors are not {where} (e.g. {k!r}; another number of layers?). Use the "
                              f"model_config / model_name_or_path it was trained with, or start without "
                              f"resume_from_checkpoint.")


def newest_complete_checkpoint(run_dir: str, model=None) -> str | None:
    """The checkpoint-N with the largest N that passes `check_checkpoint` (damaged ones are skipped, logged)."""
    return newest_checkpoint_and_why(run_dir, model)[0]


def newest_checkpoint_and_why(run_dir: str, model=None) -> tuple[str | None, CheckpointError | None]:
    """`newest_complete_checkpoint`, and why the newest checkpoint was skipped (None: it was not, or there is
    none)."""
    if not os.path.isdir(run_dir):
        return None, None
    why = None
    for name in reversed(checkpoint_steps(run_dir)):
        path = os.path.join(run_dir, name)
        try:
            check_checkpoint(path, model)
            return path, why
        except CheckpointError as e:
            logger.warning("skipping %s: %s", name, e)
            why = why or e
    return None, why
