"""The streamed optimizer on CUDA: real side streams, pinned memory, against torchao AdamW8bit on the GPU."""
import contextlib
import math

import pytest
import torch
from torchao.optim import AdamW8bit

from offload_trainer.engine.optim import StreamedAdamW8bit
from optim_cases import BETAS, LR, HeadReadLM, rel_l2, run
from tiny_models import TinyLM, param_groups

pytestmark = pytest.mark.gpu

MODES = {
    "update_in_backward": (dict(update_in_backward=True), 0.0),
    "offload_grads_clip": (dict(offload_gradients=True), 0.5),
    "grads_on_gpu_clip": (dict(), 0.5),
    "update_in_backward_offload_grads": (dict(update_in_backward=True, offload_gradients=True), 0.0),
    # the embedding's states (first in model order) kept on the GPU, the others streamed:
    "update_in_backward_device_states": (dict(update_in_backward=True, device_state_bytes=40000), 0.0),
    "offload_grads_clip_device_states": (dict(offload_gradients=True, device_state_bytes=40000), 0.5),
}


def pair(model_kw, dtype, lr=LR, cls=TinyLM, **kw):
    torch.manual_seed(0)
    ref = cls(**model_kw).to("cuda", dtype)
    ours = cls(**model_kw).to("cuda", dtype)
    ours.load_state_dict(ref.state_dict())
    ref_opt = AdamW8bit(param_groups(ref), lr=lr, betas=BETAS, bf16_stochastic_round=False)
    opt = StreamedAdamW8bit(param_groups(ours), lr=lr, betas=BETAS, bf16_stochastic_round=False,
                            chunk_numel=kw.pop("chunk_numel", 4096), inflight_chunks=2, **kw)
    opt.attach(ours)
    return ref, ref_opt, ours, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", list(MODES))
def test_matches_torchao_on_gpu_50_steps(mode, dtype):
    kw, max_norm = MODES[mode]
    ref, ref_opt, ours, opt = pair({}, dtype, **kw)
    a = run(ref, ref_opt, steps=50, accum=2, max_norm=max_norm, seed=1, streamed=False, device="cuda")
    b = run(ours, opt, steps=50, accum=2, max_norm=max_norm, seed=1, streamed=True, device="cuda")
    assert opt._states.host_codes.is_pinned()
    assert bool(opt._states.on_device) == ("device_state_bytes" in kw)
    err = rel_l2(ref, ours)
    print(f"{mode} {dtype}: rel L2 {err:.2e}, last losses {a[0][-1]:.4f} / {b[0][-1]:.4f}")
    assert err <= 1e-3


THIN_WIDE = dict(vocab=128, d=32, hidden=1 << 17, n_layers=2)  # big copies, almost no compute
THIN_LR = 1e-4  # at 3e-3 without clipping the reference itself diverges to NaN on this shape


def change_err(ref, ours, start) -> float:
    """||(ours - start) - (ref - start)|| / ||ref - start||: errors relative to how far the weights moved."""
    num = den = 0.0
    for (name, r), o in zip(ref.named_parameters(), ours.parameters()):
        d = r.detach().float() - start[name]
        num += float((o.detach().float() - r.detach().float()).pow(2).sum())
        den += float(d.pow(2).sum())
    return (num / den) ** 0.5


@pytest.mark.parametrize("mode", list(MODES))
def test_thin_wide_layers_catch_missing_stream_syncs(mode):
    """Copies of 4M-element chunks take far longer than the tiny matmuls: an update that did not wait for
    its H2D copy, or a forward that did not wait for its update, would read stale data and diverge."""
    kw, max_norm = MODES[mode]
    ref, ref_opt, ours, opt = pair(THIN_WIDE, torch.float32, lr=THIN_LR, chunk_numel=1 << 22, **kw)
    start = {k: v.detach().float().clone() for k, v in ref.named_parameters()}
    ref_losses, _ = run(ref, ref_opt, steps=10, accum=1, max_norm=max_norm, seed=2, streamed=False, device="cuda")
    run(ours, opt, steps=10, accum=1, max_norm=max_norm, seed=2, streamed=True, device="cuda")
    assert all(math.isfinite(x) for x in ref_losses)
    assert change_err(ref, ours, start) <= 1e-3


