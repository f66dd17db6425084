"""Layer swap's resident count changed between steps (`LayerSwap.set_resident`) against an unswapped model, and the
fit that chooses it from measured peaks (`ResidencyFit`) against a fake allocator whose peak follows the resident
layers (CPU; the same on CUDA with `gpu`)."""
import pytest
import torch

from offload_trainer.engine.fit import GiB, ResidencyFit, StepMemory, fitted, margin_bytes
from test_swap import DEVICES, install, optimizers, setup, train_both_and_compare


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("clip", [False, True], ids=["update_in_backward", "exact_clip"])
@pytest.mark.slow
def test_changing_resident_layers_between_steps_trains_as_the_unswapped_model(device, clip):
    """Layers moved on and off the GPU between steps (more resident, fewer, none, all): the same losses and weights as
    the model never swapped, bit for bit; a layer moved on holds no pinned copy, one moved off does."""
    ref, model, batches = setup(device)
    swap = install(model, device, resident=2, prefetch=1)
    ref_opt, opt = optimizers(ref, model, swap, lr=1e-2, update_in_backward=not clip, offload_gradients=clip,
                              chunk_numel=4096, inflight_chunks=2, bf16_stochastic_round=False)
    plan = {2: 5, 4: 1, 5: 0, 6: 6, 7: 3}  # before step k: resident layers

    def move(k):
        if k in plan:
            opt.synchronize()  # (no queued update may touch a layer while it moves)
            swapped = swap.set_resident(plan[k])
            assert len(swapped) == 6 - plan[k] and swap.memory_stats()["resident_layers"] == plan[k]
            for i, layer in enumerate(model.model.layers):
                where = layer.mlp.up_proj.weight.device.type
                assert where == ("cpu" if i in swapped else device) or device == "cpu"

    train_both_and_compare(ref, model, ref_opt, opt, swap, batches, clip, device, before_step=move)


def test_set_resident_moves_as_few_layers_as_it_can():
    _, model, _ = setup("cpu")
    swap = install(model, "cpu", resident=2, prefetch=1)
    before = set(swap.swapped_indices)
    assert set(swap.set_resident(4)) < before  # fewer swapped: a subset of those swapped before
    fewer = set(swap.swapped_indices)
    assert set(swap.set_resident(1)) > fewer  # more swapped: those swapped before and some more
    with pytest.raises(ValueError):
        swap.set_resident(7)


class FakeProbe:
    """An allocator whose step peaks at `base` + resident layers x `layer`: `live` of it in tensors, the rest cache;
    `growth` left allocated by the first step only (optimizer states made at its end); `retry_above`: the allocator
    gives cache back once the reserved peak would pass it."""

    def __init__(self, swap, *, base, layer, available, cache=0.3 * GiB, growth=0, retry_above=None, first_extra=0):
        self.swap, self.base, self.layer, self.available, self.cache = swap, base, layer, available, cache
        self.first_extra = first_extra  # live only in the first step (a transient the later steps do not have)
        self.growth, self.retry_above, self.peaks = growth, retry_above, []

    def start(self):
        pass

    def end(self):
        resident = self.swap.resident
        live = self.base + resident * self.layer + (self.growth if len(self.peaks) else self.first_extra)
        reserved = live + self.cache
        retries = 0
        if self.retry_above is not None and reserved > self.retry_above:
            reserved, retries = self.retry_above, 3
        self.peaks.append((resident, live, reserved))
        growth, self.growth = (self.growth, self.growth) if not self.peaks[:-1] else (0, self.growth)
        return StepMemory(peak_reserved=int(reserved), peak_allocated=int(live), growth=int(growth),
                          retries=retries, available=int(self.available))


def fit_run(resident, steps=6, tokens=None, fit_steps=3, **probe):
    _, model, _ = setup("cpu")
    swap = install(model, "cpu", resident=resident, prefetch=1)
    lines = []
    fake = FakeProbe(swap, **probe)
    fit = ResidencyFit(swap, full_tokens=128, layer_bytes=int(probe["layer"]), steps=fit_steps, probe=fake,
                       say=lines.append)
    for k in range(steps):
        fit.start_step()
        fit.saw_batch(tokens[k] if tokens else 128)
        fit.end_step()
    return swap, fake, lines


def test_fit_moves_layers_on_while_the_measured_peak_leaves_room():
    """Planned 1 of 6 resident, room measured for all but one: 5 after the first step, kept after; the margin
    always free."""
    swap, fake, lines = fit_run(1, base=10 * GiB, layer=2 * GiB, available=22.5 * GiB)
    # 10 + 0.3 cache + 2 per layer, within 22.5 - 0.675 margin: 5 layers (20.3 GiB), not 6 (22.3)
    assert [p[0] for p in fake.peaks] == [1, 5, 5]  # three measured steps, then no more measuring
    assert swap.memory_stats()["resident_layers"] == 5
    assert all(res <= fake.available - margin_bytes(fake.available) for _, _, res in fake.peaks)
    assert "1 -> 5 of 6 decoder layers on the GPU (+8.00 GiB)" in lines[0]
    assert "5 of 6 decoder layers stay on the GPU" in lines[1]


