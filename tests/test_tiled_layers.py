"""Tiled decoder layers against the layers run whole, per family (Llama; Qwen2 with projection biases; Qwen3 with
per-head q/k norms): the same loss, input and weight gradients (float32 on the CPU, bf16 on the GPU within the
rounding of summing tiles), each gradient completed once, with gradient checkpointing and with activation offload's
checkpoint; untouched where autograd is off, the input short, or the layer of another structure."""
import copy

import pytest
import torch

from offload_trainer.engine.activations import enable_activation_offload
from offload_trainer.engine.tiled_mlp import run_tiled, tile_mlps
from offload_trainer.models.tiled_layers import tile_decoder_layers

FAMILIES = {
    "llama": {},
    "qwen2": {},  # (q/k/v projections with biases)
    "qwen3": {"head_dim": 16},  # (q_norm and k_norm on each head)
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def tiny(family, device, dtype, layers=3):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                  max_position_embeddings=256, **FAMILIES[family])
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).to(device, dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    return model


def grads_of(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("offload", [False, True])
def test_tiled_layers_give_the_whole_layers_gradients(family, device, offload):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    ref = tiny(family, device, dtype)
    tiled = copy.deepcopy(ref)
    assert tile_decoder_layers(tiled.model.layers, tile=24) == 3  # rows of 64 tokens: tiles of 24, 24 and 16
    if offload:
        enable_activation_offload(tiled)
    calls = {}
    for n, p in tiled.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: calls.__setitem__(n, calls.get(n, 0) + 1))
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-3)
    for seed in range(2):
        ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(seed)).to(device)
        loss_a, a = grads_of(ref, ids)
        loss_b, b = grads_of(tiled, ids)
        assert loss_b == pytest.approx(loss_a, rel=1e-5 if dtype == torch.float32 else 1e-2)
        for n in a:
            torch.testing.assert_close(b[n], a[n], **tol, msg=n)
    assert set(calls.values()) == {2}  # each gradient completed once per backward, as without tiles
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(5)).to(device)
    with torch.no_grad():  # (no autograd: the layers run whole)
        torch.testing.assert_close(tiled(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_tiled_layers_with_tiled_mlps_and_only_known_layers():
    ref = tiny("llama", "cpu", torch.float32, layers=2)
    tiled = copy.deepcopy(ref)
    assert tile_mlps(tiled.model.layers, tile=8) == 2
    assert tile_decoder_layers(tiled.model.layers, tile=24) == 2
    assert tile_decoder_layers(tiled.model.layers, tile=8) == 0  # already tiled
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(0))
    loss_a, a = grads_of(ref, ids)
    loss_b, b = grads_of(tiled, ids)
    assert loss_b == pytest.approx(loss_a, rel=1e-5)
    for n in a:
        torch.testing.assert_close(b[n], a[n], rtol=1e-4, atol=1e-6, msg=n)
    with pytest.raises(ValueError):
        tile_decoder_layers(tiled.model.layers, tile=0)
    assert tile_decoder_layers(torch.nn.ModuleList([torch.nn.Linear(2, 2)]), tile=8) == 0


def test_run_tiled_gives_zeros_for_an_input_no_output_uses():
    x = torch.randn(2, 10, 3, requires_grad=True)
    unused = torch.randn(2, 10, 3, requires_grad=True)
    w = torch.randn(3, 3, requires_grad=True)
    (y,) = run_tiled(lambda a, b: (a @ w,), 4, [x, unused], [w])
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(2, 10, 3) @ w.detach().T)
    torch.testing.assert_close(w.grad, x.detach().reshape(-1, 3).T @ torch.ones(20, 3))
    assert torch.equal(unused.grad, torch.zeros(2, 10, 3))
