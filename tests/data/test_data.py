"""The command's data path on `datasets`: every format from every container gives the same rows, labels token by
token, packing that trains exactly as the documents one by one, TRL's packing as the oracle, the cache reused."""
import json
import logging
import os
import re
import shutil

import pytest
import torch

from offload_trainer.cli.run_args import DataArguments, ModelArguments
from offload_trainer.data import IGNORE_INDEX, DataError, build_datasets
from offload_trainer.models import load_tokenizer

CHAT = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello friend"},
        {"role": "user", "content": "two plus two?"}, {"role": "assistant", "content": "four"}]
RECORDS = {
    "text": [{"text": "the cat sat on the mat"}, {"text": "a dog ran"}, {"text": "birds fly south in winter"}],
    "messages": [{"messages": CHAT}, {"messages": CHAT[:2]}],
    "prompt_completion": [{"prompt": "What is 2 plus 2?", "completion": " 4."},
                          {"prompt": "Name a colour.", "completion": " Blue."}],
    "conversational_prompt_completion": [{"prompt": CHAT[:1], "completion": CHAT[1:2]},
                                         {"prompt": CHAT[:3], "completion": CHAT[3:]}],
    "tokenized": [{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}, {"input_ids": [9, 10, 11]}],
}


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """Each test its own datasets cache (the cache's reuse is tested on purpose below)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    datasets.disable_progress_bars()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelArguments(model_config="tiny-llama"))


def rows(ds) -> list[tuple[list, list]]:
    return [(r["input_ids"].tolist(), r["labels"].tolist()) for r in ds]


def build(tok, path, **kw):
    kw.setdefault("max_seq_length", 64)
    return build_datasets(DataArguments(dataset_path=str(path), **kw), tok, vocab_size=512)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ---------------------------------------------------------------------------------------------------- containers
def containers(tmp_path, records):
    """The same records in every container the command reads (CSV only for flat string records)."""
    import datasets

    ds = datasets.Dataset.from_list(records)
    out = {"jsonl": write_jsonl(tmp_path / "d.jsonl", records)}
    ds.to_parquet(str(tmp_path / "d.parquet"))
    out["parquet"] = tmp_path / "d.parquet"
    if all(isinstance(v, str) for r in records for v in r.values()):
        ds.to_csv(str(tmp_path / "d.csv"), index=False)
        out["csv"] = tmp_path / "d.csv"
    ds.save_to_disk(str(tmp_path / "saved"))
    out["save_to_disk"] = tmp_path / "saved"
    shutil.copy(next((tmp_path / "saved").glob("*.arrow")), tmp_path / "d.arrow")
    out["arrow"] = tmp_path / "d.arrow"
    (tmp_path / "repo" / "data").mkdir(parents=True)
    ds.to_parquet(str(tmp_path / "repo" / "data" / "train-00000-of-00001.parquet"))
    out["directory"] = tmp_path / "repo"
    return out


@pytest.mark.parametrize("fmt", list(RECORDS))
def test_every_format_reads_the_same_from_every_container(fmt, tok, tmp_path):
    records = RECORDS[fmt]
    found = containers(tmp_path, records)
    want = rows(build(tok, found.pop("jsonl"))[0])
    assert want and all(ids for ids, _ in want)
    for name, path in found.items():
        assert rows(build(tok, path)[0]) == want, name


def test_a_hub_dataset_works_offline_from_the_hf_cache(tok, tmp_path):
    """A Hub name (`org/name`, split) read from the datasets cache, as after an earlier online run."""
    import datasets
    from datasets.packaged_modules.parquet.parquet import Parquet

    src = tmp_path / "src.parquet"
    datasets.Dataset.from_list(RECORDS["text"]).to_parquet(str(src))
    builder = Parquet(data_files={"train": str(src)}, dataset_name="chat", cache_dir=datasets.config.HF_DATASETS_CACHE)
    builder.download_and_prepare()
    shutil.copytree(builder.cache_dir, os.path.join(datasets.config.HF_DATASETS_CACHE, "someorg___chat", "default",
                                                    "0.0.0", "abc"))
    got = rows(build_datasets(DataArguments(dataset_name="someorg/chat", max_seq_length=64), tok, vocab_size=512)[0])
    assert got == rows(build(tok, write_jsonl(tmp_path / "d.jsonl", RECORDS["text"]))[0])
    with pytest.raises(DataError, match="has no split 'validation'; it has train"):
        build_datasets(DataArguments(dataset_name="someorg/chat", dataset_test_split="validation"), tok,
                       vocab_size=512)


# ---------------------------------------------------------------------------------------------------- labels
def labelled(ids, labels):
    return [t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX]


def unpacked(tok, path, **kw):
    """One row per document, as tokenized (no packing: its labels are the record's own)."""
    kw.setdefault("max_seq_length", 256)
    return rows(build(tok, path, packing=False, **kw)[0])


def test_assistant_only_labels_token_by_token(tok, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    (ids, labels), = unpacked(tok, path, assistant_only_loss=True)
    assert ids == tok(tok.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False)["input_ids"]
    want = tok("hello friend<|endoftext|>\n", add_special_tokens=False)["input_ids"] + \
        tok("four<|endoftext|>\n", add_special_tokens=False)["input_ids"]
    assert labelled(ids, labels) == want
    assert [t for t, lab in zip(ids, labels) if lab == t] == want  # labels are the ids themselves where trained
    (all_ids, all_labels), = unpacked(tok, path)
    assert all_ids == ids and all_labels == ids  # without assistant_only_loss: every token


def test_assistant_only_from_generation_markers_matches_turn_by_turn(tok, tmp_path):
    """The same template with {% generation %} markers: the tokenizer's assistant mask (what TRL uses) gives the same
    labels as rendering turn by turn."""
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}, {"messages": CHAT[:2]}])
    marked = ("{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['role'] == 'assistant' %}{% generation %}"
              "{{ m['content'] }}<|endoftext|>\n{% endgeneration %}{% else %}{{ m['content'] }}<|endoftext|>\n"
              "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    assert unpacked(tok, path, assistant_only_loss=True, chat_template=marked) == \
        unpacked(tok, path, assistant_only_loss=True)


def test_completion_only_labels_token_by_token(tok, tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", RECORDS["prompt_completion"][:1])
    (ids, labels), = unpacked(tok, path)
    prompt = tok("What is 2 plus 2?", add_special_tokens=False)["input_ids"]
    completion = tok(" 4.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ids == prompt + completion and labels == [IGNORE_INDEX] * len(prompt) + completion
    (_, labels_all), = unpacked(tok, path, completion_only_loss=False)
    assert labels_all == ids


def test_conversational_prompt_completion_is_rendered_not_stringified(tok, tmp_path):
    path = write_jsonl(tmp_path / "cpc.jsonl", RECORDS["conversational_prompt_completion"][:1])
    (ids, labels), = unpacked(tok, path)
    text = tok.decode(ids)
    assert "[{'role'" not in text and text == tok.apply_chat_template(CHAT[:2], tokenize=False)
    assert tok.decode(labelled(ids, labels)) == "hello friend<|endoftext|>\n"


def test_tokenized_records_keep_their_labels(tok, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", RECORDS["tokenized"])
    assert unpacked(tok, path) == [([5, 6, 7, 8], [-100, -100, 7, 8]), ([9, 10, 11], [9, 10, 11])]


@pytest.mark.parametrize("fmt, ext, codec", [("text", "jsonl", "gzip"), ("messages", "jsonl", "lzma"),
                                              ("prompt_completion", "csv", "bz2"), ("text", "txt", "gzip")])
def test_data_compressed_files(fmt, ext, codec, tok, tmp_path):
    """A data file compressed (.gz, .bz2, .xz) reads as the file itself, alone or in a directory (was refused as
    none of the known kinds)."""
    import importlib

    records = RECORDS[fmt]
    plain = containers(tmp_path, records)["jsonl"] if ext == "jsonl" else tmp_path / f"d.{ext}"
    if ext == "csv":
        containers(tmp_path, records)
    if ext == "txt":
        plain.write_text("".join(r["text"] + "\n" for r in records))
    suffix = {"gzip": "gz", "bz2": "bz2", "lzma": "xz"}[codec]
    packed = tmp_path / "z" / f"d.{ext}.{suffix}"
    packed.parent.mkdir()
    with importlib.import_module(codec).open(packed, "wb") as f:
        f.write(plain.read_bytes())
    want = rows(build(tok, plain)[0])
    assert want and rows(build(tok, packed)[0]) == want
    assert rows(build(tok, packed.parent)[0]) == want


def test_data_damaged_compressed_file(tok, tmp_path):
    import gzip

    whole = gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in RECORDS["text"] * 50))
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataError, match="cannot be loaded: Compressed file ended before the end-of-stream marker"):
        build(tok, tmp_path / "cut.jsonl.gz")
    with gzip.open(tmp_path / "bad.jsonl.gz", "wt") as f:
        f.write('{"text": "a b"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"bad.jsonl.gz:2: not valid JSON"):
        build(tok, tmp_path / "bad.jsonl.gz")


def test_data_damaged_parquet(tok, tmp_path, caplog):
    """One sentence quoting the reader, and not the reader's own log line before it (it said the same twice)."""
    (tmp_path / "d.parquet").write_bytes(b"PAR1garbagegarbagePAR1")
    with caplog.at_level("DEBUG"), pytest.raises(DataError, match="cannot be loaded: Parquet file size is 22 bytes"):
        build(tok, tmp_path / "d.parquet")
    assert "Failed to read" not in caplog.text
    assert logging.getLogger("datasets.packaged_modules").level == logging.NOTSET  # (put back)


def as_parts(messages, split=False):
    """The messages with each content as a list of text parts (OpenAI's format); `split`: one part per word."""
    def parts(text):
        words = text.split(" ")
        return [{"type": "text", "text": w + (" " if k < len(words) - 1 else "")} for k, w in enumerate(words)] \
            if split else [{"type": "text", "text": text}]
    return [{**m, "content": parts(m["content"])} for m in messages]


@pytest.mark.parametrize("split", [False, True], ids=["one_part", "a_part_per_word"])
def test_data_content_as_text_parts(split, tok, tmp_path):
    """Content as a list of text parts trains exactly as the same text as a string (a text model's template printed
    the list itself, `[{'type': 'text', ...}]`, and trained on that); in conversations and conversational
    prompt-completion records."""
    for records, plain in [([{"messages": as_parts(CHAT, split)}], [{"messages": CHAT}]),
                           ([{"prompt": as_parts(CHAT[:3], split), "completion": as_parts(CHAT[3:], split)}],
                            [{"prompt": CHAT[:3], "completion": CHAT[3:]}])]:
        chat = "messages" in records[0]
        got = unpacked(tok, write_jsonl(tmp_path / "parts.jsonl", records), assistant_only_loss=chat)
        want = unpacked(tok, write_jsonl(tmp_path / "plain.jsonl", plain), assistant_only_loss=chat)
        assert got == want and "'type'" not in tok.decode(got[0][0])


def test_data_image_part_in_a_text_run(tok, tmp_path):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]},
                {"role": "assistant", "content": "a cat"}]
    with pytest.raises(DataError, match=r"row 1: message 1's content has a part \{'type': 'image'\}; a text run reads "
                                        r"text parts only"):
        build(tok, write_jsonl(tmp_path / "img.jsonl", [{"messages": messages}]))


