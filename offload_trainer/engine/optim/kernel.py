"""One chunk's 8-bit AdamW update as a single GPU kernel (Triton), on torchao's blockwise 8-bit format.

torchao's update (`single_param_adam`, compiled by inductor) spends its GPU time in table lookups: each value's
two codes are found by a binary search over the 256-entry map (8 dependent lookups, 2 more to round), and the
in-place writes add copy kernels. On the H200 it ran 0.55-0.60 ms per 25M values, 3.2-4x torch's fused bf16
AdamW, and its compiled call cost 0.6-0.8 ms of CPU (bench/mechanisms/update_kernel.py).

This kernel reads each value once and writes it once, and quantizes with two lookups instead of ten, into the
same codes: the map from a scaled value to its code is monotone (torchao finds the largest map value <= x, then
rounds up past half the gap), so it is fixed by 255 thresholds -- the smallest float32 that reaches each code,
found here by bisection over torchao's own `quantize_8bit_with_qmap`. Floats are bucketed by their top 16 bits
(sign, exponent, 7 mantissa bits); no bucket holds more than one threshold (checked when the table is built), so a
bucket's lowest code and its next threshold give the code: `code = low[b] + (x >= next_threshold[b])`.
`quantize_with_table` is the same lookup in torch ops, tested equal to torchao's quantizer on CPU (near every
threshold and bucket edge; once on every float32 in [-1, 1]: bench/quantizer_exhaustive.py, no mismatch).

The rest follows torchao's `single_param_adam` (AdamW branch) op for op, in float32, with its non-finite guard
(`optim.adamw8bit_chunk`): a 256-value block whose new moments are not all finite keeps its weights, codes and
scales. Stochastic rounding to bf16 draws its bits from a Philox counter that depends only on the seed, the
step and the value's place in the optimizer's flat state buffer, so a resumed run rounds as the uninterrupted one.

On the H200 it runs 0.21-0.24 ms per 25M values (bench/mechanisms/update_kernel.py) and, with `eager_numerics`
(default), gives torchao's eagerly run update bit for bit: no code, scale or weight differs on 1M values, and 50 steps of
StreamedAdamW8bit equal torchao `AdamW8bit` on the GPU exactly in every tested mode (tests/optim/test_streamed_gpu.py).
"""
from __future__ import annotations

import functools
import math
import os

import torch
from torch import Tensor
from torchao.optim.quant_utils import quantize_8bit_with_qmap
from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned

try:  # Triton ships with CUDA builds of torch; CPU-only installs run the torch update instead
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["QuantTable", "Update8bit", "available", "quantize_with_table", "runnable"]

_FIRST_KEY = 0x3380  # top 16 bits of 2**-24: smaller magnitudes share bucket 0 (all below the first threshold)
_LAST_KEY = 0x3F80  # top 16 bits of 1.0 (scaled values lie in [-1, 1])
N_BUCKETS = _LAST_KEY - _FIRST_KEY + 1


def _to_key(x: Tensor) -> Tensor:
    """float32 -> int64 keys in the floats' order (-0.0 and +0.0 share key 0)."""
    bits = x.view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))


def _from_key(k: Tensor) -> Tensor:
    bits = torch.where(k >= 0, k, (-k) | (1 << 31)).to(torch.int64)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)
    return bits.to(torch.int32).view(torch.float32)


def thresholds(qmap: Tensor) -> Tensor:
    """(256,) float32: entry j is the smallest float32 that torchao quantizes to a code >= j (entry 0: -inf)."""
    qmap = qmap.float().cpu()
    lo, hi = _to_key(qmap[:-1].clone()), _to_key(qmap[1:].clone())  # code j-1 at lo, code j at hi
    want = torch.arange(1, 256)
    assert torch.equal(quantize_8bit_with_qmap(qmap, qmap).long(), torch.arange(256)), "map values must be fixed points"
    while bool((hi - lo > 1).any()):
        mid = (lo + hi) // 2
        reach = quantize_8bit_with_qmap(_from_key(mid), qmap).long() >= want
        hi, lo = torch.where(reach, mid, hi), torch.where(reach, lo, mid)
    return torch.cat([torch.tensor([-math.inf]), _from_key(hi)])


