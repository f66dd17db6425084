"""One tensor's update on the GPU, queued on side streams: for a streamed tensor, chunk by chunk through a bounded
pool of GPU slots -- (1) H2D copy of the chunk's 8-bit states (and a host gradient), (2) the update, (3) D2H copy of
the new states -- ordered by events only, so the CPU never blocks and the compute stream never waits for it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .states import HostStates


@dataclass
class Update:
    """One tensor's update, taken at `step()` (or at its gradient hook): everything it reads that the caller may change
    before it is queued -- the gradient, the step count, the learning rate, the clip coefficient."""

    p: Tensor
    grad: Tensor | None  # on the device; None: its copy in pinned host memory
    grad_ready: object  # event: the gradient (device or host) is final
    step: Tensor
    args: tuple  # (lr, beta1, beta2, weight_decay, eps, stochastic rounding)
    coef: Tensor | None  # the clip coefficient, applied to the gradient by its update (not yet applied in place)
    hold: bool  # the gradient was just made (backward): count it against the backlog
    rank: int = 0  # place of its unit in the launch order (`Schedule.launch_order`)
    banks: tuple = (0, 0)  # (the bank of host states it reads, the bank it writes): states.py
    speculative: bool = False  # run before the global norm is known: undone if the clip fires (speculation.py)


@dataclass
class StepPlan:
    """Bookkeeping of one optimizer step, shared by the optimizer's parts; `reset()` by `step()` / `zero_grad()`."""

    norms: dict = field(default_factory=dict)  # param -> grad norm (0-dim tensor)
    sumsq: dict = field(default_factory=dict)  # param -> its gradient's squared norm, summed by the fused update
    host_grad_ready: dict = field(default_factory=dict)  # param -> event: grad copied to host
    merged: object = None  # event: the last host-accumulated sum was added into a device gradient (H2D stream)
    merged_params: set = field(default_factory=set)  # params whose gradient was made so, on the H2D stream
    updated: set = field(default_factory=set)  # params already updated in this backward
    reduced: list = field(default_factory=list)  # data parallel: params whose gradient was reduced, in order
    clip_coef: Tensor | None = None
    redo_coef: Tensor | None = None  # during a redo: the coefficient each update applies to its device gradient

    def reset(self) -> None:
        self.__init__()


class Backlog:
    """Back-pressure: GPU bytes of gradients that stay allocated until an event (their update or copy to the host has
    read them). When backward makes gradients faster than PCIe drains them, the CPU waits for the oldest to pass once
    more than the limit waits -- the other streams keep going -- instead of the allocator hitting the memory cap,
    where it synchronizes the whole device and serializes the step."""

    def __init__(self, states: HostStates):
        import collections

        self.states, self.held, self.bytes = states, collections.deque(), 0

    def hold(self, done, nbytes: int) -> None:
        while self.held and self.held[0][0].query():
            self.bytes -= self.held.popleft()[1]
        self.held.append((done, nbytes))
        self.bytes += nbytes
        while self.bytes > self.states.held_limit:
            event, n = self.held.popleft()
            event.synchronize()
            self.bytes -= n