def test_data_records_inside_a_json_object(tok, tmp_path):
    """A .json file holding {"data": [records]}: the error names the key to read them from, and that reads them."""
    (tmp_path / "w.json").write_text(json.dumps({"data": RECORDS["text"]}))
    with pytest.raises(DataError, match=r"records have columns \['data'\]; .* read them with dataset_kwargs: "
                                        r"\{field: data\}"):
        build(tok, tmp_path / "w.json")
    got = rows(build_datasets(DataArguments(dataset_path=str(tmp_path / "w.json"), max_seq_length=64,
                                            dataset_kwargs={"field": "data"}), tok, vocab_size=512)[0])
    assert got == rows(build(tok, write_jsonl(tmp_path / "d.jsonl", RECORDS["text"]))[0])


@pytest.mark.parametrize("kwargs, needle", [
    ({"bogus": 1}, "dataset_kwargs: 'bogus' is not an option of the json reader of"),  # (was a raw TypeError)
    ({"builder": "nope"}, "dataset_kwargs: builder 'nope' is none of datasets' readers (arrow, "),
    ({"field": "nope"}, "no key 'nope' at the top of the JSON (dataset_kwargs: field names the key"),  # (was "'nope'")
])
def test_data_kwargs_the_reader_does_not_take(kwargs, needle, tok, tmp_path):
    (tmp_path / "w.json").write_text(json.dumps({"data": RECORDS["text"]}))
    with pytest.raises(DataError, match=re.escape(needle)):
        build_datasets(DataArguments(dataset_path=str(tmp_path / "w.json"), dataset_kwargs=kwargs), tok,
                       vocab_size=512)


