"""Tiled MLP: each decoder layer's MLP run over the sequence in tiles of `tile` tokens, and each tile recomputed in
backward, so its intermediate activations (the gate and up projections and their product: several tokens x
intermediate-size tensors) exist for one tile at a time.

At 64k tokens an 8B layer's MLP holds ~7 GiB of them in its backward, more than a 24 GB card has beside the
weights; with 8k-token tiles, under 1 GiB. The cost: one more forward of the MLP in each backward (the tile's
recompute). An MLP sees each token alone, so tiles along the sequence give the same values. The weights' gradients
are summed over the tiles in float32 and handed to autograd once, so hooks that act when a gradient is complete
(the streamed optimizer's) run once per tensor, as without tiling.

`tile_mlps(layers, tile)` wraps the `mlp` of each layer (dense MLPs: a mixture of experts is left alone); inputs of
at most `tile` tokens, and forwards without autograd, run the MLP as it is. Imports torch only.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["tile_mlps"]


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward, tile: int, *params):
        ctx.forward, ctx.tile, ctx.params = forward, tile, params
        ctx.save_for_backward(x)
        out = None
        with torch.no_grad():
            for s in range(0, x.shape[-2], tile):
                y = forward(x[..., s:s + tile, :])
                if out is None:
                    out = y.new_empty((*x.shape[:-1], y.shape[-1]))
                out[..., s:s + tile, :] = y
        return out

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        wanted = [i for i, p in enumerate(ctx.params) if p.requires_grad]
        sums = {i: torch.zeros(ctx.params[i].shape, dtype=torch.float32, device=ctx.params[i].device) for i in wanted}
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        for s in range(0, x.shape[-2], ctx.tile):
            xt = x[..., s:s + ctx.tile, :].detach().requires_grad_(dx is not None)
            with torch.enable_grad():
                y = ctx.forward(xt)
            inputs = ([xt] if dx is not None else []) + [ctx.params[i] for i in wanted]
            grads = torch.autograd.grad(y, inputs, grad[..., s:s + ctx.tile, :], allow_unused=True)
            if dx is not None:
                dx[..., s:s + ctx.tile, :] = grads[0]
                grads = grads[1:]
            for i, g in zip(wanted, grads):
                if g is not None:
                    sums[i] += g
        return (dx, None, None, *[sums[i].to(p.dtype) if i in sums else None for i, p in enumerate(ctx.params)])


def _is_dense_mlp(m: nn.Module) -> bool:
    # (a mixture of experts routes each token too, but keeps router losses and expert counts per call)
    return "MLP" in type(m).__name__ and not any("Expert" in type(c).__name__ for c in m.modules())


def tile_mlps(layers: nn.ModuleList, tile: int) -> int:
    """Run the dense `mlp` of each of `layers` in tiles of `tile` tokens while autograd records. Returns how many
    MLPs were wrapped."""
    if tile < 1:
        raise ValueError(f"tile={tile}: a tile holds at least one token")
    wrapped = 0
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not _is_dense_mlp(mlp) or getattr(mlp, "_tiled_mlp", None):
            continue
        plain = mlp.forward
        params = tuple(mlp.parameters())

        def forward(x, plain=plain, params=params):
            if x.shape[-2] <= tile or not torch.is_grad_enabled():
                return plain(x)
            return _TiledMLP.apply(x, plain, tile, *params)

        mlp.forward = forward  # (an instance attribute: the module's hooks still run around it)
        mlp._tiled_mlp = tile
        wrapped += 1
    return wrapped