@pytest.mark.parametrize("mode", ["offload_grads_clip", "update_in_backward_offload_grads"])
def test_thin_wide_accumulation_on_the_host(mode):
    """3 micro-batches per step, summed in pinned memory: each sum crosses PCIe both ways per micro-batch, with
    the additions on the H2D stream; a missed wait would add a stale or half-copied sum. And the gradient set is
    never on the GPU between micro-batches."""
    kw, max_norm = MODES[mode]
    ref, ref_opt, ours, opt = pair(THIN_WIDE, torch.float32, lr=THIN_LR, chunk_numel=1 << 22, **kw)
    start = {k: v.detach().float().clone() for k, v in ref.named_parameters()}
    run(ref, ref_opt, steps=6, accum=3, max_norm=max_norm, seed=3, streamed=False, device="cuda")
    run(ours, opt, steps=6, accum=3, max_norm=max_norm, seed=3, streamed=True, device="cuda")
    err = change_err(ref, ours, start)
    big = [p for p in ours.parameters() if p in opt._states.offset]
    before = torch.cuda.memory_allocated()
    with opt.no_update():  # one more micro-batch: its gradients go to the host sum
        ours.loss(torch.randint(0, 128, (4, 17), device="cuda")).backward()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    grads = sum(p.numel() * p.element_size() for p in big)
    print(f"{mode}: change err {err:.2e}; after a micro-batch {held / 2**20:.1f} MiB held, "
          f"gradients {grads / 2**20:.0f} MiB")
    assert err <= 1e-3
    assert big and all(p.grad is None for p in big) and held < grads / 4
    opt.zero_grad()


def _updates_lag(monkeypatch) -> None:
    """Every update queued behind ~10 ms of a GPU sleep kernel on the update stream: a read that is not ordered after
    its update then reads the weights before it, every time -- the race forced rather than hoped for (with the fused
    update, 0.2 ms per 25M values, unforced runs stayed exact six times in a row on the H200)."""
    from offload_trainer.engine.streams import Streams

    real = Streams.on

    @contextlib.contextmanager
    def on(self, stream):
        with real(self, stream):
            if self.is_cuda and stream is self.update:
                torch.cuda._sleep(20_000_000)
            yield

    monkeypatch.setattr(Streams, "on", on)


@pytest.mark.parametrize("mode", ["offload_grads_clip", "update_in_backward"])
def test_thin_wide_without_syncs_diverges(monkeypatch, mode):
    """Negative control for the test above: with every stream wait_event removed (and the updates made to lag, so
    that the missing order shows every time), it must fail."""
    kw, max_norm = MODES[mode]
    errs = []
    for seed in range(2, 5):
        ref, ref_opt, ours, opt = pair(THIN_WIDE, torch.float32, lr=THIN_LR, chunk_numel=1 << 22, **dict(kw))
        start = {k: v.detach().float().clone() for k, v in ref.named_parameters()}
        run(ref, ref_opt, steps=10, accum=1, max_norm=max_norm, seed=seed, streamed=False, device="cuda")
        monkeypatch.setattr(torch.cuda.Stream, "wait_event", lambda self, ev: None)
        _updates_lag(monkeypatch)
        run(ours, opt, steps=10, accum=1, max_norm=max_norm, seed=seed, streamed=True, device="cuda")
        monkeypatch.undo()
        torch.cuda.synchronize()
        errs.append(change_err(ref, ours, start))
        if not errs[-1] <= 1e-3:  # (NaN counts as diverged)
            break
    print(f"{mode} without waits: change err {errs}")
    assert not errs[-1] <= 1e-3


WIDE_HEAD = dict(vocab=1 << 20, d=32, hidden=64, n_layers=2)  # a 32M-value head (8 chunks), read after a tiny layer


def head_read_errors(mode: str, seeds, monkeypatch=None) -> list[float]:
    """Weight errors after 6 clipped steps of a model whose loss reads the head's weight without calling the head
    (as the chunked loss does), against torchao; `monkeypatch`: queue the updates in plain forward order."""
    kw, max_norm = MODES[mode]
    errs = []
    for seed in seeds:
        ref, ref_opt, ours, opt = pair(WIDE_HEAD, torch.float32, lr=THIN_LR, cls=HeadReadLM, chunk_numel=1 << 22,
                                       **dict(kw))
        start = {k: v.detach().float().clone() for k, v in ref.named_parameters()}
        run(ref, ref_opt, steps=6, accum=1, max_norm=max_norm, seed=seed, streamed=False, device="cuda")
        if monkeypatch is not None:
            from offload_trainer.engine.optim.schedule import Schedule

            natural = lambda self: {u: u for u in range(len(self.units))}  # noqa: E731
            monkeypatch.setattr(Schedule, "launch_order", natural)
            _updates_lag(monkeypatch)  # (the head's update then always ends after the loss has read the head)
        run(ours, opt, steps=6, accum=1, max_norm=max_norm, seed=seed, streamed=True, device="cuda")
        if monkeypatch is not None:
            monkeypatch.undo()
        torch.cuda.synchronize()
        errs.append(change_err(ref, ours, start))
        if monkeypatch is not None and not errs[-1] <= HEAD_TOL:
            break
    return errs


# The same kernels on the same inputs: 0 measured on the H200 (the race, a loss that read a one-step-old head:
# 1.7e-3 at seed 2). Tighter than the thin-wide tests' 1e-3, which a read of the old head stays close to.
HEAD_TOL = 1e-5


@pytest.mark.parametrize("mode", ["offload_grads_clip", "grads_on_gpu_clip"])
def test_a_head_read_without_its_forward_waits_for_its_update(mode):
    """The head's update (8 chunks of copies) is queued before the last layer's, whose forward waits for it."""
    errs = head_read_errors(mode, (2,))
    print(f"{mode}: change err {errs}")
    assert errs[0] <= HEAD_TOL


