"""StreamedAdamW8bit: AdamW whose 8-bit states live in pinned CPU memory and are streamed to the GPU.

Weights stay on the GPU. Each trainable tensor's two AdamW moments are kept on the host in torchao's
blockwise 8-bit format (`OptimState8bit`: uint8 codes + one fp32 scale per block). For the update, a
chunk of states is copied to a GPU staging slot (H2D stream), updated there (update stream) -- on CUDA by one
Triton kernel with torchao's arithmetic and codes (update_kernel.py), elsewhere by torchao's own update
(`adamw8bit_chunk`, compiled on CUDA with `fused=False`) -- and copied back (D2H stream). Slots form a
bounded pool: a chunk waits (on the GPU, never on the CPU) for its slot's previous copy-back, so GPU memory in
flight is fixed.

When the updates happen:
- `update_in_backward=True`: from post-accumulate-grad hooks, as each gradient is ready (no clipping
  possible: the global norm is not known yet). Each gradient is freed once its update has read it.
- `update_in_backward=False` (needed for clipping by global norm): gradients wait until `step()`;
  with `offload_gradients=True` they wait in pinned host memory (copied out during backward), so the
  full gradient set never sits on the GPU.
- Gradient accumulation (backward passes inside `no_update()`): with `offload_gradients=True` the running
  sum of each big tensor's gradient waits in the same pinned host buffer between micro-batches (each new
  gradient is added to it on the GPU, on the H2D stream, and copied back), so accumulating never keeps
  the gradient set on the GPU either -- whichever `update_in_backward` is. Without it, gradients
  accumulate on the device as usual. `clip_grad_norm_` then scales them exactly as
  `torch.nn.utils.clip_grad_norm_` would, and `step()` streams the updates in forward order; with
  `attach(model)` the next forward overlaps them, each layer waiting only for its own update: step() takes
  every update (gradient, learning rate, step count) but queues only the first layers', and each layer's forward
  queues the next ones (`LAUNCH_AHEAD`), so the CPU never blocks on full copy queues before that forward starts.
  Reading weights outside a forward therefore needs `synchronize()` first (the Trainer does it). With layer swap
  (swap.py) the same holds: a swapped layer is updated in the GPU slot its forward is fetched into, no further
  ahead than the swap engine prefetches (`set_residency(touch, ahead=...)`), so no layer is fetched only for its
  update.

Data parallel (`sharding=Sharding()`, distributed.py): each rank keeps and updates only the states of the
tensors it owns; gradients are averaged onto their owner as they are ready, and the owner broadcasts the
updated weights (ZeRO-1, with the states in each rank's pinned memory).

On CPU the same code runs with synchronous stand-ins for streams (see streams.py).
The state dict has torchao `AdamW8bit`'s layout (`step`, `exp_avg`, `exp_avg_sq`).
"""
from __future__ import annotations

import collections
import contextlib
import math
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torchao.optim.adam import single_param_adam
from torchao.optim.quant_utils import _fp32_to_bf16_sr, dequant_with_qmap, quantize_8bit_with_qmap, scale_tensor
from torchao.optim.subclass_8bit import OptimState8bit, get_qmap_signed, get_qmap_unsigned

from . import update_kernel
from .distributed import Sharding
from .streams import LaunchThread, StallMeter, Streams, pinned_empty

__all__ = ["StreamedAdamW8bit", "forward_units"]


# step()'s updates are queued as the next forward reaches each unit, this many units ahead of it.
LAUNCH_AHEAD = 2

