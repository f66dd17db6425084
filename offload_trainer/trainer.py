"""OffloadTrainer: `transformers.Trainer` with the streamed 8-bit AdamW and chunked loss wired in.

A thin shell over the mechanisms (optim.py, loss.py), through the Trainer's seams: `create_optimizer`,
`training_step`, `compute_loss`, `log`, `save_model`, `evaluate`, and the two private clip hooks
`_clip_grad_norm` / `_get_grad_norm` (there is no public seam for clipping; the streamed optimizer must
clip gradients that may already sit in host memory). On a GPU it also reads the Trainer's private running loss
(`_tr_loss`, `_globalstep_last_logged`) to filter non-finite losses on the device (`_loss_filter_on_device`; the
Trainer's own filter when they are absent). `OffloadMixin` carries it all, so TRL's `SFTTrainer` gets the same with
`class OffloadSFTTrainer(OffloadMixin, SFTTrainer)`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import shutil
import signal
import threading
import time
import warnings

import torch
from torch import nn
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from .activations import enable_activation_offload
from .args import (OffloadFields, OffloadTrainingArguments, checkpointing_on, offload_conflict, several_gpus_conflict,
                   streams_optimizer)
from .checkpoint import (STAGING_PREFIX, check_checkpoint, clean_staging, load_optimizer_states,
                         newest_complete_checkpoint, optimizer_shard_name, publish)
from .config import ConfigError
from .distributed import Sharding
from .errors import CheckpointError, StorageError, TrainingInterrupted, TrainingStopped
from .loss import chunked_causal_lm_loss
from .optim import StreamedAdamW8bit
from .outputs import OutputLock, check_output_dir, check_space, disk_full, free_bytes, staged_save
from .planner import SAVE_SHARD_BYTES, Machine, Plan, PlanError, device_state_setting, plan_from_args
from .swap import LayerSwap
from .sysinfo import gpu_budget_gib, rss_gib, trim_host_memory

logger = logging.getLogger("offload_trainer")

# A training log gives the C allocator's free pages back (sysinfo.trim_host_memory, ~5 ms) at most once in this many
# optimizer steps: with `logging_steps: 1` a trim at every step cost ~1% of a 3B step, spent while the GPU waits.
TRIM_EVERY_STEPS = 10


@contextlib.contextmanager
def _overridden(obj, name: str, fn):
    """Within: `obj.<name>` is `fn` (an attribute of the instance, over its class's method); after, the class's
    method again. For the seams transformers and accelerate do not offer."""
    setattr(obj, name, fn)
    try:
        yield
    finally:
        delattr(obj, name)


@contextlib.contextmanager
def smaller_shards(model, size: str | int):
    """Within: `model.save_pretrained(...)` splits its weights into shards of at most `size` (unless the call says
    otherwise), for the Trainer's own saves, which pass no shard size. Only transformers models: a PEFT model saves
    adapters, which are small."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        yield
        return
    save = type(model).save_pretrained

    def save_pretrained(*args, **kwargs):
        kwargs.setdefault("max_shard_size", size)
        return save(model, *args, **kwargs)

    with _overridden(model, "save_pretrained", save_pretrained):
        yield


@functools.lru_cache(maxsize=None)
def _own_default(name: str):
    return next(f.default for f in dataclasses.fields(OffloadTrainingArguments) if f.name == name)


def apply_gpu_memory_limit(gib: float | None) -> None:
    """Cap this process's CUDA memory at `gib` GiB (emulates a smaller card on a bigger one)."""
    if not gib:
        return
    if not torch.cuda.is_available():
        raise ConfigError(f"gpu_memory_limit_gb={gib:g} caps GPU memory, but PyTorch sees no CUDA GPU (a CPU-only "
                          f"torch build, or no driver). Remove gpu_memory_limit_gb to train on the CPU; "
                          f"`offload-trainer plan` plans for a GPU without one.")
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if gib * 2**30 > total:
        raise ConfigError(f"gpu_memory_limit_gb={gib} is more than this GPU has ({total / 2**30:.1f} GiB)")
    torch.cuda.set_per_process_memory_fraction(gib * 2**30 / total)


def _head_and_decoder(model: nn.Module):
    """(decoder, lm_head) when the chunked loss can reproduce the model's own loss exactly, else None."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    decoder = getattr(inner, getattr(inner, "base_model_prefix", ""), None)
    cfg = getattr(inner, "config", None)
    special = any(getattr(cfg, k, None) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
    if type(head) is not nn.Linear or decoder is None or decoder is inner or special:
        return None
    return decoder, head


def _decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The largest ModuleList (the decoder layers of any HF causal LM)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)


class OffloadMixin:
    """Mix into a `transformers.Trainer` subclass (before it): `class T(OffloadMixin, Trainer)`."""

    def __init__(self, *args, **kwargs):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        conflict = offload_conflict(training_args)  # a plain TrainingArguments was not checked yet
        if conflict:
            raise ConfigError(conflict)
        conflict = several_gpus_conflict(training_args)
        if conflict:
            raise ConfigError(conflict)
        apply_gpu_memory_limit(getattr(training_args, "gpu_memory_limit_gb", None))
        super().__init__(*args, **kwargs)
        try:  # (an optimizer handed over is honoured: the Trainer's own path, said in the log)
            self._streaming, self._not_streaming_why = streams_optimizer(
                self.args, optimizer_given=self.optimizer is not None or self.optimizer_cls_and_kwargs is not None,
                model=self.model)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # Non-finite steps are skipped (the states stay sane); a plain TrainingArguments, where the Trainer would
        # train on, never stops on them, ours stops after max_nonfinite_steps in a row (0: no check).
        own_args = isinstance(self.args, OffloadFields)
        self._check_nonfinite = bool(self.args.max_nonfinite_steps) if own_args else True
        self._nonfinite_limit = self.args.max_nonfinite_steps if own_args else 0
        self._offload_opt: StreamedAdamW8bit | None = None
        self._tokens_since_log = 0
        self._last_log_time = time.perf_counter()
        self._paused_s = 0.0  # saving and evaluating since the last log (`_not_training_time`)
        self._last_bytes = 0
        self._last_stall_ms = 0.0
        self._last_trim_step: int | None = None
        self._plan: Plan | None = None
        self._activations = None  # the ActivationOffloader, once installed in this train()
        self._want_activations = False
        self._swap: LayerSwap | None = None
        self._install_layer_swap()
        self._staging_run_dir: str | None = None  # set while a checkpoint is written (see _save_checkpoint)
        self._interrupted: int | None = None  # the signal that asked training to stop
        self._device_loss_filter = False  # see _loss_filter_on_device
        self._skip_step = False  # this optimizer step saw a non-finite loss or gradient norm
        self._nonfinite = {"skipped": 0, "in_a_row": 0, "stopped": False}
        self._said_nonfinite = False

    def _flag(self, name: str):
        # A plain TrainingArguments (a script that only swapped Trainer for OffloadTrainer) gets our defaults.
        return getattr(self.args, name, _own_default(name))

    # -------------------------------------------------------------- plan
    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        """The Trainer's train(), with output_dir locked against a second run for its duration."""
        if not self.args.should_save:
            return self._train(resume_from_checkpoint, trial, **kwargs)
        check_output_dir(self.args.output_dir)
        with OutputLock(self.args.output_dir):
            return self._train(resume_from_checkpoint, trial, **kwargs)

    def _train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        self._make_plan()
        resume_from_checkpoint = self._resolve_resume(resume_from_checkpoint)
        self._check_disk()
        if self._swap is not None:  # a checkpoint loaded by train() must land in the host copies
            self._swap.offload_all()
            self._swap.synchronize()
        # Trainer.train() (re)enables plain checkpointing before its loop; ours goes on top at the first step.
        self._activations = None
        self._want_activations = self._resolved("activation_offload") and checkpointing_on(self.args)
        self._interrupted = None
        self._last_trim_step = None
        self._last_log_time, self._paused_s, self._tokens_since_log = time.perf_counter(), 0.0, 0
        self._nonfinite.update(in_a_row=0, stopped=False)
        if self._streaming and not isinstance(self.args, OffloadFields) and not self._said_nonfinite:
            self._said_nonfinite = True
            logger.info("non-finite steps: an optimizer step whose loss or gradient norm is NaN/inf is skipped (weights "
                        "and 8-bit states kept), where the Trainer would apply it; training goes on, as the Trainer's "
                        "does (OffloadTrainingArguments' max_nonfinite_steps stops after that many in a row)")
        with self._signals_stop_cleanly(), self._no_ddp_wrapper(), self._optimizer_not_moved(), \
                self._loss_filter_on_device(), self._step_end_decisions():
            result = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        if self._interrupted is not None:
            ckpt = newest_complete_checkpoint(self.args.output_dir)
            name = signal.Signals(self._interrupted).name
            raise TrainingInterrupted(
                f"{name}: stopped after step {self.state.global_step}; "
                + (f"the last checkpoint is {ckpt} (continue with resume_from_checkpoint: true)" if ckpt
                   else "no checkpoint was saved (save_on_interrupt is off and none was due)"),
                self._interrupted, ckpt)
        if self._nonfinite["stopped"]:
            ckpt = newest_complete_checkpoint(self.args.output_dir)
            raise TrainingStopped(
                f"{self._nonfinite['in_a_row']} optimizer steps in a row had a non-finite loss or gradient norm "
                f"(all skipped: weights and optimizer states are those of the last finite step, "
                f"{self.state.global_step - self._nonfinite['in_a_row']}). Lower learning_rate, check the data, or "
                f"raise max_nonfinite_steps. " + (f"Last checkpoint: {ckpt}." if ckpt else ""))
        return result

    # -------------------------------------------------------------- data parallel
    def _sharded(self) -> bool:
        """Several ranks and the streamed optimizer: it reduces gradients and shards states itself."""
        return self.args.world_size > 1 and self._streaming

    @contextlib.contextmanager
    def _no_ddp_wrapper(self):
        """Keep accelerate from wrapping the model in DistributedDataParallel (it does for any trainable model in
        a multi-process run): DDP would all-reduce every gradient into its own buckets, a second full gradient
        set on the GPU, and refuses swapped layers. There is no Trainer seam for this, so this Trainer's own
        accelerator prepares the model as for evaluation (mixed precision, placement) while train() runs."""
        if not self._sharded():
            yield
            return
        acc = self.accelerator
        prepare_model = acc.prepare_model
        bypass = os.environ.get("ACCELERATE_BYPASS_DEVICE_MAP")

        def without_ddp(model, device_placement=None, evaluation_mode=False):
            return prepare_model(model, device_placement=device_placement, evaluation_mode=True)

        if self._swap is not None:  # swapped layers are a multi-device map, which accelerate refuses when distributed
            os.environ["ACCELERATE_BYPASS_DEVICE_MAP"] = "true"
        try:
            with _overridden(acc, "prepare_model", without_ddp):
                yield
        finally:
            if bypass is None:
                os.environ.pop("ACCELERATE_BYPASS_DEVICE_MAP", None)
            else:
                os.environ["ACCELERATE_BYPASS_DEVICE_MAP"] = bypass

    @contextlib.contextmanager
    def _optimizer_not_moved(self):
        """accelerate's prepare() "places" an optimizer by sending its whole state dict to the GPU and loading it
        back. The streamed optimizer's states are where they belong (pinned host memory, GPU only within its budget):
        the round trip would copy them all to the GPU (16 GiB for 8B, on a second train()), and it brought the
        learning rate back as a GPU tensor (see optim._as_float).
        While train() runs, this Trainer's accelerator prepares the streamed optimizer without placement."""
        acc = self.accelerator
        prepare_optimizer = acc.prepare_optimizer

        def in_place(optimizer, device_placement=None):
            if isinstance(optimizer, StreamedAdamW8bit):
                device_placement = False
            return prepare_optimizer(optimizer, device_placement=device_placement)

        with _overridden(acc, "prepare_optimizer", in_place):
            yield

    def _filters_loss_on_device(self) -> bool:
        return self.args.device.type == "cuda"

    @contextlib.contextmanager
    def _loss_filter_on_device(self):
        """The Trainer's `logging_nan_inf_filter` (on by default) reads each micro-batch's loss on the host, in a
        Python `if`: a device sync after every backward, after which the GPU waited while the CPU ran the optimizer
        step, the gradient norm and the log (~10 ms of a 3B step, run 20261201-s21c). While train() runs on a GPU,
        the same filter runs on the device instead (`_filtered`, from training_step) and the Trainer's own is off;
        evaluate() has it back."""
        if not (self.args.logging_nan_inf_filter and self._filters_loss_on_device()):
            yield
            return
        self.args.logging_nan_inf_filter = False
        self._device_loss_filter = True
        try:
            yield
        finally:
            self._device_loss_filter = False
            self.args.logging_nan_inf_filter = True

    def _filtered(self, loss: torch.Tensor) -> torch.Tensor:
        """What the Trainer's filter adds to its running loss (`_tr_loss`): this micro-batch's loss, or where that is
        not finite, the running loss's mean over the steps since the last log -- without reading either on the host."""
        running, last = getattr(self, "_tr_loss", None), getattr(self, "_globalstep_last_logged", None)
        if not isinstance(running, torch.Tensor) or last is None:  # a transformers without them: its own filter
            self._device_loss_filter = False
            self.args.logging_nan_inf_filter = True
            return loss
        return torch.where(torch.isfinite(loss), loss, running / (1 + self.state.global_step - last))

    # -------------------------------------------------------------- checkpoints
    def _resolve_resume(self, resume):
        """True / 'true' -> the newest complete checkpoint in output_dir; a path -> checked before anything loads."""
        if isinstance(resume, str) and resume.strip().lower() in ("true", "latest", "false", "none", ""):
            resume = resume.strip().lower() in ("true", "latest")
        if self.args.should_save:
            clean_staging(self.args.output_dir)  # what a killed save left behind
        self.accelerator.wait_for_everyone()
        if resume is True:
            found = newest_complete_checkpoint(self.args.output_dir, self.model)
            if found is None:  # the Trainer's own words first: scripts match on them
                raise CheckpointError(f"No valid checkpoint found in output directory ({self.args.output_dir}): "
                                      f"resume_from_checkpoint: true, but it holds no complete checkpoint-N "
                                      f"directory. Start without resume_from_checkpoint.")
            logger.info("resuming from %s", found)
            return found
        if resume:
            check_checkpoint(str(resume), self.model)
            return str(resume)
        return None

    def _check_disk(self) -> None:
        if getattr(self.args.save_strategy, "value", self.args.save_strategy) == "no" or not self.args.should_save:
            return
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        states = 2 * trainable * (1 + 4 / 256) if self._streaming else 8 * trainable
        # a new checkpoint is written in full before the previous one can be rotated out
        check_space(self.args.output_dir, int((weights + states) * 1.05) + 2**20, "one checkpoint (weights and "
                    "optimizer states; or set save_strategy: 'no', and save the model yourself)")

    def _get_output_dir(self, trial):
        return getattr(self, "_staging_run_dir", None) or super()._get_output_dir(trial)

    @contextlib.contextmanager
    def _not_training_time(self):
        """Time spent saving or evaluating: left out of the logged tok/s (it dipped at every save and evaluation)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._paused_s += time.perf_counter() - t0

    def _save_checkpoint(self, model, trial):
        with self._not_training_time():
            self._save_checkpoint_staged(model, trial)

    def _save_checkpoint_staged(self, model, trial):
        """The Trainer's checkpoint, written into a staging directory and renamed into place when complete."""
        run_dir = self._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging = os.path.join(run_dir, STAGING_PREFIX + name)
        main = self.args.should_save  # several ranks write into one staging dir; the main one publishes it
        if main:
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)
        self.accelerator.wait_for_everyone()
        self._staging_run_dir = staging
        try:
            super()._save_checkpoint(model, trial)
            self.accelerator.wait_for_everyone()  # every rank's optimizer shard and RNG state is written
            if main:
                publish(os.path.join(staging, name), os.path.join(run_dir, name))
            self.accelerator.wait_for_everyone()
        except Exception as e:  # torch.save and safetensors report a full disk in their own words
            if not disk_full(e, run_dir):
                raise
            prev = newest_complete_checkpoint(run_dir)
            raise StorageError(f"out of disk space while saving {name} in {run_dir!r} "
                               f"({free_bytes(run_dir) / 2**30:.2f} GiB free); nothing was "
                               f"published. " + (f"The previous checkpoint {prev} is intact. " if prev else "")
                               + "Free some space and resume with resume_from_checkpoint: true.") from None
        finally:
            self._staging_run_dir = None
            if main:
                shutil.rmtree(staging, ignore_errors=True)
        best = self.state.best_global_step
        if best and os.path.isdir(os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best}")):
            self.state.best_model_checkpoint = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best}")
        if self.args.should_save:  # the Trainer rotated inside the staging directory: rotate the real one
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def _save_optimizer_and_scheduler(self, output_dir):
        if self._offload_opt is None or not self._sharded():
            return super()._save_optimizer_and_scheduler(output_dir)
        # each rank owns part of the states: every rank writes its own shard
        os.makedirs(output_dir, exist_ok=True)
        torch.save(self._offload_opt.state_dict(),
                   os.path.join(output_dir, optimizer_shard_name(self.args.process_index, self.args.world_size)))
        if self.args.should_save:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_optimizer_and_scheduler(self, checkpoint):
        states = load_optimizer_states(checkpoint) if checkpoint and self._offload_opt is not None else None
        if states is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        # mmap: the states go from the file's pages straight into the pinned buffers, never a second copy in RAM;
        # with several ranks each keeps the tensors it owns, whatever the number of ranks that saved them
        self._offload_opt.load_state_dict(states)
        sched = os.path.join(checkpoint, "scheduler.pt")
        if os.path.isfile(sched):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch's "please also save the optimizer" notice
                self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))

    # -------------------------------------------------------------- interrupts and non-finite steps
    @contextlib.contextmanager
    def _signals_stop_cleanly(self):
        """SIGINT / SIGTERM: finish the current step, save if save_on_interrupt, then stop; twice: stop now."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self._interrupted is not None:
                raise KeyboardInterrupt
            self._interrupted = signum
            logger.warning("%s received: finishing step %d, then %s (again to stop at once)",
                           signal.Signals(signum).name, self.state.global_step + 1,
                           "saving a checkpoint" if self._flag("save_on_interrupt") else "stopping")

        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    @contextlib.contextmanager
    def _step_end_decisions(self):
        """While train() runs, the Trainer's `on_step_end` event is followed by ours (skipped non-finite steps,
        interrupts), after every callback's: a wrapper of this Trainer's callback handler, not a callback of our
        own, so `callback_handler.callbacks` lists only what the user and the Trainer added."""
        handler = self.callback_handler
        on_step_end = handler.on_step_end

        def with_ours(args, state, control):
            control = on_step_end(args, state, control)
            self._on_step_end(control)
            return control

        with _overridden(handler, "on_step_end", with_ours):
            yield

    def _on_step_end(self, control) -> None:
        nf = self._nonfinite
        if self._skip_step:
            nf["skipped"] += 1
            nf["in_a_row"] += 1
            logger.warning("step %d: non-finite loss or gradient norm, update skipped (%d in a row)",
                           self.state.global_step, nf["in_a_row"])
            limit = self._nonfinite_limit
            if limit and nf["in_a_row"] >= limit:
                nf["stopped"] = True
                control.should_training_stop = True
        else:
            nf["in_a_row"] = 0
        self._skip_step = False
        if self._interrupted is not None:
            control.should_training_stop = True
            control.should_save = bool(self._flag("save_on_interrupt"))

    def _nonfinite_step(self) -> None:
        """This optimizer step is skipped: the streamed optimizer drops its gradients instead of updating."""
        self._skip_step = True
        if self._offload_opt is not None:
            self._offload_opt.skip_next_step()

    def _make_plan(self) -> None:
        """Run the planner once (logged), and let it decide the switches left unset."""
        peft = hasattr(self.model, "get_base_model")
        if self._plan is not None or not (self._streaming or peft):
            return
        if not getattr(self.args, "gpu_memory_limit_gb", None) and self.args.device.type != "cuda":
            return  # (a plan is of GPU memory, PCIe traffic and GPU step time: none applies on a CPU)
        lora = sum(p.numel() for p in self.model.parameters() if p.requires_grad) if peft else 0
        bits = 4 if getattr(self.model.get_base_model() if peft else self.model, "is_loaded_in_4bit", False) else 16
        config = getattr(self.model, "config", None)
        seq = self._longest_row()
        if config is None or not seq:
            return
        # no cap given: plan for the card (its free memory and what the model already holds), so the switches left
        # unset (gradient and activation offload, layer swap, states kept on the GPU) suit it
        gpu_gb = getattr(self.args, "gpu_memory_limit_gb", None) or gpu_budget_gib(Machine().cuda_context_gib)
        try:
            self._plan = plan_from_args(self.args, config, seq, gpu_gb=gpu_gb, lora_params=lora, weight_bits=bits)
        except (AttributeError, TypeError) as e:  # not a decoder-only LM config the planner knows
            logger.info("no plan: %s", e if isinstance(e, PlanError) else "the model's config has no shape the "
                        "planner reads")
            return
        except PlanError as e:
            if getattr(self.args, "gpu_memory_limit_gb", None):
                raise
            if gpu_gb:  # (the card's own memory: warn, and let training try with the switches as given)
                logger.warning("the planner finds no plan that fits this GPU (%.1f GiB): %s", gpu_gb, e)
            return
        logger.info("plan:\n%s", self._plan.table())

    def _longest_row(self) -> int | None:
        """Tokens in the longest row the training data can give, which the plan must hold: the configured maximum
        (TRL's `max_length`) when there is one; else the longest `input_ids` of a `datasets.Dataset` (read from its
        Arrow column, nothing decoded) or of the first 1,000 rows of another map-style dataset. None: no plan
        (a stream without a maximum, or rows that are not token ids)."""
        limit = getattr(self.args, "max_length", None) or getattr(self.args, "max_seq_length", None)
        if isinstance(limit, int) and limit > 0:
            return limit
        ds = self.train_dataset
        if ds is None or not hasattr(ds, "__len__") or not len(ds):
            if ds is not None:
                logger.info("plan: skipped -- a streaming dataset and no max_length to size it from")
            return None
        table = getattr(getattr(ds, "data", None), "table", None)
        if table is not None and "input_ids" in table.column_names:
            import pyarrow.compute as pc

            return pc.max(pc.list_value_length(table.column("input_ids"))).as_py()
        rows = [ds[i] for i in range(min(len(ds), 1000))]
        lengths = [len(r["input_ids"]) for r in rows if isinstance(r, dict) and "input_ids" in r]
        return max(lengths) if lengths else None

    def _resolved(self, name: str) -> bool:
        value = self._flag(name)
        if value is None and self._plan is not None:
            value = getattr(self._plan, name)
        return bool(value)

    # -------------------------------------------------------------- layer swap
    def _install_layer_swap(self) -> None:
        """Keep `layer_swap` decoder layers on the device (planner's choice for 'auto'); the rest swap."""
        mode = self._flag("layer_swap")
        if mode == "off":
            return
        if self.model_init is not None:
            raise ConfigError("layer_swap places the layers of the model the Trainer is built with, but model_init "
                              "builds a new model at every train(): pass model=... instead of model_init")
        model = self.model
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        layers = _decoder_layers(inner)
        if layers is None:
            raise ConfigError("layer_swap needs a model whose decoder layers are an nn.ModuleList (every HF causal LM)")
        if mode == "auto":
            self._make_plan()
            if self._plan is None:
                raise ConfigError("layer_swap: auto asks the planner, which models decoder-only LMs trained on "
                                  "tokenized sequences; give the number of layers to keep on the GPU instead "
                                  f"(e.g. layer_swap: {len(layers) // 2})")
            resident = self._plan.resident_layers
        else:
            resident = min(int(mode), len(layers))
        device = self.args.device
        in_layers = {id(m) for m in layers.modules()}
        for m in inner.modules():  # everything but the decoder layers lives on the device
            if id(m) not in in_layers:
                for name, p in m._parameters.items():
                    if p is not None:
                        p.data = p.data.to(device)
                for name, b in m._buffers.items():
                    if b is not None:
                        m._buffers[name] = b.to(device)
        self._swap = LayerSwap(layers, device, resident=resident, prefetch=self._flag("layer_swap_prefetch"))
        if self.args.world_size > 1 and not self._streaming:
            raise ConfigError("layer_swap with several processes needs offload_optimizer: true (the streamed optimizer "
                              "reduces gradients itself; DistributedDataParallel cannot wrap swapped layers)")
        if self._swap.trainable_swapped and not self._streaming:
            raise ConfigError("layer_swap with trainable swapped layers (full finetune) needs offload_optimizer: true: "
                              "the streamed optimizer updates each swapped layer while it is on the GPU. (With LoRA "
                              "only the frozen base weights are swapped and any optimizer works.)")
        # A map with more than one entry tells the Trainer and accelerate not to move the model as a whole.
        prefix = next(n for n, m in model.named_modules() if m is layers)
        model.hf_device_map = {"": str(device), **{f"{prefix}.{i}": "cpu" for i in self._swap.swapped_indices}}
        stats = self._swap.memory_stats()
        logger.info("layer swap: %d of %d decoder layers on %s, %d in pinned CPU memory (%.2f GiB), "
                    "%.2f GiB of GPU slots, prefetch %d", stats["resident_layers"], len(layers), device,
                    stats["swapped_layers"], stats["host_bytes"] / 2**30, stats["gpu_slot_bytes"] / 2**30,
                    self._swap.prefetch)

    # -------------------------------------------------------------- optimizer
    def _device_state_bytes(self) -> int:
        """`offload_device_states` in bytes: 'auto' takes the planner's choice (none without a plan)."""
        value = device_state_setting(self._flag("offload_device_states"))
        if value == "auto":
            value = self._plan.device_state_gib if self._plan is not None and not self._sharded() else 0.0
        return int(value * 2**30)

    def _trainers_own_optimizer(self, model=None):
        """The Trainer's own optimizer (the streamed one does not run: `streams_optimizer` says why), said once."""
        optimizer = super().create_optimizer(model)
        if self._not_streaming_why and not getattr(self, "_said_not_streaming", False):
            self._said_not_streaming = True
            m = model if model is not None else self.model
            weights = sum(p.numel() * p.element_size() for p in m.parameters()) / 2**30
            grads = sum(p.numel() * p.element_size() for p in m.parameters() if p.requires_grad) / 2**30
            logger.info("optimizer: %s, so the Trainer's own %s runs and nothing is offloaded: the %s holds the weights "
                        "(%.2f GiB), their gradients (%.2f GiB) and its states", self._not_streaming_why,
                        type(optimizer).__name__, "GPU" if self.args.device.type == "cuda" else self.args.device.type,
                        weights, grads)
        return optimizer

    def create_optimizer(self, model=None):
        if not self._streaming:
            return self._trainers_own_optimizer(model)
        if self.optimizer is None:
            model = model if model is not None else self.model
            decay = set(self.get_decay_parameter_names(model))
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            groups = [
                {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
            ]
            clip = self.args.max_grad_norm is not None and self.args.max_grad_norm > 0
            accumulate = self.args.gradient_accumulation_steps > 1
            offload_grads = self._resolved("offload_gradients")
            if self._flag("offload_gradients") is None and self._swap is not None and self._swap.trainable_swapped:
                offload_grads = offload_grads or accumulate  # swapped layers' gradients must not pile up on the GPU
            self._offload_opt = StreamedAdamW8bit(
                groups,  # both, also when one is empty: get_learning_rates() lists them as the Trainer's do
                lr=self.args.learning_rate,
                betas=(self.args.adam_beta1, self.args.adam_beta2),
                eps=self.args.adam_epsilon,
                weight_decay=self.args.weight_decay,
                bf16_stochastic_round=self._flag("master_weights") == "bf16_sr",
                update_in_backward=not clip,
                offload_gradients=(clip or accumulate) and offload_grads,
                chunk_numel=self._flag("offload_chunk_numel"),
                inflight_chunks=self._flag("offload_inflight_chunks"),
                sharding=Sharding() if self._sharded() else None,
                fused=self._flag("offload_fused_update"),
                device_state_bytes=self._device_state_bytes(),
            )
            self._offload_opt.attach(model)
            if self._swap is not None:
                self._offload_opt.set_residency(self._swap.touch, ahead=self._swap.prefetch)
            self._offload_opt.sync_weights()  # data parallel: every rank starts from rank 0's weights
            self.optimizer = self._offload_opt
            mode = "after backward, clipped to max_grad_norm" if clip else "during backward (no clipping)"
            if self._offload_opt.offload_gradients:
                mode += "; gradients wait in host memory" + (" between micro-batches" if accumulate else "")
            logger.info("optimizer: AdamW, 8-bit states in %s memory, updates streamed %s%s",
                        "pinned CPU" if self._offload_opt.device.type == "cuda" else "CPU", mode,
                        (f"; data parallel over {self.args.world_size} ranks, each holding its share of the states"
                         if self._sharded() else "")
                        + (f"; up to {self._offload_opt.device_state_bytes / 2**30:.2f} GiB of them (the model's first "
                           f"tensors) kept on the GPU" if self._offload_opt.device_state_bytes else ""))
        return self.optimizer

    def _clip_grad_norm(self, model):
        if self._offload_opt is None:
            return super()._clip_grad_norm(model)
        norm = self._offload_opt.clip_grad_norm_(self.args.max_grad_norm)
        if self._check_nonfinite and not math.isfinite(norm.item()):  # one sync per optimizer step
            self._nonfinite_step()
        return norm

    def _get_grad_norm(self, model, grad_norm=None):
        if self._offload_opt is None:
            return super()._get_grad_norm(model, grad_norm)
        if grad_norm is None:  # no clipping: the norm the hooks measured before each update
            grad_norm = self._offload_opt.clip_grad_norm_(float("inf"))
        return grad_norm

    # -------------------------------------------------------------- step and loss
    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._want_activations and self._activations is None:
            self._activations = enable_activation_offload(self.accelerator.unwrap_model(model))
        self._tokens_since_log += int(inputs["input_ids"].numel()) if "input_ids" in inputs else 0
        accumulate = self._offload_opt is not None and not self.accelerator.sync_gradients
        with self._offload_opt.no_update() if accumulate else contextlib.nullcontext():
            loss = super().training_step(model, inputs, num_items_in_batch)
        return self._filtered(loss) if self._device_loss_filter else loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # Updates during backward cannot be undone: a non-finite loss must be caught before its backward.
        guard = (self._offload_opt is not None and self._offload_opt.update_in_backward and not return_outputs
                 and model.training and torch.is_grad_enabled() and self._check_nonfinite)
        if guard and self._skip_step:  # a micro-batch of this step was non-finite: the whole step is skipped
            return torch.full((), float("nan"), device=self.args.device, requires_grad=True)
        loss = self._compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if guard and not self._offload_opt.all_finite(loss):
            self._nonfinite_step()
            return torch.full((), float("nan"), device=loss.device, requires_grad=True)  # no backward into the model
        return loss

    def _compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        chunk = self._flag("loss_chunk_size")
        parts = _head_and_decoder(self.accelerator.unwrap_model(model)) if chunk else None
        usable = (parts is not None and not return_outputs and "labels" in inputs and self.label_smoother is None
                  and self.compute_loss_func is None)
        if not usable:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        decoder, head = parts
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        hidden = decoder(**inputs, use_cache=False)[0]  # (a cache would also turn off packed rows' masks)
        if not self.model_accepts_loss_kwargs:
            num_items_in_batch = None  # as the Trainer does: the model's loss would be a per-batch mean
        loss = chunked_causal_lm_loss(hidden, labels, head.weight, head.bias, chunk_size=chunk,
                                      num_items_in_batch=num_items_in_batch)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # as Trainer.compute_loss: num_items_in_batch counts every rank's tokens, gradients are averaged
            loss = loss * self.accelerator.num_processes
        return loss

    # -------------------------------------------------------------- weights read outside forward
    def _synchronize(self) -> None:
        """Updates may still be in flight on the update stream, copies of swapped layers on theirs."""
        if self._offload_opt is not None:
            self._offload_opt.synchronize()
        if self._swap is not None:
            self._swap.synchronize()

    def save_model(self, output_dir=None, _internal_call=False):
        """The Trainer's save; a user's (not a checkpoint's, which is staged as a whole) is written into a staging
        directory and moved into place once complete, then pushed if `push_to_hub` (the Trainer pushes output_dir,
        which must hold the new files by then)."""
        self._synchronize()
        with warnings.catch_warnings(), smaller_shards(self.accelerator.unwrap_model(self.model), SAVE_SHARD_BYTES):
            # swapped layers are in host memory, not on disk: nothing to warn about
            warnings.filterwarnings("ignore", message="Attempting to save a model with offloaded modules")
            if _internal_call or not self.args.should_save:
                return super().save_model(output_dir, _internal_call)
            with staged_save(output_dir or self.args.output_dir, "the model") as staging:
                super().save_model(staging, _internal_call=True)
        if self.args.push_to_hub:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def evaluate(self, *args, **kwargs):
        self._synchronize()
        with self._not_training_time():
            if not self._device_loss_filter:
                return super().evaluate(*args, **kwargs)
            self.args.logging_nan_inf_filter = True  # (evaluation filters its losses on the host, after its loop)
            try:
                return super().evaluate(*args, **kwargs)
            finally:
                self.args.logging_nan_inf_filter = False

    # -------------------------------------------------------------- logs
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log: add throughput and memory
            now = time.perf_counter()
            dt = max(now - self._last_log_time - self._paused_s, 1e-9)
            self._paused_s = 0.0
            logs["tok_per_s"] = round(self._tokens_since_log / dt, 1)
            step = self.state.global_step
            if self._last_trim_step is None or step - self._last_trim_step >= TRIM_EVERY_STEPS:
                trim_host_memory()
                self._last_trim_step = step
            rss = rss_gib()
            if rss is not None:
                logs["host_rss_gib"] = round(rss, 3)
            if torch.cuda.is_available():
                logs["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            movers = [m for m in (self._offload_opt, self._swap, self._activations) if m is not None]
            if torch.cuda.is_available() and movers:
                moved = sum(m.stats["h2d_bytes"] + m.stats["d2h_bytes"] for m in movers)
                logs["pcie_gb_per_s"] = round((moved - self._last_bytes) / dt / 1e9, 2)
                pinned = sum(m.memory_stats()["pinned_bytes"] for m in movers)
                logs["host_pinned_gib"] = round(pinned / 2**30, 2)
                # time the GPU's compute stream waited for a layer's weights or an update, since the last log
                stall = sum(m.stall.total_ms() for m in movers if hasattr(m, "stall"))
                logs["gpu_stall_ms"] = round(stall - self._last_stall_ms, 1)
                self._last_bytes, self._last_stall_ms = moved, stall
            if self._nonfinite["skipped"]:
                logs["nonfinite_skipped"] = self._nonfinite["skipped"]
            if "gpu_peak_gib" in logs:
                logger.info("step %d | loss %.4f | %.0f tok/s | gpu peak %s GiB | pcie %s GB/s | stall %s ms",
                            self.state.global_step, logs["loss"], logs["tok_per_s"], logs["gpu_peak_gib"],
                            logs.get("pcie_gb_per_s", "-"), logs.get("gpu_stall_ms", "-"))
            else:  # (no GPU: what applies here)
                logger.info("step %d | loss %.4f | %.0f tok/s | host rss %s GiB", self.state.global_step,
                            logs["loss"], logs["tok_per_s"], logs.get("host_rss_gib", "-"))
            self._tokens_since_log = 0
            self._last_log_time = now
        super().log(logs, start_time)


class OffloadTrainer(OffloadMixin, Trainer):
    """Drop-in replacement for `transformers.Trainer`."""
