"""Tokenized documents into training rows.

Packed (`packing: true`, the default): documents are placed into rows of exactly `max_seq_length` tokens, each
keeping its own `position_ids` (from 0 at its first token) and no attention mask, from which transformers builds a
block-diagonal mask (its packed-sequence detection, every attention implementation): no token attends across a
document boundary, and the first token of each document is not a target of the one before. So a packed row trains
exactly as its documents would one by one. Strategies, named as TRL's `pack_dataset`:
- `bfd` (best-fit decreasing, TRL's default): whole documents into the fullest row they fit; a document longer
  than a row is cut to it (the tokens dropped are counted and logged);
- `bfd_split`: the same, a long document's overflow packed as documents of their own;
- `wrapped`: documents end to end, cut at row ends (a cut document continues, as a document of its own, in the
  next row): no padding at all.
The rest of a row's last place is padding (labels ignored, positions of its own).

Not packed (`packing: false`): one document per row, cut to `max_seq_length`; `PaddingCollator` pads each batch
to its longest row, with an attention mask.
"""
from __future__ import annotations

import bisect

import torch

from .formats import IGNORE_INDEX

STRATEGIES = ("bfd", "bfd_split", "wrapped")


def pack_batch(batch: dict, *, seq_len: int, strategy: str, pad_id: int) -> dict:
    """`datasets.map(batched=True)`: documents (input_ids, labels) -> rows of seq_len (+ position_ids, dropped)."""
    docs = [d for d in zip(batch["input_ids"], batch["labels"]) if d[0]]
    dropped = 0
    if strategy == "wrapped":
        rows = _wrapped(docs, seq_len)
    else:
        pieces = []
        for ids, labels in docs:
            if len(ids) > seq_len and strategy == "bfd":
                dropped += len(ids) - seq_len
            cuts = range(0, len(ids), seq_len) if strategy == "bfd_split" else (0,)
            pieces += [(ids[a:a + seq_len], labels[a:a + seq_len]) for a in cuts]
        rows = _best_fit(pieces, seq_len)
    out = {"input_ids": [], "labels": [], "position_ids": [], **{k: [] for k in STATS}}
    for n, row in enumerate(rows):
        ids, labels, pos = [], [], []
        for d_ids, d_labels in row:
            ids += d_ids
            labels += [IGNORE_INDEX] + list(d_labels[1:])  # (the first token is not predicted from another document)
            pos += range(len(d_ids))
        pad = seq_len - len(ids)
        _stats(out, ids, labels, dropped if n == 0 else 0)
        out["input_ids"].append(ids + [pad_id] * pad)
        out["labels"].append(labels + [IGNORE_INDEX] * pad)
        out["position_ids"].append(pos + list(range(pad)))
    return out


# Per-row figures the map writes beside the rows, so that checking the whole dataset (ids within the vocabulary,
# something to train on, tokens cut) reads three small columns instead of every token again.
STATS = ("top_id", "trained", "dropped")


def _stats(out: dict, ids: list, labels: list, dropped: int) -> None:
    out["top_id"].append(max(ids) if ids else -1)
    out["trained"].append(sum(1 for x in labels if x != IGNORE_INDEX))
    out["dropped"].append(dropped)


def _best_fit(pieces: list, seq_len: int) -> list[list]:
    """Best-fit decreasing: longest first, each into the row with the least room that still holds it."""
    rows: list[list] = []
    room: list[tuple[int, int]] = []  # (free tokens, row index), sorted
    for piece in sorted(pieces, key=lambda p: -len(p[0])):
        n = len(piece[0])
        k = bisect.bisect_left(room, (n, -1))
        if k < len(room):
            free, r = room.pop(k)
        else:
            free, r = seq_len, len(rows)
            rows.append([])
        rows[r].append(piece)
        if free - n:
            bisect.insort(room, (free - n, r))
    return rows


def _wrapped(docs: list, seq_len: int) -> list[list]:
    rows, row, used = [], [], 0
    for ids, labels in docs:
        a = 0
        while a < len(ids):
            take = min(seq_len - used, len(ids) - a)
            row.append((ids[a:a + take], labels[a:a + take]))
            a, used = a + take, used + take
            if used == seq_len:
                rows.append(row)
                row, used = [], 0
    if row:
        rows.append(row)
    return rows


def truncate_batch(batch: dict, *, seq_len: int) -> dict:
    """`packing: false`: one document per row, cut to seq_len (the tokens dropped are counted)."""
    out = {"input_ids": [], "labels": [], **{k: [] for k in STATS}}
    for ids, labels in zip(batch["input_ids"], batch["labels"]):
        if ids:
            out["input_ids"].append(ids[:seq_len])
            out["labels"].append(labels[:seq_len])
            _stats(out, out["input_ids"][-1], out["labels"][-1], max(0, len(ids) - seq_len))
    return out


class PaddingCollator:
    """Batches of unpacked rows: padded (right) to the longest, `attention_mask` 0 on the padding, labels ignored."""

    def __init__(self, pad_id: int, pad_to_multiple_of: int = 8):
        self.pad_id, self.multiple = pad_id, pad_to_multiple_of

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(r["input_ids"]) for r in rows)
        n = -(-longest // self.multiple) * self.multiple
        ids = torch.full((len(rows), n), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), n), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(rows), n), dtype=torch.long)
        for b, r in enumerate(rows):
            k = len(r["input_ids"])
            ids[b, :k] = torch.as_tensor(r["input_ids"])
            labels[b, :k] = torch.as_tensor(r["labels"])
            mask[b, :k] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
