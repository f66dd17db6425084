"""Activation offload: checkpointed layer inputs live in pinned CPU memory between forward and backward.

With gradient checkpointing, each decoder layer keeps only its input (batch x seq x hidden) for backward,
and recomputes the rest. `ActivationOffloader.checkpoint` is a drop-in for `torch.utils.checkpoint`: in
forward it copies each layer's input to pinned host memory on a side stream (the GPU copy is freed once the
copy lands); in backward, before a layer's recompute, it waits for that input's copy back, which was
started while the layer after it was being recomputed (`prefetch` layers ahead).

Saves L x batch x seq x hidden x 2 bytes of GPU memory (2 GiB for an 8B Llama at 8k tokens), costs the same
bytes over PCIe each way, overlapped with compute. Works from a bare loop: pass `offloader.checkpoint` where
`torch.utils.checkpoint.checkpoint` would go; `enable_activation_offload(model)` wires it into a transformers
model (its `_set_gradient_checkpointing` hook, the only seam transformers offers for this).
"""
from __future__ import annotations

import collections

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint as _checkpoint

from .streams import Streams, pinned_empty
from .wrap import add_hook, on_unwrap

__all__ = ["ActivationOffloader", "enable_activation_offload"]


class _Entry:
    __slots__ = ("host", "shape", "dtype", "stored", "gpu", "loaded")

    def __init__(self, host: Tensor, shape, dtype, stored):
        self.host, self.shape, self.dtype, self.stored = host, shape, dtype, stored
        self.gpu: Tensor | None = None
        self.loaded = None


class ActivationOffloader:
    """Offloads the first tensor argument of each checkpointed call; one instance per model.

    `max_inflight`: inputs whose copy to the host may still be pending before forward's CPU waits for the oldest
    (None: no bound). An offloaded input's GPU block is reusable only once its copy has run; the CPU queues a
    checkpointed forward far ahead of the GPU, so without a bound each layer may get a fresh block. On the H200
    the reserved GPU memory with activation offload exceeded the allocated peak by 0.45-1.2x the offloaded inputs
    (bench/results/README.md, "Fused update kernel"). With the bound at 3 (same runs): 3B at
    4 x 2048 reserved 10.97 GiB instead of 11.32, 8B at 1 x 8192 20.93 instead of 20.99; step times equal within
    0.2%. Hence the default 3.
    """

    def __init__(self, device: torch.device | str, *, prefetch: int = 1, max_inflight: int | None = 3):
        if max_inflight is not None and max_inflight < 1:
            raise ValueError(f"max_inflight={max_inflight}: use None (no bound) or at least 1")
        self.device = torch.device(device)
        self.prefetch = prefetch
        self.max_inflight = max_inflight
        self._pending: collections.deque = collections.deque()  # copy-done events of offloaded inputs, oldest first
        self._streams = Streams(self.device)
        self._host: dict[int, Tensor] = {}  # pinned buffers, reused across steps (index = layer call order)
        self._entries: list[_Entry] = []
        self.stats = {"d2h_bytes": 0, "h2d_bytes": 0}

    def pinned_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._host.values()) if self._streams.is_cuda else 0

    def memory_stats(self) -> dict[str, int]:
        """As the optimizer's and the layer swap's: host memory this offloader pins."""
        return {"pinned_bytes": self.pinned_bytes()}

    def reset(self) -> None:
        """Forget the saved inputs of an abandoned forward (a new forward starts the count again)."""
        self._entries = []
        self._pending.clear()

    # -------------------------------------------------------------- forward side
    def _save(self, x: Tensor) -> int:
        S = self._streams
        idx = len(self._entries)
        host = self._host.get(idx)
        if host is None or host.numel() < x.numel() or host.dtype != x.dtype:
            S.d2h.synchronize()  # the old buffer may still be the target of a copy
            host = self._host[idx] = pinned_empty(x.numel(), x.dtype, pin=S.is_cuda)
        dst = host[: x.numel()]
        # The copy may start only once the compute stream has produced x.
        S.d2h.wait_event(S.record(S.compute()))
        with S.on(S.d2h):
            dst.copy_(x.detach().reshape(-1), non_blocking=True)
        S.keep_alive(x, S.d2h)  # x's GPU memory is reused only after the copy lands
        stored = S.record(S.d2h)
        self._entries.append(_Entry(dst, x.shape, x.dtype, stored))
        self.stats["d2h_bytes"] += x.numel() * x.element_size()
        if self.max_inflight is not None:
            self._pending.append(stored)
            while len(self._pending) > self.max_inflight:
                self._pending.popleft().synchronize()  # the CPU waits; the GPU still has the queued layers to run
        return idx

    # -------------------------------------------------------------- backward side
    def _fetch(self, idx: int) -> None:
        e = self._entries[idx]
        if e.gpu is not None:
            return
        S = self._streams
        S.h2d.wait_event(e.stored)  # the host copy must be complete before it is read back
        with S.on(S.h2d):
            e.gpu = torch.empty(e.shape, dtype=e.dtype, device=self.device)
            e.gpu.view(-1).copy_(e.host, non_blocking=True)
        e.loaded = S.record(S.h2d)
        self.stats["h2d_bytes"] += e.host.numel() * e.host.element_size()

    def _load(self, idx: int) -> Tensor:
        S = self._streams
        self._fetch(idx)
        e = self._entries[idx]
        S.compute().wait_event(e.loaded)
        x = e.gpu
        S.keep_alive(x, S.compute())  # allocated on the H2D stream, used (and freed) on the compute stream
        e.gpu = None
        # Start bringing back the inputs of the layers recomputed next (backward runs in reverse order).
        for j in range(idx - 1, max(idx - 1 - self.prefetch, -1), -1):
            self._fetch(j)
        if idx == 0:
            self._entries = []
        return x

    def checkpoint(self, fn, *args, use_reentrant=None, preserve_rng_state=True, **kwargs):
        """`torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)` with args[0] kept in
        (pinned) host memory between forward and the recompute. (`use_reentrant` is accepted and ignored.)

        Non-reentrant, as transformers' checkpointing: backward runs through the forward's own graph and the
        recompute only rebuilds the tensors it saved, stopping once the last one is made. A decoder layer's last
        matmul (the MLP's down projection, whose output nothing saves) is not recomputed: at 16k tokens of an 8B
        Llama that is 32 matmuls, about 1.6% of the step. Gradients reach the input and any keyword tensor (a
        vision-language model's cross-attention states, shared by several layers) through that graph, once."""
        if not args or not isinstance(args[0], Tensor) or not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        x = args[0]
        held = _Held(self, fn, x)
        # (an empty tensor on x's device stands in for x among checkpoint's inputs: checkpoint keeps the random
        # state of the devices its inputs are on, which dropout's recompute needs)
        out = _checkpoint(held, x.new_empty(0), *args[1:], use_reentrant=False,
                          preserve_rng_state=preserve_rng_state, **kwargs)
        held.x = None  # from here on the input lives in host memory only: the recompute loads it back
        return out


