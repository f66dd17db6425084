"""The architectures we know by name (shapes of real models, for random-init benchmarks, tests and the planner),
the dtypes a config names, and small facts about a built model (its base under peft, its stacks of blocks)."""
from __future__ import annotations

import copy
from typing import Any

import torch

from ..engine.layers import layer_stacks

# Shared by the Llama-3.2 Vision sizes (90B, 11B): Llama-3.1's long-context RoPE and the 40-layer vision encoder.
# (architecture_config deep-copies an entry before use.)
_LLAMA31_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)


_LLAMA32_VISION_ENCODER = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_global_layers=8,
                               attention_heads=16, image_size=560, patch_size=14, max_num_tiles=4,
                               vision_output_dim=7680, intermediate_layers_indices=[3, 7, 15, 23, 30])


# Shapes of real models (from their published configs), for random-init benchmarks and the planner.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(model_type="llama", hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                       max_position_embeddings=2048, tie_word_embeddings=False),
    "llama3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                        max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True),
    "llama3.2-3b": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                        num_attention_heads=24, num_key_value_heads=8, vocab_size=128256,
                        max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False),
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False),
    # Llama-3.1-8B: Llama-3-8B's layers with 128k positions (Llama-3.1's RoPE scaling), for long-context runs
    "llama3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                        max_position_embeddings=131072, rope_parameters=_LLAMA31_ROPE, tie_word_embeddings=False),
    "qwen2.5-14b": dict(model_type="qwen2", hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                        max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=False),
    "llama3-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False),
    # Llama-3.2-90B-Vision (MllamaForConditionalGeneration): a 100-layer language model (80 self-attention layers
    # as Llama-3-70B's, 20 cross-attention layers reading the image) and a 40-layer vision encoder.
    "llama3.2-90b-vision": dict(
        model_type="mllama",
        text_config=dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=100, num_attention_heads=64,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                         rope_parameters=_LLAMA31_ROPE,
                         cross_attention_layers=list(range(3, 100, 5)), tie_word_embeddings=False),
        vision_config=_LLAMA32_VISION_ENCODER),
    # Llama-3.2-11B-Vision: Llama-3.1-8B's 32 self-attention layers with 8 cross-attention layers among them (40),
    # and the same vision encoder as the 90B.
    "llama3.2-11b-vision": dict(
        model_type="mllama",
        text_config=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=40, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                         rope_parameters=_LLAMA31_ROPE,
                         cross_attention_layers=list(range(3, 40, 5)), tie_word_embeddings=False),
        vision_config=_LLAMA32_VISION_ENCODER),
    # the same structure, small enough for CPU tests
    "tiny-mllama": dict(
        model_type="mllama",
        text_config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=5, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048,
                         cross_attention_layers=[1, 3], tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0),
        image_token_index=512,
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_global_layers=1,
                           attention_heads=4, image_size=28, patch_size=14, max_num_tiles=4,
                           vision_output_dim=192, intermediate_layers_indices=[0, 1])),
}


DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def architecture_config(name: str, overrides: dict | None = None):
    """A transformers config for a named architecture, without touching any weights."""
    from transformers import AutoConfig

    if name not in ARCHITECTURES:
        import difflib

        close = difflib.get_close_matches(name, ARCHITECTURES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"model_config={name!r} is not a known architecture.{hint} "
                         f"Known: {', '.join(ARCHITECTURES)}")
    fields = copy.deepcopy(ARCHITECTURES[name])
    model_type = fields.pop("model_type")
    if overrides:
        _check_override_keys(name, AutoConfig.for_model(model_type, **fields), overrides)
    fields.update(overrides or {})
    return AutoConfig.for_model(model_type, **fields)


def _check_override_keys(name: str, base, overrides: dict) -> None:
    """A config accepts any keyword (an unknown one becomes an attribute nobody reads): a typo in model_overrides
    would be ignored silently. Each key must be a field of the architecture's config."""
    import difflib
    import inspect

    known = set(base.to_dict()) | set(getattr(base, "attribute_map", {}))
    known |= set(inspect.signature(type(base).__init__).parameters) - {"self", "kwargs"}
    known |= set(ARCHITECTURES[name]) | {"rope_theta", "rope_scaling"}  # (read by __init__ through its **kwargs)
    for key, value in overrides.items():
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            raise ValueError(f"model_overrides: {key!r} is not a field of {name}'s {type(base).__name__}"
                             + (f". Did you mean {close[0]!r}?" if close else ""))
        if key in POSITIVE_SIZES and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise ValueError(f"model_overrides: {key}={value!r} must be a positive whole number (a model of "
                             f"{value!r} {key.replace('_', ' ')} would plan or train nothing sensible)")


# model_overrides that are sizes: 0 or negative would build a model that plans or trains nothing sensible
POSITIVE_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "head_dim")


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


# `lora_target_modules: all-linear` on a vision-language model: every linear layer of its language model.
VISION_LM_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def model_class(config):
    """The transformers auto class that builds a trainable LM for `config`: the image-text model for
    vision-language configs (e.g. Mllama), else the causal LM."""
    import transformers

    if getattr(config, "vision_config", None) is not None:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def layer_lists(model: torch.nn.Module) -> list[torch.nn.ModuleList]:
    """The stacks of repeated blocks, longest first (swap.layer_stacks: one definition)."""
    return layer_stacks(model)


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