def test_data_hub_dataset_offline(tok, monkeypatch):
    """A Hub name that is not in the cache, offline: datasets' own words (the cause under them said `is not cached in
    None`) and what it needs."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match=r"dataset 'someorg/nothing-here' cannot be loaded: Couldn't reach "
                                        r"'someorg/nothing-here' on the Hub \(OfflineModeIsEnabled\)\. A Hub dataset "
                                        r"needs the network"):
        build_datasets(DataArguments(dataset_name="someorg/nothing-here"), tok, vocab_size=512)


def test_data_mixed_formats(tok, tmp_path):
    """A file whose records are in two formats said `messages is null (or missing)` for a record that had text."""
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"text": "a b c"}, {"messages": CHAT}])
    with pytest.raises(DataError, match=r"row 1: has \['text'\] but no 'messages': the file's records are read as "
                                        r"one format, the one other records have \(messages\)"):
        build(tok, path)
    with pytest.raises(DataError, match=r"row 2: 'text' is null \(or missing\), not a string"):  # (not mixed)
        build(tok, write_jsonl(tmp_path / "gap.jsonl", [{"text": "a b", "id": 1}, {"id": 2}]))


TYPO = [{"role": "user", "content": "hi there"}, {"role": "assistent", "content": "hello friend"}]


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
def test_data_records_that_train_no_token(packing, tok, tmp_path, caplog):
    """A role misspelt under assistant_only_loss trained nothing of its record, silently: a warning names how many
    records, the first one's row and its roles. Without assistant_only_loss (every token trains), no word."""
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}, {"messages": TYPO}, {"messages": CHAT[:2]},
                                                 {"messages": TYPO}])
    with caplog.at_level("WARNING", logger="offload_trainer"):
        build(tok, path, assistant_only_loss=True, packing=packing)
    assert ("2 of 4 records train no token (the first: row 2: with assistant_only_loss only messages whose role is "
            "'assistant' are trained, and its roles are ['user', 'assistent'])") in caplog.text
    with pytest.raises(DataError, match=r"no record trains a token \(the first: row 1: with assistant_only_loss only messages "
                                        r"whose role is 'assistant' are trained, and its roles are "
                                        r"\['user', 'assistent'\]\)"):
        build(tok, write_jsonl(tmp_path / "all.jsonl", [{"messages": TYPO}] * 2), assistant_only_loss=True,
              packing=packing)
    caplog.clear()
    with caplog.at_level("WARNING", logger="offload_trainer"):
        build(tok, path, packing=packing)
        build(tok, write_jsonl(tmp_path / "good.jsonl", [{"messages": CHAT}, {"messages": CHAT[:2]}]),
              assistant_only_loss=True, packing=packing)
    assert "train no token" not in caplog.text


