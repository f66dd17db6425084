"""Speculative clipping through OffloadTrainer (the Trainer's default max_grad_norm): the same run as exact clipping --
losses, logged norms, learning rates, weights and optimizer states -- with the clip firing on some steps, and the
log's clip figures."""
import logging
import statistics

import pytest
import torch

from helpers import tiny_setup
from offload_trainer import OffloadTrainer, OffloadTrainingArguments, run_history


def train(tmp_path, name, *, speculative, max_grad_norm, accum=1, steps=12, **kw):
    model, tok, data = tiny_setup()
    args = OffloadTrainingArguments(
        output_dir=str(tmp_path / name), max_steps=steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=accum, learning_rate=3e-3, warmup_steps=3, logging_steps=1, save_strategy="no",
        report_to="none", offload_optimizer=True, max_grad_norm=max_grad_norm, speculative_clipping=speculative,
        seed=0, **kw)
    trainer = OffloadTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    trainer.train()
    return trainer, [h for h in run_history(trainer) if "loss" in h]


SWAP_AND_OFFLOAD = dict(layer_swap="1", activation_offload=True, activation_checkpointing=True)


@pytest.mark.parametrize("accum,kw", [(1, {}), (2, {}), (1, SWAP_AND_OFFLOAD)],
                         ids=["one_micro_batch", "accumulation", "layer_swap_and_activation_offload"])
def test_speculative_clipping_trains_as_exact_clipping(tmp_path, accum, kw, caplog):
    """(With layer swap and activation offload: a redo fetches the swapped layers and offloads the checkpoints again,
    and the rollback restores a swapped layer's weights where it is.)"""
    _, free = train(tmp_path, "free", speculative=False, max_grad_norm=1e9, accum=accum, **kw)
    max_norm = statistics.median(h["grad_norm"] for h in free)  # about half the steps clip
    exact, a = train(tmp_path, "exact", speculative=False, max_grad_norm=max_norm, accum=accum, **kw)
    with caplog.at_level(logging.INFO, logger="offload_trainer"):
        spec, b = train(tmp_path, "spec", speculative=True, max_grad_norm=max_norm, accum=accum, **kw)
    if kw:
        assert spec._run.swap is not None and spec._run.activations is not None
    assert spec._run.optimizer.speculative and not exact._run.optimizer.speculative
    for key in ("loss", "grad_norm", "learning_rate"):
        assert [h[key] for h in a] == [h[key] for h in b], key
    fired = [max_norm / (h["grad_norm"] + 1e-6) < 1 for h in a]  # (torch's coefficient under 1)
    assert 0 < sum(fired) < len(a)
    for (name, x), y in zip(exact.model.state_dict().items(), spec.model.state_dict().values()):
        assert torch.equal(x, y), name
    sa, sb = exact.optimizer.state_dict(), spec.optimizer.state_dict()
    for x, y in zip(sa["state"].values(), sb["state"].values()):
        assert all(torch.equal(getattr(x[k], "codes", x[k]), getattr(y[k], "codes", y[k]))
                   for k in ("exp_avg", "exp_avg_sq"))
    # the log: the share of steps whose clip fired, and how many were redone / clipped exactly
    assert [h["clip_rate"] for h in b] == [float(f) for f in fired]
    counts = spec._run.optimizer.clip_counts
    assert sum(h["redone_steps"] for h in b) == counts["redone"] >= 1
    assert sum(h["exact_clip_steps"] for h in b) == counts["exact"]
    assert counts["redone"] + counts["exact"] >= counts["clipped"]
    lines = [r.getMessage() for r in caplog.records]
    assert any("max_grad_norm speculatively" in m for m in lines)
    assert sum(m.startswith("step ") and "| redone" in m for m in lines) == len(b)


def test_a_nan_loss_is_rolled_back_and_skipped(tmp_path):
    """The step's updates ran in backward before its NaN was seen: undone, the step counted as skipped, training goes
    on from the last finite step's weights."""
    from transformers import TrainerCallback

    nan = {"on": False}

    class NanAt(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            nan["on"] = state.global_step == 3

    model, tok, data = tiny_setup()
    model.model.embed_tokens.register_forward_hook(lambda m, i, out: out * float("nan") if nan["on"] else out)
    args = OffloadTrainingArguments(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4,
                                    logging_steps=1, save_strategy="no", report_to="none", offload_optimizer=True,
                                    max_grad_norm=100.0, speculative_clipping=True)  # (never clips: all speculative)
    trainer = OffloadTrainer(model=model, args=args, train_dataset=data, processing_class=tok, callbacks=[NanAt()])
    seen = {}

    def snapshot(step):
        trainer._run.optimizer.synchronize()
        seen[step] = [p.detach().clone() for p in model.parameters()]

    class Snap(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            snapshot(state.global_step)

    trainer.add_callback(Snap())
    trainer.train()
    logs = [h for h in run_history(trainer) if "loss" in h]
    counts = trainer._run.optimizer.clip_counts
    assert logs[-1]["nonfinite_skipped"] == 1 and counts["nonfinite"] == 1 and counts["exact"] == 0
    assert all(torch.equal(a, b) for a, b in zip(seen[3], seen[4]))  # step 4 (the NaN) changed nothing
    assert not all(torch.equal(a, b) for a, b in zip(seen[4], seen[5]))
