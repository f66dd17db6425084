"""Where training data comes from, loaded with `datasets` (memory-mapped Arrow, its cache reused between runs):
the built-in corpora, local files (.txt, .jsonl / .json, .parquet, .csv, .arrow; the text ones may be compressed:
.gz, .bz2, .xz), a directory written by `save_to_disk` or holding data files, and Hub datasets by name (offline from
the HF cache). Every failure is one sentence naming the dataset, the split or the line."""
from __future__ import annotations

import bz2
import contextlib
import gzip
import json
import logging
import lzma
import os
import re
from importlib import resources

from ..digest import files_digest
from ..errors import DataError


def builtin_asset(name: str) -> str:
    """Path of a file shipped in offload_trainer/assets (the built-in corpus and tokenizer)."""
    return str(resources.files("offload_trainer") / "assets" / name)


BUILTIN = {"builtin": "corpus.txt", "builtin-sft": "sft.jsonl"}
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv",
            ".arrow": "arrow"}
# Compression that datasets undoes as it reads a data file (Python's own codecs), and how to open it here.
COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
DAMAGED = (OSError, EOFError, lzma.LZMAError)  # what reading a damaged compressed file raises


def data_ext(path: str) -> str:
    """A data file's kind, under any compression suffix: `d.jsonl.gz` -> `.jsonl`."""
    root, ext = os.path.splitext(path.lower())
    return os.path.splitext(root)[1] if ext in COMPRESSED else ext


def _open_bytes(path: str):
    """A data file's bytes, decompressed."""
    return COMPRESSED.get(os.path.splitext(path.lower())[1], open)(path, "rb")


def resolve(name: str) -> str:
    return builtin_asset(BUILTIN[name]) if name in BUILTIN else os.path.expanduser(name)


def looks_local(name: str) -> bool:
    """A path (or a built-in name) rather than a Hub id such as `tatsu-lab/alpaca`."""
    return (name in BUILTIN or name.startswith((".", "/", "~")) or os.path.exists(os.path.expanduser(name))
            or name.count("/") > 1 or data_ext(name) in BUILDERS)


def check_source(name: str) -> None:
    """Fail before any model is loaded when a local dataset is missing or of an unknown kind."""
    if name == "random" or name in BUILTIN or not looks_local(name):
        return
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        _refuse_special_files(name, [os.path.join(root, f) for root, _, names in os.walk(path) for f in names
                                     if data_ext(f) in BUILDERS])
        kinds = sorted({BUILDERS[e] for f in os.listdir(path) if (e := data_ext(f)) in BUILDERS})
        if len(kinds) > 1:  # (datasets would read one kind and drop the others without a word)
            raise DataError(f"dataset_path: directory {name!r} holds data files of several kinds ({', '.join(kinds)}): "
                            f"one kind is read, the others would be left out. Keep one kind in it, or name one "
                            f"file")
        return
    if not os.path.exists(path):
        raise DataError(f"dataset_path: {name!r} does not exist (use a .txt, .jsonl, .json, .parquet, .csv or .arrow "
                        f"file, a directory of them or one written by save_to_disk, a Hub dataset name, 'builtin', "
                        f"'builtin-sft' or 'random')")
    _refuse_special_files(name, [path])
    if data_ext(path) not in BUILDERS:
        raise DataError(f"dataset_path: {name!r} is none of {', '.join(BUILDERS)} (each may be compressed: "
                        f"{', '.join(COMPRESSED)}): convert it, or name its format with dataset_kwargs (e.g. "
                        f"{{builder: json}})")
    if not os.access(path, os.R_OK):
        raise DataError(f"dataset_path: {name!r} cannot be read (permission denied)")
    _check_utf8_family(path, name)
    if BUILDERS[data_ext(path)] == "json":
        _check_json_depth(path, name)
    if BUILDERS[data_ext(path)] == "csv":
        _check_csv_header(path, name)


# byte-order marks of the encodings Windows tools save "Unicode" text in; UTF-8's own (EF BB BF) is read as UTF-8
_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
         (b"\xfe\xff", "UTF-16"))


