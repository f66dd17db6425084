"""Speculative clipping (updates in backward, rolled back and redone when the clip fires) against exact clipping: torchao
`AdamW8bit` after `torch.nn.utils.clip_grad_norm_` -- weights, 8-bit states, learning rates, losses and norms after N
steps, bit for bit on CPU, with the clip firing on some steps and not on others. The `gpu` tests repeat it on CUDA."""
import logging
import statistics

import pytest
import torch

from offload_trainer.engine.optim import StreamedAdamW8bit
from offload_trainer.engine.optim.speculation import ClipPolicy, Speculation
from optim_cases import make_pair, rel_l2, run, run_speculative
from tiny_models import TinyLM, param_groups



def clips(norm: float, max_norm: float) -> bool:
    """Whether clipping changes the gradients: torch's coefficient max_norm / (norm + 1e-6) under 1."""
    return max_norm / (norm + 1e-6) < 1.0


def clip_at_median(accum: int, seed: int = 1, steps: int = 30) -> float:
    """A max_norm at the median of an unclipped run's norms: about half the steps clip."""
    ref, ref_opt, _, _ = make_pair("cpu")
    _, norms = run(ref, ref_opt, steps=steps, accum=accum, max_norm=1e9, seed=seed, streamed=False, device="cpu")
    return statistics.median(norms)


def states_equal(ref_opt, opt) -> bool:
    a, b = ref_opt.state_dict(), opt.state_dict()
    for sa, sb in zip(a["state"].values(), b["state"].values()):
        for key in ("exp_avg", "exp_avg_sq"):
            x, y = sa[key], sb[key]
            if hasattr(x, "codes"):
                if not (torch.equal(x.codes, y.codes) and torch.equal(x.scale, y.scale)):
                    return False
            elif not torch.equal(x, y):
                return False
        if float(sa["step"]) != float(sb["step"]):
            return False
    return [float(g["lr"]) for g in a["param_groups"]] == [float(g["lr"]) for g in b["param_groups"]]


@pytest.mark.parametrize("accum,offload_gradients", [(1, False), (1, True), (2, False), (2, True)],
                         ids=["one_micro_batch", "one_micro_batch_grads_on_host", "accumulation_on_device",
                              "accumulation_on_host"])
def test_equals_exact_clipping_bit_for_bit(accum, offload_gradients):
    max_norm = clip_at_median(accum)
    ref, ref_opt, ours, opt = make_pair("cpu", speculative=True, clip_policy=ClipPolicy(to_exact=10**9),
                                        offload_gradients=offload_gradients)
    opt.attach(ours)
    ref_losses, ref_norms = run(ref, ref_opt, steps=30, accum=accum, max_norm=max_norm, seed=1, streamed=False,
                                device="cpu")
    losses, norms = run_speculative(ours, opt, steps=30, accum=accum, max_norm=max_norm, seed=1, device="cpu")
    clipped = sum(clips(n, max_norm) for n in ref_norms)
    assert 5 <= clipped <= 25, "the clip must fire on some steps and not on others"
    counts = opt._spec.counts
    # (accumulation on the host: the sums wait in the spare buffer the backups then take, each once its sum is read)
    assert counts["redone"] == clipped and counts["exact"] == 0
    assert counts["clipped"] == clipped
    assert norms == ref_norms and losses == ref_losses
    assert rel_l2(ref, ours) == 0.0
    assert states_equal(ref_opt, opt)


def test_without_the_rollback_the_comparison_fails(monkeypatch):
    """Negative control: the same run with the restore of the weights skipped (states still uncommitted) differs."""
    max_norm = clip_at_median(1)
    monkeypatch.setattr(Speculation, "restore", lambda self, p, stream: None)
    ref, ref_opt, ours, opt = make_pair("cpu", speculative=True, clip_policy=ClipPolicy(to_exact=10**9))
    opt.attach(ours)
    run(ref, ref_opt, steps=30, accum=1, max_norm=max_norm, seed=1, streamed=False, device="cpu")
    run_speculative(ours, opt, steps=30, accum=1, max_norm=max_norm, seed=1, device="cpu")
    assert opt._spec.counts["redone"] > 0
    assert rel_l2(ref, ours) > 0.0


