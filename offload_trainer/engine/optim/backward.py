"""What happens as backward reaches each trainable tensor (a mixin of `StreamedAdamW8bit`, whose attributes it uses):
its gradient summed, reduced to its owner, offloaded or measured, and -- updating during backward -- its update taken
and queued at once; `_take` is the one place an update's hyperparameters, gradient and clip coefficient are fixed."""
from __future__ import annotations

import torch
from torch import Tensor

from .pipeline import Update
from .update import as_float, grad_norm


class BackwardUpdates:
    @torch.no_grad()
    def _on_grad_ready(self, p: Tensor) -> None:
        if p.grad is None:
            return
        if self._schedule.deferred:  # a backward without a forward through every unit: the last step's go first
            self._schedule.launch_deferred()
        self._ensure_states()
        if self._accumulating:
            return self._accumulate(p)
        S = self._streams
        speculate = self._speculates(p)
        in_backward = self.update_in_backward or speculate
        if self._shard is not None:
            ready = self._shard.reduce(p)
            if ready is None:  # another rank owns p: its new weights come from there
                if in_backward:
                    self._plan.updated.add(p)
                    self._publish(p)
                return
            ready = self._shard.add_sums(p, ready, self._host_grads, p in self._states.offset)
            if not self._redoing:  # (a redo's norms are the first pass's)
                self._measure_norm(p, S.reduced)
        else:
            ready = self._host_grads.add_sum(p, S.record(S.compute()))  # + earlier micro-batches' sum, if any
            if not self._norm_in_update(p) and not self._redoing and (in_backward or (
                    self.offload_gradients and p in self._states.offset)):
                self._measure_norm(p, S.compute())
        if in_backward:
            self._launch(self._take(p, ready, hold=True, speculative=speculate))
            self._plan.updated.add(p)
            self._publish(p)
        elif self.offload_gradients and p in self._states.offset:
            if self._spec is not None:
                self._spec.backed.pop(p, None)  # its slice of the spare buffer holds its gradient now
            self._plan.host_grad_ready[p] = self._host_grads.offload(p, ready)

    def _accumulate(self, p: Tensor) -> None:
        """A micro-batch before the last: big tensors' gradients sum in pinned memory with `offload_gradients` (data
        parallel: averaged onto their owner first); otherwise autograd sums them on the device."""
        on_host = self.offload_gradients and p in self._states.offset
        if self._shard is not None and self.offload_gradients:
            self._shard.reduce_micro_batch(p, self._host_grads, on_host)
        elif on_host:
            self._host_grads.stash(p)

    def _norm_in_update(self, p: Tensor) -> bool:
        """Whether `p`'s gradient norm (for logging: no clipping in backward) is summed by the fused update kernel
        on its pass over the gradient, instead of by a norm kernel on the compute stream."""
        return self._fused is not None and self.update_in_backward and self._shard is None and p in self._states.place

    def _measure_norm(self, p: Tensor, stream) -> None:
        """Queue `p.grad`'s norm on the stream that made the gradient (`stream`, or the H2D stream where a host sum
        was added: then `merged` moves past the norm, so the compute stream's wait covers it)."""
        S = self._streams
        merged = p in self._plan.merged_params
        with S.on(S.h2d if merged else stream):
            self._plan.norms[p] = grad_norm(p.grad)
        if merged:
            self._plan.merged = S.record(S.h2d)

    def _take(self, p: Tensor, grad_ready, *, hold: bool, speculative: bool = False) -> Update:
        """`p`'s update as of now: its step counted, learning rate and gradient taken (`p.grad` becomes None). A
        streamed tensor's update writes the other bank of states, made current now, or for a speculative update when
        the step commits (`step()`). The clip coefficient: applied to a host gradient by its update, or to a device
        gradient during a redo (exact clipping scales device gradients in place before)."""
        group, st = self._group_of[p], self.state[p]
        st["step"] += 1
        step = st["step"].clone()  # read when each kernel launches; never mutated afterwards
        if isinstance(group["lr"], Tensor):  # put there by a user or a scheduler: read once, kept a number
            group["lr"] = as_float(group["lr"])
        lr = torch.tensor(group["lr"], dtype=torch.float32)  # as step: fixed now, float32 as torchao rounds it
        sr = self.bf16_stochastic_round and p.dtype is torch.bfloat16
        args = (lr, group["betas"][0], group["betas"][1], group["weight_decay"], group["eps"], sr)
        grad, p.grad = p.grad, None
        coef = self._plan.clip_coef if grad is None else self._plan.redo_coef
        banks = self._states.banks_of(p) if p in self._states.offset else (0, 0)
        if not speculative and p in self._states.offset:
            self._states.commit(p)
        return Update(p, grad, grad_ready, step, args, coef, hold, banks=banks, speculative=speculative)

    def _launch(self, u: Update) -> None:
        """Queue the copies and the update of a taken update (`_publish` then marks its unit's next forward ready)."""
        S = self._streams
        with self._residency(u.p, S.update):
            if u.speculative:
                self._spec.before_update(u.p, S.update)
            self._pipeline.queue(u, self._norm_in_update(u.p))
        if self._spec is not None and u.p in self._states.offset:
            self._spec.updated(u.p, S.record(S.update))

    def _publish(self, p: Tensor) -> None:
        if self._shard is None:
            self._schedule.unit_done(p, self._streams.update)
        else:
            self._shard.publish(p, self._residency)

    def _all_queued(self) -> None:
        """Every update of the step is queued: the next step's copies wait for these (host states and gradients)."""
        S = self._streams
        self._pipeline.prev_d2h_done = S.record(S.d2h)
        self._host_grads.prev_h2d_done = S.record(S.h2d)

    def _draws_random(self, u: Update) -> bool:
        """Whether `u`'s update draws from the global RNG (stochastic rounding by torchao's update: small tensors, or
        every tensor without the fused kernel, whose Philox counters depend on the step and place only). Such
        updates are queued by step() itself: queued later, they would draw after the next step's own random numbers
        (data, dropout), and a run would round differently depending on where it synchronized (a checkpoint)."""
        return self._rounds_from_global_rng(u.p)
