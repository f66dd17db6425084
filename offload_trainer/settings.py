"""Every offload switch as one typed, frozen value (`OffloadSettings`), resolved once from a run's arguments: each
default and bound is written here and nowhere else (the rules between values: trainer/conflicts.py). The
planner and the Trainer shell read only this; `OffloadTrainingArguments` (trainer/args.py) takes its field defaults
from the constants below and checks its values by building one. Nothing is imported: the mechanisms and the planner
read the constants without importing transformers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The defaults (the engine's and the planner's keyword defaults are these names too).
CHUNK_NUMEL = 2**25  # elements per streamed chunk of optimizer state
CHUNK_NUMEL_MIN, CHUNK_NUMEL_MULTIPLE = 4096, 256  # (256: torchao's 8-bit block)
INFLIGHT_CHUNKS = 4  # GPU staging slots; at least 2: one copying while one updates
INFLIGHT_CHUNKS_MIN = 2
LOSS_CHUNK = 1024  # tokens per chunk of the LM head + cross-entropy (0: the model's own loss)
LAYER_SWAP_PREFETCH = 1  # swapped layers fetched ahead of use
MLP_TILE_TOKENS = 8192  # tiled MLP: tokens per tile (its intermediates exist for one tile at a time)
LAYER_SWAP_FIT_STEPS = 3  # layer_swap auto: full-size steps whose measured peak moves layers on or off the GPU
MAX_NONFINITE_STEPS = 5  # skipped non-finite steps in a row before the run stops (0: no check)
MASTER_WEIGHTS = ("bf16_sr", "bf16")  # the first is the default
DEVICE_STATES = "auto"
LAYER_SWAP = "off"
FOLD = "auto"  # gradient accumulation's micro-batches run as one where the planner finds that faster

# One vocabulary for a switch's words, in a config, an override and the arguments (YAML 1.1 readers also turn a bare
# on / off / yes / no into a boolean: each is read as that boolean)
ON_WORDS = ("on", "true", "yes")
OFF_WORDS = ("off", "false", "no", "none", "")
_AUTO = ("auto", *ON_WORDS)  # (for a switch with a planner's choice, `on` asks for it)


def switch_word(value: Any) -> bool | None:
    """True / False for a word of the vocabulary (any case), None for anything else."""
    text = str(value).strip().lower()
    return True if text in ON_WORDS else False if text in OFF_WORDS else None


def _off_auto_or_count(value: Any, *, off, unset, least: int, why: str):
    """A switch that is off, auto or a count: `off` for an off word (or False), None -- the planner's choice -- for an
    auto or on word (or True), `unset` for no value, else the count (at least `least`); ValueError `why` otherwise."""
    if value is None:
        return unset
    if isinstance(value, bool):
        return None if value else off
    text = str(value).strip().lower()
    if text in OFF_WORDS:
        return off
    if text in _AUTO:
        return None
    if not text.isdigit() or int(text) < least:
        raise ValueError(why)
    return int(text)


def parse_layer_swap(value: Any) -> bool | int | None:
    """`layer_swap` as the planner takes it: False (off), None (auto, the planner chooses) or a number of resident
    layers. YAML 1.1 readers turn a bare `off` / `on` into a boolean; both spellings are read the same."""
    return _off_auto_or_count(value, off=False, unset=False, least=0, why=(
        f"layer_swap={value!r}: use off, auto, or a number of decoder layers to keep on the GPU"))


def parse_fold(value: Any) -> int | None:
    """`fold_accumulation` as the planner takes it: None (auto: the planner chooses how many of a step's micro-batches
    run as one), 1 (off: each runs as the Trainer hands it) or that many. `on` asks for auto, as with layer_swap."""
    return _off_auto_or_count(value, off=1, unset=None, least=1, why=(
        f"fold_accumulation={value!r}: use auto, off, or how many of an optimizer step's micro-batches run as one (a "
        f"divisor of gradient_accumulation_steps)"))


def gradients_offloaded(offload: bool, *, asked: bool | None, clips: bool, accumulation: int,
                        swapped_trainable: bool) -> bool:
    """Whether gradients wait in pinned host memory (the planner counts them there, the optimizer puts them there).
    They wait only for the global norm (clipping) or for the other micro-batches (accumulation); then as decided
    (`offload`: the switch, or the plan's choice where `asked` is None), and always where trained layers are swapped
    and micro-batches accumulate with the switch left to the plan: a swapped layer's gradient sums must not pile up
    on the GPU."""
    if not (clips or accumulation > 1):
        return False
    return offload or (asked is None and swapped_trainable and accumulation > 1)


def parse_device_states(value: Any) -> str | float:
    """`offload_device_states` ('auto', or GiB; 'off' / None: 0) as the planner takes it. `on` asks for auto, as with
    layer_swap."""
    text = str(value).strip().lower()
    if value is None or value is False or text in OFF_WORDS:
        return 0.0
    if value is True or text in _AUTO:
        return "auto"
    try:
        gib = float(text)
    except ValueError:
        gib = -1.0
    if not gib >= 0:  # (also NaN)
        raise ValueError(f"offload_device_states={text!r}: use auto, off, or a number of GiB of optimizer states to "
                         f"keep on the GPU")
    return gib


@dataclass(frozen=True)
class OffloadSettings:
    """The switches of one run. `None` leaves a switch to the plan (`decided`). The last group is the Trainer's own
    arguments that the plan and the wiring read (one place, so the planner never reads a `TrainingArguments`)."""

    offload_optimizer: bool | None = None
    offload_gradients: bool | None = None
    speculative_clipping: bool | None = None
    activation_offload: bool | None = None
    tiled_mlp: bool | None = None
    tiled_layers: bool | None = None
    chunk_numel: int = CHUNK_NUMEL
    inflight_chunks: int = INFLIGHT_CHUNKS
    fused_update: bool | None = None
    device_states: str | float = DEVICE_STATES  # 'auto' or GiB
    master_weights: str = MASTER_WEIGHTS[0]
    loss_chunk_size: int = LOSS_CHUNK
    layer_swap: bool | int | None = False  # False: off; None: auto; N: resident layers
    layer_swap_prefetch: int = LAYER_SWAP_PREFETCH
    fold: int | None = None  # micro-batches run as one (None: the plan's choice, 1: none folded)
    save_on_interrupt: bool = True
    check_nonfinite: bool = True
    max_nonfinite_steps: int = 0  # 0: skip non-finite steps but never stop
    gpu_memory_limit_gb: float | None = None
    host_memory_limit_gb: float | None = None  # the host RAM the run may use (GiB): a budget, not a cap
    # the Trainer's own
    batch: int = 1
    max_grad_norm: float = 0.0
    accumulation: int = 1
    world_size: int = 1
    checkpointing: bool = False
    data_workers: int = 0  # the data loader's worker processes (dataloader_num_workers)

    def __post_init__(self) -> None:
        if self.master_weights not in MASTER_WEIGHTS:
            raise ValueError(f"master_weights={self.master_weights!r}: use one of {', '.join(MASTER_WEIGHTS)}")
        if self.chunk_numel < CHUNK_NUMEL_MIN or self.chunk_numel % CHUNK_NUMEL_MULTIPLE:
            raise ValueError(f"offload_chunk_numel={self.chunk_numel}: use a multiple of {CHUNK_NUMEL_MULTIPLE} of at "
                             f"least {CHUNK_NUMEL_MIN} (default {CHUNK_NUMEL})")
        if self.inflight_chunks < INFLIGHT_CHUNKS_MIN:
            raise ValueError(f"offload_inflight_chunks={self.inflight_chunks}: use at least {INFLIGHT_CHUNKS_MIN} "
                             f"(one slot copying while one updates)")
        if self.loss_chunk_size < 0:
            raise ValueError(f"loss_chunk_size={self.loss_chunk_size}: use 0 (off) or a positive token count")
        if self.max_nonfinite_steps < 0:
            raise ValueError(f"max_nonfinite_steps={self.max_nonfinite_steps}: use 0 (no check) or a positive count")
        if self.layer_swap_prefetch < 0:
            raise ValueError(f"layer_swap_prefetch={self.layer_swap_prefetch}: use 0 or more")
        if self.gpu_memory_limit_gb is not None and not self.gpu_memory_limit_gb > 0:
            raise ValueError(f"gpu_memory_limit_gb={self.gpu_memory_limit_gb}: give a positive number of GiB")
        if self.host_memory_limit_gb is not None and not self.host_memory_limit_gb > 0:
            raise ValueError(f"host_memory_limit_gb={self.host_memory_limit_gb}: give a positive number of GiB (e.g. 57 "
                             f"for a 64 GB machine)")
        if isinstance(self.layer_swap, int) and not isinstance(self.layer_swap, bool) and self.layer_swap < 0:
            raise ValueError(f"layer_swap={self.layer_swap}: use off, auto, or a number of layers (0 or more)")
        if self.fold is not None and self.fold < 1:
            raise ValueError(f"fold_accumulation={self.fold}: use auto, off, or a count of micro-batches (1 or more)")

    @classmethod
    def from_args(cls, args) -> "OffloadSettings":
        """The one function that makes a run's settings (each switch parsed here, once), held by whoever runs the
        training and handed down from there: the Trainer makes them in its constructor (or is handed the command's),
        the arguments make a throwaway one as they are built, to check their values. No copy is kept anywhere.
        From `OffloadTrainingArguments` (or TRL's config with our fields), or from a plain `TrainingArguments`,
        which gets the defaults: non-finite steps skipped but the run never stopped for them (the Trainer's own
        would apply them), no interrupt handling beyond a clean stop."""
        def get(name: str, default):  # (a field the arguments lack -- a plain TrainingArguments -- has its default)
            return getattr(args, name, default)

        own = hasattr(args, "max_nonfinite_steps")
        limit = get("max_nonfinite_steps", MAX_NONFINITE_STEPS)
        return cls(
            offload_optimizer=get("offload_optimizer", None),
            offload_gradients=get("offload_gradients", None),
            speculative_clipping=get("speculative_clipping", None),
            activation_offload=get("activation_offload", None),
            tiled_mlp=get("tiled_mlp", None),
            tiled_layers=get("tiled_layers", None),
            chunk_numel=get("offload_chunk_numel", CHUNK_NUMEL),
            inflight_chunks=get("offload_inflight_chunks", INFLIGHT_CHUNKS),
            fused_update=get("offload_fused_update", None),
            device_states=parse_device_states(get("offload_device_states", DEVICE_STATES)),
            master_weights=get("master_weights", MASTER_WEIGHTS[0]),
            loss_chunk_size=get("loss_chunk_size", LOSS_CHUNK),
            layer_swap=parse_layer_swap(get("layer_swap", LAYER_SWAP)),
            layer_swap_prefetch=get("layer_swap_prefetch", LAYER_SWAP_PREFETCH),
            fold=parse_fold(get("fold_accumulation", FOLD)),
            save_on_interrupt=get("save_on_interrupt", True),
            check_nonfinite=bool(limit) if own else True,
            max_nonfinite_steps=limit if own else 0,
            gpu_memory_limit_gb=get("gpu_memory_limit_gb", None),
            host_memory_limit_gb=get("host_memory_limit_gb", None),
            batch=int(getattr(args, "per_device_train_batch_size", 1) or 1),
            max_grad_norm=float(getattr(args, "max_grad_norm", 0.0) or 0.0),
            accumulation=max(1, int(getattr(args, "gradient_accumulation_steps", 1) or 1)),
            world_size=int(getattr(args, "world_size", 1) or 1),
            checkpointing=bool(getattr(args, "gradient_checkpointing", False)
                               or getattr(args, "activation_checkpointing", False)),
            data_workers=int(getattr(args, "dataloader_num_workers", 0) or 0),
        )

    @property
    def clips(self) -> bool:
        return self.max_grad_norm > 0

    @property
    def stochastic_rounding(self) -> bool:
        return self.master_weights == "bf16_sr"

    def decided(self, name: str, plan=None) -> bool:
        """A switch left unset (None) as the plan decided it (off without a plan); a switch given, as given."""
        value = getattr(self, name)
        if value is None and plan is not None:
            value = getattr(plan, name)
        return bool(value)
