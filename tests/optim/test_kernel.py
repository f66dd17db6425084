"""The fused 8-bit update (update_kernel.py): its quantizer against torchao's, its kernel against the torch update.

The quantizer tests run everywhere. The kernel runs on CUDA, or on CPU under Triton's interpreter when Triton is
installed (conftest sets TRITON_INTERPRET=1 without a GPU); CPU-only torch installs have no Triton, so there they
are skipped, and the `gpu` run covers them.
"""
import pytest
import torch
from torchao.optim.quant_utils import quantize_8bit_with_qmap

from offload_trainer.engine.optim import kernel as uk
from offload_trainer.engine.optim import StreamedAdamW8bit, adamw8bit_chunk
from optim_cases import BETAS, LR, rel_l2, run
from tiny_models import TinyLM, param_groups

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(not uk.runnable(torch.device(DEV)),
                                  reason="needs Triton: CUDA, or its interpreter on CPU (pip install triton)")


def maps():
    qmaps, signed, unsigned = uk.default_tables()
    return ((qmaps[:256], signed), (qmaps[256:], unsigned))


def test_thresholds_are_the_first_float_of_each_code():
    for qmap, _ in maps():
        thr = uk.thresholds(qmap)
        below = uk._from_key(uk._to_key(thr[1:].clone()) - 1)  # the float just below each threshold
        codes = torch.arange(1, 256)
        assert torch.equal(quantize_8bit_with_qmap(thr[1:], qmap).long(), codes)
        assert torch.equal(quantize_8bit_with_qmap(below, qmap).long(), codes - 1)


