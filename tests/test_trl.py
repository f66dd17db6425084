"""OffloadSFTTrainer: TRL's SFTTrainer with the same wiring (the mixin)."""
import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is an optional extra: pip install 'offload-trainer[trl]'")

from helpers import tiny_setup  # noqa: E402
from offload_trainer import StreamedAdamW8bit  # noqa: E402
from offload_trainer.trl import OffloadSFTTrainer  # noqa: E402


def test_sft_trainer_with_offload(tmp_path):
    model, tok, _ = tiny_setup()
    from datasets import Dataset

    ds = Dataset.from_list([{"prompt": f"What is {a} plus {b}?", "completion": f" {a} plus {b} equals {a + b}."}
                            for a in range(6) for b in range(6)])
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=4, learning_rate=3e-3,
                         logging_steps=4, save_strategy="no", report_to="none", max_length=64, bf16=False)
    trainer = OffloadSFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    trainer.train()
    assert isinstance(trainer._offload_opt, StreamedAdamW8bit)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert all(torch.isfinite(p).all() for p in model.parameters())
