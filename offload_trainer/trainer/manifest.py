"""The record of what our runs wrote into a directory (`output_dir/.offload-trainer-files.json`): the names of the
files and directories a save published there, added before each is renamed into place. overwrite_output_dir,
checkpoint rotation and a merge's re-write replace or remove only recorded names; anything else there is the user's
and is left alone (cli/earlier_run.py, staging.rotate). A directory without a record was written by an earlier
version, by the Python class alone (a drop-in for the Trainer: it adds no file of its own) or by none of ours: None,
and the callers read it as the Trainer would.

The command keeps a record in its output_dir (`kept`, around the run), and `merge` in its --out: the file is
written with the first name a save adds there (`record`), so a run refused before it saves leaves none, and from then
on every save adds its names.

The record is read and rewritten under an advisory lock on the directory itself (`report` may publish its plots while
a run publishes a checkpoint), written to a temporary name and renamed over the old one: never through a link planted
at its name, and never half-written."""
from __future__ import annotations

import contextlib
import json
import os
import stat

MANIFEST_NAME = ".offload-trainer-files.json"
_TEMP = ".partial-files-"  # (a STAGING_PREFIX name: what a killed write leaves is cleaned with the staging)


def read(directory: str) -> set[str] | None:
    """The names recorded in `directory`; None where there is no record (or a link or something not a regular file
    stands at its name, or it cannot be parsed: not a record of ours)."""
    try:
        fd = os.open(os.path.join(directory, MANIFEST_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            names = json.load(f).get("names")
        except (ValueError, AttributeError, UnicodeDecodeError):
            return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return None
    return set(names)


_KEPT: dict[str, set[str]] = {}  # realpath -> the names already ours there, until the record's first write


@contextlib.contextmanager
def kept(directory: str, names=()):
    """Within: a record is kept in `directory` (`names`: what is ours there already, written with the first name a
    save records); one that exists is extended either way."""
    key = os.path.realpath(directory)
    _KEPT[key] = _entries(names)
    try:
        yield
    finally:
        _KEPT.pop(key, None)


def record(directory: str, names) -> None:
    """Add `names` (entries of `directory`, not paths) to its record: one that exists, or one `kept` asks for."""
    names = _entries(names)
    if not names:
        return
    with _locked(directory):
        known = read(directory)
        if known is None:
            known = _KEPT.get(os.path.realpath(directory))
            if known is None:
                return  # (the Python class alone: the Trainer's own files, nothing added)
        elif names <= known:
            return
        _write(directory, known | names)


def _entries(names) -> set[str]:
    return {n for n in names if n and n != MANIFEST_NAME and os.sep not in n}


def forget(directory: str, names) -> None:
    """Drop `names` from the record (they were removed)."""
    with _locked(directory):
        known = read(directory)
        if known is not None and known & set(names):
            _write(directory, known - set(names))


def _write(directory: str, names: set[str]) -> None:
    tmp = os.path.join(directory, f"{_TEMP}{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # (the name itself: a link planted there is removed, never followed)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump({"written_by": "offload_trainer", "names": sorted(names)}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, MANIFEST_NAME))


@contextlib.contextmanager
def _locked(directory: str):
    import fcntl

    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (drops the lock)
