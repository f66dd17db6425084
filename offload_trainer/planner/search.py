"""The planner's search: the fastest configuration that fits the budgets -- every layer resident first, then as many
as fit; gradient and activation offload only where needed; the 8-bit states the budget has room for kept on the GPU
-- and, when none fits, the advice that says which knob to change and by how much."""
from __future__ import annotations

import dataclasses

from ..engine.sizes import STATE_BYTES_PER_VALUE
from ..settings import MLP_TILE_TOKENS, OffloadSettings, gradients_offloaded
from .estimate import Choice, Step, estimate
from .advice import refusal
from .inputs import Budget, RunShape
from .shape import GiB, HostPlanError, ModelShape, PlanError
from .table import Plan

# Speculative clipping takes a second bank of 8-bit states and the weights' backups in host memory (2 GiB per 1B
# parameters more than exact clipping): taken only where its step is predicted this much faster -- more than the
# model's error on the step (within 3% of the measured 8B steps), and 8B at 32k (0.5% predicted, 1.0% measured)
# keeps its host peak
SPECULATION_GAIN = 0.02


def plan(shape: RunShape, settings: OffloadSettings, budget: Budget, suggest: bool = True) -> Plan:
    """The fastest configuration for the run's `settings` that fits the `budget` (a switch left None is the
    planner's to choose). The public keyword form, `offload_trainer.plan`, is an adapter over this (keywords.py).

    `settings.fold`: with accumulation, how many of a step's micro-batches run as one (the Trainer's loop hands them
    one by one; trainer/fold.py concatenates them): 1 runs each as it comes; None takes the divisor j of the
    accumulation whose plan (micro-batches of `batch * j`, `accumulation / j` per step: the same samples per step) is
    predicted fastest within the budgets. One micro-batch of the step's samples moves no gradient sums over PCIe, and
    may clip speculatively; a larger micro-batch needs more GPU memory. The Plan's `batch` and `accum` are the
    micro-batches as run, `fold` the j. Where none fits, the error is that of the micro-batches as given (fold 1), or
    of the fold asked for, and (`suggest`) it ends with every key of `ALTERNATIVES` that makes the run fit on its own,
    with the plan it gives."""
    s = settings
    accum, fold = s.accumulation, s.fold
    if fold is not None and (fold < 1 or accum % fold):
        raise PlanError(f"fold_accumulation={fold} must divide gradient_accumulation_steps={accum}")
    best, first_error = None, None
    for j in [fold] if fold is not None else [j for j in range(1, accum + 1) if accum % j == 0]:
        try:
            p = _plan_micro_batch(shape, dataclasses.replace(s, batch=s.batch * j, accumulation=accum // j, fold=1),
                                  budget)
        except PlanError as e:
            first_error = first_error or e
            continue
        p.fold = j
        if best is None or p.step_s <= best.step_s:  # (a tie goes to the larger micro-batch: fewer host copies)
            best = p
    if best is None:
        fits = _fits_with(shape, s, budget) if suggest else []
        if fits:
            raise type(first_error)(f"{first_error} Each of these fits as the only change: {'; '.join(fits)}.")
        raise first_error
    if best.fold > 1:
        best.notes.insert(0, f"gradient accumulation: {best.fold} micro-batches of {s.batch} x {shape.seq} run as one "
                             f"of {best.batch} x {shape.seq} ({best.accum} per optimizer step): the same samples, "
                             f"loss and update, {'no gradient sums' if best.accum == 1 else 'fewer gradient sums'} "
                             f"over PCIe")
    return best


# settings a refusal tries one at a time (the field, the value that asks for it, the key as a config writes it); a
# value the run already has is skipped
ALTERNATIVES = (("max_grad_norm", 0.0, "max_grad_norm: 0"), ("layer_swap", None, "layer_swap: auto"),
                ("activation_offload", True, "activation_offload: true"), ("tiled_layers", None, "tiled_layers: true"))


def _fits_with(shape: RunShape, settings: OffloadSettings, budget: Budget) -> list[str]:
    """Each key of ALTERNATIVES that makes a refused run fit on its own, with its plan's figures."""
    found = []
    for key, value, text in ALTERNATIVES:
        now = getattr(settings, key)
        if now == value or (key == "activation_offload" and now is None) or (key == "max_grad_norm" and not now):
            continue  # (activation_offload None: the planner tried it already)
        try:
            p = plan(shape, dataclasses.replace(settings, **{key: value}), budget, suggest=False)
        except ValueError:  # (PlanError, or a combination the planner refuses)
            continue
        found.append(f"{text} ({p.gpu_peak_gib:.1f} GiB GPU, {p.host_peak_gib:.1f} GiB host, {p.step_s:.2f} s a "
                     f"step)")
    return found


def _plan_micro_batch(shape: RunShape, settings: OffloadSettings, budget: Budget) -> Plan:
    """The fastest configuration that fits the budgets for micro-batches of `settings.batch` x `shape.seq` tokens,
    `settings.accumulation` per step (their gradients wait between micro-batches, on the GPU or with
    `offload_gradients` in pinned memory).

    `layer_swap`: False keeps every decoder layer on the GPU; None swaps as few as the GPU budget needs; an int keeps
    that many resident. `device_states`: GiB of 8-bit states kept on the GPU (`StreamedAdamW8bit(device_state_bytes=)`),
    or "auto" (with a GPU budget): see `_with_device_states`. `speculative_clipping` (with clipping): None takes it
    where it is faster and the host budget has room (`_with_speculation`); True insists; False clips exactly.
    `tiled_mlp`: each MLP in tiles (engine/tiled_mlp.py); None takes it only where no plan fits without it.
    `tiled_layers`: each decoder layer but its attention in tiles (models/tiled_layers.py, its MLP included); None
    takes it only where no plan fits with tiled MLPs, and for the layers it knows (`ModelShape.tileable`).
    `fused_update`: False is torchao's compiled update, else the optimizer's Triton update (its default on CUDA).

    Raises PlanError, naming the knob to change, when none fits; HostPlanError when plans fit the GPU but not the
    host, naming the machine they need.
    """
    s, model, machine = settings, shape.model, budget.machine
    batch, seq, n = s.batch, shape.seq, shape.n
    lora, clip = shape.lora_params, s.clips
    gpu_gb, host_gb = budget.gpu_gb, budget.host_gb
    fixed_states = 0.0 if s.device_states == "auto" or lora else float(s.device_states or 0) * GiB
    step = Step(shape, clip=clip, loss_chunk=s.loss_chunk_size, chunk_numel=s.chunk_numel, inflight=s.inflight_chunks,
                machine=machine, accum=s.accumulation, ranks=budget.ranks, node_ranks=budget.ranks_here,
                fused_update=s.fused_update is not False, workers=s.data_workers)
    base = dict(params=n, batch=batch, seq=seq, clip=clip, lora_params=lora, rates_of=machine.name,
                accum=s.accumulation, ranks=budget.ranks, gpu_budget_gib=gpu_gb, host_budget_gib=host_gb,
                layers=model.layers, device_state_gib=fixed_states / GiB, save_shard_gib=shape.save_shard_bytes / GiB,
                host_budget_source=budget.host_source)
    gpu_usable, host_usable = budget.gpu_usable, budget.host_usable
    layer_swap = s.layer_swap

    # layer_swap auto starts with a margin below the budget: its first steps measure the peak and move layers onto
    # the GPU while it leaves room (engine/fit.py); a count predicted to just fit would be run before it is measured.
    # The margin grows with what the prediction is least sure of, the step's working set (long sequences)
    def swap_usable(e) -> float:
        if layer_swap is not None:
            return gpu_usable
        return gpu_usable - AUTO_SWAP_START_MARGIN_GIB * GiB - AUTO_SWAP_START_WORKING_SHARE * e["working"]
    tried, gpu_fits, usables = [], [], []  # every plan tried; whether each fit the GPU; the GPU bytes it was given
    for switches in (dict(c, tiled=mlp, tiled_layers=layers) for mlp, layers in _tilings(
            s.tiled_mlp, s.tiled_layers, seq, model) for c in _candidates(
            model.layers, layer_swap, s.activation_offload, s.offload_gradients, clip=clip, accum=s.accumulation,
            lora=bool(lora), gpu_fits=gpu_fits)):
        choice = Choice(batch=batch, seq=seq, device_states=fixed_states, **switches)
        e = estimate(step, choice)
        p = Plan(offload_gradients=switches["offload_gradients"], activation_offload=switches["activation_offload"],
                 resident_layers=switches["resident"], tiled_mlp=switches["tiled"],
                 tiled_layers=switches["tiled_layers"], **base, **_predicted(e))
        # (none resident: no fewer to start from, so the plan that fits the budget itself runs and is measured)
        usable = gpu_usable if switches["resident"] in (model.layers, 0) else swap_usable(e)
        gpu_fits.append(e["reserved"] <= usable)
        usables.append(usable)
        p.fits = gpu_fits[-1] and e["host"] <= host_usable
        tried.append(p)
        with_acts = None
        if p.fits and s.device_states == "auto" and gpu_gb and budget.ranks == 1 and not (
                lora or switches["activation_offload"] or switches["resident"] < model.layers):
            tried[-1] = p = _with_device_states(p, step, choice, gpu_usable, gpu_gb)
            if not p.device_states_scope and s.activation_offload is None:
                with_acts = dataclasses.replace(choice, activation_offload=True)
            if with_acts is not None and not clip:
                tried[-1] = p = _embedding_for_activations(p, step, with_acts, gpu_usable, host_usable)
        if p.fits:
            if clip and not lora:
                p = _with_speculation(p, step, dataclasses.replace(choice, device_states=p.device_state_gib * GiB),
                                      host_usable, host_gb, s.speculative_clipping)
                if with_acts is not None and p.speculative_clipping:
                    p = _embedding_for_activations(p, step, dataclasses.replace(with_acts, speculative=True),
                                                   gpu_usable, host_usable)
            p.notes += _notes(p, e, model, shape.weight_bytes)
            return p
    advice = refusal(list(zip(tried, usables)), step, Choice(batch=batch, seq=seq, device_states=fixed_states), budget)
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


def _with_device_states(p: Plan, step: Step, choice: Choice, gpu_usable: float, gpu_gb: float) -> Plan:
    """`device_states: auto`: the input embedding's states on the GPU, when the plan leaves room for them (and their
    gradient, when gradients would wait on the host) within the GPU budget less `DEVICE_STATE_MARGIN_GIB`; then the
    next tensors' in model order, as many as leave max(`DEVICE_STATE_FILL_MARGIN_GIB`, `DEVICE_STATE_FILL_FRACTION` of
    the budget) free (all of them for a 3B model on 24 GiB: no PCIe traffic at all) -- with one process, and only
    where the plan needs neither activation offload nor layer swap to fit (a tight plan gets no extras). Backward
    reaches the embedding last, so its states' copies would follow backward's last kernel (3B with its tied
    embedding at 4 x 2048 on the H200: ~16 ms of a 0.54 s step)."""
    def est(states):
        return estimate(step, dataclasses.replace(choice, device_states=states))

    want = _embedding_state_bytes(step.shape)
    e2 = est(want)
    if e2["reserved"] > gpu_usable - DEVICE_STATE_MARGIN_GIB * GiB:
        return p
    # then the next tensors' (in model order), as many as leave the wider fill margin free
    limit = gpu_usable - max(DEVICE_STATE_FILL_MARGIN_GIB, DEVICE_STATE_FILL_FRACTION * gpu_gb) * GiB
    every = STATE_BYTES_PER_VALUE * step.params
    more = _most_states(lambda b: est(b)["reserved"] <= limit, want, every)
    scope = "all" if more >= every else "first" if more > want else "embedding"
    if more > want:
        want, e2 = more, est(more)
    return dataclasses.replace(p, device_state_gib=want / GiB, **_predicted(e2), device_states_scope=scope)


def _embedding_for_activations(p: Plan, step: Step, choice: Choice, gpu_usable: float, host_usable: float) -> Plan:
    """`device_states: auto` where the plan has no room for the input embedding's states: its layer inputs offloaded
    to pinned memory instead (`choice` has activation offload on) make the room, taken when the step that saves (its
    states' copies after backward, `estimate._first_unit_kept`) is predicted faster than the one it has. Only the
    embedding's: a tight plan gets no more (8B at 4 x 2048 on a 24 GiB card: 1.0 GiB of states for 2.0 GiB of
    activations moved off the GPU; +1.3-1.5% tok/s measured without clipping, s50b, s66a, s66b, s66c). Also with
    speculative clipping (`p` its plan), whose weights' backups cross PCIe beside the activations': +0.8% (s68a),
    once the backups were paced over forward and backward (all in the forward, they made the step 3.8% slower, s66c,
    s68a). Not with exact clipping, not measured."""
    want = _embedding_state_bytes(step.shape)
    e = estimate(step, dataclasses.replace(choice, device_states=want))
    if e["reserved"] > gpu_usable - DEVICE_STATE_MARGIN_GIB * GiB or e["host"] > host_usable or e["step"] >= p.step_s:
        return p
    alt = dataclasses.replace(p, activation_offload=True, device_state_gib=want / GiB, device_states_scope="embedding",
                              **_predicted(e))
    alt.notes = [*p.notes, f"activation offload: the layer inputs in pinned memory leave the GPU room for the input "
                           f"embedding's 8-bit states, whose copies after backward the next forward would wait for "
                           f"({e['step']:.3f} s a step predicted, {p.step_s:.3f} s without)"]
    return alt


def _with_speculation(p: Plan, step: Step, choice: Choice, host_usable: float, host_gb: float | None,
                      speculative: bool | None) -> Plan:
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
    e = estimate(step, dataclasses.replace(choice, speculative=True)) if why_not is None else None
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
    """The Plan fields an `estimate` gives."""
    return dict(gpu_peak_gib=e["reserved"] / GiB, gpu_allocated_gib=e["allocated"] / GiB, host_peak_gib=e["host"] / GiB,
                pinned_gib=e["pinned"] / GiB, pcie_gb_per_step=e["pcie"] / 1e9, step_s=e["step"],
                native_step_s=e["native"], breakdown=e["breakdown"], host_breakdown=e["host_breakdown"])
