"""Model building: pretrained NF4 bases loaded one layer at a time (against transformers' own 4-bit loading),
random-init NF4 shapes, named architectures."""
import gc
import json
import math
import re

import pytest
import torch

from offload_trainer import cli
from offload_trainer.data.sources import builtin_asset
from offload_trainer.models import SafetensorsReader, architecture_config, pretrained_4bit_layerwise

pytest.importorskip("bitsandbytes")


def save_tiny(path, tie: bool, layers: int = 3):
    """A small bf16 Llama saved as several safetensors shards (plus the built-in tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = architecture_config("tiny-llama", {"hidden_size": 256, "intermediate_size": 512,
                                             "num_hidden_layers": layers, "tie_word_embeddings": tie})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path, max_shard_size="300KB")
    AutoTokenizer.from_pretrained(builtin_asset("tokenizer")).save_pretrained(path)
    return path


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_layerwise_4bit_load_equals_transformers_4bit_load(tmp_path, tie):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    path = save_tiny(tmp_path, tie)
    assert len(list(tmp_path.glob("*.safetensors"))) > 3  # sharded
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                               bnb_4bit_use_double_quant=True)
    ref = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch.bfloat16,
                                               device_map={"": "cpu"})
    ours = pretrained_4bit_layerwise(str(path), device="cpu", park="cpu")
    a, b = ref.state_dict(), ours.state_dict()
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a)  # packed NF4 codes, absmax, nested quantization state
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ref(input_ids=ids).logits, ours(input_ids=ids).logits)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tie


@pytest.mark.slow
def test_layerwise_load_reads_one_layer_at_a_time(tmp_path, monkeypatch):
    """Each decoder layer's tensors are read together, in order, and quantized before the next layer is read:
    at most one layer is ever in 16 bits."""
    import bitsandbytes as bnb

    path = save_tiny(tmp_path, tie=False, layers=6)
    events = []
    get = SafetensorsReader.get
    to = bnb.nn.Linear4bit.to
    monkeypatch.setattr(bnb.nn.Linear4bit, "to", lambda self, *a, **k: events.append(("quantize", None)) or
                        to(self, *a, **k))
    big = []  # at each read: how many 16-bit MLP weights are alive (only the layer being read may have them)

    def read(self, name):
        big.append(sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and not o.is_meta
                       and o.dtype == torch.bfloat16 and tuple(o.shape) == (512, 256)))
        events.append(("read", name))
        return get(self, name)

    monkeypatch.setattr(SafetensorsReader, "get", read)
    gc.collect()
    before = sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and not o.is_meta
                 and tuple(o.shape) == (512, 256))
    pretrained_4bit_layerwise(str(path), device="cpu", park="cpu")
    # gate_proj and up_proj of the layer being read, and of the one just quantized until the garbage collector
    # frees them: bounded, whatever the number of layers
    assert max(big) - before <= 4, big
    layer_of = [(kind, int(m.group(1)) if name and (m := re.search(r"layers\.(\d+)\.", name)) else None)
                for kind, name in events]
    reads = [i for kind, i in layer_of if kind == "read" and i is not None]
    assert reads == sorted(reads) and set(reads) == set(range(6))
    for i in range(5):  # layer i's 7 linears are quantized before anything of layer i + 1 is read
        first_next = layer_of.index(("read", i + 1))
        assert sum(1 for kind, j in layer_of[:first_next] if kind == "quantize") == 7 * (i + 1)


def test_layerwise_load_names_missing_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_tiny(tmp_path, tie=False, layers=2)
    shard = next(p for p in tmp_path.glob("*.safetensors") if "model.layers.1.mlp.up_proj.weight" in load_file(p))
    tensors = load_file(shard)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj.weight.*layer_swap: off"):
        pretrained_4bit_layerwise(str(path), device="cpu", park="cpu")


def test_pretrained_qlora_with_layer_swap_through_the_cli(tmp_path, capsys, monkeypatch):
    """model_name_or_path + load_in_4bit + layer_swap: the base is loaded layer by layer, then trained."""
    import offload_trainer.models as models

    path = save_tiny(tmp_path / "base", tie=False, layers=4)
    calls = []
    load = models.pretrained_4bit_layerwise
    monkeypatch.setattr(models.loading, "pretrained_4bit_layerwise", lambda *a, **k: calls.append(a) or load(*a, **k))
    rc = cli.main(["train", "configs/tiny-cpu.yaml", "model_config=null", f"model_name_or_path={path}",
                   "torch_dtype=bfloat16", "lora_r=8", "lora_alpha=16", "load_in_4bit=true", "layer_swap=2",
                   "activation_checkpointing=true",
                   "max_steps=2", "logging_steps=1", "save_strategy=no", "eval_fraction=0",
                   "per_device_train_batch_size=2", "max_seq_length=32", f"output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert rc == 0, err[-2000:]
    assert "layer swap: 2 of 4 decoder layers" in err and len(calls) == 1
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    losses = [h["loss"] for h in state["log_history"] if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


def test_random_init_goes_to_the_gpu_only_where_its_weights_fit(monkeypatch):
    from offload_trainer.models import random_init_device

    from offload_trainer.planner import ModelShape

    cfg = ModelShape.from_config(architecture_config("tiny-llama")).params  # 0.8M bf16 parameters: ~1.6 MB, + 1 GiB
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    free = {"bytes": 2 * 2**30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 80 * 2**30))
    assert random_init_device(cfg, torch.bfloat16, gpu) == gpu
    assert random_init_device(cfg, torch.bfloat16, gpu, budget_gib=1.0) == cpu  # the budget leaves no spare GiB
    free["bytes"] = 2**30  # less free memory than the weights + 1 GiB
    assert random_init_device(cfg, torch.bfloat16, gpu, budget_gib=24) == cpu
    assert random_init_device(cfg, torch.bfloat16, cpu) == cpu



@pytest.mark.parametrize("name", ["tiny-llama", "llama3.2-11b-vision"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_random_init_layerwise_builds_what_from_config_builds(name, device, caplog, monkeypatch):
    """Built block by block (decoder layers parked on the CPU): the same tensors, shapes, dtypes and trainability as
    transformers' own random init; norms at one, weights at the config's init scale, gates opened; each block said
    once the build takes longer than the progress interval (here 0 s)."""
    import logging

    from offload_trainer.models import layerwise, model_class, random_init_layerwise

    overrides = {"num_hidden_layers": 3} if name == "tiny-llama" else {
        "text_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 5, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "cross_attention_layers": [1, 3]},
        "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_global_layers": 1,
                          "attention_heads": 2, "image_size": 28, "patch_size": 14, "vision_output_dim": 64,
                          "intermediate_layers_indices": [0]}}
    cfg = architecture_config(name, overrides)
    monkeypatch.setattr(layerwise, "PROGRESS_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="offload_trainer"):
        model = random_init_layerwise(cfg, device, park="cpu", dtype=torch.bfloat16)
    ref = model_class(cfg).from_config(cfg, dtype=torch.bfloat16)
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    assert got.keys() == want.keys()
    for n, p in got.items():
        assert (p.shape, p.dtype, p.requires_grad) == (want[n].shape, want[n].dtype, want[n].requires_grad), n
        assert p.device.type == ("cpu" if ".layers." in n and "vision" not in n else device), n
        if "norm" in n and n.endswith("weight"):
            assert torch.equal(p.cpu(), want[n]), n  # (ones; the reference is built on the CPU)
        elif p.dim() == 2:
            assert abs(p.float().std().item() - want[n].float().std().item()) < 0.25 * want[n].float().std().item(), n
        elif n.endswith("_gate"):
            assert torch.all(p == 0.1), n
    blocks = sum(len(s) for s in layerwise.layer_lists(model))
    said = [r.getMessage() for r in caplog.records if "blocks built" in r.getMessage()]
    assert len(said) == blocks and said[-1].startswith(f"model: {blocks} of {blocks} blocks built")
    batch = torch.randint(0, 256, (1, 8))
    if name == "tiny-llama":  # it runs (every layer brought to one device)
        model.to(device)
        assert torch.isfinite(model(input_ids=batch.to(device)).logits).all()


def test_vision_layers_transformers_does_not_checkpoint_are_checkpointed_when_they_train():
    """Mllama's vision encoder layers are plain modules, which `gradient_checkpointing_enable` leaves alone: wrapped,
    a trained tower keeps only each layer's input for backward (saved-tensor bytes counted), with the same
    gradients."""
    from offload_trainer.models import random_init_layerwise
    from offload_trainer.trainer.seams import checkpoint_plain_stacks

    cfg = architecture_config("llama3.2-11b-vision", {
        "text_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "cross_attention_layers": [1]},
        "vision_config": {"hidden_size": 32, "intermediate_size": 128, "num_hidden_layers": 4, "num_global_layers": 2,
                          "attention_heads": 2, "image_size": 56, "patch_size": 14, "vision_output_dim": 64,
                          "intermediate_layers_indices": [0]}})
    torch.manual_seed(0)
    model = random_init_layerwise(cfg, "cpu", park=None, dtype=torch.float32)
    tower = model.model.vision_model
    pixels = torch.randn(1, 1, 4, 3, 56, 56)
    inputs = dict(pixel_values=pixels, aspect_ratio_ids=torch.tensor([[6]]), aspect_ratio_mask=torch.ones(1, 1, 4))

    def run():
        saved = []

        def pack(t):
            saved.append(t.numel() * t.element_size())
            return t

        tower.zero_grad()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = tower(**inputs).last_hidden_state
        out.float().pow(2).mean().backward()
        return sum(saved), {n: p.grad.clone() for n, p in tower.named_parameters() if p.grad is not None}

    plain_bytes, plain_grads = run()
    assert checkpoint_plain_stacks(model) == 6  # 4 local + 2 global vision layers; the decoder's are transformers'
    assert checkpoint_plain_stacks(model) == 0
    ckpt_bytes, ckpt_grads = run()
    assert ckpt_bytes < plain_bytes / 3, (ckpt_bytes, plain_bytes)
    assert plain_grads.keys() == ckpt_grads.keys() and len(plain_grads) > 10
    for n in plain_grads:
        torch.testing.assert_close(ckpt_grads[n], plain_grads[n], msg=n)
