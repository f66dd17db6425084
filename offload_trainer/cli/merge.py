"""LoRA adapters merged into the base model's own weights, one safetensors shard at a time:

    offload-trainer merge ADAPTER_DIR --base BASE_DIR [--out DIR]

A QLoRA run trains adapters on NF4 weights; merging into the NF4 weights would round the update away (peft warns),
and loading a 70B-90B bf16 model to merge it in memory needs 140-180 GB. Here each shard of the bf16 (or fp32) base is
read, every LoRA pair that belongs to a weight of it added (W + scale * B @ A, in float32, as peft's merge computes
it), and the shard written -- so memory holds one shard and the adapters. The output is a plain transformers
directory (config, tokenizer, shards and their index), written into a staging directory and moved into place."""
from __future__ import annotations

import json
import os
import shutil
import signal

from ..errors import MergeError, TrainingInterrupted, stop_signals_call
from ..trainer.checkpoint import index_shards
from ..trainer.outputs import STAGING_PREFIX, staged_save

SKIP = {"adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "README.md"}


def lora_pairs(adapter_dir: str) -> tuple[dict, float]:
    """{base weight name: (A, B)} of the adapters, and their scale (lora_alpha / r, or / sqrt(r) with rsLoRA)."""
    from safetensors.torch import load_file

    cfg_path = os.path.join(adapter_dir, "adapter_config.json")
    weights = os.path.join(adapter_dir, "adapter_model.safetensors")
    if not (os.path.isfile(cfg_path) and os.path.isfile(weights)):
        raise MergeError(f"{adapter_dir!r} holds no LoRA adapters (adapter_config.json and adapter_model.safetensors, "
                         f"as a LoRA run writes into its output_dir)")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
        if not isinstance(cfg, dict) or not isinstance(cfg.get("r"), int) or cfg["r"] < 1:
            raise ValueError("no positive LoRA rank r")
    except (OSError, ValueError) as e:  # (json's JSONDecodeError is a ValueError)
        raise MergeError(f"{cfg_path}: not a LoRA adapter config ({e}); it is written by peft's save_pretrained "
                         f"next to adapter_model.safetensors") from None
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("fan_in_fan_out"):
        raise MergeError(f"{adapter_dir!r}: only plain LoRA adapters are merged here (peft_type LORA, not "
                         f"fan_in_fan_out); merge others with peft's merge_and_unload()")
    r, alpha = cfg["r"], cfg.get("lora_alpha", cfg["r"])
    scale = alpha / (r ** 0.5 if cfg.get("use_rslora") else r)
    pairs: dict[str, list] = {}
    for key, t in load_file(weights).items():
        for part, k in ((".lora_A.weight", 0), (".lora_B.weight", 1)):
            if key.endswith(part):
                name = key[: -len(part)].removeprefix("base_model.model.") + ".weight"
                pairs.setdefault(name, [None, None])[k] = t
    return {n: tuple(ab) for n, ab in pairs.items()}, scale


def base_shards(base_dir: str) -> list[str]:
    """The base's safetensors shards, by name: each a file of `base_dir` itself -- an index naming an absolute path,
    a `..` or a subdirectory is refused (the merge would read it, and write its merged copy by that name)."""
    index = os.path.join(base_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            return index_shards(index)
        except ValueError as e:
            raise MergeError(str(e)) from None
    if os.path.isfile(os.path.join(base_dir, "model.safetensors")):
        return ["model.safetensors"]
    raise MergeError(f"{base_dir!r} holds no safetensors weights (model.safetensors or its index): the merge reads "
                     f"the base model's own bf16 checkpoint")


TOKENIZER_FILES = ("tokenizer", "special_tokens", "chat_template")  # (the adapters' run saved the tokenizer it used)
MERGE_RECORD = ".offload-trainer-merge.json"  # written with a merge: which base and adapters it merged


def _merge_record(adapter_dir: str, base_dir: str) -> dict:
    return {"base": os.path.realpath(base_dir), "adapters": os.path.realpath(adapter_dir)}


def check_merge_target(adapter_dir: str, base_dir: str, out_dir: str) -> None:
    """`--out` must be a new or empty directory, or a merged model written before: never the base itself, the
    adapters' run, or another model (its weights would be replaced, or left beside the new shards and loaded)."""
    out = os.path.realpath(out_dir)
    for other, what in ((base_dir, "the base model's directory (--base)"), (adapter_dir, "the adapters' run")):
        if out == os.path.realpath(other):
            raise MergeError(f"--out {out_dir!r} is {what}: the merge would overwrite it. Give a new directory, "
                             f"e.g. --out {os.path.join(adapter_dir, 'merged')}")
    if not os.path.isdir(out_dir) or not os.listdir(out_dir):
        return
    names = {n for n in os.listdir(out_dir) if not n.startswith(STAGING_PREFIX)}
    if not names:  # (only what a merge cut short left staging: the next save removes it)
        return
    if names & {"trainer_state.json", "adapter_config.json"} or any(n.startswith("checkpoint-") for n in names):
        raise MergeError(f"--out {out_dir!r} holds a training run (trainer_state.json, checkpoints or adapters): "
                         f"the merge would replace its files. Give a new directory.")
    try:  # an earlier merge of these adapters into this base, as it recorded itself, is replaced
        with open(os.path.join(out_dir, MERGE_RECORD)) as f:
            earlier = json.load(f)
    except (OSError, ValueError):
        earlier = None
    if earlier == _merge_record(adapter_dir, base_dir):
        return
    what = (f"a merge of other adapters or another base ({earlier.get('adapters')} into {earlier.get('base')})"
            if isinstance(earlier, dict) else
            f"files this merge did not write ({', '.join(sorted(names)[:3])}{', ...' if len(names) > 3 else ''})")
    raise MergeError(f"--out {out_dir!r} holds {what}: the merge writes only into a new or empty directory, or over "
                     f"its own earlier merge of the same adapters and base. Give a new or empty directory.")


def merge_lora(adapter_dir: str, base_dir: str, out_dir: str) -> str:
    """Write base + adapters into `out_dir` (returned); the base's dtype kept. SIGTERM / SIGHUP end it as Ctrl-C
    does: the staging directory is removed on the way out (the default action killed the process and left
    `.partial-save` behind), and the command says so."""
    def stop(signum, frame):
        raise TrainingInterrupted(f"{signal.Signals(signum).name} during merge: nothing was written to {out_dir!r} "
                                  f"(its partial files removed); run the merge again", signum, None)

    with stop_signals_call(stop, with_sigint=False, children_die=True):
        return _merge_lora(adapter_dir, base_dir, out_dir)


def _merge_lora(adapter_dir: str, base_dir: str, out_dir: str) -> str:
    from safetensors.torch import load_file, save_file


    check_merge_target(adapter_dir, base_dir, out_dir)
    pairs, scale = lora_pairs(adapter_dir)
    left = dict(pairs)
    with staged_save(out_dir, "the merged model") as staging:
        for shard in base_shards(base_dir):
            tensors = load_file(os.path.join(base_dir, shard))
            for name in [n for n in tensors if n in left]:
                a, b = left.pop(name)
                w = tensors[name]
                if (b.shape[0], a.shape[1]) != tuple(w.shape):
                    raise MergeError(f"adapter for {name} is {b.shape[0]} x {a.shape[1]}, the base weight "
                                     f"{tuple(w.shape)}: these adapters were trained on another model")
                tensors[name] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
            save_file(tensors, os.path.join(staging, shard), metadata={"format": "pt"})
            del tensors
        if left:
            raise MergeError(f"{len(left)} adapters match no weight of the base (e.g. {next(iter(left))}): these "
                             f"adapters were trained on another model")
        for name in os.listdir(base_dir):  # config, tokenizer, the shard index: as the base has them
            path = os.path.join(base_dir, name)
            if os.path.isfile(path) and not name.endswith(".safetensors") and name not in SKIP:
                shutil.copy(path, os.path.join(staging, name))
        for name in os.listdir(adapter_dir):  # the tokenizer the run trained with, if it saved one
            if name.startswith(TOKENIZER_FILES):
                shutil.copy(os.path.join(adapter_dir, name), os.path.join(staging, name))
        with open(os.path.join(staging, MERGE_RECORD), "w") as f:
            json.dump(_merge_record(adapter_dir, base_dir), f)
    return out_dir
