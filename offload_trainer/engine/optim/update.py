"""The AdamW arithmetic of one streamed chunk: torchao's `single_param_adam` (AdamW branch) over the plain tensors of
two `OptimState8bit`s, compiled on CUDA where the Triton kernel (kernel.py) is not used. Functions only."""
from __future__ import annotations

import torch
from torch import Tensor
from torchao.optim.quant_utils import _fp32_to_bf16_sr, dequant_with_qmap, quantize_8bit_with_qmap, scale_tensor

# Inductor options for the update. None by default: bench/mechanisms/update_kernel.py measured int32 codes in the
# quantizer, no bounds asserts on the table lookups, multi-kernel reductions and autotuning within ~10% of the default kernel
# (0.50-0.57 ms per 25M values, torchao's own update 0.47-0.49 ms), not worth leaving torchao's code for.
UPDATE_INDUCTOR_OPTIONS: dict = {}


def compile_update(fn, options: dict | None = None):
    """`fn` compiled as the optimizer compiles its updates (static shapes, one graph, `UPDATE_INDUCTOR_OPTIONS`)."""
    return torch.compile(fn, fullgraph=True, dynamic=False,
                         options={**UPDATE_INDUCTOR_OPTIONS, **(options or {})} or None)


def adamw8bit_chunk(p: Tensor, grad: Tensor, codes: Tensor, scales: Tensor, qmap_signed: Tensor,
                    qmap_unsigned: Tensor, step: Tensor, lr: Tensor, beta1: float, beta2: float,
                    weight_decay: float, eps: float, bf16_stochastic_round: bool,
                    quantize=quantize_8bit_with_qmap, guard: bool = True) -> None:
    """torchao's `single_param_adam` (AdamW branch) on two `OptimState8bit`s, written over their plain
    tensors: codes (2, n) uint8 and scales (2, n / block) of exp_avg and exp_avg_sq.

    Same ops in the same order, with torchao's quantization functions (`quantize`: a variant to measure, see
    bench/mechanisms/update_kernel.py), so results are identical; but a compiled call over plain tensors skips the
    tensor-subclass dispatch, which cost ~1 ms of CPU per call and starved the GPU of backward kernels when called
    from gradient hooks.

    A 256-value block whose gradient holds a NaN or an infinity is left as it was (its weights, codes and
    scales): its new block scales come out non-finite, which is all the check reads (no extra pass over the
    gradient), and it is decided on the GPU, so updates queued during backward never wait for the CPU.
    (`guard=False` drops that check: torchao's own update, for bench/mechanisms/update_kernel.py to measure.)
    """
    block = codes.shape[1] // scales.shape[1]
    p_f32 = p.float()
    grad_f32 = grad.float()
    p_f32 = p_f32 - lr * weight_decay * p_f32
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    exp_avg_f32 = dequant_with_qmap(codes[0], qmap_signed, scales[0]).lerp(grad_f32, 1 - beta1)
    exp_avg_sq_f32 = dequant_with_qmap(codes[1], qmap_unsigned, scales[1]).lerp(grad_f32.square(), 1 - beta2)
    quantized = [scale_tensor(x, block) for x in (exp_avg_f32, exp_avg_sq_f32)]  # as OptimState8bit.copy_
    ok = torch.isfinite(quantized[0][1]) & torch.isfinite(quantized[1][1])  # per block
    for k, ((scaled, scale), qmap) in enumerate(zip(quantized, (qmap_signed, qmap_unsigned))):
        new_codes = quantize(scaled, qmap)
        codes[k].copy_(torch.where(ok.view(-1, 1), new_codes.view(-1, block), codes[k].view(-1, block)).view(-1)
                       if guard else new_codes)
        scales[k].copy_(torch.where(ok, scale, scales[k]) if guard else scale)
    denom = (exp_avg_sq_f32.sqrt() / bias_correction2.sqrt()) + eps
    p_f32 = p_f32 - lr * (exp_avg_f32 / bias_correction1) / denom
    new_p = _fp32_to_bf16_sr(p_f32) if bf16_stochastic_round else p_f32.to(p.dtype)
    p.copy_(torch.where(ok.view(-1, 1), new_p.view(-1, block), p.view(-1, block)).view(p.shape) if guard else new_p)


def grad_norm(g: Tensor) -> Tensor:
    """The per-tensor norm exactly as clip_grad_norm_ computes it (foreach kernel where the device has one)."""
    if g.device.type in ("cuda", "xpu"):
        return torch._foreach_norm([g], 2.0)[0]
    return torch.linalg.vector_norm(g, 2.0)


def roots_of_sums(params: list, sumsq: dict) -> dict:
    """Each tensor's gradient norm from the squared norm its fused update summed, in the gradient's dtype as the norm
    kernel gives it: sqrt then cast, for all of them at once (two small kernels per tensor cost ~2 ms of launches at
    every step's end, the GPU waiting)."""
    if not params:
        return {}
    roots = torch.stack([sumsq[p] for p in params]).sqrt()
    out = {}
    for dtype in dict.fromkeys(p.dtype for p in params):
        idx = [i for i, p in enumerate(params) if p.dtype == dtype]
        cast = (roots if len(idx) == len(params) else roots[idx]).to(dtype)
        out.update(zip((params[i] for i in idx), cast.unbind()))
    return out


def global_norm(norms: dict) -> Tensor:
    """The L2 norm of per-tensor norms, stacked as clip_grad_norm_ stacks them: grouped by gradient dtype, in order."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for p, nrm in norms.items():
        by_dtype.setdefault(p.dtype, []).append(nrm)
    return torch.linalg.vector_norm(torch.stack([n for ns in by_dtype.values() for n in ns]), 2.0)


def as_float(value) -> float:
    """A hyperparameter as a Python number. A tensor here (a user's, or a state dict that went through accelerate's
    prepare(), which sends it to the GPU) is read once, so no update's launch reads a GPU tensor (a device sync per
    chunk, which serialized the CPU with the update stream)."""
    return float(value.detach().cpu()) if isinstance(value, Tensor) else float(value)