def _check_utf8_family(path: str, name: str) -> None:
    """A text data file in UTF-16 or UTF-32 (a byte-order mark, or the NUL bytes every ASCII character of them
    holds): datasets read it as UTF-8 and failed on a line it named, with a hint about JSON or columns."""
    if data_ext(path) not in (".txt", ".jsonl", ".json", ".csv"):
        return
    try:
        with _open_bytes(path) as f:
            head = f.read(1 << 12)
    except DAMAGED:
        return  # (the reader says so)
    enc = next((e for bom, e in _BOMS if head.startswith(bom)), "UTF-16 or UTF-32" if b"\x00" in head else None)
    if enc is not None:
        raise DataError(f"dataset_path: {name!r} is {enc} text, not UTF-8: save the data as UTF-8 (e.g. iconv -f "
                        f"{enc.split()[0]} -t UTF-8 FILE > NEW)")


MAX_JSON_DEPTH = 1000  # levels of nested lists and objects a JSON data file may hold (a record: a few)


def _check_json_depth(path: str, name: str) -> None:
    """A JSON value nested thousands deep (`[[[[...`) crashed the Arrow reader (a segfault: exit 139, no word). JSON
    Lines: a line with fewer brackets than the limit cannot be nested that deep (counted in C: `bytes.count`), and
    only a line with more is scanned; a JSON document is scanned whole, chunk by chunk."""
    try:
        f = _open_bytes(path)
    except DAMAGED:
        return
    with f:
        if data_ext(path) == ".jsonl":
            depths = (_json_depth([line]) for line in f if line.count(b"[") + line.count(b"{") > MAX_JSON_DEPTH)
        else:
            depths = [_json_depth(iter(lambda: f.read(1 << 23), b""))]
        if any(d > MAX_JSON_DEPTH for d in depths):
            raise DataError(f"dataset_path: {name!r} holds a JSON value nested more than {MAX_JSON_DEPTH} levels deep "
                            f"(lists or objects inside each other): the Arrow reader crashes on such input. Flatten it "
                            f"(a record is a few levels deep)")


def _json_depth(blocks) -> int:
    """The deepest nesting of brackets outside strings in the JSON text of `blocks` (bytes), vectorised: quotes not
    escaped by an odd run of backslashes, a string's inside from the quotes' parity. Carried from block to block: the
    depth, whether a string is open, the parity of the backslashes a block ends with."""
    import numpy as np

    deepest = depth = in_string = carry = 0
    for block in blocks:
        a = np.frombuffer(block, dtype=np.uint8)
        idx = np.arange(a.size, dtype=np.int32)
        last_other = np.maximum.accumulate(np.where(a == 92, -1, idx))  # the last non-backslash at or before i
        run = np.empty(a.size, dtype=np.int32)  # the backslashes right before i
        run[0] = carry
        run[1:] = np.where(last_other[:-1] < 0, idx[1:] + carry, idx[:-1] - last_other[:-1])
        quote = (a == 34) & (run % 2 == 0)
        inside = (np.cumsum(quote, dtype=np.int32) + in_string) % 2 == 1
        step = ((a == 91) | (a == 123)).astype(np.int32) - ((a == 93) | (a == 125))
        step[inside] = 0
        levels = depth + np.cumsum(step, dtype=np.int32)
        deepest = max(deepest, int(levels.max()))
        depth, in_string = int(levels[-1]), int((in_string + np.count_nonzero(quote)) % 2)
        carry = (carry + a.size) % 2 if last_other[-1] < 0 else (a.size - 1 - int(last_other[-1])) % 2
    return deepest


def _refuse_special_files(name: str, files: list[str]) -> None:
    """Data is read from regular files only: a FIFO waits for a writer forever (the run hung before a word), a
    device reads without end."""
    import stat

    for f in files:
        if not stat.S_ISREG(os.stat(f).st_mode):
            raise DataError(f"dataset_path: {name!r}: {f} is not a regular file (a FIFO, a device or a socket): "
                            f"reading it would wait forever or never end. Copy the data into a file")


