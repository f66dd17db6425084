"""Tiled decoder layers: everything in a decoder layer but attention itself run over the sequence in tiles.

A Llama-style layer is `h = x + o_proj(attention(rope(q, k, v of norm(x))))`, `y = h + mlp(norm(h))`. Only the
attention mixes positions; the rest treats each token alone. Untiled, a layer's recompute and backward hold about
15 whole-sequence hidden-size tensors at once (the input, both norms' outputs, q/k/v, the attention output and its
contiguous copy, the residual, the MLP's input and output, and their gradients): 1 GiB each at 128k tokens of an
8B model, past what a 24 GB card has beside the weights. Tiled, the layer is two `run_tiled` calls around the
attention: the first makes q, k and v from the input (norm, projections, rotary embedding), the second the output
from the input and the attention output (output projection, residual, norm, MLP, residual). Whole-sequence tensors
left: the input, q/k/v, the attention's output and the gradients of those. The cost: the projections and the MLP run
once more in backward (the tiles' recompute).

Known layer structures only (`TILED_LAYER_CLASSES`, each tested against the layer's own forward): another layer is
left as it is. A forward with a KV cache, without autograd, or of at most `tile` tokens runs the layer as it is.
The seam: the layer's modeling module's `ALL_ATTENTION_FUNCTIONS`, `eager_attention_forward` and
`apply_rotary_pos_emb`, looked up on the module so that each family's own are used, as its attention does.
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from ..engine.tiled_mlp import run_tiled
from ..engine.wrap import wrap_forward

__all__ = ["TILED_LAYER_CLASSES", "tile_decoder_layers"]

# decoder layers whose forward is the structure above (q_norm / k_norm per head, as Qwen3's, where present)
TILED_LAYER_CLASSES = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
_CACHE_KEYS = ("cache", "past_key_values", "past_key_value")


def _qkv(layer: nn.Module, rope):
    attn = layer.self_attn

    def qkv(x, cos, sin):
        n = layer.input_layernorm(x)
        shape = (*n.shape[:-1], -1, attn.head_dim)
        q, k, v = attn.q_proj(n).view(shape), attn.k_proj(n).view(shape), attn.v_proj(n).view(shape)
        if getattr(attn, "q_norm", None) is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q, k, v.transpose(1, 2)
    return qkv


def _rest(layer: nn.Module):
    def rest(x, a):
        h = x + layer.self_attn.o_proj(a)
        return (h + layer.mlp(layer.post_attention_layernorm(h)),)
    return rest


def _tiled_forward(layer: nn.Module, plain, tile: int):
    attn = layer.self_attn
    modeling = sys.modules[type(attn).__module__]
    qkv, rest = _qkv(layer, modeling.apply_rotary_pos_emb), _rest(layer)

    def forward(hidden_states, *args, **kwargs):
        if (args or hidden_states.shape[-2] <= tile or not torch.is_grad_enabled() or kwargs.get("use_cache")
                or any(kwargs.get(k) is not None for k in _CACHE_KEYS)):
            return plain(hidden_states, *args, **kwargs)
        mask = kwargs.pop("attention_mask", None)
        cos, sin = kwargs.pop("position_embeddings")
        for k in _CACHE_KEYS:
            kwargs.pop(k, None)
        if hasattr(attn, "sliding_window"):
            kwargs["sliding_window"] = attn.sliding_window
        pre = [p for m in (layer.input_layernorm, attn.q_proj, attn.k_proj, attn.v_proj,
                           getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if m is not None
               for p in m.parameters()]
        q, k, v = run_tiled(qkv, tile, [hidden_states, cos, sin], pre)
        interface = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation,
                                                                   modeling.eager_attention_forward)
        a, _ = interface(attn, q, k, v, mask, dropout=attn.attention_dropout if attn.training else 0.0,
                         scaling=attn.scaling, **kwargs)
        a = a.reshape(*hidden_states.shape[:-1], -1)
        post = [p for m in (attn.o_proj, layer.post_attention_layernorm, layer.mlp) for p in m.parameters()]
        return run_tiled(rest, tile, [hidden_states, a], post)[0]
    return forward


TILED_LAYER_TAG = "tiled_layer"


def tile_decoder_layers(layers: nn.ModuleList, tile: int) -> int:
    """Run each of `layers` (of `TILED_LAYER_CLASSES`) in tiles of `tile` tokens around its attention while
    autograd records. Returns how many layers were wrapped."""
    if tile < 1:
        raise ValueError(f"tile={tile}: a tile holds at least one token")
    count = 0
    for layer in layers:
        if type(layer).__name__ in TILED_LAYER_CLASSES:  # (unwrap() puts the layer's own forward back)
            count += wrap_forward(layer, TILED_LAYER_TAG, lambda plain, layer=layer: _tiled_forward(layer, plain, tile))
    return count
