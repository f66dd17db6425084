"""`ModelArguments` and `DataArguments`: what a YAML config says about the model and the data (the rest of a config
is `OffloadTrainingArguments`, args.py). Checked as they are built, before anything loads."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Hub id or local directory of a pretrained model (loaded with from_pretrained)."},
    )
    model_config: str | None = field(
        default=None,
        metadata={"help": "Instead of weights: a named architecture built with random init, e.g. "
                          "'tiny-llama', 'llama3-8b', 'qwen2.5-14b' (see offload_trainer.models.ARCHITECTURES)."},
    )
    model_overrides: dict | None = field(
        default=None,
        metadata={"help": "Config fields to override on a named architecture, e.g. {num_hidden_layers: 4}."},
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer to use; default: the model's own, or the built-in tokenizer."}
    )
    torch_dtype: str = field(
        default="bfloat16", metadata={"help": "Weights dtype: bfloat16 (default), float32 or float16."}
    )
    attn_implementation: str = field(default="sdpa", metadata={"help": "Attention kernel: sdpa or eager."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Run the model's own code from its repository (from_pretrained's flag)."})
    revision: str | None = field(
        default=None, metadata={"help": "Branch, tag or commit of the model (and its tokenizer) on the Hub."})
    lora_r: int = field(
        default=0, metadata={"help": "LoRA rank (peft); 0 = full finetune. With LoRA only the adapters train."}
    )
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scaling numerator (peft's lora_alpha)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA path."})
    lora_target_modules: str = field(
        default="all-linear", metadata={"help": "Modules that get adapters: 'all-linear' or comma-separated names."}
    )
    load_in_4bit: bool = field(
        default=False,
        metadata={"help": "QLoRA: the frozen base linears as bitsandbytes NF4 (needs lora_r > 0). With model_config, "
                          "built one layer at a time and kept in CPU memory until the layer swap places it."},
    )

    def __post_init__(self) -> None:
        if (self.model_name_or_path is None) == (self.model_config is None):
            raise ValueError(
                "give exactly one of `model_name_or_path` (pretrained weights) or `model_config` "
                "(a named architecture with random init, e.g. model_config: tiny-llama)"
            )
        if self.model_config is not None:
            from ..models import architecture_config

            try:
                from huggingface_hub.errors import StrictDataclassError
            except ImportError:  # (a huggingface_hub without strict dataclasses: nothing of that kind to catch)
                StrictDataclassError = ()

            try:  # an unknown name or override key fails; so do values the config's own validators refuse
                config = architecture_config(self.model_config, self.model_overrides)
            except StrictDataclassError as e:  # (transformers' config checks: not ValueErrors, and several lines)
                last = [line.strip() for line in str(e).splitlines() if line.strip()][-1]
                raise ValueError(f"model_overrides {self.model_overrides}: {last.removeprefix('ValueError: ')}") \
                    from None
            heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
            if isinstance(heads, int) and isinstance(kv, int) and kv > 0 and heads % kv:  # (no validator has it:
                # the first forward failed on a shape mismatch)
                raise ValueError(f"model_overrides {self.model_overrides}: num_attention_heads={heads} is not a "
                                 f"multiple of num_key_value_heads={kv} (each key/value head serves a whole group "
                                 f"of query heads)")
        if self.load_in_4bit and not self.lora_r:
            raise ValueError("load_in_4bit freezes the base in 4 bits: set lora_r (e.g. 16) to train adapters on it")
        if self.lora_r < 0:
            raise ValueError(f"lora_r={self.lora_r}: use 0 (full finetune) or a positive rank such as 16")
        if self.torch_dtype not in ("bfloat16", "float32", "float16"):
            raise ValueError(f"torch_dtype={self.torch_dtype!r}: use bfloat16, float32 or float16")


@dataclass
class DataArguments:
    """What to train on. The keys TRL's SFTConfig / ScriptArguments users know keep TRL's names and meanings."""

    dataset_path: str = field(
        default="builtin",
        metadata={"help": "A local file (.txt, .jsonl, .json, .parquet, .csv, .arrow), a directory (of such files, or "
                          "written by save_to_disk), a Hub dataset name (offline: from the HF cache), 'builtin' (the "
                          "small corpus shipped in the package), 'builtin-sft' (prompt/completion pairs) or 'random' "
                          "(random tokens, for benchmarks)."},
    )
    dataset_name: str | None = field(
        default=None, metadata={"help": "TRL's name for dataset_path (give one of the two)."})
    dataset_config: str | None = field(default=None, metadata={"help": "The dataset's configuration (Hub datasets)."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str | None = field(
        default=None, metadata={"help": "Split to evaluate on (default: none, or eval_fraction of the train split)."})
    eval_fraction: float = field(
        default=0.0, metadata={"help": "Fraction of the training records held out for evaluation, drawn at random "
                                       "(seed) before packing, when there is no dataset_test_split (0 = none)."})
    dataset_text_field: str = field(default="text", metadata={"help": "Column holding plain text."})
    dataset_kwargs: dict | None = field(
        default=None, metadata={"help": "Passed to datasets.load_dataset (e.g. {data_files: ..., builder: csv})."})
    dataset_num_proc: int | None = field(
        default=None, metadata={"help": "Processes that tokenize (datasets' num_proc; default: one)."})
    streaming: bool = field(
        default=False, metadata={"help": "Read the dataset as a stream (nothing loaded up front); needs max_steps."})
    packing: bool = field(
        default=True, metadata={"help": "Pack documents into rows of max_seq_length, each document kept apart "
                                        "(its own positions, no attention across); false: one document per row, "
                                        "padded per batch."})
    packing_strategy: str = field(
        default="bfd", metadata={"help": "bfd (TRL's default: whole documents, longer ones cut), bfd_split (their "
                                         "overflow packed too) or wrapped (end to end, no padding)."})
    max_seq_length: int = field(default=512, metadata={"help": "Tokens per training row (TRL: max_length)."})
    assistant_only_loss: bool = field(
        default=False, metadata={"help": "Chat 'messages': loss on the assistant turns only (the template's "
                                         "{% generation %} markers, or turn by turn where it has none)."})
    completion_only_loss: bool | None = field(
        default=None, metadata={"help": "prompt/completion records: loss on the completion only (default, as TRL)."})
    chat_template: str | None = field(
        default=None, metadata={"help": "A Jinja chat template, or the path of a file holding one, instead of the "
                                        "tokenizer's."})
    random_num_samples: int = field(default=256, metadata={"help": "Number of sequences when dataset_path=random."})

    def __post_init__(self) -> None:
        if self.dataset_name is not None:
            if self.dataset_path not in ("builtin", self.dataset_name):
                raise ValueError(f"dataset_name={self.dataset_name!r} and dataset_path={self.dataset_path!r} name "
                                 f"two datasets: give one")
            self.dataset_path = self.dataset_name
        if self.max_seq_length < 8:
            raise ValueError(f"max_seq_length={self.max_seq_length} is too small: use at least 8")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction={self.eval_fraction} must be in [0, 1)")
        if self.packing_strategy not in ("bfd", "bfd_split", "wrapped"):
            raise ValueError(f"packing_strategy={self.packing_strategy!r}: use bfd, bfd_split or wrapped")
        if self.dataset_num_proc is not None and self.dataset_num_proc < 1:
            raise ValueError(f"dataset_num_proc={self.dataset_num_proc}: use 1 or more")
