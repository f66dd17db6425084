"""Training data for the command, on `datasets`: sources (sources.py), formats and labels (formats.py), packing
(packing.py). `build_datasets` returns (train, eval or None), tokenized in parallel (`dataset_num_proc`) and cached
under the HF datasets cache: a second run, a resume or another rank reads the cache instead of tokenizing again.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os

import torch

from ..errors import DataError
from .formats import (IGNORE_INDEX, PROBE_RECORDS, ROW, Tokenize, check_template_limits, detect_format,
                      has_generation_markers, say_untrained, tokenize_batch)
from .packing import STATS, STRATEGIES, PaddingCollator, pack_batch, truncate_batch
from .sources import BUILTIN, cause_of, check_source, load, not_utf8, resolve
from .vision import ImageTextCollator, ImageTextRecords, RandomImageText, build_processor

__all__ = ["IGNORE_INDEX", "DataError", "build_datasets", "build_image_text", "build_processor", "data_collator",
           "random_dataset", "check_dataset_path", "PaddingCollator", "STRATEGIES", "BUILTIN", "resolve"]

logger = logging.getLogger("offload_trainer")
check_dataset_path = check_source


class RandomTokens(torch.utils.data.Dataset):
    """Fixed-length rows of random tokens (benchmarks): input_ids, labels, position_ids."""

    def __init__(self, vocab_size: int, seq_len: int, num_samples: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab_size, (num_samples, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone(), "attention_mask": torch.ones_like(self.ids[i])}


def random_dataset(vocab_size: int, seq_len: int, num_samples: int, seed: int = 0) -> RandomTokens:
    return RandomTokens(vocab_size, seq_len, num_samples, seed)


def data_collator(data_args, tokenizer, processor=None, records=None):
    """The collator for build_datasets' rows: packed rows are all max_seq_length long (stacking them is all there is
    to do); unpacked rows are padded per batch; image-text records are rendered and their images opened per batch."""
    from transformers import default_data_collator

    if processor is not None and isinstance(records, ImageTextRecords):
        return ImageTextCollator(processor, records, max_length=data_args.max_seq_length)
    return default_data_collator if data_args.packing or data_args.dataset_path == "random" else \
        PaddingCollator(tokenizer.pad_token_id)


def build_image_text(data_args, *, config, seed: int = 0, dtype=torch.float32):
    """(train, eval or None) of image-text records for a vision-language model (vision.py), or random rows."""
    if data_args.dataset_path == "random":
        return RandomImageText(config, data_args.max_seq_length, data_args.random_num_samples, seed, dtype), None
    train_raw, eval_raw = _splits(data_args, seed)
    name = data_args.dataset_path
    if "messages" not in _columns(train_raw):
        raise DataError(f"dataset {name!r}: a vision-language model trains on image-text records: 'messages' whose "
                        f"content holds {{\"type\": \"image\"}} parts, and 'images'; these have columns "
                        f"{sorted(_columns(train_raw))}")
    path = resolve(name)
    root = os.path.dirname(os.path.abspath(path)) if os.path.isfile(path) else (path if os.path.isdir(path) else "")
    train = ImageTextRecords(train_raw, f"{name} ({data_args.dataset_train_split})", root)
    return train, None if eval_raw is None else ImageTextRecords(eval_raw, f"{name} (eval)", root)


def build_datasets(data_args, tokenizer, *, vocab_size: int, seed: int = 0, main_process_first=None):
    """(train, eval or None). `main_process_first`: a context (the Trainer arguments' `main_process_first`) inside
    which rank 0 tokenizes while the other ranks wait, then read its cache."""
    seq = data_args.max_seq_length
    if data_args.dataset_path == "random":
        return random_dataset(vocab_size, seq, data_args.random_num_samples, seed), None
    max_len = getattr(tokenizer, "model_max_length", None)
    if max_len and max_len < 10**9 and seq > max_len:  # checked before tokenizing anything
        raise DataError(f"max_seq_length={seq} is longer than the tokenizer/model allows ({max_len}); "
                        f"use max_seq_length <= {max_len}")
    if data_args.chat_template:
        tokenizer.chat_template = _template(data_args.chat_template)
    with main_process_first() if main_process_first else contextlib.nullcontext():
        train_raw, eval_raw = _splits(data_args, seed)
        name = data_args.dataset_path
        fmt = detect_format(_columns(train_raw), data_args.dataset_text_field, f"dataset {name!r}")
        if fmt in ("messages", "prompt_completion"):
            check_template_limits(tokenizer, _first_conversations(train_raw, fmt))
        spec = Tokenize(fmt=fmt, text_field=data_args.dataset_text_field,
                        assistant_only=data_args.assistant_only_loss,
                        completion_only=data_args.completion_only_loss is not False,
                        generation_markers=has_generation_markers(tokenizer))
        if spec.assistant_only and fmt != "messages":
            raise DataError(f"assistant_only_loss needs conversational 'messages' records; dataset {name!r} holds "
                            f"{fmt.replace('_', '/')} records (for prompt/completion use completion_only_loss)")
        train = _prepare(train_raw, data_args, tokenizer, spec, vocab_size, f"{name} ({data_args.dataset_train_split})")
        evald = None if eval_raw is None else _prepare(eval_raw, data_args, tokenizer, spec, vocab_size,
                                                       f"{name} (eval)")
    return train, evald


def _first_conversations(raw, fmt: str) -> list:
    """The first records' conversations (messages; or a conversational prompt and completion, joined), for the chat
    template's probe: of a map-style dataset only (a stream is not read ahead)."""
    if not hasattr(raw, "__len__"):
        return []
    found = []
    for i in range(min(len(raw), PROBE_RECORDS)):
        row = raw[i]
        parts = [row.get("messages")] if fmt == "messages" else [row.get("prompt"), row.get("completion")]
        if all(isinstance(p, list) for p in parts):
            turns = [t for p in parts for t in p]
            if turns and all(isinstance(t, dict) for t in turns):
                found.append(turns)
    return found


def _template(value: str) -> str:
    """`chat_template`: a Jinja template, or the path of a file holding one. Text without Jinja's `{{` / `{%` that
    names no file is a path that is missing, not a template (it would render every conversation as that text)."""
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if "{{" not in value and "{%" not in value:
        raise DataError(f"chat_template: {value!r} is neither a Jinja template (no {{{{ or {{%) nor a file that "
                        f"exists: give the template's path, or the template itself")
    return value


def _splits(data_args, seed: int):
    train = load(data_args, split=data_args.dataset_train_split)
    if hasattr(train, "__len__") and len(train) == 0:
        raise DataError(f"dataset {data_args.dataset_path!r}: no records (the file is empty); add text lines or JSON "
                        f"records")
    if data_args.dataset_test_split:
        return train, load(data_args, split=data_args.dataset_test_split)
    if not data_args.eval_fraction:
        return train, None
    if data_args.streaming:
        raise DataError("eval_fraction needs the whole dataset to draw from: with streaming, name an eval split "
                        "(dataset_test_split)")
    if len(train) < 2:
        raise DataError(f"dataset {data_args.dataset_path!r} has {len(train)} record(s): too few to hold some out "
                        f"(eval_fraction); add data or set eval_fraction: 0")
    frac, n = data_args.eval_fraction, len(train)
    if math.floor((1.0 - frac) * n) < 1:  # (datasets' split: ceil(frac * n) held out, floor((1 - frac) * n) kept)
        raise DataError(f"eval_fraction={frac:g} of the {n} records of {data_args.dataset_path!r} holds out all of "
                        f"them, leaving none to train on: use eval_fraction below {(n - 1) / n:.3f}, or more data")
    parts = train.add_column(ROW, range(n)).train_test_split(test_size=frac, seed=seed, shuffle=True)
    return parts["train"], parts["test"]


def _columns(ds, *, ours: bool = False) -> list[str]:
    """The records' columns (`ours`: with the row numbers of a held-out split, which the records do not have)."""
    cols = getattr(ds, "column_names", None)
    if cols is None:  # a streaming dataset whose features are not known before reading
        cols = list(next(iter(ds)).keys())
    return list(cols) if ours else [c for c in cols if c != ROW]


def _fingerprint(ds, *parts) -> str:
    h = hashlib.sha256(str(getattr(ds, "_fingerprint", "")).encode())
    for p in parts:
        h.update(repr(p).encode())
    return h.hexdigest()[:32]


def _tokenizer_id(tok) -> str:
    backend = getattr(tok, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else repr(sorted(tok.get_vocab().items()))
    return hashlib.sha256((body + str(tok.chat_template) + str(tok.eos_token_id)).encode()).hexdigest()


def _map(ds, fn, *, fingerprint: str, desc: str, num_proc, **kw):
    """`ds.map(batched=True)`, cached under HF_DATASETS_CACHE by our own fingerprint (deterministic across runs and
    processes, whatever the source's cache directory)."""
    if not hasattr(ds, "_fingerprint"):  # streaming: lazy, nothing to cache (ids as int64: nothing stored)
        kw.pop("features", None)
        return ds.map(fn, batched=True, **kw)
    import datasets

    # One directory per map: datasets writes its temporary files beside the cache file, and the clean-up below must
    # see only this map's, not those of another run (or test) tokenizing other data at the same time.
    cache = os.path.join(datasets.config.HF_DATASETS_CACHE, "offload_trainer", fingerprint)
    os.makedirs(cache, exist_ok=True)
    before = set(os.listdir(cache))
    try:
        return ds.map(fn, batched=True, num_proc=num_proc, new_fingerprint=fingerprint, desc=desc,
                      cache_file_name=os.path.join(cache, "data.arrow"), **kw)
    except BaseException as e:
        # A Ctrl-C or SIGTERM with num_proc > 1 terminates the pool's workers before they remove the temporary files
        # they were writing (datasets cleans them up only where the interrupt reaches the worker's own code): the
        # ones this map made go, the finished shards stay for the next run to reuse.
        for name in set(os.listdir(cache)) - before:
            if name.startswith("tmp"):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(cache, name))
        interrupt = _interrupt_behind(e)
        if interrupt is not None and interrupt is not e:
            # (datasets' pool, stopping its workers, raises a TimeoutError on top of the interrupt: the interrupt is
            # what happened, and what the command turns into its sentence)
            raise interrupt from None
        raise


def _interrupt_behind(e: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt (a Ctrl-C, or SIGTERM as the command raises it) that `e` is, or was raised while handling."""
    return cause_of(e, KeyboardInterrupt)


def _prepare(raw, data_args, tok, spec: Tokenize, vocab_size: int, where: str):
    seq, strategy = data_args.max_seq_length, data_args.packing_strategy
    fp = _fingerprint(raw, "tokenize-v2", spec, _tokenizer_id(tok))
    columns = _columns(raw, ours=True)
    try:
        tokenized = _map(raw, tokenize_batch, fingerprint=fp, desc="tokenizing", num_proc=data_args.dataset_num_proc,
                         with_indices=True, remove_columns=columns,
                         fn_kwargs=dict(tokenizer=tok, spec=spec, where=where))
    except UnicodeDecodeError as e:  # (the JSON reader keeps bytes; they are decoded as the rows are read)
        raise not_utf8(data_args.dataset_path, e) from None
    if data_args.packing:
        rows = _map(tokenized, pack_batch, fingerprint=_fingerprint(tokenized, "pack-v2", seq, strategy),
                    desc="packing", num_proc=data_args.dataset_num_proc, remove_columns=["input_ids", "labels"],
                    features=_features(("input_ids", "labels", "position_ids")),
                    fn_kwargs=dict(seq_len=seq, strategy=strategy, pad_id=tok.pad_token_id))
    else:
        rows = _map(tokenized, truncate_batch, fingerprint=_fingerprint(tokenized, "truncate-v2", seq),
                    desc="cutting", num_proc=data_args.dataset_num_proc, remove_columns=["input_ids", "labels"],
                    features=_features(("input_ids", "labels")), fn_kwargs=dict(seq_len=seq))
    if hasattr(rows, "_fingerprint"):
        _check(rows, vocab_size, where, data_args, untrained=_untrained(raw, tokenized, spec, where))
    rows = rows.remove_columns(list(STATS))
    # Our own tensors, not `with_format("torch")`: datasets' torch (and numpy) formatter imports
    # `torchvision.io.VideoReader` whenever torchvision is loaded, which torchvision 0.26 removed, so datasets up to
    # 4.5 (LLaMA-Factory pins 4.0) fail on the first row read.
    if not hasattr(rows, "_fingerprint"):  # streaming: one example at a time
        return rows.map(_long_row)
    return rows.with_transform(_long_rows)


def _long_row(row: dict) -> dict[str, torch.Tensor]:
    """A row's token columns as int64 tensors (stored as int32; the model and the loss take int64)."""
    return {k: torch.tensor(v, dtype=torch.long) for k, v in row.items()}


def _long_rows(batch: dict) -> dict[str, list[torch.Tensor]]:
    """`_long_row` over a batch of rows (unpacked rows differ in length: one tensor each)."""
    return {k: [torch.tensor(v, dtype=torch.long) for v in vs] for k, vs in batch.items()}


def _features(token_columns):
    """Token columns as int32 (half the disk and the pages of int64; every vocabulary fits), stats as int64."""
    import datasets

    ids = {k: datasets.List(datasets.Value("int32")) for k in token_columns}
    return datasets.Features({**ids, **{k: datasets.Value("int64") for k in STATS}})


def _untrained_records(tokenized) -> tuple[int, int | None, int]:
    """(how many records have tokens but no label that trains, the index of the first, how many have tokens): read
    from the labels column in Arrow's own buffers, one stored chunk at a time."""
    import numpy as np

    count, first, filled_total, start = 0, None, 0, 0
    for chunk in tokenized.data.table.column("labels").chunks:
        offsets = chunk.offsets.to_numpy()  # (into the values behind a sliced chunk)
        values = chunk.values.to_numpy(zero_copy_only=False)[:offsets[-1]]
        filled = np.flatnonzero(offsets[1:] > offsets[:-1])
        filled_total += len(filled)
        if len(filled):
            # a record's largest label is IGNORE_INDEX when none trains (the others are token ids, >= 0)
            idle = filled[np.maximum.reduceat(values, offsets[filled]) == IGNORE_INDEX]
            count += len(idle)
            first = start + int(idle[0]) if first is None and len(idle) else first
        start += len(chunk)
    return count, first, filled_total


def _untrained(raw, tokenized, spec: Tokenize, where: str) -> int:
    """Records that train nothing, said with the first one's reason (`say_untrained`). Returns their count."""
    count, first, filled = _untrained_records(tokenized)
    if not count:
        return 0
    rec = raw[first]
    why = "every label of it is -100"
    if spec.fmt == "messages" and spec.assistant_only:
        roles = [m.get("role") for m in rec["messages"]]
        why = f"with assistant_only_loss only messages whose role is 'assistant' are trained, and its roles are {roles}"
    elif spec.fmt == "prompt_completion" and spec.completion_only:
        why = "completion_only_loss trains the completion only, and its completion renders to no token"
    say_untrained(where, count, filled, rec.get(ROW, first) + 1, why,
                  "fix the data, or check completion_only_loss / assistant_only_loss against it")
    return count


def _check(rows, vocab_size: int, where: str, data_args, untrained: int = 0) -> None:
    """Every row's ids within the model's vocabulary, something to train on, and a word on what was cut.
    `untrained`: records that trained nothing before any cut (already reported)."""
    import pyarrow.compute as pc

    if len(rows) == 0:
        raise DataError(f"{where}: no records with text (the dataset is empty, or every text is empty); add data")
    table = rows.data.table if hasattr(rows.data, "table") else rows.data
    top = pc.max(table.column("top_id")).as_py()
    if top is not None and top >= vocab_size:
        raise DataError(f"{where}: the tokenizer makes ids up to {top}, but the model's vocabulary has {vocab_size}; "
                        f"use the model's own tokenizer")
    trained = pc.sum(table.column("trained")).as_py()
    # unpacked, a row is a record: rows that train nothing now but did before lost their trained part to the cut
    cut_away = 0 if data_args.packing else (pc.sum(pc.equal(table.column("trained"), 0)).as_py() or 0) - untrained
    if not trained:
        if cut_away:
            raise DataError(f"{where}: no token carries a loss once the rows are cut to max_seq_length="
                            f"{data_args.max_seq_length}: what each record trains (its completion, its assistant "
                            f"turns) lies beyond it; raise max_seq_length")
        raise DataError(f"{where}: no token carries a loss (every label is masked): check completion_only_loss / "
                        f"assistant_only_loss against the data")
    if cut_away:
        logger.warning("%s: %d rows train no token once cut to max_seq_length=%d: what they train (the completion, "
                       "the assistant turns) lies beyond it; raise max_seq_length, or shorten what comes first", where,
                       cut_away, data_args.max_seq_length)
    dropped = pc.sum(table.column("dropped")).as_py() or 0
    if dropped:
        logger.warning("%s: %d tokens beyond max_seq_length=%d were cut off (%s); packing_strategy: bfd_split or "
                       "wrapped keeps them", where, dropped, data_args.max_seq_length,
                       "documents longer than a row" if data_args.packing else "rows longer than it")
