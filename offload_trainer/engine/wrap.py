"""Everything of ours put on a user's model -- a module's forward replaced, a hook registered, a mechanism attached --
recorded on the model, so that one call takes it all off (`unwrap`) and the model is the user's again, as
accelerate's `add_hook_to_module` / `remove_hook_from_module` keep a module's original forward.

- `wrap_forward(module, tag, make)`: `module.forward = make(module.forward)`, once per tag (an instance attribute:
  the module's own hooks still run around it); `wrapped(module, tag)` says whether it is.
- `add_hook(model, handle)`: a hook's handle (module or tensor hook), removed by `unwrap`.
- `on_unwrap(model, undo)`: what a mechanism does to let go of the model (the streamed optimizer's hooks, the layer
  swap's, activation offload's checkpoint function), called by `unwrap`, last registered first.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

__all__ = ["wrap_forward", "wrapped", "add_hook", "on_unwrap", "unwrap", "attached", "carries_ours"]

_WRAPS = "_offload_trainer_wraps"  # on a module: [(tag, its instance attribute `forward` before, or _NONE)]
_UNDO = "_offload_trainer_undo"  # on the model: [handle.remove or a mechanism's undo]
_NONE = object()


def wrap_forward(module: nn.Module, tag: str, make: Callable[[Callable], Callable]) -> bool:
    """Replace `module.forward` by `make(module.forward)` unless `tag` replaced it already; True where it did now."""
    wraps = module.__dict__.setdefault(_WRAPS, [])
    if any(t == tag for t, _ in wraps):
        return False
    before = module.__dict__.get("forward", _NONE)
    module.forward = make(module.forward)
    wraps.append((tag, before))
    return True


def wrapped(module: nn.Module, tag: str) -> bool:
    return any(t == tag for t, _ in module.__dict__.get(_WRAPS, ()))


def add_hook(model: nn.Module, handle):
    """Record a hook's handle (`RemovableHandle`) registered on `model` or on one of its modules or tensors."""
    on_unwrap(model, handle.remove)
    return handle


def on_unwrap(model: nn.Module, undo: Callable[[], None]) -> None:
    model.__dict__.setdefault(_UNDO, []).append(undo)


def attached(model: nn.Module) -> bool:
    """Whether a hook or a mechanism of ours is attached to `model` (a forward replaced alone holds no state)."""
    return bool(model.__dict__.get(_UNDO))


def carries_ours(model: nn.Module) -> bool:
    """Whether anything of ours is on `model` (a forward replaced, a hook, a mechanism attached)."""
    return attached(model) or any(m.__dict__.get(_WRAPS) for m in model.modules())


def unwrap(model: nn.Module) -> int:
    """Take everything of ours off `model`: each mechanism let go (last attached first), each hook removed, each
    module's forward as it was before our first replacement. Returns how many forwards were restored."""
    undo = model.__dict__.pop(_UNDO, [])
    while undo:
        undo.pop()()
    restored = 0
    for m in model.modules():
        wraps = m.__dict__.pop(_WRAPS, None)
        if not wraps:
            continue
        before = wraps[0][1]
        if before is _NONE:
            m.__dict__.pop("forward", None)
        else:
            m.forward = before
        restored += 1
    return restored