def test_table_quantizer_gives_torchaos_codes():
    """Every float within 3 ulps of a threshold or a bucket edge, random values at three scales, and +-1, +-0."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.arange(uk._FIRST_KEY, uk._LAST_KEY + 1, dtype=torch.int64) << 16
    edges = torch.cat([(keys + d).to(torch.int32).view(torch.float32) for d in (-1, 0, 1)])
    for qmap, table in maps():
        k = uk._to_key(uk.thresholds(qmap)[1:].clone())
        near = torch.cat([uk._from_key(k + d) for d in range(-3, 4)])
        rnd = torch.cat([torch.rand(400_000, generator=gen) * 2 - 1, (torch.rand(200_000, generator=gen) - 0.5) * 1e-3,
                         torch.randn(200_000, generator=gen) * 1e-6])
        x = torch.cat([near, edges, -edges, rnd, torch.tensor([1.0, -1.0, 0.0, -0.0])]).clamp(-1, 1)
        assert torch.equal(uk.quantize_with_table(x, table), quantize_8bit_with_qmap(x, qmap))


def chunk_case(n_blocks=37, p_dtype=torch.bfloat16, g_dtype=torch.bfloat16, seed=0):
    """A chunk as the optimizer passes it: codes and scales are views of wider slot rows; one block's gradient
    holds a NaN and another's an infinity."""
    gen = torch.Generator().manual_seed(seed)
    n, width = 256 * n_blocks, 256 * (n_blocks + 3)
    p = (torch.randn(n, generator=gen) * 0.02).to(p_dtype)
    g = (torch.randn(n, generator=gen) * 1e-3).to(g_dtype)
    g[300], g[1000] = float("nan"), float("inf")
    codes = torch.randint(0, 256, (2, width), dtype=torch.uint8, generator=gen)[:, :n]
    scales = (torch.rand(2, width // 256, generator=gen) * 1e-3)[:, :n_blocks]
    return [t.to(DEV) for t in (p, g, codes, scales)]


def qmaps_on(dev):
    return [q.to(dev) for q, _ in maps()]


HYPER = (torch.tensor(7.0), torch.tensor(1e-3), 0.9, 0.999, 0.01, 1e-8)


@needs_kernel
@pytest.mark.parametrize("p_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kernel_matches_the_torch_update(p_dtype):
    """Against torchao's arithmetic run eagerly: on CUDA bit for bit (H200, 1M values: no code, scale or weight
    differs); on CPU (Triton's interpreter, numpy) within an ulp, the codes equal."""
    p, g, codes, scales = chunk_case(p_dtype=p_dtype, n_blocks=4096 if DEV == "cuda" else 37)
    ref = [t.clone() for t in (p, codes, scales)]
    adamw8bit_chunk(ref[0], g, ref[1], ref[2], *qmaps_on(DEV), *HYPER, False)
    uk.Update8bit(torch.device(DEV))(p, g, codes, scales, *qmaps_on(DEV), *HYPER, False)
    print(f"{p_dtype}: codes differ {int((codes != ref[1]).sum())} of {codes.numel()}, "
          f"weights {int((p != ref[0]).sum())} of {p.numel()}, scales {int((scales != ref[2]).sum())}")
    if DEV == "cuda":
        assert torch.equal(codes, ref[1]) and torch.equal(scales, ref[2]) and torch.equal(p, ref[0])
    assert torch.equal(codes, ref[1])
    torch.testing.assert_close(scales, ref[2], rtol=1e-6, atol=0)
    torch.testing.assert_close(p.float(), ref[0].float(), rtol=1e-6, atol=0)
    # the blocks holding a NaN (values 256-511) and an infinity (768-1023) kept weights, codes and scales
    before = chunk_case(p_dtype=p_dtype, n_blocks=scales.shape[1])
    assert torch.equal(codes[:, 256:512], before[2][:, 256:512])
    assert torch.equal(scales[:, 1], before[3][:, 1])
    assert torch.equal(p[768:1024], before[0][768:1024])
    assert torch.isfinite(p).all() and torch.isfinite(scales).all()


@needs_kernel
def test_kernel_scales_the_gradient_as_clipping_does():
    p, g, codes, scales = chunk_case(p_dtype=torch.float32)
    coef = torch.tensor(0.3711, device=DEV)  # not a bf16 value (a bf16 scale, as clip_grad_norm_ of bf16 gradients
    # gives, is tested by the optimizer tests)
    ref = [t.clone() for t in (p, codes, scales)]
    # as CUDA's in-place multiply by a 0-dim tensor (clip_grads_with_norm_ on bf16 gradients): the scale is cast to
    # the gradient's dtype first (on CPU the scale would stay float32)
    clipped = (g.float() * coef.to(g.dtype).float()).to(g.dtype)
    update = uk.Update8bit(torch.device(DEV))
    update(ref[0], clipped, ref[1], ref[2], *qmaps_on(DEV), *HYPER, False)
    update(p, g, codes, scales, *qmaps_on(DEV), *HYPER, False, grad_scale=coef)
    print(f"scaled in the kernel vs before it: weights differ {int((p != ref[0]).sum())} of {p.numel()}, "
          f"codes {int((codes != ref[1]).sum())}, scales {int((scales != ref[2]).sum())}")
    assert torch.equal(p, ref[0]) and torch.equal(codes, ref[1]) and torch.equal(scales, ref[2])
    unscaled, _, codes0, scales0 = chunk_case(p_dtype=torch.float32)
    update(unscaled, g, codes0, scales0, *qmaps_on(DEV), *HYPER, False)
    assert not torch.allclose(unscaled, p, rtol=1e-6, atol=0)  # the scale changes the update


@needs_kernel
def test_kernel_stochastic_rounding():
    """Each bf16 weight is its float32 result rounded down or up (toward / away from zero), up with probability
    (low 16 bits) / 2**16; the same counter rounds the same way, another counter differently."""
    p, g, codes, scales = chunk_case(n_blocks=64)
    g = torch.nan_to_num(g, nan=0.0, posinf=0.0)
    update = uk.Update8bit(torch.device(DEV), seed=1234)
    exact = p.float()
    update(exact, g, codes.clone(), scales.clone(), *qmaps_on(DEV), *HYPER, True)  # float32 weights: no rounding
    outs = []
    for counter in (0, 0, 10**12):
        q = p.clone()
        update(q, g, codes.clone(), scales.clone(), *qmaps_on(DEV), *HYPER, True, counter=counter)
        outs.append(q)
    bits = exact.view(torch.int32)
    down = (bits & -65536).view(torch.float32)
    up = ((bits & -65536) + 0x10000).view(torch.float32)
    got = outs[0].float()
    assert bool(((got == down) | (got == up)).all())
    frac = (bits & 0xFFFF).double() / 2**16
    went_up = (got == up) & (down != up)
    n = frac.numel()
    expected, sd = float(frac.sum()), float((frac * (1 - frac)).sum().sqrt())
    assert abs(float(went_up.sum()) - expected) <= 5 * sd + 1, (float(went_up.sum()), expected, n)
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


@needs_kernel
@pytest.mark.parametrize("kw, max_norm", [(dict(offload_gradients=True), 0.5), (dict(update_in_backward=True), 0.0)],
                         ids=["offload_grads_clip", "update_in_backward"])
def test_optimizer_fused_matches_unfused(kw, max_norm):
    """Clipping, accumulation, a cosine schedule, two param groups: the fused and torch updates agree."""
    models, opts = [], []
    for fused in (False, True):
        torch.manual_seed(0)
        m = TinyLM().to(DEV)
        opt = StreamedAdamW8bit(param_groups(m), lr=LR, betas=BETAS, bf16_stochastic_round=False, chunk_numel=4096,
                                inflight_chunks=2, fused=fused, **kw)
        opt.attach(m)
        models.append(m)
        opts.append(opt)
        run(m, opt, steps=8, accum=2, max_norm=max_norm, seed=1, streamed=True, device=DEV)
    assert opts[1]._fused is not None and opts[0]._fused is None
    assert rel_l2(models[0], models[1]) <= 1e-5


def test_fused_needs_triton_on_its_device(monkeypatch):
    monkeypatch.setattr(uk, "triton", None)
    with pytest.raises(ValueError, match="fused=True needs Triton"):
        StreamedAdamW8bit(TinyLM().parameters(), fused=True)
    assert StreamedAdamW8bit(TinyLM().parameters())._fused is None


@needs_kernel
def test_kernel_sums_the_squared_gradient():
    p, g, codes, scales = chunk_case(n_blocks=64, p_dtype=torch.float32)
    g = torch.nan_to_num(g, nan=0.0, posinf=0.0)
    acc = torch.full((), 5.0, device=DEV)
    uk.Update8bit(torch.device(DEV))(p, g, codes, scales, *qmaps_on(DEV), *HYPER, False, sumsq=acc)
    torch.testing.assert_close(acc, 5.0 + g.double().square().sum().float(), rtol=1e-5, atol=0)


@needs_kernel
def test_fused_updates_in_backward_measure_the_logged_norm():
    """With updates in backward the fused kernel sums each gradient's squares (no norm kernels on the compute
    stream); clip_grad_norm_(inf) reports the global norm torch's clip_grad_norm_ computes."""
    torch.manual_seed(0)
    ours, plain = TinyLM().to(DEV), TinyLM().to(DEV)
    opt = StreamedAdamW8bit(param_groups(ours), lr=LR, update_in_backward=True, chunk_numel=4096, fused=True)
    opt.attach(ours)
    for step in range(3):
        plain.load_state_dict(ours.state_dict())  # the weights this step's gradients are taken at
        ids = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(step)).to(DEV)
        plain.loss(ids).backward()
        ours.loss(ids).backward()  # updates run here
        assert opt._plan.sumsq and set(opt._plan.sumsq) == set(opt._states.offset) and not set(opt._plan.norms) & set(
            opt._states.offset)
        got = opt.clip_grad_norm_(float("inf"))
        want = torch.nn.utils.clip_grad_norm_(plain.parameters(), float("inf"))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        opt.step()
        opt.zero_grad()
        plain.zero_grad()
        opt.synchronize()


@needs_kernel
def test_bf16_rounding_keeps_cudas_nan():
    """CUDA's NaN is 0x7FFFFFFF: rounding it in integer ops carried into the sign bit (-0.0), so a NaN gradient
    scaled by clipping looked finite and its block was updated (found on the H200; numpy's NaN is 0x7FC00000)."""
    import triton
    import triton.language as tl

    @triton.jit
    def round_all(x_ptr, y_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(y_ptr + i, uk._round_bf16(tl.load(x_ptr + i)))

    # three NaNs, inf, then ties (even below, odd below) and a plain value, and zero
    xs = torch.tensor([0x7FFFFFFF, 0x7FC00000, -1, 0x7F800000, 0x3EBE8000, 0x3EBF8000, 0x3EBE1234, 0],
                      dtype=torch.int32).view(torch.float32).to(DEV)
    ys = torch.empty_like(xs)
    round_all[(1,)](xs, ys, N=8)
    assert torch.isnan(ys[:3]).all() and ys[3] == float("inf")
    assert torch.equal(ys[4:], xs[4:].bfloat16().float())  # ties to even, both ways
