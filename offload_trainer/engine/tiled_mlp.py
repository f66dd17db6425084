"""Sequence tiling: a function of per-token inputs run over the sequence in tiles of `tile` tokens, and each tile
recomputed in backward, so the function's intermediate activations exist for one tile at a time.

At 64k tokens an 8B layer's MLP holds ~7 GiB of them in its backward, more than a 24 GB card has beside the
weights; with 8k-token tiles, under 1 GiB. The cost: one more forward of the function in each backward (the tile's
recompute). A function that sees each token alone (an MLP, a norm, a projection) gives the same values in tiles
along the sequence. The weights' gradients are summed over the tiles in float32 and handed to autograd once, so
hooks that act when a gradient is complete (the streamed optimizer's) run once per tensor, as without tiling.

`run_tiled(fn, tile, inputs, params)` runs `fn` so (inputs and outputs hold the sequence in dimension -2);
`tile_mlps(layers, tile)` wraps the `mlp` of each layer with it (dense MLPs: a mixture of experts is left alone);
inputs of at most `tile` tokens, and forwards without autograd, run the MLP as it is. Imports torch only.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from .wrap import wrap_forward

__all__ = ["run_tiled", "tile_mlps"]


def _tile(t: Tensor, s: int, tile: int) -> Tensor:
    return t[..., s:s + tile, :]


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, tile: int, n_inputs: int, *tensors):
        inputs, ctx.params = tensors[:n_inputs], tensors[n_inputs:]
        ctx.fn, ctx.tile = fn, tile
        ctx.save_for_backward(*inputs)
        ctx.set_materialize_grads(False)
        seq = inputs[0].shape[-2]
        outs = None
        with torch.no_grad():
            for s in range(0, seq, tile):
                ys = fn(*[_tile(t, s, tile) for t in inputs])
                if outs is None:
                    outs = [y.new_empty((*y.shape[:-2], seq, y.shape[-1])) for y in ys]
                for out, y in zip(outs, ys):
                    _tile(out, s, tile).copy_(y)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        inputs, params = ctx.saved_tensors, ctx.params
        wanted = [i for i, p in enumerate(params) if p.requires_grad]
        sums = {i: torch.zeros(params[i].shape, dtype=torch.float32, device=params[i].device) for i in wanted}
        dins = [torch.empty_like(t) if ctx.needs_input_grad[3 + j] else None for j, t in enumerate(inputs)]
        for s in range(0, inputs[0].shape[-2], ctx.tile):
            tiles = [_tile(t, s, ctx.tile).detach().requires_grad_(d is not None) for t, d in zip(inputs, dins)]
            with torch.enable_grad():
                ys = ctx.fn(*tiles)
            pairs = [(y, _tile(g, s, ctx.tile)) for y, g in zip(ys, grads) if g is not None and y.requires_grad]
            sources = [t for t, d in zip(tiles, dins) if d is not None] + [params[i] for i in wanted]
            got = list(torch.autograd.grad([y for y, _ in pairs], sources, [g for _, g in pairs], allow_unused=True)
                       if pairs else [None] * len(sources))
            for d in dins:
                if d is not None:  # (an input no output depends on gets zeros, as autograd would sum nothing)
                    g = got.pop(0)
                    _tile(d, s, ctx.tile).copy_(g) if g is not None else _tile(d, s, ctx.tile).zero_()
            for i, g in zip(wanted, got):
                if g is not None:
                    sums[i] += g
        return (None, None, None, *dins, *[sums[i].to(p.dtype) if i in sums else None for i, p in enumerate(params)])


def run_tiled(fn: Callable[..., Sequence[Tensor]], tile: int, inputs: Sequence[Tensor],
              params: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """`fn(*inputs)` (a tuple of tensors) computed in tiles of `tile` positions along dimension -2 of every input and
    output, each tile recomputed in backward; `params`: the tensors `fn` reads besides its inputs that may need
    gradients. `fn` must treat each position alone (no attention, no sequence-wide reduction)."""
    return _Tiled.apply(fn, tile, len(inputs), *inputs, *params)


def _is_dense_mlp(m: nn.Module) -> bool:
    # (a mixture of experts routes each token too, but keeps router losses and expert counts per call)
    return "MLP" in type(m).__name__ and not any("Expert" in type(c).__name__ for c in m.modules())


def tile_mlps(layers: nn.ModuleList, tile: int) -> int:
    """Run the dense `mlp` of each of `layers` in tiles of `tile` tokens while autograd records. Returns how many
    MLPs were wrapped."""
    if tile < 1:
        raise ValueError(f"tile={tile}: a tile holds at least one token")
    count = 0
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not _is_dense_mlp(mlp):
            continue

        def tiled(plain, mlp=mlp):
            def forward(x):
                if x.shape[-2] <= tile or not torch.is_grad_enabled():
                    return plain(x)
                return run_tiled(lambda t: (plain(t),), tile, [x], tuple(mlp.parameters()))[0]
            return forward

        count += wrap_forward(mlp, "tiled_mlp", tiled)  # (unwrap() puts the MLP's own forward back)
    return count
