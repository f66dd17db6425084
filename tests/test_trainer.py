"""OffloadTrainer as a drop-in Trainer: same script, streamed optimizer, exact resume."""
import json
import math

import pytest
import torch
from transformers import TrainerCallback, TrainingArguments

from helpers import tiny_setup
from offload_trainer import OffloadTrainer, OffloadTrainingArguments, StreamedAdamW8bit, run_history


def losses_of(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


class ArgsAskingToStream(TrainingArguments):
    """A plain TrainingArguments on which a script set `offload_optimizer = True` (on a CPU, the streamed optimizer
    runs only when asked for; on a GPU a plain TrainingArguments streams by default)."""

    offload_optimizer = True


@pytest.mark.parametrize("asked", [False, True], ids=["cpu_default", "asked_to_stream"])
def test_script_written_for_trainer_runs_unchanged(tmp_path, asked, caplog):
    """A plain `Trainer` script (TrainingArguments and all) with only the class name swapped. On a CPU the Trainer's
    own AdamW runs, said once in the log (nothing to offload to); asked to, the streamed optimizer."""
    import logging

    model, tok, train = tiny_setup()
    cls = ArgsAskingToStream if asked else TrainingArguments
    args = cls(output_dir=str(tmp_path), max_steps=12, per_device_train_batch_size=4,
               learning_rate=3e-3, logging_steps=4, save_strategy="no", report_to="none")
    trainer = OffloadTrainer(model=model, args=args, train_dataset=train, processing_class=tok)
    with caplog.at_level(logging.INFO, logger="offload_trainer"):
        trainer.train()
    if asked:
        assert isinstance(trainer._run.optimizer, StreamedAdamW8bit)  # it did not silently fall back
    else:
        assert trainer._run.optimizer is None and isinstance(trainer.optimizer.optimizer, torch.optim.AdamW)
        assert sum("no GPU here" in r.getMessage() and "nothing is offloaded" in r.getMessage()
                   for r in caplog.records) == 1
    losses = losses_of(trainer)
    assert len(losses) == 3 and losses[-1] < losses[0]
    logged = [h for h in run_history(trainer) if "loss" in h][-1]
    assert logged["tok_per_s"] > 0 and logged["grad_norm"] > 0


def test_logs_trim_host_memory_at_most_once_in_ten_steps(tmp_path, monkeypatch):
    """Every training log has host RSS; glibc's free pages go back (a ~5 ms trim) at the first log and then at most
    once in TRIM_EVERY_STEPS steps, also when a second train() starts."""
    import offload_trainer.trainer.run_logs as run_logs

    trims = []
    monkeypatch.setattr(run_logs, "trim_host_memory", lambda: trims.append(None))
    model, tok, train = tiny_setup()
    args = OffloadTrainingArguments(output_dir=str(tmp_path), max_steps=23, per_device_train_batch_size=2,
                                    logging_steps=1, save_strategy="no", report_to="none")
    trainer = OffloadTrainer(model=model, args=args, train_dataset=train)
    trainer.train()
    logs = [h for h in run_history(trainer) if "loss" in h]
    assert len(logs) == 23 and all(h["host_rss_gib"] > 0 for h in logs)
    assert len(trims) == 3  # steps 1, 11, 21
    assert run_logs.TRIM_EVERY_STEPS == 10
    trainer.args.max_steps = 25
    trainer.train(resume_from_checkpoint=None)  # a new train(): its first log trims again
    assert len(trims) == 6


def test_offload_off_is_the_plain_trainer(tmp_path):
    model, tok, train = tiny_setup()
    args = OffloadTrainingArguments(output_dir=str(tmp_path), max_steps=2, offload_optimizer=False,
                                    optim="sgd", save_strategy="no", report_to="none")
    trainer = OffloadTrainer(model=model, args=args, train_dataset=train)
    trainer.train()
    assert trainer._run.optimizer is None
    assert isinstance(trainer.optimizer.optimizer, torch.optim.SGD)


def test_chunked_loss_matches_model_loss_in_trainer():
    model, tok, train = tiny_setup()
    batch = {k: torch.stack([train[i][k] for i in range(3)]) for k in train[0]}
    batch["labels"][0, :10] = -100
    args = OffloadTrainingArguments(output_dir="unused", loss_chunk_size=50, report_to="none")
    trainer = OffloadTrainer(model=model, args=args)
    ours = trainer.compute_loss(model, dict(batch))
    ref = model(**batch).loss
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    ours_n = trainer.compute_loss(model, dict(batch), num_items_in_batch=torch.tensor(77))
    ref_n = model(**batch, num_items_in_batch=torch.tensor(77)).loss
    torch.testing.assert_close(ours_n, ref_n, rtol=1e-5, atol=1e-6)


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step >= self.step:
            control.should_training_stop = True


def make_args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=3, max_grad_norm=0.5,
                logging_steps=1, save_steps=20, max_steps=40, report_to="none", seed=0, data_seed=0,
                offload_optimizer=True)  # (on a CPU the streamed optimizer runs when asked for)
    base.update(kw)
    return OffloadTrainingArguments(**base)