def test_data_trained_part_beyond_max_seq_length(tok, tmp_path, caplog):
    """Unpacked rows cut to max_seq_length: a record whose completion lies beyond the cut trained nothing, silently
    (and when every record did, the error blamed the loss switches, not the cut)."""
    long = {"prompt": " ".join(["word"] * 40), "completion": " done."}
    path = write_jsonl(tmp_path / "pc.jsonl", [long, RECORDS["prompt_completion"][0], long])
    with caplog.at_level("WARNING", logger="offload_trainer"):
        build(tok, path, packing=False, max_seq_length=16)
    assert "2 rows train no token once cut to max_seq_length=16: what they train (the completion, the assistant " \
           "turns) lies beyond it" in caplog.text
    assert "records train no token" not in caplog.text  # (before the cut every record trained)
    with pytest.raises(DataError, match="no token carries a loss once the rows are cut to max_seq_length=16: what each "
                                        "record trains"):
        build(tok, write_jsonl(tmp_path / "all.jsonl", [long] * 3), packing=False, max_seq_length=16)


def test_untrained_records_are_counted_in_every_stored_chunk(tok, tmp_path, caplog):
    """Tokenized records whose labels are all -100, past the first stored chunk and in a held-out split (shuffled:
    the row named is the file's)."""
    from offload_trainer.data import _untrained_records

    records = [{"input_ids": [5, 6, 7], "labels": [5, -100, 7]} for _ in range(2500)]
    for i in (1200, 2400):
        records[i] = {"input_ids": [5, 6, 7], "labels": [-100, -100, -100]}
    path = write_jsonl(tmp_path / "t.jsonl", records)
    with caplog.at_level("WARNING", logger="offload_trainer"):
        train, _ = build(tok, path, packing=False)
    assert "2 of 2500 records train no token (the first: row 1201: every label of it is -100)" in caplog.text
    import datasets

    split = datasets.Dataset.from_list(records).train_test_split(test_size=0.5, seed=0)["train"]
    count, _, _ = _untrained_records(split.flatten_indices())
    assert count == sum(r["labels"] == [-100, -100, -100] for r in split)
    caplog.clear()
    with caplog.at_level("WARNING", logger="offload_trainer"):
        build(tok, path, packing=False, eval_fraction=0.5)
    rows_named = [int(w.split("row ")[1].split(":")[0]) for w in caplog.messages if "train no token" in w]
    assert rows_named and all(r in (1201, 2401) for r in rows_named)


