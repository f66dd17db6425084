"""What `offload-trainer train` is made of, built once the plan is made: the model's config (read without its
weights), the tokenizer, the data, the model -- a random-init one on the device it fits, with the tokenizer's special
tokens -- and the OffloadTrainer over them. Loading errors end in one sentence (`model_errors`)."""
from __future__ import annotations

import contextlib
import logging
import os

from ..errors import ConfigError
from ..planner import ModelShape

logger = logging.getLogger("offload_trainer")


def model_config_of(model_args):
    """The model's config without its weights (a named architecture, or config.json of a checkpoint)."""
    from ..models import architecture_config

    if model_args.model_config:
        return architecture_config(model_args.model_config, model_args.model_overrides)
    from transformers import AutoConfig

    with model_errors(model_args.model_name_or_path, "its config"):
        from ..models import hub_kwargs

        return AutoConfig.from_pretrained(model_args.model_name_or_path, **hub_kwargs(model_args))


try:
    from safetensors import SafetensorError  # (raised for a truncated or corrupt weights file)
except ImportError:  # pragma: no cover
    SafetensorError = OSError


@contextlib.contextmanager
def model_errors(path: str | None, what: str):
    """from_pretrained's errors for a path (missing, empty, corrupt, truncated, offline Hub id) as one sentence."""
    try:
        yield
    except ConfigError:
        raise
    except (OSError, ValueError, SafetensorError) as e:
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        local = path is not None and os.path.isdir(path)
        fix = ("a transformers model directory holds config.json, the weights (*.safetensors) and the tokenizer files"
               if local else "a Hub id needs the network, or a copy in the HF cache (HF_HUB_OFFLINE=1 reads only that);"
               " or give a local directory")
        raise ConfigError(f"model_name_or_path {path!r}: cannot load {what}: {first}. ({fix})") from None


def build_trainer(model_args, data_args, training_args, settings, model_config, plan=None):
    """(trainer, tokenizer, eval dataset): data, model and the OffloadTrainer over them (with the run's `plan`)."""
    from transformers import set_seed

    from ..data import build_datasets, data_collator
    from ..models import count_params, load_model, load_tokenizer
    from ..trainer import OffloadTrainer

    set_seed(training_args.seed)
    with model_errors(model_args.tokenizer_name_or_path or model_args.model_name_or_path, "the tokenizer"):
        tokenizer = load_tokenizer(model_args)
    vocab = (getattr(model_config, "text_config", None) or model_config).vocab_size
    processor = None
    if getattr(model_config, "vision_config", None) is not None:
        processor, train_ds, eval_ds = image_text_data(model_args, data_args, training_args, model_config, tokenizer)
    else:  # (rank 0 tokenizes, the others then read its cache)
        train_ds, eval_ds = build_datasets(data_args, tokenizer, vocab_size=vocab, seed=training_args.seed,
                                           main_process_first=lambda: training_args.main_process_first(desc="dataset"))
    if processor is None and hasattr(train_ds, "__len__"):
        logger.info("data: %d training rows of up to %d tokens%s", len(train_ds), data_args.max_seq_length,
                    f", {len(eval_ds)} held out" if eval_ds is not None and hasattr(eval_ds, "__len__") else "")
    swap = settings.layer_swap is not False
    with model_errors(model_args.model_name_or_path, "the weights"):
        model = load_model(model_args, layerwise=swap,
                           init_device=init_device(model_args, model_config, settings, training_args.device))
    logger.info("model: %s, %.1fM parameters, %s", model_args.model_name_or_path or model_args.model_config,
                count_params(model) / 1e6, model_args.torch_dtype)
    if model_args.model_config:  # a random-init model takes its special tokens from the tokenizer it trains with
        special_tokens_from(tokenizer, model)
    if training_args.device.type == "cpu":
        training_args.dataloader_pin_memory = False  # (pinning needs an accelerator; torch warns at every loader)
    # Packed rows are all one length: stacking them is all a collator has to do. (The Trainer's default with a
    # tokenizer, DataCollatorWithPadding, took ~6 ms per 4 x 2048 batch in tokenizer.pad, at every step's start, and
    # would add an attention mask, which turns off the per-document masks that position_ids give.)
    trainer = OffloadTrainer(model=model, args=training_args, train_dataset=train_ds, eval_dataset=eval_ds,
                             processing_class=processor or tokenizer, offload_plan=plan, offload_settings=settings,
                             data_collator=data_collator(data_args, tokenizer, processor, train_ds))
    _one_line_per_log(trainer)
    return trainer, tokenizer, eval_ds


def image_text_data(model_args, data_args, training_args, model_config, tokenizer):
    """(processor, train, eval) for a vision-language model: the model's own processor (or, for a random-init named
    architecture, one built from its config and the tokenizer), and image-text records, loss on the assistant turns."""
    from ..data import build_image_text, build_processor
    from ..models import DTYPES

    if model_args.model_name_or_path:
        from transformers import AutoProcessor

        from ..models import hub_kwargs

        with model_errors(model_args.model_name_or_path, "the processor"):
            processor = AutoProcessor.from_pretrained(model_args.model_name_or_path, **hub_kwargs(model_args))
    else:
        processor = build_processor(model_config, tokenizer)
    train_ds, eval_ds = build_image_text(data_args, config=model_config, seed=training_args.seed,
                                         dtype=DTYPES[model_args.torch_dtype])
    # The rows are records (messages, image paths) the collator renders: the Trainer must pass them on whole.
    training_args.remove_unused_columns = False
    logger.info("data: %d image-text records%s; loss on the assistant turns (images opened per batch)", len(train_ds),
                f", {len(eval_ds)} held out" if eval_ds is not None else "")
    return processor, train_ds, eval_ds


def _one_line_per_log(trainer) -> None:
    """The command logs one line per training log (`step N | loss ...`): the Trainer's progress bar stays, without
    also printing each training log's dict (its evaluation and summary logs it still prints)."""
    from transformers.trainer_callback import ProgressCallback

    class Progress(ProgressCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs is not None and "loss" in logs:
                return
            return super().on_log(args, state, control, logs=logs, **kwargs)

    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(Progress)


def init_device(model_args, model_config, settings, device):
    """Where a random-init model is built: on the GPU, whole where it fits, else layer by layer for the swap (None:
    a checkpoint, or a 4-bit base, loads as from_pretrained places it)."""
    from ..models import DTYPES, random_init_device

    if model_args.model_name_or_path or getattr(model_args, "load_in_4bit", False):
        return None
    if settings.layer_swap is not False:
        return device
    return random_init_device(ModelShape.from_config(model_config).params, DTYPES[model_args.torch_dtype], device,
                              settings.gpu_memory_limit_gb)


def special_tokens_from(tokenizer, model) -> None:
    """A random-init model's pad, bos and eos ids: the tokenizer's it trains with (its config and generation
    config)."""
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        for cfg in (model.config, getattr(model, "generation_config", None)):
            if cfg is not None:
                setattr(cfg, name, getattr(tokenizer, name))
