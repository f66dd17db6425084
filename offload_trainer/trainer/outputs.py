"""The run's output directory: one run at a time, writable, with room for what the run writes, and saves that never
leave a complete-looking half.

- `OutputLock`: an advisory `flock` on `output_dir/.offload-trainer.lock`, held while a run trains. A second run on the
  same directory is refused at once (`OutputBusy`); the kernel drops the lock when its process dies, even by SIGKILL.
- `check_writable`: a probe file written and removed before any weights load, so a read-only or foreign directory
  is reported in a second, not at the first checkpoint after hours of training.
- `check_space` / `disk_full`: free space against the bytes a save will write; and the test whether an exception
  raised by a writer means the disk filled (torch.save raises RuntimeError, safetensors its own error, not always
  OSError(ENOSPC)).
- `publish` / `publish_into`: the one way anything is saved (checkpoints and final outputs): written into a
  staging directory, flushed to disk (fsync), then renamed into place -- a directory whole, or file by file into
  output_dir -- so a kill or a full disk never leaves a complete-looking half. `staged_save` wraps a save in it.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil

from ..errors import OutputBusy, StorageError
from . import manifest

logger = logging.getLogger("offload_trainer")

LOCK_NAME = ".offload-trainer.lock"
STAGING_PREFIX = ".partial-"  # staging/.partial-checkpoint-N/checkpoint-N while it is written
STAGING_FINAL = ".partial-save"  # + "-<pid>": a run's final save and `report`'s plots never share one
# the longest name a run writes under output_dir, with room to spare: a checkpoint's staging copy of a rank's
# optimizer shard, `.partial-checkpoint-1000000/checkpoint-1000000/optimizer-rank15-of-16.pt` (63)
DEEPEST_NAME = 100
_FULL_WORDS = ("no space left", "file write failed", "disk quota", "enospc")


class OutputLock:
    """Exclusive lock of a run's output_dir; re-entrant within one process (the command locks before loading the
    model, the Trainer again in train())."""

    _held: dict[str, list] = {}  # realpath -> [fd, count]

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self.path = os.path.join(os.path.realpath(output_dir), LOCK_NAME)

    def __enter__(self) -> "OutputLock":
        held = self._held.get(self.path)
        if held is not None:
            held[1] += 1
            return self
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = self._take(open_no_follow(self.path, os.O_RDWR | os.O_CREAT, 0o644))
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._held[self.path] = [fd, 1]
        return self

    def probe(self) -> None:
        """OutputBusy if another process holds the lock now (nothing is created or kept)."""
        if self.path in self._held or not os.path.exists(self.path):
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # (gone, or a link planted there: not a lock anyone holds)
            return
        os.close(self._take(fd))  # (taken and dropped at once; on failure _take has closed it)

    def _take(self, fd: int) -> int:
        import fcntl

        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise OutputBusy(f"output_dir {self.output_dir!r} is in use by another run (pid {holder}): two runs "
                             f"writing there would interleave their checkpoints. Wait for it to end, or choose "
                             f"another output_dir.") from None
        return fd

    def __exit__(self, *exc) -> None:
        held = self._held[self.path]
        held[1] -= 1
        if held[1]:
            return
        del self._held[self.path]
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # (while still held: a new run creates and locks a new file)
        os.close(held[0])


def open_no_follow(path: str, flags: int, mode: int = 0o644) -> int:
    """`os.open` of a file of ours in output_dir, never through a link planted there (a shared or /tmp directory):
    a link or a stale file of that name is removed and the file made anew. Our names only (the lock, the probe)."""
    flags |= os.O_NOFOLLOW
    try:
        return os.open(path, flags, mode)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.EEXIST):
            raise
    os.unlink(path)  # (the link itself, not what it points to)
    return os.open(path, flags | os.O_EXCL, mode)


def check_output_dir(output_dir: str) -> None:
    """Raise StorageError unless `output_dir` is (or can be made) a directory this process can write."""
    if not output_dir or not str(output_dir).strip():
        raise StorageError("output_dir is empty: name the directory the run writes to, e.g. output_dir: outputs/run")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise StorageError(f"output_dir {output_dir!r} is a file, not a directory: choose another output_dir or "
                           f"move the file away")
    longest = len(os.path.abspath(output_dir)) + DEEPEST_NAME
    try:
        path_max = os.pathconf(free_path(output_dir), "PC_PATH_MAX")
    except (OSError, ValueError):
        path_max = 4096
    if longest > path_max:
        raise StorageError(f"output_dir is {len(os.path.abspath(output_dir))} characters long: the files a run writes "
                           f"inside it (a checkpoint's staging copy, e.g. .partial-checkpoint-N/checkpoint-N/"
                           f"optimizer.pt) would pass this system's limit of {path_max} characters for a path, at the "
                           f"first checkpoint. Choose a shorter output_dir -- checked before loading anything.")
    probe = os.path.join(output_dir, f".write-probe-{os.getpid()}")
    try:
        os.makedirs(output_dir, exist_ok=True)
        fd = open_no_follow(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as e:
        reason = {errno.EROFS: "the filesystem is read-only", errno.EACCES: "permission denied",
                  errno.EPERM: "permission denied", errno.ENOSPC: "the disk is full"}.get(e.errno, e.strerror)
        raise StorageError(f"cannot write to output_dir {output_dir!r}: {reason}. Choose an output_dir you can write "
                           f"to (or fix its permissions) -- checked before loading anything, so no training is lost."
                           ) from None


def free_path(path: str) -> str:
    """`path`, or its nearest ancestor that exists."""
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe) or "."
    return probe


def free_bytes(path: str) -> int:
    return shutil.disk_usage(free_path(path)).free


def check_space(path: str, need_bytes: int, what: str) -> None:
    """Raise StorageError when the filesystem of `path` has less than `need_bytes` free for `what`."""
    free = free_bytes(path)
    if free < need_bytes:
        raise StorageError(f"not enough disk in {path!r} for {what}: it needs about {need_bytes / 2**30:.2f} GiB, "
                           f"{free / 2**30:.2f} GiB are free. Free some space or point output_dir elsewhere.")


def _chain(exc: BaseException | None):
    """`exc` and the exceptions it was raised from or during, outermost first."""
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def disk_full(exc: BaseException, path: str) -> bool:
    """Whether `exc`, raised while writing under `path`, means the disk is full."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(w in str(e).lower() for w in _FULL_WORDS):
            return True
    with contextlib.suppress(OSError):
        return free_bytes(path) < 2**20  # a writer's own wording: what the disk says
    return False


