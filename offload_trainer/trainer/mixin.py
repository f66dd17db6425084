"""OffloadTrainer: `transformers.Trainer` with the streamed 8-bit AdamW, layer swap, activation offload and the chunked
loss wired in. A thin shell: the run's settings and what it built are one `RunState` (run_state.py); what it builds
lives in wiring.py, checkpoints in staging.py, stops and skipped steps in guards.py, the log's figures in
run_logs.py, and every seam into transformers / accelerate without a public hook in seams.py (with its reason).
`OffloadMixin` carries it all, so TRL's `SFTTrainer` gets the same with `class OffloadSFTTrainer(OffloadMixin,
SFTTrainer)`.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import time
import warnings

import torch
from torch import nn
from transformers import Trainer

from . import fold, guards, run_history, run_logs, seams, staging, wiring
from ..engine import wrap
from ..engine.activations import enable_activation_offload
from ..settings import OffloadSettings
from .args import OffloadFields, streams_optimizer
from .conflicts import check_settings, check_trainer, launch_conflict
from ..errors import ConfigError
from ..engine.loss import chunked_causal_lm_loss
from ..models import base_model
from .outputs import OutputLock, check_output_dir, staged_save
from .run_state import RunState
from ..planner import SAVE_SHARD_BYTES, Plan

logger = logging.getLogger("offload_trainer")


def _liger_computes_loss(model: nn.Module) -> bool:
    """The model's forward is Liger's (`use_liger_kernel`: the Trainer binds it at train()): its fused linear
    cross-entropy never materialises the logits either, in one kernel, so the chunked loss steps aside for it rather
    than bypass it (calling the decoder and the head itself would silently drop Liger's loss)."""
    forward = getattr(model, "forward", None)
    return getattr(getattr(forward, "__func__", forward), "__module__", "").startswith("liger_kernel")


def _head_and_decoder(model: nn.Module):
    """(decoder, lm_head) when the chunked loss can reproduce the model's own loss exactly, else None."""
    inner = base_model(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    decoder = getattr(inner, getattr(inner, "base_model_prefix", ""), None)
    cfg = getattr(inner, "config", None)
    special = any(getattr(cfg, k, None) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
    if type(head) is not nn.Linear or decoder is None or decoder is inner or special:
        return None
    return decoder, head


def make_settings(args) -> OffloadSettings:
    """The run's settings from its arguments (`OffloadSettings.from_args`), a bad value as ConfigError."""
    try:
        return OffloadSettings.from_args(args)
    except ValueError as e:
        raise ConfigError(str(e)) from None


class OffloadMixin:
    """Mix into a `transformers.Trainer` subclass (before it): `class T(OffloadMixin, Trainer)`."""

    def __init__(self, *args, offload_plan: Plan | None = None, offload_settings: OffloadSettings | None = None,
                 **kwargs):
        """`offload_settings`: the run's settings, when the caller made them already from these arguments (the
        command, which planned with them); else they are made here, once: every later decision reads this value.
        `offload_plan`: the run's plan, when the caller made it already (`offload-trainer train` plans before
        loading any weight); else the Trainer plans at train()."""
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        self._run = None
        if training_args is not None:
            settings = offload_settings or make_settings(training_args)
            if not isinstance(training_args, OffloadFields):  # (ours met this as they were built)
                launch_conflict(training_args, settings.offload_optimizer)
            check_settings(settings, training_args)
            wiring.apply_gpu_memory_limit(settings.gpu_memory_limit_gb)  # (before the Trainer places anything)
            self._run = RunState(settings, offload_plan)  # (before the Trainer's constructor: it places the model)
        super().__init__(*args, **kwargs)
        if self._run is None:  # (the Trainer made its default arguments)
            self._run = RunState(offload_settings or make_settings(self.args), offload_plan)
        given = self.optimizer is not None or self.optimizer_cls_and_kwargs is not None
        check_trainer(self._run.settings, self.args, given)
        if given:  # (an optimizer handed over is honoured: the Trainer's own path, said in the log)
            self._run.not_streaming_why = ("an optimizer was passed to the Trainer (optimizers= or "
                                           "optimizer_cls_and_kwargs=)")
        else:
            self._run.streaming, self._run.not_streaming_why = streams_optimizer(self.args, self._run.settings,
                                                                                 model=self.model)
        if isinstance(self.model, nn.Module) and wrap.attached(self.model):
            # (another Trainer's optimizer hooks would also update the weights in this one's backward)
            wrap.unwrap(self.model)
            logger.info("the model came with another OffloadTrainer's optimizer, layer swap or activation offload "
                        "attached: taken off it (that Trainer no longer trains this model; hand_back_model() does "
                        "this explicitly)")
        fold.check(self, self._run, OffloadMixin)  # (before the layer swap asks for a plan)
        wiring.install_layer_swap(self, self._run)

    def hand_back_model(self) -> nn.Module:
        """Take every wrapper, hook and mechanism of ours off the model and return it: each module's own forward
        back, no hook of ours, the streamed optimizer and the layer swap detached (swapped layers' weights left in
        CPU memory, as `hf_device_map` says), activation checkpointing as the Trainer set it. Until then the Trainer
        keeps them for evaluate(), predict() and another train(); a later train() takes the model again (its
        optimizer states kept), as does a new Trainer given it. `offload-trainer train` hands the model back at its
        end, and train() at an error."""
        run = self._run
        if not run.handed_back and isinstance(self.model, nn.Module):
            run.synchronize()
            wrap.unwrap(self.model)
        run.handed_back = True
        return self.model

    def _move_model_to_device(self, model, device):
        # With layer swap the Trainer must not move the whole model: install_layer_swap places it layer by layer.
        # (The Trainer's constructor and a model_init call this; TrainingArguments.place_model_on_device would need
        # the arguments to parse layer_swap on every read.)
        if self._run is not None and self._run.settings.layer_swap is not False:
            return None
        return super()._move_model_to_device(model, device)

    def _filters_loss_on_device(self) -> bool:
        return self.args.device.type == "cuda"

    # -------------------------------------------------------------- train
    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        """The Trainer's train(), with output_dir locked against a second run for its duration. An error hands the
        model back (`hand_back_model`): nothing of ours stays on it."""
        try:
            if not self.args.should_save:
                return self._train(resume_from_checkpoint, trial, **kwargs)
            check_output_dir(self.args.output_dir)
            with OutputLock(self.args.output_dir):
                return self._train(resume_from_checkpoint, trial, **kwargs)
        except BaseException:
            with contextlib.suppress(Exception):  # (the error that ended the run is the one to see)
                self.hand_back_model()
            raise

    def _train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        run = self._run
        if run.handed_back:  # (the Trainer's own optimizer and scheduler states are kept, as across its train()s)
            run.handed_back = False
            wiring.install_layer_swap(self, run)
            if run.optimizer is not None:
                wiring.attach_optimizer(run, run.optimizer, self.model)
        wiring.plan_the_run(self, run)
        guards.watch_host(run)
        fold.start(run, self.args.per_device_train_batch_size)
        wiring.install_tiling(self, run)
        if run.settings.checkpointing and seams.checkpoint_plain_stacks(
                self.accelerator.unwrap_model(self.model)) and run.first_time("plain stacks"):
            logger.info("activation checkpointing: also the layers transformers does not checkpoint (a vision encoder's)")
        resume_from_checkpoint = staging.resolve_resume(self, run, resume_from_checkpoint)
        staging.check_disk(self, run)
        if run.swap is not None:  # a checkpoint loaded by train() must land in the host copies
            run.swap.offload_all()
            run.swap.synchronize()
        last = staging.finished_at(self, resume_from_checkpoint) if resume_from_checkpoint else None
        run.figures = run_history.load_figures(resume_from_checkpoint) if resume_from_checkpoint else []
        if last is not None:
            return staging.load_finished(self, resume_from_checkpoint, last)
        # Trainer.train() (re)enables plain checkpointing before its loop; ours goes on top at the first step.
        run.new_train()
        if run.streaming and not isinstance(self.args, OffloadFields) and run.first_time("nonfinite"):
            logger.info("non-finite steps: an optimizer step whose loss or gradient norm is NaN/inf is skipped (weights "
                        "and 8-bit states kept), where the Trainer would apply it; training goes on, as the Trainer's "
                        "does (OffloadTrainingArguments' max_nonfinite_steps stops after that many in a row)")
        with guards.signals_stop_cleanly(run, lambda: self.state, self.args.output_dir), \
                seams.no_ddp_wrapper(self.accelerator, run), seams.optimizer_not_moved(self.accelerator), \
                seams.loss_filter_on_device(self.args, run, on_device=self._filters_loss_on_device()), \
                seams.step_decisions(self.callback_handler, self._on_step_begin, self._on_step_end), \
                seams.figures_to_callbacks(self.callback_handler, self._add_figures):
            result = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        # The last step's updates may still be queued (they wait for a next forward): the model a caller reads after
        # train() is its final one, as with the Trainer's own optimizer.
        run.synchronize()
        guards.raise_if_stopped(run, self.args.output_dir, self.state.global_step)
        return result

    def _on_step_begin(self) -> None:
        run = self._run
        if run.fit is not None:
            run.fit.start_step()
        if run.first_time("warmup"):
            guards.warmup_past_the_run(self.args, self.state.max_steps)
        if run.optimizer is not None and run.optimizer.device.type == "cuda" and run.first_time("first step"):
            logger.info("first step: also compiles the update kernels and makes the pinned buffers (once: tens of "
                        "seconds for a large model; later steps are timed in the logs)")

    def _on_step_end(self, state, control) -> None:
        run = self._run
        if run.fit is not None and not run.fit.done:
            run.fit.end_step(before_move=run.synchronize)
            seams.claim_device_map(self.model, run.swap.stack, self.args.device, run.swap.swapped_indices)
        guards.on_step_end(run, state.global_step, control)

    # -------------------------------------------------------------- checkpoints (staging.py)
    def _get_output_dir(self, trial):
        return self._run.staging_dir or super()._get_output_dir(trial)

    @contextlib.contextmanager
    def _not_training_time(self):
        """Time spent saving or evaluating: left out of the logged tok/s (it dipped at every save and evaluation)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._run.log.paused_s += time.perf_counter() - t0

    def _save_checkpoint(self, model, trial):
        with self._not_training_time():
            self._save_checkpoint_staged(model, trial)

    def _save_checkpoint_staged(self, model, trial):
        staging.save_checkpoint(self, self._run, model, trial, super()._save_checkpoint)

    def _save_optimizer_and_scheduler(self, output_dir):
        if self._run.optimizer is None or not self._run.sharded:
            return super()._save_optimizer_and_scheduler(output_dir)
        staging.save_optimizer_shard(self, self._run, output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if not staging.load_streamed_states(self, self._run, checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)

    # -------------------------------------------------------------- optimizer
    def create_optimizer(self, model=None):
        if self._run.streaming:
            return wiring.streamed_optimizer(self, self._run, model)
        optimizer = super().create_optimizer(model)
        wiring.say_not_streaming(self, self._run, optimizer, model)
        return optimizer

    def _clip_grad_norm(self, model):
        run = self._run
        if run.optimizer is None:
            return super()._clip_grad_norm(model)
        redo = self._redo_step if run.optimizer.speculative else None
        try:
            norm = run.optimizer.clip_grad_norm_(run.settings.max_grad_norm, redo=redo)
        finally:
            run.step_batches = []
        # one sync per optimizer step (none more where the optimizer read the norm already)
        value = run.optimizer.last_norm
        if run.nonfinite.check and not math.isfinite(norm.item() if value is None else value):
            guards.nonfinite_step(run)
        return norm

    def _redo_step(self) -> None:
        """Speculative clipping undid this step (its clip fired): run its micro-batches' forward and backward again,
        as the Trainer's loop ran them (the optimizer has put the weights and the RNG back). What their losses and
        TRL's per-step metrics would add a second time is not kept: the first pass's stand, and are equal."""
        metrics = getattr(self, "_metrics", None)
        saved = copy.deepcopy(metrics) if isinstance(metrics, dict) else None
        for model, inputs, num_items_in_batch, accumulate in self._run.step_batches:
            with self._run.optimizer.no_update() if accumulate else contextlib.nullcontext():
                super().training_step(model, inputs, num_items_in_batch)
        if saved is not None:
            self._metrics = saved

    def _get_grad_norm(self, model, grad_norm=None):
        run = self._run
        if run.optimizer is None:
            norm = super()._get_grad_norm(model, grad_norm)
            # The Trainer's own optimizer (CPU, LoRA, another optim): with our arguments a non-finite step is skipped
            # there too -- its gradients dropped, which every torch optimizer takes as "leave this tensor as it is" --
            # and counted toward max_nonfinite_steps. (Plain TrainingArguments: the Trainer's own behaviour.)
            if run.nonfinite.limit and not math.isfinite(float(norm.item() if hasattr(norm, "item") else norm)):
                guards.nonfinite_step(run)
                for p in model.parameters():
                    p.grad = None
            return norm
        if grad_norm is None:  # no clipping: the norm the hooks measured before each update
            grad_norm = self._run.optimizer.clip_grad_norm_(float("inf"))
        return grad_norm

    # -------------------------------------------------------------- step and loss
    def training_step(self, model, inputs, num_items_in_batch=None):
        run, opt = self._run, self._run.optimizer
        if run.want_activations and run.activations is None:
            run.activations = enable_activation_offload(self.accelerator.unwrap_model(model))
        tokens = int(inputs["input_ids"].numel()) if "input_ids" in inputs else 0
        run.log.tokens += tokens
        if run.fold is not None:  # (fold.py: the group's forward and backward run at its last micro-batch)
            if num_items_in_batch is None:
                raise ConfigError("fold_accumulation: these batches get no num_items_in_batch from the Trainer (no "
                                  "labels), so each micro-batch's loss is its own mean and folding would change it: "
                                  "set fold_accumulation: off")
            inputs = run.fold.add(inputs, last=self.accelerator.sync_gradients)
            if inputs is None:
                return torch.zeros((), device=self.args.device)  # (its loss is in the group's)
            tokens = int(inputs["input_ids"].numel())
        if run.fit is not None:
            run.fit.saw_batch(tokens)
        accumulate = opt is not None and not self.accelerator.sync_gradients
        if opt is not None and opt.speculative:  # (a redo runs these again)
            run.step_batches.append((model, dict(inputs), num_items_in_batch, accumulate))
        try:
            with opt.no_update() if accumulate else contextlib.nullcontext():
                loss = super().training_step(model, inputs, num_items_in_batch)
        except torch.OutOfMemoryError as e:
            if self.args.auto_find_batch_size:  # (the Trainer's retry with a smaller batch reads torch's error)
                raise
            raise guards.out_of_memory(run, self.state.global_step + 1, e, self.args.output_dir) from e
        return seams.filtered_loss(self, run, loss) if run.device_loss_filter else loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # Updates during backward cannot be undone: a non-finite loss must be caught before its backward.
        run, opt = self._run, self._run.optimizer
        guard = (opt is not None and opt.update_in_backward and not return_outputs and model.training
                 and torch.is_grad_enabled() and run.nonfinite.check)
        if guard and run.nonfinite.skip_this_step:  # a micro-batch of this step was non-finite: all of it is skipped
            return torch.full((), float("nan"), device=self.args.device, requires_grad=True)
        loss = self._offload_loss(model, inputs, return_outputs, num_items_in_batch)
        if guard and not opt.all_finite(loss):
            guards.nonfinite_step(run)
            return torch.full((), float("nan"), device=loss.device, requires_grad=True)  # no backward into the model
        return loss

    def _offload_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        chunk = self._run.settings.loss_chunk_size
        unwrapped = self.accelerator.unwrap_model(model)
        if chunk and _liger_computes_loss(base_model(unwrapped)):
            chunk = 0
            if self._run.first_time("liger"):
                logger.info("use_liger_kernel: Liger's fused linear cross-entropy computes the loss (it keeps no full "
                            "logits either); loss_chunk_size steps aside")
        parts = _head_and_decoder(unwrapped) if chunk else None
        usable = (parts is not None and not return_outputs and "labels" in inputs and self.label_smoother is None
                  and self.compute_loss_func is None)
        if not usable:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        decoder, head = parts
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        if not self.model_accepts_loss_kwargs:
            num_items_in_batch = None  # as the Trainer does: the model's loss would be a per-batch mean
        # The decoder and head are called past the model's forward, which accelerate wraps in the mixed-precision
        # autocast: without it a model of mixed dtypes (axolotl's fp32 embeddings and norms) fails its first matmul.
        with self.accelerator.autocast():
            hidden = decoder(**inputs, use_cache=False)[0]  # (a cache would also turn off packed rows' masks)
            loss = chunked_causal_lm_loss(hidden, labels, head.weight, head.bias, chunk_size=chunk,
                                          num_items_in_batch=num_items_in_batch)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # as Trainer.compute_loss: num_items_in_batch counts every rank's tokens, gradients are averaged
            loss = loss * self.accelerator.num_processes
        return loss

    # -------------------------------------------------------------- weights read outside forward
    def save_model(self, output_dir=None, _internal_call=False):
        """The Trainer's save; a user's (not a checkpoint's, which is staged as a whole) is written into a staging
        directory and moved into place once complete, then pushed if `push_to_hub` (the Trainer pushes output_dir,
        which must hold the new files by then)."""
        self._run.synchronize()
        with warnings.catch_warnings(), seams.smaller_shards(self.accelerator.unwrap_model(self.model), SAVE_SHARD_BYTES):
            # swapped layers are in host memory, not on disk: nothing to warn about
            warnings.filterwarnings("ignore", message="Attempting to save a model with offloaded modules")
            if _internal_call or not self.args.should_save:
                return super().save_model(output_dir, _internal_call)
            guards.refuse_nonfinite_weights(self.model, self.state.global_step, "the model", self.args.output_dir)
            with staged_save(output_dir or self.args.output_dir, "the model") as staging:
                super().save_model(staging, _internal_call=True)
        if self.args.push_to_hub:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def evaluate(self, *args, **kwargs):
        self._run.synchronize()
        with self._not_training_time():
            if not self._run.device_loss_filter:
                return super().evaluate(*args, **kwargs)
            self.args.logging_nan_inf_filter = True  # (evaluation filters its losses on the host, after its loop)
            try:
                return super().evaluate(*args, **kwargs)
            finally:
                self.args.logging_nan_inf_filter = False

    # -------------------------------------------------------------- logs
    def _add_figures(self, state, logs) -> None:  # a training log: throughput and memory beside the Trainer's
        run_logs.add_run_figures(self._run, logs, state.global_step)

    def save_state(self):
        """The Trainer's trainer_state.json and our figures beside it (run_history.py), moved into output_dir when
        written (the Trainer's own save_state writes through a link planted at that name)."""
        if self.is_world_process_zero():
            with staged_save(self.args.output_dir, "the trainer state") as staging:
                self.state.save_to_json(os.path.join(staging, "trainer_state.json"))
                run_history.save_figures(self._run, staging)


class OffloadTrainer(OffloadMixin, Trainer):
    """Drop-in replacement for `transformers.Trainer`."""
