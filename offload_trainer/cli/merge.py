"""LoRA adapters merged into the base model's own weights, one safetensors shard at a time:

    offload-trainer merge ADAPTER_DIR --base BASE_DIR [--out DIR]

A QLoRA run trains adapters on NF4 weights; merging into the NF4 weights would round the update away (peft warns),
and loading a 70B-90B bf16 model to merge it in memory needs 140-180 GB. Here each shard of the bf16 (or fp32) base is
read, every LoRA pair that belongs to a weight of it added (W + scale * B @ A, in float32, as peft's merge computes
it: per-module ranks and alphas, DoRA's magnitudes, modules trained whole; other adapter features are refused), and
the shard written -- so memory holds one shard and the adapters. Only the base's own files are read (a link out of it
is refused); a re-merge removes the earlier merge's files it does not write again. The output is a plain transformers
directory (config, tokenizer, shards and their index), written into a staging directory and moved into place."""
from __future__ import annotations

import json
import os
import shutil
import signal

from ..errors import MergeError, TrainingInterrupted, stop_signals_call
from ..trainer import manifest
from ..trainer.checkpoint import WEIGHT_NAME, index_shards
from ..trainer.outputs import STAGING_PREFIX, staged_save

SKIP = {"adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "README.md"}


# what a LoRA adapter file holds per module: the pair, and DoRA's magnitude (use_dora)
_PARTS = {".lora_A.weight": 0, ".lora_B.weight": 1, ".lora_magnitude_vector": 2}
# adapter_config keys of peft features this merge does not compute: each refused, with the way that does
_UNSUPPORTED = ("lora_bias", "trainable_token_indices", "layer_replication", "target_parameters",
                "alora_invocation_tokens")


class Adapters:
    """The adapters of a LoRA run, as peft's merge_and_unload applies them: per base weight its (A, B) pair, its
    scale (lora_alpha / r, or / sqrt(r) with rsLoRA; r and alpha per module with rank_pattern / alpha_pattern) and
    DoRA's magnitude; `saved`: whole modules trained beside them (modules_to_save), which replace the base's."""

    def __init__(self, pairs: dict, scales: dict, magnitudes: dict, saved: dict):
        self.pairs, self.scales, self.magnitudes, self.saved = pairs, scales, magnitudes, saved

    def merged(self, name: str, w):
        """The base weight `name` with its adapter merged, in float32 (peft: W + s B A; DoRA: then each output row
        scaled to its magnitude over the norm of W + s B A)."""
        import torch

        a, b = self.pairs[name]
        if (b.shape[0], a.shape[1]) != tuple(w.shape):
            raise MergeError(f"adapter for {name} is {b.shape[0]} x {a.shape[1]}, the base weight {tuple(w.shape)}: "
                             f"these adapters were trained on another model")
        out = w.float() + self.scales[name] * (b.float() @ a.float())
        mag = self.magnitudes.get(name)
        if mag is not None:
            out = (mag.float() / torch.linalg.norm(out, dim=1)).view(-1, 1) * out
        return out


def lora_pairs(adapter_dir: str) -> Adapters:
    """The adapters of `adapter_dir` (its adapter_config.json and adapter_model.safetensors, as peft saves them)."""
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
    used = [k for k in _UNSUPPORTED if cfg.get(k)]
    if used:
        raise MergeError(f"{adapter_dir!r}: the adapters use {', '.join(used)}, which this merge does not compute; "
                         f"merge them with peft's merge_and_unload() (it loads the whole base)")
    from peft.utils.other import get_pattern_key  # (peft's own rule for which pattern names a module)

    alpha = cfg.get("lora_alpha", cfg["r"])
    ranks, alphas = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    found: dict[str, list] = {}
    saved = {}
    for key, t in load_file(weights).items():
        if not t.is_floating_point() or not bool(t.isfinite().all()):
            raise MergeError(f"{weights}: {key} holds non-finite values (NaN or inf): the run that trained these "
                             f"adapters diverged; merging them would write a model of NaN. Nothing was written.")
        part = next((p for p in _PARTS if key.endswith(p)), None)
        if part is None:
            if "lora_" in key:
                raise MergeError(f"{weights}: {key} is an adapter tensor this merge does not compute; merge with "
                                 f"peft's merge_and_unload()")
            saved[key.removeprefix("base_model.model.")] = t  # modules_to_save: trained whole
            continue
        module = key[: -len(part)].removeprefix("base_model.model.")
        found.setdefault(module + ".weight", [None, None, None])[_PARTS[part]] = t
    pairs, scales, magnitudes = {}, {}, {}
    for name, (a, b, mag) in found.items():
        if a is None or b is None:
            raise MergeError(f"{weights}: {name[:-7]} has only half of its LoRA pair: the file is damaged")
        module = name[: -len(".weight")]
        r = a.shape[0]  # (rank_pattern: this module's own rank; the pair's shape says it)
        a_mod = alphas.get(get_pattern_key(alphas.keys(), module), alpha) if alphas else alpha
        if ranks and r != ranks.get(get_pattern_key(ranks.keys(), module), cfg["r"]):
            raise MergeError(f"{weights}: {module}'s pair has rank {r}, its rank_pattern another: the file and its "
                             f"adapter_config.json do not belong together")
        pairs[name], scales[name] = (a, b), a_mod / (r ** 0.5 if cfg.get("use_rslora") else r)
        if mag is not None:
            magnitudes[name] = mag
    if cfg.get("use_dora") and set(magnitudes) != set(pairs):
        raise MergeError(f"{weights}: use_dora is set, but not every adapter has its magnitude vector: the file is "
                         f"damaged or was saved by another peft")
    return Adapters(pairs, scales, magnitudes, saved)


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
    names = {n for n in os.listdir(out_dir) if not n.startswith(STAGING_PREFIX) and n != manifest.MANIFEST_NAME}
    if not names:  # (only what a merge cut short left: staging, the record it began)
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
    earlier = _earlier_merge_files(out_dir)
    adapters = lora_pairs(adapter_dir)
    left, saved = dict(adapters.pairs), dict(adapters.saved)
    # (each file it writes is recorded: a re-merge removes only those)
    with manifest.kept(out_dir), staged_save(out_dir, "the merged model") as staging:
        for shard in base_shards(base_dir):
            tensors = load_file(_base_file(base_dir, shard))
            for name in [n for n in tensors if n in left or n in saved]:
                w = tensors[name]
                if name in saved:
                    new = saved.pop(name)
                    if new.shape != w.shape:
                        raise MergeError(f"the trained {name} (modules_to_save) is {tuple(new.shape)}, the base's "
                                         f"{tuple(w.shape)}: these adapters were trained on another model")
                else:
                    new = adapters.merged(name, w)
                    left.pop(name)
                if not bool(new.isfinite().all()):
                    raise MergeError(f"merging into {name} gives non-finite values: nothing was written")
                tensors[name] = new.to(w.dtype)
            save_file(tensors, os.path.join(staging, shard), metadata={"format": "pt"})
            del tensors
        if left or saved:
            name = next(iter(left or saved))
            raise MergeError(f"{len(left) + len(saved)} adapters match no weight of the base (e.g. {name}): these "
                             f"adapters were trained on another model")
        for name in os.listdir(base_dir):  # config, tokenizer, the shard index: as the base has them
            path = os.path.join(base_dir, name)
            if os.path.isfile(path) and not name.endswith(".safetensors") and name not in SKIP:
                shutil.copy(_base_file(base_dir, name), os.path.join(staging, name))
        for name in os.listdir(adapter_dir):  # the tokenizer the run trained with, if it saved one
            if name.startswith(TOKENIZER_FILES):
                shutil.copy(_base_file(adapter_dir, name), os.path.join(staging, name))
        with open(os.path.join(staging, MERGE_RECORD), "w") as f:
            json.dump(_merge_record(adapter_dir, base_dir), f)
        written = set(os.listdir(staging))
    for name in sorted(earlier - written):  # a re-merge: the earlier merge's files this one did not write (a
        # whole model.safetensors where the base is now sharded would be loaded instead of the new shards)
        os.unlink(os.path.join(out_dir, name))
    manifest.forget(out_dir, earlier - written)
    return out_dir


def _earlier_merge_files(out_dir: str) -> set[str]:
    """The files an earlier merge wrote into `out_dir` (check_merge_target let it be replaced): those its record
    lists, or, written before there was one, its weights."""
    if not os.path.isdir(out_dir):
        return set()
    recorded = manifest.read(out_dir)
    names = recorded if recorded is not None else {n for n in os.listdir(out_dir) if WEIGHT_NAME.match(n)}
    return {n for n in names if os.path.isfile(os.path.join(out_dir, n))
            and not os.path.islink(os.path.join(out_dir, n))}


def _base_file(directory: str, name: str) -> str:
    """`directory`/`name`, refused when it is a link to a file outside `directory`: the merge copies what it reads
    into --out (a `vocab.txt` linked to a private key would be copied there). A Hub cache's snapshot is made of links
    into the repository's `blobs/`: those are the model's own files."""
    path = os.path.join(directory, name)
    real, home = os.path.realpath(path), os.path.realpath(directory)
    blobs = os.path.join(os.path.dirname(os.path.dirname(home)), "blobs")
    if os.path.basename(os.path.dirname(home)) == "snapshots" and real.startswith(blobs + os.sep):
        return path
    if not real.startswith(home + os.sep):
        raise MergeError(f"{path} is a link to {real}, outside {directory!r}: the merge reads and copies only a "
                         f"model's own files. Copy the file into the directory if it belongs to the model.")
    return path
