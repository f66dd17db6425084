"""Every seam into transformers and accelerate that has no public hook, in one place, each reversible and with its
reason. The Trainer's private names used here and in the mixin: `_tr_loss` and `_globalstep_last_logged` (the
device loss filter), `_save_checkpoint`, `_get_output_dir`, `_save_optimizer_and_scheduler`,
`_load_optimizer_and_scheduler` (checkpoint staging, staging.py), `_load_from_checkpoint`, `_load_callback_state`
and `_train_batch_size` (a run's last checkpoint resumed without training, staging.py), `_clip_grad_norm` /
`_get_grad_norm` (clipping by the streamed optimizer); the callback handler's `on_log` (our figures beside the
Trainer's, kept out of its log history); accelerate's `prepare_model` / `prepare_optimizer` (patched
on this Trainer's accelerator only, while train() runs) and `ACCELERATE_BYPASS_DEVICE_MAP`; a model's
`hf_device_map` (swapped layers); the forward of layers transformers leaves out of gradient checkpointing
(`checkpoint_plain_stacks`)."""
from __future__ import annotations

import contextlib
import os

import torch

from ..engine.optim import StreamedAdamW8bit
from ..engine.wrap import wrap_forward
from .run_state import RunState


@contextlib.contextmanager
def overridden(obj, name: str, fn):
    """Within: `obj.<name>` is `fn` (an attribute of the instance, over its class's method); after, the class's
    method again (or the instance's own attribute it had before). For the seams transformers and accelerate do not
    offer."""
    before = vars(obj).get(name, _NONE)
    setattr(obj, name, fn)
    try:
        yield
    finally:
        if before is _NONE:
            delattr(obj, name)
        else:
            setattr(obj, name, before)


_NONE = object()


@contextlib.contextmanager
def smaller_shards(model, size: str | int):
    """Within: `model.save_pretrained(...)` splits its weights into shards of at most `size` (unless the call says
    otherwise), for the Trainer's own saves, which pass no shard size. Only transformers models: a PEFT model saves
    adapters, which are small."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        yield
        return
    with overridden(model, "save_pretrained", saving_in_shards(model, size)):
        yield


def saving_in_shards(model, size: str | int):
    """`model.save_pretrained` with shards of at most `size` unless the call says otherwise (transformers' default,
    50 GB, gathers a whole 8B model's weights in host memory for one shard, beside the optimizer's pinned states)."""
    save = type(model).save_pretrained

    def save_pretrained(*args, **kwargs):
        kwargs.setdefault("max_shard_size", size)
        return save(model, *args, **kwargs)

    return save_pretrained


@contextlib.contextmanager
def no_ddp_wrapper(accelerator, run: RunState):
    """Keep accelerate from wrapping the model in DistributedDataParallel (it does for any trainable model in
    a multi-process run): DDP would all-reduce every gradient into its own buckets, a second full gradient
    set on the GPU, and refuses swapped layers. There is no Trainer seam for this, so this Trainer's own
    accelerator prepares the model as for evaluation (mixed precision, placement) while train() runs."""
    if not run.sharded:
        yield
        return
    acc = accelerator
    prepare_model = acc.prepare_model
    bypass = os.environ.get("ACCELERATE_BYPASS_DEVICE_MAP")

    def without_ddp(model, device_placement=None, evaluation_mode=False):
        return prepare_model(model, device_placement=device_placement, evaluation_mode=True)

    if run.swap is not None:  # swapped layers are a multi-device map, which accelerate refuses when distributed
        os.environ["ACCELERATE_BYPASS_DEVICE_MAP"] = "true"
    try:
        with overridden(acc, "prepare_model", without_ddp):
            yield
    finally:
        if bypass is None:
            os.environ.pop("ACCELERATE_BYPASS_DEVICE_MAP", None)
        else:
            os.environ["ACCELERATE_BYPASS_DEVICE_MAP"] = bypass

@contextlib.contextmanager
def optimizer_not_moved(accelerator):
    """accelerate's prepare() "places" an optimizer by sending its whole state dict to the GPU and loading it
    back. The streamed optimizer's states are where they belong (pinned host memory, GPU only within its budget):
    the round trip would copy them all to the GPU (16 GiB for 8B, on a second train()), and it brought the
    learning rate back as a GPU tensor (see optim._as_float).
    While train() runs, this Trainer's accelerator prepares the streamed optimizer without placement."""
    acc = accelerator
    prepare_optimizer = acc.prepare_optimizer

    def in_place(optimizer, device_placement=None):
        if isinstance(optimizer, StreamedAdamW8bit):
            device_placement = False
        return prepare_optimizer(optimizer, device_placement=device_placement)

    with overridden(acc, "prepare_optimizer", in_place):
        yield