def storage_limit(exc: BaseException, path: str) -> str | None:
    """What stopped a writer under `path`, said for the user: a full disk, or the shell's file-size limit (`ulimit
    -f`: the write fails with EFBIG, Python ignoring the SIGXFSZ that would kill it); None for anything else."""
    if any(isinstance(e, OSError) and e.errno == errno.EFBIG or "file too large" in str(e).lower()
           for e in _chain(exc)):
        return "over the file-size limit (ulimit -f)"
    return "out of disk space" if disk_full(exc, path) else None


def fsync_tree(path: str) -> None:
    """Flush every file under `path` and the directories themselves to disk."""
    for root, dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems do not sync directories
        pass
    finally:
        os.close(fd)


def remove_staging(path: str) -> None:
    """Remove what stands at a staging name: a directory's tree, or a link or file there -- the link itself, never
    what it points to (a link planted at `.partial-save` made the save fail: rmtree refuses links, makedirs found it)."""
    if os.path.islink(path) or os.path.isfile(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def publish(staged: str, final: str) -> None:
    """Atomically make the complete directory `staged` appear as `final` (replacing an older one): flushed to disk
    first, so what appears is complete after a power loss too. `final`'s name is recorded first (manifest.py)."""
    fsync_tree(staged)
    parent = os.path.dirname(final)
    manifest.record(parent, [os.path.basename(final)])
    old = None
    if os.path.exists(final):  # rename() cannot replace a non-empty directory: move the old one aside first
        old = os.path.join(parent, STAGING_PREFIX + "old-" + os.path.basename(final))
        remove_staging(old)
        os.rename(final, old)
    os.rename(staged, final)
    fsync_dir(parent)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def publish_into(staged: str, dest: str) -> None:
    """Every file under `staged` renamed into the same place under `dest` (replacing those of the same name), each
    flushed to disk first: output_dir holds other things (checkpoints), so it cannot be replaced whole. The top-level
    names are recorded first (manifest.py)."""
    fsync_tree(staged)
    os.makedirs(dest, exist_ok=True)
    manifest.record(dest, os.listdir(staged))
    for root, dirs, files in os.walk(staged):
        target = os.path.normpath(os.path.join(dest, os.path.relpath(root, staged)))
        os.makedirs(target, exist_ok=True)
        for name in files:
            os.replace(os.path.join(root, name), os.path.join(target, name))
        fsync_dir(target)


def _remove_dead_saves(output_dir: str) -> None:
    """What a killed save left (`.partial-save-<pid>` of a process that is gone); a live one is another process's
    save in progress (`report` beside a run) and stays."""
    for name in os.listdir(output_dir):
        if not name.startswith(STAGING_FINAL):
            continue
        pid = name[len(STAGING_FINAL) + 1:]
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                os.kill(int(pid), 0)
                continue  # (alive)
            except ProcessLookupError:
                pass
            except PermissionError:  # (alive, another user's)
                continue
        remove_staging(os.path.join(output_dir, name))


@contextlib.contextmanager
def staged_save(output_dir: str, what: str):
    """Yield a staging directory to save into; when the block completes, its files are moved into `output_dir`
    (replacing those of the same name), so a save cut short leaves only the staging directory, removed here or by the
    next run -- never a half-written model beside a config that looks complete. A full disk becomes StorageError."""
    staging = os.path.join(output_dir, f"{STAGING_FINAL}-{os.getpid()}")
    existed = os.path.isdir(output_dir)
    if existed:
        _remove_dead_saves(output_dir)
    remove_staging(staging)
    os.makedirs(staging)
    try:
        yield staging
        publish_into(staging, output_dir)
    except Exception as e:
        remove_staging(staging)
        if not existed:  # (made for this save: nothing of it stays)
            with contextlib.suppress(OSError):
                os.rmdir(output_dir)
        why = storage_limit(e, output_dir)
        if why:
            raise StorageError(f"{why} while writing {what} to {output_dir!r} "
                               f"({free_bytes(output_dir) / 2**30:.2f} GiB free); nothing of it was kept. Free some "
                               f"space (or raise the limit) and save again (checkpoints, if any, are intact)."
                               ) from None
        raise
    finally:
        remove_staging(staging)
