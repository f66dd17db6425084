"""What a plan is made from, beside the run's switches (`OffloadSettings`): `RunShape`, what trains and how long its
rows are, and `Budget`, what the machine gives it. `plan(shape, settings, budget)` takes these three."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .shape import GiB, Machine, ModelShape


@dataclass(frozen=True)
class RunShape:
    """The model (`model`), the longest row it trains on (`seq` tokens), and how it is held: `lora_params` > 0 trains
    that many adapter parameters on a frozen base of `weight_bits` (16, or 4 for bitsandbytes NF4; the adapters and
    their optimizer stay on the GPU); `weight_bytes` per value of the model's dtype (2: bf16 / fp16, 4: float32);
    `save_shard_bytes`, the host memory a save adds (safetensors holds one shard in host memory while it writes it);
    `params`: the parameter count, where it is not the model's (None: `model.params`)."""

    model: ModelShape
    seq: int
    lora_params: int = 0
    weight_bits: int = 16
    weight_bytes: int = 2
    save_shard_bytes: int = 0
    params: int | None = None

    @property
    def n(self) -> int:
        return self.params or self.model.params


@dataclass(frozen=True)
class Budget:
    """What the machine gives the run: `gpu_gb` of GPU memory per process (None: no budget, a switch left to the
    plan is then off), `host_gb` of host memory for the node (None: unbounded), where that figure comes from
    (`host_source`, for the table), `ranks` data parallel processes (each holds its share of the optimizer states),
    `node_ranks` of them on this host (None: all), and the `machine` whose measured rates give the step time."""

    gpu_gb: float | None = None
    host_gb: float | None = None
    host_source: str = ""
    ranks: int = 1
    node_ranks: int | None = None
    machine: Machine = field(default_factory=Machine)

    @property
    def ranks_here(self) -> int:
        return self.ranks if self.node_ranks is None else self.node_ranks

    @property
    def gpu_usable(self) -> float:
        """Bytes of the GPU budget the allocator has (the CUDA context taken off); unbounded without a budget."""
        return (self.gpu_gb - self.machine.cuda_context_gib) * GiB if self.gpu_gb else math.inf

    @property
    def host_usable(self) -> float:
        """Bytes of the host budget; unbounded without one."""
        return self.host_gb * GiB if self.host_gb else math.inf