@pytest.mark.parametrize("mode", ["offload_grads_clip"])
def test_a_head_read_without_its_forward_races_in_plain_forward_order(monkeypatch, mode):
    """Negative control: queued after the last layer's update, the head's is still running when the loss reads it
    (the updates made to lag, so that it shows every time; unforced it failed to show once in the GPU suite)."""
    errs = head_read_errors(mode, (2, 3, 4), monkeypatch)
    print(f"{mode} in forward order: change err {errs}")
    assert not errs[-1] <= HEAD_TOL


@pytest.mark.parametrize("device_state_bytes", [0, 40000], ids=["streamed", "embedding_states_on_gpu"])
def test_resume_mid_run_on_gpu(tmp_path, device_state_bytes):
    def train(steps, opt_state=None, model_state=None, sched_state=None, start=0):
        torch.manual_seed(0)
        m = TinyLM().to("cuda", torch.bfloat16)
        opt = StreamedAdamW8bit(param_groups(m), lr=LR, betas=BETAS, offload_gradients=True, chunk_numel=4096,
                                device_state_bytes=device_state_bytes)
        opt.attach(m)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 50)
        if model_state:
            m.load_state_dict(model_state)
            opt.load_state_dict(opt_state)
            sched.load_state_dict(sched_state)
        losses = []
        for step in range(start, steps):
            torch.manual_seed(1000 + step)  # data and stochastic rounding depend on the step only
            ids = torch.randint(0, 128, (4, 17), device="cuda")
            loss = m.loss(ids)
            loss.backward()
            opt.clip_grad_norm_(0.5)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
        opt.synchronize()
        return losses, m, opt, sched

    full, *_ = train(40)
    first, m, opt, sched = train(20)
    assert bool(opt._states.on_device) == bool(device_state_bytes)
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")  # as the Trainer saves and loads it
    opt_state = torch.load(tmp_path / "optimizer.pt", map_location="cpu", weights_only=True, mmap=True)
    saved = ({k: v.clone() for k, v in m.state_dict().items()}, opt_state, sched.state_dict())
    second, *_ = train(40, saved[1], saved[0], saved[2], start=20)
    got = first + second
    assert max(abs(a - b) for a, b in zip(got, full)) <= 1e-4


def test_stream_switches_nest_and_restore():
    """`Streams.on` (a cheap `torch.cuda.stream`) nests, re-enters the current stream, and restores on exit;
    `Streams.compute()` is whatever stream is current (a user's stream too)."""
    from offload_trainer.engine.streams import Streams

    S = Streams(torch.device("cuda", torch.cuda.current_device()))
    before = torch.cuda.current_stream()
    with S.on(S.h2d):
        assert torch.cuda.current_stream() == S.h2d == S.compute()
        with S.on(S.update):
            with S.on(S.update):
                assert torch.cuda.current_stream() == S.update
            assert torch.cuda.current_stream() == S.update
        assert torch.cuda.current_stream() == S.h2d
    assert torch.cuda.current_stream() == before == S.compute()
    user = torch.cuda.Stream()
    with torch.cuda.stream(user):
        assert S.compute() == user
        with S.on(S.d2h):
            assert torch.cuda.current_stream() == S.d2h
        assert torch.cuda.current_stream() == user


@pytest.mark.parametrize("mode", ["update_in_backward", "offload_grads_clip"])
def test_a_step_prepared_by_accelerate_never_syncs_the_device(mode):
    """The Trainer prepares every optimizer with accelerate, which sends its state dict through the GPU: the learning
    rate came back as a GPU tensor, and each update's launch, reading it as a number, synchronized the device (8B
    through the Trainer ran at 0.75x native where the bare loop ran at 0.94x). After the first step (states
    allocated, kernels compiled), a whole step -- forward, backward with its updates, clipping, step(), scheduler --
    makes no synchronizing CUDA call."""
    import warnings

    from accelerate import Accelerator

    kw, max_norm = MODES[mode]
    torch.manual_seed(0)
    m = TinyLM().to("cuda", torch.bfloat16)
    opt = StreamedAdamW8bit(param_groups(m), lr=LR, betas=BETAS, chunk_numel=4096, **kw)
    opt.attach(m)
    prepared = Accelerator().prepare(opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 50)
    ids = torch.randint(0, 128, (4, 17), device="cuda")

    def step():
        m.loss(ids).backward()
        if max_norm:
            opt.clip_grad_norm_(max_norm)
        prepared.step()
        sched.step()
        prepared.zero_grad()

    step()
    torch.cuda.synchronize()
    updates = opt.stats["updates"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (setting the mode warns that it is a prototype)
        # a synchronizing call raises where it is made (its traceback names the line)
        warnings.filterwarnings("error", message="called a synchronizing")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
            with pytest.raises(UserWarning, match="called a synchronizing"):  # the detector works
                torch.ones((), device="cuda").item()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert opt.stats["updates"] > updates and bool(opt._states.place)
    assert all(type(g["lr"]) is float for g in opt.param_groups)