def _check_csv_header(path: str, name: str) -> None:
    """A CSV header that names a column twice: pandas (datasets' reader) renames the second `text.1`, so the rows
    would train on the first column only, without a word."""
    import csv
    import io

    try:
        with io.TextIOWrapper(_open_bytes(path), newline="", encoding="utf-8-sig") as f:
            header = next(csv.reader(f), [])
    except (UnicodeDecodeError, csv.Error, *DAMAGED):
        return  # (the reader says what is wrong with it, with the line)
    seen = set()
    for col in header:
        if col in seen:
            raise DataError(f"dataset_path: {name!r}: its header names the column {col!r} twice; the second would be "
                            f"renamed and left out. Give each column its own name")
        seen.add(col)


def _known_by(ds, digest: str | None):
    """`ds` fingerprinted by its source's content too (the tokenized and packed rows are cached under it)."""
    if digest and hasattr(ds, "_fingerprint"):
        ds._fingerprint = f"{ds._fingerprint}-{digest[:16]}"
    return ds


def content_digest(path: str) -> str:
    """A hash of the local data's content (a file, or a directory's data files). datasets knows a file by its path
    and modification time, so a file rewritten with its old time (a copy with -p, a restored backup) was read from
    the stale cache; its cache directory and the rows' fingerprint are named by this too. Reads the data once per
    run (xxh3: ~10 GB/s)."""
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(root, f) for root, _, names in os.walk(path) for f in names
        if data_ext(f) in BUILDERS)
    return files_digest(files, root=path)


def _cached_by_content(kwargs: dict, path: str) -> str:
    """`path`'s content digest, with load_dataset's cache directory named by it (unless the user gave one)."""
    import datasets

    digest = content_digest(path)
    kwargs.setdefault("cache_dir", os.path.join(datasets.config.HF_DATASETS_CACHE, "offload_trainer", "sources",
                                                digest))
    return digest


@contextlib.contextmanager
def _readers_quiet():
    """datasets' file readers log a failure (`Failed to read ...`) before raising it, twice on the console (their own
    handler and ours): `load` turns what they raise into one sentence that quotes it, so their log says it once more
    before that. Their warnings still pass."""
    readers = logging.getLogger("datasets.packaged_modules")
    level = readers.level
    readers.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        readers.setLevel(level)


def load(data_args, *, split: str):
    """The raw dataset of one split: a `datasets.Dataset`, or an `IterableDataset` with `streaming`."""
    with _readers_quiet():
        return _load(data_args, split=split)


