"""Gradient accumulation's micro-batches run as one (`fold_accumulation`): the Trainer's loop hands an optimizer step's
k micro-batches to `training_step` one by one; where the plan folds j of them, the first j - 1 are kept and the j-th
runs with them as one micro-batch (concatenated, shorter rows padded on the right), its loss returned for the group.

Why it is exact: with a model that takes `num_items_in_batch`, the Trainer's loss for a micro-batch is the sum of its
tokens' losses divided by the step's token count, so k backward passes sum to the gradient of one batch holding them
all. Padding on the right adds positions after every real token, masked out of attention (`attention_mask` 0) and
of the loss (label -100): a causal model's outputs at the real tokens do not see them, and their positions are
unchanged. What the Trainer counts and calls per micro-batch -- tokens seen, floating-point ops, the substep
callbacks, `global_step`, `epoch`, the schedule, checkpoints -- still happens per micro-batch in its loop; only the
forward and backward move. Where the result would differ, nothing folds (`blockers`, said in the log).

Each fold and the redo of a speculative step run the same folded batch."""
from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from ..errors import ConfigError

logger = logging.getLogger("offload_trainer")

# The keys a row of tokens may carry, and what pads it on the right: positions no real token attends to and no loss
# reads. (position_ids: the padding counts from 0 as a document of its own, so a packed row's last document does not
# run on into it; input_ids: any id, since nothing reads its output.)
PADDING = {"input_ids": 0, "attention_mask": 0, "labels": -100, "position_ids": None, "token_type_ids": 0}


def config_blockers(args, config) -> list[str]:
    """Why folding would change the result, from the arguments and the model's config alone (the command asks before
    any weight loads)."""
    why = []
    if getattr(args, "neftune_noise_alpha", None):
        why.append("NEFTune's noise is scaled by the padded batch's length")
    if getattr(args, "label_smoothing_factor", 0):
        why.append("label smoothing's loss is a mean per micro-batch")
    if int(getattr(args, "world_size", 1) or 1) > 1 and not getattr(args, "average_tokens_across_devices", True):
        why.append("with several ranks each rank's loss is scaled by its own tokens unless "
                   "average_tokens_across_devices is true")
    if config is not None:
        text = getattr(config, "text_config", None) or config
        if getattr(config, "vision_config", None) is not None:
            why.append("image batches are not rows of tokens")
        if getattr(text, "output_router_logits", False):
            why.append("the MoE auxiliary loss is added per micro-batch")
        dropout = sorted(k for k, v in vars(text).items() if "dropout" in k and isinstance(v, (int, float))
                         and not isinstance(v, bool) and v > 0)
        if dropout:
            why.append(f"dropout ({', '.join(dropout)}) draws its masks for the batch's shape")
    return why


def blockers(trainer, mixin: type) -> list[str]:
    """Why folding `trainer`'s micro-batches would change the result: `config_blockers`, then what only the built
    Trainer knows. Its forward and backward must be the Trainer's own (`mixin`'s training_step and compute_loss over
    `transformers.Trainer`'s: a subclass's loss or metrics -- TRL's per-micro-batch entropy and accuracy, a DPO loss
    -- may be computed per micro-batch)."""
    from transformers import Trainer

    model = trainer.accelerator.unwrap_model(trainer.model)
    why = config_blockers(trainer.args, getattr(model, "config", None))
    if not trainer.model_accepts_loss_kwargs:
        why.append("the model takes no num_items_in_batch: its loss is a mean per micro-batch, which the Trainer "
                   "averages")
    if trainer.compute_loss_func is not None:
        why.append("a compute_loss_func computes the loss")
    mro = type(trainer).__mro__
    after = mro[mro.index(mixin) + 1:]
    for name in ("training_step", "compute_loss"):
        own = getattr(type(trainer), name) is getattr(mixin, name)
        base = next((c for c in after if name in vars(c)), Trainer)
        if not own or base is not Trainer:
            cls = base if own else next(c for c in mro if name in vars(c))
            why.append(f"{cls.__name__}.{name} is not the Trainer's own")
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()) and not any("dropout" in w for w in why):
        why.append("dropout draws its masks for the batch's shape")
    return why