def test_without_uncommitted_states_the_comparison_fails(monkeypatch):
    """Negative control: an update that writes the states in place (no second bank) cannot be rolled back."""
    from offload_trainer.engine.optim import states

    max_norm = clip_at_median(1)
    monkeypatch.setattr(states.HostStates, "banks_of", lambda self, p: (self.bank[p], self.bank[p]))
    monkeypatch.setattr(states.HostStates, "commit", lambda self, p: None)
    ref, ref_opt, ours, opt = make_pair("cpu", speculative=True, clip_policy=ClipPolicy(to_exact=10**9))
    opt.attach(ours)
    run(ref, ref_opt, steps=30, accum=1, max_norm=max_norm, seed=1, streamed=False, device="cpu")
    run_speculative(ours, opt, steps=30, accum=1, max_norm=max_norm, seed=1, device="cpu")
    assert not states_equal(ref_opt, opt) or rel_l2(ref, ours) > 0.0


def test_a_nonfinite_step_is_rolled_back_and_skipped():
    """A NaN loss: the updates that ran in backward are undone and the step skipped, as the Trainer skips it."""
    max_norm = clip_at_median(1)
    ref, ref_opt, ours, opt = make_pair("cpu", speculative=True, clip_policy=ClipPolicy(to_exact=10**9))
    opt.attach(ours)
    nan = (3, 4, 11)
    ref_losses, ref_norms = run(ref, ref_opt, steps=20, accum=1, max_norm=max_norm, seed=1, streamed=False,
                                device="cpu", nan_steps=nan)
    losses, norms = run_speculative(ours, opt, steps=20, accum=1, max_norm=max_norm, seed=1, device="cpu",
                                    nan_steps=nan)
    assert opt._spec.counts["nonfinite"] == 3
    assert str(norms) == str(ref_norms) and str(losses) == str(ref_losses)  # (nan == nan as text)
    assert rel_l2(ref, ours) == 0.0 and states_equal(ref_opt, opt)


def test_the_policy_clips_exactly_while_most_steps_clip_and_speculates_again_after(caplog):
    """Every step clips (max_norm tiny): after `to_exact` steps the optimizer stops speculating, once in the log; a
    max_norm that no longer clips brings speculation back after a window. Still torchao + clip_grad_norm_'s result."""
    torch.manual_seed(0)
    ref, ref_opt, ours, opt = make_pair("cpu", speculative=True)
    opt.attach(ours)
    policy = opt._spec.policy
    with caplog.at_level(logging.INFO, logger="offload_trainer"):
        run(ref, ref_opt, steps=12, accum=1, max_norm=1e-3, seed=1, streamed=False, device="cpu")
        run_speculative(ours, opt, steps=12, accum=1, max_norm=1e-3, seed=1, device="cpu")
        assert policy.exact and opt._spec.counts == dict(steps=12, clipped=12, redone=policy.to_exact, exact=9,
                                                         nonfinite=0)
        run(ref, ref_opt, steps=12, accum=1, max_norm=1e9, seed=2, streamed=False, device="cpu")
        run_speculative(ours, opt, steps=12, accum=1, max_norm=1e9, seed=2, device="cpu")
    assert not policy.exact
    switches = [r.getMessage() for r in caplog.records if r.getMessage().startswith("clipping:")]
    assert len(switches) == 2 and "clip exactly" in switches[0] and "during backward again" in switches[1]
    assert rel_l2(ref, ours) == 0.0 and states_equal(ref_opt, opt)


