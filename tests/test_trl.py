"""OffloadSFTTrainer: TRL's SFTTrainer with the same wiring (the mixin)."""
import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is an optional extra: pip install 'offload-trainer[trl]'")

from helpers import tiny_setup  # noqa: E402
from offload_trainer import StreamedAdamW8bit, run_history  # noqa: E402
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
    assert isinstance(trainer._run.optimizer, StreamedAdamW8bit)
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


def _dpo(tmp_path, trainer_cls, config_cls, **kw):
    import copy

    from datasets import Dataset

    model, tok, _ = tiny_setup(seed=0)
    ds = Dataset.from_list([{"prompt": f"What is {a} plus {b}?", "chosen": f" {a + b}.", "rejected": f" {a * b + 1}."}
                            for a in range(6) for b in range(6)])
    args = config_cls(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=4, learning_rate=3e-3,
                      logging_steps=1, save_strategy="no", report_to="none", max_length=64, bf16=False, seed=0, **kw)
    trainer = trainer_cls(model=model, ref_model=copy.deepcopy(model).eval(), args=args, train_dataset=ds,
                          processing_class=tok)
    trainer.train()
    return trainer, [h for h in run_history(trainer) if "loss" in h]


def test_dpo_trainer_with_offload_follows_trls_own(tmp_path):
    """OffloadDPOTrainer against trl.DPOTrainer on the same model, reference and data: DPO's own loss (its batches
    have no `labels`, so the chunked loss stays out), the same first step, and the same course with 8-bit streamed
    AdamW in place of fp32 AdamW."""
    from offload_trainer.trl import OffloadDPOConfig, OffloadDPOTrainer

    ours, got = _dpo(tmp_path / "ours", OffloadDPOTrainer, OffloadDPOConfig, offload_optimizer=True)
    _, want = _dpo(tmp_path / "trl", trl.DPOTrainer, trl.DPOConfig, optim="adamw_torch")
    assert isinstance(ours._run.optimizer, StreamedAdamW8bit)
    assert len(got) == len(want) == 8
    assert got[0]["loss"] == pytest.approx(want[0]["loss"], abs=1e-6)  # before any update: DPO's loss, ours unchanged
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(got, want)) < 0.02
    assert all("rewards/accuracies" in h and "tok_per_s" in h for h in got)  # TRL's metrics and ours
    assert got[-1]["loss"] < got[0]["loss"]


def test_the_plan_counts_a_reference_model(tmp_path):
    from offload_trainer.trainer import wiring
    from offload_trainer.planner import plan_for_run, run_budget, run_shape
    from offload_trainer.trl import OffloadDPOConfig, OffloadDPOTrainer

    trainer, _ = _dpo(tmp_path, OffloadDPOTrainer, OffloadDPOConfig, offload_optimizer=True)
    want = sum(p.numel() * p.element_size() for p in trainer.ref_model.parameters()) / 2**30
    assert wiring.reference_model_gib(trainer) == pytest.approx(want, rel=0.01) and want > 0
    config, settings = trainer.model.config, trainer._run.settings
    alone = plan_for_run(settings, run_shape(config, 64), run_budget(settings, gpu_gb=1.0))
    beside = plan_for_run(settings, run_shape(config, 64),
                          run_budget(settings, gpu_gb=1.0, other_models_gib=0.25))
    assert beside.gpu_budget_gib == pytest.approx(alone.gpu_budget_gib - 0.25)


def test_the_mixin_adds_no_name_a_trl_trainer_defines():
    """OffloadMixin's own methods must not shadow a TRL trainer's (DPOTrainer.compute_loss calls its own
    `_compute_loss`: a mixin method of that name recursed forever)."""
    import transformers

    from offload_trainer.trainer.mixin import OffloadMixin

    added = {n for n in vars(OffloadMixin) if not n.startswith("__")} - set(dir(transformers.Trainer))
    for name in dir(trl):
        cls = getattr(trl, name, None) if name.endswith("Trainer") else None
        if not (isinstance(cls, type) and issubclass(cls, transformers.Trainer)):
            continue
        own = set().union(*(vars(c) for c in cls.__mro__[:cls.__mro__.index(transformers.Trainer)]))
        assert not added & own, (name, sorted(added & own))