class QuantTable:
    """Per (sign, bucket): the lowest code reached in the bucket and the threshold of the next code.

    Index: sign * N_BUCKETS + bucket, bucket = clamp(top 16 bits of |x|, _FIRST_KEY, _LAST_KEY) - _FIRST_KEY.
    """

    def __init__(self, qmap: Tensor) -> None:
        thr = thresholds(qmap)
        keys = torch.arange(_FIRST_KEY, _LAST_KEY + 1, dtype=torch.int64)
        mag_lo = (keys << 16).to(torch.int32).view(torch.float32).clone()
        mag_hi = ((keys << 16) | 0xFFFF).to(torch.int32).view(torch.float32).clone()
        mag_lo[0] = 0.0  # bucket 0 also holds every smaller magnitude
        low, high = torch.cat([mag_lo, -mag_hi]), torch.cat([mag_hi, -mag_lo])  # each bucket's range, both signs
        first = quantize_8bit_with_qmap(low, qmap.float().cpu()).long()
        inside = ((thr[None, 1:] > low[:, None]) & (thr[None, 1:] <= high[:, None])).sum(1)
        if int(inside.max()) > 1:
            raise AssertionError("a bucket holds two thresholds: the buckets are too coarse for this map")
        self.low_code = first.to(torch.uint8)
        self.next_threshold = torch.where(first < 255, thr[(first + 1).clamp(max=255)], torch.tensor(math.inf))

    def to(self, device) -> QuantTable:
        out = object.__new__(QuantTable)
        out.low_code, out.next_threshold = self.low_code.to(device), self.next_threshold.to(device)
        return out


@functools.cache
def default_tables() -> tuple[Tensor, QuantTable, QuantTable]:
    """torchao's signed and unsigned maps (concatenated, 512 floats) and their tables, on the CPU."""
    qmaps = [torch.tensor(get_qmap_signed()), torch.tensor(get_qmap_unsigned())]
    return torch.cat(qmaps), QuantTable(qmaps[0]), QuantTable(qmaps[1])


def _bucket(x: Tensor) -> Tensor:
    bits = x.view(torch.int32).to(torch.int64)
    key = ((bits & 0x7FFFFFFF) >> 16).clamp(_FIRST_KEY, _LAST_KEY) - _FIRST_KEY
    return key + (bits < 0) * N_BUCKETS


def quantize_with_table(x: Tensor, table: QuantTable) -> Tensor:
    """The kernel's quantizer in torch ops (float32 in [-1, 1] -> uint8 codes): torchao's codes, two lookups."""
    b = _bucket(x.float().contiguous())
    return (table.low_code[b].long() + (x >= table.next_threshold[b]).long()).to(torch.uint8)


def available(device: torch.device) -> bool:
    """Whether the kernel runs natively on `device` (a CUDA device with Triton installed)."""
    return triton is not None and torch.device(device).type == "cuda"


def runnable(device: torch.device) -> bool:
    """`available`, or Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 before import; for tests)."""
    return available(device) or (triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
                                 and torch.device(device).type == "cpu")


