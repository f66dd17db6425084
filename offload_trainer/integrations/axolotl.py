"""axolotl plugin: `plugins: [offload_trainer.integrations.axolotl.OffloadPlugin]` in an axolotl YAML, plus our keys
(`offload_optimizer`, `layer_swap`, `activation_offload`, ...; `offload-trainer keys` lists them) beside axolotl's.

Through axolotl's plugin API (`axolotl.integrations.base.BasePlugin`): our keys join axolotl's config schema
(`get_input_args`) and its training arguments (`get_training_args_mixin`, `get_training_args`), and the trainer
axolotl builds gets the offload wiring (`get_trainer_cls`: `OffloadMixin` before axolotl's own `AxolotlTrainer`).
axolotl's own offloading (DeepSpeed / FSDP offload, `activation_offloading`, `layer_offloading`, gradient
checkpointing to CPU) would move the same tensors a second way: the config is refused, naming what to turn off.
Two seams into axolotl, each with its reason where it is made: QLoRA (`load_in_4bit`) with our `layer_swap` builds the
base our way (`_take_over_4bit_build`), and the model axolotl saves itself at the end keeps the Trainer's shard size
(`post_trainer_create`). A full finetune's trainable weights stay in the load dtype (`post_model_load`).
Needs `pip install 'offload-trainer[axolotl]'` (axolotl pins its own transformers / peft / trl / datasets: use a
virtual environment of its own).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import typing
from typing import Any, Optional

from axolotl.integrations.base import BasePlugin
from pydantic import BaseModel, model_validator

from ..settings import parse_layer_swap
from ..trainer.args import OffloadFields

__all__ = ["OffloadArgs", "OffloadPlugin"]

# Our fields that axolotl's config already has under its own name (the Trainer's checkpointing switch).
_AXOLOTL_HAS = {"activation_checkpointing", "overwrite_output_dir"}
KEYS = tuple(f.name for f in dataclasses.fields(OffloadFields) if f.name not in _AXOLOTL_HAS)

# axolotl switch (refused when set) -> what to do instead
_CLASHES = {
    **{k: f"remove {k}: the plugin streams the optimizer states itself (or remove the plugin)"
       for k in ("deepspeed", "fsdp", "fsdp_config")},
    "activation_offloading": "remove activation_offloading (axolotl's); ours is activation_offload: true",
    "layer_offloading": "remove layer_offloading (axolotl's); ours is layer_swap: auto",
}


# Models whose packed batches axolotl's compute_loss prepares itself (AxolotlTrainer.compute_loss)
_PACKED_MASK_MODELS = ("gemma3", "gemma4", "gemma4_unified")


def _clashes(data: dict) -> list[str]:
    found = [f"{k}: {fix}" for k, fix in _CLASHES.items() if data.get(k)]
    if data.get("gradient_checkpointing") in ("offload", "offload_disk"):
        found.append(f"gradient_checkpointing: {data['gradient_checkpointing']} offloads the checkpoints axolotl's way: "
                     "use gradient_checkpointing: true with activation_offload: true")
    if data.get("rl"):
        found.append(f"rl: {data['rl']}: the plugin wires axolotl's SFT trainer only; for DPO use OffloadDPOTrainer "
                     "from Python (offload_trainer.trl)")
    return found


def _checkpointing_kwargs(data: dict) -> dict:
    """Non-reentrant checkpointing where the config leaves it to axolotl, which would pick reentrant (its
    normalize_config, for a config without `gradient_checkpointing_kwargs`): `offload-trainer train` and TRL run
    transformers' non-reentrant default, and the same gradients came out slower under reentrant recompute on a held
    24 GB card (bench/results/README.md, "Integrations"). A config that sets the kwargs keeps them."""
    if data.get("gradient_checkpointing") is True and data.get("gradient_checkpointing_kwargs") is None:
        logging.getLogger("offload_trainer").info(
            "gradient_checkpointing_kwargs: {use_reentrant: false} (offload-trainer train's checkpointing; set "
            "gradient_checkpointing_kwargs to choose)")
        return {**data, "gradient_checkpointing_kwargs": {"use_reentrant": False}}
    return data


class _NoOtherOffload(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def no_other_offloading(cls, data):
        if not isinstance(data, dict):
            return data
        found = _clashes(data)
        if found:
            raise ValueError("offload_trainer's plugin cannot run with: " + "; ".join(found))
        return _checkpointing_kwargs(data)


def _input_model() -> type[BaseModel]:
    """Our keys as axolotl config fields (None: not given, the Trainer-side default applies), typed as our
    dataclass types them, so axolotl checks their values when it reads the YAML."""
    from pydantic import create_model

    hints = typing.get_type_hints(OffloadFields)
    return create_model("OffloadArgs", __base__=_NoOtherOffload,
                        **{k: (Optional[hints[k]], None) for k in KEYS})  # type: ignore[call-overload]


OffloadArgs = _input_model()


@functools.lru_cache(maxsize=None)
def _trainer_cls() -> type:
    from axolotl.core.trainers.base import AxolotlTrainer

    from ..trainer.mixin import OffloadMixin

    return type("OffloadAxolotlTrainer", (OffloadMixin, AxolotlTrainer),
                {"__doc__": "axolotl's AxolotlTrainer with the offload wiring (offload_trainer's axolotl plugin)."})


def _builds_4bit_layer_by_layer(cfg) -> bool:
    return bool(cfg.get("load_in_4bit")) and parse_layer_swap(cfg.get("layer_swap")) is not False


@functools.lru_cache(maxsize=None)
def _take_over_4bit_build() -> None:
    """QLoRA with layer swap: axolotl's ModelLoader quantizes the whole base onto the GPU as from_pretrained loads it,
    which a base bigger than the card (70B: ~37 GB in NF4) does not survive, and then moves the model to the GPU. For
    such a config its `_build_model` (the step that makes `loader.model`) builds the base our way instead, a block at a
    time, decoder layers parked in CPU memory for the swap to place (`models.layerwise`, as `offload-trainer train`
    loads it: the same NF4 as BitsAndBytesConfig's nf4 + double quant), and answers "do not move it to the device".
    axolotl's `reinit_weights: true` builds a random-init base the same way. Every other config goes to axolotl's own
    `_build_model`; everything around it (kbit preparation, LoRA, patches) stays axolotl's."""
    from axolotl.loaders.model import ModelLoader

    build = ModelLoader._build_model

    @functools.wraps(build)
    def build_model(loader) -> bool:
        if not _builds_4bit_layer_by_layer(loader.cfg):
            return build(loader)
        loader.model = _base_4bit_layer_by_layer(loader)
        return True  # (skip_move_to_device)

    ModelLoader._build_model = build_model


def _base_4bit_layer_by_layer(loader):
    import types

    import torch

    from ..models.layerwise import pretrained_4bit_layerwise, random_init_4bit
    from ..models.loading import local_weights

    cfg, config = loader.cfg, loader.model_config
    config._attn_implementation = loader.model_kwargs.get("attn_implementation") or "sdpa"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.reinit_weights:
        return random_init_4bit(config, device, park="cpu")
    path = local_weights(types.SimpleNamespace(model_name_or_path=loader.base_model, revision=cfg.revision_of_model))
    return pretrained_4bit_layerwise(path, config, device, park="cpu", dtype=cfg.torch_dtype or torch.bfloat16)


class OffloadPlugin(BasePlugin):
    """axolotl plugin: the offload wiring on axolotl's SFT trainer."""

    def register(self, cfg) -> None:
        from ..cli.main import show_our_log_lines

        show_our_log_lines()
        # axolotl's logger class gives every other library's logger a filter dropping records below WARNING (its
        # LOG_LEVEL); ours made after axolotl's import carries it: our level decides instead, as everywhere else
        ours = logging.getLogger("offload_trainer")
        for f in [f for f in ours.filters if type(f).__module__.startswith("axolotl")]:
            ours.removeFilter(f)

    def pre_model_load(self, cfg) -> None:
        # Our chunked loss runs in OffloadMixin.compute_loss, before AxolotlTrainer's: for packed rows of these models
        # axolotl drops the all-ones attention mask there so that transformers builds per-row causal masks. Without
        # that the packed rows would attend to each other, silently: refused until the loss runs below axolotl's.
        if cfg.get("sample_packing") and cfg.get("model_config_type") in _PACKED_MASK_MODELS:
            raise ValueError(f"offload_trainer's plugin cannot run sample_packing with {cfg['model_config_type']} "
                             "yet: set sample_packing: false (or remove the plugin)")
        if _builds_4bit_layer_by_layer(cfg):
            _take_over_4bit_build()

    def post_model_load(self, cfg, model) -> None:
        # axolotl upcasts a full finetune's embeddings, LM head and norms to fp32 under bf16 autocast: 2 GiB more for
        # an 8B model, where the plan leaves 1 GiB of a held 24 GB card. The streamed optimizer updates bf16 weights
        # with stochastic rounding, as offload-trainer train does.
        # (Cast here, before the Trainer and its layer swap exist: the swap keeps pinned copies of the weights.)
        import torch

        from . import cast_trainable_weights, optimizer_will_stream

        streams = optimizer_will_stream(on_gpu=torch.cuda.is_available(), full_finetune=not cfg.get("adapter"),
                                        offload_optimizer=cfg.get("offload_optimizer"),
                                        optim=cfg.get("optimizer") or "adamw_torch_fused")  # (axolotl's default)
        if not streams or cfg.torch_dtype not in (torch.bfloat16, torch.float16):
            return

        n, gib = cast_trainable_weights(model, cfg.torch_dtype)
        if n:
            logging.getLogger("offload_trainer").info(
                "%d trainable fp32 tensors (axolotl's upcast embeddings, head and norms) kept in %s for the streamed "
                "optimizer: %.2f GiB less on the GPU (offload_optimizer: false keeps axolotl's fp32)",
                n, str(cfg.torch_dtype).replace("torch.", ""), gib)

    def post_trainer_create(self, cfg, trainer) -> None:
        # axolotl saves the finished model with `model.save_pretrained`, past the Trainer's save_model (which writes
        # shards of SAVE_SHARD_BYTES): at transformers' default shard size an 8B model's 16 GB of weights were
        # gathered in host memory at once, beside the optimizer's pinned states (host peak 62 GiB against the
        # command's 49). The model keeps the Trainer's shard size for every save.
        from transformers import PreTrainedModel

        from ..planner import SAVE_SHARD_BYTES
        from ..trainer.seams import saving_in_shards

        if isinstance(trainer.model, PreTrainedModel):
            trainer.model.save_pretrained = saving_in_shards(trainer.model, SAVE_SHARD_BYTES)

    def get_input_args(self) -> str:
        return "offload_trainer.integrations.axolotl.OffloadArgs"

    def get_training_args_mixin(self) -> str:
        return "offload_trainer.trainer.args.OffloadFields"

    def get_training_args(self, cfg) -> dict[str, Any]:
        return {k: cfg[k] for k in KEYS if cfg.get(k) is not None}

    def get_trainer_cls(self, cfg):
        return _trainer_cls()