# the embedding's 8-bit states (65,536 values: 133,120 bytes) kept on the device, every other tensor's streamed
EMBEDDING_ON_DEVICE = dict(offload_device_states="0.00013")  # GiB: 139,586 bytes; the next tensor needs 33,280


@pytest.mark.parametrize("max_grad_norm, extra", [(0.5, {}), (0.0, {}), (0.5, EMBEDDING_ON_DEVICE),
                                                  (0.0, EMBEDDING_ON_DEVICE)],
                         ids=["clip", "update_in_backward", "clip_embedding_states_on_device",
                              "update_in_backward_embedding_states_on_device"])
@pytest.mark.slow
def test_resume_at_8_gives_identical_losses_to_16(tmp_path, max_grad_norm, extra):
    """Stopped at step 8 of a 16-step schedule and resumed from its checkpoint into a model of another init: the
    losses of all 16 steps equal the uninterrupted run's (CPU: exactly)."""
    steps = dict(max_steps=16, save_steps=8)
    model, tok, train = tiny_setup(seq=32)
    full = OffloadTrainer(model=model, args=make_args(tmp_path / "full", max_grad_norm=max_grad_norm, **steps, **extra),
                          train_dataset=train)
    full.train()
    want = losses_of(full)
    assert len(want) == 16
    kept = [n for n, p in model.named_parameters() if p in full._run.optimizer._states.on_device]
    assert kept == (["model.embed_tokens.weight"] if extra else [])

    model, _, _ = tiny_setup(seq=32)
    first = OffloadTrainer(model=model, args=make_args(tmp_path / "cut", max_grad_norm=max_grad_norm, **steps, **extra),
                           train_dataset=train, callbacks=[StopAt(8)])  # same 16-step schedule, stopped at 8
    first.train()
    ckpt = tmp_path / "cut" / "checkpoint-8"
    assert (ckpt / "optimizer.pt").exists()

    model, _, _ = tiny_setup(seq=32, seed=123)  # different init: everything must come from the checkpoint
    second = OffloadTrainer(model=model, args=make_args(tmp_path / "cut", max_grad_norm=max_grad_norm, **steps, **extra),
                            train_dataset=train)
    second.train(resume_from_checkpoint=str(ckpt))
    assert losses_of(first) == want[:8]
    got = losses_of(second)  # its log history starts with the 8 steps restored from the checkpoint
    assert got == want  # CPU: exact
    state = json.loads((tmp_path / "cut" / "checkpoint-16" / "trainer_state.json").read_text())
    assert state["global_step"] == 16


def test_the_streamed_optimizer_is_prepared_without_placement(tmp_path):
    """accelerate would send the optimizer's state dict through the GPU and back (all 8-bit states, and a GPU learning
    rate that syncs every update): the Trainer prepares it with device_placement=False, on every train() call."""
    model, tok, train = tiny_setup(seq=32)
    trainer = OffloadTrainer(model=model, args=make_args(tmp_path, max_steps=2, save_steps=100), train_dataset=train)
    trainer.train()
    assert trainer.optimizer.optimizer is trainer._run.optimizer and trainer.optimizer.device_placement is False
    assert "prepare_optimizer" not in trainer.accelerator.__dict__  # the accelerator's own method again
    # a second train() (the states now exist) prepares it the same way
    trainer.args.max_steps = 4
    trainer.train()
    assert trainer.optimizer.optimizer is trainer._run.optimizer and trainer.optimizer.device_placement is False
    assert len(losses_of(trainer)) == 4