class UpdatePipeline:
    """Queues taken updates. `step_fn` (torchao's `single_param_adam`, small tensors) and `chunk_fn`
    (`update.adamw8bit_chunk`) are the compiled or eager updates; `fused` the Triton kernel, used where it is set."""

    def __init__(self, states: HostStates, streams, stats: dict, plan: StepPlan, backlog: Backlog, *, step_fn,
                 chunk_fn, fused, state: dict):
        self.states, self.S, self.stats, self.plan, self.backlog = states, streams, stats, plan, backlog
        self.step_fn, self.chunk_fn, self.fused, self.state = step_fn, chunk_fn, fused, state
        self.prev_d2h_done = None  # event: the last step's copy-backs finished (host states final)

    def queue(self, u: Update, norm_in_update: bool) -> None:
        S, p, grad, step, args = self.S, u.p, u.grad, u.step, u.args
        st = self.state[p]
        on_host = grad is None
        if grad is not None:
            S.update.wait_event(u.grad_ready)
            S.keep_alive(grad, S.update)
        self.stats["updates"] += 1
        if p not in self.states.place:
            with S.on(S.update):  # small tensors: states stay on the device, nothing to stream
                self.step_fn(p.detach(), grad, step, st["exp_avg"], st["exp_avg_sq"], None, *args[:5], True, args[5])
            return
        flat_p = p.detach().view(-1)
        flat_g = None if on_host else grad.view(-1)
        sumsq = None
        if not on_host and norm_in_update:  # (in backward the gradient is always on the device)
            with S.on(S.update):
                sumsq = self.plan.sumsq[p] = torch.zeros((), dtype=torch.float32, device=self.states.device)
            S.keep_alive(sumsq, S.compute())  # read there by clip_grad_norm_
        if p in self.states.on_device:  # states on the device: one update over the whole tensor, nothing to copy
            self._on_device(p, flat_p, flat_g, step, args, sumsq)
        else:
            for chunk in self.states.host_chunks(p):
                self._chunk(chunk, u.banks, flat_p, flat_g, u.grad_ready if on_host else None, step, args, sumsq,
                            u.coef)
        if not on_host and u.hold:  # the gradient is freed once the update read it
            self.backlog.hold(S.record(S.update), p.numel() * grad.element_size())

    def _on_device(self, p: Tensor, flat_p: Tensor, flat_g: Tensor, step, args, sumsq) -> None:
        """The update of a tensor whose states stay on the device (`device_state_bytes`), on the update stream."""
        S, (codes, scales), n = self.S, self.states.on_device[p], p.numel()
        qmaps = self.states.qmaps_dev
        with S.on(S.update):
            if self.fused is not None:
                self.fused(flat_p, flat_g, codes, scales, *qmaps, step, *args, sumsq=sumsq,
                           counter=int(step) * self.states.total_8bit + self.states.place[p])
                return
            bs, size = self.states.block_size, self.states.chunk_numel  # torchao's makes fp32 moments: by chunks
            for a in range(0, n, size):
                b = min(a + size, n)
                self.chunk_fn(flat_p[a:b], flat_g[a:b], codes[:, a:b], scales[:, a // bs:b // bs], *qmaps, step,
                              *args)

    def _chunk(self, chunk, banks, flat_p, flat_g, host_grad_ready, step, args, sumsq=None, coef=None) -> None:
        S, bs = self.S, self.states.block_size
        s, e, flat_start = chunk.start, chunk.end, chunk.flat_start
        n = e - s
        (host_codes, host_scales), (out_codes, out_scales) = [(chunk.codes[b], chunk.scales[b]) for b in banks]
        slot = self.states.take_slot()
        # 1) H2D: the slot must be free (its last copy-back done), host states final (last step's
        #    copy-backs done), and a host gradient must have landed (its D2H done).
        if slot.free is not None:
            S.h2d.wait_event(slot.free)
        if self.prev_d2h_done is not None:
            S.h2d.wait_event(self.prev_d2h_done)
            self.prev_d2h_done = None
        if host_grad_ready is not None:
            S.h2d.wait_event(host_grad_ready)
        codes, scales, code_rows, scale_rows, g = self.states.slot_views(slot, n)
        with S.on(S.h2d):
            for k in range(2):  # row by row: a strided 2-D host copy would go through a pageable temporary
                code_rows[k].copy_(host_codes[k], non_blocking=True)
                scale_rows[k].copy_(host_scales[k], non_blocking=True)
            if flat_g is None:
                g.copy_(chunk.spare, non_blocking=True)
        loaded = S.record(S.h2d)
        self.stats["h2d_bytes"] += 2 * n + 8 * (n // bs) + (0 if flat_g is not None else g.numel() * g.element_size())
        # 2) the update, on its own stream so that backward / forward never wait for it
        S.update.wait_event(loaded)
        whole = s == 0 and e == flat_p.numel()
        with S.on(S.update):
            if flat_g is not None:
                g = flat_g if whole else flat_g[s:e]
            if coef is not None and self.fused is None:
                g = g * coef  # bf16 * fp32 scalar -> bf16, as clip_grad_norm_ does in place
            chunk_p = flat_p if whole else flat_p[s:e]
            if self.fused is not None:  # clipping's product inside the kernel; Philox counters unique per step
                self.fused(chunk_p, g, codes, scales, *self.states.qmaps_dev, step, *args, grad_scale=coef,
                           sumsq=sumsq, counter=int(step) * self.states.total_8bit + flat_start)
            else:
                self.chunk_fn(chunk_p, g, codes, scales, *self.states.qmaps_dev, step, *args)
        updated = S.record(S.update)
        # 3) D2H: the new states back to the host (the bank it writes); the slot is free once this lands
        S.d2h.wait_event(updated)
        with S.on(S.d2h):
            for k in range(2):
                out_codes[k].copy_(code_rows[k], non_blocking=True)
                out_scales[k].copy_(scale_rows[k], non_blocking=True)
        slot.free = S.record(S.d2h)
        self.stats["d2h_bytes"] += 2 * n + 8 * (n // bs)
