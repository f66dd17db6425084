"""When updates run and what waits for them: the model's forward units, a pre-hook per unit that makes its forward
wait (on the GPU) for its own weights' updates only, and the queue of `step()`'s updates, launched as the next
forward reaches each unit -- `LAUNCH_AHEAD` units ahead of it (with layer swap no further than the swap engine
prefetches) -- so the CPU never blocks on full copy queues before that forward starts."""
from __future__ import annotations

import collections
import math

from torch import Tensor, nn

# step()'s updates are queued as the next forward reaches each unit, this many units ahead of it.
LAUNCH_AHEAD = 2


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


class Schedule:
    """Units, their readiness events and the deferred updates of the last `step()`. `launch(u)` queues a taken
    update, `publish(p)` marks it done (data parallel: broadcasts it first), `all_queued()` runs once every update of
    a step is queued."""

    def __init__(self, streams, stall, params: list[Tensor], *, launch, publish, all_queued):
        self.S, self.stall, self.params = streams, stall, params
        self.launch, self.publish, self.all_queued = launch, publish, all_queued
        self.units: list[list[Tensor]] = []  # params of each unit, forward order
        self.unit_of: dict[Tensor, int] = {}
        self.unit_event: dict[int, object] = {}
        self.handles: list = []
        self.fired: set[int] = set()  # units whose forward ran with grad enabled since the last step()
        self.deferred: collections.deque = collections.deque()  # step()'s taken updates, not queued yet
        self.launch_rank: dict[int, int] = {}  # unit -> its place in the launch order of the deferred updates
        self.covered_by: dict[int, int] = {}  # unit whose forward never runs -> the unit whose wait covers it
        self.launch_ahead = LAUNCH_AHEAD
        self.on_step_start = None  # called at a step's first forward with grad (speculative clipping's backups)
        self.on_forward = None  # called with each unit a forward with grad reaches (they are queued as it goes)
        self.norm_order = params  # clip_grad_norm_(model.parameters()) sums per-tensor norms in the model's order

    def attach(self, model: nn.Module, units: list[nn.Module] | None, owned: set, on_grad_ready) -> None:
        self.detach()
        units = units if units is not None else forward_units(model)
        seen: set = set()
        for u in units:
            ps = [p for p in u.parameters() if p.requires_grad and p in owned and p not in seen]
            seen.update(ps)
            self.units.append(ps)
        self.unit_of = {p: i for i, ps in enumerate(self.units) for p in ps}
        in_model = [p for p in model.parameters() if p.requires_grad and p in owned]
        self.norm_order = in_model + [p for p in self.params if p not in set(in_model)]
        for i, u in enumerate(units):
            self.handles.append(u.register_forward_pre_hook(self._wait_hook(i)))
        for p in self.params:
            self.handles.append(p.register_post_accumulate_grad_hook(on_grad_ready))

    def detach(self) -> None:
        self.launch_deferred()
        for h in self.handles:
            h.remove()
        self.handles = []
        self.units, self.unit_of, self.unit_event = [], {}, {}
        self.norm_order = self.params

    @property
    def attached(self) -> bool:
        return bool(self.units)

    def _wait_hook(self, unit: int):
        import torch

        def hook(module, args):
            # The forward of this unit reads weights that the update stream may still be writing.
            if torch.is_grad_enabled():
                if not self.fired and self.on_step_start is not None:
                    self.on_step_start()  # (the first training forward since the last step())
                self.fired.add(unit)
                if self.on_forward is not None and torch._C._current_autograd_node() is None:
                    self.on_forward(unit)  # (a forward, not a recompute in backward)
            self.launch_deferred(unit)
            self.stall.wait(self.S.compute(), self.unit_event.get(unit))

        return hook

    def covers_every_update(self) -> bool:
        """Whether the next forward's unit waits cover every update (attached, some unit ran, all params in units)."""
        return bool(self.units) and bool(self.fired) and all(p in self.unit_of for p in self.params)

    def launch_order(self) -> dict[int, int]:
        """unit -> its place in the order step()'s updates are queued: forward order, except that units after the
        last one whose forward ran (with grad) go just before it -- their weights are read without their module
        being called (an LM head whose weight a chunked loss reads), so no wait of their own covers them: the wait
        for that last unit (the final norm) does, the update stream running in order."""
        n = len(self.units)
        self.covered_by = {}
        if not self.fired:
            return {u: u for u in range(n)}
        last = max(self.fired)
        self.covered_by = {u: last for u in range(last + 1, n)}
        order = [*range(last), *range(last + 1, n), last]
        return {u: i for i, u in enumerate(order)}

    def launch_deferred(self, unit: int | None = None) -> None:
        """Queue step()'s taken updates through `unit` (in launch order) and `launch_ahead` units more; all of them
        when None. Called by each unit's forward pre-hook, and before anything else touches gradients or states."""
        if not self.deferred:
            return
        limit = math.inf if unit is None else self.launch_rank.get(unit, math.inf) + self.launch_ahead
        while self.deferred and self.deferred[0].rank <= limit:
            u = self.deferred.popleft()
            self.launch(u)
            self.publish(u.p)  # (deferred only without data parallel: marks its unit, no broadcast)
        if not self.deferred:
            self.all_queued()

    def unit_done(self, p: Tensor, stream) -> None:
        """`p`'s update is queued on `stream`: its unit's next forward waits for it."""
        unit = self.unit_of.get(p)
        if unit is not None:  # one stream per mode (update, or published with data parallel): the last covers all
            self.unit_event[unit] = event = self.S.record(stream)
            cover = self.covered_by.get(unit)
            if cover is not None:  # its forward never runs: the wait of the last unit that does covers it, even
                self.unit_event[cover] = event  # where that unit's own update was queued earlier (by step())
