"""Layer swap: K decoder layers stay on the GPU, the others live in pinned CPU memory and are prefetched.

`LayerSwap(layers, device, resident=K)` takes a `ModuleList` of decoder layers. The swapped layers
(spread evenly between resident ones, so each transfer overlaps the compute of the layers before it) keep
their tensors in pinned host memory. A forward pre-hook makes each swapped layer's tensors point into a
reused GPU slot, after an H2D copy on a side stream that was started `prefetch` layers ahead, in the order
the layers will be needed: forward 0..L-1, then (training) the backward's recompute and backward L-1..0.
Slots are given back lazily (least recently used first), and weights are copied back only if they changed.

Training needs gradient checkpointing: autograd must not keep a swapped layer's weights between forward
and backward; with checkpointing each layer is recomputed in backward, which fetches it again.

Full finetune: the streamed optimizer (`StreamedAdamW8bit.set_residency(swap.touch, ahead=swap.prefetch)`)
updates a swapped layer where it is, in its GPU slot: while it is there for its backward, or (exact clipping,
where updates wait for the global norm) once its next forward has prefetched it; the layer is marked changed
and copied back to the host when its slot is reused, before it is fetched again. Trained vectors (norms,
biases) stay on the GPU. LoRA / QLoRA:
only the frozen tensors are swapped (bf16, or bitsandbytes 4-bit with its quantization state); the
trainable adapters stay on the GPU, so nothing is ever copied back.

The resident count can change between steps (`set_resident`: layer_swap auto's fit to the measured peak, fit.py).
Each tensor keeps its own storage (host and slot), so `state_dict()` / `save_pretrained` see ordinary,
unshared tensors. Works from a bare loop; imports torch only. On CPU the same logic runs synchronously.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..settings import LAYER_SWAP_PREFETCH
from .layers import TensorRef, quant_state_refs
from .streams import StallMeter, Streams, pinned_empty

__all__ = ["LayerSwap", "spread_swapped"]


def spread_swapped(n_layers: int, n_swapped: int) -> list[int]:
    """Indices of `n_swapped` of `n_layers` layers, spread evenly (the last of each stride is swapped)."""
    if not 0 <= n_swapped <= n_layers:
        raise ValueError(f"cannot swap {n_swapped} of {n_layers} layers")
    return [i for i in range(n_layers) if (i + 1) * n_swapped // n_layers > i * n_swapped // n_layers]


@dataclass
class _Layer:
    index: int
    refs: list[TensorRef]
    host: list[Tensor]  # pinned, one storage per tensor
    signature: tuple
    nbytes: int  # of the host tensors: what one fetch or one copy-back moves
    slot: "_Slot | None" = None
    loaded: object = None  # event: H2D into the slot done
    host_ready: object = None  # event: the last copy-back landed (host tensors final)
    updated: object = None  # event: the last update of the weights in the slot (update stream)
    used: object = None  # event: compute is done with the slot (recorded when the next layer starts)
    dirty: bool = False
    stamp: int = 0


@dataclass
class _Slot:
    tensors: list[Tensor]
    owner: _Layer | None = None
    free: object = None  # event: the previous owner's last use (compute or copy-back) is done


class LayerSwap:
    """Keep `resident` of `layers` on `device`; swap the others through `prefetch` + 2 reused GPU slots.

    `swap_trainable`: also swap trainable parameters (full finetune; needs the streamed optimizer bound with
    `optimizer.set_residency(self.touch)`). None: swap them only when a layer's frozen tensors are the smaller
    part (so LoRA adapters stay resident, full-finetune layers are swapped whole).
    """

    def __init__(self, layers: nn.ModuleList, device: torch.device | str, *, resident: int, prefetch: int = LAYER_SWAP_PREFETCH,
                 swap_trainable: bool | None = None):
        self.device = torch.device(device)
        self.n_layers = len(layers)
        if not 0 <= resident <= self.n_layers:
            raise ValueError(f"resident={resident}: must be between 0 and the number of layers ({self.n_layers})")
        if prefetch < 0:
            raise ValueError(f"prefetch={prefetch} must be >= 0")
        self.prefetch = prefetch
        self.stack, self._swap_trainable = layers, swap_trainable
        self._streams = Streams(self.device, update_stream=False)
        self.stall = StallMeter(self._streams)
        self.swapped_indices = spread_swapped(self.n_layers, self.n_layers - resident)
        swapped = set(self.swapped_indices)
        self._layers: dict[int, _Layer] = {}
        self._by_param: dict[Tensor, _Layer] = {}
        self._handles = []
        self._clock = 0
        self._current: _Layer | None = None
        self.stats = {"h2d_bytes": 0, "d2h_bytes": 0, "loads": 0, "reloads_for_update": 0}
        for i, layer in enumerate(layers):
            if i in swapped:
                self._layers[i] = self._offload(i, layer, swap_trainable)
            else:
                layer.to(self.device)
        self._pools = self._make_pools()
        self._last: int | None = None  # the layer whose hook ran last
        for i, layer in enumerate(layers):
            # NOTE: the layer's own hook and its children's: transformers >= 5.2x checkpoints `forward`, not
            # `__call__`, so the recompute in backward runs the children's hooks but not the layer's.
            for m in (layer, *layer.children()):
                self._handles.append(m.register_forward_pre_hook(self._make_hook(i), prepend=True))

    def swaps(self, p: Tensor) -> bool:
        """Whether the trained tensor `p` lives in pinned host memory between uses (a swapped layer's)."""
        return p in self._by_param

    @property
    def resident(self) -> int:
        """Decoder layers kept on the GPU."""
        return self.n_layers - len(self._layers)

    @property
    def layer_bytes(self) -> int:
        """The GPU memory of the largest layer when resident: what moving one layer on or off changes."""
        return max(sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers())) for m in self.stack)

    @property
    def trainable_swapped(self) -> bool:
        """Some swapped tensors are trained (full finetune): the optimizer must update them via `touch`."""
        return bool(self._by_param)

    # ------------------------------------------------------------------ setup
    def _offload(self, i: int, layer: nn.Module, swap_trainable: bool | None) -> _Layer:
        frozen_refs, trainable_refs = [], []
        for mod in layer.modules():
            for name, p in mod._parameters.items():
                if p is None:
                    continue
                (trainable_refs if p.requires_grad else frozen_refs).append(TensorRef(mod, name, "param"))
                qs = getattr(p, "quant_state", None)
                if qs is not None:
                    frozen_refs.extend(quant_state_refs(qs))
            for name, b in mod._buffers.items():
                if b is not None:
                    frozen_refs.append(TensorRef(mod, name, "buffer"))
        if swap_trainable is None:
            nbytes = lambda refs: sum(r.get().numel() * r.get().element_size() for r in refs)  # noqa: E731
            swap_trainable = nbytes(frozen_refs) < nbytes(trainable_refs)
        # Trained vectors (norms, biases: kilobytes) stay on the GPU even in a swapped layer: their updates draw
        # random numbers (stochastic rounding of small tensors), so the optimizer queues them at step() itself,
        # which must not fetch the layer then -- its update waits for the next forward's prefetch.
        stay = [r for r in trainable_refs if not swap_trainable or r.get().dim() <= 1]
        refs = frozen_refs + [r for r in trainable_refs if r not in stay]
        for r in stay:
            r.set(r.get().data.to(self.device))
        pin = self._streams.is_cuda
        host = []
        for r in refs:
            t = r.get()
            h = pinned_empty(t.numel(), t.dtype, pin=pin).view(t.shape)
            h.copy_(t.data if isinstance(t, nn.Parameter) else t)
            r.set(h)  # the original storage (GPU or pageable CPU) is released here
            host.append(h)
        sig = tuple((tuple(h.shape), h.dtype) for h in host)
        lay = _Layer(i, refs, host, sig, nbytes=sum(h.numel() * h.element_size() for h in host))
        for r in refs:
            if r.kind == "param" and r.get().requires_grad:  # updated by the optimizer, through `touch`
                self._by_param[r.owner._parameters[r.name]] = lay
        return lay

    def remove(self) -> None:
        """Remove the hooks. Tensors stay where they are: swapped ones in host memory after `offload_all()`."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _make_pools(self) -> dict:
        """One pool of GPU slots per layer shape (decoder stacks may mix kinds of layers), never more slots than
        such layers."""
        counts = Counter(lay.signature for lay in self._layers.values())
        return {sig: [_Slot([torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in sig])
                      for _ in range(min(self.prefetch + 2, n))] for sig, n in counts.items()}

    def set_resident(self, resident: int) -> list[int]:
        """Keep `resident` layers on the GPU from now on: between optimizer steps, once every update of the model
        has run (`StreamedAdamW8bit.synchronize()`). Layers leave the GPU before others arrive, so the GPU never
        holds both; the swapped set changes as little as it can (layers leaving are spread over the resident ones,
        those arriving over the swapped ones). Returns the swapped indices."""
        if not 0 <= resident <= self.n_layers:
            raise ValueError(f"resident={resident}: must be between 0 and the number of layers ({self.n_layers})")
        old = sorted(self._layers)
        want = self.n_layers - resident
        if want == len(old):
            return old
        self.offload_all()
        self._streams.synchronize()
        self._pools, self._current, self._last = {}, None, None  # (slots freed before any layer moves)
        if want > len(old):
            kept = [i for i in range(self.n_layers) if i not in self._layers]
            for k in spread_swapped(len(kept), want - len(old)):
                self._layers[kept[k]] = self._offload(kept[k], self.stack[kept[k]], self._swap_trainable)
        else:
            keep = {old[k] for k in spread_swapped(len(old), want)}
            for i in old:
                if i not in keep:
                    self._bring_back(self._layers.pop(i))
        self._streams.synchronize()
        self._pools = self._make_pools()
        self.swapped_indices = sorted(self._layers)
        return self.swapped_indices

    def _bring_back(self, lay: _Layer) -> None:
        """Make a swapped layer resident: its tensors copied to the GPU, its pinned host copies released."""
        for r, h in zip(lay.refs, lay.host):
            r.set(h.to(self.device))  # (on the compute stream, where the layer runs; the host copy goes once read)
            if r.kind == "param":
                self._by_param.pop(r.owner._parameters[r.name], None)
        lay.host.clear()

    # ------------------------------------------------------------------ hooks
    def _make_hook(self, i: int):
        def hook(module, args):
            self._on_layer(i)
        return hook

    def _on_layer(self, i: int) -> None:
        lay = self._layers.get(i)
        if i == self._last and (lay is None or lay.slot is not None):
            return  # another child of the layer that is running
        self._last = i
        if lay is None:
            self._set_current(None)
            self._prefetch_from(i)
        else:
            self._ensure(lay)

    def _set_current(self, lay: _Layer | None) -> None:
        prev = self._current
        if prev is not None and prev is not lay:
            # every kernel of the previous layer has been queued: its slot is free once they ran
            prev.used = self._streams.record(self._streams.compute())
        self._current = lay

    @staticmethod
    def _in_backward() -> bool:
        return torch._C._current_autograd_node() is not None

    def _ensure(self, lay: _Layer) -> None:
        S = self._streams
        self._clock += 1
        if lay.slot is None:
            self._load(lay, protect=(lay,))
        lay.stamp = self._clock
        self._set_current(lay)
        self.stall.wait(S.compute(), lay.loaded)
        if lay.dirty and lay.updated is not None:  # an update queued on the optimizer's stream writes these weights
            S.compute().wait_event(lay.updated)
        self._prefetch_from(lay.index)

    def _order_after(self, i: int) -> list[int]:
        """Layer indices in the order they will run after layer `i` (one lap: this pass, then the next one)."""
        L = self.n_layers
        if self._in_backward():
            return list(range(i - 1, -1, -1)) + list(range(0, L))
        following = list(range(i + 1, L))
        return following + (list(range(L - 1, -1, -1)) if torch.is_grad_enabled() else list(range(0, L)))

    def _prefetch_from(self, i: int) -> None:
        if not self.prefetch or not self._layers:
            return
        want = []
        for j in self._order_after(i):
            lay = self._layers.get(j)
            if lay is not None and lay is not self._current and lay not in want:
                want.append(lay)
                if len(want) == self.prefetch:
                    break
        protect = tuple(want) + ((self._current,) if self._current is not None else ())
        for lay in want:
            if lay.slot is None and not self._load(lay, protect=protect, required=False):
                break
            lay.stamp = max(lay.stamp, self._clock)  # just fetched: not the next to be given back

    # ------------------------------------------------------------------ moving
    def _load(self, lay: _Layer, *, protect: tuple, required: bool = True) -> bool:
        S = self._streams
        slot = self._take_slot(lay.signature, protect)
        if slot is None:
            if required:
                raise RuntimeError("layer swap: no GPU slot to load a layer into (all in use)")
            return False
        if slot.free is not None:
            S.h2d.wait_event(slot.free)
        if lay.host_ready is not None:
            S.h2d.wait_event(lay.host_ready)
        with S.on(S.h2d):
            for dst, src in zip(slot.tensors, lay.host):
                dst.copy_(src, non_blocking=True)
        lay.loaded = S.record(S.h2d)
        for r, t in zip(lay.refs, slot.tensors):
            r.set(t)
        slot.owner, lay.slot = lay, slot
        lay.stamp = self._clock
        self.stats["loads"] += 1
        self.stats["h2d_bytes"] += lay.nbytes
        return True

    def _take_slot(self, signature: tuple, protect: tuple) -> _Slot | None:
        pool = self._pools[signature]
        free = [s for s in pool if s.owner is None]
        if free:
            return free[0]
        victims = [s for s in pool if s.owner not in protect]
        if not victims:
            return None
        slot = min(victims, key=lambda s: s.owner.stamp)
        self._evict(slot.owner)
        return slot

    def _evict(self, lay: _Layer) -> None:
        S, slot = self._streams, lay.slot
        # every kernel that reads this slot has been queued before `used`
        used = lay.used if lay.used is not None and lay is not self._current else S.record(S.compute())
        if lay.dirty:
            S.d2h.wait_event(used)
            if lay.updated is not None:
                S.d2h.wait_event(lay.updated)
            with S.on(S.d2h):
                for dst, src in zip(lay.host, slot.tensors):
                    dst.copy_(src, non_blocking=True)
            lay.host_ready = slot.free = S.record(S.d2h)
            self.stats["d2h_bytes"] += lay.nbytes
            lay.dirty = False
        else:
            slot.free = used
        for r, h in zip(lay.refs, lay.host):
            r.set(h)
        slot.owner, lay.slot, lay.loaded, lay.updated, lay.used = None, None, None, None, None
        if self._current is lay:
            self._current = None

    # ------------------------------------------------------------------ optimizer side
    @contextlib.contextmanager
    def touch(self, p: Tensor, stream):
        """Around an optimizer update of `p`, queued on `stream`: the weights are in a GPU slot (fetched if
        they were not), the update waits for them, and the layer is copied back before its slot is reused."""
        lay = self._by_param.get(p)
        if lay is None:
            yield
            return
        if lay.slot is None:
            protect = (lay,) + ((self._current,) if self._current is not None else ())
            self._load(lay, protect=protect)
            self.stats["reloads_for_update"] += 1
        stream.wait_event(lay.loaded)
        yield
        lay.dirty = True
        lay.updated = self._streams.record(stream)

    # ------------------------------------------------------------------ whole-model operations
    def offload_all(self) -> None:
        """Give back every slot (changed layers are copied back to the host)."""
        for lay in self._layers.values():
            if lay.slot is not None:
                self._evict(lay)

    def synchronize(self) -> None:
        self._streams.synchronize()

    def memory_stats(self) -> dict[str, int]:
        host = sum(lay.nbytes for lay in self._layers.values())
        slots = sum(t.numel() * t.element_size() for pool in self._pools.values() for s in pool for t in s.tensors)
        return {"pinned_bytes": host if self._streams.is_cuda else 0, "host_bytes": host, "gpu_slot_bytes": slots,
                "resident_layers": self.resident, "swapped_layers": len(self._layers)}
