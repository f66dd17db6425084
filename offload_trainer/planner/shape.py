"""The model's shape as the planner reads it from a config (no weights): hidden size, layers, heads, vocabulary,
mixture-of-experts and vision-encoder fields, and the parameter counts they give (checked against transformers' own
models built on the meta device). `Machine`: the measured rates and constants of the machine the plans are for."""
from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30


class PlanError(ValueError):
    """No plan fits: the message says which knob to change and by how much."""


class HostPlanError(PlanError):
    """Plans fit the GPU but none fits the host's memory: a run would be killed by the kernel's OOM killer (SIGKILL,
    everything since the last checkpoint lost), so it is refused even where a GPU that does not fit only warns."""


# what an OS (and a desktop) keep of a machine's RAM: a 64 GB machine has 59.6 GiB, about 57 of them available
OS_KEEPS_GIB = 2.6
RAM_SIZES_GB = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


def available_gib(ram_gb: int) -> float:
    """What a machine of `ram_gb` GB of RAM (as sold) leaves a run: 32 -> 27.2, 64 -> 57.0, 128 -> 116.6 GiB."""
    return ram_gb * 1e9 / GiB - OS_KEEPS_GIB


def machine_for(host_gib: float, above: float | None = None) -> str:
    """The smallest usual RAM size whose available memory holds `host_gib` -- and larger than the machine that
    leaves `above`, the budget the user has now (a machine of the size they own is never proposed; 1 GiB of slack
    for what their OS keeps) -- as a phrase ("a 96 GB machine (~86.8 GiB available; ...)")."""
    owned = next((g for g in RAM_SIZES_GB if available_gib(g) >= above - 1.0), 0) if above else 0
    size = next((g for g in RAM_SIZES_GB if available_gib(g) >= host_gib and g > owned), None)
    # (other programs may hold what the run lacks: a machine of the size it seems to be would leave enough)
    free = (f"; or {host_gib - above:.1f} GiB more free on this one" if owned and above
            and available_gib(owned) >= host_gib else "")
    if size is None:
        return f"a machine with {(host_gib + OS_KEEPS_GIB) * GiB / 1e9:.0f} GB of RAM{free}"
    return f"a {size} GB machine (~{available_gib(size):.1f} GiB available; this run needs {host_gib:.1f}{free})"


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
    # 0.240 s per step (medians) over 28 layers in two runs
    cpu_s_per_layer: float = 7.4e-3
    cuda_context_gib: float = 0.7  # taken from the card outside PyTorch's allocator
    # a training process's RSS beside its pinned buffers (torch, CUDA runtime, transformers, the batch): 1.66-1.74 GiB
    # measured before any profiling (3B, two runs); 1.5 before, which put hosts 2-10% under
    host_base_gib: float = 1.7
    # a data loader worker (forked: torch's pages shared with its parent): 0.18 GiB RSS of which 0.07 its share of the
    # shared pages and 0.01 its own, measured on 4 x 2048 batches; rounded up for larger batches and collators
    worker_gib: float = 0.2
    # the update kernels running beside the compute stream's (backward's, or the next forward's) slow it by about a
    # fixed time per updated value, not a share of the step: 8B spent 1.05-1.09 s a step at 4 x 2048 in six runs,
    # 2.54 s at 16k and 6.15 s at 32k (speculative clipping, not firing), each within 2% of its compute plus 30 ms
    update_beside_s_per_param: float = 3.7e-12
    # the fused update with the GPU otherwise idle (the input embedding's, after backward, its states on the GPU): 6.9 ms
    # for 8B's 525M values (s66a)
    update_alone_s_per_param: float = 1.3e-11
    # exact clipping with streamed states: after backward the host reads the norm, then queues the updates, and the
    # next forward waits for its first unit's (the input embedding's states and gradient over PCIe, then its update).
    # At 32k, with no copy stall in the step, exact ran 62 ms a step slower than speculative clipping (s58b): 41 ms
    # the embedding's copies at the rate above, this the rest
    exact_restart_s: float = 0.02
    nf4_slowdown: float = 1.40  # bitsandbytes NF4 matmuls dequantize every weight each use (70B QLoRA: 2.38 s
    #                             measured vs 1.70 s at the bf16 rate)


class UnknownArchitecture(PlanError, TypeError):
    """A model type whose structure the planner does not model: it would be planned wrong, so it is not planned."""


# model_type -> what differs from a Llama layer; a config-like object without a model_type is planned as a Llama
KNOWN_TYPES = {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "mllama",
               "mllama_text_model"}
# model_types whose decoder layers models/tiled_layers.py tiles (a config without one is planned as a Llama)
TILEABLE_TYPES = {None, "llama", "qwen2", "qwen3"}


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
    vision_hidden: int = 0  # the vision encoder's width and layers (their checkpoints, when the tower trains)
    vision_layers: int = 0
    head_dim: int = 0  # (0: hidden / heads)
    qk_norm: bool = False  # per-head RMSNorm of queries and keys (Qwen3; Mllama's cross-attention layers)
    extra_embeddings: int = 0  # rows of the input embedding beyond the vocabulary (Mllama's image tokens)
    experts: int = 0  # mixture of experts: experts per MoE layer (Mixtral, Qwen-MoE), 0 for a dense model
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # Qwen2-MoE's shared expert (and its gate), 0 without one
    moe_layers: int = 0  # layers whose MLP is the experts (the others are dense, of `intermediate`)
    tileable: bool = False  # decoder layers that models/tiled_layers.py tiles (TILED_LAYER_CLASSES)

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
                   tileable=kind in TILEABLE_TYPES and vision is None,
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
    return dict(vision_linear=n_layers * (4 * h * h + 2 * h * inter), vision_other=other, cross_tokens=tiles * padded,
                vision_hidden=h, vision_layers=n_layers)
