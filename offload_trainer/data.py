"""Training data: local .txt / .jsonl files or the built-in corpus, tokenized and packed to fixed length.

.jsonl records may hold plain text (`text`, or the field named by `text_field`), chat `messages`
(rendered with the tokenizer's chat template), or `prompt` + `completion` pairs (loss on the completion
only). Every bad record is reported with its file and line number.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from .errors import DataError
from .models import builtin_asset

IGNORE_INDEX = -100  # label value that cross-entropy skips
BUILTIN = {"builtin": "corpus.txt", "builtin-sft": "sft.jsonl"}


def resolve_dataset_path(path: str) -> str:
    if path in BUILTIN:
        return builtin_asset(BUILTIN[path])
    return path


def check_dataset_path(path: str) -> None:
    """Fail before any model is loaded when the data file is missing or of an unknown kind."""
    if path == "random" or path in BUILTIN:
        return
    if not os.path.isfile(path):
        raise DataError(f"dataset_path: file {path!r} does not exist (use a .txt or .jsonl file, "
                        f"'builtin', 'builtin-sft' or 'random')")
    if not path.endswith((".txt", ".jsonl")):
        raise DataError(f"dataset_path: {path!r} is neither .txt nor .jsonl")


def read_records(path: str) -> list[dict]:
    """Records of a .txt (one per non-empty line: {'text': line}) or .jsonl file (one JSON object per line)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if path.endswith(".txt"):
                records.append({"text": line.rstrip("\n"), "_line": lineno})
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object")
            if not isinstance(rec, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            rec["_line"] = lineno
            records.append(rec)
    if not records:
        raise DataError(f"{path}: no records (the file is empty); add text lines or JSON records")
    return records


def tokenize_record(rec: dict, tokenizer, text_field: str, where: str) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one record, EOS-terminated; labels are IGNORE_INDEX where no loss is taken."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if text_field in rec:
        ids = tokenizer(str(rec[text_field]), add_special_tokens=False)["input_ids"] + eos
        return ids, list(ids)
    if "messages" in rec:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(f"{where}: chat 'messages' need a tokenizer with a chat template; "
                            f"set tokenizer_name_or_path to one that has it, or convert to prompt/completion")
        text = tokenizer.apply_chat_template(rec["messages"], tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids, list(ids)
    if "prompt" in rec and "completion" in rec:
        p = tokenizer(str(rec["prompt"]), add_special_tokens=False)["input_ids"]
        c = tokenizer(str(rec["completion"]), add_special_tokens=False)["input_ids"] + eos
        return p + c, [IGNORE_INDEX] * len(p) + c
    keys = sorted(k for k in rec if k != "_line")
    raise DataError(f"{where}: record has keys {keys}; expected '{text_field}', 'messages', "
                    f"or 'prompt' + 'completion'")


@dataclass
class PackedDataset(torch.utils.data.Dataset):
    """Fixed-length blocks of (input_ids, labels, attention_mask)."""

    blocks: list[dict[str, torch.Tensor]]

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.blocks[i]


def pack(ids: list[int], labels: list[int], seq_len: int, pad_id: int) -> list[dict[str, torch.Tensor]]:
    """Cut one long token stream into blocks of seq_len; the last partial block is padded, not dropped."""
    blocks = []
    for start in range(0, len(ids), seq_len):
        x, y = ids[start:start + seq_len], labels[start:start + seq_len]
        n = len(x)
        pad = seq_len - n
        blocks.append({
            "input_ids": torch.tensor(x + [pad_id] * pad, dtype=torch.long),
            "labels": torch.tensor(y + [IGNORE_INDEX] * pad, dtype=torch.long),
            "attention_mask": torch.tensor([1] * n + [0] * pad, dtype=torch.long),
        })
    return blocks


def random_dataset(vocab_size: int, seq_len: int, num_samples: int, seed: int = 0) -> PackedDataset:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (num_samples, seq_len), generator=g)
    ones = torch.ones(seq_len, dtype=torch.long)
    return PackedDataset([{"input_ids": x, "labels": x.clone(), "attention_mask": ones} for x in ids])


def build_datasets(data_args, tokenizer, *, vocab_size: int, seed: int = 0):
    """(train, eval or None) datasets for the Trainer."""
    seq = data_args.max_seq_length
    if data_args.dataset_path == "random":
        return random_dataset(vocab_size, seq, data_args.random_num_samples, seed), None
    path = resolve_dataset_path(data_args.dataset_path)
    check_dataset_path(path)
    max_len = getattr(tokenizer, "model_max_length", None)
    if max_len and max_len < 10**9 and seq > max_len:  # checked before tokenizing the whole file
        raise DataError(f"max_seq_length={seq} is longer than the tokenizer/model allows ({max_len}); "
                        f"use max_seq_length <= {max_len}")
    ids: list[int] = []
    labels: list[int] = []
    for rec in read_records(path):
        x, y = tokenize_record(rec, tokenizer, data_args.text_field, f"{path}:{rec['_line']}")
        ids += x
        labels += y
    top = max(ids)
    if top >= vocab_size:
        raise DataError(f"{path}: the tokenizer makes ids up to {top}, but the model's vocabulary has "
                        f"{vocab_size}; use the model's own tokenizer")
    blocks = pack(ids, labels, seq, tokenizer.pad_token_id)
    n_eval = int(len(blocks) * data_args.eval_fraction)
    if data_args.eval_fraction > 0 and n_eval == 0:
        n_eval = 1
    if n_eval >= len(blocks):
        raise DataError(f"{path}: only {len(blocks)} block(s) of {seq} tokens; lower max_seq_length or "
                        f"eval_fraction, or add data")
    train = PackedDataset(blocks[: len(blocks) - n_eval])
    evald = PackedDataset(blocks[len(blocks) - n_eval:]) if n_eval else None
    return train, evald