class _Held:
    """The checkpointed call with its first argument taken out of checkpoint's inputs, which would keep it on the
    GPU until backward: forward uses the tensor itself (so the graph reaches it), the recompute its copy from the
    host, detached as checkpoint detaches the inputs it recomputes from."""

    __slots__ = ("offloader", "fn", "x", "idx", "requires_grad")

    def __init__(self, offloader: ActivationOffloader, fn, x: Tensor):
        self.offloader, self.fn, self.x, self.requires_grad = offloader, fn, x, x.requires_grad
        self.idx = offloader._save(x)

    def __call__(self, _device_of_x, *rest, **kwargs):
        x = self.x
        if x is None:
            x = self.offloader._load(self.idx).detach().requires_grad_(self.requires_grad)
        return self.fn(x, *rest, **kwargs)


_OFFLOADER = "_offload_trainer_activations"
_NONE = object()


def _checkpointing_as_it_was(model: torch.nn.Module):
    """What puts the layers' checkpointing back as it is now, and forgets the offloader (for `wrap.unwrap`)."""
    before = [(m, m.__dict__.get("_gradient_checkpointing_func", _NONE), m.gradient_checkpointing)
              for m in model.modules() if hasattr(m, "gradient_checkpointing")]

    def undo() -> None:
        for m, func, on in before:
            m.gradient_checkpointing = on
            if func is _NONE:
                m.__dict__.pop("_gradient_checkpointing_func", None)
            else:
                m._gradient_checkpointing_func = func
        model.__dict__.pop(_OFFLOADER, None)
    return undo


def enable_activation_offload(model: torch.nn.Module, *, prefetch: int = 1,
                              max_inflight: int | None = 3) -> ActivationOffloader:
    """Turn on gradient checkpointing of a transformers model with offloaded layer inputs."""
    if not hasattr(model, "_set_gradient_checkpointing"):
        raise TypeError("enable_activation_offload needs a transformers PreTrainedModel; from a bare loop, "
                        "call ActivationOffloader(device).checkpoint(layer, x) in place of checkpoint()")
    offloader = model.__dict__.get(_OFFLOADER)
    layers = [m for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")]
    if offloader is None:
        offloader = ActivationOffloader(next(model.parameters()).device, prefetch=prefetch, max_inflight=max_inflight)
        model.__dict__[_OFFLOADER] = offloader
        add_hook(model, model.register_forward_pre_hook(lambda module, args: offloader.reset()))
        on_unwrap(model, _checkpointing_as_it_was(model))
    if not all(m._gradient_checkpointing_func == offloader.checkpoint and m.gradient_checkpointing for m in layers):
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=offloader.checkpoint)
    model.config.use_cache = False
    return offloader
