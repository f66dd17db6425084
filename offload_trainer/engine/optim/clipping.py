"""Clipping by global norm, as `torch.nn.utils.clip_grad_norm_` computes it, for `StreamedAdamW8bit` (a mixin: the
optimizer's parts are its attributes). Exact clipping scales the gradients -- in place on the device, or by each
update for those waiting on the host -- before any update runs. Speculative clipping (speculation.py) lets the
updates run during backward and, once the norm is known, keeps the step or undoes and redoes it; the hooks that
prepare a step for that (its RNG, the weights' backups as the forward goes) and commit it live here too."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .host_read import read_floats
from .update import global_norm, grad_norm, roots_of_sums


def _clip_coef(total: Tensor, max_norm: float) -> Tensor:
    """The factor `torch.nn.utils.clip_grads_with_norm_` scales gradients by (1: unchanged)."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


class GlobalNormClipping:
    """`clip_grad_norm_` and the speculative step's life cycle, over the attributes `StreamedAdamW8bit` sets."""

    def _speculates(self, p: Tensor) -> bool:
        """Whether `p`'s update runs in this backward before the norm is known (speculative clipping): a streamed
        tensor whose rounding does not draw from the global RNG, while the policy speculates. Every rank answers
        alike for every tensor (data parallel: the owner updates it, every rank takes part in its broadcast)."""
        return (self._spec is not None and self._spec.speculating and self._streamed(p)
                and not self._rounds_from_global_rng(p))

    def _streamed(self, p: Tensor) -> bool:
        """`p`'s 8-bit states stream through the host buffers. With data parallel only the owner holds them, so every
        rank reads it from the tensor alone: there every 8-bit tensor streams (none kept on the GPU, see __init__)."""
        return self._states.is_8bit(p) if self._shard is not None else p in self._states.offset

    def _rounds_from_global_rng(self, p: Tensor) -> bool:
        """torchao's stochastic rounding (small tensors, or any without the fused kernel) draws from the global RNG;
        the fused kernel's Philox counters depend on the step and the value's place among the 8-bit tensors only."""
        sr = self.bf16_stochastic_round and p.dtype is torch.bfloat16
        return sr and (self._fused is None or not self._states.is_8bit(p))

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, redo=None) -> Tensor:
        """Global-norm clipping with `torch.nn.utils.clip_grad_norm_`'s arithmetic, over gradients on the
        device and those waiting on the host. Call after backward, before `step()`. Returns the norm.

        `redo` (needed with `speculative=True`): a function that runs the step's forward and backward again (every
        micro-batch of it, the earlier ones inside `no_update()`). When the updates already ran in backward and the
        norm clips, they are undone, the global RNG is put back as it was at the step's first forward, and `redo()`
        runs with each update applying the clip coefficient."""
        if norm_type != 2.0:
            raise ValueError("only the L2 norm (norm_type=2) is supported")
        self.last_norm = None  # (the norm as a Python float, where this call read it on the host anyway)
        self._schedule.launch_deferred()
        speculated = self._spec is not None and any(self._streamed(p) for p in self._plan.updated)
        if speculated and math.isfinite(max_norm) and redo is None:
            raise ValueError("speculative clipping: updates ran during backward before the norm was known; pass "
                             "clip_grad_norm_(max_norm, redo=fn), fn running this step's forward and backward again, "
                             "so that a step that clips can be redone (or construct with speculative=False)")
        if self._plan.updated and math.isfinite(max_norm) and not speculated:
            raise RuntimeError(
                "updates already ran during backward (update_in_backward=True), so gradients cannot be "
                "clipped any more. Construct with update_in_backward=False to clip by global norm, or set "
                "max_grad_norm to 0 / inf."
            )
        norms = self._norms()
        on_device = [p for p in norms if p.grad is not None]  # clip_grads_with_norm_ takes parameters
        if self._shard is not None:
            norms = self._shard.gather_norms(norms, self._schedule.norm_order)
        if not norms:
            return torch.tensor(0.0, device=self.device)
        total = global_norm(norms)
        if speculated and math.isfinite(max_norm):
            return self._validate(total, max_norm, redo)
        if math.isfinite(max_norm) and not self._plan.updated:
            torch.nn.utils.clip_grads_with_norm_(on_device, max_norm, total)
            coef = _clip_coef(total, max_norm)
            self._plan.clip_coef = coef.to(self.device)
            self._streams.keep_alive(self._plan.clip_coef, self._streams.update)  # read by the updates
            if self._spec is not None:  # (the policy counts exact steps too, to know when to speculate again)
                clipped, finite = self._clip_fired(total, coef)
                self._spec.count(clipped=clipped, redone=False, exact=True, finite=finite)
        return total

    def _clip_fired(self, total: Tensor, coef: Tensor) -> tuple[bool, bool]:
        """(whether clipping changes the gradients, whether the norm is finite): the step's one device sync, its norm
        kept as `last_norm`. The same test as exact clipping's arithmetic: a coefficient of exactly 1 multiplies every
        gradient unchanged."""
        t, c = read_floats(torch.stack([total.float(), coef.float()]))
        self.last_norm = t
        finite = math.isfinite(t)
        return finite and c < 1.0, finite

    def _validate(self, total: Tensor, max_norm: float, redo) -> Tensor:
        """Speculative clipping, once the norm is known: keep the step, or undo it and (a finite norm) redo it."""
        coef = _clip_coef(total, max_norm)
        clipped, finite = self._clip_fired(total, coef)
        if finite and not clipped:  # the common case: the updates stand, committed by step()
            self._spec.count(clipped=False, redone=False, exact=False)
            return total
        self._rollback()
        if not finite:  # skipped, as exact clipping skips it
            self._skip = True
            self._spec.count(clipped=False, redone=False, exact=False, finite=False)
            return total
        S = self._streams
        self._plan.redo_coef = self._plan.clip_coef = coef.to(self.device)  # (clip_coef: host gradients' updates)
        S.keep_alive(self._plan.redo_coef, S.update)
        self._spec.replay_rng()
        self._redoing = True
        try:
            with torch.enable_grad():
                redo()
        finally:
            self._redoing = False
            self._plan.redo_coef = None
        # what waited for the norm (small tensors, states on the GPU) is clipped in place, as exact clipping does
        self._host_grads.flush()
        on_device = [p for p in self._schedule.norm_order if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(on_device, max_norm, total)
        self._spec.count(clipped=True, redone=True, exact=False)
        return total

    def _rollback(self) -> None:
        """Undo this step's speculative updates: the weights back from their backups (queued on the update stream
        after the updates being undone; each unit's next forward waits for it), the step counts back, the states'
        other bank left uncommitted; every gradient of the step dropped."""
        S = self._streams
        for p in self._schedule.norm_order:
            if p not in self._plan.updated:
                continue
            if self._owns(p):
                with self._residency(p, S.update):
                    self._spec.restore(p, S.update)
                self.state[p]["step"] -= 1
            self._publish(p)  # (data parallel: the owner's restored weights to every rank)
        # The redo's earlier micro-batches write their gradient sums into the spare buffer the restores read from
        S.d2h.wait_stream(S.update)
        for p in self._params:
            p.grad = None
        plan = self._plan
        plan.updated.clear()
        plan.norms.clear()
        plan.sumsq.clear()
        plan.reduced.clear()
        self._host_grads.sums.clear()

    def _norms(self) -> dict:
        """Each tensor's gradient norm, in the model's order: measured in backward, summed by the fused updates, or
        measured now (gradients still on the device)."""
        S = self._streams
        self._host_grads.flush()
        if self._shard is not None:
            S.compute().wait_stream(S.reduced)  # gradients reduced onto their owners, and their norms
        roots = {}
        if self._plan.sumsq:  # summed by the fused updates (update stream)
            S.compute().wait_stream(S.update)
            order = self._schedule.norm_order
            roots = roots_of_sums([p for p in order if p in self._plan.sumsq and p not in self._plan.norms],
                                  self._plan.sumsq)
        norms = {}
        for p in self._schedule.norm_order:
            if p in self._plan.norms:
                norms[p] = self._plan.norms[p]
            elif p in roots:
                norms[p] = roots[p]
            elif p.grad is not None:
                norms[p] = grad_norm(p.grad)
        return norms

    def _end_speculative_step(self) -> None:
        """Commit the step's speculative (or redone) updates: their bank of states becomes current."""
        if self._spec is None:
            return
        for p in self._plan.updated:
            if p in self._states.offset and self._owns(p):
                self._states.commit(p)
        self._spec.exact_this_step = self._spec.sums_in_spare = False

    def _start_speculative_step(self) -> None:
        """A step's first forward: the global RNG its redo would replay, and which resident tensors' weights are
        backed up as this forward goes (last layer first, as backward updates them). Where some of the last step's
        updates of streamed tensors are still to be queued (it clipped exactly), each backup is taken just before
        its update instead, which then comes after them -- as where gradient sums wait in the spare buffer the backups
        go to (accumulation)."""
        spec = self._spec
        if not spec.speculating:  # (nothing left to back up from an earlier speculative step)
            spec.plan_backups([])
            return
        spec.snapshot_rng()
        if spec.sums_in_spare or any(u.p in self._states.offset for u in self._schedule.deferred):
            spec.plan_backups([])
            return
        spec.plan_backups([p for p in reversed(self._schedule.norm_order)
                           if p in self._states.offset and self._speculates(p) and not self._swapped(p)])

    def _forward_reached(self, unit: int) -> None:
        """Backups keep pace with the forward: a share per unit from the second on (the first unit's forward is
        often followed by a read of the model's own that would wait behind copies queued before it)."""
        if self._spec.pending:
            self._spec.pace(unit / max(1, len(self._schedule.units) - 2))
