"""Gradient accumulation's micro-batches run as one (trainer/fold.py): the folded run against the unfolded run of the same
class and optimizer -- the same losses, gradient norms, weights, epoch and tokens seen -- for packed rows, padded rows
of different lengths and a last step with fewer micro-batches; where the result would differ, nothing folds; a resume
that changes the fold continues the same run. The fold is forced by its key (`fold_accumulation`) or by a plan handed
to the Trainer: on a CPU the planner makes no plan (it plans GPU memory), so `auto` folds nothing here."""
import json

import pytest
import torch
from torch import nn

from helpers import tiny_setup
from offload_trainer import OffloadTrainer, OffloadTrainingArguments
from offload_trainer.data.packing import PaddingCollator
from offload_trainer.errors import ConfigError
from offload_trainer.planner import Plan
from offload_trainer.trainer.fold import PADDING, Fold, concatenate

K = 4  # micro-batches per optimizer step


class Forwards:
    """The model's forwards: how many rows each ran (a forward pre-hook on the input embedding, which every path to
    the loss runs once per forward)."""

    def __init__(self, model):
        self.rows = []
        model.get_input_embeddings().register_forward_pre_hook(lambda m, a: self.rows.append(len(a[0])))


def padded_rows(train, n=30, seed=1):
    """`n` unpacked rows of 5-32 tokens (cut from packed rows: one document each, padded per batch)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        k = int(torch.randint(5, 33, (1,), generator=g))
        ids = list(train[i]["input_ids"][:k])
        out.append({"input_ids": ids, "labels": ids})
    return out


def run(tmp_path, name, *, fold, data="packed", rows=None, streamed=False, plan=None, model_fn=None, **kw):
    """A tiny fp32 Llama trained for 8 optimizer steps of K micro-batches of 1 row; the trainer, its forwards and
    its final weights."""
    model, tok, train = tiny_setup(seq=32, layers=1)
    collator = None
    if data == "padded":
        train, collator = padded_rows(train, n=rows or 8 * K), PaddingCollator(tok.pad_token_id)
    elif rows:
        train = torch.utils.data.Subset(train, range(rows))
    if model_fn is not None:
        model = model_fn(model)
    args = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=1, gradient_accumulation_steps=K,
                learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", seed=0, data_seed=0,
                max_grad_norm=1.0, include_num_input_tokens_seen="all", fold_accumulation=fold,
                offload_optimizer=streamed)
    args.update(kw)
    if "num_train_epochs" not in kw:
        args["max_steps"] = 8
    trainer = OffloadTrainer(model=model, args=OffloadTrainingArguments(**args), train_dataset=train,
                             data_collator=collator, offload_plan=plan)
    forwards = Forwards(model)
    trainer.train()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return trainer, forwards, weights


def logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


def assert_same_run(folded, unfolded):
    (ft, _, fw), (ut, _, uw) = folded, unfolded
    fl, ul = logs(ft), logs(ut)
    assert len(fl) == len(ul) > 0
    for a, b in zip(fl, ul):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), (fl, ul)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6), (fl, ul)
        assert (a["epoch"], a["num_input_tokens_seen"], a["step"]) == (b["epoch"], b["num_input_tokens_seen"], b["step"])
    assert ft.state.global_step == ut.state.global_step
    assert max((fw[n] - uw[n]).abs().max().item() for n in fw) < 1e-4


@pytest.mark.parametrize("data", ["packed", "padded"])
def test_folded_steps_equal_unfolded_ones(tmp_path, data):
    folded, unfolded = (run(tmp_path, f, fold=f, data=data) for f in ("4", "off"))
    assert_same_run(folded, unfolded)
    assert folded[1].rows == [K] * 8 and unfolded[1].rows == [1] * (8 * K)  # (it did fold)


def test_folded_in_pairs_with_the_streamed_optimizer_and_a_short_last_step(tmp_path):
    """fold 2 of 4 (two micro-batches of 2 per step: gradients still accumulate, in the streamed optimizer's no_update)
    over one epoch of 30 rows: 8 steps, the last of 2 micro-batches."""
    folded, unfolded = (run(tmp_path, f, fold=f, streamed=True, rows=30, num_train_epochs=1) for f in ("2", "off"))
    assert_same_run(folded, unfolded)
    assert folded[1].rows == [2] * 15 and unfolded[1].rows == [1] * 30
    assert logs(folded[0])[-1]["epoch"] == 1.0


class NoLossKwargs(nn.Module):
    """A causal LM whose forward takes no `num_items_in_batch`: its loss is a mean per micro-batch."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    def forward(self, input_ids, labels=None, position_ids=None, attention_mask=None):
        return self.inner(input_ids=input_ids, labels=labels, position_ids=position_ids, attention_mask=attention_mask)


def folding_plan(fold=K):
    return Plan(params=1, batch=fold, seq=32, clip=True, offload_gradients=False, lora_params=0,
                activation_offload=False, gpu_budget_gib=None, host_budget_gib=None, accum=K // fold, fold=fold,
                layers=1, resident_layers=1)


def test_a_plan_that_folds_is_run_and_dropped_where_the_result_would_differ(tmp_path, caplog):
    _, forwards, _ = run(tmp_path, "plan", fold="auto", plan=folding_plan())
    assert forwards.rows == [K] * 8
    with caplog.at_level("INFO", logger="offload_trainer"):
        _, forwards, _ = run(tmp_path, "plain", fold="auto", plan=folding_plan(), model_fn=NoLossKwargs)
    assert forwards.rows == [1] * (8 * K)
    assert "takes no num_items_in_batch" in caplog.text
    with pytest.raises(ConfigError, match="fold_accumulation: 4 would change the result.*num_items_in_batch"):
        run(tmp_path, "forced", fold="4", model_fn=NoLossKwargs)


def test_dropout_and_neftune_are_not_folded(tmp_path):
    for kw in (dict(neftune_noise_alpha=5.0), dict(model_fn=lambda m: (m.config.__setattr__("attention_dropout", 0.1),
                                                                        m)[1])):
        _, forwards, _ = run(tmp_path, "x", fold="auto", plan=folding_plan(), **kw)
        assert forwards.rows == [1] * (8 * K)


def test_a_resume_that_changes_the_fold_continues_the_same_run(tmp_path):
    whole = run(tmp_path, "whole", fold="off")
    run(tmp_path, "first", fold="off", save_strategy="steps", save_steps=4)
    model, _, train = tiny_setup(seq=32, layers=1)
    args = OffloadTrainingArguments(output_dir=str(tmp_path / "first"), per_device_train_batch_size=1,
                                    gradient_accumulation_steps=K, learning_rate=1e-3, logging_steps=1,
                                    save_strategy="no", report_to="none", seed=0, data_seed=0, max_steps=8,
                                    include_num_input_tokens_seen="all", fold_accumulation="4",
                                    offload_optimizer=False)
    resumed = OffloadTrainer(model=model, args=args, train_dataset=train)
    forwards = Forwards(model)
    resumed.train(resume_from_checkpoint=str(tmp_path / "first" / "checkpoint-4"))
    assert forwards.rows == [K] * 4
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    got, want = logs(resumed)[-4:], logs(whole[0])[-4:]
    for a, b in zip(got, want):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["step"] == b["step"]
        assert a["num_input_tokens_seen"] == b["num_input_tokens_seen"]
    assert max((weights[n] - whole[2][n]).abs().max().item() for n in weights) < 1e-4


def test_concatenate_pads_each_key_on_the_right():
    a = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.tensor([[1, 1, 1]]),
         "labels": torch.tensor([[5, 6, 7]]), "position_ids": torch.tensor([[0, 1, 2]])}
    b = {k: v[:, :2] for k, v in a.items()}
    out = concatenate([b, a])
    assert out["input_ids"].tolist() == [[5, 6, PADDING["input_ids"]], [5, 6, 7]]
    assert out["attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert out["labels"].tolist() == [[5, 6, -100], [5, 6, 7]]
    assert out["position_ids"].tolist() == [[0, 1, 0], [0, 1, 2]]
    with pytest.raises(ConfigError, match="'pixel_values'.*fold_accumulation: off"):
        concatenate([a, {**a, "pixel_values": torch.zeros(1, 3, 4, 4)}])
    fold = Fold(2)
    assert fold.add(a, last=False) is None and fold.add(b, last=False)["input_ids"].shape == (2, 3)
    assert fold.add(a, last=True) is a  # (the step's last: its group runs, whatever its size)


def test_the_command_folds_and_trains_the_same(tmp_path):
    from offload_trainer import cli

    states = {}
    for fold in ("4", "off"):
        out = tmp_path / fold
        cli.main(["train", "configs/tiny-cpu.yaml", f"output_dir={out}", "max_steps=4", "per_device_train_batch_size=2",
                  f"gradient_accumulation_steps={K}", f"fold_accumulation={fold}", "logging_steps=1",
                  "save_strategy=no", "eval_fraction=0", "eval_strategy=no"])
        states[fold] = [h for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    assert len(states["4"]) == 4
    for a, b in zip(states["4"], states["off"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"],
                                                                                                  rel=1e-6)
        assert a["epoch"] == b["epoch"]
