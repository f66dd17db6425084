"""Where the fused 8-bit update's GPU time goes: the kernel of `engine/optim/kernel.py` rebuilt with switches that
change or remove one part each, timed alone and beside compute-stream work (device; ~90 s):

    python bench/mechanisms/update_kernel_parts.py > rows.jsonl

Each variant runs on one 25M-value chunk (states on the GPU) and, through `update_kernel.py --beside`'s measure, on a
high-priority stream beside 300 `silu_backward` kernels: `beside_ps_per_element` is what each updated value cost the
compute stream. Variants that keep the update's results are checked equal to the production kernel's (p, g, codes,
scales: the count of values that differ); the others are bounds, not updates:
  prod                  offload_trainer's kernel as it is
  packed                one int32 table lookup per quantized value (low code and comparator packed) instead of two
  fake_q / fake_dq      no table lookup to quantize / to dequantize (wrong codes: what the lookups cost)
  no_sr, fast, recip    no stochastic rounding; Triton's approximate division and contraction; the block's scale
                        inverted once per block (these change results)
  rand8                 eight stochastic-rounding values per Philox call instead of four (other random bits)
  gather_dq             the dequantizing lookup through tl.gather from the map loaded into registers
  persN[_nsK]           a persistent grid of N programs per SM, loads pipelined K stages
  rRwW                  R blocks of 256 values per program, W warps
  floor_all_fake        every lookup, the division and the rounding's randomness removed
  copy                  the same bytes read and written, no arithmetic
"""
import json

import torch
import triton
import triton.language as tl
from update_kernel import beside_bench

from offload_trainer.engine.optim import kernel as uk
from offload_trainer.engine.optim.kernel import _div, _fma, _quantize, _random16, _round_bf16


@triton.jit
def _quantize_packed(x, tab_ptr, FIRST_KEY: tl.constexpr, LAST_KEY: tl.constexpr, NB: tl.constexpr):
    bits = x.to(tl.int32, bitcast=True)
    a = bits & 0x7FFFFFFF
    key = a >> 16
    neg = bits < 0
    lo = a & 0xFFFF
    t = tl.where(neg, 0xFFFF - lo, lo)
    t = tl.where(key < FIRST_KEY, tl.where(neg, 0x10000, -1), t)
    t = tl.where(key > LAST_KEY, -1, t)
    b = tl.minimum(tl.maximum(key, FIRST_KEY), LAST_KEY) - FIRST_KEY + tl.where(neg, NB, 0)
    e = tl.load(tab_ptr + b)
    return (e & 0xFF) + (t >= (e >> 8)).to(tl.int32)


