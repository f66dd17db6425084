"""Speculative clipping: with `max_grad_norm > 0`, updates still run during backward, before the global gradient norm
is known; when backward ends, a step whose norm is finite and does not clip is kept, and a step that clips (or is
not finite) is rolled back exactly and redone with the clip coefficient (DeepSpeed SuperOffload's
speculation-then-validation). In a finetune the clip rarely fires, so the defaults of every trainer
(`max_grad_norm: 1.0`) run at the speed of updates in backward instead of waiting for the norm.

What a rollback needs, and where it is kept (per streamed value, bf16 weights):
- the 8-bit states before the update: the update writes the other bank of host states (states.py), and only the
  commit makes it current. Nothing is copied: +2.03 bytes of host memory, no PCIe.
- the weights before the update: a backup in the spare pinned buffer (the one exact clipping keeps gradients in),
  copied device -> host once the previous update of the tensor is done: +2 bytes of host memory, +2 bytes of D2H per
  step. Resident tensors are backed up in the order backward updates them: `FORWARD_SHARE` of their bytes during the
  step's forward, a share at each layer it reaches (`pace`), the rest as backward goes, `AHEAD_BYTES` ahead of the
  update being queued (`before_update`). Queued all at once, 16 GB of copies (8B) held the copy engine for 0.3 s,
  and a one-value read of the model's own forward (a mask check's `.item()`) waited behind them with the GPU idle;
  all during the forward, they fill its D2H time, which offloaded activations need too. A swapped layer is backed
  up just before its update, while it is on the GPU for backward.
So 8B takes 6.1 bytes/param of pinned host memory (45 GiB) against exact clipping's 4.0. With gradient accumulation
the spare buffer holds the gradient sums of the earlier micro-batches until the last one's backward reads each: then
nothing is backed up during the forward, and each tensor's backup is queued once its sum has been read, just before
its update (the same buffer, no more host memory).
The redo runs the step's forward and backward again (the caller's `redo`, with the global RNG as it was at the
step's first forward) and each update applies the clip coefficient: its gradients equal the first pass's, so the
result is exact clipping's. Keeping the gradients instead would cost 2 bytes/param more host memory and D2H on
every step, to save work only on the steps that clip.

Tensors whose update cannot be undone this way wait for the norm, as with exact clipping: small tensors and those
whose states stay on the GPU (updated in place; small, or last in backward anyway), and updates that draw from the
global RNG (torchao's stochastic rounding without the fused kernel: drawn in backward, the numbers would differ from
exact clipping's).

`ClipPolicy` switches to exact clipping while the clip fires on most recent steps (pretraining, a high learning
rate), where redoing them would cost more than waiting for the norm, and back when it stops firing.
"""
from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

import torch
from torch import Tensor

logger = logging.getLogger("offload_trainer")

# The share of the backups' bytes queued during the forward; the rest is queued in backward, this many bytes ahead of
# the update being queued (about one 8B decoder layer's weights: the copy has that update's queueing to land in).
FORWARD_SHARE = 0.5
AHEAD_BYTES = 2**29


@dataclass
class ClipPolicy:
    """Whether the next step speculates. A step that clips costs a speculative step twice (its forward and backward run
    again), so speculating pays while under ~30% of steps clip (8B on 24 GiB: 0.93x native speculating, 0.70x
    exact: 1 + r < 0.93 / 0.70). Over the last `window` steps: `to_exact` or more clipped -> exact clipping from the
    next step; `to_speculative` or fewer -> speculative again (the gap keeps it from flapping)."""

    window: int = 8
    to_exact: int = 3
    to_speculative: int = 1
    exact: bool = False
    recent: collections.deque = field(default_factory=collections.deque)

    def record(self, clipped: bool) -> bool | None:
        """Count one step; returns the new mode (True: exact) when it changes, else None."""
        self.recent.append(bool(clipped))
        if len(self.recent) > self.window:
            self.recent.popleft()
        fired = sum(self.recent)
        if not self.exact and fired >= self.to_exact:
            self.exact = True
            return True
        if self.exact and len(self.recent) == self.window and fired <= self.to_speculative:
            self.exact = False
            return False
        return None


