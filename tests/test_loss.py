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
