"""Activation offload against plain gradient checkpointing: identical gradients (CPU; `gpu` on CUDA)."""
import pytest
import torch

from helpers import tiny_setup
from offload_trainer.engine.activations import ActivationOffloader, enable_activation_offload


def grads_of(model, batch):
    model.zero_grad()
    model(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def batch_of(train, n=3):
    return {k: torch.stack([train[i][k] for i in range(n)]) for k in train[0]}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_offloaded_checkpointing_gives_identical_gradients(device):
    model, _, train = tiny_setup(layers=3)
    model.to(device).train()
    batch = {k: v.to(device) for k, v in batch_of(train).items()}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = grads_of(model, batch)
    offloader = enable_activation_offload(model)
    got = grads_of(model, batch)
    assert offloader.stats["d2h_bytes"] == 3 * batch["input_ids"].numel() * model.config.hidden_size * 4
    assert offloader.stats["h2d_bytes"] == offloader.stats["d2h_bytes"]
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    got2 = grads_of(model, batch)  # a second step reuses the host buffers
    assert all(torch.equal(ref[n], got2[n]) for n in ref)


def test_the_recompute_stops_before_each_layers_last_matmul():
    """Backward recomputes only what it saved, as transformers' (non-reentrant) checkpointing does: no decoder
    layer's down projection runs again (its output is saved by nothing); a reentrant recompute runs it per layer."""
    model, _, train = tiny_setup(layers=3)
    model.train()
    calls = {"forward": 0, "backward": 0}

    def count(module, args, out):  # after the matmul: a recompute that stops before it never gets here
        calls["backward" if torch._C._current_autograd_node() is not None else "forward"] += 1

    for layer in model.model.layers:
        layer.mlp.down_proj.register_forward_hook(count)
    batch = batch_of(train)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model(**batch).loss.backward()
    assert calls == {"forward": 3, "backward": 0}  # the reference: plain non-reentrant checkpointing
    enable_activation_offload(model)
    model(**batch).loss.backward()
    assert calls == {"forward": 6, "backward": 0}


def test_an_offloaded_input_is_not_kept_by_the_graph():
    """Between forward and backward only the host copy of a checkpointed input exists: the graph holds no
    reference to the tensor itself (checkpoint's own inputs would keep it on the GPU)."""
    import weakref

    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    x = torch.randn(4, 8, requires_grad=True)
    h = x * 2
    alive = weakref.ref(h)
    out = ActivationOffloader("cpu").checkpoint(layer, h)
    del h
    assert alive() is None
    out.sum().backward()
    ref = torch.autograd.grad(torch.utils.checkpoint.checkpoint(layer, x * 2, use_reentrant=False).sum(), x)[0]
    assert torch.equal(x.grad, ref)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_dropout_is_recomputed_with_the_forwards_random_state(device):
    """A layer with dropout: the recompute draws the forward's mask (the random state of x's device is kept, though
    x itself is not among checkpoint's inputs), so gradients equal plain checkpointing's."""
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Dropout(0.5), torch.nn.Tanh()).to(device)
    x = torch.randn(32, 64, device=device, requires_grad=True)

    def grads(checkpoint):
        torch.manual_seed(1)
        if device == "cuda":
            torch.cuda.manual_seed(1)
        torch.randn(3, device=device)  # (the state moves on between the forward and the recompute)
        out = checkpoint(layer, x * 1.0)
        torch.randn(3, device=device)
        return torch.autograd.grad(out.sum(), [x, *layer.parameters()])

    ref = grads(lambda fn, h: torch.utils.checkpoint.checkpoint(fn, h, use_reentrant=False))
    got = grads(ActivationOffloader(device).checkpoint)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_frozen_inputs_still_train_the_layer():
    """With the embeddings frozen no layer input requires grad; the layer weights must still get grads."""
    model, _, train = tiny_setup(layers=2)
    model.train()
    model.get_input_embeddings().weight.requires_grad_(False)
    enable_activation_offload(model)
    model(**batch_of(train)).loss.backward()
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None


def test_bare_loop_checkpoint_function():
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    x = torch.randn(4, 8, requires_grad=True)
    ref = torch.autograd.grad(torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False).sum(), x)[0]
    off = ActivationOffloader("cpu")
    got = torch.autograd.grad(off.checkpoint(layer, x).sum(), x)[0]
    assert torch.equal(ref, got)


def test_a_keyword_tensor_shared_by_layers_gets_its_gradient_once_per_layer():
    """transformers binds a checkpointed layer's keyword arguments into a partial; a keyword tensor that requires
    grad and feeds several layers (cross-attention states) must get every layer's gradient, as with plain
    checkpointing, not be backpropagated through its own graph once per layer."""
    import functools

    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(3)]
    proj = torch.nn.Linear(8, 8)

    def layer_fn(layer, h, *, states, scale):
        return torch.tanh(layer(h) + states * scale)

    def run(checkpoint):
        for m in (*layers, proj):
            m.zero_grad()
        h, states = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), proj(torch.ones(4, 8))
        for layer in layers:
            h = checkpoint(functools.partial(layer_fn, layer, states=states, scale=0.5), h)
        h.sum().backward()
        return [p.grad.clone() for m in (*layers, proj) for p in m.parameters()]

    ref = run(lambda fn, h: torch.utils.checkpoint.checkpoint(fn, h, use_reentrant=False))
    got = run(ActivationOffloader("cpu").checkpoint)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_max_inflight_bounds_pending_copies(monkeypatch):
    """Forward's CPU waits for the oldest pending copy once more than `max_inflight` are queued, oldest first."""
    model, _, train = tiny_setup(layers=4)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    offloader = enable_activation_offload(model, max_inflight=2)
    waited = []

    class Event:
        def synchronize(self):
            waited.append(self)

    monkeypatch.setattr(offloader._streams, "record", lambda stream: Event())
    loss = model(**batch_of(train)).loss  # forward: 4 inputs offloaded
    stored = [e.stored for e in offloader._entries]
    assert len(stored) == 4 and waited == stored[:2]
    loss.backward()
    with pytest.raises(ValueError, match="max_inflight"):
        ActivationOffloader("cpu", max_inflight=0)