class Speculation:
    """Backups of the weights, the RNG at the step's first forward, the rollback and the per-step counts. Owned by
    `StreamedAdamW8bit(speculative=True)`; `states` has two banks and the spare buffer (states.py)."""

    def __init__(self, states, streams, stats: dict, device: torch.device, policy: ClipPolicy | None = None):
        self.states, self.S, self.stats, self.device = states, streams, stats, device
        self.policy = policy if policy is not None else ClipPolicy()
        self.backed: dict[Tensor, object] = {}  # param -> event: its backup holds its current weights once passed
        self.done: dict[Tensor, object] = {}  # param -> event after its last update (what its next backup waits for)
        self.rng: tuple | None = None  # the global RNG at the step's first forward
        # cumulative: optimizer steps, steps whose clip fired, steps redone, steps run with exact clipping
        self.counts = {"steps": 0, "clipped": 0, "redone": 0, "exact": 0, "nonfinite": 0}
        self.exact_this_step = False  # data parallel accumulation with gradients on the host: they clip exactly
        # accumulation with gradients on the host: the spare buffer holds their sums until each is read in the last
        # micro-batch's backward, so no backup is queued ahead of its own update
        self.sums_in_spare = False
        self.pending: collections.deque = collections.deque()  # backups still to queue this step, in update order
        self.through: dict[Tensor, int] = {}
        self.pending_bytes = self.queued_bytes = 0

    @property
    def speculating(self) -> bool:
        return not (self.policy.exact or self.exact_this_step)

    # ------------------------------------------------------------------ backups
    def backup(self, p: Tensor, after=None) -> object:
        """Queue the copy of `p`'s current weights into its backup (D2H stream), after its last update (and `after`);
        returns the event after which the backup holds them. The caller keeps `p` on the device meanwhile (a swapped
        layer: its residency context)."""
        S = self.S
        for ev in (self.done.pop(p, None), after):
            if ev is not None:
                S.d2h.wait_event(ev)
        with S.on(S.d2h):
            self.states.spare(p).copy_(p.detach(), non_blocking=True)
        self.stats["d2h_bytes"] += p.numel() * p.element_size()
        self.backed[p] = ev = S.record(S.d2h)
        return ev

    def plan_backups(self, params: list[Tensor]) -> None:
        """At a step's first forward: these tensors' backups (resident, in the order backward updates them) are
        queued as the forward goes (`pace`), then ahead of their updates (`before_update`); earlier backups are
        stale."""
        self.backed.clear()
        self.pending = collections.deque(params)
        self.through = {}  # param -> the backups' bytes through it, in update order
        total = 0
        for p in params:
            total += p.numel() * p.element_size()
            self.through[p] = total
        self.pending_bytes, self.queued_bytes = total, 0

    def pace(self, fraction: float) -> None:
        """The forward has reached `fraction` of the model: queue backups up to that part of their forward share."""
        self._queue_through(self.pending_bytes * FORWARD_SHARE * min(1.0, fraction))

    def _queue_through(self, target: float) -> None:
        while self.pending and self.queued_bytes < target:
            p = self.pending.popleft()
            self.queued_bytes += p.numel() * p.element_size()
            if p not in self.backed:
                self.backup(p)

    def before_update(self, p: Tensor, update_stream) -> None:
        """`p` is about to be updated speculatively: its backup must have landed (queued now if it was not, with the
        next `AHEAD_BYTES` of backups), and the next one waits for this update (`updated`)."""
        self._queue_through(self.through.get(p, self.queued_bytes) + AHEAD_BYTES)
        ev = self.backed.get(p)
        if ev is None:  # (after the compute stream as it is now: a swapped layer's slot is loaded, its backward read)
            if self.sums_in_spare:  # (and after the H2D stream: its slice held its gradient sum, read just before)
                self.S.d2h.wait_event(self.S.record(self.S.h2d))
            ev = self.backup(p, after=self.S.record(self.S.compute()))
        update_stream.wait_event(ev)
        # From here the backup is of the weights before this update: valid for a rollback, stale after a commit.

    def updated(self, p: Tensor, event) -> None:
        self.done[p] = event

    # ------------------------------------------------------------------ rollback
    def restore(self, p: Tensor, stream) -> None:
        """Queue on `stream` (after the update being undone) the copy of `p`'s backup back into its weights."""
        S = self.S
        ev = self.backed[p]
        stream.wait_event(ev)
        with S.on(stream):
            p.detach().copy_(self.states.spare(p), non_blocking=True)
        self.stats["h2d_bytes"] += p.numel() * p.element_size()

    # ------------------------------------------------------------------ the RNG the redo replays
    def snapshot_rng(self) -> None:
        """At the step's first forward: the global RNG the redo starts from (dropout, and what updates draw)."""
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        self.rng = (torch.get_rng_state(), cuda)

    def replay_rng(self) -> None:
        if self.rng is None:
            return
        cpu, cuda = self.rng
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)

    # ------------------------------------------------------------------ counts and mode
    def count(self, *, clipped: bool, redone: bool, exact: bool, finite: bool = True) -> None:
        """One optimizer step's outcome; switches the mode when the policy says so (logged once per switch)."""
        c = self.counts
        c["steps"] += 1
        c["clipped"] += int(clipped)
        c["redone"] += int(redone)
        c["exact"] += int(exact)
        c["nonfinite"] += int(not finite)
        switched = self.policy.record(clipped)
        if switched is True:
            logger.info("clipping: the clip fired on %d of the last %d steps, so the next steps clip exactly (updates "
                        "wait for the global norm) instead of being redone; speculative again once it fires on at "
                        "most %d of %d", sum(self.policy.recent), len(self.policy.recent),
                        self.policy.to_speculative, self.policy.window)
        elif switched is False:
            logger.info("clipping: the clip fired on %d of the last %d steps: updates run during backward again "
                        "(speculative, redone when it fires)", sum(self.policy.recent), len(self.policy.recent))