@triton.jit
def _random16x8(seed, counter, rows, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    quads = (counter // 8 + rows[:, None] * (BLOCK // 8) + tl.arange(0, BLOCK // 8)[None, :])
    r0, r1, r2, r3 = tl.randint4x(seed, quads)
    four = tl.join(tl.join(r0, r1), tl.join(r2, r3))  # (ROWS, BLOCK/8, 2, 2)
    eight = tl.join(four & 0xFFFF, (four >> 16) & 0xFFFF)
    return tl.reshape(eight, (ROWS, BLOCK)).to(tl.int32)


@triton.jit
def _tile(tile, p_ptr, g_ptr, codes_ptr, scales_ptr, qmap_ptr, low_s, thr_s, low_u, thr_u, pk_s, pk_u,
    n_blocks, code_stride, scale_stride,
    lr, weight_decay, w1, w2, eps, bias_correction1, bias_correction2_sqrt, inv_bc1, inv_bc2_sqrt, seed, counter,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, FIRST_KEY: tl.constexpr, LAST_KEY: tl.constexpr,
    NB: tl.constexpr, SR: tl.constexpr, EAGER: tl.constexpr,
    PACKED: tl.constexpr, FAKE_Q: tl.constexpr, FAKE_DQ: tl.constexpr, RAND8: tl.constexpr, COPY: tl.constexpr,
    GATHER_DQ: tl.constexpr, RECIP: tl.constexpr,
):
    rows = tile.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_blocks
    idx = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = row_ok[:, None]
    p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    code_m = tl.load(codes_ptr + idx, mask=mask, other=0).to(tl.int32)
    code_v = tl.load(codes_ptr + code_stride + idx, mask=mask, other=0).to(tl.int32)
    scale_m = tl.load(scales_ptr + rows, mask=row_ok, other=0.0)
    scale_v = tl.load(scales_ptr + scale_stride + rows, mask=row_ok, other=0.0)
    if COPY:
        tl.store(p_ptr + idx, (p + g).to(p_ptr.dtype.element_ty), mask=mask)
        tl.store(codes_ptr + idx, (code_m + 1).to(tl.uint8), mask=mask)
        tl.store(codes_ptr + code_stride + idx, (code_v + 1).to(tl.uint8), mask=mask)
        tl.store(scales_ptr + rows, scale_m * 1.0001, mask=row_ok)
        tl.store(scales_ptr + scale_stride + rows, scale_v * 1.0001, mask=row_ok)
    else:
        p = p - lr * weight_decay * p
        if FAKE_DQ:
            m = code_m.to(tl.float32) * (1.0 / 128) * scale_m[:, None]
            v = code_v.to(tl.float32) * (1.0 / 256) * scale_v[:, None]
        elif GATHER_DQ:
            qs = tl.load(qmap_ptr + tl.arange(0, 256))
            qu = tl.load(qmap_ptr + 256 + tl.arange(0, 256))
            m = tl.reshape(tl.gather(qs, tl.reshape(code_m, (ROWS * BLOCK,)), 0), (ROWS, BLOCK)) * scale_m[:, None]
            v = tl.reshape(tl.gather(qu, tl.reshape(code_v, (ROWS * BLOCK,)), 0), (ROWS, BLOCK)) * scale_v[:, None]
        else:
            m = tl.load(qmap_ptr + code_m) * scale_m[:, None]
            v = tl.load(qmap_ptr + 256 + code_v) * scale_v[:, None]
        m = _fma(w1, g - m, m, EAGER)
        v = _fma(w2, g * g - v, v, EAGER)
        finite = (tl.abs(m) < float("inf")) & (tl.abs(v) < float("inf"))
        ok = tl.min(finite.to(tl.int32), axis=1) > 0
        new_scale_m = tl.maximum(tl.max(tl.abs(m), axis=1), 1e-12)
        new_scale_v = tl.maximum(tl.max(tl.abs(v), axis=1), 1e-12)
        if RECIP:
            xm = m * (1.0 / new_scale_m)[:, None]
            xv = v * (1.0 / new_scale_v)[:, None]
        else:
            xm = _div(m, new_scale_m[:, None], EAGER)
            xv = _div(v, new_scale_v[:, None], EAGER)
        if FAKE_Q:
            new_m = (xm.to(tl.int32, bitcast=True) >> 20) & 255
            new_v = (xv.to(tl.int32, bitcast=True) >> 20) & 255
        elif PACKED:
            new_m = _quantize_packed(xm, pk_s, FIRST_KEY, LAST_KEY, NB)
            new_v = _quantize_packed(xv, pk_u, FIRST_KEY, LAST_KEY, NB)
        else:
            new_m = _quantize(xm, low_s, thr_s, FIRST_KEY, LAST_KEY, NB)
            new_v = _quantize(xv, low_u, thr_u, FIRST_KEY, LAST_KEY, NB)
        if EAGER:
            denom = tl.sqrt_rn(v) * inv_bc2_sqrt + eps
            p = p - tl.div_rn(lr * (m * inv_bc1), denom)
        else:
            denom = tl.sqrt_rn(v) / bias_correction2_sqrt + eps
            p = p - lr * (m / bias_correction1) / denom
        if SR:
            if RAND8:
                rand = _random16x8(seed, counter, rows, ROWS, BLOCK)
            else:
                rand = _random16(seed, counter, rows, ROWS, BLOCK)
            bits = p.to(tl.int32, bitcast=True)
            bits = (bits & -65536) + tl.where(rand < (bits & 0xFFFF), 0x10000, 0)
            p = bits.to(tl.float32, bitcast=True)
        else:
            p = _round_bf16(p)
        store = mask & ok[:, None]
        store_row = row_ok & ok
        tl.store(p_ptr + idx, p.to(p_ptr.dtype.element_ty), mask=store)
        tl.store(codes_ptr + idx, new_m.to(tl.uint8), mask=store)
        tl.store(codes_ptr + code_stride + idx, new_v.to(tl.uint8), mask=store)
        tl.store(scales_ptr + rows, new_scale_m, mask=store_row)
        tl.store(scales_ptr + scale_stride + rows, new_scale_v, mask=store_row)




@triton.jit
def _var_kernel(
    p_ptr, g_ptr, codes_ptr, scales_ptr, qmap_ptr, low_s, thr_s, low_u, thr_u, pk_s, pk_u,
    n_blocks, code_stride, scale_stride,
    lr, weight_decay, w1, w2, eps, bias_correction1, bias_correction2_sqrt, inv_bc1, inv_bc2_sqrt, seed, counter,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, FIRST_KEY: tl.constexpr, LAST_KEY: tl.constexpr,
    NB: tl.constexpr, SR: tl.constexpr, EAGER: tl.constexpr,
    PACKED: tl.constexpr, FAKE_Q: tl.constexpr, FAKE_DQ: tl.constexpr, RAND8: tl.constexpr, COPY: tl.constexpr,
    GATHER_DQ: tl.constexpr, RECIP: tl.constexpr, PERSIST: tl.constexpr, NS: tl.constexpr,
):
    if PERSIST:
        n_tiles = tl.cdiv(n_blocks, ROWS)
        for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=NS):
            _tile(t, p_ptr, g_ptr, codes_ptr, scales_ptr, qmap_ptr, low_s, thr_s, low_u, thr_u, pk_s, pk_u,
                  n_blocks, code_stride, scale_stride, lr, weight_decay, w1, w2, eps, bias_correction1,
                  bias_correction2_sqrt, inv_bc1, inv_bc2_sqrt, seed, counter, BLOCK, ROWS, FIRST_KEY, LAST_KEY, NB,
                  SR, EAGER, PACKED, FAKE_Q, FAKE_DQ, RAND8, COPY, GATHER_DQ, RECIP)
    else:
        _tile(tl.program_id(0), p_ptr, g_ptr, codes_ptr, scales_ptr, qmap_ptr, low_s, thr_s, low_u, thr_u, pk_s, pk_u,
              n_blocks, code_stride, scale_stride, lr, weight_decay, w1, w2, eps, bias_correction1,
              bias_correction2_sqrt, inv_bc1, inv_bc2_sqrt, seed, counter, BLOCK, ROWS, FIRST_KEY, LAST_KEY, NB,
              SR, EAGER, PACKED, FAKE_Q, FAKE_DQ, RAND8, COPY, GATHER_DQ, RECIP)


NEVER = 0x20000  # a comparator no 17-bit value reaches


def packed_table(table):
    """(6146,) int32: per (sign, bucket) the bucket's lowest code | the comparator << 8: code = low + (t >= comparator),
    t the value's low 16 bits (counted from the bucket's far end for negative values); checked on every float."""
    NB = uk.N_BUCKETS
    keys = torch.arange(uk._FIRST_KEY, uk._LAST_KEY + 1, dtype=torch.int64)
    l = torch.arange(0x10000, dtype=torch.int64)
    out = []
    for sign in (0, 1):
        for i, k in enumerate(keys.tolist()):
            b = i + sign * NB
            thr = float(table.next_threshold[b])
            bits = ((k << 16) | l).to(torch.int32).view(torch.float32)
            x = -bits if sign else bits
            reach = x >= thr
            if sign == 0:
                c = int(reach.int().argmax()) if bool(reach.any()) else NEVER
                assert bool((reach == (l >= c)).all())
            else:
                c = 0xFFFF - int(reach.nonzero().max()) if bool(reach.any()) else NEVER
                assert bool((reach == ((0xFFFF - l) >= c)).all())
            out.append(int(table.low_code[b]) | (c << 8))
    return torch.tensor(out, dtype=torch.int32)


class Var:
    """The production kernel's arithmetic with the module's switches (see the docstring)."""

    def __init__(self, dev, rows=4, num_warps=4, sr=True, eager=True, packed=False, fake_q=False, fake_dq=False,
                 rand8=False, copy=False, seed=1234, gather_dq=False, recip=False, persist=0, ns=1):
        qmaps, s, u = uk.default_tables()
        self.qmaps = qmaps.to(dev)
        self.s, self.u = s.to(dev), u.to(dev)
        self.pk = [packed_table(s).to(dev), packed_table(u).to(dev)]
        self.kw = dict(ROWS=rows, SR=sr, EAGER=eager, PACKED=packed, FAKE_Q=fake_q, FAKE_DQ=fake_dq, RAND8=rand8,
                       COPY=copy, GATHER_DQ=gather_dq, RECIP=recip, PERSIST=persist > 0, NS=ns, num_warps=num_warps,
                       enable_fp_fusion=not eager)
        self.rows, self.seed, self.persist = rows, seed, persist

    def __call__(self, p, g, codes, scales, counter=0):
        n = p.numel(); blocks = n // 256
        step = torch.tensor(7.0)
        bc1 = 1 - 0.9 ** step; bc2 = (1 - 0.999 ** step).sqrt()
        grid = min(triton.cdiv(blocks, self.rows), self.persist) if self.persist else triton.cdiv(blocks, self.rows)
        _var_kernel[(grid,)](
            p, g, codes, scales, self.qmaps, self.s.low_code, self.s.next_threshold, self.u.low_code,
            self.u.next_threshold, self.pk[0], self.pk[1], blocks, codes.stride(0), scales.stride(0),
            1e-3, 0.01, 0.1, 0.001, 1e-8, float(bc1), float(bc2), float(1 / bc1), float(1 / bc2), self.seed, counter,
            BLOCK=256, FIRST_KEY=uk._FIRST_KEY, LAST_KEY=uk._LAST_KEY, NB=uk.N_BUCKETS, **self.kw)


def prod(dev, **kw):
    k = uk.Update8bit(torch.device(dev), seed=1234, **kw)
    qm = [k.qmaps[:256], k.qmaps[256:]]
    return lambda p, g, codes, scales, counter=0: k(p, g, codes, scales, *qm, torch.tensor(7.0), torch.tensor(1e-3),
                                                    0.9, 0.999, 0.01, 1e-8, True, counter=counter)


def main():
    dev = "cuda"
    n = 25165824
    torch.manual_seed(0)
    p0 = torch.randn(n, device=dev, dtype=torch.bfloat16) * 0.02
    g0 = torch.randn(n, device=dev, dtype=torch.bfloat16) * 1e-3
    c0 = torch.randint(0, 256, (2, n), device=dev, dtype=torch.uint8)
    s0 = torch.rand(2, n // 256, device=dev) * 1e-3
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants = {
        "prod": prod(dev),
        "packed": Var(dev, packed=True),
        "fake_q": Var(dev, fake_q=True),
        "fake_dq": Var(dev, fake_dq=True),
        "fake_q_dq": Var(dev, fake_q=True, fake_dq=True),
        "no_sr": Var(dev, sr=False),
        "fast": Var(dev, eager=False),
        "recip": Var(dev, recip=True),
        "rand8": Var(dev, rand8=True),
        "gather_dq": Var(dev, gather_dq=True),
        "pers8": Var(dev, persist=sms * 8),
        "pers16_ns2": Var(dev, persist=sms * 16, ns=2),
        "r2w2": Var(dev, rows=2, num_warps=2),
        "r1w1": Var(dev, rows=1, num_warps=1),
        "r8w8": Var(dev, rows=8, num_warps=8),
        "floor_all_fake": Var(dev, fake_q=True, fake_dq=True, sr=False, eager=False),
        "copy": Var(dev, copy=True),
    }
    # the variants meant to keep the results, against the production kernel (values that differ: p, g, codes, scales)
    outs = {}
    checks = ["prod", "packed", "gather_dq", "pers8", "pers16_ns2", "r2w2", "r1w1", "r8w8"]
    for name in checks:
        t = [x.clone() for x in (p0, g0, c0, s0)]
        try:
            variants[name](*t, counter=1 << 20)
            torch.cuda.synchronize()
        except Exception as e:
            print(json.dumps({"variant": name, "error": repr(e)[:500]}), flush=True)
            del variants[name]
            continue
        outs[name] = t
    checks = [k for k in checks if k in outs]
    for name in checks[1:]:
        same = [int((a != b).sum()) for a, b in zip(outs["prod"], outs[name])]
        print(json.dumps({"check": name, "values_differing_p_g_codes_scales": same}), flush=True)
    # alone
    p, g, c, s = [x.clone() for x in (p0, g0, c0, s0)]
    res = {}
    for name, fn in variants.items():
        for _ in range(3):
            fn(p, g, c, s)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(20):
            fn(p, g, c, s)
        e1.record()
        torch.cuda.synchronize()
        res[name] = e0.elapsed_time(e1) / 20
        ms = res[name]
        print(json.dumps({"variant": name, "ms_per_25M": round(ms, 4), "ps_per_el": round(ms * 1e9 / n, 2)}), flush=True)
    # beside compute-stream work, as update_kernel.py --beside measures it
    beside = beside_bench(dev)
    for name, fn in variants.items():
        row = beside(lambda: fn(p, g, c, s), n)
        print(json.dumps({"beside": "elementwise", "variant": name, **row,
                          "update_alone_ms": round(res[name] * int(3e9 // n), 2)}), flush=True)

if __name__ == "__main__":
    main()
