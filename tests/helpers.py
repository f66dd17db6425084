"""Shared fixtures for Trainer-level tests: a tiny Llama and the built-in corpus, all offline."""
from offload_trainer.cli.run_args import DataArguments, ModelArguments
from offload_trainer.data import build_datasets
from offload_trainer.models import load_model, load_tokenizer


def tiny_setup(seq=64, layers=2, seed=0):
    import torch

    torch.manual_seed(seed)
    margs = ModelArguments(model_config="tiny-llama", torch_dtype="float32",
                           model_overrides={"num_hidden_layers": layers})
    tok = load_tokenizer(margs)
    model = load_model(margs)
    train, _ = build_datasets(DataArguments(max_seq_length=seq), tok, vocab_size=model.config.vocab_size)
    return model, tok, train


def readme_yaml(tag: str) -> dict:
    """The README's YAML block fenced as ```yaml TAG (the lines a user adds to another tool's config), as a dict."""
    import os
    import re

    import yaml

    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    return yaml.safe_load(re.search(rf"```yaml {tag}\n(.*?)```", readme, re.S).group(1))


def save_tiny_base(path) -> None:
    """A tiny Llama and its tokenizer saved where another tool loads a checkpoint from (once per path)."""
    if not path.exists():
        model, tok, _ = tiny_setup(seed=0)
        model.save_pretrained(path)
        tok.save_pretrained(path)


# alpaca-format records, short enough for a 64-token block
SUM_ROWS = [{"instruction": f"What is {a} plus {b}?", "input": "", "output": f"{a} plus {b} is {a + b}."}
            for a in range(8) for b in range(8)]


def assert_same_course(got: list[float], want: list[float], steps: int = 6) -> None:
    """Another tool's run with our wiring against the same run without it: the first loss equal (same weights, data
    and seed), the course close (streamed 8-bit AdamW against torch's fp32 AdamW), and the loss falling."""
    import pytest

    print("with offload_trainer", got, "\nwithout", want)
    assert len(got) == len(want) == steps
    assert got[0] == pytest.approx(want[0], abs=1e-4)
    assert max(abs(a - b) / b for a, b in zip(got, want)) < 0.05
    assert got[-1] < 0.8 * got[0]