# Inductor options for the update. None by default: bench/update_kernel.py measured int32 codes in the quantizer,
# no bounds asserts on the table lookups, multi-kernel reductions and autotuning within ~10% of the default kernel
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
    bench/update_kernel.py), so results are identical; but a compiled call over plain tensors skips the
    tensor-subclass dispatch, which cost ~1 ms of CPU per call and starved the GPU of backward kernels when called
    from gradient hooks.

    A 256-value block whose gradient holds a NaN or an infinity is left as it was (its weights, codes and
    scales): its new block scales come out non-finite, which is all the check reads (no extra pass over the
    gradient), and it is decided on the GPU, so updates queued during backward never wait for the CPU.
    (`guard=False` drops that check: torchao's own update, for bench/update_kernel.py to measure.)
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


def _always_resident(p: Tensor, stream):
    return contextlib.nullcontext()


def _grad_norm(g: Tensor) -> Tensor:
    """The per-tensor norm exactly as clip_grad_norm_ computes it (foreach kernel where the device has one)."""
    if g.device.type in ("cuda", "xpu"):
        return torch._foreach_norm([g], 2.0)[0]
    return torch.linalg.vector_norm(g, 2.0)


def forward_units(model: nn.Module) -> list[nn.Module]:
    """Modules in forward order whose parameters are updated (and waited for) together.

    Items of the largest `ModuleList` (the decoder layers) are units; so is every module that owns
    parameters directly (embeddings, norms, heads). Works for any HF causal LM and for plain models.
    """
    units: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        if isinstance(m, nn.ModuleList):
            units.extend(c for c in m if any(True for _ in c.parameters()))
            return
        children = [c for c in m.children() if any(True for _ in c.parameters())]
        if any(True for _ in m.parameters(recurse=False)) or not children:
            units.append(m)
            return
        for c in children:
            visit(c)

    visit(model)
    return units


@dataclass
class _Slot:
    """GPU staging for one chunk: both moments' codes and scales, and (optionally) its gradient."""

    codes: Tensor  # (2, chunk) uint8
    scales: Tensor  # (2, chunk // block) fp32
    grad_bytes: Tensor | None  # raw bytes for a chunk of gradient, viewed as its dtype
    free: object = None  # event: the last copy-back out of this slot is done
    views: dict = field(default_factory=dict)  # chunk length -> its views (`_slot_views`)


@dataclass
class _Update:
    """One tensor's update, taken at `step()` (or at its gradient hook): everything it reads that the caller may change
    before it is queued -- the gradient, the step count, the learning rate, the clip coefficient."""

    p: Tensor
    grad: Tensor | None  # on the device; None: its copy in pinned host memory
    grad_ready: object  # event: the gradient (device or host) is final
    step: Tensor
    args: tuple  # (lr, beta1, beta2, weight_decay, eps, stochastic rounding)
    coef: Tensor | None  # the clip coefficient, applied to a host gradient by its update
    hold: bool  # the gradient was just made (backward): count it against the backlog (`_hold`)
    rank: int = 0  # place of its unit in the launch order (`_launch_order`)


@dataclass
class _StepPlan:
    """Bookkeeping of one optimizer step (reset by `step()` / `zero_grad()`)."""

    norms: dict = field(default_factory=dict)  # param -> grad norm (0-dim tensor)
    sumsq: dict = field(default_factory=dict)  # param -> its gradient's squared norm, summed by the fused update
    host_grad_ready: dict = field(default_factory=dict)  # param -> event: grad copied to host
    merged: object = None  # event: the last host-accumulated sum was added into a device gradient (H2D stream)
    merged_params: set = field(default_factory=set)  # params whose gradient was made so, on the H2D stream
    updated: set = field(default_factory=set)  # params already updated in this backward
    reduced: list = field(default_factory=list)  # data parallel: params whose gradient was reduced, in order
    clip_coef: Tensor | None = None


def _as_float(value) -> float:
    """A hyperparameter as a Python number. A tensor here (a user's, or a state dict that went through accelerate's
    prepare(), which sends it to the GPU) is read once, so no update's launch reads a GPU tensor (a device sync per
    chunk, which serialized the CPU with the update stream)."""
    return float(value.detach().cpu()) if isinstance(value, Tensor) else float(value)


class StreamedAdamW8bit(torch.optim.Optimizer):
    """AdamW with 8-bit states in (pinned) CPU memory, updated on the weights' device.

    Args mirror torchao `AdamW8bit`; keyword-only flags choose how the update is streamed.
    `chunk_numel` elements are staged per copy; `inflight_chunks` slots bound GPU memory in flight.
    `fused`: update each streamed chunk with one Triton kernel (update_kernel.py: torchao's codes, about a fifth of
    the GPU time, one launch) instead of torchao's compiled update. Default: where Triton runs (CUDA). A dict
    passes options to `update_kernel.Update8bit` (e.g. `{"eager_numerics": False}`).
    `seed`: the Philox key of the fused kernel's stochastic rounding (default: `torch.initial_seed()`); its counter
    is the step and the value's place, so a resumed run with the same seed rounds exactly as an uninterrupted one.
    `compile`: compile the (unfused) update (default: on CUDA); a dict is passed to `torch.compile` as inductor
    options. Small tensors, whose states stay on the device, always take this update.
    `grad_backlog_bytes`: GPU bytes of gradients that may wait for their update or copy to the host before the
    CPU waits for the oldest (default: twice the largest tensor's gradient, at least 1 GiB).
    `launch_thread`: with `update_in_backward` (not with data parallel or layer swap), queue the copies and updates
    from a thread of their own, so that the thread running backward only hands gradients over. Off by default: on
    the H200 it removed the compute stream's waits for the CPU but left the step time within run-to-run noise (3B
    at 4 x 2048: 0.573 vs 0.580 s; the step is then bound by the GPU, where the updates share the SMs with
    backward; at 1 x 2048 backward's own launches, slowed by the shared GIL, bound it): not worth a second thread.
    `defer_updates`: with `attach()` (not with data parallel), `step()` queues only the first units' updates and each
    unit's forward queues the next (see above). False: `step()` queues every update itself, as before this existed
    (slower: its CPU blocks on full copy queues, and with layer swap it fetches layers for their updates alone); each
    layer's forward still waits only for its own, so reading weights outside a forward still needs `synchronize()`.
    `device_state_bytes`: GPU memory for 8-bit states kept on the device instead of streamed. The tensors whose
    states stay are the model's first (in model order once attached: the embeddings, then the first layers) that fit:
    backward reaches them last, so their copies could not overlap anything and would only lengthen the step (3B
    with tied embeddings: ~16 ms of copies after backward's last kernel). They behave like the small tensors: no
    host copy of their states, gradients never offloaded (clipped and accumulated on the device).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        block_size: int = 256,
        bf16_stochastic_round: bool = True,
        update_in_backward: bool = False,
        offload_gradients: bool = False,
        chunk_numel: int = 2**25,
        inflight_chunks: int = 4,
        compile: bool | dict | None = None,
        sharding: Sharding | None = None,
        grad_backlog_bytes: int | None = None,
        launch_thread: bool = False,
        fused: bool | dict | None = None,
        seed: int | None = None,
        device_state_bytes: int = 0,
        defer_updates: bool = True,
    ) -> None:
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid AdamW hyperparameters lr={lr}, betas={betas}, eps={eps}")
        if chunk_numel % block_size or chunk_numel < block_size:
            raise ValueError(f"chunk_numel={chunk_numel} must be a positive multiple of block_size={block_size}")
        if inflight_chunks < 2:
            raise ValueError("inflight_chunks must be >= 2 (one slot copying while another updates)")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.block_size = block_size
        self.bf16_stochastic_round = bf16_stochastic_round
        self.update_in_backward = update_in_backward
        self.offload_gradients = offload_gradients
        self.chunk_numel = chunk_numel
        self.grad_backlog_bytes = grad_backlog_bytes
        self.launch_thread = launch_thread
        self.device_state_bytes = int(device_state_bytes)
        self.defer_updates = defer_updates
        self._launch_ahead = LAUNCH_AHEAD  # units past the running one whose deferred updates its hook queues

        self._params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if not self._params:
            raise ValueError("no trainable parameters (all have requires_grad=False)")
        devices = {p.device for p in self._params}
        accel = {d for d in devices if d.type != "cpu"}
        if len(accel) > 1:
            raise ValueError(f"all trainable parameters must be on one device, found {sorted(map(str, devices))}")
        # Parameters on the host beside GPU ones are swapped layers (swap.py): updated where they are fetched to.
        self.device = accel.pop() if accel else torch.device("cpu")
        self._shard = sharding if sharding is not None and sharding.world_size > 1 else None
        self._owner = self._shard.owners(self._params) if self._shard is not None else {}
        self._streams = Streams(self.device, comm_streams=self._shard is not None)
        self._group_of = {p: g for g in self.param_groups for p in g["params"]}
        self._step_fn, self._chunk_fn = single_param_adam, adamw8bit_chunk
        if compile if compile is not None else self.device.type == "cuda":
            options = compile if isinstance(compile, dict) else None  # inductor options, e.g. {"cpp_wrapper": True}
            self._step_fn = compile_update(single_param_adam, options)
            self._chunk_fn = compile_update(adamw8bit_chunk, options)
        if fused is None:
            fused = update_kernel.available(self.device)
        elif fused and not update_kernel.runnable(self.device):
            raise ValueError(f"fused=True needs Triton and a CUDA device (have {self.device}); use fused=False")
        self._fused = None
        if fused:  # a dict: options of update_kernel.Update8bit
            self._fused = update_kernel.Update8bit(self.device, seed=torch.initial_seed() if seed is None else seed,
                                                   **(fused if isinstance(fused, dict) else {}))

        # Host states and GPU slots are allocated at first use, not here: accelerate's prepare() round-trips
        # an optimizer's state dict through the GPU, which must not see gigabytes of host states.
        self._inflight_chunks = inflight_chunks
        self._offset: dict[Tensor, int] = {}  # streamed tensor -> its place in the flat host buffers
        self._on_device: dict[Tensor, tuple] = {}  # tensor whose 8-bit states stay on the device -> (codes, scales)
        self._place: dict[Tensor, int] = {}  # 8-bit tensor -> its place among all 8-bit values (Philox counters)
        self._chunks: dict[Tensor, list] = {}  # param -> its chunks' host views (`_host_chunks`)
        self._allocated = False
        self._plan = _StepPlan()
        self._accumulating = False
        self._units: list[list[Tensor]] = []  # params of each unit, forward order
        self._unit_of: dict[Tensor, int] = {}
        self._unit_event: dict[int, object] = {}
        self._handles: list = []
        self._fired: set[int] = set()  # units whose forward ran with grad enabled since the last step()
        self._deferred: collections.deque[_Update] = collections.deque()  # step()'s updates not queued yet
        self._launch_rank: dict[int, int] = {}  # unit -> its place in the launch order of the deferred updates
        self._covered_by: dict[int, int] = {}  # unit whose forward never runs -> the unit whose wait covers it
        self._norm_order = self._params
        self._prev_d2h_done = None  # event: the last step's copy-backs finished (host states final)
        self._prev_h2d_done = None  # event: the last step's host gradients were read
        self._host_sum: dict[Tensor, object] = {}  # param -> event: its accumulated gradient landed on the host
        self._dev_sum: dict[Tensor, Tensor] = {}  # data parallel, small tensors: the owner's sum of earlier means
        self._held: collections.deque = collections.deque()  # (event, GPU gradient bytes freed when it has passed)
        self._held_bytes = 0
        self._residency = _always_resident
        self._launcher: LaunchThread | None = None  # started at the first update in backward, if asked for
        self._skip = False
        self.stall = StallMeter(self._streams)  # forward waiting for a layer's update
        self.stats = {"h2d_bytes": 0, "d2h_bytes": 0, "updates": 0}

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        # lr stays a Python float, as in torch's own optimizers (torchao keeps a tensor): schedulers, the Trainer's
        # logs and users read and copy it as a number. Each update takes a float32 tensor of it when it is taken
        # (`_take`), which is what the compiled update wants (no recompile when lr changes).
        group = self.param_groups[-1]
        group["lr"] = _as_float(group["lr"])

    # ------------------------------------------------------------------ setup
    def _owns(self, p: Tensor) -> bool:
        """Whether this rank keeps and updates `p`'s states (always, without data parallel)."""
        return self._shard is None or self._owner[p] == self._shard.rank

    def _is_8bit(self, p: Tensor) -> bool:
        # torchao's rule (after bitsandbytes): only tensors of >= 4096 values, divisible into blocks.
        return p.numel() >= 4096 and p.numel() % self.block_size == 0

    def _ensure_states(self) -> None:
        if not self._allocated:
            self._allocated = True
            self._init_states(pin=self.device.type == "cuda")
            self._init_slots(self._inflight_chunks)

    def _state_bytes(self, p: Tensor) -> int:
        """Bytes of `p`'s two 8-bit moments: a code per value and an fp32 scale per block, each."""
        return 2 * p.numel() + 2 * 4 * (p.numel() // self.block_size)

    def _init_states(self, *, pin: bool) -> None:
        big = [p for p in self._params if self._is_8bit(p) and self._owns(p)]
        self._total_8bit = sum(p.numel() for p in big)  # the fused update's Philox counter: step * total + place
        bs = self.block_size
        room, candidates = self.device_state_bytes, set(big)
        for p in self._norm_order:  # model order once attached: backward reaches the first tensors last
            if p in candidates and p.device == self.device and p not in self._on_device and \
                    self._state_bytes(p) <= room:
                room -= self._state_bytes(p)
                self._on_device[p] = ()
        big = [p for p in big if p not in self._on_device]  # streamed
        total = sum(p.numel() for p in big)
        # One flat host buffer per kind (exactly sized, pinned once): codes of both moments, their scales,
        # and, when offloading, the gradients.
        self._host_codes = pinned_empty(2 * total, torch.uint8, pin=pin).view(2, total)
        self._host_scales = pinned_empty(2 * total // bs, torch.float32, pin=pin).view(2, total // bs)
        self._host_codes.zero_()
        self._host_scales.zero_()
        grad_dtype = big[0].dtype if big else torch.float32
        if self.offload_gradients and any(p.dtype != grad_dtype for p in big):
            raise ValueError("offload_gradients needs all 8-bit-state parameters in one dtype")
        self._host_grads = pinned_empty(total, grad_dtype, pin=pin) if self.offload_gradients else None
        # GPU bytes of gradients allowed to wait for their update or copy (`_hold`): two of the largest tensor, >= 1 GiB
        self._held_limit = self.grad_backlog_bytes if self.grad_backlog_bytes is not None else max(
            2 * max((p.numel() * p.element_size() for p in big), default=0), 2**30)
        qmaps = [torch.tensor(get_qmap_signed()), torch.tensor(get_qmap_unsigned())]
        self._qmaps_dev = [q.to(self.device) for q in qmaps]
        off, dev_off = 0, total  # places: streamed tensors first (as in the host buffers), then those on the device
        for p in self._params:
            if not self._owns(p):
                continue
            st = self.state[p]
            st["step"] = torch.tensor(0.0)
            if p in self._on_device or self._is_8bit(p):
                n = p.numel()
                if p in self._on_device:
                    self._place[p], dev_off = dev_off, dev_off + n
                    codes = torch.zeros(2, n, dtype=torch.uint8, device=self.device)
                    scales = torch.zeros(2, n // bs, dtype=torch.float32, device=self.device)
                    self._on_device[p], maps = (codes, scales), self._qmaps_dev
                else:
                    self._offset[p] = self._place[p] = off
                    codes, scales = self._host_codes[:, off:off + n], self._host_scales[:, off // bs:(off + n) // bs]
                    maps, off = qmaps, off + n
                for k, (name, signed) in enumerate((("exp_avg", True), ("exp_avg_sq", False))):
                    st[name] = OptimState8bit(codes[k].view(p.shape), scales[k], maps[k], signed, dtype=p.dtype)
            else:  # small tensors (norms, biases): plain states on the device, as torchao keeps them
                st["exp_avg"] = torch.zeros(p.shape, dtype=p.dtype, device=self.device)
                st["exp_avg_sq"] = torch.zeros(p.shape, dtype=p.dtype, device=self.device)

    def _init_slots(self, n_slots: int) -> None:
        big = [p for p in self._params if p in self._offset]
        chunk = min(self.chunk_numel, max((p.numel() for p in big), default=self.block_size))
        gbytes = max((p.element_size() for p in big), default=4) * chunk if self.offload_gradients else 0
        self._slots = [
            _Slot(
                codes=torch.empty(2, chunk, dtype=torch.uint8, device=self.device),
                scales=torch.empty(2, chunk // self.block_size, dtype=torch.float32, device=self.device),
                grad_bytes=torch.empty(gbytes, dtype=torch.uint8, device=self.device) if gbytes else None,
            )
            for _ in range(n_slots if big else 0)
        ]
        self._slot_chunk = chunk
        self._next_slot = 0

    def attach(self, model: nn.Module, units: list[nn.Module] | None = None):
        """Hook the optimizer into `model`: updates/gradient offload during backward, and per-unit waits
        in forward so that a layer runs as soon as its own update is done. Returns a handle with remove()."""
        self.detach()
        units = units if units is not None else forward_units(model)
        seen: set = set()
        self._units = []
        for u in units:
            ps = [p for p in u.parameters() if p.requires_grad and p in self._group_of and p not in seen]
            seen.update(ps)
            self._units.append(ps)
        self._unit_of = {p: i for i, ps in enumerate(self._units) for p in ps}
        # clip_grad_norm_(model.parameters()) sums per-tensor norms in the model's order: so do we
        in_model = [p for p in model.parameters() if p.requires_grad and p in self._group_of]
        self._norm_order = in_model + [p for p in self._params if p not in set(in_model)]
        for i, u in enumerate(units):
            self._handles.append(u.register_forward_pre_hook(self._make_wait_hook(i)))
        for p in self._params:
            self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        return _Handle(self)

    def detach(self) -> None:
        self._drain()
        self._launch_deferred()
        for h in self._handles:
            h.remove()
        self._handles = []
        self._units, self._unit_of, self._unit_event = [], {}, {}
        self._norm_order = self._params

    def _make_wait_hook(self, unit: int):
        def hook(module, args):
            # The forward of this unit reads weights that the update stream may still be writing.
            self._drain()  # (a forward right after backward, without step(): its updates must be queued first)
            if torch.is_grad_enabled():
                self._fired.add(unit)
            self._launch_deferred(unit)
            self.stall.wait(self._streams.compute(), self._unit_event.get(unit))

        return hook

    @torch.no_grad()
    def sync_weights(self, src: int = 0) -> None:
        """Data parallel: make every rank's trainable weights rank `src`'s (as DistributedDataParallel does at
        construction). A no-op on one rank. Swapped layers' host copies go through a GPU buffer."""
        if self._shard is None:
            return
        for p in self._params:
            t = p.detach()
            staged = t.to(self.device) if t.device != self.device else t
            self._shard.broadcast(staged, src).wait()
            if staged is not t:
                t.copy_(staged)
        if self._streams.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def set_residency(self, touch, ahead: int | None = None) -> None:
        """`touch(p, update_stream)`: a context manager around each update of `p`, which makes sure `p` is
        on the device while the update is queued (the layer-swap engine's `LayerSwap.touch`). `ahead`: queue
        deferred updates at most this many units past the running forward (`LayerSwap.prefetch`: a swapped layer is
        then updated in the slot its forward was prefetched into, never fetched for its update alone)."""
        self._residency = touch
        self._launch_ahead = LAUNCH_AHEAD if ahead is None else max(0, min(LAUNCH_AHEAD, ahead))

    def all_finite(self, t: Tensor) -> bool:
        """Whether `t` is finite on this rank and (data parallel) on every rank: a step is skipped everywhere or
        nowhere, so the ranks issue the same collectives. One device sync."""
        ok = bool(torch.isfinite(t).all())
        return ok if self._shard is None else self._shard.all_true(ok, self.device)

    def skip_next_step(self) -> None:
        """The next `step()` drops the gradients instead of updating (a non-finite loss or norm was seen)."""
        self._skip = True

    @contextlib.contextmanager
    def no_update(self):
        """Backward passes inside only accumulate gradients (all micro-batches but the last)."""
        prev, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = prev

    # ------------------------------------------------------------------ backward hooks
    @torch.no_grad()
    def _on_grad_ready(self, p: Tensor) -> None:
        if p.grad is None:
            return
        if self._deferred:  # a backward without a forward through every unit: the last step's updates go first
            self._launch_deferred()
        if self._accumulating:
            if self._shard is not None and self.offload_gradients:
                self._reduce_micro_batch(p)
            elif self._accumulates_on_host(p):
                self._stash_grad(p)
            return
        self._ensure_states()
        S = self._streams
        if self._launches_elsewhere():
            grad, ready = p.grad, S.record(S.compute())
            p.grad = None  # (held by the queued call until its update has been queued)
            self._launcher.submit(self._update_launched, p, grad, ready, nbytes=grad.numel() * grad.element_size())
            return
        if self._shard is not None:
            ready = self._reduce(p)
            if ready is None:  # another rank owns p: its new weights come from there
                if self.update_in_backward:
                    self._plan.updated.add(p)
                    self._publish(p)
                return
            ready = self._add_sums(p, ready)  # + earlier micro-batches' means, if accumulating
            self._measure_norm(p, S.reduced)
        else:
            ready = self._add_host_sum(p, S.record(S.compute()))  # + earlier micro-batches' sum, if on the host
            if not self._norm_in_update(p) and (self.update_in_backward or (
                    self.offload_gradients and p in self._offset)):
                self._measure_norm(p, S.compute())
        if self.update_in_backward:
            self._update_in_backward(p, ready)
        elif self.offload_gradients and p in self._offset:
            self._plan.host_grad_ready[p] = self._offload_grad(p, ready)

    def _launches_elsewhere(self) -> bool:
        """Whether updates in backward are queued from the launch thread (started here at first use)."""
        if self._launcher is not None:
            return True
        if not (self.launch_thread and self.update_in_backward and self._shard is None
                and self._residency is _always_resident):
            return False
        self._launcher = LaunchThread(self.device, self._held_limit)
        weakref.finalize(self, self._launcher.close)
        return True

    def _update_launched(self, p: Tensor, grad: Tensor, grad_ready) -> None:
        """On the launch thread: what `_on_grad_ready` does for an update in backward, the gradient handed over.
        Streams are per thread: every wait here is on an event, and the norm is measured on the update stream."""
        S = self._streams
        p.grad = grad
        ready = self._add_host_sum(p, grad_ready)
        S.update.wait_event(ready)
        if not self._norm_in_update(p):
            self._measure_norm(p, S.update)
        self._update_in_backward(p, ready)

    def _update_in_backward(self, p: Tensor, ready) -> None:
        """Queue `p`'s update once `ready` (its gradient final) and mark it done for this step and its unit."""
        self._update_param(p, ready)
        self._plan.updated.add(p)
        self._publish(p)

    def _drain(self) -> None:
        """Wait until the launch thread has queued every update handed to it (not until they ran)."""
        if self._launcher is not None:
            self._launcher.drain()

    def _norm_in_update(self, p: Tensor) -> bool:
        """Whether `p`'s gradient norm (for logging: no clipping in backward) is summed by the fused update kernel
        on its pass over the gradient, instead of by a norm kernel on the compute stream."""
        return self._fused is not None and self.update_in_backward and self._shard is None and p in self._place

    def _measure_norm(self, p: Tensor, stream) -> None:
        """Queue `p.grad`'s norm on the stream that made the gradient (`stream`, or the H2D stream where a host sum
        was added: then `merged` moves past the norm, so the compute stream's wait covers it)."""
        S = self._streams
        merged = p in self._plan.merged_params
        with S.on(S.h2d if merged else stream):
            self._plan.norms[p] = _grad_norm(p.grad)
        if merged:
            self._plan.merged = S.record(S.h2d)

    # ------------------------------------------------------------------ gradient accumulation on the host
    def _accumulates_on_host(self, p: Tensor) -> bool:
        if not self.offload_gradients or self._shard is not None:
            return False
        self._ensure_states()
        return p in self._offset

    def _reduce_micro_batch(self, p: Tensor) -> None:
        """Data parallel, a micro-batch before the last (with `offload_gradients`): average `p.grad` onto its owner
        now, as ZeRO-2 does, so that no rank keeps a gradient set between micro-batches; the owner adds the mean to
        its running sum (pinned host memory for big tensors, the device for small ones). The sum of the means is
        the mean of the sums, associated differently (equal to rounding)."""
        self._ensure_states()
        ready = self._reduce(p, final=False)
        if ready is None:  # not ours: dropped
            return
        if p in self._offset:
            self._stash_grad(p, ready)
            return
        S, grad = self._streams, p.grad
        with S.on(S.reduced):
            prev = self._dev_sum.get(p)
            self._dev_sum[p] = grad if prev is None else prev.add_(grad)
        S.keep_alive(grad, S.reduced)
        p.grad = None

    def _add_sums(self, p: Tensor, ready):
        """The owner's gradient after its last reduction: + the sum of earlier micro-batches' means, if any."""
        if p in self._offset:
            return self._add_host_sum(p, ready)
        prev = self._dev_sum.pop(p, None)
        if prev is None:
            return ready
        S = self._streams
        with S.on(S.reduced):
            p.grad = prev.add_(p.grad)  # (on the stream where both were made)
        return S.record(S.reduced)

    def _stash_grad(self, p: Tensor, grad_ready=None) -> None:
        """A micro-batch before the last: add `p.grad` to its running sum in pinned host memory, free it."""
        S = self._streams
        held = p.grad.numel() * p.grad.element_size() * (2 if p in self._host_sum else 1)  # + the sum's H2D copy
        ready = self._add_host_sum(p, grad_ready if grad_ready is not None else S.record(S.compute()))
        self._host_sum[p] = self._offload_grad(p, ready, held)

    def _hold(self, done, nbytes: int) -> None:
        """Back-pressure: `nbytes` of gradients stay allocated on the GPU until the event `done` (their update or
        copy to the host has read them). When backward makes gradients faster than PCIe drains them, the CPU waits
        for the oldest to pass once more than `_held_limit` bytes wait -- the other streams keep going -- instead
        of the allocator hitting the memory cap, where it synchronizes the whole device and serializes the step."""
        while self._held and self._held[0][0].query():
            self._held_bytes -= self._held.popleft()[1]
        self._held.append((done, nbytes))
        self._held_bytes += nbytes
        while self._held_bytes > self._held_limit:
            event, n = self._held.popleft()
            event.synchronize()
            self._held_bytes -= n

    def _add_host_sum(self, p: Tensor, grad_ready):
        """If earlier micro-batches left a sum of `p`'s gradients on the host, `p.grad` becomes that sum plus
        `p.grad`, computed on the H2D stream (the compute stream never waits for it). Returns the event after
        which `p.grad` is final. The addition is autograd's own (old + new, in the gradient's dtype): the
        same bits as accumulating on the device."""
        host_ready = self._host_sum.pop(p, None)
        if host_ready is None:
            return grad_ready
        S, grad = self._streams, p.grad
        total = self._host_sum_to_device(p, host_ready)
        S.h2d.wait_event(grad_ready)
        with S.on(S.h2d):
            total.add_(grad)
        S.keep_alive(grad, S.h2d)
        p.grad = total
        self._plan.merged_params.add(p)
        self._plan.merged = S.record(S.h2d)
        return self._plan.merged

    def _host_sum_to_device(self, p: Tensor, host_ready) -> Tensor:
        """A new device tensor holding `p`'s gradient sum from the host, copied on the H2D stream once `host_ready`
        (its last copy out) has passed. The compute stream may scale it in place later (clipping)."""
        S, off, n = self._streams, self._offset[p], p.numel()
        S.h2d.wait_event(host_ready)
        with S.on(S.h2d):
            total = torch.empty(p.shape, dtype=self._host_grads.dtype, device=self.device)
            total.view(-1).copy_(self._host_grads[off:off + n], non_blocking=True)
        S.keep_alive(total, S.compute())
        self.stats["h2d_bytes"] += n * total.element_size()
        return total

    def _flush_host_sums(self) -> None:
        """After backward: a tensor that got no gradient in the last micro-batch still has its sum on the host.
        Bring it back as its gradient (the compute stream waits for every host sum added this step)."""
        S = self._streams
        for p, host_ready in list(self._host_sum.items()):
            self._host_sum.pop(p)
            p.grad = self._host_sum_to_device(p, host_ready)
            self._plan.merged = S.record(S.h2d)
        if self._plan.merged is not None:
            S.compute().wait_event(self._plan.merged)

    def _reduce(self, p: Tensor, final: bool = True):
        """Queue the mean over ranks of `p.grad` onto `p`'s owner. On the owner: returns the event after which
        `p.grad` holds it; elsewhere the gradient is dropped and None returned. `final`: the step's last reduction
        of `p` (recorded for the updates and the norm)."""
        S, grad, owner = self._streams, p.grad, self._owner[p]
        work = self._shard.reduce_mean(grad, owner)  # NCCL starts after the compute stream's work so far
        if final:
            self._plan.reduced.append(p)
        with S.on(S.reduced):
            work.wait()  # the stream waits, not the CPU (gloo: the CPU waits)
            S.keep_alive(grad, S.reduced)  # not reused by the allocator before the reduction has read it
        if owner != self._shard.rank:
            p.grad = None
            return None
        return S.record(S.reduced)

    def _publish(self, p: Tensor) -> None:
        """`p`'s update is queued: with data parallel, broadcast it from its owner (every rank calls this for every
        reduced tensor, in the same order); then mark its unit's next forward ready.

        The broadcast waits for the owner's update stream, and on a non-owner for the compute stream as it is now
        (at the gradient hook, or in `step()` after backward): kernels of this backward that still read `p` (e.g.
        the input gradient of its layer) are queued before it, so they read the old weights."""
        S = self._streams
        if self._shard is None:
            self._record_unit_done(p, S.update)
            return
        with self._residency(p, S.published):  # a swapped layer: receive into (or send from) its GPU slot
            S.published.wait_stream(S.update if self._owns(p) else S.compute())
            with S.on(S.published):
                self._shard.broadcast(p.detach(), self._owner[p]).wait()
        self._record_unit_done(p, S.published)

    def _offload_grad(self, p: Tensor, grad_ready, held: int | None = None):
        """Queue the copy of `p.grad` into its slice of the pinned host buffer; frees it. Returns the event.
        `held`: GPU bytes that wait for the copy (default: the gradient's)."""
        S = self._streams
        S.d2h.wait_event(grad_ready)
        if self._prev_h2d_done is not None:  # the host buffer still holds last step's grads until read
            S.d2h.wait_event(self._prev_h2d_done)
            self._prev_h2d_done = None
        off, n = self._offset[p], p.numel()
        with S.on(S.d2h):
            self._host_grads[off:off + n].copy_(p.grad.view(-1), non_blocking=True)
        S.keep_alive(p.grad, S.d2h)
        nbytes = n * p.grad.element_size()
        self.stats["d2h_bytes"] += nbytes
        p.grad = None
        landed = S.record(S.d2h)
        self._hold(landed, nbytes if held is None else held)
        return landed

    def _record_unit_done(self, p: Tensor, stream) -> None:
        unit = self._unit_of.get(p)
        if unit is not None:  # one stream per mode (update, or published with data parallel): the last covers all
            self._unit_event[unit] = event = self._streams.record(stream)
            cover = self._covered_by.get(unit)
            if cover is not None:  # its forward never runs: the wait of the last unit that does covers it, even
                self._unit_event[cover] = event  # where that unit's own update was queued earlier (by step())

    # ------------------------------------------------------------------ the update
    def _update_param(self, p: Tensor, grad_ready) -> None:
        """Queue the update of one tensor now (from backward); the gradient is `p.grad` (device) or its host copy."""
        self._launch(self._take(p, grad_ready, hold=True))

    def _take(self, p: Tensor, grad_ready, *, hold: bool) -> _Update:
        """`p`'s update as of now: its step counted, learning rate and gradient taken (`p.grad` becomes None)."""
        group, st = self._group_of[p], self.state[p]
        st["step"] += 1
        step = st["step"].clone()  # read when each kernel launches; never mutated afterwards
        if isinstance(group["lr"], Tensor):  # put there by a user or a scheduler: read once, kept a number
            group["lr"] = _as_float(group["lr"])
        lr = torch.tensor(group["lr"], dtype=torch.float32)  # as step: fixed now, float32 as torchao rounds it
        sr = self.bf16_stochastic_round and p.dtype is torch.bfloat16
        args = (lr, group["betas"][0], group["betas"][1], group["weight_decay"], group["eps"], sr)
        grad, p.grad = p.grad, None
        return _Update(p, grad, grad_ready, step, args, self._plan.clip_coef if grad is None else None, hold)

    def _launch(self, u: _Update) -> None:
        """Queue the copies and the update of a taken update (`_publish` then marks its unit's next forward ready)."""
        with self._residency(u.p, self._streams.update):
            self._queue_update(u)

    def _queue_update(self, u: _Update) -> None:
        S, p, grad, step, args = self._streams, u.p, u.grad, u.step, u.args
        st = self.state[p]
        on_host = grad is None
        if grad is not None:
            S.update.wait_event(u.grad_ready)
            S.keep_alive(grad, S.update)
        self.stats["updates"] += 1
        if p not in self._place:
            with S.on(S.update):  # small tensors: states stay on the device, nothing to stream
                self._step_fn(p.detach(), grad, step, st["exp_avg"], st["exp_avg_sq"], None, *args[:5], True, args[5])
            return
        n = p.numel()
        flat_p = p.detach().view(-1)
        flat_g = None if on_host else grad.view(-1)
        sumsq = None
        if not on_host and self._norm_in_update(p):  # (in backward the gradient is always on the device)
            with S.on(S.update):
                sumsq = self._plan.sumsq[p] = torch.zeros((), dtype=torch.float32, device=self.device)
            S.keep_alive(sumsq, S.compute())  # read there by clip_grad_norm_
        if p in self._on_device:  # states on the device: one update over the whole tensor, nothing to copy
            self._update_on_device(p, flat_p, flat_g, step, args, sumsq)
        else:
            for chunk in self._host_chunks(p):
                self._update_chunk(chunk, flat_p, flat_g, u.grad_ready if on_host else None, step, args, sumsq, u.coef)
        if not on_host and u.hold:  # the gradient is freed once the update read it
            self._hold(S.record(S.update), n * grad.element_size())

    def _update_on_device(self, p: Tensor, flat_p: Tensor, flat_g: Tensor, step, args, sumsq) -> None:
        """The update of a tensor whose states stay on the device (`device_state_bytes`), on the update stream."""
        S, (codes, scales), n = self._streams, self._on_device[p], p.numel()
        with S.on(S.update):
            if self._fused is not None:
                self._fused(flat_p, flat_g, codes, scales, *self._qmaps_dev, step, *args, sumsq=sumsq,
                            counter=int(step) * self._total_8bit + self._place[p])
                return
            bs, size = self.block_size, self.chunk_numel  # torchao's update makes fp32 moments: chunk by chunk
            for a in range(0, n, size):
                b = min(a + size, n)
                self._chunk_fn(flat_p[a:b], flat_g[a:b], codes[:, a:b], scales[:, a // bs:b // bs], *self._qmaps_dev,
                               step, *args)

    def _host_chunks(self, p: Tensor) -> list:
        """`p`'s chunks: (start, end, host code rows, host scale rows, host gradient, start in the flat host
        buffers) -- views made once, since indexing costs microseconds of CPU per call and the updates run from
        backward hooks."""
        chunks = self._chunks.get(p)
        if chunks is None:
            bs, off, n = self.block_size, self._offset[p], p.numel()
            codes, scales, grads = self._host_codes, self._host_scales, self._host_grads
            chunks = self._chunks[p] = []
            for s in range(0, n, self._slot_chunk):
                e = min(s + self._slot_chunk, n)
                a, b = off + s, off + e  # range in the flat host buffers
                rows = slice(a // bs, b // bs)
                chunks.append((s, e, (codes[0, a:b], codes[1, a:b]), (scales[0, rows], scales[1, rows]),
                               None if grads is None else grads[a:b], a))
        return chunks

    def _slot_views(self, slot: _Slot, n: int) -> tuple:
        """(codes, scales, code rows, scale rows, gradient) of `slot` for a chunk of `n` values (made once per n)."""
        views = slot.views.get(n)
        if views is None:
            codes, scales = slot.codes[:, :n], slot.scales[:, : n // self.block_size]
            g = None
            if slot.grad_bytes is not None:
                g = slot.grad_bytes[: n * self._host_grads.element_size()].view(self._host_grads.dtype)
            views = slot.views[n] = (codes, scales, (codes[0], codes[1]), (scales[0], scales[1]), g)
        return views

    def _update_chunk(self, chunk, flat_p, flat_g, host_grad_ready, step, args, sumsq=None, coef=None) -> None:
        S, bs = self._streams, self.block_size
        s, e, host_codes, host_scales, host_grad, flat_start = chunk
        n = e - s
        slot = self._slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % len(self._slots)
        # 1) H2D: the slot must be free (its last copy-back done), host states final (last step's
        #    copy-backs done), and a host gradient must have landed (its D2H done).
        if slot.free is not None:
            S.h2d.wait_event(slot.free)
        if self._prev_d2h_done is not None:
            S.h2d.wait_event(self._prev_d2h_done)
            self._prev_d2h_done = None
        if host_grad_ready is not None:
            S.h2d.wait_event(host_grad_ready)
        codes, scales, code_rows, scale_rows, g = self._slot_views(slot, n)
        with S.on(S.h2d):
            for k in range(2):  # row by row: a strided 2-D host copy would go through a pageable temporary
                code_rows[k].copy_(host_codes[k], non_blocking=True)
                scale_rows[k].copy_(host_scales[k], non_blocking=True)
            if flat_g is None:
                g.copy_(host_grad, non_blocking=True)
        loaded = S.record(S.h2d)
        self.stats["h2d_bytes"] += 2 * n + 8 * (n // bs) + (0 if flat_g is not None else g.numel() * g.element_size())
        # 2) the update, on its own stream so that backward / forward never wait for it
        S.update.wait_event(loaded)
        whole = s == 0 and e == flat_p.numel()
        with S.on(S.update):
            if flat_g is None:
                if coef is not None and self._fused is None:
                    g = g * coef  # bf16 * fp32 scalar -> bf16, as clip_grad_norm_ does in place
            else:
                g, coef = flat_g if whole else flat_g[s:e], None
            chunk_p = flat_p if whole else flat_p[s:e]
            if self._fused is not None:  # clipping's product inside the kernel; Philox counters unique per step
                self._fused(chunk_p, g, codes, scales, *self._qmaps_dev, step, *args, grad_scale=coef, sumsq=sumsq,
                            counter=int(step) * self._total_8bit + flat_start)
            else:
                self._chunk_fn(chunk_p, g, codes, scales, *self._qmaps_dev, step, *args)
        updated = S.record(S.update)
        # 3) D2H: the new states back to the host; the slot is free once this lands
        S.d2h.wait_event(updated)
        with S.on(S.d2h):
            for k in range(2):
                host_codes[k].copy_(code_rows[k], non_blocking=True)
                host_scales[k].copy_(scale_rows[k], non_blocking=True)
        slot.free = S.record(S.d2h)
        self.stats["d2h_bytes"] += 2 * n + 8 * (n // bs)

    # ------------------------------------------------------------------ clip / step
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Global-norm clipping with `torch.nn.utils.clip_grad_norm_`'s arithmetic, over gradients on the
        device and those waiting on the host. Call after backward, before `step()`. Returns the norm."""
        if norm_type != 2.0:
            raise ValueError("only the L2 norm (norm_type=2) is supported")
        self._drain()
        self._launch_deferred()
        if self._plan.updated and math.isfinite(max_norm):
            raise RuntimeError(
                "updates already ran during backward (update_in_backward=True), so gradients cannot be "
                "clipped any more. Construct with update_in_backward=False to clip by global norm, or set "
                "max_grad_norm to 0 / inf."
            )
        S = self._streams
        self._flush_host_sums()
        if self._shard is not None:
            S.compute().wait_stream(S.reduced)  # gradients reduced onto their owners, and their norms
        norms = {}
        roots = {}
        if self._plan.sumsq:  # summed by the fused updates (update stream)
            S.compute().wait_stream(S.update)
            roots = self._roots_of_sums()
        for p in self._norm_order:
            if p in self._plan.norms:
                norms[p] = self._plan.norms[p]
            elif p in roots:
                norms[p] = roots[p]
            elif p.grad is not None:
                norms[p] = _grad_norm(p.grad)
        on_device = [p for p in norms if p.grad is not None]  # clip_grads_with_norm_ takes parameters
        if self._shard is not None:
            norms = self._gather_norms(norms)
        if not norms:
            return torch.tensor(0.0, device=self.device)
        # clip_grad_norm_ stacks per-tensor norms grouped by gradient dtype, in parameter order
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for p, nrm in norms.items():
            by_dtype.setdefault(p.dtype, []).append(nrm)
        total = torch.linalg.vector_norm(torch.stack([n for ns in by_dtype.values() for n in ns]), 2.0)
        if math.isfinite(max_norm) and not self._plan.updated:
            torch.nn.utils.clip_grads_with_norm_(on_device, max_norm, total)
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            self._plan.clip_coef = coef.to(self.device)
            S.keep_alive(self._plan.clip_coef, S.update)  # read by the updates, freed with this step's plan
        return total

    def _roots_of_sums(self) -> dict:
        """Each tensor's gradient norm from the squared norm its fused update summed, in the gradient's dtype as the
        norm kernel gives it: sqrt then cast, for all of them at once (two small kernels per tensor cost ~2 ms of
        launches at every step's end, the GPU waiting)."""
        sums = [p for p in self._norm_order if p in self._plan.sumsq and p not in self._plan.norms]
        if not sums:
            return {}
        roots = torch.stack([self._plan.sumsq[p] for p in sums]).sqrt()
        out = {}
        for dtype in dict.fromkeys(p.dtype for p in sums):
            idx = [i for i, p in enumerate(sums) if p.dtype == dtype]
            cast = (roots if len(idx) == len(sums) else roots[idx]).to(dtype)
            out.update(zip((sums[i] for i in idx), cast.unbind()))
        return out

    def _gather_norms(self, own: dict) -> dict:
        """Every rank gets every reduced tensor's norm (each owner measured its own), in model order, so the
        global norm is computed from the same values in the same order as on one GPU: the same bits."""
        reduced = set(self._plan.reduced)
        ordered = [p for p in self._norm_order if p in reduced]
        if not ordered:
            return {}
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        vec = torch.stack([own[p].float() if p in own else zero for p in ordered])
        vec = self._shard.sum(vec)  # one value per tensor, the others' zeros: the sum is exact
        return {p: vec[i].to(own[p].dtype if p in own else p.dtype) for i, p in enumerate(ordered)}

    @torch.no_grad()
    def step(self, closure=None):
        """Update every tensor that still has a gradient (on the device or the host).

        With `attach()` (and `defer_updates`), returns without waiting: the updates are taken now and queued as the
        next forward reaches each layer, which waits for its own; `synchronize()` queues and finishes them all
        (before reading weights outside a forward). With data parallel or `defer_updates=False` they are all queued
        now, each layer's next forward waiting for its own. Without `attach()` (or when no layer's forward ran), they
        are all queued now and the compute stream waits for them before continuing.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._drain()
        self._launch_deferred()
        if self._skip:  # weights and states stay as they are; gradients (device or host) are dropped
            self._skip = False
            for p in self._params:
                p.grad = None
            self._plan = _StepPlan()
            self._host_sum.clear()
            self._dev_sum.clear()
            self._fired = set()
            return loss
        self._ensure_states()
        S = self._streams
        self._flush_host_sums()
        if self._shard is not None:
            S.compute().wait_stream(S.reduced)  # owners' gradients are reduced
        grads_final = S.record(S.compute())  # after backward and any in-place clipping
        if self._shard is not None:  # the same list, in the same order, on every rank
            pending = [p for p in self._plan.reduced if p not in self._plan.updated and (
                not self._owns(p) or p.grad is not None or p in self._plan.host_grad_ready)]
        else:
            pending = [p for p in self._params if p.grad is not None or p in self._plan.host_grad_ready]
        waited = bool(self._units) and bool(self._fired) and all(p in self._unit_of for p in self._params)
        if pending:
            # the clip coefficient and in-place clipped gradients come from the compute stream
            S.update.wait_event(grads_final)
            rank = self._launch_order()
            pending.sort(key=lambda p: rank.get(self._unit_of.get(p), len(rank)))
            if waited and self._shard is None and self.defer_updates:
                # Taken now, queued as the next forward reaches each unit (`_launch_deferred`): queuing them all
                # here would block the CPU once the copy streams' queues fill (8B: ~0.3 s per step), and the next
                # forward could not start beside them.
                for p in pending:
                    u = self._take(p, self._plan.host_grad_ready.get(p, grads_final), hold=False)
                    u.rank = rank[self._unit_of[p]]
                    if self._draws_random(u):  # queued now, so the global RNG is drawn at the same point as ever
                        self._launch(u)
                        self._publish(p)
                    else:
                        self._deferred.append(u)
                self._launch_rank = rank
                self._launch_deferred(min(rank, key=rank.get))  # the copies start now
            else:
                for p in pending:
                    if self._owns(p):
                        self._launch(self._take(p, self._plan.host_grad_ready.get(p, grads_final), hold=False))
                    self._publish(p)
        self._fired = set()
        self._finish_step(waited)
        return loss

    def _draws_random(self, u: _Update) -> bool:
        """Whether `u`'s update draws from the global RNG (stochastic rounding by torchao's update: small tensors, or
        every tensor without the fused kernel, whose Philox counters depend on the step and place only). Such
        updates are queued by step() itself: queued later, they would draw after the next step's own random numbers
        (data, dropout), and a run would round differently depending on where it synchronized (a checkpoint)."""
        return u.args[5] and (self._fused is None or u.p not in self._place)

    def _launch_order(self) -> dict[int, int]:
        """unit -> its place in the order step()'s updates are queued: forward order, except that units after the
        last one whose forward ran (with grad) go just before it -- their weights are read without their module
        being called (an LM head whose weight a chunked loss reads), so no wait of their own covers them: the wait
        for that last unit (the final norm) does, the update stream running in order."""
        n = len(self._units)
        self._covered_by = {}
        if not self._fired:
            return {u: u for u in range(n)}
        last = max(self._fired)
        self._covered_by = {u: last for u in range(last + 1, n)}
        order = [*range(last), *range(last + 1, n), last]
        return {u: i for i, u in enumerate(order)}

    def _launch_deferred(self, unit: int | None = None) -> None:
        """Queue step()'s taken updates through `unit` (in launch order) and `_launch_ahead` units more; all of them
        when None. Called by each unit's forward pre-hook, and before anything else touches gradients or states."""
        if not self._deferred:
            return
        limit = math.inf if unit is None else self._launch_rank.get(unit, math.inf) + self._launch_ahead
        while self._deferred and self._deferred[0].rank <= limit:
            u = self._deferred.popleft()
            self._launch(u)
            self._publish(u.p)  # (deferred only without data parallel: marks its unit, no broadcast)
        if not self._deferred:
            self._record_step_end()

    def _record_step_end(self) -> None:
        """Every update of the step is queued: the next step's copies wait for these (host states and gradients)."""
        S = self._streams
        self._prev_d2h_done = S.record(S.d2h)
        self._prev_h2d_done = S.record(S.h2d)

    def _finish_step(self, waited: bool = False) -> None:
        S = self._streams
        if not self._deferred:
            self._record_step_end()
        if not waited:
            # No per-layer waits cover these weights: the compute stream waits for every update.
            S.compute().wait_stream(S.update)
            if self._shard is not None:
                S.compute().wait_stream(S.published)
        self._plan = _StepPlan()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._drain()
        super().zero_grad(set_to_none)
        self._plan = _StepPlan()
        self._host_sum.clear()  # gradients accumulated on the host are dropped with the others
        self._dev_sum.clear()

    def synchronize(self) -> None:
        """Block until every queued copy and update is done (before reading weights or states on the host)."""
        self._drain()
        self._launch_deferred()
        S = self._streams
        if S.is_cuda:
            S.compute().wait_stream(S.update)
            if self._shard is not None:
                S.compute().wait_stream(S.published)
            S.synchronize()
            torch.cuda.current_stream(self.device).synchronize()

    # ------------------------------------------------------------------ state
    def state_dict(self):
        """torchao `AdamW8bit`'s layout, lr included: a 0-dim float32 tensor there (its step() refuses a number)."""
        self.synchronize()
        sd = super().state_dict()
        for g in sd["param_groups"]:  # (copies of our groups: ours keep their float)
            g["lr"] = torch.tensor(g["lr"], dtype=torch.float32)
        return sd

    def load_state_dict(self, state_dict) -> None:
        """Copy a saved state (ours or torchao AdamW8bit's) into the existing host buffers, in place."""
        self.synchronize()
        if state_dict["state"]:
            self._ensure_states()
        groups, saved = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved) or any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved)):
            raise ValueError("optimizer state does not match this model's parameter groups "
                             "(a checkpoint from a different model or different trainable parameters?)")
        idmap = {sid: p for g, s in zip(groups, saved) for sid, p in zip(s["params"], g["params"])}
        for sid, saved_st in state_dict["state"].items():
            p = idmap[sid]
            if not self._owns(p):  # data parallel: another rank's share (a merged or unsharded checkpoint)
                continue
            st = self.state[p]
            for key, val in saved_st.items():
                dst = st.get(key)
                if dst is None:
                    st[key] = val
                    continue
                if tuple(dst.shape) != tuple(val.shape):
                    raise ValueError(f"optimizer state {key!r} has shape {tuple(val.shape)} in the checkpoint "
                                     f"but {tuple(dst.shape)} here: the checkpoint is from a different model")
                if isinstance(dst, OptimState8bit) and isinstance(val, OptimState8bit):
                    dst.codes.copy_(val.codes)
                    dst.scale.copy_(val.scale)
                else:
                    dst.copy_(val)
        for g, s in zip(groups, saved):
            for key, val in s.items():
                if key == "params":
                    continue
                if isinstance(val, Tensor) and val.numel() == 1:  # torchao's lr tensor, or one moved by accelerate
                    val = _as_float(val)
                g[key] = val

    def memory_stats(self) -> dict[str, int]:
        if not self._allocated:
            return {"host_state_bytes": 0, "pinned_bytes": 0, "gpu_slot_bytes": 0, "gpu_state_bytes": 0}
        host = sum(t.numel() * t.element_size() for t in (self._host_codes, self._host_scales) if t is not None)
        host += self._host_grads.numel() * self._host_grads.element_size() if self._host_grads is not None else 0
        slots = sum(t.numel() * t.element_size() for s in self._slots
                    for t in (s.codes, s.scales, s.grad_bytes) if t is not None)
        on_device = sum(t.numel() * t.element_size() for ts in self._on_device.values() for t in ts)
        return {"host_state_bytes": host, "pinned_bytes": host if self._streams.is_cuda else 0,
                "gpu_slot_bytes": slots, "gpu_state_bytes": on_device}


class _Handle:
    def __init__(self, opt: StreamedAdamW8bit):
        self._opt = opt

    def remove(self) -> None:
        self._opt.detach()
