"""OffloadTrainer against the stock Trainer, scenario by scenario: the same script run with each class, and what a
user can observe (logs, learning rates, callbacks, checkpoints, errors) compared. Where they differ on purpose the
README's "What differs from Trainer, and why" says so, and the test checks that difference and nothing else.

The reference runs torch's AdamW (`adamw_torch`), ours its 8-bit streamed AdamW: values that depend on the optimizer's
arithmetic (losses) are compared with a tolerance, everything else exactly."""
import json
import logging
import math

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from helpers import tiny_setup
from offload_trainer import OffloadTrainer, OffloadTrainingArguments, StreamedAdamW8bit, run_history
from offload_trainer.errors import ConfigError

# Keys our training logs add to the Trainer's (throughput and memory; the README lists them): in the logs the callbacks
# get and in run_figures.json, never in the Trainer's log history.
OUR_LOG_KEYS = {"tok_per_s", "host_rss_gib", "gpu_peak_gib", "pcie_gb_per_s", "host_pinned_gib", "gpu_stall_ms",
                "nonfinite_skipped"}


class Streamed(TrainingArguments):
    """The stock arguments, asking for the streamed optimizer (on a CPU it runs only when asked for; on a GPU plain
    TrainingArguments get it by default): what a Trainer script sees, with the optimizer under test."""

    offload_optimizer = True


def args_for(out, cls=TrainingArguments, **kw):
    base = dict(output_dir=str(out), max_steps=6, per_device_train_batch_size=2, learning_rate=3e-3,
                logging_steps=1, save_strategy="no", report_to="none", seed=0, data_seed=0, optim="adamw_torch")
    base.update(kw)
    return cls(**base)


def pair(tmp_path, *, trainer_kw=None, setup_kw=None, ours=Streamed, **kw):
    """(stock Trainer, OffloadTrainer) over the same tiny model, data and TrainingArguments (`ours`: the arguments
    class of our side)."""
    out = []
    for name, cls in (("stock", Trainer), ("ours", OffloadTrainer)):
        model, tok, train = tiny_setup(**{"seq": 32, "layers": 1, **(setup_kw or {})})
        extra = trainer_kw(model) if callable(trainer_kw) else dict(trainer_kw or {})
        if kw.get("eval_strategy", "no") != "no":
            extra.setdefault("eval_dataset", small(train))
        args = args_for(tmp_path / name, ours if cls is OffloadTrainer else TrainingArguments, **kw)
        t = cls(model=model, args=args, train_dataset=train, **extra)
        out.append(t)
    return out


def small(ds, n=8):
    return torch.utils.data.Subset(ds, range(n))


def train_logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


class LrSnapshots(TrainerCallback):
    """What a user's callback sees: the optimizer's param groups' lr and the scheduler's last lr, at every step end,
    written into the logs too (a custom callback logging `_last_lr`)."""

    def __init__(self):
        self.seen = []

    def on_step_end(self, args, state, control, optimizer=None, lr_scheduler=None, **kw):
        self.seen.append(([g["lr"] for g in optimizer.param_groups], list(lr_scheduler._last_lr)))

    def on_log(self, args, state, control, logs=None, lr_scheduler=None, **kw):
        if logs is not None and "loss" in logs:  # (the history holds a copy of `logs`)
            state.log_history[-1]["last_lr"] = lr_scheduler._last_lr[0]


