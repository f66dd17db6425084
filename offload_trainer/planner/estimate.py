"""The planner's model of one training step, phase by phase: what the weights take, the GPU's peak (what the step
holds plus its largest transient), the host's pinned buffers, the PCIe traffic, and the step time. Each phase reads
the step's inputs from a shared namespace and adds what it computes; `estimate` returns the figures a Plan holds.
Sizes in bytes, times in seconds; constants calibrated on the H200 runs in bench/results (see `Machine`)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

from ..engine.sizes import STATE_BYTES_PER_VALUE
from ..settings import MLP_TILE_TOKENS
from .inputs import RunShape
from .shape import GiB, Machine, ModelShape

# the allocator's slack past the MLP's intermediates: a base and whole-sequence hidden tensors (see `_gpu_phase`);
# tiled layers leave fewer of those tensors to be freed and made again at other sizes
SLACK_BASE_GIB, SLACK_HIDDEN_TENSORS, SLACK_HIDDEN_TENSORS_TILED_LAYERS = 2.87, 6.35, 2.75


@dataclass(frozen=True)
class Step:
    """What the search holds fixed for one micro-batch shape: what trains (`run`: the model, LoRA / QLoRA, the
    weights' bytes, a save's shard), the optimizer's streaming, the launch. `clip`: max_grad_norm > 0. `accum`:
    micro-batches per optimizer step. Data parallel over `ranks` processes (`node_ranks` of them on this host): each
    holds 1/ranks of the states; GPU figures are per process, host figures per node. The 8-bit states are 2 bytes
    per value whatever the model's dtype. `workers`: the data loader's worker processes (each process's)."""

    run: RunShape
    clip: bool
    loss_chunk: int
    chunk_numel: int
    inflight: int
    machine: Machine
    accum: int = 1
    ranks: int = 1
    node_ranks: int = 1
    fused_update: bool = True
    workers: int = 0
    swap_slots: int = 3
    block: int = 256

    @property
    def params(self) -> int:
        return self.run.n

    @property
    def shape(self) -> ModelShape:
        return self.run.model

    @property
    def wb(self) -> int:
        return self.run.weight_bytes


@dataclass(frozen=True)
class Choice:
    """What the search tries for a micro-batch of `batch` x `seq` tokens: where gradients wait
    (`offload_gradients`), the layer inputs (`activation_offload`), how many decoder layers stay on the GPU
    (`resident`, None: all), `tiled`: each MLP in tiles of `MLP_TILE_TOKENS` positions (engine/tiled_mlp.py),
    `tiled_layers`: each decoder layer but its attention so (models/tiled_layers.py), `speculative` (with clipping):
    speculative clipping, on the steps whose clip does not fire (a redone step runs its micro-batches twice; the GPU
    must also hold exact clipping's step, which it falls back to), `device_states`: bytes of 8-bit states kept on the
    GPU (their tensors' gradients are never offloaded either)."""

    batch: int
    seq: int
    offload_gradients: bool = False
    activation_offload: bool = False
    resident: int | None = None
    tiled: bool = False
    tiled_layers: bool = False
    speculative: bool = False
    device_states: float = 0


def estimate(step: Step, choice: Choice) -> dict:
    """Memory of one micro-batch; traffic and time of one optimizer step of `step.accum` micro-batches."""
    s, c, r = step, choice, step.run
    L = r.model.layers
    x = SimpleNamespace(shape=r.model, params=r.n, batch=c.batch, seq=c.seq, clip=s.clip, og=c.offload_gradients,
                        act=c.activation_offload, loss_chunk=s.loss_chunk, chunk_numel=s.chunk_numel,
                        inflight=s.inflight, m=s.machine, swap_slots=s.swap_slots, lora=r.lora_params,
                        weight_bits=r.weight_bits, block=s.block, accum=s.accum, ranks=s.ranks,
                        node_ranks=s.node_ranks, fused_update=s.fused_update, device_states=c.device_states,
                        save_shard=r.save_shard_bytes, wb=r.weight_bytes, T=c.batch * c.seq,
                        swapped=L - (L if c.resident is None else c.resident),
                        spec=c.speculative and s.clip and not r.lora_params, tiled=c.tiled or c.tiled_layers,
                        tiled_layers=c.tiled_layers, workers=s.workers)
    _weights(x)
    _gpu_held(x)
    _gpu_phase(x)
    _host(x)
    _traffic(x)
    _time(x)
    return dict(reserved=x.reserved, allocated=x.allocated, host=x.host, pinned=x.pinned, pcie=x.h2d + x.d2h,
                host_breakdown={k: v / GiB for k, v in x.host_parts.items()},
                working=x.phase - x.checkpoints - x.grads_kept,
                step=x.step, native=x.t_native, cpu_bound=x.cpu_bound,
                breakdown={"weights": x.weights / GiB, "swap slots": x.swap_gpu / GiB,
                           **({"LoRA adapters + AdamW": x.adapters / GiB} if x.lora else {}),
                           "optimizer slots": (x.slots + x.update_temps) / GiB,
                           **({"optimizer states on the GPU": x.device_states / GiB} if x.device_states else {}),
                           **_peak_parts(x.phase, x.start, x.checkpoints, x.grads_kept, throughout=x.accum > 1),
                           "allocator slack": x.slack / GiB})


def _weights(x) -> None:
    """The weights on the GPU: all but the swapped layers (in NF4 under 4-bit), and the swapped layers' reused slots."""
    s, h, L, wb = x.shape, x.shape.hidden, x.shape.layers, x.wb
    if x.weight_bits == 4:  # NF4 linears: half a byte per value + absmax (1 byte per 64, double-quantized); bf16 norms
        x.layer_bytes = (s.layer_params - 2 * h) * (0.5 + 1 / 64) + 2 * h * wb
    else:
        x.layer_bytes = wb * s.layer_params
    # reused GPU slots of the swapped layers: a pool per kind of layer (Mllama: self- and cross-attention)
    pools = 2 if s.cross_layers and x.swapped > s.cross_layers else 1
    x.swap_gpu = min(x.swap_slots, x.swapped) * x.layer_bytes * pools
    vision_bytes = s.vision_linear * ((0.5 + 1 / 64) if x.weight_bits == 4 else wb)
    # (resident layers counted at the largest layer's size: an MoE model's dense layers are over-counted)
    x.weights = wb * (x.params - s.layers_params - s.vision_linear) + (L - x.swapped) * x.layer_bytes + vision_bytes


def _gpu_held(x) -> None:
    """What the step holds on the GPU besides the weights: streamed-optimizer slots, LoRA's adapters, checkpoints."""
    s, wb = x.shape, x.wb
    x.largest = s.vocab * s.hidden
    x.chunk = min(x.chunk_numel, x.largest)
    x.all_states = STATE_BYTES_PER_VALUE * x.params / x.ranks  # this process's share of the 8-bit states
    streamed_any = x.device_states < x.all_states  # (all on the GPU: no slots either)
    x.slots = (x.inflight * x.chunk * (2 + 8 / x.block + (wb if x.og else 0))
               if not x.lora and streamed_any else 0)
    # torchao's compiled update materialises both fp32 moments of a chunk; the fused kernel keeps them in registers
    x.update_temps = 2 * 4 * x.chunk if not (x.lora or x.fused_update) else 0
    x.adapters = 16 * x.lora  # LoRA: fp32 weights, gradients and two AdamW moments, all on the GPU
    x.ckpt_per_layer = x.T * s.hidden * wb
    x.checkpoints = (2 if x.act else s.layers) * x.ckpt_per_layer  # offloaded: the one in use + one prefetched
    if s.vision_layers and not x.lora:  # a trained vision tower: each encoder layer's input (checkpointed,
        # trainer/seams.py), and the image states every cross-attention layer reads, live until the tower's backward
        x.checkpoints += x.batch * s.cross_tokens * (s.vision_layers * s.vision_hidden + s.hidden) * wb


def _gpu_phase(x) -> None:
    """The peak of backward: its start (the loss chunk and head gradient) or its middle (one layer's recompute and
    gradients), with the gradients that must wait kept; then the allocator's slack."""
    s, T, wb = x.shape, x.T, x.wb
    h, inter = s.hidden, s.intermediate
    loss = (x.loss_chunk if x.loss_chunk else T) * s.vocab * 10 + 2 * T * h * wb  # fp32 logits + grad, bf16; hidden
    head_grad = wb * x.largest if not x.lora else 0
    # one layer's recompute activations and their grads; tiled, the MLP's intermediates are one tile's, and the MLP's
    # weight gradients are summed over the tiles in float32
    x.mlp_T = min(T, x.batch * MLP_TILE_TOKENS) if x.tiled else T
    # (tiled: the MLP's input, output, their gradients and the tiles' input gradient are whole-sequence tensors too,
    # 5 more: measured 8B at 64k tokens, 2.6 GiB over the untiled count)
    if x.tiled_layers:
        # whole-sequence tensors left: the input, q/k/v, the attention's output and their gradients, and attention's
        # backward workspace; the two tiles' intermediates; every weight's gradient summed over the tiles in float32.
        # The tiles' share fitted to a two-layer 8B stack's backward peak at 64k and 128k tokens (3.5 and 8.5 GiB
        # under the tiled MLP's); the whole-sequence count to the 8B run at 128k (15.84 GiB allocated; bench/results)
        layer_ws = (6 * T * h + 12 * x.mlp_T * inter) * wb + (4 * s.layer_params if not x.lora else 0)
    else:
        layer_ws = ((15 if x.tiled else 10) * T * h + 6 * x.mlp_T * inter) * wb + (
            4 * 3 * h * inter if x.tiled and not x.lora else 0)
    if x.weight_bits == 4:
        layer_ws += 2 * h * inter  # the largest weight, dequantized for its matmul
    if s.cross_layers:
        # the (heads x tokens x image tokens) attention scores of a cross-attention layer, about one bf16 copy live
        # at its recompute + backward (measured over the first steps at two resident counts each: 90B-Vision QLoRA
        # 1 x 2048 and 11B-Vision full 2 x 2048, the frozen tower run without autograd)
        layer_ws += s.heads * T * s.cross_tokens * wb
    layer_grads = wb * s.layer_params if not x.lora else 0
    x.grads_wait = x.clip or x.accum > 1  # gradients outlive their backward: until the norm, or the next micro-batch
    _gradients_kept(x)
    if x.grads_kept and x.accum > 1:
        # the sums of earlier micro-batches are live through each later micro-batch's backward
        x.start = x.phase = x.grads_kept + x.checkpoints + max(loss + head_grad, layer_ws)
    elif x.grads_kept:
        # gradients pile up while checkpoints are freed: the peak is at the start or at the end of backward
        x.start = x.checkpoints + loss + head_grad
        x.phase = max(x.start, x.grads_kept + layer_ws)
    else:  # updates lag backward by about a layer
        x.start = x.phase = x.checkpoints + max(loss + head_grad, layer_ws + 2 * layer_grads)
        if x.grads_wait and x.og and x.device_grads:
            # the gradients of tensors whose states stay on the GPU stay there too, until the step: with one
            # micro-batch, made at the end of backward (the embedding's first), when the checkpoints are gone; when
            # accumulating, their sums stay through every later micro-batch's peak
            x.grads_kept = x.device_grads
            if x.accum > 1:
                x.start = x.phase = x.start + x.device_grads
            else:
                x.phase = max(x.phase, x.grads_kept + layer_ws + 2 * layer_grads)
    x.allocated = x.weights + x.swap_gpu + x.slots + x.update_temps + x.adapters + x.device_states + x.phase
    # allocator blocks freed between layers but not reused across sizes: up to ~16k tokens as many as the MLP's
    # intermediates, then growing more slowly, with the whole-sequence hidden tensors (tiling the MLP leaves those as
    # large). Fitted to 8B's reserved less allocated peaks, measured where the allocator never gave memory back:
    # 3.6 GiB at 16k tokens, 4.4-4.8 at 32k, 6.0 at 64k (tiled; 2 resident layers); with tiled layers, 5.7 at 128k
    hidden_tensors = SLACK_HIDDEN_TENSORS_TILED_LAYERS if x.tiled_layers else SLACK_HIDDEN_TENSORS
    x.slack = min(9 * T * inter * wb, SLACK_BASE_GIB * GiB + hidden_tensors * T * h * wb)
    x.reserved = x.allocated + x.slack


def _gradients_kept(x) -> None:
    """Gradients on the GPU until the norm or the next micro-batch (none when they wait on the host, or with LoRA)."""
    wb = x.wb
    x.grads_kept = wb * x.params if x.grads_wait and not x.og and not x.lora else 0
    if x.ranks > 1 and x.grads_kept:  # data parallel: once reduced, each owner keeps its share (micro-batches before
        # the last sum on each device, unless offload_gradients reduces each one and sums the means on the host)
        x.grads_kept = wb * x.params if x.accum > 1 else wb * x.params / x.ranks
    x.device_grads = x.device_states / STATE_BYTES_PER_VALUE * wb  # the gradients of the tensors whose states stay


def _host(x) -> None:
    """Pinned host memory: the streamed states, host gradients, offloaded activations and swapped layers (per node);
    the host peak adds each process's base RSS, the data loader's workers and a save's shard, or is the layers' load,
    where that is higher. `host_parts` is the peak's breakdown (bytes), which sums to it."""
    x.states = x.all_states - x.device_states if not x.lora else 0  # this process's, streamed
    x.host_grads = x.wb * x.params / x.ranks - x.device_grads if x.og and not x.lora else 0
    # speculative clipping: a second bank of states, and the weights' backups in the spare buffer (host gradients')
    x.backups = x.wb * x.params / x.ranks - x.device_grads if x.spec else 0
    x.host_acts = x.shape.layers * x.ckpt_per_layer if x.act else 0
    spare = max(x.host_grads, x.backups)
    n = x.node_ranks
    pinned = {"8-bit optimizer states (pinned)": n * x.states,
              "second bank of states (speculative clipping)": n * x.states if x.spec else 0,
              ("weights' backups (speculative clipping)" if x.backups >= x.host_grads
               else "gradients waiting (pinned)"): n * spare,
              "offloaded activations (pinned)": n * x.host_acts,
              "swapped layers (pinned)": n * x.swapped * x.layer_bytes}
    x.pinned = sum(pinned.values())
    base = {"Python, torch, CUDA context, the batch": n * x.m.host_base_gib * GiB}
    x.host_parts = {**base, "data loader workers": n * x.workers * x.m.worker_gib * GiB, **pinned,
                    "a save's shard": x.save_shard}  # (one process saves)
    if x.swapped:  # with layer swap every decoder layer is first made (or loaded) in CPU memory, one by one, and only
        # then pinned or moved to the GPU: a QLoRA run peaks there (70B: all 80 NF4 layers, 34.8 GiB measured)
        load = {**base, "every decoder layer, loaded before the swap places it": n * x.shape.layers * x.layer_bytes}
        if sum(load.values()) > sum(x.host_parts.values()):
            x.host_parts = load
    x.host_parts = {k: v for k, v in x.host_parts.items() if v}
    x.host = sum(x.host_parts.values())


def _traffic(x) -> None:
    """PCIe bytes of one step, each way."""
    # a swapped layer is fetched twice per micro-batch (forward, recompute + backward) and, changed, copied back
    # once per step (with clipping it is updated in the slot its next forward fetches it into)
    # (LoRA: frozen layers are never copied back)
    swap_h2d = 2 * x.accum * x.swapped * x.layer_bytes
    swap_d2h = x.swapped * x.layer_bytes if not x.lora else 0
    # host gradients: each micro-batch but the last adds into the host sum (H2D of the sum from the 2nd on, D2H);
    # the last reads it back; with clipping the total goes out once more and comes back for the update
    x.host_sums = x.accum > 1  # (data parallel: each owner sums the means of its share)
    # speculative clipping: no gradient waits for the norm; each streamed weight is backed up (D2H) once per step
    grad_moves = ((x.accum - 1 if x.host_sums else 0) + (1 if x.clip and not x.spec else 0)) * x.host_grads
    x.h2d = x.states + grad_moves + x.accum * x.host_acts + swap_h2d
    x.d2h = x.states + grad_moves + x.accum * x.host_acts + swap_d2h + x.backups


def _time(x) -> None:
    """The step's time: the GPU's work (model FLOPs at the measured rate), what of the PCIe traffic it cannot hide,
    and the CPU's launches where those set the pace."""
    s, m = x.shape, x.m
    active = x.params - (s.params - s.active_params)  # (an MoE token uses experts_per_token of the experts)
    # weights: forward + recompute + backward (input and weight gradients; LoRA: input gradients only)
    flops = (6 if x.lora else 8) * active * x.T + 8 * s.layers * x.T * x.seq * s.hidden  # + causal attention
    flops += 16 * s.cross_layers * x.T * s.cross_tokens * s.hidden  # + cross-attention to the image (fwd x2, bwd)
    # tiled MLP: each MLP's forward once more, in backward (not on one big GPU, which needs no tiles)
    if x.tiled_layers:  # (and the projections: the whole layer's linear weights once more)
        tiled_flops = 2 * (s.layer_params - 2 * s.hidden) * x.T * s.layers
    else:
        tiled_flops = 2 * 3 * s.hidden * s.intermediate * x.T * (s.layers - s.moe_layers) if x.tiled else 0
    slowdown = m.nf4_slowdown if x.weight_bits == 4 else 1.0
    x.t_native = x.accum * flops / m.train_flops * slowdown + (16 * x.params / 4.0e12 if not x.lora else 0.0)  # AdamW:
    # ~16 B/param at ~4 TB/s
    x.t_micro = t_micro = (flops + tiled_flops) / m.train_flops * slowdown
    t_compute = x.accum * t_micro
    per_layer = [fan_in * fan_out for fan_in, fan_out in s.linear_shapes().values()]
    x.n_chunks = s.layers * (2 + sum(math.ceil(n / x.chunk) for n in per_layer)) + 2 * math.ceil(x.largest / x.chunk)
    # Launching chunk updates from Python competes with launching the step's own kernels; measured: hidden
    # on 8B at 8k tokens (1 s steps), not on 3B at 4k (0.25 s steps).
    x.t_cpu = x.n_chunks * m.cpu_s_per_chunk * max(0.0, 1 - t_micro / 1.1) if not x.lora else 0.0
    x.t_beside = x.params / x.ranks * m.update_beside_s_per_param if not x.lora else 0.0
    if x.lora:
        step = t_compute
    elif x.clip and not x.spec:
        # the update waits for the global norm: after backward, states (and host gradients) cross PCIe -- and the
        # swapped layers, fetched for the forward that waits for their updates; only that forward (~1/4 of a
        # micro-batch) overlaps them (8B at 12 GiB, 26 of 32 layers swapped: 1.685 s measured, 1.649 s by this).
        # The forward cannot start before its first unit, the input embedding, is updated (`_exact_restart`).
        post = (x.states + x.host_grads + x.swapped * x.layer_bytes) / (m.h2d_gb_s * 1e9)
        step = t_compute + _exact_restart(x) + max(0.0, post - t_micro / 4) + x.t_cpu
    else:
        step = t_micro + x.t_beside + (x.accum - 1) * t_micro + x.t_cpu + _first_unit_kept(x)
    x.step = _with_copies(x, step)


def _first_unit_kept(x) -> float:
    """Updating during backward, the input embedding's gradient comes last; with its states streamed they cross PCIe
    after backward's last kernel, and the next forward, whose first unit it is, waits for them (8B at 4 x 2048: 19.5 ms
    a step, of which its update 7 ms, bench/results s66). The rates above were fitted on such steps, so the streamed
    wait is in them: what this returns is the (negative) time saved where those states stay on the GPU."""
    if x.lora or not _first_unit_on_gpu(x):
        return 0.0
    return x.largest * (x.m.update_alone_s_per_param - STATE_BYTES_PER_VALUE / (x.m.h2d_gb_s * 1e9))


def _first_unit_on_gpu(x) -> bool:
    """Whether the input embedding's states (the largest tensor's, at least) stay on the GPU."""
    return x.device_states >= STATE_BYTES_PER_VALUE * x.largest


def _exact_restart(x) -> float:
    """Exact clipping's pause between backward and the next forward: the host reads the norm, then the input
    embedding (the forward's first unit, and the last gradient of backward) has its states and gradient brought over
    PCIe and updated before the forward can use it -- unless its states stay on the GPU."""
    if _first_unit_on_gpu(x):  # (updated in place on the GPU, as native AdamW does)
        return 0.0
    first = (STATE_BYTES_PER_VALUE + (x.wb if x.og else 0)) * x.largest
    return x.m.exact_restart_s + first / (x.m.h2d_gb_s * 1e9)


def _with_copies(x, step: float) -> float:
    """The step time once host gradient sums, activation copies and the busier PCIe direction are counted, and the
    CPU's floor."""
    m, t_micro = x.m, x.t_micro
    if x.host_sums and x.host_grads:
        # Gradient sums in pinned memory: a micro-batch's sums cross PCIe (both ways at once) during its backward,
        # not its forward, so each micro-batch takes its forward plus the longer of its backward and its copies;
        # the last also streams the states (measured 8B, 4 x (1 x 2048) at 24 GiB: 2.08 s, 2.42 s with clipping)
        # With speculative clipping the last one's backward also backs the weights up (D2H), once each sum is read.
        t_f, t_b = t_micro / 4, t_micro * 3 / 4
        g, st = x.host_grads / (m.h2d_gb_s * 1e9), x.states / (m.h2d_gb_s * 1e9)
        step = (x.accum - 1) * (t_f + max(t_b, g)) + x.t_cpu
        if x.clip and not x.spec:
            step += t_f + max(t_b, g) + max(0.0, st + g - t_f)
        else:
            step += t_f + max(t_b + x.t_beside, g + st, (st + x.backups) / (m.d2h_gb_s * 1e9))
    if x.act:
        step += x.accum * max(0.0, x.host_acts / (m.d2h_gb_s * 1e9) - t_micro / 4)  # copies beyond overlap
    copies_s = max(x.h2d / (m.h2d_gb_s * 1e9), x.d2h / (m.d2h_gb_s * 1e9))  # the busier direction
    if x.swapped or (x.host_sums and x.host_grads) or x.spec:
        # the copy engines are busy for (states, host gradients, layers, activations, backups) each way: the step
        # is at least as long as the busier direction
        step = max(step, copies_s)
    # One thread queues every kernel of the step and, from backward's hooks, every chunk update: on small
    # micro-batches that, not the GPU, sets the pace (3B at 1 x 2048, natively too)
    cpu_floor = x.accum * x.shape.layers * m.cpu_s_per_layer + (x.n_chunks * m.cpu_s_per_chunk if not x.lora else 0.0)
    x.cpu_bound = (cpu_floor, step) if cpu_floor > step else None
    return max(step, cpu_floor)


def _peak_parts(phase: float, start: float, checkpoints: float, grads_kept: float, throughout: bool = False) -> dict:
    """What is live at the phase's peak (GiB): the peak of backward's start and middle (`start`: checkpoints, the loss
    and head gradient or a layer's work; kept gradients not made yet), or, when higher, its end (the kept gradients
    and a layer's work, the checkpoints freed). `throughout`: the kept gradients are live at the start too (sums
    of earlier micro-batches)."""
    if grads_kept and throughout and phase == start:
        return {"gradients kept": grads_kept / GiB, "checkpointed activations": checkpoints / GiB,
                "largest transient": (phase - grads_kept - checkpoints) / GiB}
    if grads_kept and phase > start:  # the end of backward
        return {"gradients kept": grads_kept / GiB, "checkpointed activations": 0.0,
                "largest transient": (phase - grads_kept) / GiB}
    return {"gradients kept": 0.0, "checkpointed activations": checkpoints / GiB,
            "largest transient": (phase - checkpoints) / GiB}
