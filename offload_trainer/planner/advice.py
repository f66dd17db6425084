"""The planner's refusal: when no plan fits, which knob to change and by how much (search.py tries the plans)."""
from __future__ import annotations

import dataclasses

from .estimate import Choice, Step, estimate
from .inputs import Budget
from .shape import GiB, machine_for


def refusal(checked, step: Step, base: Choice, budget: Budget) -> str:
    """Why none of the plans tried fits, and what would: for the GPU, layer swap or fewer tokens per micro-batch;
    for the host, the machine the leanest plan that fits the GPU needs, or what frees host memory; a plan that fits
    both budgets but not layer_swap: auto's start margin, named with the margin and the count that runs as set.
    `checked`: (plan, the GPU bytes it was given: the budget, or the budget less that margin); `base`: the
    micro-batch and the states kept on the GPU, as tried."""
    tried = [p for p, _ in checked]
    best = min(tried, key=lambda p: p.gpu_peak_gib)
    batch, seq, n, wb, machine = base.batch, base.seq, step.params, step.wb, step.machine
    gpu_gb, host_gb, source = budget.gpu_gb, budget.host_gb, budget.host_source
    gpu_usable = budget.gpu_usable
    as_best = dataclasses.replace(base, offload_gradients=best.offload_gradients,
                                  activation_offload=best.activation_offload, resident=best.resident_layers,
                                  tiled=best.tiled_mlp, tiled_layers=best.tiled_layers)

    def same_switches(batch: int, seq: int) -> dict:
        return estimate(step, dataclasses.replace(as_best, batch=batch, seq=seq))

    msgs = []
    if best.gpu_peak_gib * GiB > gpu_usable:
        fixed = same_switches(batch=1, seq=8)
        msgs.append(f"GPU: needs {best.gpu_peak_gib:.1f} GiB (the leanest plan tried) but {gpu_gb:g} GiB leaves "
                    f"{gpu_usable / GiB:.1f} GiB for PyTorch.")
        swap_helps = best.resident_layers == best.layers and estimate(
            step, dataclasses.replace(as_best, resident=0))["reserved"] <= gpu_usable
        if swap_helps:
            msgs.append("Swapping decoder layers through pinned CPU memory fits: layer_swap: auto "
                        "(the planner keeps as many layers on the GPU as fit).")
        if fixed["reserved"] > gpu_usable and not swap_helps:
            msgs.append(f"The weights alone ({wb * n / GiB:.1f} GiB in {'float32' if wb == 4 else 'bf16'}) and the "
                        f"optimizer's buffers do not fit"
                        + (f" even with {best.resident_layers} of {best.layers} layers on the GPU"
                           if best.resident_layers < best.layers else "")
                        + f": use LoRA (peft), or a GPU with more than "
                        f"{fixed['reserved'] / GiB + machine.cuda_context_gib:.0f} GiB.")
        elif fixed["reserved"] <= gpu_usable:
            tokens = _most_tokens(lambda t: same_switches(batch=1, seq=t)["reserved"] <= gpu_usable, batch * seq)
            b, s = max(1, tokens // seq), min(seq, tokens)
            tokens = b * s
            msgs.append(f"Fewer tokens per micro-batch fit: per_device_train_batch_size={b}"
                        + (f", max_seq_length={s}" if s < seq else "")
                        + f" (about {tokens} tokens; keep the tokens per step with gradient_accumulation_steps)"
                        + ("" if best.activation_offload else "; or activation_offload: true"))
    host_ok = host_gb is None or host_gb <= 0
    margin_only = [(p, u) for p, u in checked if u < p.gpu_peak_gib * GiB <= gpu_usable
                   and (host_ok or p.host_peak_gib <= host_gb)]
    if margin_only:  # both budgets hold; auto's margin for its first measured steps does not
        p, u = max(margin_only, key=lambda pu: pu[0].resident_layers)
        msgs.append(f"GPU: with {p.resident_layers} of {p.layers} decoder layers on the GPU the plan needs "
                    f"{p.gpu_peak_gib:.2f} GiB of the {gpu_usable / GiB:.2f} usable ({gpu_gb:g} GiB budget) and "
                    f"{p.host_peak_gib:.1f} GiB of host memory, which fit; but layer_swap: auto starts "
                    f"{(gpu_usable - u) / GiB:.2f} GiB under the budget (0.5 GiB + a quarter of the step's working "
                    f"set, room for its first steps to measure the peak), and no count fits under that. Set "
                    f"layer_swap: {p.resident_layers} to run that count as set, "
                    f"{(gpu_usable - p.gpu_peak_gib * GiB) / GiB:.2f} GiB under the budget as predicted.")
    gpu_ok = [p for p, u in checked if p.gpu_peak_gib * GiB <= u]
    if gpu_ok and not margin_only:  # the GPU is not the problem: host RAM is
        lean = min(gpu_ok, key=lambda p: p.host_peak_gib)
        fixes = [machine_for(lean.host_peak_gib, above=host_gb)]
        if lean.clip and lean.offload_gradients:  # (its figure: the plan it gives, search.py's list of keys)
            fixes.insert(0, "max_grad_norm: 0 (no clipping: updates during backward need no host gradient buffer)")
        fixes += [] if lean.lora_params else ["LoRA"]
        parts = ", ".join(f"{k} {v:.1f}" for k, v in lean.host_breakdown.items())
        source = f" ({source})" if source else ""
        msgs.append(f"Host RAM: the plans that fit the GPU need {lean.host_peak_gib:.1f} GiB (GiB: {parts}), but the "
                    f"host budget is {host_gb:.1f} GiB{source}: the kernel would kill the run. Use "
                    + ", or ".join(fixes) + ".")
    return "no plan fits. " + " ".join(msgs)


def _most_tokens(fits, tokens: int, step: int = 256) -> int:
    """The largest micro-batch size in tokens, below `tokens`, for which `fits(t)`: a multiple of `step` (down to 8
    tokens for tiny budgets). Halves until one fits, then bisects up to the `step` granularity."""
    lo = tokens
    while lo > 8 and not fits(lo):
        lo //= 2
    hi = min(2 * lo, tokens)  # lo fits (or is the floor); hi does not
    lo_r, hi_r = lo // step, hi // step  # bisect over multiples of `step`
    while hi_r - lo_r > 1:
        mid = (lo_r + hi_r) // 2
        lo_r, hi_r = (mid, hi_r) if fits(mid * step) else (lo_r, mid)
    return max(lo, lo_r * step)