class Fold:
    """An optimizer step's micro-batches, `size` at a time, as one: `add(inputs, last)` keeps them and returns the
    batches to run now -- none until the group is full or the step's last micro-batch came (`last`), then the group
    as one batch."""

    def __init__(self, size: int):
        self.size = size
        self.kept: list[dict] = []

    def add(self, inputs: dict, last: bool) -> dict | None:
        self.kept.append(inputs)
        if len(self.kept) < self.size and not last:
            return None
        group, self.kept = self.kept, []
        return concatenate(group)

    def clear(self) -> None:
        """A train() starts (or stopped inside a step): micro-batches kept from an unfinished step are not the next
        one's."""
        self.kept = []


def concatenate(batches: list[dict]) -> dict:
    """One batch of `batches`' rows, in order, each key's rows padded on the right to the longest (PADDING).
    ConfigError where a batch holds something else than rows of tokens: a plan that folds counted on one micro-batch
    of the group's size (no gradient kept between them), so running them one by one could run out of memory."""
    if len(batches) == 1:
        return batches[0]
    keys = set(batches[0])
    odd = set()
    for b in batches:
        odd |= (set(b) ^ keys) | {k for k, v in b.items()
                                  if k not in PADDING or not (isinstance(v, torch.Tensor) and v.dim() == 2)}
    if odd:
        raise ConfigError(f"fold_accumulation: the micro-batches hold {', '.join(map(repr, sorted(odd)))}, which "
                          f"folding does not know as rows of tokens to pad (it knows {', '.join(PADDING)}): set "
                          f"fold_accumulation: off")
    length = max(b[k].shape[1] for b in batches for k in keys)
    out = {}
    for k in batches[0]:
        rows = []
        for b in batches:
            t = b[k]
            short = length - t.shape[1]
            if short:
                pad = PADDING[k]
                fill = (torch.arange(short, device=t.device, dtype=t.dtype).expand(t.shape[0], short)
                        if pad is None else t.new_full((t.shape[0], short), pad))
                t = torch.cat([t, fill], dim=1)
            rows.append(t)
        out[k] = torch.cat(rows, dim=0)
    return out


def settings_for(settings, why: list[str]):
    """`settings` as they fold where nothing in `why` would change the result, else folding nothing
    (`fold_accumulation` given as a count is refused, naming why)."""
    if not why or settings.accumulation <= 1 or settings.fold == 1:
        return settings
    if settings.fold is not None:
        raise ConfigError(f"fold_accumulation: {settings.fold} would change the result here ({'; '.join(why)}): set "
                          f"fold_accumulation: off (or auto, which folds only where the result is the same)")
    return dataclasses.replace(settings, fold=1)


def check(trainer, run, mixin: type) -> None:
    """Once, as the Trainer is built: where folding would change the result (`blockers`), the run's settings fold
    nothing, and a plan that folded (the command's, made before the model was built) is made again at train(). The
    reasons are kept for the log (`run.fold_blockers`)."""
    if run.settings.accumulation <= 1 or run.settings.fold == 1:
        return
    run.fold_blockers = blockers(trainer, mixin)
    run.settings = settings_for(run.settings, run.fold_blockers)
    if run.settings.fold == 1 and run.plan is not None and run.plan.fold > 1:
        run.plan = None


def start(run, batch: int) -> None:
    """At train(), once planned: the micro-batches the plan folds (or `fold_accumulation`'s count without a plan),
    said in the log once a run."""
    s = run.settings
    size = run.plan.fold if run.plan is not None else s.fold or 1
    run.fold = Fold(size) if size > 1 else None
    if s.accumulation <= 1 or not run.first_time("fold"):
        return
    k = s.accumulation
    if size > 1:
        logger.info("gradient accumulation: each optimizer step's %d micro-batches of %d run as %d of %d (%d x %d as "
                    "%d x %d: the same samples, loss and update; fold_accumulation: off runs them one by one)",
                    k, batch, k // size, batch * size, k, batch, k // size, batch * size)
    elif run.fold_blockers:
        logger.info("gradient accumulation: each of the step's %d micro-batches runs as the Trainer hands it (folding "
                    "them would change the result: %s)", k, "; ".join(run.fold_blockers))