def test_fit_moves_layers_off_when_the_live_peak_is_too_close_and_never_back_on():
    """The plan over-committed (5 resident, live 23.5 of 23 GiB at the first step): layers move off until the margin
    is free, and none moves back on although the later steps measure room for one (20 GiB live)."""
    swap, fake, lines = fit_run(5, base=12 * GiB, layer=2 * GiB, available=23 * GiB, cache=0, first_extra=1.5 * GiB)
    assert fake.peaks[0][0] == 5 and swap.memory_stats()["resident_layers"] == 4
    assert "5 -> 4" in lines[0] and all("->" not in line for line in lines[1:])


def test_fit_counts_what_the_first_step_left_allocated():
    """States made at the first step's end (growth) are held by every later step: counted before moving on."""
    _, fake, _ = fit_run(1, base=10 * GiB, layer=2 * GiB, available=22.5 * GiB, growth=3 * GiB)
    assert [p[0] for p in fake.peaks][:2] == [1, 4]  # 10 + 3 + 0.3 + 2 x 4 = 21.3 (+2 would pass 21.825)


def test_fit_adds_nothing_while_the_allocator_gives_cache_back():
    swap, fake, lines = fit_run(2, base=10 * GiB, layer=2 * GiB, available=23 * GiB, retry_above=13 * GiB)
    assert swap.memory_stats()["resident_layers"] == 2
    assert "gave cached memory back 3 times" in lines[0]


def test_fit_measures_only_full_size_steps():
    """Short batches peak lower than the plan's: such steps are not measured (nor counted in the window)."""
    swap, fake, lines = fit_run(1, steps=5, tokens=[64, 64, 128, 128, 128], base=10 * GiB, layer=2 * GiB,
                                available=22.5 * GiB)
    assert "had 64 tokens per micro-batch, fewer than the plan's 128: not measured" in lines[0]
    assert "1 -> 5" in lines[2] and len(lines) == 5
    assert swap.memory_stats()["resident_layers"] == 5


def test_fitted_is_the_most_layers_within_the_margin():
    """Against a brute force over every count: the most resident layers whose next peak stays within the line."""
    layer, base, cache = int(0.4 * GiB), int(9 * GiB), int(0.5 * GiB)
    for available in (int(g * GiB) for g in (16, 20.5, 23.3, 24)):
        for resident in range(0, 33):
            live = base + resident * layer
            m = StepMemory(peak_reserved=live + cache, peak_allocated=live, growth=0, retries=0, available=available)
            new, _ = fitted(resident, 32, layer, m)
            line = available - margin_bytes(available)
            ok = [k for k in range(33) if base + k * layer + cache <= line and base + k * layer <= line]
            best = max(ok) if ok else 0
            if live > line:  # over: the fewest layers off that bring the live peak under the line
                assert base + new * layer <= line and base + (new + 1) * layer > line
            else:
                assert new == max(resident, best), (available, resident)


@pytest.mark.parametrize("max_grad_norm", [0.5, 0.0], ids=["clip", "update_in_backward"])
@pytest.mark.slow
def test_the_fit_through_the_trainer_trains_as_the_unswapped_model(tmp_path, max_grad_norm):
    """The Trainer's loop with the fit wired in (a fake allocator: on a CPU there is none to read): layers move on
    after the first step, the device map follows, and the losses equal the unswapped run's, accumulating 2
    micro-batches with gradients in host memory."""
    from helpers import tiny_setup
    from offload_trainer import OffloadTrainer
    from test_trainer import losses_of, make_args

    def run(swap, out):
        model, _, train = tiny_setup(seq=32, layers=4)
        args = make_args(tmp_path / out, max_steps=6, save_steps=100, max_grad_norm=max_grad_norm,
                         activation_checkpointing=True, layer_swap=swap)
        trainer = OffloadTrainer(model=model, args=args, train_dataset=train)
        if swap != "off":
            s = trainer._run.swap
            trainer._run.fit = ResidencyFit(s, full_tokens=4 * 32, layer_bytes=GiB, probe=FakeProbe(
                s, base=10 * GiB, layer=GiB, available=14.5 * GiB), say=lines.append)
        trainer.train()
        return trainer

    lines = []
    plain, fitted_run = run("off", "plain"), run("1", "fit")
    # 10 + 0.3 + 1 per layer within 14.5 - 0.5: 3 of 4 after the first step (measured in the Trainer's own steps)
    assert "1 -> 3 of 4 decoder layers on the GPU" in lines[0], lines
    assert fitted_run._run.swap.memory_stats()["resident_layers"] == 3
    assert len([k for k in fitted_run.model.hf_device_map if k]) == 1  # (one swapped layer listed)
    assert losses_of(fitted_run) == losses_of(plain)
