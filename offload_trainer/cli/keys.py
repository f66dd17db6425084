"""`offload-trainer keys`: every config key with its type and default, ours with their help, in well under a second.

Listing TrainingArguments' fields means importing transformers (~8 s on 2 cores, with torch, peft and torchao), so
the table is kept as JSON: shipped in the package for the transformers version the project is tested with
(`assets/keys.json`, written by `python -m offload_trainer.cli.keys --write`, checked by tests/test_cli.py), else
built once per transformers version into the user's cache."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import textwrap
from importlib import metadata, resources

from .config import ALIASES, field_types
from .run_args import DataArguments, ModelArguments

SHIPPED = "keys.json"


def transformers_version() -> str:
    return metadata.version("transformers")


def build_table() -> dict:
    """{'transformers': version, 'ours': [...], 'trainer': [...]}: each key's name, type, default (and help)."""
    import typing

    from ..trainer.args import OffloadTrainingArguments

    from transformers import TrainingArguments

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    types = field_types()
    ours, trainer = [], []
    for cls in (ModelArguments, DataArguments, OffloadTrainingArguments):
        for f in dataclasses.fields(cls):
            if not f.init or (cls is OffloadTrainingArguments and f.name in base and f.name not in types):
                continue
            row = {"name": f.name, "type": _type_name(types.get(f.name, f.type), typing), "default": _default(f)}
            if cls is OffloadTrainingArguments and f.name in base:
                trainer.append(row)
            else:
                ours.append({**row, "help": f.metadata.get("help", "")})
    aliases = [{"alias": a, "key": k} for a, k in ALIASES.items()]
    return {"transformers": transformers_version(), "ours": ours, "trainer": sorted(trainer, key=lambda r: r["name"]),
            "aliases": aliases}


def _type_name(tp, typing) -> str:
    origin = typing.get_origin(tp)
    if origin is not None and type(None) in typing.get_args(tp):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        return " | ".join(_type_name(a, typing) for a in rest) + " | null"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _default(f) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    value = getattr(value, "value", value)  # enums
    return "null" if value is None else json.dumps(value) if isinstance(value, (str, list, dict)) else str(value)


def _cache_path(version: str) -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "offload_trainer", f"keys-transformers-{version}.json")


def table() -> dict:
    """The shipped table when it is for the installed transformers, else the cached one, else built (and cached)."""
    version = transformers_version()
    shipped = resources.files("offload_trainer") / "assets" / SHIPPED
    for path in (str(shipped), _cache_path(version)):
        try:
            with open(path) as f:
                data = json.load(f)
            if data.get("transformers") == version:
                return data
        except (OSError, ValueError):
            continue
    data = build_table()
    try:
        os.makedirs(os.path.dirname(_cache_path(version)), exist_ok=True)
        with open(_cache_path(version), "w") as f:
            json.dump(data, f)
    except OSError:  # a read-only home: listed anyway, built again next time
        pass
    return data


def print_keys(out=None) -> None:
    out = out or sys.stdout  # (looked up now: a test's capture replaces it)
    data = table()
    w = max(len(r["name"]) for r in data["ours"] + data["trainer"])
    print("Our keys (model, data and offload switches):", file=out)
    for r in data["ours"]:
        print(f"  {r['name'].ljust(w)}  {r['type']} = {r['default']}", file=out)
        if r["help"]:
            print(textwrap.indent(textwrap.fill(r["help"], 100), " " * 6), file=out)
    print("\nOther names accepted for ours: " + ", ".join(f"{a['alias']} ({a['key']})" for a in data["aliases"]),
          file=out)
    print(f"\nTrainingArguments keys (transformers {data['transformers']}; their help: "
          f"https://huggingface.co/docs/transformers/main_classes/trainer#transformers.TrainingArguments):", file=out)
    for r in data["trainer"]:
        print(f"  {r['name'].ljust(w)}  {r['type']} = {r['default']}", file=out)


if __name__ == "__main__":  # python -m offload_trainer.cli.keys --write: the shipped table, for this transformers
    if "--write" in sys.argv:
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", SHIPPED)
        with open(path, "w") as f:
            json.dump(build_table(), f, indent=0)
        print(path)