SCHEDULES = {
    "cosine_with_min_lr": dict(lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": 1e-4},
                               warmup_steps=2),
    "warmup_stable_decay": dict(lr_scheduler_type="warmup_stable_decay",
                                lr_scheduler_kwargs={"num_decay_steps": 2}, warmup_steps=2),
    # lr small enough that no evaluation improves by the plateau's threshold (half the loss): both runs halve it at
    # every evaluation after the first
    "reduce_lr_on_plateau": dict(lr_scheduler_type="reduce_lr_on_plateau", learning_rate=1e-6,
                                 lr_scheduler_kwargs={"patience": 0, "factor": 0.5, "threshold": 0.5},
                                 eval_strategy="steps",
                                 eval_steps=1, metric_for_best_model="eval_loss"),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.slow
def test_schedulers_log_and_checkpoint_floats_as_the_trainer_does(tmp_path, schedule):
    snaps = {}

    def kw(model):
        return {"callbacks": [LrSnapshots()]}

    stock, ours = pair(tmp_path, trainer_kw=kw, save_strategy="steps", save_steps=3, **SCHEDULES[schedule])
    for t in (stock, ours):
        t.train()
        snaps[t] = next(c for c in t.callback_handler.callbacks if isinstance(c, LrSnapshots)).seen
    # lr: a Python float everywhere a user looks, the same numbers as the Trainer's
    for t in (stock, ours):
        assert all(type(lr) is float for groups, last in snaps[t] for lr in groups + last), snaps[t]
    assert snaps[ours] == snaps[stock]
    assert [h["learning_rate"] for h in train_logs(ours)] == [h["learning_rate"] for h in train_logs(stock)]
    assert [h["last_lr"] for h in train_logs(ours)] == [h["last_lr"] for h in train_logs(stock)]
    # checkpoints were written (trainer_state.json serialized every log) and read back the same
    for t in (stock, ours):
        state = json.loads((tmp_path / ("stock" if t is stock else "ours") / "checkpoint-6" /
                            "trainer_state.json").read_text())
        assert state["global_step"] == 6 and state["log_history"] == json.loads(json.dumps(t.state.log_history[:-1]))
    if schedule == "reduce_lr_on_plateau":
        lrs = [h["learning_rate"] for h in train_logs(ours)]
        assert lrs[-1] < lrs[0]  # the plateau did act


def test_log_history_has_the_trainers_keys_and_types_and_ours_come_beside_it(tmp_path):
    """The log history is the Trainer's (its keys, their types); our figures go to the callbacks with each training
    log and into run_figures.json, and run_history() puts them together."""
    stock, ours = pair(tmp_path, max_grad_norm=1.0, save_strategy="steps", save_steps=3)
    seen = []

    class Seen(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            seen.append(dict(logs))

    ours.add_callback(Seen())
    for t in (stock, ours):
        t.train()
    assert len(stock.state.log_history) == len(ours.state.log_history)
    for a, b in zip(stock.state.log_history, ours.state.log_history):
        assert set(b) == set(a)
        for k in a:
            assert type(a[k]) is type(b[k]), (k, a[k], b[k])
    train = [h for h in run_history(ours) if "loss" in h]
    assert len(train) == 6 and all({"tok_per_s", "host_rss_gib"} <= set(h) <= set(train_logs(stock)[0]) | OUR_LOG_KEYS
                                   for h in train)
    assert [h for h in seen if "loss" in h] == [{k: v for k, v in h.items() if k != "step"} for h in train]
    saved = run_history(str(tmp_path / "ours" / "checkpoint-6"))  # (a checkpoint's state: its figures beside it)
    assert saved == [h for h in run_history(ours) if "train_runtime" not in h]
    (first_a, *_), (first_b, *_) = train_logs(stock), train_logs(ours)
    assert first_b["loss"] == pytest.approx(first_a["loss"], rel=1e-5)  # the same start: before any update
    assert first_b["grad_norm"] == pytest.approx(first_a["grad_norm"], rel=1e-4)
    for a, b in zip(train_logs(stock), train_logs(ours)):
        assert b["learning_rate"] == a["learning_rate"] and b["epoch"] == a["epoch"] and b["step"] == a["step"]
        assert b["loss"] == pytest.approx(a["loss"], rel=0.1)  # 8-bit vs fp32 AdamW states after that


def test_weight_decay_groups_and_learning_rates_match(tmp_path):
    stock, ours = pair(tmp_path, weight_decay=0.1, max_steps=1)
    for t in (stock, ours):
        t.train()
    assert isinstance(ours.optimizer.optimizer, StreamedAdamW8bit)

    def groups(t):
        return [(g["weight_decay"], [id(p) for p in g["params"]] and len(g["params"]))
                for g in t.optimizer.param_groups]

    assert groups(ours) == groups(stock)
    assert ours.get_learning_rates() == stock.get_learning_rates()
    assert all(type(lr) is float for lr in ours.get_learning_rates())


class Recorder(TrainerCallback):
    def __init__(self):
        self.events = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            events = object.__getattribute__(self, "events")
            return lambda args, state, control, **kw: events.append((name, state.global_step))
        return object.__getattribute__(self, name)


def test_callbacks_are_the_trainers_and_fire_in_the_same_order(tmp_path):
    stock, ours = pair(tmp_path, trainer_kw=lambda m: {"callbacks": [Recorder()]}, gradient_accumulation_steps=2,
                       max_steps=3, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2)
    for t in (stock, ours):
        t.train()
    kinds = [[type(c).__name__ for c in t.callback_handler.callbacks] for t in (stock, ours)]
    assert kinds[0] == kinds[1]
    rec = [next(c for c in t.callback_handler.callbacks if isinstance(c, Recorder)).events for t in (stock, ours)]
    assert rec[0] == rec[1] and ("on_step_end", 3) in rec[0]
    assert "on_step_end" not in ours.callback_handler.__dict__  # our step-end decisions are gone after train()


# ------------------------------------------------------------------------------------------ optimizer choices
@pytest.mark.parametrize("optim", ["sgd", "adafactor", "rmsprop"])
def test_a_non_adamw_optim_runs_the_trainers_own_and_says_so(tmp_path, optim, caplog):
    stock, ours = pair(tmp_path, optim=optim, max_steps=3, learning_rate=1e-2, ours=TrainingArguments)
    with caplog.at_level(logging.INFO, logger="offload_trainer"):
        for t in (stock, ours):
            t.train()
    assert type(ours.optimizer.optimizer) is type(stock.optimizer.optimizer)
    assert ours._run.optimizer is None
    said = [r.getMessage() for r in caplog.records if "nothing is offloaded" in r.getMessage()]
    assert len(said) == 1 and f"optim={optim!r} is not AdamW" in said[0]
    for a, b in zip(train_logs(stock), train_logs(ours)):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)  # the same optimizer: only the chunked loss differs


def test_our_arguments_follow_the_same_rule(tmp_path):
    model, tok, train = tiny_setup(seq=32, layers=1)
    t = OffloadTrainer(model=model, args=args_for(tmp_path, OffloadTrainingArguments, optim="sgd", max_steps=1),
                       train_dataset=train)
    t.train()
    assert isinstance(t.optimizer.optimizer, torch.optim.SGD)
    with pytest.raises(ValueError, match="offload_optimizer=True streams 8-bit AdamW states, but optim='sgd'"):
        args_for(tmp_path, OffloadTrainingArguments, optim="sgd", offload_optimizer=True)
    # optim_args is refused where the streamed AdamW would replace the optimizer that reads it: the Trainer built
    # without an optimizer of its caller's (the command asks before loading a weight)
    with pytest.raises(ValueError, match="optim_args"):
        OffloadTrainer(model=model, args=args_for(tmp_path, OffloadTrainingArguments, optim_args="foo=1"),
                       train_dataset=train)


@pytest.mark.parametrize("how", ["optimizers", "optimizer_cls_and_kwargs"])
def test_an_optimizer_passed_in_is_honoured(tmp_path, how, caplog):
    def kw(model):
        if how == "optimizers":
            return {"optimizers": (torch.optim.SGD(model.parameters(), lr=1e-2), None)}
        return {"optimizer_cls_and_kwargs": (torch.optim.SGD, {"lr": 1e-2})}

    with caplog.at_level(logging.INFO, logger="offload_trainer"):
        stock, ours = pair(tmp_path, trainer_kw=kw, max_steps=3, ours=TrainingArguments)
        for t in (stock, ours):
            t.train()
    assert isinstance(ours.optimizer.optimizer, torch.optim.SGD) and ours._run.optimizer is None
    assert any("an optimizer was passed to the Trainer" in r.getMessage() for r in caplog.records)
    for a, b in zip(train_logs(stock), train_logs(ours)):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    model, tok, train = tiny_setup(seq=32, layers=1)
    with pytest.raises(ConfigError, match="an optimizer was passed to the Trainer"):
        OffloadTrainer(model=model, args=args_for(tmp_path, OffloadTrainingArguments, offload_optimizer=True),
                       train_dataset=train, **kw(model))


# ------------------------------------------------------------------------------------------ resume
def test_resume_errors_start_with_the_trainers_words(tmp_path):
    for resume, words in ((str(tmp_path / "nope"), f"Can't find a valid checkpoint at {tmp_path / 'nope'}"),
                          (True, f"No valid checkpoint found in output directory ({tmp_path / 'ours'})")):
        stock, ours = pair(tmp_path, max_steps=1)
        with pytest.raises(ValueError) as theirs:
            stock.train(resume_from_checkpoint=resume)
        with pytest.raises(ValueError) as mine:
            ours.train(resume_from_checkpoint=resume)
        assert str(theirs.value).replace("stock", "ours").startswith(words.split(" at ")[0])
        assert str(mine.value).startswith(words), str(mine.value)


def test_resume_true_and_save_total_limit_as_the_trainer(tmp_path):
    stock, ours = pair(tmp_path, save_strategy="steps", save_steps=2, save_total_limit=2)
    for t in (stock, ours):
        t.train()
    names = [sorted(p.name for p in (tmp_path / n).iterdir() if p.name.startswith("checkpoint-"))
             for n in ("stock", "ours")]
    assert names[0] == names[1] == ["checkpoint-4", "checkpoint-6"]
    ours.args.max_steps = 8
    ours.train(resume_from_checkpoint=True)  # from checkpoint-6
    assert ours.state.global_step == 8 and len(train_logs(ours)) == 8


def test_resuming_a_finished_run_trains_nothing(tmp_path):
    """train(resume_from_checkpoint=True) from a checkpoint at max_steps: the Trainer trains one step past its end
    and makes that the model; ours loads the checkpoint's weights and trains nothing, and trains on once max_steps
    is raised."""
    stock, ours = pair(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    for t in (stock, ours):
        t.train()
        assert t.state.global_step == 2
    stock.train(resume_from_checkpoint=True)
    assert stock.state.global_step == 3  # (the Trainer's behaviour this replaces)
    trained = {n: p.detach().clone() for n, p in ours.model.named_parameters()}
    with torch.no_grad():
        for p in ours.model.parameters():
            p.zero_()  # (so that the checkpoint's weights must be loaded back)
    out = ours.train(resume_from_checkpoint=True)
    assert out.global_step == ours.state.global_step == 2 and math.isfinite(out.training_loss)
    assert all(torch.equal(p, trained[n]) for n, p in ours.model.named_parameters())
    assert sorted(p.name for p in (tmp_path / "ours").iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-2"]
    ours.args.max_steps = 3
    ours.train(resume_from_checkpoint=True)
    assert ours.state.global_step == 3


def test_a_run_stopped_by_max_steps_resumes_by_epochs_as_the_trainer(tmp_path):
    """A checkpoint at the max_steps its run stopped at, resumed with max_steps unset (by epochs: more steps): both
    classes train on to the epoch's end (ours took the checkpoint for a finished run and trained nothing)."""
    stock, ours = pair(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    ends = {}
    for name, t in (("stock", stock), ("ours", ours)):
        t.train_dataset = small(t.train_dataset)  # (an epoch: 4 steps)
        t.train()
        t.args.max_steps, t.args.num_train_epochs = -1, 1
        t.train(resume_from_checkpoint=str(tmp_path / name / "checkpoint-2"))
        ends[name] = t.state.global_step
    assert ends["ours"] == ends["stock"] == 4, ends


class OutOfMemoryAt(TrainerCallback):
    """A step at `batch` rows or more fails as CUDA's out-of-memory does (auto_find_batch_size then retries at 0.9x)."""

    def __init__(self, batch):
        self.batch = batch

    def on_step_end(self, args, state, control, **kw):
        if state.train_batch_size >= self.batch:
            raise RuntimeError("CUDA out of memory.")


def test_resuming_a_finished_run_takes_back_the_batch_size_it_found(tmp_path):
    """auto_find_batch_size: a new Trainer resuming the run starts from the batch size the run found, not the one
    asked for, as the Trainer's resume does; also where the checkpoint is the run's last and ours trains nothing."""
    stock, ours = pair(tmp_path, max_steps=2, save_strategy="steps", save_steps=2, auto_find_batch_size=True,
                       per_device_train_batch_size=4, trainer_kw={"callbacks": [OutOfMemoryAt(4)]})
    found = {}
    for name, t in (("stock", stock), ("ours", ours)):
        t.train()
        again = type(t)(model=t.model, args=t.args, train_dataset=t.train_dataset)
        assert again._train_batch_size == 4
        again.train(resume_from_checkpoint=True)
        found[name] = (t._train_batch_size, again._train_batch_size)
    assert found["ours"] == found["stock"] == (3, 3), found


def test_resuming_a_finished_run_restores_the_callbacks_states(tmp_path):
    """restore_callback_states_from_checkpoint: the callbacks' saved states come back as with the Trainer, also where
    the checkpoint is the run's last and ours trains nothing (transformers' own stateful-callback tests resume so)."""
    from transformers import EarlyStoppingCallback

    stock, ours = pair(tmp_path, max_steps=2, save_strategy="steps", save_steps=2, eval_strategy="steps",
                       eval_steps=2, load_best_model_at_end=True, restore_callback_states_from_checkpoint=True,
                       trainer_kw=lambda model: {"callbacks": [EarlyStoppingCallback(early_stopping_patience=5)]})
    patience = {}
    for name, t in (("stock", stock), ("ours", ours)):
        t.train()
        again = type(t)(model=t.model, args=t.args, train_dataset=t.train_dataset, eval_dataset=t.eval_dataset,
                        callbacks=[EarlyStoppingCallback()])
        again.train(resume_from_checkpoint=True)
        patience[name] = [c.early_stopping_patience for c in again.callback_handler.callbacks
                          if isinstance(c, EarlyStoppingCallback)]
    assert patience["ours"] == patience["stock"] == [5], patience


# Figures no two runs share in the Trainer's log history: its own timings (its summary log)
TIMINGS = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss"}


def test_a_resumed_runs_history_is_the_uninterrupted_ones(tmp_path):
    """transformers' own resume tests compare a resumed run's log history with the uninterrupted run's, leaving out
    the Trainer's timings. Ours, with the streamed optimizer, holds that too: our measured figures (tok/s, memory)
    are kept beside the history, and the resumed run has those of the checkpoint's steps and its own."""
    import shutil

    history, figures = {}, {}
    for name in ("whole", "resumed"):
        model, tok, train = tiny_setup(seq=32, layers=1)
        args = args_for(tmp_path / name, Streamed, max_steps=4, save_strategy="steps", save_steps=2)
        t = OffloadTrainer(model=model, args=args, train_dataset=train)
        if name == "resumed":
            shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / name / "checkpoint-2")
        t.train(resume_from_checkpoint=str(tmp_path / name / "checkpoint-2") if name == "resumed" else None)
        history[name] = [{k: v for k, v in h.items() if k not in TIMINGS} for h in t.state.log_history]
        figures[name] = [h for h in run_history(t) if "tok_per_s" in h]
    assert len(history["whole"]) == 5 and history["resumed"] == history["whole"]
    assert [h["step"] for h in figures["resumed"]] == [1, 2, 3, 4]
    assert figures["resumed"][:2] == figures["whole"][:2]  # (the checkpoint's, as measured then)


class GrowingBuffer(torch.nn.Module):
    """A model whose persistent buffer grows as it trains, and whose load_state_dict accepts any length of it."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self.register_buffer("seen", torch.zeros(0))

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kw):
        if self.training:
            self.seen = torch.cat([self.seen, torch.ones(1)])
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kw)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        self.seen = torch.zeros_like(state_dict["seen"])
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def test_a_model_that_grows_a_buffer_resumes_as_with_the_trainer(tmp_path):
    results = {}
    for name, cls in (("stock", Trainer), ("ours", OffloadTrainer)):
        model, tok, train = tiny_setup(seq=32, layers=1)
        args = args_for(tmp_path / name, Streamed if cls is OffloadTrainer else TrainingArguments,
                        save_strategy="steps", save_steps=2, max_steps=2)
        t = cls(model=GrowingBuffer(model), args=args, train_dataset=train)
        t.train()
        model, tok, train = tiny_setup(seq=32, layers=1)
        args.max_steps = 4
        t = cls(model=GrowingBuffer(model), args=args, train_dataset=train)
        t.train(resume_from_checkpoint=str(tmp_path / name / "checkpoint-2"))
        results[name] = (t.state.global_step, t.model.seen.numel())
    assert results["ours"] == results["stock"] == (4, 4)


# ------------------------------------------------------------------------------------------ non-finite steps
def test_nonfinite_steps_with_plain_arguments_train_on_as_the_trainer_does(tmp_path, caplog):
    """Every step's loss is NaN: the Trainer applies them (NaN weights), we skip them (weights kept); both train every
    step, and our log says once what differs. (Plain arguments asking for the streamed optimizer: what a plain
    TrainingArguments gets on a GPU.)"""
    stock, ours = pair(tmp_path, max_steps=7)
    for t in (stock, ours):  # the final norm's output is NaN in training: the same loss for both loss paths
        t.model.model.norm.register_forward_hook(lambda m, i, o: o * float("nan") if m.training else o)
    with caplog.at_level(logging.INFO, logger="offload_trainer"):
        for t in (stock, ours):
            t.train()
    assert stock.state.global_step == ours.state.global_step == 7
    assert not all(torch.isfinite(p).all() for p in stock.model.parameters())
    assert all(torch.isfinite(p).all() for p in ours.model.parameters())
    assert sum("is skipped" in r.getMessage() and "training goes on" in r.getMessage() for r in caplog.records) == 1


# ------------------------------------------------------------------------------------------ other entry points
def test_evaluate_before_train_predict_and_train_twice(tmp_path):
    stock, ours = pair(tmp_path, max_steps=2)
    got = {}
    for t in (stock, ours):
        t.eval_dataset = small(t.train_dataset)
        before = t.evaluate()
        pred = t.predict(small(t.train_dataset, 4))
        t.train()
        t.args.max_steps = 4
        t.train()  # a second train() on the same Trainer starts over with max_steps 4
        got[t] = (before, pred, t.state.global_step)
    (b0, p0, s0), (b1, p1, s1) = got[stock], got[ours]
    assert set(b0) == set(b1) and b1["eval_loss"] == pytest.approx(b0["eval_loss"], rel=1e-5)
    assert p0.predictions.shape == p1.predictions.shape
    assert s0 == s1 == 4


def test_load_best_model_at_end(tmp_path):
    stock, ours = pair(tmp_path, max_steps=6, eval_strategy="steps", eval_steps=2, save_strategy="steps",
                       save_steps=2, load_best_model_at_end=True, save_total_limit=1, learning_rate=3e-3)
    for t in (stock, ours):
        t.train()
    assert ours.state.best_model_checkpoint.replace("ours", "stock") == stock.state.best_model_checkpoint
    kept = [sorted(p.name for p in (tmp_path / n).iterdir() if p.name.startswith("checkpoint-"))
            for n in ("stock", "ours")]
    assert kept[0] == kept[1]
    # the loaded best weights are the ones its checkpoint holds
    from safetensors.torch import load_file

    saved = load_file(f"{ours.state.best_model_checkpoint}/model.safetensors")
    for name, p in ours.model.named_parameters():
        assert torch.equal(p.detach(), saved[name]), name


def test_model_init_builds_a_fresh_model_per_train(tmp_path):
    def init():
        return tiny_setup(seq=32, layers=1)[0]

    _, tok, train = tiny_setup(seq=32, layers=1)
    runs = []
    for cls in (Trainer, OffloadTrainer):
        args = args_for(tmp_path / cls.__name__, Streamed if cls is OffloadTrainer else TrainingArguments, max_steps=2)
        t = cls(model_init=init, args=args, train_dataset=train)
        t.train()
        runs.append([h["loss"] for h in train_logs(t)])
    assert len(runs[1]) == 2 and runs[1][0] == pytest.approx(runs[0][0], rel=1e-5) and math.isfinite(runs[1][1])


def test_a_streaming_dataset_trains_with_max_steps(tmp_path):
    """An IterableDataset (here datasets' streaming one over the tiny model's rows) trains with max_steps as with the
    Trainer; the plan, which cannot take its length, is sized from nothing and skipped, saying so."""
    runs = []
    for cls in (Trainer, OffloadTrainer):
        model, tok, train = tiny_setup(seq=32, layers=1)
        stream = train.with_format(None).to_iterable_dataset()  # (rows of lists: the collator makes tensors)
        args = args_for(tmp_path / cls.__name__, Streamed if cls is OffloadTrainer else TrainingArguments, max_steps=3)
        t = cls(model=model, args=args, train_dataset=stream)
        t.train()
        runs.append(train_logs(t))
    assert len(runs[0]) == len(runs[1]) == 3
    assert runs[1][0]["loss"] == pytest.approx(runs[0][0]["loss"], rel=1e-5)


@pytest.mark.parametrize("warmup, schedule, said", [(10, "linear", True), (0.5, "linear", False),
                                                     (6, "cosine", True), (10, "constant", False)])
def test_a_warmup_the_run_never_finishes_is_said_once(tmp_path, caplog, warmup, schedule, said):
    """The stock Trainer trains on silently with a learning rate that never reaches learning_rate; ours says so once
    and trains the same (the learning rates logged are the stock Trainer's)."""
    stock, ours = pair(tmp_path, max_steps=6, warmup_steps=warmup, lr_scheduler_type=schedule)
    with caplog.at_level(logging.INFO, logger="offload_trainer"):
        for t in (stock, ours):
            t.train()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warmup:")]
    assert len(lines) == int(said)
    if said:
        assert lines[0].startswith(f"warmup: {warmup} steps, the run 6: the learning rate stays below learning_rate=")
    rates = [h["learning_rate"] for h in train_logs(ours)]
    assert rates == [h["learning_rate"] for h in train_logs(stock)]
    assert (max(rates) < 3e-3) == said
