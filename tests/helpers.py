"""Shared fixtures for Trainer-level tests: a tiny Llama and the built-in corpus, all offline."""
from offload_trainer.args import DataArguments, ModelArguments
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
