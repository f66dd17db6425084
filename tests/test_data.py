import json

import pytest

from offload_trainer.args import DataArguments, ModelArguments
from offload_trainer.data import IGNORE_INDEX, DataError, build_datasets, pack
from offload_trainer.models import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelArguments(model_config="tiny-llama"))


def test_pack_pads_the_last_block_instead_of_dropping_it():
    blocks = pack(list(range(10)), list(range(10)), 4, pad_id=99)
    assert len(blocks) == 3
    assert blocks[2]["input_ids"].tolist() == [8, 9, 99, 99]
    assert blocks[2]["labels"].tolist() == [8, 9, IGNORE_INDEX, IGNORE_INDEX]
    assert blocks[2]["attention_mask"].tolist() == [1, 1, 0, 0]


def test_builtin_corpus_and_sft(tok):
    train, ev = build_datasets(DataArguments(max_seq_length=64, eval_fraction=0.1), tok, vocab_size=512)
    assert len(train) > 100 and len(ev) >= 1
    sft, _ = build_datasets(DataArguments(dataset_path="builtin-sft", max_seq_length=64), tok, vocab_size=512)
    labels = sft[0]["labels"]
    assert (labels == IGNORE_INDEX).any() and (labels != IGNORE_INDEX).any()  # loss on completions only


def test_prompt_completion_masks_the_prompt(tmp_path, tok):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": "What is 2 plus 2?", "completion": " 4."}) + "\n")
    train, _ = build_datasets(DataArguments(dataset_path=str(p), max_seq_length=32), tok, vocab_size=512)
    ids, labels = train[0]["input_ids"].tolist(), train[0]["labels"].tolist()
    n_prompt = len(tok("What is 2 plus 2?", add_special_tokens=False)["input_ids"])
    assert labels[:n_prompt] == [IGNORE_INDEX] * n_prompt
    assert labels[n_prompt] == ids[n_prompt]


def test_chat_messages_use_the_template(tmp_path, tok):
    p = tmp_path / "chat.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": "hello"}]}) + "\n")
    train, _ = build_datasets(DataArguments(dataset_path=str(p), max_seq_length=32), tok, vocab_size=512)
    assert "<|assistant|>" in tok.decode(train[0]["input_ids"])


@pytest.mark.parametrize("content, needle", [
    ('{"text": "ok"}\n{bad json\n', "d.jsonl:2: not valid JSON"),
    ('{"text": "ok"}\n[1, 2]\n', "d.jsonl:2: expected a JSON object"),
    ('{"body": "x"}\n', "d.jsonl:1: record has keys ['body']"),
    ("\n\n", "no records (the file is empty)"),
])
def test_bad_records_name_file_and_line(tmp_path, tok, content, needle):
    p = tmp_path / "d.jsonl"
    p.write_text(content)
    with pytest.raises(DataError, match=None) as e:
        build_datasets(DataArguments(dataset_path=str(p), max_seq_length=32), tok, vocab_size=512)
    assert needle in str(e.value)


def test_chat_without_template_is_a_clear_error(tmp_path, tok):
    p = tmp_path / "chat.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    tok2 = load_tokenizer(ModelArguments(model_config="tiny-llama"))
    tok2.chat_template = None
    with pytest.raises(DataError, match="need a tokenizer with a chat template"):
        build_datasets(DataArguments(dataset_path=str(p), max_seq_length=32), tok2, vocab_size=512)


def test_tokenizer_bigger_than_model_vocab(tok):
    with pytest.raises(DataError, match="model's vocabulary has 100"):
        build_datasets(DataArguments(max_seq_length=64), tok, vocab_size=100)