def test_activation_offload_through_the_trainer(tmp_path):
    model, tok, train = tiny_setup()
    args = OffloadTrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4,
                                    learning_rate=3e-3, activation_checkpointing=True, activation_offload=True,
                                    logging_steps=2, save_strategy="no", report_to="none")
    trainer = OffloadTrainer(model=model, args=args, train_dataset=train)
    trainer.train()
    off = trainer._run.activations
    assert off is not None and off.stats["d2h_bytes"] > 0
    assert off.stats["h2d_bytes"] == off.stats["d2h_bytes"]  # every offloaded input came back for its recompute
    losses = losses_of(trainer)
    assert len(losses) == 2 and losses[1] < losses[0]


@pytest.mark.parametrize("max_grad_norm", [0.5, 0.0], ids=["clip", "update_in_backward"])
@pytest.mark.slow
def test_layer_swap_through_the_trainer_matches_unswapped_and_resumes(tmp_path, max_grad_norm):
    def run(swap, out, stop=None, resume=None, seed=0):
        model, _, train = tiny_setup(seq=32, layers=4, seed=seed)
        args = make_args(tmp_path / out, max_steps=8, save_steps=4, max_grad_norm=max_grad_norm,
                         activation_checkpointing=True, layer_swap=swap)
        trainer = OffloadTrainer(model=model, args=args, train_dataset=train,
                                 callbacks=[StopAt(stop)] if stop else None)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    plain = run("off", "plain")
    swapped = run("2", "swap")
    assert swapped._run.swap.memory_stats()["swapped_layers"] == 2 and swapped._run.swap.stats["loads"] > 0
    # accumulating 2 micro-batches: the swapped run sums its gradients in host memory, the plain one on the device
    assert swapped._run.optimizer.offload_gradients and not plain._run.optimizer.offload_gradients
    assert losses_of(swapped) == losses_of(plain)  # CPU: exact
    run("2", "cut", stop=4)
    resumed = run("2", "cut", resume=str(tmp_path / "cut" / "checkpoint-4"), seed=123)
    assert losses_of(resumed) == losses_of(plain)
    # the saved model holds the trained weights of swapped layers too
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(tmp_path / "swap" / "checkpoint-8", dtype=torch.float32)
    for (name, a), b in zip(plain.model.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name


def test_layer_swap_refusals(tmp_path):
    with pytest.raises(ValueError, match="activation_checkpointing"):
        make_args(tmp_path, layer_swap="auto")
    with pytest.raises(ValueError, match="layer_swap='most'"):
        make_args(tmp_path, layer_swap="most", activation_checkpointing=True)
    model, _, train = tiny_setup(layers=4)
    args = make_args(tmp_path, layer_swap="2", activation_checkpointing=True, offload_optimizer=False,
                     optim="adamw_torch")
    with pytest.raises(ValueError, match="needs offload_optimizer"):
        OffloadTrainer(model=model, args=args, train_dataset=train)


class Snapshot(TrainerCallback):
    """Weights and 8-bit host states after every optimizer step."""

    def __init__(self, trainer):
        self.trainer, self.after = trainer, {}

    def on_step_end(self, args, state, control, **kw):
        opt = self.trainer._run.optimizer
        opt.synchronize()
        self.after[state.global_step] = (
            {n: p.detach().clone() for n, p in self.trainer.model.named_parameters()},
            opt._states.host_codes.clone() if opt._states.allocated else None)


def poisoned_tiny_setup(at: int = 4):
    """A tiny model (and its data) whose final norm output becomes NaN in its `at`-th training forward."""
    model, _, train = tiny_setup(seq=32)
    calls = {"n": 0}

    def poison(module, args, out):
        if module.training:
            calls["n"] += 1
            if calls["n"] == at:
                return out * float("nan")
        return out

    model.model.norm.register_forward_hook(poison)
    return model, train


@pytest.mark.parametrize("max_grad_norm", [0.5, 0.0], ids=["clip", "update_in_backward"])
def test_nonfinite_step_is_skipped_with_weights_and_states_unchanged(tmp_path, max_grad_norm):
    model, train = poisoned_tiny_setup()
    args = make_args(tmp_path, max_steps=6, gradient_accumulation_steps=1, max_grad_norm=max_grad_norm,
                     save_strategy="no")
    trainer = OffloadTrainer(model=model, args=args, train_dataset=train)
    snap = Snapshot(trainer)
    trainer.add_callback(snap)
    trainer.train()
    w3, s3 = snap.after[3]
    w4, s4 = snap.after[4]
    assert all(torch.equal(w3[n], w4[n]) for n in w3)  # step 4 (the NaN one) changed nothing
    assert torch.equal(s3, s4)
    w5, _ = snap.after[5]
    assert not all(torch.equal(w4[n], w5[n]) for n in w4)  # and training went on
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert run_history(trainer)[-2]["nonfinite_skipped"] == 1


@pytest.mark.parametrize("optim, extra", [("sgd", {}), ("adamw_torch", dict(offload_optimizer=False))],
                         ids=["another_optim", "trainers_adamw"])
@pytest.mark.parametrize("max_grad_norm", [0.5, 0.0], ids=["clip", "no_clip"])
@pytest.mark.slow
def test_nonfinite_steps_skipped_with_the_trainers_own_optimizer(tmp_path, optim, extra, max_grad_norm):
    """max_nonfinite_steps on the Trainer's own optimizer path (another optim, or offload_optimizer: false): the NaN
    step changes no weight, training goes on; NaN on every step stops after max_nonfinite_steps in a row."""
    from offload_trainer.errors import TrainingStopped

    model, train = poisoned_tiny_setup()
    args = make_args(tmp_path / "one", max_steps=6, gradient_accumulation_steps=1, max_grad_norm=max_grad_norm,
                     save_strategy="no", optim=optim, **{"offload_optimizer": None, **extra})
    weights = {}
    trainer = OffloadTrainer(model=model, args=args, train_dataset=train)
    trainer.add_callback(type("Weights", (TrainerCallback,), {"on_step_end": lambda self, a, state, c, **k: weights.
                         __setitem__(state.global_step, [p.detach().clone() for p in model.parameters()])})())
    trainer.train()
    assert trainer._run.optimizer is None  # (the Trainer's own optimizer ran)
    assert all(torch.equal(a, b) for a, b in zip(weights[3], weights[4]))  # the NaN step (4) changed nothing
    assert not all(torch.equal(a, b) for a, b in zip(weights[4], weights[5]))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    model, _, train = tiny_setup(seq=32)
    model.model.norm.register_forward_hook(lambda m, i, o: o * float("nan") if m.training else o)
    args = make_args(tmp_path / "all", max_steps=8, gradient_accumulation_steps=1, max_grad_norm=max_grad_norm,
                     save_strategy="no", optim=optim, max_nonfinite_steps=3, **{"offload_optimizer": None, **extra})
    trainer = OffloadTrainer(model=model, args=args, train_dataset=train)
    with pytest.raises(TrainingStopped, match="3 optimizer steps in a row had a non-finite"):
        trainer.train()
    assert trainer.state.global_step == 3 and all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("max_grad_norm", [0.5, 0.0], ids=["clip", "update_in_backward"])
@pytest.mark.slow
def test_loss_filter_on_the_device_logs_what_the_trainers_own_does(tmp_path, monkeypatch, max_grad_norm):
    """On a GPU the Trainer's logging_nan_inf_filter (a host read of every loss) is replaced by the same arithmetic on
    the device; forced on here: the logged losses, a NaN step among them, are those of the Trainer's own filter."""
    import offload_trainer.trainer.mixin as trainer_mod

    def run(on_device: bool):
        monkeypatch.setattr(trainer_mod.OffloadMixin, "_filters_loss_on_device", lambda self: on_device)
        model, train = poisoned_tiny_setup()
        args = make_args(tmp_path / str(on_device), max_steps=7, gradient_accumulation_steps=1, logging_steps=2,
                         max_grad_norm=max_grad_norm, save_strategy="no", eval_strategy="steps", eval_steps=3)
        trainer = OffloadTrainer(model=model, args=args, train_dataset=train,
                                 eval_dataset=torch.utils.data.Subset(train, range(4)))
        seen, seen_in_eval = [], []
        trainer.add_callback(type("Seen", (TrainerCallback,), {
            "on_step_end": lambda self, a, state, control, **kw: seen.append(a.logging_nan_inf_filter),
            "on_evaluate": lambda self, a, state, control, **kw: seen_in_eval.append(a.logging_nan_inf_filter)})())
        trainer.train()
        assert args.logging_nan_inf_filter  # the user's setting, back after train()
        assert len(seen_in_eval) >= 2 and all(seen_in_eval)  # evaluations (steps 3, 6, ...) filter on the host
        return losses_of(trainer), seen

    host, seen_host = run(False)
    device, seen_device = run(True)
    assert seen_host == [True] * 7 and seen_device == [False] * 7  # the Trainer's own filter was off on the "device"
    assert len(host) == 3 and all(math.isfinite(x) for x in host)
    assert device == host


def test_loss_filter_falls_back_to_the_trainers_own_without_its_running_loss(tmp_path):
    """A transformers whose loop keeps no `_tr_loss` (the device filter's input): the Trainer's own filter comes back
    on, and this micro-batch's loss goes to it unchanged."""
    model, _, train = tiny_setup()
    trainer = OffloadTrainer(model=model, args=make_args(tmp_path, logging_nan_inf_filter=False), train_dataset=train)
    assert not hasattr(trainer, "_tr_loss")  # (set by the Trainer's loop)
    trainer._run.device_loss_filter = True
    loss = torch.tensor(float("nan"))
    from offload_trainer.trainer import seams

    assert seams.filtered_loss(trainer, trainer._run, loss) is loss
    assert trainer.args.logging_nan_inf_filter and not trainer._run.device_loss_filter


def test_qlora_4bit_with_layer_swap_through_the_cli(tmp_path, capsys):
    """load_in_4bit + LoRA + layer swap end to end on the CPU (bitsandbytes' CPU kernels): trains and saves."""
    pytest.importorskip("bitsandbytes")
    from offload_trainer import cli

    rc = cli.main(["train", "configs/tiny-cpu.yaml", "lora_r=8", "lora_alpha=16", "load_in_4bit=true",
                   "layer_swap=2", "activation_checkpointing=true", "max_steps=3", "logging_steps=1", "save_steps=3",
                   "eval_fraction=0", "per_device_train_batch_size=2", "max_seq_length=64",
                   "model_overrides={num_hidden_layers: 4}", f"output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert rc == 0, err[-2000:]
    assert "layer swap: 2 of 4 decoder layers" in err
    state = json.loads((tmp_path / "checkpoint-3" / "trainer_state.json").read_text())
    losses = [h["loss"] for h in state["log_history"] if "loss" in h]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert (tmp_path / "adapter_model.safetensors").exists()


@pytest.mark.gpu
def test_gpu_logs_show_pcie_pinned_and_stall_with_layer_swap(tmp_path):
    model, tok, train = tiny_setup(layers=4)
    args = OffloadTrainingArguments(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4,
                                    learning_rate=3e-3, activation_checkpointing=True, layer_swap="2",
                                    activation_offload=True, max_grad_norm=0.0, logging_steps=2,
                                    gradient_accumulation_steps=2, fold_accumulation="off", save_strategy="no",
                                    report_to="none")
    args._n_gpu = min(args.n_gpu, 1)  # one GPU, as CUDA_VISIBLE_DEVICES=0 would give on a machine with several
    trainer = OffloadTrainer(model=model, args=args, train_dataset=train)
    trainer.train()
    logs = [h for h in run_history(trainer) if "loss" in h]
    assert len(logs) == 3 and logs[-1]["loss"] < logs[0]["loss"]
    # (a 0.2 M-parameter model moves a few MB per step: the logged GB/s and GiB round to ~0, so check the counters)
    assert all(h["pcie_gb_per_s"] >= 0 and h["host_pinned_gib"] >= 0 and h["gpu_stall_ms"] >= 0 for h in logs)
    assert trainer._run.swap.stats["loads"] > 0 and trainer._run.swap.memory_stats()["pinned_bytes"] > 0
    assert trainer._run.optimizer.memory_stats()["pinned_bytes"] > 0 and trainer._run.activations.pinned_bytes() > 0
    assert trainer._run.optimizer.offload_gradients  # accumulating with swapped layers: the sums wait in pinned memory


def test_without_a_cap_the_plan_is_for_the_gpus_own_memory(monkeypatch):
    """No gpu_memory_limit_gb: on a GPU the planner plans for its free memory plus what this process already holds,
    less what libraries take once training starts (and plus the CUDA context, which the planner takes off again);
    without CUDA there is no budget."""
    from offload_trainer import sysinfo

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sysinfo.gpu_budget_gib(0.7) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (20 * 2**30, 24 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 3 * 2**30)
    assert sysinfo.gpu_budget_gib(0.7) == pytest.approx(23.7 - sysinfo.LATER_LIBRARIES_GIB)
    assert sysinfo.LATER_LIBRARIES_GIB == pytest.approx(0.4)


@pytest.mark.gpu
@pytest.mark.parametrize("max_grad_norm", [0.5, 0.0], ids=["clip", "update_in_backward"])
def test_gpu_resume_without_a_cap_plans_for_the_card(tmp_path, max_grad_norm):
    """On a GPU with no gpu_memory_limit_gb the plan is for the card: a tiny model keeps every 8-bit state on it
    ('auto'); with clipping the updates are queued by the next forward. Save at 20, resume, 40: the same losses."""
    def trainer(out, seed=0, **kw):
        model, _, train = tiny_setup(seq=32, seed=seed)
        args = make_args(out, max_grad_norm=max_grad_norm)
        args._n_gpu = min(args.n_gpu, 1)
        return OffloadTrainer(model=model, args=args, train_dataset=train, **kw)

    full = trainer(tmp_path / "full")
    full.train()
    want = losses_of(full)
    assert full._run.plan is not None and full._run.plan.gpu_budget_gib > 30  # the card's own memory (not a cap)
    assert full._run.optimizer._states.on_device and not full._run.optimizer._states.offset  # every state kept on the GPU
    first = trainer(tmp_path / "cut", callbacks=[StopAt(20)])
    first.train()
    second = trainer(tmp_path / "cut", seed=123)
    second.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-20"))
    got = losses_of(second)
    assert len(got) == len(want) == 40
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-4


@pytest.mark.slow
def test_saves_are_sharded_so_host_memory_holds_one_shard_and_resume_reads_them(tmp_path, monkeypatch):
    """A checkpoint and the final model are written in shards of at most SAVE_SHARD_BYTES (safetensors copies a
    whole shard to host memory first), and a resume from the sharded checkpoint continues exactly."""
    from safetensors.torch import load_file

    from offload_trainer.trainer import mixin as trainer_mod

    model, tok, train = tiny_setup(seq=32)
    monkeypatch.setattr(trainer_mod, "SAVE_SHARD_BYTES", 100_000)  # bytes: the tiny model needs several
    t = OffloadTrainer(model=model, args=make_args(tmp_path / "run", max_steps=4, save_steps=2), train_dataset=train)
    t.train()
    t.save_model()
    for where in (tmp_path / "run" / "checkpoint-2", tmp_path / "run"):
        shards = [load_file(s) for s in sorted(where.glob("model-*.safetensors"))]
        assert len(shards) > 1 and (where / "model.safetensors.index.json").exists()
        for shard in shards:  # at most the limit, or one tensor that alone exceeds it
            assert sum(v.numel() * v.element_size() for v in shard.values()) <= 100_000 or len(shard) == 1
        saved = {k: v for shard in shards for k, v in shard.items()}
        if where.name == "run":
            for name, p in model.named_parameters():
                torch.testing.assert_close(saved[name], p.detach(), rtol=0, atol=0)
    assert "save_pretrained" not in model.__dict__  # the model's own method again after saving

    model, _, _ = tiny_setup(seq=32, seed=123)
    again = OffloadTrainer(model=model, args=make_args(tmp_path / "run", max_steps=4, save_steps=2),
                           train_dataset=train)
    again.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert losses_of(again) == losses_of(t)


def test_small_trainable_sets_and_cpus_keep_the_trainers_adamw():
    """offload_optimizer unset: LoRA (a small trainable set) keeps the Trainer's AdamW on a GPU, as the plan says
    ("LoRA adapters + AdamW on the GPU"); on a CPU every model does; a full finetune on a GPU streams; asked for, it
    always streams."""
    from types import SimpleNamespace

    from offload_trainer.trainer.args import streams_optimizer
    from offload_trainer.cli.run_args import ModelArguments
    from offload_trainer.models import load_model
    from offload_trainer.settings import OffloadSettings

    settings = OffloadSettings.from_args

    lora = load_model(ModelArguments(model_config="tiny-llama", torch_dtype="float32", lora_r=4))
    full = load_model(ModelArguments(model_config="tiny-llama", torch_dtype="float32"))

    def args(device, asked=None):
        return SimpleNamespace(offload_optimizer=asked, optim="adamw_torch_fused", optim_args=None,
                               device=torch.device(device))

    streams, why = streams_optimizer(args("cuda"), settings(args("cuda")), model=lora)
    assert not streams and "of 1 M parameters train (LoRA or adapters)" in why and "stay on the GPU" in why
    assert streams_optimizer(args("cuda"), settings(args("cuda")), model=full) == (True, "")
    streams, why = streams_optimizer(args("cpu"), settings(args("cpu")), model=full)
    assert not streams and why.startswith("no GPU here")
    assert streams_optimizer(args("cpu", asked=True), settings(args("cpu", asked=True)), model=lora) == (True, "")


def test_on_a_cpu_the_log_line_says_what_applies_and_no_gpu_plan_is_logged(tmp_path, caplog):
    import logging

    model, tok, train = tiny_setup(seq=32)
    trainer = OffloadTrainer(model=model, args=make_args(tmp_path, max_steps=2, logging_steps=1, save_steps=100),
                             train_dataset=train)
    with caplog.at_level(logging.INFO, logger="offload_trainer"):
        trainer.train()
    lines = [r.getMessage() for r in caplog.records]
    steps = [m for m in lines if m.startswith("step ")]
    assert len(steps) == 2 and all(" tok/s | host rss " in m and "gpu" not in m and "pcie" not in m for m in steps)
    assert not any(m.startswith("plan:") for m in lines)


@pytest.mark.slow
def test_saves_and_evaluations_are_not_counted_in_tok_per_s(tmp_path, monkeypatch):
    """A slow save between two logs: the logged throughput is the training's (it dipped at every save before)."""
    import time as time_mod

    import offload_trainer.trainer.mixin as trainer_mod

    model, tok, train = tiny_setup(seq=32)
    args = make_args(tmp_path, max_steps=6, logging_steps=2, save_steps=3, gradient_accumulation_steps=1)
    trainer = OffloadTrainer(model=model, args=args, train_dataset=train)
    real = trainer_mod.OffloadMixin._save_checkpoint_staged

    def slow(self, *a, **k):
        time_mod.sleep(2.0)
        return real(self, *a, **k)

    monkeypatch.setattr(trainer_mod.OffloadMixin, "_save_checkpoint_staged", slow)
    trainer.train()
    tok_s = [h["tok_per_s"] for h in run_history(trainer) if "loss" in h]
    # the interval of step 4 holds the 2 s save at step 3: counted, its tok/s would be under a fifth of the others
    assert len(tok_s) == 3 and tok_s[1] > 0.4 * min(tok_s[0], tok_s[2])


def test_a_model_of_mixed_dtypes_trains_under_the_trainers_autocast(tmp_path):
    """axolotl's full-finetune layout: bf16 layers, fp32 embeddings, norms and head, under bf16 autocast. Our chunked
    loss calls the decoder past the model's forward (which accelerate wraps in autocast), so it must enter the same
    autocast: without it the first matmul mixes fp32 and bf16 and fails. Reference: the stock Trainer's loss."""
    from transformers import Trainer

    def run(cls):
        model, tok, train = tiny_setup()
        model.to(torch.bfloat16)
        for name, module in model.named_modules():
            if "norm" in name or name.endswith(("embed_tokens", "lm_head")):
                module.to(torch.float32)
        args = TrainingArguments(output_dir=str(tmp_path / cls.__name__), max_steps=2, per_device_train_batch_size=4,
                                 learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", bf16=True,
                                 use_cpu=not torch.cuda.is_available())
        trainer = cls(model=model, args=args, train_dataset=train, processing_class=tok)
        trainer.train()
        return losses_of(trainer)

    ours, stock = run(OffloadTrainer), run(Trainer)
    assert ours[0] == pytest.approx(stock[0], rel=1e-2)
