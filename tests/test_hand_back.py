"""The model handed back (`OffloadTrainer.hand_back_model`, an error in train(), the command's end): every forward
replacement, hook and mechanism of ours off it, so that it is the user's model again; a later train() of the same
Trainer, or a new Trainer, takes it again."""
import pytest
import torch
from torch import nn

from helpers import tiny_setup
from offload_trainer import OffloadTrainer, OffloadTrainingArguments
from offload_trainer.engine import wrap


def _hooks(model: nn.Module) -> dict:
    """What runs around each module and parameter, by name: an instance forward (its function's name), the hook
    counts, the checkpointing function's owner. (Not forward hooks: the Trainer's own `enable_input_require_grads`
    adds one on the input embeddings at each train(), as the stock Trainer does; none of ours is one.)"""
    seen = {}
    for name, m in model.named_modules():
        forward = m.__dict__.get("forward")
        func = m.__dict__.get("_gradient_checkpointing_func")
        seen[name] = (getattr(forward, "__qualname__", None), len(m._forward_pre_hooks), len(m._backward_hooks),
                      len(getattr(m, "_backward_pre_hooks", {})), type(getattr(func, "__self__", None)).__name__,
                      getattr(m, "gradient_checkpointing", None))
    for name, p in model.named_parameters():
        seen["param " + name] = len(p._post_accumulate_grad_hooks or {}), len(p._backward_hooks or {})
    return seen


def _args(out, **kw):
    return OffloadTrainingArguments(output_dir=str(out), max_steps=2, per_device_train_batch_size=2,
                                    learning_rate=3e-3, offload_optimizer=True, activation_checkpointing=True,
                                    activation_offload=True, tiled_mlp=True, tiled_layers=True, layer_swap="1",
                                    max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to="none", **kw)


@pytest.mark.slow
def test_a_trained_model_is_handed_back_as_the_users_and_trains_again(tmp_path):
    model, _, train = tiny_setup(seq=32, layers=2)
    trainer = OffloadTrainer(model=model, args=_args(tmp_path / "a"), train_dataset=train)
    # what the Trainer itself sets on the model at train() (checkpointing on, inputs requiring grad) is the user's
    # model as the stock Trainer leaves it: compare against that
    trainer.train()
    assert wrap.carries_ours(model) and trainer._run.optimizer is not None and trainer._run.swap is not None
    held = _hooks(model)
    handed = trainer.hand_back_model()
    assert handed is model and not wrap.carries_ours(model)
    after = _hooks(model)
    ours = {k: (held[k], after[k]) for k in held if held[k] != after[k]}
    assert ours, "nothing of ours was on the model: the check below could not fail"
    for name, m in model.named_modules():
        assert "forward" not in m.__dict__, f"{name} keeps a forward of ours"
        func = m.__dict__.get("_gradient_checkpointing_func")
        assert getattr(func, "__self__", None) is None, f"{name} checkpoints through our offloader"
    assert not hasattr(model, "_offload_trainer_activations")
    assert all(not (p._post_accumulate_grad_hooks or {}) for p in model.parameters()), "an optimizer hook stays"
    # its forward is the model's own: the same logits as a fresh model with its weights
    fresh, _, _ = tiny_setup(seq=32, layers=2)
    fresh.load_state_dict({k: v.to("cpu") for k, v in model.state_dict().items()})
    ids = torch.tensor([list(range(1, 17))])
    model.eval(), fresh.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, fresh(ids).logits)
    # the same Trainer's next train() takes it again (its optimizer kept), and hands it back clean once more
    model.train()
    steps_before = trainer._run.optimizer.state_dict()["state"]
    trainer.train()
    assert wrap.carries_ours(model) and _hooks(model) == held
    assert trainer._run.swap is not None and trainer._run.optimizer.state_dict()["state"].keys() == steps_before.keys()
    trainer.hand_back_model()
    assert _hooks(model) == after
    # a new Trainer takes it and trains it: one optimizer's hooks, not two
    model.train()
    again = OffloadTrainer(model=model, args=_args(tmp_path / "b"), train_dataset=train)
    again.train()
    losses = [h["loss"] for h in again.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert all(len(p._post_accumulate_grad_hooks or {}) <= 1 for p in model.parameters())


@pytest.mark.slow
def test_a_new_trainer_takes_the_model_from_one_that_still_holds_it(tmp_path, caplog):
    """Without hand_back_model(), the first Trainer's optimizer hooks would also update the weights in the second's
    backward: the second takes everything of the first off the model first, and says so."""
    import logging

    model, _, train = tiny_setup(seq=32, layers=2)
    OffloadTrainer(model=model, args=_args(tmp_path / "a"), train_dataset=train).train()
    with caplog.at_level(logging.INFO, logger="offload_trainer"):
        second = OffloadTrainer(model=model, args=_args(tmp_path / "b"), train_dataset=train)
    assert "came with another OffloadTrainer's optimizer" in caplog.text
    second.train()
    assert all(len(p._post_accumulate_grad_hooks or {}) <= 1 for p in model.parameters())


def test_an_error_in_train_hands_the_model_back(tmp_path):
    from transformers import TrainerCallback

    class Boom(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            raise RuntimeError("boom")

    model, _, train = tiny_setup(seq=32, layers=2)
    trainer = OffloadTrainer(model=model, args=_args(tmp_path), train_dataset=train, callbacks=[Boom()])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    assert not wrap.carries_ours(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_unwrap_restores_each_forward_as_it_was():
    """Two replacements of one module's forward, and one that was an instance attribute before ours: unwrap puts
    back what was there first, hooks and undo functions run once, last first."""
    lin, other = nn.Linear(2, 2), nn.Linear(2, 2)
    own = lin.forward
    order = []
    assert wrap.wrap_forward(lin, "a", lambda f: lambda x: f(x) + 1)
    assert not wrap.wrap_forward(lin, "a", lambda f: lambda x: f(x) + 100)  # (once per tag)
    assert wrap.wrap_forward(lin, "b", lambda f: lambda x: f(x) * 2)
    custom = lambda x: x  # noqa: E731 (a user's own instance forward)
    other.forward = custom
    wrap.wrap_forward(other, "a", lambda f: lambda x: f(x) + 1)
    model = nn.Sequential(lin, other)
    wrap.add_hook(model, lin.register_forward_pre_hook(lambda m, a: order.append("hook")))
    wrap.on_unwrap(model, lambda: order.append("first"))
    wrap.on_unwrap(model, lambda: order.append("second"))
    x = torch.ones(1, 2)
    assert torch.equal(lin(x), (own(x) + 1) * 2) and wrap.wrapped(lin, "b")
    assert wrap.unwrap(model) == 2
    assert order == ["hook", "second", "first"] and not wrap.carries_ours(model)
    assert "forward" not in lin.__dict__ and other.forward is custom and not lin._forward_pre_hooks
    assert torch.equal(lin(x), own(x))
