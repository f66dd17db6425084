"""Where a model's repeated blocks and their tensors are: the stacks of layers (decoder, vision encoder), and a
reference to one tensor of a layer (a parameter, a buffer, or a field of a bitsandbytes quantization state) that can
be pointed at another storage. Read by the layer-swap engine, the Trainer and the 4-bit loaders; imports torch only."""
from __future__ import annotations

from torch import Tensor, nn

__all__ = ["TensorRef", "decoder_layers", "layer_stacks", "quant_state_refs"]


def layer_stacks(model: nn.Module) -> list[nn.ModuleList]:
    """The stacks of repeated blocks (ModuleLists whose items hold linear layers): the decoder layers, and a vision
    encoder's layers. Longest first. The one way the package finds layers (swap, the Trainer, the 4-bit loaders)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)
             and all(any(isinstance(c, nn.Linear) for c in item.modules()) for item in m)]
    return sorted(lists, key=len, reverse=True)


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The decoder layers: the stack with the most parameters (of any HF causal LM, or a plain model's blocks)."""
    return max(layer_stacks(model), key=lambda m: sum(p.numel() for p in m.parameters()), default=None)


class TensorRef:
    """Where one swappable tensor lives: a parameter, a buffer, or a field of a quantization state."""

    __slots__ = ("owner", "name", "kind")

    def __init__(self, owner, name: str, kind: str):
        self.owner, self.name, self.kind = owner, name, kind

    def get(self) -> Tensor:
        if self.kind == "param":
            return self.owner._parameters[self.name]
        if self.kind == "buffer":
            return self.owner._buffers[self.name]
        return getattr(self.owner, self.name)

    def set(self, t: Tensor) -> None:
        if self.kind == "param":
            self.owner._parameters[self.name].data = t
        elif self.kind == "buffer":
            self.owner._buffers[self.name] = t
        else:
            setattr(self.owner, self.name, t)


def quant_state_refs(qs) -> list[TensorRef]:
    """bitsandbytes 4-bit QuantState: absmax and code (and the nested state of double quantization)."""
    refs = [TensorRef(qs, n, "attr") for n in ("absmax", "code") if isinstance(getattr(qs, n, None), Tensor)]
    if isinstance(getattr(qs, "offset", None), Tensor):
        refs.append(TensorRef(qs, "offset", "attr"))
    inner = getattr(qs, "state2", None)
    return refs + (quant_state_refs(inner) if inner is not None else [])
