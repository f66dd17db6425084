"""`Plan`: one predicted configuration (sizes in GiB, times in seconds), and the table the command prints of it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..settings import MLP_TILE_TOKENS
from .shape import Machine

@dataclass
class Plan:
    """A predicted configuration; sizes in GiB, times in seconds."""

    params: int
    batch: int
    seq: int
    clip: bool
    offload_gradients: bool
    lora_params: int
    activation_offload: bool
    gpu_budget_gib: float | None
    host_budget_gib: float | None
    accum: int = 1  # micro-batches per optimizer step as run (gradient_accumulation_steps / fold)
    fold: int = 1  # the Trainer's micro-batches run as one (`batch` is theirs times this)
    ranks: int = 1  # data parallel processes sharing the optimizer states
    resident_layers: int = 0  # decoder layers kept on the GPU; the others are swapped (layer_swap)
    tiled_mlp: bool = False  # each MLP run in tiles of MLP_TILE_TOKENS tokens, recomputed in backward
    tiled_layers: bool = False  # each decoder layer but its attention run so (models/tiled_layers.py)
    device_state_gib: float = 0.0  # 8-bit states kept on the GPU (the first tensors: the input embedding)
    device_states_scope: str = ""  # whose ('auto'): "embedding" (the input embedding's), "first" (and the next), "all"
    speculative_clipping: bool = False  # clip: updates during backward, a step that clips rolled back and redone
    exact_step_s: float = 0.0  # with speculative clipping: exact clipping's step time, which it falls back to
    layers: int = 0
    gpu_peak_gib: float = 0.0  # predicted torch.cuda.max_memory_reserved
    gpu_allocated_gib: float = 0.0
    host_peak_gib: float = 0.0  # RSS incl. pinned (and a save's shard)
    host_breakdown: dict = field(default_factory=dict)  # the host peak's parts (GiB), which sum to it
    host_budget_source: str = ""  # where host_budget_gib comes from: the key, or what the machine has available
    save_shard_gib: float = 0.0  # host memory a checkpoint's save adds (one safetensors shard)
    pinned_gib: float = 0.0
    pcie_gb_per_step: float = 0.0
    step_s: float = 0.0
    native_step_s: float = 0.0
    breakdown: dict = field(default_factory=dict)
    fits: bool = True
    notes: list = field(default_factory=list)
    rates_of: str = Machine.name  # the machine whose measured rates give step_s and the PCIe time

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def _optimizer_row(self) -> str:
        if self.device_states_scope == "all":
            return (f"8-bit AdamW states on the GPU ({self.device_state_gib:.2f} GiB: the budget has room for all; "
                    f"nothing streamed)")
        row = "8-bit AdamW states in pinned CPU memory, streamed"
        if not self.device_state_gib:
            return row
        whose = {"embedding": "the input embedding's",
                 "first": "the model's first tensors': the input embedding's, then the first layers'"}.get(
            self.device_states_scope, "the model's first tensors'")
        return row + f"; {self.device_state_gib:.2f} GiB of them ({whose}) kept on the GPU"

    def _updates_row(self) -> str:
        if self.speculative_clipping:
            return (f"during backward, clipped speculatively (a step whose clip fires is rolled back and run again; "
                    f"while most steps clip, exact clipping: {self.exact_step_s:.2f} s per step)")
        return "after backward, exact clipping" if self.clip else "during backward (no clipping)"

    def _gradients_row(self) -> str:
        waits = [w for w, on in (("between micro-batches", self.accum > 1),
                                 ("until the norm is known", self.clip and not self.speculative_clipping)) if on]
        if not waits:
            return "freed as used"
        return ("pinned CPU memory " if self.offload_gradients else "on the GPU ") + " and ".join(waits)

    def table(self) -> str:
        rows = [
            ("parameters", f"{self.params / 1e9:.2f} B" if self.params >= 1e9 else f"{self.params / 1e6:.1f} M"),
            ("micro-batch", f"{self.batch} x {self.seq} tokens"
             + (f" ({self.fold} of the Trainer's micro-batches of {self.batch // self.fold} x {self.seq} run as one: "
                f"the same samples per step)" if self.fold > 1 else "")
             + (f", {self.accum} per optimizer step (gradient accumulation)" if self.accum > 1 else "")
             + (f", on each of {self.ranks} GPUs (data parallel: each holds 1/{self.ranks} of the optimizer states; "
                f"GPU figures per GPU, host figures per node)" if self.ranks > 1 else "")),
        ]
        if self.lora_params:
            rows += [("training", f"LoRA: {self.lora_params / 1e6:.1f} M adapter parameters, their gradients and "
                                  f"AdamW states on the GPU; base weights frozen")]
        else:
            rows += [
                ("optimizer", self._optimizer_row()),
                ("updates", self._updates_row()),
                ("gradients", self._gradients_row()),
            ]
        rows += [
            ("activations", ("layer inputs in pinned CPU memory" if self.activation_offload else "on the GPU")
             + (f"; each decoder layer but its attention in tiles of {MLP_TILE_TOKENS} tokens, recomputed in backward"
                if self.tiled_layers else
                f"; each MLP in tiles of {MLP_TILE_TOKENS} tokens, recomputed in backward" if self.tiled_mlp else "")),
            ("decoder layers", f"all {self.layers} on the GPU" if self.resident_layers == self.layers else
             f"{self.resident_layers} of {self.layers} on the GPU, {self.layers - self.resident_layers} swapped "
             f"from pinned CPU memory"),
            ("GPU peak (reserved)", f"{self.gpu_peak_gib:.1f} GiB"
             + (f" of {self.gpu_budget_gib:g} GiB" if self.gpu_budget_gib else
                " (no GPU budget: this machine has no GPU; gpu_memory_limit_gb plans for a card of that size)")),
            ("host peak (RSS + pinned)", f"{self.host_peak_gib:.1f} GiB"
             + (f" (with a save's {self.save_shard_gib:.1f} GiB shard)" if self.save_shard_gib else "")
             + (f" of {self.host_budget_gib:.1f} GiB" if self.host_budget_gib else "")
             + (f" ({self.host_budget_source})" if self.host_budget_gib and self.host_budget_source else "")),
            ("PCIe per step", f"{self.pcie_gb_per_step:.1f} GB"),
            ("step time", f"{self.step_s:.2f} s ({self.ranks * self.accum * self.batch * self.seq / self.step_s:,.0f} "
                          f"tok/s{f' over {self.ranks} GPUs' if self.ranks > 1 else ''}; "
                          f"all on one big GPU: {self.native_step_s:.2f} s) at the rates of {self.rates_of}"),
        ]
        w = max(len(k) for k, _ in rows)
        lines = [f"{k.ljust(w)}  {v}" for k, v in rows]
        lines += ["GPU memory breakdown (GiB): " + ", ".join(f"{k} {v:.2f}" for k, v in self.breakdown.items())]
        lines += ["host memory breakdown (GiB): " + ", ".join(f"{k} {v:.2f}" for k, v in self.host_breakdown.items())]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)