def test_resume_from_a_checkpoint_is_exact(tmp_path):
    """A checkpoint after a step holds committed states only: saved mid-run and loaded into a new optimizer, the run
    goes on as the uninterrupted one."""
    max_norm = clip_at_median(1)
    _, _, whole, whole_opt = make_pair("cpu", speculative=True, clip_policy=ClipPolicy(to_exact=10**9))
    whole_opt.attach(whole)
    run_speculative(whole, whole_opt, steps=10, accum=1, max_norm=max_norm, seed=1, device="cpu")
    run_speculative(whole, whole_opt, steps=10, accum=1, max_norm=max_norm, seed=2, device="cpu")
    _, _, first, first_opt = make_pair("cpu", speculative=True, clip_policy=ClipPolicy(to_exact=10**9))
    first_opt.attach(first)
    run_speculative(first, first_opt, steps=10, accum=1, max_norm=max_norm, seed=1, device="cpu")
    torch.save({"model": first.state_dict(), "opt": first_opt.state_dict()}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    _, _, resumed, opt = make_pair("cpu", speculative=True, clip_policy=ClipPolicy(to_exact=10**9))
    resumed.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    opt.attach(resumed)
    run_speculative(resumed, opt, steps=10, accum=1, max_norm=max_norm, seed=2, device="cpu")
    assert whole_opt._spec.counts["redone"] > 0
    assert rel_l2(whole, resumed) == 0.0 and states_equal(whole_opt, opt)


def test_bf16_updates_that_draw_from_the_global_rng_wait_for_the_norm():
    """On CPU torchao's stochastic rounding draws from the global RNG: such updates are not speculated (drawn in
    backward, the numbers would differ), so bf16 runs equal exact clipping's too."""
    torch.manual_seed(0)
    ref = TinyLM().to(torch.bfloat16)
    ours = TinyLM().to(torch.bfloat16)
    ours.load_state_dict(ref.state_dict())
    kw = dict(lr=3e-3, chunk_numel=4096, inflight_chunks=2)
    exact, spec = StreamedAdamW8bit(param_groups(ref), **kw), StreamedAdamW8bit(param_groups(ours), speculative=True,
                                                                                **kw)
    exact.attach(ref)
    spec.attach(ours)
    torch.manual_seed(5)
    a = run(ref, exact, steps=6, accum=1, max_norm=0.5, seed=1, streamed=True, device="cpu")
    torch.manual_seed(5)
    b = run_speculative(ours, spec, steps=6, accum=1, max_norm=0.5, seed=1, device="cpu")
    assert a == b and rel_l2(ref, ours) == 0.0
    assert spec._spec.counts["redone"] == 0 and spec._spec.counts["clipped"] == 6  # nothing ran before the norm


def test_clipping_without_a_redo_is_refused_when_updates_ran():
    _, _, ours, opt = make_pair("cpu", speculative=True)
    opt.attach(ours)
    ours.loss(torch.randint(0, 128, (2, 9))).backward()
    with pytest.raises(ValueError, match="redo="):
        opt.clip_grad_norm_(1.0)
    with pytest.raises(ValueError, match="choose one"):
        StreamedAdamW8bit(TinyLM().parameters(), speculative=True, update_in_backward=True)


def test_backups_are_queued_over_the_forward_then_just_ahead_of_their_updates(monkeypatch):
    """`FORWARD_SHARE` of the backups' bytes as the forward goes, the rest `AHEAD_BYTES` ahead of the update being
    queued: each backup is queued before its update, and none in backward before its turn."""
    from offload_trainer.engine import streams
    from offload_trainer.engine.optim import speculation

    monkeypatch.setattr(speculation, "FORWARD_SHARE", 0.5)
    monkeypatch.setattr(speculation, "AHEAD_BYTES", 8000)
    params = [torch.full((1000,), float(i)) for i in range(8)]  # 4000 bytes each, in update order
    spare = {p: torch.empty_like(p) for p in params}
    S = streams.Streams(torch.device("cpu"))
    spec = Speculation(type("States", (), {"spare": lambda self, p: spare[p]})(), S, {"d2h_bytes": 0}, S.device)
    spec.plan_backups(params)
    backed = lambda: [i for i, p in enumerate(params) if p in spec.backed]  # noqa: E731
    spec.pace(0.5)
    assert backed() == [0, 1]  # a quarter of 32000 bytes
    spec.pace(1.0)
    assert backed() == [0, 1, 2, 3]  # the forward's half
    spec.before_update(params[0], S.update)
    assert backed() == [0, 1, 2, 3]  # already ahead by 8000 bytes
    spec.before_update(params[4], S.update)
    assert backed() == [0, 1, 2, 3, 4, 5, 6]  # its own, then two more
    spec.before_update(params[7], S.update)
    assert backed() == list(range(8)) and all(torch.equal(spare[p], p) for p in params)


def test_host_memory_of_speculation():
    """Two banks of 8-bit states and the spare buffer (gradients or backups): 2 x 2.03 + 2 bytes per streamed value
    in bf16, where exact clipping with offloaded gradients takes 2.03 + 2."""
    torch.manual_seed(0)
    sizes = {}
    for name, kw in {"exact": dict(offload_gradients=True), "speculative": dict(speculative=True)}.items():
        model = TinyLM().to(torch.bfloat16)
        opt = StreamedAdamW8bit(model.parameters(), chunk_numel=4096, **kw)
        opt._ensure_states()
        streamed = sum(p.numel() for p in opt._states.offset)
        sizes[name] = opt.memory_stats()["host_state_bytes"] / streamed
    assert sizes["exact"] == pytest.approx(2 + 8 / 256 + 2)
    assert sizes["speculative"] == pytest.approx(2 * (2 + 8 / 256) + 2)


# ---------------------------------------------------------------------------------------------------------- GPU
def gpu_pair(model_kw, dtype, lr, speculative, accum=1, **kw):
    from offload_trainer.engine.optim.speculation import ClipPolicy as Policy

    torch.manual_seed(0)
    model = TinyLM(**model_kw).to("cuda", dtype)
    opt = StreamedAdamW8bit(param_groups(model), lr=lr, betas=(0.9, 0.95), chunk_numel=kw.pop("chunk_numel", 4096),
                            inflight_chunks=2, speculative=speculative,
                            clip_policy=Policy(to_exact=10**9) if speculative else None,
                            offload_gradients=not speculative or accum > 1, **kw)
    opt.attach(model)
    return model, opt


def gpu_run(speculative, max_norm, *, model_kw=None, dtype=torch.bfloat16, lr=3e-3, steps=30, seed=1, accum=1, **kw):
    model, opt = gpu_pair(model_kw or {}, dtype, lr, speculative, accum, **kw)
    torch.manual_seed(7)  # (stochastic rounding of the small tensors draws from here)
    go = run_speculative if speculative else lambda m, o, **a: run(m, o, streamed=True, **a)
    losses, norms = go(model, opt, steps=steps, accum=accum, max_norm=max_norm, seed=seed, device="cuda")
    torch.cuda.synchronize()
    return model, opt, losses, norms


@pytest.mark.gpu
def test_gpu_speculative_equals_exact_within_the_run_to_run_spread():
    """bf16 with stochastic rounding, the fused kernel, real streams: speculative clipping against exact clipping
    (both ours; torchao's own AdamW8bit rounds differently on the GPU) after 30 steps, about half of them clipped.
    The spread is that of exact clipping run twice; the difference must be within it."""
    _, _, _, free = gpu_run(False, 1e9)
    max_norm = statistics.median(free)
    a, _, la, na = gpu_run(False, max_norm)
    b, _, lb, nb = gpu_run(False, max_norm)
    c, opt, lc, nc = gpu_run(True, max_norm)
    spread, diff = rel_l2(a, b), rel_l2(a, c)
    clipped = opt._spec.counts["clipped"]
    print(f"clipped {clipped}/30, redone {opt._spec.counts['redone']}; exact vs exact rel L2 {spread:.2e}, "
          f"speculative vs exact {diff:.2e}; losses {la[-1]:.5f} / {lc[-1]:.5f}")
    assert 5 <= clipped <= 25 and opt._spec.counts["redone"] == clipped
    assert diff <= spread and (spread > 0 or (la == lc and na == nc))


THIN_WIDE = dict(vocab=128, d=32, hidden=1 << 17, n_layers=2)  # big copies, almost no compute


@pytest.mark.gpu
@pytest.mark.parametrize("skip_restore,accum", [(False, 1), (True, 1), (False, 2)],
                         ids=["rollback", "negative_control_no_restore", "accumulation_on_host"])
def test_gpu_thin_wide_rollbacks_wait_for_their_copies(monkeypatch, skip_restore, accum):
    """Copies of 4M-value chunks dwarf the matmuls: a backup read before the previous update landed, an update
    before its backup, or a forward before its restore would read stale weights; accumulating on the host, a backup
    written before its slice's gradient sum was read, or a redo's sum before the restore read the backup. Against
    exact clipping (fp32, bit for bit when every wait holds); without the restore it must differ."""
    run_kw = dict(model_kw=THIN_WIDE, dtype=torch.float32, lr=1e-4, steps=10, chunk_numel=1 << 22, accum=accum)
    _, _, _, free = gpu_run(False, 1e9, **run_kw)
    max_norm = statistics.median(free)
    a, _, la, _ = gpu_run(False, max_norm, **run_kw)
    if skip_restore:
        monkeypatch.setattr(Speculation, "restore", lambda self, p, stream: None)
    b, opt, lb, _ = gpu_run(True, max_norm, **run_kw)
    err = rel_l2(a, b)
    print(f"thin-wide, restore {'skipped' if skip_restore else 'kept'}: redone {opt._spec.counts['redone']}, "
          f"rel L2 {err:.2e}")
    assert opt._spec.counts["redone"] > 0
    assert (err > 0) if skip_restore else (err == 0 and la == lb)
