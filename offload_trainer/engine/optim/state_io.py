"""The streamed optimizer's state dict (a mixin of `StreamedAdamW8bit`): torchao `AdamW8bit`'s layout, loaded in
place into the existing pinned buffers (a checkpoint's states never take a second copy in RAM)."""
from __future__ import annotations

import torch
from torch import Tensor
from torchao.optim.subclass_8bit import OptimState8bit

from .update import as_float


class StateDictIO:
    def state_dict(self):
        """torchao `AdamW8bit`'s layout, lr included: a 0-dim float32 tensor there (its step() refuses a number)."""
        self.synchronize()
        sd = super().state_dict()
        for g in sd["param_groups"]:  # (copies of our groups: ours keep their float)
            g["lr"] = torch.tensor(g["lr"], dtype=torch.float32)
        return sd

    def load_state_dict(self, state_dict) -> None:
        """Copy a saved state (ours or torchao AdamW8bit's) into the existing host buffers, in place."""
        self.synchronize()
        if state_dict["state"]:
            self._ensure_states()
        groups, saved = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved) or any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved)):
            raise ValueError("optimizer state does not match this model's parameter groups "
                             "(a checkpoint from a different model or different trainable parameters?)")
        idmap = {sid: p for g, s in zip(groups, saved) for sid, p in zip(s["params"], g["params"])}
        for sid, saved_st in state_dict["state"].items():
            p = idmap[sid]
            if self._owns(p):  # data parallel: another rank's share (a merged or unsharded checkpoint) is skipped
                self._load_tensor_state(self.state[p], saved_st)  # (into the current bank)
        for g, s in zip(groups, saved):
            for key, val in s.items():
                if key != "params":  # torchao's lr tensor, or one moved by accelerate: a number again
                    g[key] = as_float(val) if isinstance(val, Tensor) and val.numel() == 1 else val

    @staticmethod
    def _load_tensor_state(st: dict, saved: dict) -> None:
        for key, val in saved.items():
            dst = st.get(key)
            if dst is None:
                st[key] = val
                continue
            if tuple(dst.shape) != tuple(val.shape):
                raise ValueError(f"optimizer state {key!r} has shape {tuple(val.shape)} in the checkpoint "
                                 f"but {tuple(dst.shape)} here: the checkpoint is from a different model")
            if isinstance(dst, OptimState8bit) and isinstance(val, OptimState8bit):
                dst.codes.copy_(val.codes)
                dst.scale.copy_(val.scale)
            else:
                dst.copy_(val)