@contextlib.contextmanager
def loss_filter_on_device(args, run: RunState, *, on_device: bool):
    """The Trainer's `logging_nan_inf_filter` (on by default) reads each micro-batch's loss on the host, in a
    Python `if`: a device sync after every backward, after which the GPU waited while the CPU ran the optimizer
    step, the gradient norm and the log (~10 ms of a 3B step, measured). While train() runs on a GPU,
    the same filter runs on the device instead (`filtered_loss`, from training_step) and the Trainer's own is off;
    evaluate() has it back."""
    if not (args.logging_nan_inf_filter and on_device):
        yield
        return
    args.logging_nan_inf_filter = False
    run.device_loss_filter = True
    try:
        yield
    finally:
        run.device_loss_filter = False
        args.logging_nan_inf_filter = True

def filtered_loss(trainer, run: RunState, loss: torch.Tensor) -> torch.Tensor:
    """What the Trainer's filter adds to its running loss (`_tr_loss`): this micro-batch's loss, or where that is
    not finite, the running loss's mean over the steps since the last log -- without reading either on the host."""
    running, last = getattr(trainer, "_tr_loss", None), getattr(trainer, "_globalstep_last_logged", None)
    if not isinstance(running, torch.Tensor) or last is None:  # a transformers without them: its own filter
        run.device_loss_filter = False
        trainer.args.logging_nan_inf_filter = True
        return loss
    return torch.where(torch.isfinite(loss), loss, running / (1 + trainer.state.global_step - last))

@contextlib.contextmanager
def step_decisions(handler, begin, end):
    """While train() runs, the Trainer's `on_step_begin` event is followed by `begin()` (the residency fit's
    measurement starts) and its `on_step_end` by `end(state, control)` (the fit, skipped non-finite steps,
    interrupts), after every callback's: a wrapper of this Trainer's callback handler, not a callback of our own, so
    `callback_handler.callbacks` lists only what the user and the Trainer added."""
    on_step_begin, on_step_end = handler.on_step_begin, handler.on_step_end

    def begin_with_ours(args, state, control):
        control = on_step_begin(args, state, control)
        begin()
        return control

    def end_with_ours(args, state, control):
        control = on_step_end(args, state, control)
        end(state, control)
        return control

    with overridden(handler, "on_step_begin", begin_with_ours), overridden(handler, "on_step_end", end_with_ours):
        yield


@contextlib.contextmanager
def figures_to_callbacks(handler, add):
    """While train() runs, a training log (one with a loss) gets our figures (`add(state, logs)`: run_logs) just
    before the callbacks see it. The Trainer's `log()` has by then appended its own copy to `state.log_history`, which
    so stays the Trainer's alone (a resumed run's history equals the uninterrupted one's, as the Trainer's does), while
    the console, TensorBoard and W&B get one log with both. A wrapper of the handler, as step_decisions."""
    on_log = handler.on_log

    def on_log_with_ours(args, state, control, logs):
        if "loss" in logs:
            add(state, logs)
        return on_log(args, state, control, logs)

    with overridden(handler, "on_log", on_log_with_ours):
        yield


def claim_device_map(model, layers, device, swapped_indices) -> None:
    """A map with more than one entry tells the Trainer and accelerate not to move the model as a whole (the swap
    engine places the swapped layers itself)."""
    prefix = next(n for n, m in model.named_modules() if m is layers)
    model.hf_device_map = {"": str(device), **{f"{prefix}.{i}": "cpu" for i in swapped_indices}}


def checkpoint_plain_stacks(model) -> int:
    """Gradient checkpointing for the stacks of layers that transformers' `gradient_checkpointing_enable` leaves out:
    it checkpoints `GradientCheckpointingLayer`s only, and some models' other stacks are plain modules -- Mllama's 40
    vision encoder layers, whose activations a full finetune kept for backward (2 images x 4 tiles: about 0.6 GiB per
    layer, counted on the CPU at that shape; enough to run an 11B-Vision step out of a 24 GB card). Each such layer's
    forward runs under non-reentrant checkpointing while autograd records and one of its parameters trains (a frozen
    tower runs without autograd anyway). Returns how many layers were wrapped."""
    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    from ..engine.layers import layer_stacks

    inside = {id(m) for layer in model.modules() if isinstance(layer, GradientCheckpointingLayer)
              for m in layer.modules()}  # (a stack within a checkpointed layer is recomputed with it)
    count = 0
    for stack in layer_stacks(model):
        for layer in stack:
            if id(layer) in inside:
                continue

            def checkpointed(plain, params=tuple(layer.parameters())):
                def forward(*args, **kwargs):
                    if torch.is_grad_enabled() and any(p.requires_grad for p in params):
                        return checkpoint(plain, *args, use_reentrant=False, **kwargs)
                    return plain(*args, **kwargs)
                return forward

            count += wrap_forward(layer, "checkpointed", checkpointed)  # (unwrap() puts the layer's forward back)
    return count
