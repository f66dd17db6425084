import pytest
import torch
import torch.nn.functional as F

from offload_trainer.engine.loss import chunked_causal_lm_loss


def reference(hidden, labels, weight, bias, num_items=None):
    logits = F.linear(hidden, weight, bias).float()
    shift = F.pad(labels, (0, 1), value=-100)[..., 1:]
    red = "mean" if num_items is None else "sum"
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift.reshape(-1), ignore_index=-100, reduction=red)
    return loss if num_items is None else loss / num_items


def test_chunked_loss_and_grads_match_full_logits():
    torch.manual_seed(0)
    h = torch.randn(3, 37, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    b = torch.randn(50, requires_grad=True)
    labels = torch.randint(0, 50, (3, 37))
    labels[1, 5:20] = -100
    for num_items in (None, 91):
        ref = reference(h, labels, w, b, num_items)
        g_ref = torch.autograd.grad(ref, (h, w, b))
        ours = chunked_causal_lm_loss(h, labels, w, b, chunk_size=16, num_items_in_batch=num_items)
        g = torch.autograd.grad(ours, (h, w, b))
        torch.testing.assert_close(ours, ref)
        for a, r in zip(g, g_ref):
            torch.testing.assert_close(a, r)


def _bf16_case(seed=0, vocab=50, d=16):
    torch.manual_seed(seed)
    h = torch.randn(3, 37, d, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(vocab, d, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (3, 37))
    labels[1, 5:20] = -100
    return h, w, labels


def test_gradients_computed_with_the_loss_equal_the_checkpointed_chunks():
    """The reference is the recomputing path (each chunk checkpointed): same kernels, so the loss and the hidden
    states' gradient are bit-equal for a unit gradient; the head's weight gradient is summed over chunks in another
    order (one rounding per chunk instead of two), so it is equal to bf16 rounding; a scaled backward scales both."""
    from offload_trainer.engine.loss import _checkpointed_sum
    h, w, labels = _bf16_case()
    targets = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    for scale in (1.0, 0.25):
        ref = _checkpointed_sum(h.reshape(-1, 16), w, None, targets, 16, True) / (targets != -100).sum()
        g_ref = torch.autograd.grad(ref * scale, (h, w))
        ours = chunked_causal_lm_loss(h, labels, w, None, chunk_size=16)
        assert ours.grad_fn is not None and "LossAndGrads" in type(ours.grad_fn).__name__
        g = torch.autograd.grad(ours * scale, (h, w))
        assert torch.equal(ours, ref)
        if scale == 1.0:
            assert torch.equal(g[0], g_ref[0])
        torch.testing.assert_close(g[0], g_ref[0])
        torch.testing.assert_close(g[1], g_ref[1], atol=2e-3, rtol=1.6e-2)


def test_the_head_runs_once_per_chunk_in_training():
    """No recompute in backward: each chunk's softmax (and head matmul) runs once per forward and backward; the
    checkpointed path runs them twice."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += func is torch.ops.aten._log_softmax.default
            return func(*args, **(kwargs or {}))

    h, w, labels = _bf16_case()
    with Count():
        chunked_causal_lm_loss(h, labels, w, None, chunk_size=16).backward()
    assert Count.n == 7  # ceil(3 * 37 / 16) chunks


def test_a_second_backward_through_the_loss_names_the_setting_that_allows_it():
    """The gradients are computed once, with the loss: a second backward (retain_graph=True) cannot be answered
    again, and says which setting (the model's own loss) can."""
    h, w, labels = _bf16_case()
    loss = chunked_causal_lm_loss(h, labels, w, None, chunk_size=16)
    loss.backward(retain_graph=True)
    first = h.grad.clone()
    with pytest.raises(RuntimeError, match="loss_chunk_size: 0"):
        loss.backward()
    assert torch.equal(h.grad, first)  # the first backward's gradients stay as they were


def test_frozen_head_and_mixed_dtypes_match_full_logits():
    """A head that takes no gradient (LoRA) gets none; a float32 head under bf16 autocast takes the checkpointed
    path (autocast casts inside it), and both match the full logits."""
    h, w, labels = _bf16_case()
    w.requires_grad_(False)
    ours = chunked_causal_lm_loss(h, labels, w, None, chunk_size=16)
    (gh,) = torch.autograd.grad(ours, (h,))
    ref = reference(h, labels, w, None)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(gh, torch.autograd.grad(ref, (h,))[0])
    w32 = w.detach().float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = chunked_causal_lm_loss(h, labels, w32, None, chunk_size=16)
        ref = reference(h, labels, w32, None)
        assert "LossAndGrads" not in type(ours.grad_fn).__name__
    torch.testing.assert_close(ours, ref)
    for a, r in zip(torch.autograd.grad(ours, (h, w32)), torch.autograd.grad(ref, (h, w32))):
        torch.testing.assert_close(a, r, atol=2e-3, rtol=1.6e-2)


@pytest.mark.gpu
def test_the_cross_entropy_kernel_matches_the_aten_kernels():
    """`ce_kernel` against the aten path it replaces on CUDA: each row's loss to float32 rounding, the gradient to
    bf16's (ignored rows zero), at a vocabulary of Llama-3's size and at one that is no multiple of its block."""
    from offload_trainer.engine import ce_kernel
    from offload_trainer.engine.loss import _loss_and_grad
    torch.manual_seed(0)
    for vocab in (128256, 5003):
        logits = (torch.randn(300, vocab, device="cuda") * 3).to(torch.bfloat16)
        y = torch.randint(0, vocab, (300,), device="cuda")
        y[::7] = -100
        scale = torch.ones((), device="cuda") / 257
        total, ref = _loss_and_grad(logits, y, scale)
        assert ce_kernel.available(logits)
        losses = ce_kernel.loss_and_grad_(logits, y, scale, -100)
        torch.testing.assert_close(losses.sum(), total, rtol=1e-5, atol=0)
        assert bool((losses[::7] == 0).all()) and not bool(logits[::7].any())
        torch.testing.assert_close(logits, ref, rtol=1.6e-2, atol=1e-9)


@pytest.mark.gpu
def test_gradients_with_the_loss_on_the_gpu_at_a_real_vocabulary(monkeypatch):
    """On CUDA at Llama-3's vocabulary, against the checkpointed chunks: the loss to float32 rounding, the gradients
    to bf16's, and the memory above the inputs peaking lower (one chunk's bf16 logits against up to three chunk-sized
    float32 tensors). Without the kernel (the aten path) the loss and the hidden states' gradient are bit-equal."""
    from offload_trainer.engine import ce_kernel
    from offload_trainer.engine.loss import _checkpointed_sum
    torch.manual_seed(0)
    vocab, d, tokens, chunk = 128256, 256, 4096, 1024
    h = torch.randn(1, tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, d, device="cuda", dtype=torch.bfloat16) / 16).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), device="cuda")
    targets = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    peaks, out = [], []
    for how in ("checkpointed", "kernel", "aten"):
        monkeypatch.setattr(ce_kernel, "available", lambda t, ok=ce_kernel.available, how=how: how != "aten" and ok(t))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        if how == "checkpointed":
            loss = _checkpointed_sum(h.reshape(-1, d), w, None, targets, chunk, True) / (targets != -100).sum()
        else:
            loss = chunked_causal_lm_loss(h, labels, w, None, chunk_size=chunk)
        out.append((loss, *torch.autograd.grad(loss, (h, w))))
        peaks.append(torch.cuda.max_memory_allocated() - base)
    (ref, gh_ref, gw_ref), kernel, aten = out
    torch.testing.assert_close(kernel[0], ref, rtol=1e-5, atol=0)
    for ours in kernel, aten:
        for g, g_ref in zip(ours[1:], (gh_ref, gw_ref)):
            torch.testing.assert_close(g, g_ref, atol=2e-3, rtol=1.6e-2)
    assert torch.equal(aten[0], ref) and torch.equal(aten[1], gh_ref)
    assert peaks[1] < peaks[0] / 2, peaks
