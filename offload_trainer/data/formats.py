"""Records to token ids and labels, in the formats TRL's SFT trainer reads:

- plain text (`dataset_text_field`, default `text`): loss on every token, EOS appended;
- conversational `messages`: the tokenizer's chat template; with `assistant_only_loss`, loss on the assistant turns
  only -- from the template's `{% generation %}` markers where it has them, else by rendering turn by turn (each
  assistant turn is what the template adds after the prompt that ends with the generation prompt);
- prompt / completion, as strings or as message lists (TRL's conversational prompt-completion): loss on the
  completion only (`completion_only_loss`, default on, as in TRL);
- already tokenized `input_ids` (+ `labels`).

`tokenize_batch` runs inside `datasets.map(batched=True)`; a bad record is one DataError naming its row.
"""
from __future__ import annotations

import json
import os

import logging
from dataclasses import dataclass

from ..errors import DataError

IGNORE_INDEX = -100  # label value that cross-entropy skips
FORMATS = ("text", "messages", "prompt_completion", "tokenized")


@dataclass(frozen=True)
class Tokenize:
    """What `tokenize_batch` needs, fixed once per run (and hashed into the cache fingerprint)."""

    fmt: str
    text_field: str = "text"
    assistant_only: bool = False
    completion_only: bool = True
    generation_markers: bool = False


# A held-out split shuffles the records: each keeps its place in the file in this column, so that an error names the
# row a user can find (`row N`, counted from 1), not its place in the shuffled split.
ROW = "__offload_trainer_row__"


def row_number(rec, i: int) -> int:
    """The record's row in the file, counted from 1 (`i`: its index in the dataset it was read from)."""
    return rec.get(ROW, i) + 1


def detect_format(columns: list[str], text_field: str, where: str) -> str:
    if "input_ids" in columns:
        return "tokenized"
    if "messages" in columns:
        return "messages"
    if "prompt" in columns and "completion" in columns:
        return "prompt_completion"
    if text_field in columns:
        return "text"
    hint = ""
    sep = next((c for c in (";", "\t", "|") if len(columns) == 1 and c in columns[0]), None)
    if sep is not None:  # a CSV delimited by another character reads as one column named by the whole header
        hint = (f" (the header {columns[0]!r} looks delimited by {sep!r}, not commas: read it with dataset_kwargs: "
                f"{{sep: {json.dumps(sep)}}})")
    elif len(columns) == 1:  # a JSON file holding {"data": [records]} reads as one record with one column
        hint = (f" (if {columns[0]!r} holds the records, as in {{{columns[0]!r}: [...]}}, read them with "
                f"dataset_kwargs: {{field: {columns[0]}}})")
    raise DataError(f"{where}: records have columns {sorted(columns)}; expected {text_field!r} (dataset_text_field), "
                    f"'messages', 'prompt' + 'completion', or 'input_ids'{hint}")


def say_untrained(where: str, count: int, total: int, row: int, why: str, fix: str) -> None:
    """The word on records that train no token (a typo in a role, an empty completion): a warning -- they take steps
    and add no loss -- or, when none of the `total` records trains, the error. `row` and `why`: the first one's."""
    if count == total:
        raise DataError(f"{where}: no record trains a token (the first: row {row}: {why}); {fix}")
    logging.getLogger("offload_trainer").warning(
        "%s: %d of %d records train no token (the first: row %d: %s); they take steps but add no loss: fix or drop "
        "them", where, count, total, row, why)


