"""What the optimizer tests share: the reference pair (torchao `AdamW8bit` and ours on one tiny model), a training
run with fresh random batches, a schedule that gives both the same learning rates, and a model whose head is read
without its forward running."""
import contextlib
import math

import torch
from torchao.optim import AdamW8bit

from offload_trainer.engine.optim import StreamedAdamW8bit
from tiny_models import TinyLM, param_groups

LR, BETAS, WD = 3e-3, (0.9, 0.95), 0.1


class Cosine:
    """Warmup + cosine, lr set to the same Python number on both optimizers (torchao keeps lr a float32 tensor, filled
    in place; ours a float): a LambdaLR would compute torchao's product in float32 and ours in float64, and the
    optimizers' arithmetic would no longer be compared alone."""

    def __init__(self, opt, steps, warmup=5):
        self.opt, self.steps, self.warmup, self.s = opt, steps, warmup, 0
        # each group's lr as built, rounded to float32 as torchao keeps it (ours keeps the float): the same on both
        self.base = [float(torch.tensor(float(g["lr"]), dtype=torch.float32)) for g in opt.param_groups]
        self._set()

    def _set(self):
        s, w = self.s, self.warmup
        f = (s + 1) / w if s < w else 0.5 * (1 + math.cos(math.pi * (s - w) / max(1, self.steps - w)))
        for g, base in zip(self.opt.param_groups, self.base):
            if isinstance(g["lr"], torch.Tensor):
                g["lr"].fill_(base * f)
            else:
                g["lr"] = base * f

    def step(self):
        self.s += 1
        self._set()


def run(model, opt, *, steps, accum, max_norm, seed, streamed, device, order="model", nan_steps=()):
    """Fresh random batches every micro-step; returns losses and grad norms. A step in `nan_steps` has a NaN loss: the
    reference skips its update as the Trainer does (its gradients dropped, the schedule goes on)."""
    sched = Cosine(opt, steps)
    gen = torch.Generator().manual_seed(seed)
    losses, norms = [], []
    for step in range(steps):
        for micro in range(accum):
            ids = torch.randint(0, 128, (4, 17), generator=gen).to(device)
            last = micro == accum - 1
            ctx = opt.no_update() if streamed and not last else contextlib.nullcontext()
            with ctx:
                loss = model.loss(ids) / accum * (float("nan") if step in nan_steps else 1.0)
                loss.backward()
            losses.append(loss.item())
        if max_norm:
            if streamed:
                norms.append(float(opt.clip_grad_norm_(max_norm)))
            else:  # without attach(), the streamed optimizer sums norms in param-group order
                params = [p for g in opt.param_groups for p in g["params"]] if order == "groups" else model.parameters()
                norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        if streamed or step not in nan_steps:
            opt.step()
        sched.step()
        opt.zero_grad()
    if streamed:
        opt.synchronize()  # the last updates may still run on the update stream; we read weights next
    return losses, norms


def run_speculative(model, opt, *, steps, accum, max_norm, seed, device, nan_steps=()):
    """`run` for a speculative optimizer: the step's micro-batches are kept, and `redo` runs them again; a step in
    `nan_steps` has a NaN loss. Returns losses and grad norms (the first pass's: a redo repeats them)."""
    sched = Cosine(opt, steps)
    gen = torch.Generator().manual_seed(seed)
    losses, norms = [], []
    for step in range(steps):
        batches = [torch.randint(0, 128, (4, 17), generator=gen).to(device) for _ in range(accum)]

        def forward_backward(record=None):
            for micro, ids in enumerate(batches):
                with opt.no_update() if micro < accum - 1 else contextlib.nullcontext():
                    loss = model.loss(ids) / accum * (float("nan") if step in nan_steps else 1.0)
                    loss.backward()
                if record is not None:
                    record.append(loss.item())

        forward_backward(losses)
        norms.append(float(opt.clip_grad_norm_(max_norm, redo=forward_backward)))
        opt.step()
        sched.step()
        opt.zero_grad()
    opt.synchronize()
    return losses, norms


def make_pair(device, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    ref = TinyLM().to(device=device, dtype=dtype)
    ours = TinyLM().to(device=device, dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    ref_opt = AdamW8bit(param_groups(ref), lr=LR, betas=BETAS, bf16_stochastic_round=False)
    opt = StreamedAdamW8bit(param_groups(ours), lr=LR, betas=BETAS, bf16_stochastic_round=False,
                            chunk_numel=kw.pop("chunk_numel", 4096), inflight_chunks=2, **kw)
    return ref, ref_opt, ours, opt


def rel_l2(a: torch.nn.Module, b: torch.nn.Module) -> float:
    num = sum((x.detach().float() - y.detach().float()).pow(2).sum() for x, y in zip(a.parameters(), b.parameters()))
    den = sum(x.detach().float().pow(2).sum() for x in a.parameters())
    return float((num / den).sqrt())


class HeadReadLM(TinyLM):
    """A loss that reads the head's weight without calling the head (as a chunked loss does): its forward pre-hook
    never runs, so no wait of its own covers its update."""

    def loss(self, ids):
        x = self.embed(ids[:, :-1])
        for layer in self.layers:
            x = layer(x)
        logits = torch.nn.functional.linear(x, self.head.weight, self.head.bias)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
