"""Models: the named architectures (registry.py), loading with transformers and peft (loading.py), and QLoRA bases
built block by block (layerwise.py)."""
from .layerwise import SafetensorsReader, pretrained_4bit_layerwise, random_init_4bit, random_init_layerwise
from .loading import (hub_kwargs, load_model, load_tokenizer, local_weights, no_backward_into_a_frozen_vision_tower,
                      random_init_device)
from .registry import (ARCHITECTURES, DTYPES, VISION_LM_TARGETS, architecture_config, base_model, count_params,
                       layer_lists, model_class)

__all__ = ["ARCHITECTURES", "DTYPES", "VISION_LM_TARGETS", "SafetensorsReader", "architecture_config", "base_model",
           "count_params", "hub_kwargs", "layer_lists", "load_model", "load_tokenizer", "local_weights",
           "model_class", "no_backward_into_a_frozen_vision_tower", "pretrained_4bit_layerwise", "random_init_4bit",
           "random_init_layerwise",
           "random_init_device"]
