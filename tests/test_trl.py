"""OffloadSFTTrainer: TRL's SFTTrainer with the same wiring (the mixin)."""
import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is an optional extra: pip install 'offload-trainer[trl]'")

from helpers import tiny_setup  # noqa: E402
from offload_trainer import StreamedAdamW8bit  # noqa: E402
from offload_trainer.trl import OffloadSFTConfig, OffloadSFTTrainer  # noqa: E402


def test_sft_trainer_with_offload(tmp_path):
    model, tok, _ = tiny_setup()
    from datasets import Dataset

    ds = Dataset.from_list([{"prompt": f"What is {a} plus {b}?", "completion": f" {a} plus {b} equals {a + b}."}
                            for a in range(6) for b in range(6)])
    args = OffloadSFTConfig(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=4, learning_rate=3e-3,
                            logging_steps=4, save_strategy="no", report_to="none", max_length=64, bf16=False,
                            offload_optimizer=True)  # (on a CPU the streamed optimizer runs when asked for)
    trainer = OffloadSFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    trainer.train()
    assert isinstance(trainer._offload_opt, StreamedAdamW8bit)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_offload_sft_config_keeps_sftconfig_defaults_and_checks_our_switches(tmp_path):
    import dataclasses

    kw = dict(output_dir=str(tmp_path), report_to="none", bf16=False)  # (SFTConfig's bf16 default needs a GPU)
    ours, theirs = OffloadSFTConfig(**kw), trl.SFTConfig(**kw)
    for f in dataclasses.fields(trl.SFTConfig):  # every SFTConfig field, and its default, as TRL has it
        assert getattr(ours, f.name) == getattr(theirs, f.name), f.name
    assert ours.offload_optimizer is None and ours.layer_swap == "off" and ours.loss_chunk_size == 1024
    assert ours.gradient_checkpointing  # SFTConfig's default: on
    with pytest.raises(ValueError, match="offload_chunk_numel=1000: use a multiple of 256"):
        OffloadSFTConfig(**kw, offload_chunk_numel=1000)
    with pytest.raises(ValueError, match="offload_optimizer=True streams 8-bit AdamW states, but optim='sgd'"):
        OffloadSFTConfig(**kw, optim="sgd", offload_optimizer=True)
