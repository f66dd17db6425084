"""StreamedAdamW8bit: AdamW whose 8-bit states live in pinned CPU memory and are streamed to the GPU.

The algorithm, as this class runs it (each step of it a collaborator in this package):
1. States (states.py): each trainable tensor's two AdamW moments in torchao's blockwise 8-bit format, in flat
   pinned host buffers -- or on the GPU for the first tensors that fit `device_state_bytes` (backward reaches them
   last, so their copies could overlap nothing).
2. Backward (`_on_grad_ready`, a post-accumulate-grad hook per tensor): with `update_in_backward` the tensor's update
   is queued at once (no clipping possible: the global norm is not known yet) and its gradient freed once read;
   otherwise, with `offload_gradients`, the gradient is copied to pinned host memory (grads.py) so the full set never
   sits on the GPU. Gradient accumulation (backward inside `no_update()`) sums each micro-batch into the host copy.
   Data parallel (sharded.py) first averages each gradient onto the rank that owns it.
3. `clip_grad_norm_`: the global norm with `torch.nn.utils.clip_grad_norm_`'s arithmetic, over device and host
   gradients; the coefficient is applied in place or by each update. With `speculative` the updates ran during
   backward already: a step that clips is rolled back and redone (speculation.py).
4. `step()`: takes every remaining update (gradient, lr, step count) and, when attached, queues only the first units'
   ones; each unit's next forward queues the next (schedule.py) and waits only for its own. An update (pipeline.py)
   copies a chunk of states to a GPU slot, updates it -- one Triton kernel on CUDA (kernel.py), torchao's arithmetic
   elsewhere (update.py) -- and copies it back, on side streams ordered by events only.
Reading weights outside a forward therefore needs `synchronize()` first (the Trainer does it). On CPU the same code
runs with synchronous stand-ins for streams (streams.py). The state dict has torchao `AdamW8bit`'s layout.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn
from torchao.optim.adam import single_param_adam

from ...settings import CHUNK_NUMEL, INFLIGHT_CHUNKS, INFLIGHT_CHUNKS_MIN
from ..distributed import Sharding
from ..streams import StallMeter, Streams
from . import kernel
from .clipping import GlobalNormClipping
from .grads import HostGradients
from .backward import BackwardUpdates
from .pipeline import Backlog, StepPlan, UpdatePipeline
from .state_io import StateDictIO
from .schedule import LAUNCH_AHEAD, Schedule
from .sharded import ShardedUpdates
from .speculation import ClipPolicy, Speculation
from .states import HostStates
from .update import adamw8bit_chunk, as_float, compile_update


def _always_resident(p: Tensor, stream):
    return contextlib.nullcontext()


class StreamedAdamW8bit(BackwardUpdates, GlobalNormClipping, StateDictIO, torch.optim.Optimizer):
    """AdamW with 8-bit states in (pinned) CPU memory, updated on the weights' device.

    Args mirror torchao `AdamW8bit`; keyword-only flags choose how the update is streamed.
    `chunk_numel` elements are staged per copy; `inflight_chunks` slots bound GPU memory in flight.
    `fused`: update each streamed chunk with one Triton kernel (kernel.py: torchao's codes, about a fifth of the GPU
    time, one launch) instead of torchao's compiled update. Default: where Triton runs (CUDA). A dict passes options
    to `kernel.Update8bit` (e.g. `{"eager_numerics": False}`).
    `seed`: the Philox key of the fused kernel's stochastic rounding (default: `torch.initial_seed()`); its counter
    is the step and the value's place, so a resumed run with the same seed rounds exactly as an uninterrupted one.
    `compile`: compile the (unfused) update (default: on CUDA); a dict is passed to `torch.compile` as inductor
    options. Small tensors, whose states stay on the device, always take this update.
    `grad_backlog_bytes`: GPU bytes of gradients that may wait for their update or copy to the host before the
    CPU waits for the oldest (default: twice the largest tensor's gradient, at least 1 GiB).
    `device_state_bytes`: GPU memory for 8-bit states kept on the device instead of streamed (the model's first
    tensors, in model order once attached). They behave like the small tensors: no host copy of their states,
    gradients never offloaded (clipped and accumulated on the device).
    `speculative`: clip by global norm with updates during backward (attached): `clip_grad_norm_(max_norm,
    redo=fn)` keeps a step whose norm does not clip and otherwise undoes it and calls `fn` to run the step's forward
    and backward again, each update then applying the clip coefficient -- exact clipping's result (speculation.py:
    what it keeps, 4 more bytes/param of pinned host memory). `clip_policy`: when to stop speculating while the clip
    fires on most steps (`ClipPolicy`).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, block_size: int = 256, bf16_stochastic_round: bool = True,
                 update_in_backward: bool = False, offload_gradients: bool = False, chunk_numel: int = CHUNK_NUMEL,
                 inflight_chunks: int = INFLIGHT_CHUNKS, compile: bool | dict | None = None, sharding: Sharding | None = None,
                 grad_backlog_bytes: int | None = None, fused: bool | dict | None = None, seed: int | None = None,
                 device_state_bytes: int = 0, speculative: bool = False,
                 clip_policy: ClipPolicy | None = None) -> None:
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid AdamW hyperparameters lr={lr}, betas={betas}, eps={eps}")
        if chunk_numel % block_size or chunk_numel < block_size:
            raise ValueError(f"chunk_numel={chunk_numel} must be a positive multiple of block_size={block_size}")
        if inflight_chunks < INFLIGHT_CHUNKS_MIN:
            raise ValueError(f"inflight_chunks must be >= {INFLIGHT_CHUNKS_MIN} (one slot copying while another "
                             f"updates)")
        if speculative and sharding is not None and sharding.world_size > 1 and device_state_bytes:
            raise ValueError("speculative=True with data parallel streams every 8-bit state (every rank must tell "
                             "alike which updates speculate, and only owners know which states stay on the GPU): "
                             "device_state_bytes=0")
        if speculative and update_in_backward:
            raise ValueError("speculative=True clips by global norm with updates in backward; update_in_backward=True "
                             "never clips: choose one")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.block_size, self.bf16_stochastic_round = block_size, bf16_stochastic_round
        self.update_in_backward, self.offload_gradients = update_in_backward, offload_gradients
        self.chunk_numel, self.device_state_bytes = chunk_numel, int(device_state_bytes)
        self._params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if not self._params:
            raise ValueError("no trainable parameters (all have requires_grad=False)")
        self.device = self._device_of(self._params)
        self._group_of = {p: g for g in self.param_groups for p in g["params"]}
        shard = sharding if sharding is not None and sharding.world_size > 1 else None
        self._streams = S = Streams(self.device, comm_streams=shard is not None)
        self.stats = {"h2d_bytes": 0, "d2h_bytes": 0, "updates": 0}
        self.stall = StallMeter(S)  # forward waiting for a layer's update
        self._plan = StepPlan()
        # (through lambdas: the launch and publish of this instance, as they are when called)
        self._schedule = Schedule(S, self.stall, self._params, launch=lambda u: self._launch(u),
                                  publish=lambda p: self._publish(p), all_queued=lambda: self._all_queued())
        self._shard = ShardedUpdates(shard, self._params, S, self._plan, self._schedule, self.device) \
            if shard is not None else None
        self._states = HostStates(self._params, self.state, device=self.device, block_size=block_size,
                                  chunk_numel=chunk_numel, inflight=inflight_chunks,
                                  offload_gradients=offload_gradients, device_state_bytes=self.device_state_bytes,
                                  owns=self._owns, grad_backlog_bytes=grad_backlog_bytes, two_banks=speculative)
        backlog = Backlog(self._states)
        self._host_grads = HostGradients(self._states, S, self.stats, self._plan, backlog)
        step_fn, chunk_fn = self._update_fns(compile)
        self._fused = self._fused_kernel(fused, seed)
        self._pipeline = UpdatePipeline(self._states, S, self.stats, self._plan, backlog, step_fn=step_fn,
                                        chunk_fn=chunk_fn, fused=self._fused, state=self.state)
        self._residency = _always_resident
        self._swapped = lambda p: False
        self._accumulating = self._skip = self._redoing = False
        self.last_norm: float | None = None
        self._spec = Speculation(self._states, S, self.stats, self.device, clip_policy) if speculative else None
        if speculative:
            self._schedule.on_step_start = self._start_speculative_step
            self._schedule.on_forward = self._forward_reached

    @property
    def speculative(self) -> bool:
        """Clipping by global norm with updates during backward, redone when the clip fires (`speculative=True`)."""
        return self._spec is not None

    @property
    def clip_counts(self) -> dict[str, int]:
        """Speculative clipping's counts so far: optimizer steps, those whose clip fired, those redone, those clipped
        exactly (while most steps clip, or accumulating with gradients on the host), those not finite (skipped)."""
        return dict(self._spec.counts) if self._spec is not None else {}

    @staticmethod
    def _device_of(params: list[Tensor]) -> torch.device:
        """The one accelerator of the trainable tensors (host ones beside them are swapped layers, swap.py)."""
        devices = {p.device for p in params}
        accel = {d for d in devices if d.type != "cpu"}
        if len(accel) > 1:
            raise ValueError(f"all trainable parameters must be on one device, found {sorted(map(str, devices))}")
        return accel.pop() if accel else torch.device("cpu")

    def _update_fns(self, compile):
        if compile if compile is not None else self.device.type == "cuda":
            options = compile if isinstance(compile, dict) else None  # inductor options, e.g. {"cpp_wrapper": True}
            return compile_update(single_param_adam, options), compile_update(adamw8bit_chunk, options)
        return single_param_adam, adamw8bit_chunk

    def _fused_kernel(self, fused, seed):
        if fused is None:
            fused = kernel.available(self.device)
        elif fused and not kernel.runnable(self.device):
            raise ValueError(f"fused=True needs Triton and a CUDA device (have {self.device}); use fused=False")
        if not fused:
            return None
        return kernel.Update8bit(self.device, seed=torch.initial_seed() if seed is None else seed,
                                 **(fused if isinstance(fused, dict) else {}))

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        # lr stays a Python float, as in torch's own optimizers (torchao keeps a tensor): schedulers, the Trainer's
        # logs and users read and copy it as a number. Each update takes a float32 tensor of it when it is taken
        # (`_take`), which is what the compiled update wants (no recompile when lr changes).
        group = self.param_groups[-1]
        group["lr"] = as_float(group["lr"])

    # ------------------------------------------------------------------ wiring
    def _owns(self, p: Tensor) -> bool:
        """Whether this rank keeps and updates `p`'s states (always, without data parallel)."""
        return self._shard is None or self._shard.owns(p)

    def _ensure_states(self) -> None:
        self._states.ensure(self._schedule.norm_order)

    def attach(self, model: nn.Module, units: list[nn.Module] | None = None):
        """Hook the optimizer into `model`: updates/gradient offload during backward, and per-unit waits
        in forward so that a layer runs as soon as its own update is done. Returns a handle with remove()."""
        self._schedule.attach(model, units, set(self._group_of), self._on_grad_ready)
        return _Handle(self)

    def detach(self) -> None:
        self._schedule.detach()

    def set_residency(self, touch, ahead: int | None = None, swapped=None) -> None:
        """`touch(p, update_stream)`: a context manager around each update of `p`, which makes sure `p` is
        on the device while the update is queued (the layer-swap engine's `LayerSwap.touch`). `ahead`: queue
        deferred updates at most this many units past the running forward (`LayerSwap.prefetch`: a swapped layer is
        then updated in the slot its forward was prefetched into, never fetched for its update alone). `swapped(p)`:
        whether `p` lives in host memory between uses (`LayerSwap.swaps`): speculative clipping backs it up only
        while it is on the GPU for its update."""
        self._residency = touch
        if swapped is not None:
            self._swapped = swapped
        self._schedule.launch_ahead = LAUNCH_AHEAD if ahead is None else max(0, min(LAUNCH_AHEAD, ahead))

    def sync_weights(self, src: int = 0) -> None:
        """Data parallel: make every rank's trainable weights rank `src`'s. A no-op on one rank."""
        if self._shard is not None:
            self._shard.sync_weights(self._params, src, self._streams.is_cuda)

    def all_finite(self, t: Tensor) -> bool:
        """Whether `t` is finite on this rank and (data parallel) on every rank: a step is skipped everywhere or
        nowhere, so the ranks issue the same collectives. One device sync."""
        ok = bool(torch.isfinite(t).all())
        return ok if self._shard is None else self._shard.shard.all_true(ok, self.device)

    def skip_next_step(self) -> None:
        """The next `step()` drops the gradients instead of updating (a non-finite loss or norm was seen)."""
        self._skip = True

    @contextlib.contextmanager
    def no_update(self):
        """Backward passes inside only accumulate gradients (all micro-batches but the last)."""
        if self._spec is not None and self.offload_gradients:
            # the sums wait in the spare host buffer, where a speculative step keeps its backups: each backup is
            # taken once its tensor's sum is read, just before its update (data parallel: this step clips exactly)
            if self._shard is None:
                self._spec.sums_in_spare = True
            else:
                self._spec.exact_this_step = True
        prev, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = prev

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        """Update every tensor that still has a gradient (on the device or the host).

        With `attach()`, returns without waiting: the updates are taken now and queued as the next forward reaches
        each layer, which waits for its own; `synchronize()` queues and finishes them all (before reading weights
        outside a forward). With data parallel they are all queued now, each layer's next forward waiting for its
        own. Without `attach()` (or when no layer's forward ran), they are all queued now and the compute stream waits
        for them before continuing.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._schedule.launch_deferred()
        if self._skip:  # weights and states stay as they are; gradients (device or host) are dropped
            self._skip = False
            if self._spec is not None and self._plan.updated:
                self._rollback()
            self._drop_gradients()
            self._end_speculative_step()
            return loss
        self._ensure_states()
        S = self._streams
        self._host_grads.flush()
        if self._shard is not None:
            S.compute().wait_stream(S.reduced)  # owners' gradients are reduced
        grads_final = S.record(S.compute())  # after backward and any in-place clipping
        pending = self._pending()
        waited = self._schedule.covers_every_update()
        if pending:
            S.update.wait_event(grads_final)  # the clip coefficient and in-place clipped gradients come from there
            self._queue_step(pending, grads_final, defer=waited and self._shard is None)
        self._schedule.fired = set()
        self._end_speculative_step()
        self._finish_step(waited)
        return loss

    def _pending(self) -> list[Tensor]:
        """The tensors step() updates: those with a gradient (device or host) not updated in backward -- with data
        parallel, the same list, in the same order, on every rank."""
        plan = self._plan
        if self._shard is not None:
            return [p for p in plan.reduced if p not in plan.updated and (
                not self._owns(p) or p.grad is not None or p in plan.host_grad_ready)]
        return [p for p in self._params if p.grad is not None or p in plan.host_grad_ready]

    def _queue_step(self, pending: list[Tensor], grads_final, *, defer: bool) -> None:
        sched = self._schedule
        rank = sched.launch_order()
        pending.sort(key=lambda p: rank.get(sched.unit_of.get(p), len(rank)))
        ready = self._plan.host_grad_ready
        if not defer:
            for p in pending:
                if self._owns(p):
                    self._launch(self._take(p, ready.get(p, grads_final), hold=False))
                self._publish(p)
            return
        # Taken now, queued as the next forward reaches each unit (`Schedule.launch_deferred`): queuing them all
        # here would block the CPU once the copy streams' queues fill (8B: ~0.3 s per step), and the next forward
        # could not start beside them.
        for p in pending:
            u = self._take(p, ready.get(p, grads_final), hold=False)
            u.rank = rank[sched.unit_of[p]]
            if self._draws_random(u):  # queued now, so the global RNG is drawn at the same point as ever
                self._launch(u)
                self._publish(p)
            else:
                sched.deferred.append(u)
        sched.launch_rank = rank
        sched.launch_deferred(min(rank, key=rank.get))  # the copies start now

    def _finish_step(self, waited: bool) -> None:
        S = self._streams
        if not self._schedule.deferred:
            self._all_queued()
        if not waited:
            # No per-layer waits cover these weights: the compute stream waits for every update.
            S.compute().wait_stream(S.update)
            if self._shard is not None:
                S.compute().wait_stream(S.published)
        self._plan.reset()

    def _drop_gradients(self) -> None:
        for p in self._params:
            p.grad = None
        self._plan.reset()
        self._host_grads.sums.clear()
        if self._shard is not None:
            self._shard.dev_sum.clear()
        self._schedule.fired = set()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._plan.reset()
        self._host_grads.sums.clear()  # gradients accumulated on the host are dropped with the others
        if self._shard is not None:
            self._shard.dev_sum.clear()

    def synchronize(self) -> None:
        """Block until every queued copy and update is done (before reading weights or states on the host)."""
        self._schedule.launch_deferred()
        S = self._streams
        if S.is_cuda:
            S.compute().wait_stream(S.update)
            if self._shard is not None:
                S.compute().wait_stream(S.published)
            S.synchronize()
            torch.cuda.current_stream(self.device).synchronize()

    def memory_stats(self) -> dict[str, int]:
        return self._states.memory_stats(self._streams.is_cuda)


class _Handle:
    def __init__(self, opt: StreamedAdamW8bit):
        self._opt = opt

    def remove(self) -> None:
        self._opt.detach()
