"""Where the 8-bit AdamW states live: flat pinned host buffers (codes of both moments, their block scales and, with
gradient offload, the gradients), GPU staging slots for streamed chunks, and the states of the tensors kept on the
device. Allocated at first use: accelerate's prepare() round-trips an optimizer's state dict through the GPU, which
must not see gigabytes of host states.

With speculative clipping (speculation.py) the streamed states have two banks: an update reads a tensor's current
bank and writes the other, and the step's commit makes the other current. A rolled-back update is then undone by not
committing it -- no copy of the old states is ever made, on either side of PCIe."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor
from torchao.optim.subclass_8bit import OptimState8bit, get_qmap_signed, get_qmap_unsigned

from ..sizes import state_bytes
from ..streams import pinned_empty


@dataclass(frozen=True)
class Chunk:
    """One streamed chunk of a tensor: values [start, end) of the tensor, its rows in each bank of host states and its
    slice of the spare host buffer (gradients or backups). Views made once, since indexing costs microseconds of CPU
    per call and the updates run from backward hooks."""

    start: int
    end: int
    codes: tuple  # per bank: (exp_avg codes, exp_avg_sq codes)
    scales: tuple  # per bank: (exp_avg scales, exp_avg_sq scales)
    spare: Tensor | None  # the chunk's slice of `HostStates.host_grads`
    flat_start: int  # start in the flat host buffers (the fused kernel's Philox counter)


@dataclass
class Slot:
    """GPU staging for one chunk: both moments' codes and scales, and (optionally) its gradient."""

    codes: Tensor  # (2, chunk) uint8
    scales: Tensor  # (2, chunk // block) fp32
    grad_bytes: Tensor | None  # raw bytes for a chunk of gradient, viewed as its dtype
    free: object = None  # event: the last copy-back out of this slot is done
    views: dict = field(default_factory=dict)  # chunk length -> its views (`HostStates.slot_views`)