# ---------------------------------------------------------------------------------------------------- packing
DOCS = [{"text": " ".join(["word"] * n) + " end"} for n in (3, 17, 8, 30, 5, 12, 1, 22)]


def test_bfd_packing_places_documents_as_trl_does(tok, tmp_path):
    """TRL's pack_dataset (bfd) is the oracle: the same documents in the same rows."""
    from datasets import Dataset
    from trl import pack_dataset

    path = write_jsonl(tmp_path / "d.jsonl", DOCS)
    packed = build(tok, path, max_seq_length=32)[0]
    ours = sorted(sorted(doc_lengths(r["position_ids"].tolist(), r["labels"].tolist())) for r in packed)
    docs = [ids for ids, _ in unpacked(tok, path, max_seq_length=32)]
    theirs = pack_dataset(Dataset.from_dict({"input_ids": docs}), seq_length=32, strategy="bfd")
    assert ours == sorted(sorted(r) for r in theirs["seq_lengths"])
    assert all(len(r["input_ids"]) == 32 for r in packed)


def doc_lengths(pos, labels):
    """Lengths of the documents of a packed row (a new one where positions restart), padding left out."""
    starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
    lengths = [b - a for a, b in zip(starts, starts[1:])]
    pad = sum(1 for lab in labels[starts[-2]:] if lab == IGNORE_INDEX) == lengths[-1]
    return lengths[:-1] if pad and len(lengths) > 1 else lengths


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_rows_train_exactly_as_the_documents_one_by_one(strategy, attn, tok, tmp_path):
    """The summed loss (and its gradient) over packed rows equals the sum over each document run alone: no attention
    across a boundary, no document's first token predicted from another's last. bfd_split / wrapped cut the longest
    document: its pieces are documents of their own, so the reference runs the pieces."""
    from transformers import AutoModelForCausalLM

    from offload_trainer.models import architecture_config

    torch.manual_seed(0)
    cfg = architecture_config("tiny-llama", {"num_hidden_layers": 2})
    cfg._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path = write_jsonl(tmp_path / "d.jsonl", DOCS)
    packed = build(tok, path, max_seq_length=24, packing_strategy=strategy)[0]

    def summed(ids, labels, pos=None):
        out = model(input_ids=torch.tensor([ids]), position_ids=None if pos is None else torch.tensor([pos]),
                    use_cache=False)  # (as in training: with a cache transformers does not detect packed rows)
        logits = out.logits[0, :-1].float()
        return torch.nn.functional.cross_entropy(logits, torch.tensor(labels[1:]), reduction="sum",
                                                 ignore_index=IGNORE_INDEX)

    total = sum(summed(r["input_ids"].tolist(), r["labels"].tolist(), r["position_ids"].tolist()) for r in packed)
    pieces = []
    for r in packed:  # the documents as placed (for bfd: whole, or cut to the row when longer)
        ids, pos = r["input_ids"].tolist(), r["position_ids"].tolist()
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
        pieces += [ids[a:b] for a, b in zip(starts, starts[1:]) if any(lab != IGNORE_INDEX
                                                                        for lab in r["labels"].tolist()[a + 1:b])]
    alone = sum(summed(p, p) for p in pieces)
    torch.testing.assert_close(total, alone, rtol=1e-5, atol=1e-4)
    whole = [ids for ids, _ in unpacked(tok, path, max_seq_length=1000)]
    if strategy == "bfd":  # documents not longer than a row arrive whole
        assert sorted(map(tuple, (p for p in pieces if len(p) < 24))) == sorted(
            tuple(d) for d in whole if len(d) < 24)
    else:  # no token lost
        assert sum(map(len, pieces)) == sum(map(len, whole))