if triton is not None:

    @triton.jit
    def _quantize(x, low_ptr, thr_ptr, FIRST_KEY: tl.constexpr, LAST_KEY: tl.constexpr, NB: tl.constexpr):
        bits = x.to(tl.int32, bitcast=True)
        key = (bits & 0x7FFFFFFF) >> 16
        b = tl.minimum(tl.maximum(key, FIRST_KEY), LAST_KEY) - FIRST_KEY + tl.where(bits < 0, NB, 0)
        low = tl.load(low_ptr + b).to(tl.int32)
        return low + (x >= tl.load(thr_ptr + b)).to(tl.int32)

    @triton.jit
    def _round_bf16(x):
        """float32 -> the nearest bf16 value (ties to even), as float32: in integer ops, because Triton's
        interpreter truncates on conversion where CUDA rounds."""
        bits = x.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        return tl.where(x != x, x, rounded)  # CUDA's NaN (0x7FFFFFFF) would carry into the sign: -0.0

    @triton.jit
    def _div(x, y, EAGER: tl.constexpr):
        if EAGER:  # correctly rounded, as CUDA's eager kernels (Triton's `/` is div.full, an approximation)
            return tl.div_rn(x, y)
        else:
            return x / y

    @triton.jit
    def _fma(a, b, c, EAGER: tl.constexpr):
        if EAGER:  # the kernel runs without contraction (as eager's separate kernels): this one is written out
            return tl.fma(a, b, c)
        else:
            return a * b + c

    @triton.jit
    def _random16(seed, counter, rows, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """(ROWS, BLOCK) random 16-bit values: one Philox call gives four (counters: one per 4 values, from
        `counter`, a multiple of 4, plus the value's index in the chunk, over 4)."""
        quads = (counter // 4 + rows[:, None] * (BLOCK // 4) + tl.arange(0, BLOCK // 4)[None, :])
        r0, r1, r2, r3 = tl.randint4x(seed, quads)
        four = tl.join(tl.join(r0, r1), tl.join(r2, r3))  # (ROWS, BLOCK / 4, 2, 2)
        return (tl.reshape(four, (ROWS, BLOCK)) & 0xFFFF).to(tl.int32)

    @triton.jit
    def _adamw8bit_kernel(
        p_ptr, g_ptr, codes_ptr, scales_ptr, qmap_ptr, low_s, thr_s, low_u, thr_u, coef_ptr, sumsq_ptr,
        n_blocks, code_stride, scale_stride,
        lr, weight_decay, w1, w2, eps, bias_correction1, bias_correction2_sqrt, inv_bc1, inv_bc2_sqrt, seed, counter,
        BLOCK: tl.constexpr, ROWS: tl.constexpr, FIRST_KEY: tl.constexpr, LAST_KEY: tl.constexpr,
        NB: tl.constexpr, SR: tl.constexpr, ROUND_BF16: tl.constexpr, EAGER: tl.constexpr, GUARD: tl.constexpr,
        HAS_COEF: tl.constexpr, SUMSQ: tl.constexpr,
    ):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < n_blocks
        idx = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        mask = row_ok[:, None]
        p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + idx, mask=mask, other=0.0)
        g = g.to(tl.float32)
        if SUMSQ:  # the gradient's squared norm, for logging (before any clipping scale)
            tl.atomic_add(sumsq_ptr, tl.sum(tl.sum(g * g, axis=1), axis=0), sem="relaxed")
        if HAS_COEF:  # `grad.mul_(clip_coef)` on CUDA: the 0-dim scale cast to the gradient's dtype, the product too
            coef = tl.load(coef_ptr).to(tl.float32)  # (bf16 when the norms were: clip_grad_norm_ of bf16 grads)
            if g_ptr.dtype.element_ty == tl.bfloat16:
                g = _round_bf16(g * _round_bf16(coef))
            else:
                coef = coef.to(g_ptr.dtype.element_ty).to(tl.float32)
                g = (g * coef).to(g_ptr.dtype.element_ty).to(tl.float32)
        code_m = tl.load(codes_ptr + idx, mask=mask, other=0).to(tl.int32)
        code_v = tl.load(codes_ptr + code_stride + idx, mask=mask, other=0).to(tl.int32)
        scale_m = tl.load(scales_ptr + rows, mask=row_ok, other=0.0)
        scale_v = tl.load(scales_ptr + scale_stride + rows, mask=row_ok, other=0.0)
        # torchao's single_param_adam, AdamW branch, in its order
        p = p - lr * weight_decay * p
        m = tl.load(qmap_ptr + code_m) * scale_m[:, None]
        v = tl.load(qmap_ptr + 256 + code_v) * scale_v[:, None]
        m = _fma(w1, g - m, m, EAGER)  # torch.lerp(m, g, w1) for w1 < 0.5, as its CUDA kernel computes it
        v = _fma(w2, g * g - v, v, EAGER)
        finite = (tl.abs(m) < float("inf")) & (tl.abs(v) < float("inf"))
        ok = tl.min(finite.to(tl.int32), axis=1) > 0  # per block, as the guard of optim.adamw8bit_chunk
        new_scale_m = tl.maximum(tl.max(tl.abs(m), axis=1), 1e-12)
        new_scale_v = tl.maximum(tl.max(tl.abs(v), axis=1), 1e-12)
        new_m = _quantize(_div(m, new_scale_m[:, None], EAGER), low_s, thr_s, FIRST_KEY, LAST_KEY, NB)
        new_v = _quantize(_div(v, new_scale_v[:, None], EAGER), low_u, thr_u, FIRST_KEY, LAST_KEY, NB)
        if EAGER:  # eager CUDA divides by a host scalar as a product with its reciprocal
            denom = tl.sqrt_rn(v) * inv_bc2_sqrt + eps
            p = p - tl.div_rn(lr * (m * inv_bc1), denom)
        else:
            denom = tl.sqrt_rn(v) / bias_correction2_sqrt + eps
            p = p - lr * (m / bias_correction1) / denom
        if SR:  # torchao's _fp32_to_bf16_sr: away from zero with probability (low 16 bits) / 2**16
            rand = _random16(seed, counter, rows, ROWS, BLOCK)
            bits = p.to(tl.int32, bitcast=True)
            bits = (bits & -65536) + tl.where(rand < (bits & 0xFFFF), 0x10000, 0)
            p = bits.to(tl.float32, bitcast=True)
        elif ROUND_BF16:
            p = _round_bf16(p)
        store = mask
        store_row = row_ok
        if GUARD:
            store = mask & ok[:, None]
            store_row = row_ok & ok
        tl.store(p_ptr + idx, p.to(p_ptr.dtype.element_ty), mask=store)
        tl.store(codes_ptr + idx, new_m.to(tl.uint8), mask=store)
        tl.store(codes_ptr + code_stride + idx, new_v.to(tl.uint8), mask=store)
        tl.store(scales_ptr + rows, new_scale_m, mask=store_row)
        tl.store(scales_ptr + scale_stride + rows, new_scale_v, mask=store_row)


class Update8bit:
    """The chunk update on `device`, called like `optim.adamw8bit_chunk` plus `counter`: the Philox counter of the
    chunk's first value (unique per step and value; see StreamedAdamW8bit._update_chunk).

    `rows`: 256-value blocks per program; `num_warps`: Triton's. `seed`: stochastic rounding's Philox key.
    `eager_numerics`: round every operation as torch's eager CUDA kernels do (correctly rounded divisions and square
    roots, no fused multiply-adds but the one inside lerp), so that results match torchao's update run eagerly, bit
    for bit where the order of operations is the same. False: Triton's defaults (approximate division, contraction).
    """

    def __init__(self, device, *, seed: int = 0, rows: int = 4, num_warps: int = 4, guard: bool = True,
                 eager_numerics: bool = True) -> None:
        if triton is None:
            raise RuntimeError("the fused 8-bit update needs Triton (it ships with CUDA builds of torch)")
        qmaps, signed, unsigned = default_tables()
        self.qmaps = qmaps.to(device)
        self.tables = [t.to(device) for t in (signed, unsigned)]
        self.seed = seed & (2**63 - 1)  # torch.initial_seed() may use all 64 bits; Triton takes an int64 here
        self.rows, self.num_warps, self.guard = rows, num_warps, guard
        self.eager_numerics = eager_numerics

    def __call__(self, p: Tensor, grad: Tensor, codes: Tensor, scales: Tensor, qmap_signed, qmap_unsigned,
                 step: Tensor | float, lr: Tensor | float, beta1: float, beta2: float, weight_decay: float,
                 eps: float, bf16_stochastic_round: bool, *, counter: int = 0, grad_scale: Tensor | None = None,
                 sumsq: Tensor | None = None):
        """`grad_scale`: a 0-dim tensor the gradient is multiplied by first (clipping). `sumsq`: a 0-dim float32
        tensor the gradient's sum of squares is added to (atomically: the order of the sum varies). `qmap_signed`
        and `qmap_unsigned` are accepted for `adamw8bit_chunk`'s signature and not read: the kernel holds torchao's
        maps and their tables itself."""
        n = p.numel()
        bs = n // scales.shape[1]
        if bs != 256 or n % bs or not (p.is_contiguous() and grad.is_contiguous()):
            raise ValueError("the fused update wants contiguous tensors in 256-value blocks")
        if counter % 4:
            raise ValueError("the Philox counter must be a multiple of 4 (one call draws four values)")
        if codes.stride(1) != 1 or scales.stride(1) != 1:
            raise ValueError("codes and scales rows must be contiguous")
        step = torch.as_tensor(step, dtype=torch.float32)
        # bias corrections as torchao computes them (float32, on the host where `step` lives)
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step).sqrt()
        inverses = [float(1 / x) for x in (bias_correction1, bias_correction2_sqrt)]  # float32, as eager takes them
        sr = bool(bf16_stochastic_round) and p.dtype is torch.bfloat16
        blocks = n // bs
        s, u = self.tables
        _adamw8bit_kernel[(triton.cdiv(blocks, self.rows),)](
            p, grad, codes, scales, self.qmaps, s.low_code, s.next_threshold, u.low_code, u.next_threshold,
            grad_scale if grad_scale is not None else scales, sumsq if sumsq is not None else scales,
            blocks, codes.stride(0), scales.stride(0),
            float(lr), float(weight_decay), 1 - beta1, 1 - beta2, float(eps),
            float(bias_correction1), float(bias_correction2_sqrt), *inverses, self.seed, counter,
            BLOCK=bs, ROWS=self.rows, FIRST_KEY=_FIRST_KEY, LAST_KEY=_LAST_KEY, NB=N_BUCKETS,
            SR=sr, ROUND_BF16=p.dtype is torch.bfloat16, GUARD=self.guard, HAS_COEF=grad_scale is not None,
            SUMSQ=sumsq is not None,
            EAGER=self.eager_numerics, num_warps=self.num_warps, enable_fp_fusion=not self.eager_numerics,
        )