class HostStates:
    """The states of one optimizer's trainable tensors (those this rank owns). `offset[p]`: a streamed tensor's place
    in the flat host buffers; `on_device[p]`: (codes, scales) of a tensor whose states stay on the GPU; `place[p]`:
    an 8-bit tensor's place among all of them (the fused kernel's Philox counters); `bank[p]`: which of the
    `banks` host copies holds a streamed tensor's current states.

    `host_grads`, the spare buffer (one value per streamed value, in the weights' dtype): gradients waiting in host
    memory (`offload_gradients`) or, with `two_banks`, the weights' backups of speculative clipping -- never both in
    one step, so one buffer serves both."""

    def __init__(self, params: list[Tensor], state: dict, *, device: torch.device, block_size: int, chunk_numel: int,
                 inflight: int, offload_gradients: bool, device_state_bytes: int, owns,
                 grad_backlog_bytes: int | None, two_banks: bool = False):
        self.params, self.state, self.device = params, state, device
        self.block_size, self.chunk_numel, self.inflight = block_size, chunk_numel, inflight
        self.offload_gradients, self.device_state_bytes, self.owns = offload_gradients, device_state_bytes, owns
        self.grad_backlog_bytes = grad_backlog_bytes
        self.banks = 2 if two_banks else 1
        self.offset: dict[Tensor, int] = {}
        self.on_device: dict[Tensor, tuple] = {}
        self.place: dict[Tensor, int] = {}
        self.bank: dict[Tensor, int] = {}
        self.bank_states: dict[Tensor, list] = {}  # streamed param -> per bank, its (exp_avg, exp_avg_sq) views
        self.chunks: dict[Tensor, list] = {}  # param -> its chunks (`host_chunks`)
        self.allocated = False
        self.host_codes = self.host_scales = self.host_grads = self.bank_codes = self.bank_scales = None
        self.slots: list[Slot] = []
        self.slot_chunk, self.next_slot, self.total_8bit, self.held_limit = 0, 0, 0, 0

    def is_8bit(self, p: Tensor) -> bool:
        # torchao's rule (after bitsandbytes): only tensors of >= 4096 values, divisible into blocks.
        return p.numel() >= 4096 and p.numel() % self.block_size == 0

    def ensure(self, order: list[Tensor]) -> None:
        """Allocate everything once (`order`: model order once attached, for the states kept on the device)."""
        if not self.allocated:
            self.allocated = True
            self._init_states(order, pin=self.device.type == "cuda")
            self._init_slots()

    def _keep_on_device(self, big: list[Tensor], order: list[Tensor]) -> None:
        """The model's first tensors that fit `device_state_bytes`: backward reaches them last, so their copies could
        not overlap anything and would only lengthen the step."""
        room, candidates = self.device_state_bytes, set(big)
        for p in order:
            need = state_bytes(p.numel(), self.block_size)
            if p in candidates and p.device == self.device and p not in self.on_device and need <= room:
                room -= need
                self.on_device[p] = ()

    def _init_states(self, order: list[Tensor], *, pin: bool) -> None:
        big = [p for p in self.params if self.is_8bit(p) and self.owns(p)]
        self.total_8bit = sum(p.numel() for p in big)  # the fused update's Philox counter: step * total + place
        self._keep_on_device(big, order)
        streamed = [p for p in big if p not in self.on_device]
        total, bs = sum(p.numel() for p in streamed), self.block_size
        # One flat host buffer per kind (exactly sized, pinned once) and bank: codes of both moments, their scales;
        # and the spare buffer (gradients waiting, or the backups of speculative updates).
        nb = self.banks
        self.bank_codes = pinned_empty(nb * 2 * total, torch.uint8, pin=pin).view(nb, 2, total)
        self.bank_scales = pinned_empty(nb * 2 * total // bs, torch.float32, pin=pin).view(nb, 2, total // bs)
        self.bank_codes.zero_()
        self.bank_scales.zero_()
        self.host_codes, self.host_scales = self.bank_codes[0], self.bank_scales[0]  # (the first bank's)
        grad_dtype = streamed[0].dtype if streamed else torch.float32
        spare = self.offload_gradients or self.banks == 2
        if spare and any(p.dtype != grad_dtype for p in streamed):
            raise ValueError("offload_gradients and speculative clipping need all 8-bit-state parameters in one dtype")
        self.host_grads = pinned_empty(total, grad_dtype, pin=pin) if spare else None
        # GPU bytes of gradients allowed to wait for their update or copy (`Backlog`): two of the largest tensor, >= 1 GiB
        self.held_limit = self.grad_backlog_bytes if self.grad_backlog_bytes is not None else max(
            2 * max((p.numel() * p.element_size() for p in streamed), default=0), 2**30)
        qmaps = [torch.tensor(get_qmap_signed()), torch.tensor(get_qmap_unsigned())]
        self.qmaps_dev = [q.to(self.device) for q in qmaps]
        self._bind(qmaps, total)

    def _bind(self, qmaps: list[Tensor], total: int) -> None:
        """Each tensor's optimizer state: views of the flat buffers (streamed), device tensors (kept), or plain
        moments on the device (small tensors, as torchao keeps them)."""
        bs, off, dev_off = self.block_size, 0, total  # places: streamed tensors first (as in the buffers), then kept
        for p in self.params:
            if not self.owns(p):
                continue
            st = self.state[p]
            st["step"] = torch.tensor(0.0)
            if p not in self.on_device and not self.is_8bit(p):
                st["exp_avg"] = torch.zeros(p.shape, dtype=p.dtype, device=self.device)
                st["exp_avg_sq"] = torch.zeros(p.shape, dtype=p.dtype, device=self.device)
                continue
            n = p.numel()
            if p in self.on_device:
                self.place[p], dev_off = dev_off, dev_off + n
                codes = torch.zeros(2, n, dtype=torch.uint8, device=self.device)
                scales = torch.zeros(2, n // bs, dtype=torch.float32, device=self.device)
                self.on_device[p], maps = (codes, scales), self.qmaps_dev
            else:
                self.offset[p] = self.place[p] = off
                self.bank[p] = 0
                self.bank_states[p] = [self._moments(p, self.bank_codes[b, :, off:off + n],
                                                     self.bank_scales[b, :, off // bs:(off + n) // bs], qmaps)
                                       for b in range(self.banks)]
                st["exp_avg"], st["exp_avg_sq"] = self.bank_states[p][0]
                off += n
                continue
            st["exp_avg"], st["exp_avg_sq"] = self._moments(p, codes, scales, maps)

    @staticmethod
    def _moments(p: Tensor, codes: Tensor, scales: Tensor, maps: list) -> tuple:
        """(exp_avg, exp_avg_sq) as torchao's `OptimState8bit`s over rows of `codes` (2, n) and `scales`."""
        return tuple(OptimState8bit(codes[k].view(p.shape), scales[k], maps[k], signed, dtype=p.dtype)
                     for k, signed in enumerate((True, False)))

    def banks_of(self, p: Tensor) -> tuple[int, int]:
        """(the bank an update of `p` reads, the bank it writes): the other bank when there are two."""
        b = self.bank[p]
        return b, (b + 1) % self.banks

    def commit(self, p: Tensor) -> None:
        """`p`'s update is final: the bank it wrote becomes its current one (`state[p]` views it)."""
        if self.banks == 2:
            b = self.bank[p] = 1 - self.bank[p]
            self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"] = self.bank_states[p][b]

    def _init_slots(self) -> None:
        big = [p for p in self.params if p in self.offset]
        chunk = min(self.chunk_numel, max((p.numel() for p in big), default=self.block_size))
        gbytes = max((p.element_size() for p in big), default=4) * chunk if self.offload_gradients else 0
        self.slots = [
            Slot(codes=torch.empty(2, chunk, dtype=torch.uint8, device=self.device),
                 scales=torch.empty(2, chunk // self.block_size, dtype=torch.float32, device=self.device),
                 grad_bytes=torch.empty(gbytes, dtype=torch.uint8, device=self.device) if gbytes else None)
            for _ in range(self.inflight if big else 0)
        ]
        self.slot_chunk, self.next_slot = chunk, 0

    def take_slot(self) -> Slot:
        slot = self.slots[self.next_slot]
        self.next_slot = (self.next_slot + 1) % len(self.slots)
        return slot

    def host_chunks(self, p: Tensor) -> list[Chunk]:
        """`p`'s chunks of at most a slot's length."""
        chunks = self.chunks.get(p)
        if chunks is None:
            bs, off, n = self.block_size, self.offset[p], p.numel()
            codes, scales, grads = self.bank_codes, self.bank_scales, self.host_grads
            chunks = self.chunks[p] = []
            for s in range(0, n, self.slot_chunk):
                e = min(s + self.slot_chunk, n)
                a, b = off + s, off + e  # range in the flat host buffers
                rows = slice(a // bs, b // bs)
                chunks.append(Chunk(s, e, tuple((codes[k, 0, a:b], codes[k, 1, a:b]) for k in range(self.banks)),
                                    tuple((scales[k, 0, rows], scales[k, 1, rows]) for k in range(self.banks)),
                                    None if grads is None else grads[a:b], a))
        return chunks

    def spare(self, p: Tensor) -> Tensor:
        """`p`'s slice of the spare host buffer, shaped as `p`."""
        off = self.offset[p]
        return self.host_grads[off:off + p.numel()].view(p.shape)

    def slot_views(self, slot: Slot, n: int) -> tuple:
        """(codes, scales, code rows, scale rows, gradient) of `slot` for a chunk of `n` values (made once per n)."""
        views = slot.views.get(n)
        if views is None:
            codes, scales = slot.codes[:, :n], slot.scales[:, : n // self.block_size]
            g = None
            if slot.grad_bytes is not None:
                g = slot.grad_bytes[: n * self.host_grads.element_size()].view(self.host_grads.dtype)
            views = slot.views[n] = (codes, scales, (codes[0], codes[1]), (scales[0], scales[1]), g)
        return views

    def memory_stats(self, is_cuda: bool) -> dict[str, int]:
        if not self.allocated:
            return {"host_state_bytes": 0, "pinned_bytes": 0, "gpu_slot_bytes": 0, "gpu_state_bytes": 0}
        host = sum(t.numel() * t.element_size() for t in (self.bank_codes, self.bank_scales) if t is not None)
        host += self.host_grads.numel() * self.host_grads.element_size() if self.host_grads is not None else 0
        slots = sum(t.numel() * t.element_size() for s in self.slots
                    for t in (s.codes, s.scales, s.grad_bytes) if t is not None)
        on_device = sum(t.numel() * t.element_size() for ts in self.on_device.values() for t in ts)
        return {"host_state_bytes": host, "pinned_bytes": host if is_cuda else 0, "gpu_slot_bytes": slots,
                "gpu_state_bytes": on_device}