def test_unpacked_rows_are_padded_per_batch(tok, tmp_path):
    from offload_trainer.data import data_collator

    path = write_jsonl(tmp_path / "d.jsonl", DOCS[:3])
    args = DataArguments(dataset_path=str(path), max_seq_length=64, packing=False)
    train, _ = build_datasets(args, tok, vocab_size=512)
    batch = data_collator(args, tok)([train[i] for i in range(3)])
    lengths = [len(train[i]["input_ids"]) for i in range(3)]
    assert len(set(lengths)) == 3 and batch["input_ids"].shape == (3, -(-max(lengths) // 8) * 8)  # a multiple of 8
    assert batch["attention_mask"].sum(1).tolist() == lengths
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE_INDEX).all()


@pytest.mark.parametrize("packing", [True, False])
def test_rows_do_not_go_through_datasets_tensor_formatters(packing, tok, tmp_path, monkeypatch):
    """datasets' torch and numpy formatters (datasets <= 4.5, LLaMA-Factory's pin among them) import
    `torchvision.io.VideoReader` on every row once torchvision is loaded, and torchvision 0.26 removed it: those
    formatters fail here as they do there, and the rows and their batches must not need them."""
    from datasets.formatting import np_formatter, torch_formatter

    from offload_trainer.data import data_collator

    args = DataArguments(dataset_path=str(write_jsonl(tmp_path / "d.jsonl", DOCS[:3])), max_seq_length=64,
                         packing=packing)
    train, _ = build_datasets(args, tok, vocab_size=512)
    expected = rows(train.with_format("torch", dtype=torch.long))  # (the reference: datasets' own, where it works)

    def no_video_reader(*a, **k):
        raise ImportError("cannot import name 'VideoReader' from 'torchvision.io'")

    for formatter in (torch_formatter.TorchFormatter, np_formatter.NumpyFormatter):
        for method in ("format_row", "format_column", "format_batch"):
            monkeypatch.setattr(formatter, method, no_video_reader)
    assert rows(train) == expected and all(r["input_ids"].dtype == torch.long for r in train)
    batch = data_collator(args, tok)([train[i] for i in range(len(train))])
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long and len(batch["input_ids"]) == len(train)


# ---------------------------------------------------------------------------------------------------- splits, cache
def test_eval_fraction_holds_out_random_records(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"record number {i}"} for i in range(40)])
    train, ev = build(tok, path, eval_fraction=0.25, packing=False)
    texts = sorted(tok.decode(r["input_ids"]) for r in ev)
    assert len(ev) == 10 and len(train) == 30
    assert texts != sorted(f"record number {i}<|endoftext|>" for i in range(30, 40))  # not the file's last records


