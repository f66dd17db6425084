"""One hash of files' bytes, for the checkpoints' checksums and the data cache's content key: xxh3 (xxhash, which
datasets depends on), ~10 GB/s, read in 16 MiB blocks."""
from __future__ import annotations

import os

ALGORITHM = "xxh3_128"


def files_digest(files: list[str], root: str | None = None) -> str:
    """The hash of `files`' bytes in order; with `root`, each file's path relative to it too (a renamed file
    changes it)."""
    import xxhash

    h = xxhash.xxh3_128()
    for file in files:
        if root is not None:
            h.update(os.path.relpath(file, root).encode())
        with open(file, "rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
    return h.hexdigest()
