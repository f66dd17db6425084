"""Memory planner: predict GPU peak, host peak, PCIe traffic and step time of a full finetune before any
weight is loaded, pick what to offload for a GPU budget, and refuse plans that cannot fit.

Inputs are a model config (anything with `hidden_size`, `intermediate_size`, `num_hidden_layers`,
`num_attention_heads`, `num_key_value_heads`, `vocab_size`: a transformers config or a plain namespace),
the micro-batch shape and the budgets. The model of memory is the sum of what the step holds (weights,
streamed-optimizer slots, checkpointed layer inputs) plus the largest transient phase (loss chunk and
LM-head gradient at the start of backward; one layer's recompute and gradients in the middle), plus the
allocator's slack, with constants calibrated on the H200 runs in bench/results (see `Machine`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass, field

from .sysinfo import host_memory_gib  # noqa: F401  (re-exported for the CLI)

GiB = 2**30


class PlanError(ValueError):
    """No plan fits: the message says which knob to change and by how much."""


@dataclass(frozen=True)
class Machine:
    """Rates and constants of the machine. Defaults: measured on one H200 + PCIe Gen5 (bench/results)."""

    name: str = "one H200 (PCIe Gen5)"  # whose rates these are: the step-time and traffic figures say so
    h2d_gb_s: float = 51.0  # pinned host -> GPU, one direction, while the other runs too
    d2h_gb_s: float = 51.0
    train_flops: float = 5.2e14  # bf16 FLOP/s of a checkpointed train step (model FLOPs, incl. recompute)
    cpu_s_per_chunk: float = 3.5e-4  # Python + launch cost of one streamed chunk update
    # CPU time to queue one decoder layer's forward, recompute and backward (HF Llama layer, SDPA, checkpointing):
    # native 3B at 1 x 2048 is paced by the CPU (compute stream busy 135 ms of a 0.17-0.24 s step): 0.174 and
    # 0.240 s per step (medians) over 28 layers in two runs (20261130-s14a, -s14b)
    cpu_s_per_layer: float = 7.4e-3
    cuda_context_gib: float = 0.7  # taken from the card outside PyTorch's allocator
    # a training process's RSS beside its pinned buffers (torch, CUDA runtime, transformers, the batch): 1.66-1.74 GiB
    # measured before any profiling (3B rows of runs 20261130-s17d, -s17e); 1.5 before, which put hosts 2-10% under
    host_base_gib: float = 1.7
    backward_inflation: float = 1.08  # update kernels running beside backward slow it (8B: 1077 vs 980 ms)
    nf4_slowdown: float = 1.40  # bitsandbytes NF4 matmuls dequantize every weight each use (70B QLoRA: 2.38 s
    #                             measured vs 1.70 s at the bf16 rate)


class UnknownArchitecture(PlanError, TypeError):
    """A model type whose structure the planner does not model: it would be planned wrong, so it is not planned."""


# model_type -> what differs from a Llama layer; a config-like object without a model_type is planned as a Llama
KNOWN_TYPES = {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "mllama",
               "mllama_text_model"}


@dataclass
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    vision_linear: int = 0  # a vision encoder's linear weights (quantized with the decoder's under 4-bit)
    vision_other: int = 0  # its embeddings, norms and biases, and the projector into the language model
    cross_layers: int = 0  # decoder layers that cross-attend to the image's tokens (Mllama)
    cross_tokens: int = 0  # image tokens each sequence's cross-attention reads
    head_dim: int = 0  # (0: hidden / heads)
    qk_norm: bool = False  # per-head RMSNorm of queries and keys (Qwen3; Mllama's cross-attention layers)
    extra_embeddings: int = 0  # rows of the input embedding beyond the vocabulary (Mllama's image tokens)
    experts: int = 0  # mixture of experts: experts per MoE layer (Mixtral, Qwen-MoE), 0 for a dense model
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # Qwen2-MoE's shared expert (and its gate), 0 without one
    moe_layers: int = 0  # layers whose MLP is the experts (the others are dense, of `intermediate`)

    @classmethod
    def from_config(cls, cfg) -> "ModelShape":
        text = getattr(cfg, "text_config", None) or cfg
        kind = getattr(text, "model_type", None)
        if kind is not None and kind not in KNOWN_TYPES:
            raise UnknownArchitecture(f"the planner does not know model_type {kind!r} (it plans "
                                      f"{', '.join(sorted(KNOWN_TYPES))}): set the offload switches yourself "
                                      f"(offload_gradients, activation_offload, layer_swap: N)")
        vision = getattr(cfg, "vision_config", None)
        return cls(hidden=text.hidden_size, intermediate=text.intermediate_size, layers=text.num_hidden_layers,
                   heads=text.num_attention_heads, kv_heads=getattr(text, "num_key_value_heads", None)
                   or text.num_attention_heads, vocab=text.vocab_size,
                   tied=bool(getattr(text, "tie_word_embeddings", getattr(cfg, "tie_word_embeddings", False))),
                   qkv_bias=kind in ("qwen2", "qwen2_moe"), qk_norm=kind in ("qwen3", "qwen3_moe"),
                   head_dim=getattr(text, "head_dim", None) or 0,
                   cross_layers=len(getattr(text, "cross_attention_layers", None) or ()),
                   extra_embeddings=8 if kind == "mllama_text_model" else 0,
                   **_experts(text, kind), **(_mllama_vision(vision, text.hidden_size) if vision is not None else {}))

    @property
    def dh(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.dh * self.kv_heads

    @property
    def attn_params(self) -> int:
        h, q, kv = self.hidden, self.dh * self.heads, self.kv_dim
        return 2 * h * q + 2 * h * kv + ((q + 2 * kv) if self.qkv_bias else 0) + (2 * self.dh if self.qk_norm else 0)

    @property
    def moe_mlp_params(self) -> int:
        """One MoE layer's MLP: every expert, the router, and a shared expert with its gate."""
        h = self.hidden
        shared = 3 * h * self.shared_intermediate + h if self.shared_intermediate else 0
        return self.experts * 3 * h * self.expert_intermediate + h * self.experts + shared

    @property
    def layer_params(self) -> int:
        """The largest decoder layer (an MoE layer where there are experts): what a swap slot holds."""
        mlp = self.moe_mlp_params if self.moe_layers else 3 * self.hidden * self.intermediate
        return self.attn_params + mlp + 2 * self.hidden

    @property
    def layers_params(self) -> int:
        """All decoder layers together (dense and MoE; Mllama's cross-attention layers' norms and gates)."""
        dense = 3 * self.hidden * self.intermediate
        mlps = self.moe_layers * self.moe_mlp_params + (self.layers - self.moe_layers) * dense
        cross = self.cross_layers * (2 * self.dh + 2)
        return self.layers * (self.attn_params + 2 * self.hidden) + mlps + cross

    @property
    def active_params(self) -> int:
        """Parameters a token's forward uses: all but the experts it is not routed to."""
        idle = self.moe_layers * (self.experts - self.experts_per_token) * 3 * self.hidden * self.expert_intermediate
        return self.params - idle

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of a decoder layer, by its usual HF name (attention, and the dense or
        shared-expert MLP: the experts' weights are fused 3-D tensors, not nn.Linear, in transformers 5)."""
        h, q, kv = self.hidden, self.dh * self.heads, self.kv_dim
        inter = self.shared_intermediate if self.moe_layers else self.intermediate
        shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        if inter:
            shapes |= {"gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
        return shapes

    def lora_params(self, r: int, targets: str = "all-linear") -> int:
        """Trainable parameters of LoRA rank `r` on `targets` ('all-linear' or comma-separated names)."""
        shapes = self.linear_shapes()
        names = list(shapes) if targets == "all-linear" else [t.strip() for t in targets.split(",")]
        return self.layers * sum(r * (shapes[n][0] + shapes[n][1]) for n in names if n in shapes)

    @property
    def params(self) -> int:
        embed = (self.vocab + self.extra_embeddings) * self.hidden
        return (embed + (0 if self.tied else self.vocab * self.hidden) + self.layers_params + self.hidden
                + self.vision_linear + self.vision_other)


def _experts(text, kind) -> dict:
    """The mixture-of-experts fields of a config (Mixtral: every layer; Qwen-MoE: every `decoder_sparse_step`-th
    layer but those in `mlp_only_layers`, and Qwen2-MoE's shared expert)."""
    n = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None) or 0
    if kind not in ("mixtral", "qwen2_moe", "qwen3_moe") or not n:
        return {}
    if kind == "mixtral":
        return dict(experts=n, experts_per_token=text.num_experts_per_tok, expert_intermediate=text.intermediate_size,
                    moe_layers=text.num_hidden_layers)
    step, dense = getattr(text, "decoder_sparse_step", 1) or 1, set(getattr(text, "mlp_only_layers", None) or ())
    moe = sum(1 for i in range(text.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    return dict(experts=n, experts_per_token=text.num_experts_per_tok, expert_intermediate=text.moe_intermediate_size,
                shared_intermediate=getattr(text, "shared_expert_intermediate_size", 0) or 0, moe_layers=moe)


def _mllama_vision(vc, text_hidden: int) -> dict:
    """Parameters of an Mllama (Llama-3.2-Vision) vision encoder and projector, from its config."""
    h, inter, n_global = vc.hidden_size, vc.intermediate_size, getattr(vc, "num_global_layers", 0)
    n_layers = vc.num_hidden_layers + n_global
    patches = (vc.image_size // vc.patch_size) ** 2 + 1  # + the class token
    tiles, ratio_ids = vc.max_num_tiles, len(vc.supported_aspect_ratios) + 1
    other = (n_layers * (inter + h + 4 * h) + 2 * n_global  # fc biases, two LayerNorms per layer; global gates
             + 3 * vc.patch_size ** 2 * h + h + patches * h + 1  # patch conv, class token, positions (gated)
             + ratio_ids * tiles * patches * h  # per-tile position embedding, by aspect ratio
             + 2 * (ratio_ids * tiles * h + 1) + 4 * h  # pre/post tile embeddings (gated), pre/post LayerNorms
             + vc.vision_output_dim * text_hidden + text_hidden)  # projector into the language model
    padded = -(-patches // 8) * 8  # Mllama pads each tile's patches to a multiple of 8
    return dict(vision_linear=n_layers * (4 * h * h + 2 * h * inter), vision_other=other, cross_tokens=tiles * padded)


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
    accum: int = 1  # micro-batches per optimizer step (gradient_accumulation_steps)
    ranks: int = 1  # data parallel processes sharing the optimizer states
    resident_layers: int = 0  # decoder layers kept on the GPU; the others are swapped (layer_swap)
    device_state_gib: float = 0.0  # 8-bit states kept on the GPU (the first tensors: the input embedding)
    device_states_scope: str = ""  # whose ('auto'): "embedding" (the input embedding's), "first" (and the next), "all"
    layers: int = 0
    gpu_peak_gib: float = 0.0  # predicted torch.cuda.max_memory_reserved
    gpu_allocated_gib: float = 0.0
    host_peak_gib: float = 0.0  # RSS incl. pinned (and a save's shard)
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

    def _gradients_row(self) -> str:
        waits = [w for w, on in (("between micro-batches", self.accum > 1), ("until the norm is known", self.clip))
                 if on]
        if not waits:
            return "freed as used"
        return ("pinned CPU memory " if self.offload_gradients else "on the GPU ") + " and ".join(waits)

    def table(self) -> str:
        rows = [
            ("parameters", f"{self.params / 1e9:.2f} B" if self.params >= 1e9 else f"{self.params / 1e6:.1f} M"),
            ("micro-batch", f"{self.batch} x {self.seq} tokens"
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
                ("updates", "after backward, exact clipping" if self.clip else "during backward (no clipping)"),
                ("gradients", self._gradients_row()),
            ]
        rows += [
            ("activations", "layer inputs in pinned CPU memory" if self.activation_offload else "on the GPU"),
            ("decoder layers", f"all {self.layers} on the GPU" if self.resident_layers == self.layers else
             f"{self.resident_layers} of {self.layers} on the GPU, {self.layers - self.resident_layers} swapped "
             f"from pinned CPU memory"),
            ("GPU peak (reserved)", f"{self.gpu_peak_gib:.1f} GiB"
             + (f" of {self.gpu_budget_gib:g} GiB" if self.gpu_budget_gib else
                " (no GPU budget: this machine has no GPU; gpu_memory_limit_gb plans for a card of that size)")),
            ("host peak (RSS + pinned)", f"{self.host_peak_gib:.1f} GiB"
             + (f" (with a save's {self.save_shard_gib:.1f} GiB shard)" if self.save_shard_gib else "")
             + (f" of {self.host_budget_gib:.1f} GiB" if self.host_budget_gib else "")),
            ("PCIe per step", f"{self.pcie_gb_per_step:.1f} GB"),
            ("step time", f"{self.step_s:.2f} s ({self.ranks * self.accum * self.batch * self.seq / self.step_s:,.0f} "
                          f"tok/s{f' over {self.ranks} GPUs' if self.ranks > 1 else ''}; "
                          f"all on one big GPU: {self.native_step_s:.2f} s) at the rates of {self.rates_of}"),
        ]
        w = max(len(k) for k, _ in rows)
        lines = [f"{k.ljust(w)}  {v}" for k, v in rows]
        lines += ["GPU memory breakdown (GiB): " + ", ".join(f"{k} {v:.2f}" for k, v in self.breakdown.items())]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _estimate(shape: ModelShape, params: int, *, batch: int, seq: int, clip: bool, offload_gradients: bool,
              activation_offload: bool, loss_chunk: int, chunk_numel: int, inflight: int, machine: Machine,
              resident: int | None = None, swap_slots: int = 3, lora: int = 0, weight_bits: int = 16,
              block: int = 256, accum: int = 1, ranks: int = 1, node_ranks: int = 1, fused_update: bool = True,
              device_states: float = 0, save_shard: int = 0, wb: int = 2) -> dict:
    """Memory of one micro-batch of `batch` x `seq` tokens; traffic and time of one optimizer step of `accum`
    micro-batches. Data parallel over `ranks` processes (`node_ranks` of them on this host): each holds 1/ranks of
    the states; GPU figures are per process, host figures per node. `device_states`: bytes of 8-bit states kept on
    the GPU (their tensors' gradients are never offloaded either). `wb`: bytes per value of the model's dtype (weights,
    gradients, activations: 2 for bf16, 4 for float32); the 8-bit states are 2 bytes per value whatever it is."""
    h, inter, L, V = shape.hidden, shape.intermediate, shape.layers, shape.vocab
    T = batch * seq
    swapped = L - (L if resident is None else resident)
    if weight_bits == 4:  # NF4 linears: half a byte per value + absmax (1 byte per 64, double-quantized); bf16 norms
        layer_bytes = (shape.layer_params - 2 * h) * (0.5 + 1 / 64) + 2 * h * wb
    else:
        layer_bytes = wb * shape.layer_params
    # reused GPU slots of the swapped layers: a pool per kind of layer (Mllama: self- and cross-attention)
    pools = 2 if shape.cross_layers and swapped > shape.cross_layers else 1
    swap_gpu = min(swap_slots, swapped) * layer_bytes * pools
    vision_bytes = shape.vision_linear * ((0.5 + 1 / 64) if weight_bits == 4 else wb)
    # (resident layers counted at the largest layer's size: an MoE model's dense layers are over-counted)
    weights = wb * (params - shape.layers_params - shape.vision_linear) + (L - swapped) * layer_bytes + vision_bytes
    largest = V * h
    chunk = min(chunk_numel, largest)
    all_states = 2 * params * (1 + 4 / block) / ranks  # this process's share of the 8-bit states
    streamed_any = device_states < all_states  # (all on the GPU: no slots either)
    slots = inflight * chunk * (2 + 8 / block + (wb if offload_gradients else 0)) if not lora and streamed_any else 0
    # torchao's compiled update materialises both fp32 moments of a chunk; the fused kernel keeps them in registers
    update_temps = 2 * 4 * chunk if not (lora or fused_update) else 0
    adapters = 16 * lora  # LoRA: fp32 weights, gradients and two AdamW moments, all on the GPU
    ckpt_per_layer = T * h * wb
    checkpoints = (2 if activation_offload else L) * ckpt_per_layer  # offloaded: the one in use + one prefetched
    loss = (loss_chunk if loss_chunk else T) * V * 10 + 2 * T * h * wb  # fp32 logits + grad, bf16 logits; hidden
    head_grad = wb * largest if not lora else 0
    layer_ws = (10 * T * h + 6 * T * inter) * wb  # one layer's recompute activations and their grads
    if weight_bits == 4:
        layer_ws += 2 * h * inter  # the largest weight, dequantized for its matmul
    if shape.cross_layers:
        # SDPA with the image mask runs the math kernel: the (heads x tokens x image tokens) scores are materialised,
        # ~4 bf16 copies in the recompute + backward of a cross-attention layer (measured: 90B Vision, 1 x 2048)
        layer_ws += 4 * shape.heads * T * shape.cross_tokens * wb
    layer_grads = wb * shape.layer_params if not lora else 0
    grads_wait = clip or accum > 1  # gradients outlive their backward: until the norm, or the next micro-batch
    grads_kept = wb * params if grads_wait and not offload_gradients and not lora else 0
    if ranks > 1 and grads_kept:  # data parallel: once reduced, each owner keeps its share (micro-batches before
        # the last sum on each device, unless offload_gradients reduces each one and sums the means on the host)
        grads_kept = wb * params if accum > 1 else wb * params / ranks
    device_grads = device_states / (1 + 4 / block) * wb / 2  # the gradients of the tensors whose states stay
    if grads_kept and accum > 1:
        # the sums of earlier micro-batches are live through each later micro-batch's backward
        start = phase = grads_kept + checkpoints + max(loss + head_grad, layer_ws)
    elif grads_kept:
        # gradients pile up while checkpoints are freed: the peak is at the start or at the end of backward
        start = checkpoints + loss + head_grad
        phase = max(start, grads_kept + layer_ws)
    else:  # updates lag backward by about a layer
        start = phase = checkpoints + max(loss + head_grad, layer_ws + 2 * layer_grads)
        if grads_wait and offload_gradients and device_grads:
            # the gradients of tensors whose states stay on the GPU stay there too, until the step: with one
            # micro-batch, made at the end of backward (the embedding's first), when the checkpoints are gone; when
            # accumulating, their sums stay through every later micro-batch's peak
            grads_kept = device_grads
            if accum > 1:
                start = phase = start + device_grads
            else:
                phase = max(phase, grads_kept + layer_ws + 2 * layer_grads)
    allocated = weights + swap_gpu + slots + update_temps + adapters + device_states + phase
    slack = 9 * T * inter * wb  # allocator blocks freed between layers but not reused across sizes
    reserved = allocated + slack

    states = all_states - device_states if not lora else 0  # this process's, streamed
    host_grads = wb * params / ranks - device_grads if offload_gradients and not lora else 0
    host_acts = L * ckpt_per_layer if activation_offload else 0
    pinned = node_ranks * (states + host_grads + host_acts + swapped * layer_bytes)
    host = node_ranks * machine.host_base_gib * GiB + pinned + save_shard  # (one process saves)

    # a swapped layer is fetched twice per micro-batch (forward, recompute + backward) and, changed, copied back
    # once per step (with clipping it is updated in the slot its next forward fetches it into)
    # (LoRA: frozen layers are never copied back)
    swap_h2d = 2 * accum * swapped * layer_bytes
    swap_d2h = swapped * layer_bytes if not lora else 0
    # host gradients: each micro-batch but the last adds into the host sum (H2D of the sum from the 2nd on, D2H);
    # the last reads it back; with clipping the total goes out once more and comes back for the update
    host_sums = accum > 1  # (data parallel: each owner sums the means of its share)
    grad_moves = ((accum - 1 if host_sums else 0) + (1 if clip else 0)) * host_grads
    h2d = states + grad_moves + accum * host_acts + swap_h2d
    d2h = states + grad_moves + accum * host_acts + swap_d2h
    pcie = h2d + d2h
    # weights: forward + recompute + backward (input and weight gradients; LoRA: input gradients only)
    active = params - (shape.params - shape.active_params)  # (an MoE token uses experts_per_token of the experts)
    flops = (6 if lora else 8) * active * T + 8 * L * T * seq * h  # + causal attention
    flops += 16 * shape.cross_layers * T * shape.cross_tokens * h  # + cross-attention to the image (fwd x2, bwd)
    t_micro = flops / machine.train_flops * (machine.nf4_slowdown if weight_bits == 4 else 1.0)
    t_compute = accum * t_micro
    t_native = t_compute + (16 * params / 4.0e12 if not lora else 0.0)  # AdamW: ~16 B/param at ~4 TB/s
    per_layer = [fan_in * fan_out for fan_in, fan_out in shape.linear_shapes().values()]
    n_chunks = L * (2 + sum(math.ceil(x / chunk) for x in per_layer)) + 2 * math.ceil(largest / chunk)
    # Launching chunk updates from Python competes with launching the step's own kernels; measured: hidden
    # on 8B at 8k tokens (1 s steps), not on 3B at 4k (0.25 s steps).
    t_cpu = n_chunks * machine.cpu_s_per_chunk * max(0.0, 1 - t_micro / 1.1) if not lora else 0.0
    if lora:
        step = t_compute
    elif clip:
        # the update waits for the global norm: after backward, states (and host gradients) cross PCIe -- and the
        # swapped layers, fetched for the forward that waits for their updates; only that forward (~1/4 of a
        # micro-batch) overlaps them (8B at 12 GiB, 26 of 32 layers swapped: 1.685 s measured, 1.649 s by this)
        post = (states + host_grads + swapped * layer_bytes) / (machine.h2d_gb_s * 1e9)
        step = t_compute + max(0.0, post - t_micro / 4) + t_cpu
    else:
        step = t_micro * machine.backward_inflation + (accum - 1) * t_micro + t_cpu
    if host_sums and host_grads:
        # Gradient sums in pinned memory: a micro-batch's sums cross PCIe (both ways at once) during its backward,
        # not its forward, so each micro-batch takes its forward plus the longer of its backward and its copies;
        # the last also streams the states (measured 8B, 4 x (1 x 2048) at 24 GiB: 2.08 s, 2.42 s with clipping)
        t_f, t_b = t_micro / 4, t_micro * 3 / 4
        g, st = host_grads / (machine.h2d_gb_s * 1e9), states / (machine.h2d_gb_s * 1e9)
        step = (accum - 1) * (t_f + max(t_b, g)) + t_cpu
        step += t_f + max(t_b, g) + max(0.0, st + g - t_f) if clip else t_f + max(t_b * machine.backward_inflation,
                                                                                    g + st)
    if activation_offload:
        step += accum * max(0.0, host_acts / (machine.d2h_gb_s * 1e9) - t_micro / 4)  # copies beyond overlap
    copies_s = max(h2d / (machine.h2d_gb_s * 1e9), d2h / (machine.d2h_gb_s * 1e9))  # the busier direction
    if swapped or (host_sums and host_grads):
        # the copy engines are busy for (states, host gradients, layers, activations) each way: the step is at
        # least as long as the busier direction
        step = max(step, copies_s)
    # One thread queues every kernel of the step and, from backward's hooks, every chunk update: on small
    # micro-batches that, not the GPU, sets the pace (3B at 1 x 2048, natively too)
    cpu_floor = accum * L * machine.cpu_s_per_layer + (n_chunks * machine.cpu_s_per_chunk if not lora else 0.0)
    cpu_bound = (cpu_floor, step) if cpu_floor > step else None
    step = max(step, cpu_floor)
    return dict(reserved=reserved, allocated=allocated, host=host, pinned=pinned, pcie=pcie, step=step,
                native=t_native, cpu_bound=cpu_bound,
                breakdown={"weights": weights / GiB, "swap slots": swap_gpu / GiB,
                           **({"LoRA adapters + AdamW": adapters / GiB} if lora else {}),
                           "optimizer slots": (slots + update_temps) / GiB,
                           **({"optimizer states on the GPU": device_states / GiB} if device_states else {}),
                           **_peak_parts(phase, start, checkpoints, grads_kept, throughout=accum > 1),
                           "allocator slack": slack / GiB})


def _peak_parts(phase: float, start: float, checkpoints: float, grads_kept: float, throughout: bool = False) -> dict:
    """What is live at the phase's peak (GiB): the peak of backward's start and middle (`start`: checkpoints, the loss
    and head gradient or a layer's work; kept gradients not made yet), or, when higher, its end (the kept gradients
    and a layer's work, the checkpoints freed). `throughout`: the kept gradients are live at the start too (sums
    of earlier micro-batches)."""
    if grads_kept and throughout and phase == start:
        return {"gradients kept": grads_kept / GiB, "checkpointed activations": checkpoints / GiB,
                "largest transient": (phase - grads_kept - checkpoints) / GiB}
    if grads_kept and phase > start:  # the end of backward
        return {"gradients kept": grads_kept / GiB, "checkpointed activations": 0.0,
                "largest transient": (phase - grads_kept) / GiB}
    return {"gradients kept": 0.0, "checkpointed activations": checkpoints / GiB,
            "largest transient": (phase - checkpoints) / GiB}


def plan(config, *, batch: int, seq: int, gpu_memory_limit_gb: float | None = None,
         host_memory_gb: float | None = None, max_grad_norm: float = 1.0, loss_chunk: int = 1024,
         chunk_numel: int = 2**25, inflight: int = 4, activation_offload: bool | None = None,
         offload_gradients: bool | None = None, params: int | None = None, layer_swap: bool | int | None = False,
         lora_params: int = 0, weight_bits: int = 16, accum: int = 1, ranks: int = 1, node_ranks: int | None = None,
         fused_update: bool = True, device_states: str | float = 0, save_shard_bytes: int = 0,
         weight_bytes: int = 2, machine: Machine = Machine()) -> Plan:
    """The fastest configuration that fits the budgets (None = let the planner choose a switch).

    `layer_swap`: False keeps every decoder layer on the GPU; None swaps as few as the GPU budget needs;
    an int keeps that many resident. `accum`: micro-batches per optimizer step (gradient accumulation; their
    gradients wait between micro-batches, on the GPU or with `offload_gradients` in pinned memory).
    `ranks`: data parallel processes (each holds its share of the optimizer states), `node_ranks` of them on this
    host (default: all): GPU figures are per GPU, host figures (and `host_memory_gb`) for the whole node.
    `lora_params` > 0: LoRA with that many adapter parameters on a frozen base
    of `weight_bits` (16, or 4 for bitsandbytes NF4); the adapters and their optimizer stay on the GPU.
    `fused_update`: the optimizer's Triton update (its default on CUDA); False: torchao's compiled update.
    `weight_bytes`: bytes per value of the model's dtype (2: bf16 / fp16, 4: float32).
    `save_shard_bytes`: host memory a checkpoint's save adds (safetensors holds one shard in host memory while it
    writes it; `plan_from_args` counts one `SAVE_SHARD_BYTES` shard, or the whole weights when smaller).
    `device_states`: GiB of 8-bit states kept on the GPU (`StreamedAdamW8bit(device_state_bytes=)`), or "auto" (with a
    GPU budget): the input embedding's, when the plan chosen without them leaves room for them (and their gradient,
    when gradients would wait on the host) within the GPU budget less `DEVICE_STATE_MARGIN_GIB`; then the next
    tensors' in model order, as many as leave max(`DEVICE_STATE_FILL_MARGIN_GIB`, `DEVICE_STATE_FILL_FRACTION` of the
    budget) free (all of them for a 3B model on 24 GiB: no PCIe traffic at all) -- with one process, and only where
    the plan needs neither activation offload nor layer swap to fit (a tight plan gets no extras).
    Backward reaches the embedding last, so its states' copies would follow backward's last kernel (3B with its tied
    embedding at 4 x 2048 on the H200: ~16 ms of a 0.54 s step).

    Raises PlanError, naming the knob to change, when none fits.
    """
    shape = ModelShape.from_config(config)
    n = params or shape.params
    L = shape.layers
    clip = bool(max_grad_norm and max_grad_norm > 0)
    acts = [False, True] if activation_offload is None else [activation_offload]
    grads_wait = clip or accum > 1
    grads = ([False, True] if offload_gradients is None else [offload_gradients]) if grads_wait and not lora_params \
        else [False]
    gpu_usable = (gpu_memory_limit_gb - machine.cuda_context_gib) * GiB if gpu_memory_limit_gb else math.inf
    host_usable = host_memory_gb * GiB if host_memory_gb else math.inf
    auto_states = device_states == "auto"
    fixed_states = 0.0 if auto_states or lora_params else float(device_states or 0) * GiB
    estimate = functools.partial(_estimate, shape, n, clip=clip, loss_chunk=loss_chunk, chunk_numel=chunk_numel,
                                 inflight=inflight, machine=machine, lora=lora_params, weight_bits=weight_bits,
                                 accum=accum, ranks=ranks, node_ranks=ranks if node_ranks is None else node_ranks,
                                 fused_update=fused_update, device_states=fixed_states,
                                 save_shard=save_shard_bytes, wb=weight_bytes)
    tried = []
    # Every layer resident first (no swap traffic); then as many resident layers as fit.
    if layer_swap is False:
        residents = [L]
    elif layer_swap is None or layer_swap is True:
        residents = range(L, -1, -1)
    else:
        residents = [min(int(layer_swap), L)]
    for resident in residents:
        for act in acts:
            for og in grads:
                switches = dict(batch=batch, seq=seq, offload_gradients=og, activation_offload=act, resident=resident)
                e = estimate(**switches)
                p = Plan(params=n, batch=batch, seq=seq, clip=clip, offload_gradients=og, lora_params=lora_params,
                         rates_of=machine.name,
                         activation_offload=act, accum=accum, ranks=ranks,
                         gpu_budget_gib=gpu_memory_limit_gb, host_budget_gib=host_memory_gb,
                         resident_layers=resident, layers=L, device_state_gib=fixed_states / GiB,
                         save_shard_gib=save_shard_bytes / GiB, **_predicted(e))
                p.fits = e["reserved"] <= gpu_usable and e["host"] <= host_usable
                tried.append(p)
                if p.fits and auto_states and gpu_memory_limit_gb and not (lora_params or act or resident < L) \
                        and ranks == 1:
                    want = 2 * shape.vocab * shape.hidden * (1 + 4 / 256)
                    e2 = estimate(**switches, device_states=want)
                    if e2["reserved"] <= gpu_usable - DEVICE_STATE_MARGIN_GIB * GiB:
                        # then the next tensors' (in model order), as many as leave the wider fill margin free
                        limit = gpu_usable - max(DEVICE_STATE_FILL_MARGIN_GIB, DEVICE_STATE_FILL_FRACTION *
                                                 gpu_memory_limit_gb) * GiB
                        every = 2 * n * (1 + 4 / 256)
                        more = _most_states(lambda b: estimate(**switches, device_states=b)["reserved"] <= limit,
                                            want, every)
                        scope = "all" if more >= every else "first" if more > want else "embedding"
                        if more > want:
                            want, e2 = more, estimate(**switches, device_states=more)
                        tried[-1] = p = dataclasses.replace(p, device_state_gib=want / GiB, **_predicted(e2),
                                                            device_states_scope=scope)
                if p.fits:
                    swapped_clip = resident < L and clip and not lora_params
                    if clip and og and not swapped_clip:
                        p.notes.append("exact clipping with offloaded gradients moves 4 bytes/param after backward; "
                                       "max_grad_norm: 0 updates during backward instead (faster, no clipping)")
                    if accum > 1 and og:
                        p.notes.append("gradient accumulation sums gradients in pinned CPU memory: 4 bytes/param of "
                                       "PCIe traffic per micro-batch; fewer, larger micro-batches move less")
                    if e["cpu_bound"]:
                        p.notes.append(
                            "small micro-batch: the CPU queuing the step's kernels and chunk updates ({:.2f} s) takes "
                            "longer than the GPU's work ({:.2f} s), so the CPU sets the pace -- and CPU-bound steps "
                            "vary between machines (3B at 1 x 2048 on H200 machines: 0.32-0.54 s measured, 0.30 s "
                            "predicted). Larger micro-batches hide it".format(*e["cpu_bound"]))
                    if shape.experts and resident < L:
                        p.notes.append(
                            f"each swapped MoE layer holds all {shape.experts} experts "
                            f"({weight_bytes * shape.layer_params / GiB:.2f} GiB), fetched for its forward and again "
                            f"for its backward although each token uses {shape.experts_per_token} of them: swapping "
                            f"moves {shape.experts / shape.experts_per_token:.0f}x the weights a dense layer of the "
                            f"same compute would")
                    if swapped_clip:
                        p.notes.append("with layers swapped and exact clipping, the forward after backward waits for "
                                       "each layer's gradient and 8-bit states and each swapped layer's weights to "
                                       "cross PCIe; max_grad_norm: 0 updates during backward instead (faster, no "
                                       "clipping)")
                    return p
        if resident < L and any(t.gpu_peak_gib * GiB <= gpu_usable for t in tried):
            break  # fewer resident layers only need more host RAM
    raise PlanError(_advice(tried, estimate, n, batch, seq, gpu_usable, gpu_memory_limit_gb, host_memory_gb,
                            machine, weight_bytes))


DEVICE_STATE_MARGIN_GIB = 0.25  # of the GPU budget left free when "auto" keeps the embedding's states on the GPU
# ... and when it keeps more (the next tensors' states): the larger of these, since the planner's GPU peak was measured
# up to 3.3% under (8B at 1 x 8192 on 24 GiB) on plans without activation offload
DEVICE_STATE_FILL_MARGIN_GIB = 1.0
DEVICE_STATE_FILL_FRACTION = 0.05


def _most_states(fits, low: float, high: float) -> float:
    """The most bytes of states in [low, high] for which `fits(bytes)` (monotonic), to 1 MiB; `low` if none more."""
    if fits(high):
        return high
    if not fits(low):
        return low
    while high - low > 2**20:
        mid = (low + high) / 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def _predicted(e: dict) -> dict:
    """The Plan fields an `_estimate` gives."""
    return dict(gpu_peak_gib=e["reserved"] / GiB, gpu_allocated_gib=e["allocated"] / GiB, host_peak_gib=e["host"] / GiB,
                pinned_gib=e["pinned"] / GiB, pcie_gb_per_step=e["pcie"] / 1e9, step_s=e["step"],
                native_step_s=e["native"], breakdown=e["breakdown"])


def _advice(tried, estimate, n, batch, seq, gpu_usable, gpu_gb, host_gb, machine, wb: int = 2) -> str:
    best = min(tried, key=lambda p: p.gpu_peak_gib)
    same_switches = functools.partial(estimate, offload_gradients=best.offload_gradients,
                                      activation_offload=best.activation_offload, resident=best.resident_layers)
    msgs = []
    if best.gpu_peak_gib * GiB > gpu_usable:
        fixed = same_switches(batch=1, seq=8)
        msgs.append(f"GPU: needs {best.gpu_peak_gib:.1f} GiB (the leanest plan tried) but {gpu_gb:g} GiB leaves "
                    f"{gpu_usable / GiB:.1f} GiB for PyTorch.")
        swap_helps = best.resident_layers == best.layers and estimate(
            batch=batch, seq=seq, offload_gradients=best.offload_gradients,
            activation_offload=best.activation_offload, resident=0)["reserved"] <= gpu_usable
        if swap_helps:
            msgs.append("Swapping decoder layers through pinned CPU memory fits: layer_swap: auto "
                        "(the planner keeps as many layers on the GPU as fit).")
        if fixed["reserved"] > gpu_usable and not swap_helps:
            msgs.append(f"The weights alone ({wb * n / GiB:.1f} GiB in {'float32' if wb == 4 else 'bf16'}) and the "
                        f"optimizer's buffers do not fit"
                        + (f" even with {best.resident_layers} of {best.layers} layers on the GPU"
                           if best.resident_layers < best.layers else "")
                        + f": use LoRA (peft), or a GPU with more than "
                        f"{fixed['reserved'] / GiB + machine.cuda_context_gib:.0f} GiB.")
        elif fixed["reserved"] <= gpu_usable:
            tokens = _most_tokens(lambda t: same_switches(batch=1, seq=t)["reserved"] <= gpu_usable, batch * seq)
            b, s = max(1, tokens // seq), min(seq, tokens)
            tokens = b * s
            msgs.append(f"Fewer tokens per micro-batch fit: per_device_train_batch_size={b}"
                        + (f", max_seq_length={s}" if s < seq else "")
                        + f" (about {tokens} tokens; keep the tokens per step with gradient_accumulation_steps)"
                        + ("" if best.activation_offload else "; or activation_offload: true"))
    gpu_ok = [p for p in tried if p.gpu_peak_gib * GiB <= gpu_usable]
    if gpu_ok:  # the GPU is not the problem: host RAM is
        lean = min(gpu_ok, key=lambda p: p.host_peak_gib)
        fixes = (["max_grad_norm: 0 (updates during backward need no host gradient buffer: "
                  f"{wb * n / GiB:.1f} GiB less)"] if lean.offload_gradients else []) + ["more RAM"]
        fixes += [] if lean.lora_params else ["LoRA"]
        msgs.append(f"Host RAM: the plans that fit the GPU need {lean.host_peak_gib:.1f} GiB (RSS + pinned), but "
                    f"{host_gb:.1f} GiB are available. Use " + ", or ".join(fixes) + ".")
    return "no plan fits. " + " ".join(msgs)


def _most_tokens(fits, tokens: int, step: int = 256) -> int:
    """The largest micro-batch size in tokens, below `tokens`, for which `fits(t)`: a multiple of `step` (down to 8
    tokens for tiny budgets). Halves until one fits, then bisects up to the `step` granularity."""
    lo = tokens
    while lo > 8 and not fits(lo):
        lo //= 2
    hi = min(2 * lo, tokens)  # lo fits (or is the floor); hi does not
    lo_r, hi_r = lo // step, hi // step  # bisect over multiples of `step`
    while hi_r - lo_r > 1:
        mid = (lo_r + hi_r) // 2
        lo_r, hi_r = (mid, hi_r) if fits(mid * step) else (lo_r, mid)
    return max(lo, lo_r * step)


# The Trainer's saves (and the command's merged LoRA model) are split into shards of at most this size. safetensors
# copies every tensor of a shard to host memory before writing it, and transformers 5's default (50GB) makes an 8B
# model one shard: each save then took 15 GiB of host memory beside the pinned optimizer states (H200, run
# 20261201-s19d: host peak 30.8 GiB against 15.9 during training; 46.7 against 32.3 with exact clipping) -- more than
# a 32 GB machine has. With 2 GB shards (run -s20c) the final save raised the host peak by 1.9 GiB, one shard.
SAVE_SHARD_BYTES = 2 * 10**9


def plan_from_args(args, config, seq: int, *, host_gb: float | None = None, gpu_gb: float | None = None,
                   model_args=None, lora_params: int | None = None, weight_bits: int | None = None,
                   ranks: int | None = None) -> Plan:
    """The planner for a TrainingArguments-like object and a model config (raises PlanError).
    `gpu_gb`: the GPU budget when `gpu_memory_limit_gb` is unset (e.g. the card's free memory).
    `model_args`: its `lora_r`, `lora_target_modules` and `load_in_4bit` select LoRA / QLoRA.
    `ranks`: data parallel processes on this node (default: the launcher's, from `args.world_size` and
    LOCAL_WORLD_SIZE; one process sees one GPU). The host peak includes a save's shard (`SAVE_SHARD_BYTES`, or the
    bf16 weights when smaller; with LoRA too: checkpoints hold the adapters, but `offload-trainer train` also writes
    the merged model)."""
    gpu = getattr(args, "gpu_memory_limit_gb", None) or gpu_gb
    shape = ModelShape.from_config(config)
    r = getattr(model_args, "lora_r", 0) or 0
    lora = shape.lora_params(r, getattr(model_args, "lora_target_modules", "all-linear")) if r else 0
    lora = lora if lora_params is None else lora_params
    bits = (4 if getattr(model_args, "load_in_4bit", False) else 16) if weight_bits is None else weight_bits
    if ranks is None:  # under torchrun / accelerate launch
        ranks = int(getattr(args, "world_size", 1) or 1)
        node_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
    else:
        node_ranks = ranks
    wb = dtype_bytes(getattr(model_args, "torch_dtype", None) or getattr(config, "dtype", None)
                     or getattr(config, "torch_dtype", None))
    saved = wb * shape.params  # the weights (LoRA too: the command saves a merged model)
    return plan(config, batch=args.per_device_train_batch_size, seq=seq, gpu_memory_limit_gb=gpu,
                host_memory_gb=host_gb, max_grad_norm=args.max_grad_norm or 0.0,
                loss_chunk=getattr(args, "loss_chunk_size", 1024),
                chunk_numel=getattr(args, "offload_chunk_numel", 2**25),
                inflight=getattr(args, "offload_inflight_chunks", 4),
                fused_update=getattr(args, "offload_fused_update", None) is not False,
                device_states=device_state_setting(getattr(args, "offload_device_states", 0)),
                activation_offload=getattr(args, "activation_offload", None) if gpu else
                bool(getattr(args, "activation_offload", False)),
                offload_gradients=getattr(args, "offload_gradients", None) if gpu else
                bool(getattr(args, "offload_gradients", False)),
                layer_swap=layer_swap_setting(getattr(args, "layer_swap", "off")), lora_params=lora, weight_bits=bits,
                accum=max(1, int(getattr(args, "gradient_accumulation_steps", 1) or 1)), ranks=ranks or 1,
                node_ranks=node_ranks, save_shard_bytes=min(SAVE_SHARD_BYTES, saved), weight_bytes=wb)


def dtype_bytes(dtype) -> int:
    """Bytes per value of a model dtype ('float32', torch.float32, None: bf16's 2)."""
    return 4 if str(dtype).replace("torch.", "") in ("float32", "float", "fp32") else 2


def device_state_setting(value) -> str | float:
    """The `offload_device_states` argument ('auto', or GiB; 'off' / None: 0) as `plan(device_states=...)`; raises
    ValueError on anything else (OffloadTrainingArguments checks its value with this)."""
    text = str(value).strip().lower()
    if value is None or value is False or text in ("off", "false", "no", "none"):
        return 0.0
    if text == "auto":
        return "auto"
    try:
        gib = float(text)
    except ValueError:
        gib = -1.0
    if gib < 0:
        raise ValueError(f"offload_device_states={text!r}: use auto, off, or a number of GiB of optimizer states to "
                         f"keep on the GPU")
    return gib


def layer_swap_setting(value) -> bool | int | None:
    """The `layer_swap` argument ('off', 'auto' or a number of resident layers) as `plan(layer_swap=...)`."""
    if value in (None, "off", False, "false", "False"):
        return False
    if value in ("auto", True, "true", "True"):
        return None
    return int(value)
