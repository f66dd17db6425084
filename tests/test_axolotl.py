"""The axolotl plugin, against axolotl itself: `plugins: [offload_trainer.integrations.axolotl.OffloadPlugin]` in an
axolotl YAML trains through axolotl's own config loading, datasets and trainer builder, with the offload wiring on
axolotl's trainer; its own offloading switches are refused by name.

axolotl pins its own transformers / peft / trl / datasets / torchao, so it lives in a virtual environment of its own
(README, "Use it from axolotl") and these tests skip elsewhere:
    .venv-axolotl/bin/python -m pytest -q -m axolotl tests/test_axolotl.py
"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("axolotl", reason="axolotl lives in its own venv: pip install 'offload-trainer[axolotl]'")

pytestmark = pytest.mark.axolotl

sys.path.insert(0, os.path.dirname(__file__))
from helpers import SUM_ROWS, assert_same_course, readme_yaml, save_tiny_base  # noqa: E402

PLUGIN = "offload_trainer.integrations.axolotl.OffloadPlugin"

# What axolotl's `axolotl train CONFIG` runs (axolotl.cli.train.do_train), in a process of its own (axolotl's plugin
# manager is a process-wide singleton), reporting what it built.
RUN = """
import json, sys
from axolotl.cli.config import load_cfg
from axolotl.common.datasets import load_datasets
from axolotl.train import train
cfg = load_cfg(sys.argv[1])
model, tok, trainer = train(cfg=cfg, dataset_meta=load_datasets(cfg=cfg))
run = getattr(trainer, "_run", None)
layer = trainer.model.get_base_model().model.layers[0] if hasattr(trainer.model, "get_base_model") else None
print("RESULT " + json.dumps({
    "trainer": [c.__name__ for c in type(trainer).__mro__],
    "optimizer": type(run.optimizer if run is not None else None).__name__,
    "swapped": run.swap.memory_stats()["swapped_layers"] if run is not None and run.swap is not None else None,
    "q_proj": type(layer.self_attn.q_proj.base_layer).__name__ if layer is not None else None,
    "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}))
"""


def readme_plugin_lines() -> dict:
    """The README's axolotl YAML (the lines a user adds), as a dict."""
    return readme_yaml("axolotl")


def write_case(tmp_path, plugin=True, name=None, **extra):
    save_tiny_base(tmp_path / "base")
    if not (tmp_path / "data.jsonl").exists():
        (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in SUM_ROWS))
    base = tmp_path / "base"
    name = name or ("with" if plugin else "without")
    cfg = {"base_model": str(base),
           "datasets": [{"path": str(tmp_path / "data.jsonl"), "ds_type": "json", "type": "alpaca"}],
           "dataset_prepared_path": str(tmp_path / f"prepared-{name}"), "val_set_size": 0, "sequence_len": 256,
           "micro_batch_size": 4, "gradient_accumulation_steps": 1, "max_steps": 6, "learning_rate": 0.003,
           "optimizer": "adamw_torch", "lr_scheduler": "constant", "output_dir": str(tmp_path / f"out-{name}"),
           "logging_steps": 1, "save_strategy": "no", "bf16": False, "fp16": False, "tf32": False, "seed": 42,
           **(readme_plugin_lines() if plugin else {}), **extra}
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(cfg))  # (JSON is YAML)
    return path


def run(cfg_path):
    env = {**os.environ, "AXOLOTL_DO_NOT_TRACK": "1", "DO_NOT_TRACK": "1", "OMP_NUM_THREADS": "2"}
    r = subprocess.run([sys.executable, "-c", RUN, str(cfg_path)], capture_output=True, text=True, timeout=900,
                       env=env, cwd=os.path.dirname(cfg_path))
    result = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    return r, json.loads(result[0][7:]) if result else None


def test_the_readme_lines_name_the_plugin():
    assert readme_plugin_lines()["plugins"] == [PLUGIN]


def test_axolotl_trains_with_the_plugin_like_without_it(tmp_path):
    """The same axolotl config with and without the plugin: with it, axolotl's trainer carries the offload wiring and
    streams 8-bit AdamW; the first step's loss is the same (same weights, data and seed), and the course close
    (8-bit streamed AdamW against torch's fp32 AdamW)."""
    r, ours = run(write_case(tmp_path))
    assert ours, r.stderr[-4000:]
    _, theirs = run(write_case(tmp_path, plugin=False))
    assert theirs
    assert ours["trainer"][:3] == ["OffloadAxolotlTrainer", "OffloadMixin", "AxolotlTrainer"]
    assert ours["optimizer"] == "StreamedAdamW8bit" and theirs["trainer"][0] == "AxolotlTrainer"
    assert_same_course(ours["losses"], theirs["losses"])


@pytest.mark.parametrize("extra, needle", [
    ({"activation_offloading": True}, "remove activation_offloading (axolotl's); ours is activation_offload: true"),
    ({"layer_offloading": True}, "remove layer_offloading (axolotl's); ours is layer_swap: auto"),
    ({"gradient_checkpointing": "offload"}, "use gradient_checkpointing: true with activation_offload: true"),
    ({"deepspeed": "zero2.json"}, "remove deepspeed"),
    ({"rl": "dpo"}, "for DPO use OffloadDPOTrainer"),
])
def test_axolotl_offloading_of_its_own_is_refused_by_name(tmp_path, extra, needle):
    from axolotl.cli.config import load_cfg

    with pytest.raises(Exception, match="offload_trainer's plugin cannot run with") as e:
        load_cfg(str(write_case(tmp_path, **extra)))
    assert needle in str(e.value)


@pytest.mark.parametrize("given, reentrant", [(None, False), ({"use_reentrant": True}, True)])
def test_checkpointing_is_non_reentrant_unless_the_config_says(tmp_path, given, reentrant):
    """axolotl resolves a config without gradient_checkpointing_kwargs to reentrant checkpointing; with the plugin it
    is transformers' non-reentrant default, as `offload-trainer train` runs it. A config's own choice stays."""
    from axolotl.cli.config import load_cfg

    extra = {"gradient_checkpointing": True, **({"gradient_checkpointing_kwargs": given} if given else {})}
    cfg = load_cfg(str(write_case(tmp_path, **extra)))
    assert cfg.gradient_checkpointing_kwargs == {"use_reentrant": reentrant}


@pytest.mark.parametrize("cfg, refused", [({"sample_packing": True, "model_config_type": "gemma3"}, True),
                                           ({"sample_packing": True, "model_config_type": "llama"}, False),
                                           ({"sample_packing": False, "model_config_type": "gemma3"}, False)])
def test_packed_gemma_rows_are_refused_by_name(cfg, refused):
    """axolotl's compute_loss drops a packed Gemma 3/4 batch's all-ones attention mask (so that transformers masks each
    row on its own); the plugin's loss runs before it, so that combination is refused before the model loads rather
    than trained with rows attending to each other."""
    from axolotl.utils.dict import DictDefault

    from offload_trainer.integrations.axolotl import OffloadPlugin

    if refused:
        with pytest.raises(ValueError, match="cannot run sample_packing with gemma3 yet: set sample_packing: false"):
            OffloadPlugin().pre_model_load(DictDefault(cfg))
    else:
        OffloadPlugin().pre_model_load(DictDefault(cfg))


QLORA = {"adapter": "qlora", "load_in_4bit": True, "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
         "lora_target_linear": True, "gradient_checkpointing": True,
         # axolotl's fused LoRA kernels dequantize with CUDA calls only
         "lora_mlp_kernel": False, "lora_qkv_kernel": False, "lora_o_kernel": False}


def test_axolotl_qlora_with_layer_swap_builds_the_base_layer_by_layer(tmp_path):
    """QLoRA with `layer_swap`: the plugin builds the 4-bit base a block at a time, decoder layers parked in CPU
    memory for the swap (axolotl would quantize it whole onto the GPU); the same NF4 as axolotl's own load, so the
    same course as axolotl's QLoRA with its own loader and the plugin's swap off."""
    r, swapped = run(write_case(tmp_path, name="swap", layer_swap="1", **QLORA))
    assert swapped, r.stderr[-4000:]
    assert "layer swap: 1 of 2 decoder layers" in r.stderr
    r, own = run(write_case(tmp_path, name="own", layer_swap="off", **QLORA))
    assert own, r.stderr[-4000:]
    assert swapped["swapped"] == 1 and own["swapped"] is None
    assert swapped["q_proj"] == own["q_proj"] == "Linear4bit"
    a, b = swapped["losses"], own["losses"]
    print("layer by layer + swap", a, "\naxolotl's load", b)
    assert len(a) == len(b) == 6 and a[0] == pytest.approx(b[0], abs=1e-5)  # the same NF4 weights
    # LoRA's A matrices drawn after another loader's use of the RNG: close, not equal
    assert max(abs(x - y) / y for x, y in zip(a, b)) < 0.01 and a[-1] < a[0]


def test_axolotl_qlora_reinit_weights_with_layer_swap_builds_a_random_base(tmp_path):
    """axolotl's `reinit_weights: true` (a random-init base from the config) with QLoRA and layer swap: built block by
    block in NF4 (a 70B shape never exists in bf16), and it trains."""
    r, got = run(write_case(tmp_path, name="reinit", layer_swap="1", reinit_weights=True, **QLORA))
    assert got, r.stderr[-4000:]
    assert got["swapped"] == 1 and got["q_proj"] == "Linear4bit"
    assert len(got["losses"]) == 6 and all(x == x for x in got["losses"])


@pytest.mark.parametrize("cfg, cast", [({}, True), ({"adapter": "lora"}, False), ({"offload_optimizer": False}, False),
                                       ({"optimizer": "sgd"}, False)])
def test_a_full_finetunes_upcast_weights_go_back_to_bf16_where_the_optimizer_streams(monkeypatch, caplog, cfg, cast):
    """axolotl upcasts a full finetune's embeddings, head and norms to fp32 (2 GiB more for 8B on a held 24 GB card);
    on a GPU, where the optimizer streams, the plugin's post_model_load keeps them bf16 and says so. (The GPU is
    faked: on a CPU the hook leaves the model alone, the Trainer's AdamW runs there.)"""
    import logging

    import torch
    from axolotl.utils.dict import DictDefault

    from offload_trainer.integrations.axolotl import OffloadPlugin

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 32).to(torch.bfloat16))
    with caplog.at_level(logging.INFO, logger="offload_trainer"):
        OffloadPlugin().post_model_load(DictDefault({"torch_dtype": torch.bfloat16, **cfg}), model)
    assert (model[0].weight.dtype == torch.bfloat16) == cast
    assert any("1 trainable fp32 tensors" in r.getMessage() for r in caplog.records) == cast


def test_the_finished_model_axolotl_saves_itself_is_written_in_the_trainers_shards(tmp_path):
    """axolotl writes the finished model with `model.save_pretrained`, past the Trainer's save_model: the plugin gives
    the model the Trainer's shard size (at transformers' 50 GB default an 8B model was gathered in host memory whole
    beside the pinned optimizer states: host peak 62 GiB against the command's 49)."""
    import types

    from helpers import tiny_setup
    from offload_trainer.integrations.axolotl import OffloadPlugin
    from offload_trainer.planner import SAVE_SHARD_BYTES

    model, seen = tiny_setup()[0], {}
    type(model).save_pretrained, real = (lambda self, *a, **k: seen.update(k)), type(model).save_pretrained
    try:
        OffloadPlugin().post_trainer_create({}, types.SimpleNamespace(model=model))
        model.save_pretrained(tmp_path)
    finally:
        type(model).save_pretrained = real
    assert seen["max_shard_size"] == SAVE_SHARD_BYTES
