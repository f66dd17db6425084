"""The first unit's states copied ahead of its update (prefetch.py) against torchao AdamW8bit, on CPU: weights,
8-bit states, losses and norms bit for bit, with every chunk of the embedding staged, some of them, or none. The
`gpu` tests (test_streamed_gpu.py) repeat it on CUDA, where the copies are asynchronous."""
import pytest

from offload_trainer.engine.optim import prefetch
from offload_trainer.engine.optim.speculation import ClipPolicy
from optim_cases import make_pair, rel_l2, run, run_speculative
from test_speculative import clip_at_median, states_equal

STEPS = 12
ANY_ROOM = 1 << 40
CHUNK_BYTES = 2 * 4096 + 8 * 16  # a 4096-value chunk's codes and scales (TinyLM's embedding: two chunks)


def train(mode: str, room: int | None, steps: int = STEPS):
    """torchao's run and ours, with `room` bytes allowed to each staging (None: no prefetch)."""
    kw = dict(update_in_backward=True) if mode == "update_in_backward" else dict(
        speculative=True, clip_policy=ClipPolicy(to_exact=10**9))
    ref, ref_opt, ours, opt = make_pair("cpu", prefetch_units=4 if room is not None else 0, **kw)
    opt.attach(ours)
    if room is not None:
        opt._prefetch.room = lambda: room
    if mode == "update_in_backward":
        ref_run = run(ref, ref_opt, steps=steps, accum=1, max_norm=0.0, seed=3, streamed=False, device="cpu")
        our_run = run(ours, opt, steps=steps, accum=1, max_norm=0.0, seed=3, streamed=True, device="cpu")
    else:
        max_norm = clip_at_median(1, seed=3, steps=steps)
        ref_run = run(ref, ref_opt, steps=steps, accum=1, max_norm=max_norm, seed=3, streamed=False, device="cpu")
        our_run = run_speculative(ours, opt, steps=steps, accum=1, max_norm=max_norm, seed=3, device="cpu")
        assert 0 < opt._spec.counts["redone"] < steps, "the clip must fire on some steps and not on others"
    return ref, ref_opt, ours, opt, ref_run, our_run


@pytest.mark.parametrize("mode", ["update_in_backward", "speculative"])
@pytest.mark.parametrize("room", [ANY_ROOM, CHUNK_BYTES, CHUNK_BYTES - 1], ids=["all", "one_per_hook", "none"])
def test_prefetched_states_give_torchaos_result(mode, room):
    ref, ref_opt, ours, opt, ref_run, our_run = train(mode, room)
    passes = STEPS + (opt._spec.counts["redone"] if mode == "speculative" else 0)  # each backward stages again
    # two units (the blocks) before the embedding reach the hook; `one_per_hook` stages one chunk at each
    assert opt.stats["prefetched_chunks"] == {ANY_ROOM: 2, CHUNK_BYTES: 2, CHUNK_BYTES - 1: 0}[room] * passes
    assert our_run == ref_run
    assert rel_l2(ref, ours) == 0.0
    assert states_equal(ref_opt, opt)
    assert not opt._plan.staged, "every staged chunk was taken by its update"


def test_staging_from_the_wrong_bank_fails(monkeypatch):
    """Negative control: the same speculative run with each chunk staged from the bank its update does not read
    (while recorded as the right one) differs from torchao's."""
    real = prefetch.StatePrefetch.reached

    def wrong_bank(self, unit, wait):
        banks = self.states.bank
        flipped = {p: 1 - b for p, b in banks.items()}
        self.states.bank, saved = flipped, banks
        try:
            real(self, unit, wait)
        finally:
            self.states.bank = saved
        for staged in self.plan.staged.values():
            staged.bank = 1 - staged.bank

    monkeypatch.setattr(prefetch.StatePrefetch, "reached", wrong_bank)
    ref, ref_opt, ours, opt, ref_run, our_run = train("speculative", ANY_ROOM)
    assert opt.stats["prefetched_chunks"] > 0
    assert rel_l2(ref, ours) > 0.0 and not states_equal(ref_opt, opt)


def test_the_first_units_tensors_are_staged_only_while_attached():
    """The first unit's tensors are the targets once attached, none before, after detach, or with
    `prefetch_units=0`."""
    _, _, ours, opt = make_pair("cpu", update_in_backward=True, prefetch_units=0)
    opt.attach(ours)
    assert opt._prefetch.targets == []
    _, _, ours, opt = make_pair("cpu", update_in_backward=True)
    assert opt._prefetch.targets == []  # (not attached yet)
    opt.attach(ours)
    assert opt._prefetch.targets == [ours.embed.weight]
    opt.detach()
    assert opt._prefetch.targets == []
