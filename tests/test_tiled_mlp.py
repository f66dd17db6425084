"""Tiled MLP against the MLP run whole: the same losses, input gradients and weight gradients (float32 on the CPU;
bf16 on the GPU within the rounding of summing tiles), gradient hooks called once per tensor, and the streamed
optimizer training the same model."""
import copy

import pytest
import torch

from offload_trainer.engine.tiled_mlp import tile_mlps
from test_swap import DEVICES, setup


def grads_of(model, batch):
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("device", DEVICES)
def test_tiled_mlp_gives_the_whole_mlps_gradients(device):
    ref, _, batches = setup(device, layers=3)
    tiled = copy.deepcopy(ref)
    assert tile_mlps(tiled.model.layers, tile=24) == 3  # rows of 64 tokens: tiles of 24, 24 and 16
    calls = {}
    for n, p in tiled.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: calls.__setitem__(n, calls.get(n, 0) + 1))
    for batch in batches[:2]:
        loss_a, a = grads_of(ref, batch)
        loss_b, b = grads_of(tiled, batch)
        assert loss_a == pytest.approx(loss_b, rel=1e-6)
        for n in a:
            torch.testing.assert_close(b[n], a[n], rtol=1e-4, atol=1e-6, msg=n)
    assert set(calls.values()) == {2}  # each gradient completed once per backward, as without tiles
    with torch.no_grad():  # (no autograd: the MLP runs whole)
        torch.testing.assert_close(tiled(**batches[2]).logits, ref(**batches[2]).logits)


def test_tiled_mlp_is_applied_once_and_only_to_long_inputs():
    ref, _, batches = setup("cpu", layers=2)
    assert tile_mlps(ref.model.layers, tile=64) == 2
    assert tile_mlps(ref.model.layers, tile=8) == 0  # already tiled
    with pytest.raises(ValueError):
        tile_mlps(ref.model.layers, tile=0)


@pytest.mark.slow
def test_tiled_mlp_and_tiled_layers_through_the_trainer(tmp_path, monkeypatch, caplog):
    """`tiled_mlp: true` and `tiled_layers: true` (tiles of 8 positions here): each said once, and the runs' losses
    and gradient norms those of the untiled run, with the streamed optimizer (its hooks see each gradient once) and
    exact clipping."""
    import logging

    from helpers import tiny_setup
    from offload_trainer import OffloadTrainer
    from offload_trainer.trainer import wiring
    from test_trainer import make_args

    monkeypatch.setattr(wiring, "MLP_TILE_TOKENS", 8)

    def run(out, **kw):
        model, _, train = tiny_setup(seq=32, layers=2)
        args = make_args(tmp_path / out, max_steps=5, save_steps=100, activation_checkpointing=True, **kw)
        trainer = OffloadTrainer(model=model, args=args, train_dataset=train)
        trainer.train()
        return [h for h in trainer.state.log_history if "loss" in h]

    plain = run("plain")
    with caplog.at_level(logging.INFO, logger="offload_trainer"):
        tiled = run("tiled", tiled_mlp=True)
        layers = run("layers", tiled_layers=True)
    assert [r.getMessage() for r in caplog.records if "tiled" in r.getMessage()] == [
        "tiled MLP: 2 MLPs run in tiles of 8 tokens, each recomputed in backward (their intermediate activations "
        "exist for one tile at a time)",
        "tiled layers: 2 of 2 decoder layers run in tiles of 8 tokens around their attention (norms, projections, "
        "residuals and MLP; each tile recomputed in backward)"]
    for key in ("loss", "grad_norm"):
        assert [h[key] for h in tiled] == pytest.approx([h[key] for h in plain], rel=1e-4), key
        assert [h[key] for h in layers] == pytest.approx([h[key] for h in plain], rel=1e-4), key