def has_generation_markers(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "{% generation %}" in template or "{%- generation %}" in template


def tokenize_batch(batch: dict, indices: list[int], *, tokenizer, spec: Tokenize, where: str) -> dict:
    """Each record as pieces of text (or ids), each trained on or not; the batch's text pieces tokenized in one call
    of the (fast, batched) tokenizer, then put back together."""
    rows = batch[ROW] if ROW in batch else indices
    keys = [k for k in batch if k != ROW]
    records = [_pieces(dict(zip(keys, values)), tokenizer, spec, f"{where} row {i + 1}")
               for i, values in zip(rows, zip(*(batch[k] for k in keys)))]
    texts = [p for rec in records for p, _ in rec if isinstance(p, str) and p]
    encoded = iter(tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else iter(())
    out = {"input_ids": [], "labels": []}
    for rec in records:
        ids, labels = [], []
        for piece, trained in rec:
            if isinstance(piece, str):
                piece = next(encoded) if piece else []
            ids += piece
            labels += piece if trained is True else [IGNORE_INDEX] * len(piece) if not trained else trained
        out["input_ids"].append(ids)
        out["labels"].append(labels)
    return out


# The fields each format reads (a file's records are read in one format: the first of these its columns have).
_FIELDS = {"tokenized": ("input_ids",), "messages": ("messages",), "prompt_completion": ("prompt", "completion")}


def _pieces(rec: dict, tok, spec: Tokenize, where: str) -> list[tuple]:
    """[(text or token ids, trained)]: `trained` True / False, or the labels themselves (given with the ids)."""
    fields = _FIELDS.get(spec.fmt, (spec.text_field,))
    if all(rec.get(f) is None for f in fields):  # a file that mixes formats has the union of their columns
        others = sorted(f for fs in (*_FIELDS.values(), (spec.text_field,)) for f in fs
                        if f not in fields and rec.get(f) is not None)
        if others:
            wanted = " / ".join(map(repr, fields))
            raise DataError(f"{where}: has {others} but no {wanted}: the file's records are read as one format, the "
                            f"one other records have ({spec.fmt}); give each record that format")
    if spec.fmt == "tokenized":
        ids = rec["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(x, int) for x in ids):
            raise DataError(f"{where}: input_ids must be a list of token ids")
        if ids and min(ids) < 0:  # (an embedding lookup would fail at the first step, as a traceback)
            raise DataError(f"{where}: input_ids holds a negative token id ({min(ids)}); ids count from 0")
        labels = rec.get("labels") or list(ids)
        if len(labels) != len(ids):
            raise DataError(f"{where}: labels has {len(labels)} values for {len(ids)} input_ids")
        return [(list(ids), list(labels))]
    if spec.fmt == "text":
        text = rec.get(spec.text_field)
        if not isinstance(text, str):
            raise DataError(f"{where}: {spec.text_field!r} is {_kind(text)}, not a string")
        text = text.lstrip("\ufeff")
        return [(text, True), (_eos(tok), True)] if text.strip() else []
    if spec.fmt == "messages":
        return _conversation(_text_parts_joined(rec.get("messages"), where), tok, spec, where)
    return _prompt_completion(_text_parts_joined(rec.get("prompt"), where),
                              _text_parts_joined(rec.get("completion"), where), tok, spec, where)


def _text_parts_joined(messages, where: str):
    """Messages whose content is a list of text parts (`[{"type": "text", "text": ...}]`: OpenAI's format, and the
    Hub's multimodal one) with the parts' texts joined, one after another, as the Hub's multimodal chat templates
    render them: a text model's template would print the list itself (`[{'type': 'text', ...}]`) and train on that.
    Anything else is left for `_check_messages` to judge."""
    if not isinstance(messages, list):
        return messages
    out = []
    for j, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise DataError(f"{where}: message {j + 1}'s content has a part {part!r:.80}; a text run reads "
                                    f"text parts only ({{'type': 'text', 'text': ...}}): drop the others, or train a "
                                    f"vision model on images")
            m = {**m, "content": "".join(part["text"] for part in content)}
        out.append(m)
    return out


def _prompt_completion(prompt, completion, tok, spec: Tokenize, where: str) -> list[tuple]:
    if isinstance(prompt, str) and isinstance(completion, str):
        return [(prompt, not spec.completion_only), (completion, True), (_eos(tok), True)]
    if isinstance(prompt, list) and isinstance(completion, list):  # conversational prompt-completion
        _check_messages(prompt + completion, where)
        _need_template(tok, where)
        p_text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(prompt + completion, tokenize=False)
        if not full.startswith(p_text):
            raise DataError(f"{where}: the chat template does not render the completion after the prompt's "
                            f"generation prompt; give prompt and completion as strings instead")
        return [(p_text, not spec.completion_only), (full[len(p_text):], True)]
    raise DataError(f"{where}: prompt is {_kind(prompt)} and completion {_kind(completion)}; both must be strings, "
                    f"or both lists of messages")


def _conversation(messages, tok, spec: Tokenize, where: str) -> list[tuple]:
    _check_messages(messages, where)
    _need_template(tok, where)
    if not spec.assistant_only:
        return [(tok.apply_chat_template(messages, tokenize=False), True)]
    if spec.generation_markers:
        enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids = list(enc["input_ids"])
        return [(ids, [t if m else IGNORE_INDEX for t, m in zip(ids, enc["assistant_masks"])])]
    # Turn by turn: the text before each assistant turn (ending with the generation prompt) and the text with it.
    pieces, done = [], ""
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tok.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True) if k else ""
        upto = tok.apply_chat_template(messages[: k + 1], tokenize=False)
        if not before.startswith(done) or not upto.startswith(before):
            raise DataError(f"{where}: the chat template does not render this conversation turn by turn, so the "
                            f"assistant's tokens cannot be told apart: give a chat_template with {{% generation %}} "
                            f"markers, or set assistant_only_loss: false")
        pieces += [(before[len(done):], False), (upto[len(before):], True)]
        done = upto
    return pieces + [(tok.apply_chat_template(messages, tokenize=False)[len(done):], False)]


def _check_messages(messages, where: str) -> None:
    if isinstance(messages, list) and not messages:
        raise DataError(f"{where}: messages is an empty list: a conversation needs its messages (drop the record, "
                        f"or give them)")
    if not isinstance(messages, list):
        raise DataError(f"{where}: messages is {_kind(messages)}, not a list of {{role, content}} messages")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise DataError(f"{where}: message {j + 1} is {_kind(m) if not isinstance(m, dict) else m!r}; each "
                            f"message needs a 'role' and a 'content'")
        if m["content"] is None and not m.get("tool_calls"):  # (a tool call's message may have no text)
            raise DataError(f"{where}: message {j + 1} ({m['role']}) has no content (null): give its text, or drop "
                            f"the message (the chat template would render it as empty, or as the word None)")
        if m["content"] is not None and not isinstance(m["content"], (str, list)):
            raise DataError(f"{where}: message {j + 1}'s content is {_kind(m['content'])}, not text")


def _need_template(tok, where: str) -> None:
    if not getattr(tok, "chat_template", None):
        raise DataError(f"{where}: chat 'messages' need a tokenizer with a chat template; set chat_template, or "
                        f"tokenizer_name_or_path to one that has it, or convert to prompt/completion")


# A chat template is code: rendered once on a small conversation before any record, in a child process held to
# these limits (a template doing `'x' * 10**8` per record, or looping, hung or exhausted the run before any word)
TEMPLATE_SECONDS, TEMPLATE_CHARS, TEMPLATE_MEMORY = 20.0, 1_000_000, 4 << 30
# conversations every template is probed with: two messages, a system prompt, several turns (a template may do its
# heavy work for one role or one turn only)
_PROBES = ([{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."}],
           [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello."},
            {"role": "assistant", "content": "Hi."}],
           [{"role": "user", "content": "One."}, {"role": "assistant", "content": "1."},
            {"role": "user", "content": "Two."}, {"role": "assistant", "content": "2."}])
PROBE_RECORDS = 3  # and the dataset's first conversations


def check_template_limits(tok, conversations=()) -> None:
    """DataError when the tokenizer's chat template, rendering the probe's conversations (`_PROBES`) and the dataset's
    first `conversations` (up to PROBE_RECORDS), runs longer than TEMPLATE_SECONDS in all, writes more than
    TEMPLATE_CHARS characters for one, or needs more than TEMPLATE_MEMORY bytes. A conversation the template fails
    on for its own reasons (a role it refuses) is left to the records to show."""
    import multiprocessing as mp

    if not getattr(tok, "chat_template", None) or os.name != "posix":
        return
    probes = [*_PROBES, *list(conversations)[:PROBE_RECORDS]]
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_render_probe, args=(tok, probes, send), daemon=True)
    child.start()
    send.close()
    got = recv.recv() if recv.poll(TEMPLATE_SECONDS) else ("time", None)
    child.kill()
    child.join()
    what, which = got
    if what in ("time", "memory") or (isinstance(what, int) and what > TEMPLATE_CHARS):
        too = (f"runs longer than {TEMPLATE_SECONDS:g} s" if what == "time" else
               f"needs more than {TEMPLATE_MEMORY / 2**30:g} GiB" if what == "memory" else
               f"writes {what:,} characters")
        whose = ("the probe's and the dataset's first conversations" if which is None else
                 "a two-message conversation" if which == 0 else
                 f"the probe's conversation {which + 1} of {len(_PROBES)}" if which < len(_PROBES) else
                 f"the dataset's record {which - len(_PROBES) + 1}")
        raise DataError(f"chat_template: rendering {whose} {too} (the limits: {TEMPLATE_SECONDS:g} s for "
                        f"{len(probes)} conversations, {TEMPLATE_CHARS:,} characters, "
                        f"{TEMPLATE_MEMORY / 2**30:g} GiB): every record renders through it. Fix the template (a "
                        f"model's own renders in milliseconds)")


def _render_probe(tok, probes, send) -> None:
    """In the child: (the longest rendering's characters, its index), or ("memory", index)."""
    import resource

    with open("/proc/self/statm") as f:  # (pages of address space the fork already has: CUDA maps a lot)
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + TEMPLATE_MEMORY, resource.RLIM_INFINITY))
    longest = (0, 0)
    for i, conversation in enumerate(probes):
        try:
            n = len(tok.apply_chat_template(conversation, tokenize=False))
        except MemoryError:
            send.send(("memory", i))
            return
        except Exception:  # noqa: BLE001 (the template's own error: the records will show it, with their row)
            continue
        if n > TEMPLATE_CHARS:
            send.send((n, i))
            return
        longest = max(longest, (n, i))
    send.send(longest)


def _eos(tok) -> list[int]:
    return [tok.eos_token_id] if tok.eos_token_id is not None else []


_JSON_KINDS = {bool: "a boolean", int: "a number", float: "a number", str: "a string"}  # (what a JSON file says)


def _kind(value) -> str:
    return "null (or missing)" if value is None else _JSON_KINDS.get(type(value), f"a {type(value).__name__}")
