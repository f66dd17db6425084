"""`use_liger_kernel` with OffloadTrainer: Liger's kernels patch the model as they do under the stock Trainer, and the
chunked loss steps aside for Liger's fused linear cross-entropy (calling the decoder and head itself would drop it).
Liger's kernels are Triton: GPU only."""
import logging

import pytest
import torch
from transformers import Trainer, TrainingArguments

from helpers import tiny_setup
from offload_trainer import OffloadTrainer, OffloadTrainingArguments
from offload_trainer.trainer import mixin as trainer_module
from offload_trainer.trainer.args import HAS_ACTIVATION_CHECKPOINTING

pytestmark = pytest.mark.gpu


@pytest.fixture
def liger_patches_undone():
    """Liger patches transformers' Llama module itself (RMSNorm, MLP and RoPE for every later model, as under the
    stock Trainer): undone after the test, so later tests in this process build plain models."""
    from transformers.models.llama import modeling_llama

    saved = dict(vars(modeling_llama))
    yield
    for name, value in saved.items():
        setattr(modeling_llama, name, value)


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _train(tmp_path, name, cls, args_cls, **kw):
    model, _, train = tiny_setup(layers=4, seq=64, seed=0)
    args = args_cls(output_dir=str(tmp_path / name), max_steps=12, per_device_train_batch_size=4, learning_rate=3e-3,
                    logging_steps=1, save_strategy="no", report_to="none", seed=0, **kw)
    args._n_gpu = min(args.n_gpu, 1)
    trainer = cls(model=model, args=args, train_dataset=train)
    trainer.train()
    return trainer


# (transformers 5.24 renamed the stock Trainer's switch; ours takes activation_checkpointing on every version)
STOCK_CHECKPOINTING = {"activation_checkpointing" if HAS_ACTIVATION_CHECKPOINTING else "gradient_checkpointing": True}


def test_gpu_use_liger_kernel_trains_with_liger_loss_as_the_stock_trainer(tmp_path, monkeypatch, caplog,
                                                                          liger_patches_undone):
    pytest.importorskip("liger_kernel")
    if not torch.cuda.is_available():
        pytest.skip("Liger's kernels need a GPU")
    chunked_calls = []
    real = trainer_module.chunked_causal_lm_loss
    monkeypatch.setattr(trainer_module, "chunked_causal_lm_loss",
                        lambda *a, **k: chunked_calls.append(1) or real(*a, **k))

    plain = _train(tmp_path, "plain", OffloadTrainer, OffloadTrainingArguments, layer_swap="2", max_grad_norm=0.0,
                   activation_checkpointing=True)
    assert chunked_calls, "without Liger the chunked loss computes the loss"
    chunked_calls.clear()
    with caplog.at_level(logging.INFO, logger="offload_trainer"):
        ours = _train(tmp_path, "ours", OffloadTrainer, OffloadTrainingArguments, layer_swap="2", max_grad_norm=0.0,
                      activation_checkpointing=True, use_liger_kernel=True)
    stock = _train(tmp_path, "stock", Trainer, TrainingArguments, use_liger_kernel=True, max_grad_norm=0.0,
                   optim="adamw_torch", **STOCK_CHECKPOINTING)

    assert not chunked_calls, "with Liger's fused linear cross-entropy bound, the chunked loss must step aside"
    assert trainer_module._liger_computes_loss(ours.model)  # Liger bound its forward, and ours still trains with it
    mlp = ours.model.model.layers[0].mlp
    assert mlp._get_name() == "LigerSwiGLUMLP"  # the swapped layers' modules were patched too
    assert ours._run.swap is not None and ours._run.swap.stats["loads"] > 0
    assert "loss_chunk_size steps aside" in caplog.text

    got, want, unfused = _losses(ours), _losses(stock), _losses(plain)
    assert len(got) == len(want) == len(unfused) == 12
    # The first step's loss is computed before any update: the same weights and batch through Liger's kernels.
    assert abs(got[0] - want[0]) < 1e-4
    assert abs(got[0] - unfused[0]) < 1e-3  # and the same loss as the chunked one
    # Then 8-bit streamed AdamW against fp32 AdamW: close, and training.
    assert max(abs(a - b) / b for a, b in zip(got, want)) < 0.03
    assert got[-1] < 0.8 * got[0]