def _load(data_args, *, split: str):
    import datasets

    name = data_args.dataset_path
    kwargs = dict(data_args.dataset_kwargs or {})
    builder = kwargs.pop("builder", None)
    streaming = data_args.streaming
    path = resolve(name)
    if builder is not None and looks_local(name) and os.path.exists(path):
        from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES as readers

        if builder not in readers:
            raise DataError(f"dataset_kwargs: builder {builder!r} is none of datasets' readers "
                            f"({', '.join(sorted(readers))}); a file of a known kind needs none")
    try:
        if looks_local(name) and os.path.isdir(path) and _saved_to_disk(path):
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                ds = _split_of(ds, split, name)
            return ds.to_iterable_dataset() if streaming else ds
        if looks_local(name) and os.path.isfile(path):
            if split != "train":
                raise DataError(f"dataset {name!r} has no split {split!r}; it has train (a file is one split: name "
                                f"another file, or use eval_fraction)")
            if _blank(path):
                raise DataError(f"dataset {name!r}: no records (the file is empty); add text lines or JSON records")
            builder = builder or BUILDERS[data_ext(path)]
            if builder == "text":
                kwargs.setdefault("encoding", "utf-8-sig")  # (a byte-order mark is not text)
            digest = None if streaming else _cached_by_content(kwargs, path)
            ds = datasets.load_dataset(builder, data_files={"train": path}, split="train", streaming=streaming,
                                       **kwargs)
            return _known_by(ds, digest)
        target = builder or path  # a directory of data files, or a Hub name (offline: from the HF cache)
        local_dir = looks_local(name) and os.path.isdir(path) and not streaming
        digest = _cached_by_content(kwargs, path) if local_dir else None
        found = datasets.load_dataset(target, data_args.dataset_config, streaming=streaming, **kwargs)
        return _known_by(_split_of(found, split, name), digest)
    except DataError:
        raise
    except UnicodeDecodeError as e:
        raise not_utf8(name, e) from None
    except TypeError as e:
        key = re.search(r"unexpected keyword argument '([^']*)'", str(e))
        if key is None:
            raise
        reader = builder or BUILDERS.get(data_ext(path), "its")
        raise DataError(f"dataset_kwargs: {key.group(1)!r} is not an option of the {reader} reader "
                        f"of {name!r} (its options are those of the `datasets` reader's config, e.g. json's field, "
                        f"csv's sep)") from None
    except (datasets.exceptions.DatasetGenerationError, ValueError) as e:
        if "field" in kwargs and cause_of(e, KeyError) is not None:
            raise DataError(f"dataset {name!r}: no key {kwargs['field']!r} at the top of the JSON (dataset_kwargs: "
                            f"field names the key that holds the records)") from None
        json_file = os.path.isfile(path) and data_ext(path) in (".jsonl", ".json")
        line = _first_bad_line(path, "json") if json_file else None
        if line is not None:
            raise DataError(f"{name}:{line[0]}: not valid JSON ({line[1]}); each line must be one JSON object") from None
        hint = (" (the data files of a directory are read as one table: they must have the same columns; or name "
                "one file)" if os.path.isdir(path) else "")
        raise DataError(f"dataset {name!r} cannot be loaded: {_first_line(e)}{hint}") from None
    except (FileNotFoundError, ConnectionError, *DAMAGED) as e:
        hint = ("" if looks_local(name) else " A Hub dataset needs the network, or a copy in the HF datasets cache "
                "(HF_DATASETS_OFFLINE=1 reads only that).")
        # (a Hub dataset offline: datasets' own words say so; the cause under them, "not cached in None", does not)
        reason = str(e).strip().splitlines()[0] if isinstance(e, ConnectionError) and str(e).strip() else \
            _first_line(e)
        raise DataError(f"dataset {name!r} cannot be loaded: {reason.rstrip('.')}.{hint}") from None


def not_utf8(name: str, e: UnicodeDecodeError) -> DataError:
    """The DataError for data that is not UTF-8 (found while loading, or by the Arrow reader while tokenizing)."""
    path = resolve(name)
    line = _first_bad_line(path, "utf8") if os.path.isfile(path) else None
    return DataError(f"{_where(name, path, line)}: not UTF-8 text ({e.reason}); save the data as UTF-8")


def _split_of(found, split: str, name: str):
    if not hasattr(found, "keys"):
        return found
    if split not in found:
        raise DataError(f"dataset {name!r} has no split {split!r}; it has {', '.join(found.keys())} (set "
                        f"dataset_train_split / dataset_test_split)")
    return found[split]




def _blank(path: str) -> bool:
    """A file with nothing but white space (datasets' readers fail on it with a bare StopIteration)."""
    try:
        with _open_bytes(path) as f:
            head, more = f.read(1 << 16), f.read(1)
    except DAMAGED:
        return False  # (the reader says so)
    return not head.strip(b" \t\r\n\xef\xbb\xbf") and not more


def _saved_to_disk(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f)) for f in ("dataset_info.json", "state.json", "dataset_dict.json"))


def _first_bad_line(path: str, kind: str):
    """(line number, reason) of the first line that is not valid UTF-8 (kind 'utf8') or not a JSON object."""
    try:
        with _open_bytes(path) as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    if kind == "utf8":
                        return lineno, e.reason
                    continue
                if kind == "json" and text.strip():
                    try:
                        rec = json.loads(text)
                    except json.JSONDecodeError as e:
                        return lineno, e.msg
                    if not isinstance(rec, dict):
                        return lineno, f"a JSON {type(rec).__name__}, not an object"
    except DAMAGED:
        return None
    return None


def _where(name: str, path: str, line) -> str:
    return f"{name}:{line[0]}" if line else name


def cause_of(e: BaseException, kind: type) -> BaseException | None:
    """The exception of `kind` that `e` is, or was raised from or while handling."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    cause = e.__cause__ or e.__context__
    if cause is not None and str(cause).strip():
        text = str(cause).strip()
    return (text.splitlines() or [type(e).__name__])[0][:300]