def test_eval_fraction_leaving_no_training_rows(tok, tmp_path):
    """An eval_fraction that holds out every record (3 records at 0.7 or 0.99): one sentence naming the largest that
    works (was datasets' ValueError traceback); the largest that leaves one record trains on it."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"record number {i}"} for i in range(3)])
    for frac in (0.7, 0.99):
        with pytest.raises(DataError, match=r"holds out all of them, leaving none to train on: use eval_fraction below "
                                            r"0\.667"):
            build(tok, path, eval_fraction=frac, packing=False)
    train, ev = build(tok, path, eval_fraction=0.6, packing=False)
    assert (len(train), len(ev)) == (1, 2)


def test_the_cache_is_reused_by_a_second_run(tok, tmp_path, monkeypatch):
    """A second build of the same data (a new run, a resume, another rank) tokenizes nothing: measured by counting
    the tokenizer's batch calls."""
    import offload_trainer.data as data_mod

    calls = []
    real = data_mod.tokenize_batch

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(data_mod, "tokenize_batch", counted)
    path = write_jsonl(tmp_path / "d.jsonl", DOCS * 50)
    first = rows(build(tok, path)[0])
    assert calls
    n = len(calls)
    second = rows(build(tok, path)[0])
    assert len(calls) == n and second == first
    write_jsonl(path, DOCS * 51)  # the file changed: tokenized again
    build(tok, path)
    assert len(calls) > n


def test_parallel_tokenization_gives_the_same_rows(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", DOCS * 30)
    assert rows(build(tok, path, dataset_num_proc=2)[0]) == rows(build(tok, path)[0])


def test_streaming_gives_the_same_rows(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", DOCS * 5)
    streamed, _ = build(tok, path, streaming=True)
    assert isinstance(streamed, torch.utils.data.IterableDataset) or not hasattr(streamed, "__len__")
    assert rows(streamed) == rows(build(tok, path)[0])


def test_tokenizer_bigger_than_model_vocab(tok):
    with pytest.raises(DataError, match="model's vocabulary has 100"):
        build_datasets(DataArguments(max_seq_length=64), tok, vocab_size=100)


def test_builtin_corpora(tok):
    train, ev = build_datasets(DataArguments(max_seq_length=64, eval_fraction=0.1), tok, vocab_size=512)
    assert len(train) > 100 and len(ev) >= 1
    sft, _ = build_datasets(DataArguments(dataset_path="builtin-sft", max_seq_length=64), tok, vocab_size=512)
    labels = sft[0]["labels"]
    assert (labels == IGNORE_INDEX).any() and (labels != IGNORE_INDEX).any()  # loss on completions only


def test_interrupt_while_tokenizing_in_parallel(tok, tmp_path, monkeypatch):
    """Ctrl-C while 2 processes tokenize: the pool's workers are terminated mid-write; the temporary files they were
    writing in the cache are removed, and the interrupt itself goes on up (not datasets' TimeoutError), for the
    command's sentence."""
    import signal
    import threading
    import time

    import datasets

    import offload_trainer.data as data_mod

    started = tmp_path / "started"
    real = data_mod.tokenize_batch
    calls = [0]  # (per process: each worker has its own copy)

    def slow(*a, **k):
        calls[0] += 1
        if calls[0] > 1:  # a worker has written its first batch: its temporary file is open
            started.touch()
            time.sleep(30)
        return real(*a, **k)

    def interrupt_once_started():
        for _ in range(600):
            if started.exists():
                time.sleep(0.5)
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.05)

    monkeypatch.setattr(data_mod, "tokenize_batch", slow)
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"{i} {tmp_path}"} for i in range(4000)])  # (never cached)
    cache = os.path.join(datasets.config.HF_DATASETS_CACHE, "offload_trainer")
    os.makedirs(cache, exist_ok=True)
    before = set(os.listdir(cache))
    # (a process started in the background by a non-interactive shell, as CI runs the tests, ignores SIGINT)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt_once_started, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            build(tok, path, dataset_num_proc=2)
    finally:
        signal.signal(signal.SIGINT, old)
    assert started.exists()
    assert [n for n in set(os.listdir(cache)) - before if n.startswith("tmp")] == []
