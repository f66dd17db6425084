"""The planner's search: the fastest configuration that fits the budgets -- every layer resident first, then as many
as fit; gradient and activation offload only where needed; the 8-bit states the budget has room for kept on the GPU
-- and, when none fits, the advice that says which knob to change and by how much."""
from __future__ import annotations

import dataclasses
import functools
import math

from ..engine.sizes import STATE_BYTES_PER_VALUE
from ..settings import CHUNK_NUMEL, INFLIGHT_CHUNKS, LOSS_CHUNK, MLP_TILE_TOKENS, gradients_offloaded
from .estimate import estimate as _estimate
from .advice import refusal
from .shape import GiB, HostPlanError, Machine, ModelShape, PlanError
from .table import Plan

# Speculative clipping takes a second bank of 8-bit states and the weights' backups in host memory (2 GiB per 1B
# parameters more than exact clipping): taken only where its step is predicted this much faster -- more than the
# model's error on the step (within 3% of the measured 8B steps), and 8B at 32k (0.5% predicted, 1.0% measured)
# keeps its host peak
SPECULATION_GAIN = 0.02


def plan(config, *, batch: int, seq: int, accum: int = 1, fold: int | None = 1, suggest: bool = True, **kw) -> Plan:
    """The fastest configuration that fits the budgets (None = let the planner choose a switch); `_plan_micro_batch`
    says what each argument means.

    `fold`: with `accum` > 1, how many of a step's micro-batches run as one (the Trainer's loop hands them one by one;
    trainer/fold.py concatenates them): 1 runs each as it comes; None takes the divisor j of `accum` whose plan (for
    micro-batches of `batch * j`, `accum / j` per step: the same samples per step) is predicted fastest within the
    budgets. One micro-batch of the step's samples moves no gradient sums over PCIe, and may clip speculatively; a
    larger micro-batch needs more GPU memory. The Plan's `batch` and `accum` are the micro-batches as run, `fold` the
    j. Where none fits, the error is that of the micro-batches as given (fold 1), or of the `fold` asked for, and
    (`suggest`) it ends with every key of `ALTERNATIVES` that makes the run fit on its own, with the plan it gives.
    """
    if fold is not None and (fold < 1 or accum % fold):
        raise PlanError(f"fold_accumulation={fold} must divide gradient_accumulation_steps={accum}")
    best, first_error = None, None
    for j in [fold] if fold is not None else [j for j in range(1, accum + 1) if accum % j == 0]:
        try:
            p = _plan_micro_batch(config, batch=batch * j, seq=seq, accum=accum // j, **kw)
        except PlanError as e:
            first_error = first_error or e
            continue
        p.fold = j
        if best is None or p.step_s <= best.step_s:  # (a tie goes to the larger micro-batch: fewer host copies)
            best = p
    if best is None:
        fits = _fits_with(config, batch, seq, accum, fold, kw) if suggest else []
        if fits:
            raise type(first_error)(f"{first_error} Each of these fits as the only change: {'; '.join(fits)}.")
        raise first_error
    if best.fold > 1:
        best.notes.insert(0, f"gradient accumulation: {best.fold} micro-batches of {batch} x {seq} run as one of "
                             f"{best.batch} x {seq} ({best.accum} per optimizer step): the same samples, loss and "
                             f"update, {'no gradient sums' if best.accum == 1 else 'fewer gradient sums'} over PCIe")
    return best


# keys a refusal tries one at a time (the argument, the value that asks for it, the key as a config writes it); a
# value the run already has is skipped
ALTERNATIVES = (("max_grad_norm", 0, "max_grad_norm: 0"), ("layer_swap", None, "layer_swap: auto"),
                ("activation_offload", True, "activation_offload: true"), ("tiled_layers", None, "tiled_layers: true"))
_ARG_DEFAULTS = {"max_grad_norm": 1.0, "layer_swap": False, "activation_offload": None, "tiled_layers": False}


def _fits_with(config, batch, seq, accum, fold, kw) -> list[str]:
    """Each key of ALTERNATIVES that makes a refused run fit on its own, with its plan's figures."""
    found = []
    for key, value, text in ALTERNATIVES:
        now = kw.get(key, _ARG_DEFAULTS[key])
        if now == value or (key == "activation_offload" and now is None) or (key == "max_grad_norm" and not now):
            continue  # (activation_offload None: the planner tried it already)
        try:
            p = plan(config, batch=batch, seq=seq, accum=accum, fold=fold, suggest=False, **{**kw, key: value})
        except ValueError:  # (PlanError, or a combination the planner refuses)
            continue
        found.append(f"{text} ({p.gpu_peak_gib:.1f} GiB GPU, {p.host_peak_gib:.1f} GiB host, {p.step_s:.2f} s a "
                     f"step)")
    return found


def _plan_micro_batch(config, *, batch: int, seq: int, gpu_memory_limit_gb: float | None = None,
                      host_memory_gb: float | None = None, max_grad_norm: float = 1.0, loss_chunk: int = LOSS_CHUNK,
                      chunk_numel: int = CHUNK_NUMEL, inflight: int = INFLIGHT_CHUNKS,
                      activation_offload: bool | None = None, offload_gradients: bool | None = None,
                      params: int | None = None, layer_swap: bool | int | None = False, lora_params: int = 0,
                      weight_bits: int = 16, accum: int = 1, ranks: int = 1, node_ranks: int | None = None,
                      fused_update: bool = True, device_states: str | float = 0, save_shard_bytes: int = 0,
                      weight_bytes: int = 2, speculative: bool | None = None, tiled_mlp: bool | None = False,
                      tiled_layers: bool | None = False, workers: int = 0, host_budget_source: str = "",
                      machine: Machine = Machine()) -> Plan:
    """The fastest configuration that fits the budgets for micro-batches of `batch` x `seq` tokens, `accum` per step.

    `layer_swap`: False keeps every decoder layer on the GPU; None swaps as few as the GPU budget needs;
    an int keeps that many resident. `accum`: micro-batches per optimizer step (gradient accumulation; their
    gradients wait between micro-batches, on the GPU or with `offload_gradients` in pinned memory).
    `ranks`: data parallel processes (each holds its share of the optimizer states), `node_ranks` of them on this
    host (default: all): GPU figures are per GPU, host figures (and `host_memory_gb`) for the whole node.
    `lora_params` > 0: LoRA with that many adapter parameters on a frozen base
    of `weight_bits` (16, or 4 for bitsandbytes NF4); the adapters and their optimizer stay on the GPU.
    `fused_update`: the optimizer's Triton update (its default on CUDA); False: torchao's compiled update.
    `weight_bytes`: bytes per value of the model's dtype (2: bf16 / fp16, 4: float32).
    `save_shard_bytes`: host memory a checkpoint's save adds (safetensors holds one shard in host memory while it
    writes it; `plan_for_run` counts one `SAVE_SHARD_BYTES` shard, or the whole weights when smaller).
    `device_states`: GiB of 8-bit states kept on the GPU (`StreamedAdamW8bit(device_state_bytes=)`), or "auto" (with a
    GPU budget): see `_with_device_states`.
    `speculative`: speculative clipping (with `max_grad_norm`): None takes it where it is faster and the host budget
    has room (`_with_speculation`); True insists; False clips exactly.
    `tiled_mlp`: each MLP in tiles (engine/tiled_mlp.py); None takes it only where no plan fits without it.
    `tiled_layers`: each decoder layer but its attention in tiles (models/tiled_layers.py, its MLP included); None
    takes it only where no plan fits with tiled MLPs, and for the layers it knows (`ModelShape.tileable`).
    `workers`: the data loader's worker processes (host memory). `host_budget_source`: what `host_memory_gb` is,
    for the table ("host_memory_limit_gb", "available on this machine").

    Raises PlanError, naming the knob to change, when none fits; HostPlanError when plans fit the GPU but not the
    host, naming the machine they need.
    """
    shape = ModelShape.from_config(config)
    n = params or shape.params
    clip = bool(max_grad_norm and max_grad_norm > 0)
    fixed_states = 0.0 if device_states == "auto" or lora_params else float(device_states or 0) * GiB
    est = functools.partial(_estimate, shape, n, clip=clip, loss_chunk=loss_chunk, chunk_numel=chunk_numel,
                            inflight=inflight, machine=machine, lora=lora_params, weight_bits=weight_bits,
                            accum=accum, ranks=ranks, node_ranks=ranks if node_ranks is None else node_ranks,
                            fused_update=fused_update, device_states=fixed_states, save_shard=save_shard_bytes,
                            wb=weight_bytes, workers=workers)
    base = dict(params=n, batch=batch, seq=seq, clip=clip, lora_params=lora_params, rates_of=machine.name, accum=accum,
                ranks=ranks, gpu_budget_gib=gpu_memory_limit_gb, host_budget_gib=host_memory_gb, layers=shape.layers,
                device_state_gib=fixed_states / GiB, save_shard_gib=save_shard_bytes / GiB,
                host_budget_source=host_budget_source)
    gpu_usable = (gpu_memory_limit_gb - machine.cuda_context_gib) * GiB if gpu_memory_limit_gb else math.inf
    host_usable = host_memory_gb * GiB if host_memory_gb else math.inf
    # layer_swap auto starts with a margin below the budget: its first steps measure the peak and move layers onto
    # the GPU while it leaves room (engine/fit.py); a count predicted to just fit would be run before it is measured.
    # The margin grows with what the prediction is least sure of, the step's working set (long sequences)
    def swap_usable(e) -> float:
        if layer_swap is not None:
            return gpu_usable
        return gpu_usable - AUTO_SWAP_START_MARGIN_GIB * GiB - AUTO_SWAP_START_WORKING_SHARE * e["working"]
    tried, gpu_fits, usables = [], [], []  # every plan tried; whether each fit the GPU; the GPU bytes it was given
    for switches in (dict(s, tiled=mlp, tiled_layers=layers) for mlp, layers in _tilings(
            tiled_mlp, tiled_layers, seq, shape) for s in _candidates(
            shape.layers, layer_swap, activation_offload, offload_gradients, clip=clip, accum=accum,
            lora=bool(lora_params), gpu_fits=gpu_fits)):
        e = est(batch=batch, seq=seq, **switches)
        p = Plan(offload_gradients=switches["offload_gradients"], activation_offload=switches["activation_offload"],
                 resident_layers=switches["resident"], tiled_mlp=switches["tiled"],
                 tiled_layers=switches["tiled_layers"], **base, **_predicted(e))
        # (none resident: no fewer to start from, so the plan that fits the budget itself runs and is measured)
        usable = gpu_usable if switches["resident"] in (shape.layers, 0) else swap_usable(e)
        gpu_fits.append(e["reserved"] <= usable)
        usables.append(usable)
        p.fits = gpu_fits[-1] and e["host"] <= host_usable
        tried.append(p)
        if p.fits and device_states == "auto" and gpu_memory_limit_gb and ranks == 1 and not (
                lora_params or switches["activation_offload"] or switches["resident"] < shape.layers):
            tried[-1] = p = _with_device_states(p, functools.partial(est, batch=batch, seq=seq, **switches), shape, n,
                                                gpu_usable, gpu_memory_limit_gb)
            with_acts = None if p.device_states_scope or activation_offload is not None else functools.partial(
                est, batch=batch, seq=seq, **dict(switches, activation_offload=True))
            if with_acts is not None and not clip:
                tried[-1] = p = _embedding_for_activations(p, with_acts, shape, gpu_usable, host_usable)
        else:
            with_acts = None
        if p.fits:
            if clip and not lora_params:
                p = _with_speculation(p, functools.partial(est, batch=batch, seq=seq, **switches,
                                                           device_states=p.device_state_gib * GiB),
                                      host_usable, host_memory_gb, speculative)
                if with_acts is not None and p.speculative_clipping:
                    p = _embedding_for_activations(p, functools.partial(with_acts, speculative=True), shape,
                                                   gpu_usable, host_usable)
            p.notes += _notes(p, e, shape, weight_bytes)
            return p
    advice = refusal(list(zip(tried, usables)), est, n, batch, seq, gpu_usable, gpu_memory_limit_gb, host_memory_gb,
                     machine, weight_bytes, host_budget_source)
    raise (HostPlanError if any(gpu_fits) else PlanError)(advice)


def _tilings(mlp: bool | None, layers: bool | None, seq: int, shape: ModelShape) -> list[tuple[bool, bool]]:
    """The (tiled MLP, tiled layers) pairs to try, lightest first: each tiling only where the plans without it do
    not fit, and only past one tile's tokens. A tiled layer tiles its MLP with it."""
    if seq <= MLP_TILE_TOKENS:
        return [(bool(mlp), bool(layers))]
    mlps = [False, True] if mlp is None else [mlp]
    if layers is None:
        return [(m, False) for m in mlps] + ([(True, True)] if shape.tileable else [])
    return [(True, True)] if layers else [(m, False) for m in mlps]


def _candidates(layers: int, layer_swap, activation_offload, offload_gradients, *, clip: bool, accum: int,
                lora: bool, gpu_fits: list):
    """The switches to try, fastest first: every layer resident (no swap traffic), then as many resident layers as
    fit; at each, activations and gradients on the GPU before offloaded (a switch given is not searched; where
    gradients go is `settings.gradients_offloaded`, as the optimizer will place them)."""
    acts = [False, True] if activation_offload is None else [activation_offload]
    asked = [False, True] if offload_gradients is None else [offload_gradients]
    if layer_swap is False:
        residents = [layers]
    elif layer_swap is None or layer_swap is True:
        residents = range(layers, -1, -1)
    else:
        residents = [min(int(layer_swap), layers)]
    for resident in residents:
        grads = dict.fromkeys(not lora and gradients_offloaded(
            og, asked=offload_gradients, clips=clip, accumulation=accum, swapped_trainable=resident < layers)
            for og in asked)  # (in order, once each)
        for act in acts:
            for og in grads:
                yield dict(offload_gradients=og, activation_offload=act, resident=resident)
        if resident < layers and any(gpu_fits):
            return  # fewer resident layers only need more host RAM


def _embedding_state_bytes(shape: ModelShape) -> int:
    """The input embedding's 8-bit states: the first tensor `device_states` keeps on the GPU."""
    return STATE_BYTES_PER_VALUE * shape.vocab * shape.hidden


def _with_device_states(p: Plan, est, shape: ModelShape, n: int, gpu_usable: float, gpu_gb: float) -> Plan:
    """`device_states: auto`: the input embedding's states on the GPU, when the plan leaves room for them (and their
    gradient, when gradients would wait on the host) within the GPU budget less `DEVICE_STATE_MARGIN_GIB`; then the
    next tensors' in model order, as many as leave max(`DEVICE_STATE_FILL_MARGIN_GIB`, `DEVICE_STATE_FILL_FRACTION` of
    the budget) free (all of them for a 3B model on 24 GiB: no PCIe traffic at all) -- with one process, and only
    where the plan needs neither activation offload nor layer swap to fit (a tight plan gets no extras). Backward
    reaches the embedding last, so its states' copies would follow backward's last kernel (3B with its tied
    embedding at 4 x 2048 on the H200: ~16 ms of a 0.54 s step)."""
    want = _embedding_state_bytes(shape)
    e2 = est(device_states=want)
    if e2["reserved"] > gpu_usable - DEVICE_STATE_MARGIN_GIB * GiB:
        return p
    # then the next tensors' (in model order), as many as leave the wider fill margin free
    limit = gpu_usable - max(DEVICE_STATE_FILL_MARGIN_GIB, DEVICE_STATE_FILL_FRACTION * gpu_gb) * GiB
    every = STATE_BYTES_PER_VALUE * n
    more = _most_states(lambda b: est(device_states=b)["reserved"] <= limit, want, every)
    scope = "all" if more >= every else "first" if more > want else "embedding"
    if more > want:
        want, e2 = more, est(device_states=more)
    return dataclasses.replace(p, device_state_gib=want / GiB, **_predicted(e2), device_states_scope=scope)


def _embedding_for_activations(p: Plan, est, shape: ModelShape, gpu_usable: float, host_usable: float) -> Plan:
    """`device_states: auto` where the plan has no room for the input embedding's states: its layer inputs offloaded
    to pinned memory instead (`est` has activation offload on) make the room, taken when the step that saves (its
    states' copies after backward, `estimate._first_unit_kept`) is predicted faster than the one it has. Only the
    embedding's: a tight plan gets no more (8B at 4 x 2048 on a 24 GiB card: 1.0 GiB of states for 2.0 GiB of
    activations moved off the GPU; +1.3-1.5% tok/s measured without clipping, s50b, s66a, s66b, s66c). Also with
    speculative clipping (`p` its plan), whose weights' backups cross PCIe beside the activations': +0.8% (s68a),
    once the backups were paced over forward and backward (all in the forward, they made the step 3.8% slower, s66c,
    s68a). Not with exact clipping, not measured."""
    want = _embedding_state_bytes(shape)
    e = est(device_states=want)
    if e["reserved"] > gpu_usable - DEVICE_STATE_MARGIN_GIB * GiB or e["host"] > host_usable or e["step"] >= p.step_s:
        return p
    alt = dataclasses.replace(p, activation_offload=True, device_state_gib=want / GiB, device_states_scope="embedding",
                              **_predicted(e))
    alt.notes = [*p.notes, f"activation offload: the layer inputs in pinned memory leave the GPU room for the input "
                           f"embedding's 8-bit states, whose copies after backward the next forward would wait for "
                           f"({e['step']:.3f} s a step predicted, {p.step_s:.3f} s without)"]
    return alt


def _with_speculation(p: Plan, est, host_usable: float, host_gb: float | None, speculative: bool | None) -> Plan:
    """Speculative clipping where it pays: updates during backward, a step that clips rolled back and redone. It
    needs streamed states (nothing to wait for otherwise) and host memory for a second bank of states and the backups
    (in the spare buffer, which gradient sums between micro-batches leave as each is read); taken
    when its step (one that does not clip) is faster than exact clipping's, and with data parallel only when asked.
    `speculative=True` insists (an error naming why it cannot run), False never takes it."""
    if speculative is False:
        return p
    why_not = None
    if p.ranks > 1 and not speculative:
        why_not = ("data parallel: speculative clipping over several ranks is verified on the CPU (gloo) only, not yet "
                   "measured on GPUs; speculative_clipping: true takes it")
    elif p.device_states_scope == "all":
        why_not = "every 8-bit state is on the GPU: no update waits for PCIe, exact clipping is as fast"
    e = est(speculative=True) if why_not is None else None
    if e is not None and e["host"] > host_usable:
        why_not = (f"speculative clipping needs {e['host'] / GiB:.1f} GiB of host memory (a second bank of 8-bit states "
                   f"and the weights' backups), the host budget is {host_gb:.1f} GiB"
                   + (f" ({p.host_budget_source})" if p.host_budget_source else ""))
    if why_not is not None:
        if speculative:
            raise PlanError(f"speculative_clipping: true cannot run: {why_not}. Set speculative_clipping: false "
                            f"(exact clipping)" + (" or add host memory" if e is not None else ""))
        p.notes.append(f"exact clipping: {why_not}")
        return p
    more_host = (e["host"] - p.host_peak_gib * GiB) / GiB
    if not speculative and e["step"] >= p.step_s:
        p.notes.append(f"exact clipping: its step ({p.step_s:.2f} s) is as fast as speculative clipping's "
                       f"({e['step']:.2f} s) here: few states wait for PCIe after backward")
        return p
    if not speculative and e["step"] > (1 - SPECULATION_GAIN) * p.step_s:
        p.notes.append(f"exact clipping: speculative clipping's step ({e['step']:.2f} s) would be "
                       f"{1 - e['step'] / p.step_s:.1%} shorter than its ({p.step_s:.2f} s), under the "
                       f"{SPECULATION_GAIN:.0%} worth {more_host:.1f} GiB more host memory (speculative_clipping: true "
                       f"takes it)")
        return p
    chosen = dataclasses.replace(p, speculative_clipping=True, exact_step_s=p.step_s, **_predicted(e))
    if not speculative:  # (chosen, not asked for: say why)
        chosen.notes.append(f"speculative clipping: its step ({e['step']:.2f} s, the clip not firing) is faster than "
                            f"exact clipping's ({p.step_s:.2f} s: after backward the next forward waits for the "
                            f"updates), for {more_host:.1f} GiB more host memory")
    return chosen


def _notes(p: Plan, e: dict, shape: ModelShape, weight_bytes: int) -> list[str]:
    """What the chosen plan costs that its figures do not say, and what would be faster."""
    notes = []
    swapped = p.resident_layers < p.layers
    swapped_clip = swapped and p.clip and not p.lora_params and not p.speculative_clipping
    if p.clip and p.offload_gradients and not swapped_clip and not p.speculative_clipping:
        notes.append("exact clipping with offloaded gradients moves 4 bytes/param after backward; "
                     "max_grad_norm: 0 updates during backward instead (faster, no clipping)")
    if p.accum > 1 and p.offload_gradients:
        notes.append("gradient accumulation sums gradients in pinned CPU memory: 4 bytes/param of "
                     "PCIe traffic per micro-batch; fewer, larger micro-batches move less")
    if e["cpu_bound"]:
        notes.append("small micro-batch: the CPU queuing the step's kernels and chunk updates ({:.2f} s) takes "
                     "longer than the GPU's work ({:.2f} s), so the CPU sets the pace -- and CPU-bound steps "
                     "vary between machines (3B at 1 x 2048 on H200 machines: 0.32-0.54 s measured, 0.30 s "
                     "predicted). Larger micro-batches hide it".format(*e["cpu_bound"]))
    if shape.experts and swapped:
        notes.append(f"each swapped MoE layer holds all {shape.experts} experts "
                     f"({weight_bytes * shape.layer_params / GiB:.2f} GiB), fetched for its forward and again "
                     f"for its backward although each token uses {shape.experts_per_token} of them: swapping "
                     f"moves {shape.experts / shape.experts_per_token:.0f}x the weights a dense layer of the "
                     f"same compute would")
    if swapped_clip:
        notes.append("with layers swapped and exact clipping, the forward after backward waits for "
                     "each layer's gradient and 8-bit states and each swapped layer's weights to "
                     "cross PCIe; max_grad_norm: 0 updates during backward instead (faster, no "
                     "clipping)")
    return notes


# see `plan`: layer_swap auto's first count leaves this free, before the fit measures it (the 8B working set was
# predicted 2 GiB under at 64k tokens without tiles: OOM)
AUTO_SWAP_START_MARGIN_GIB = 0.5
AUTO_SWAP_START_WORKING_SHARE = 0.25
DEVICE_STATE_MARGIN_GIB = 0.25  # of the GPU budget left free when "auto" keeps the embedding's states on the GPU
# ... and when it keeps more (the next tensors' states): the larger of these, since the planner's GPU peak was measured
# up to 3.3% under (8B at 1 x 8192 on 24 GiB) on plans without activation offload
DEVICE_STATE_FILL_MARGIN_GIB = 1.0
DEVICE_STATE_FILL_FRACTION = 0.05


def _most_states(fits, low: float, high: float) -> float:
    """The most bytes of states in [low, high] for which `fits(bytes)` (monotonic), to 1 MiB; `low` if none more."""
    if fits(high):
        return high
    if not fits(low):
        return low
    while high - low > 2**20:
        mid = (low + high) / 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def _predicted(e: dict) -> dict:
    """The Plan fields an `_estimate` gives."""
    return dict(gpu_peak_gib=e["reserved"] / GiB, gpu_allocated_gib=e["allocated"] / GiB, host_peak_gib=e["host"] / GiB,
                pinned_gib=e["pinned"] / GiB, pcie_gb_per_step=e["pcie"] / 1e9, step_s=e["step"],
                native_step_s=e["native"], breakdown=e["breakdown"], host_breakdown=e["host_breakdown"])
