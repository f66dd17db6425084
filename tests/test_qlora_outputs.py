"""What a (Q)LoRA run leaves behind: the adapters, written first and staged; for QLoRA no merged model (merging into NF4
would round the update away) but the command that merges into the bf16 base shard by shard, and the merge itself
against peft's own `merge_and_unload`."""
import json

import pytest
import torch

from cli_cases import log_to_current_stderr
from offload_trainer import cli
from offload_trainer.cli import recipe
from offload_trainer.data.sources import builtin_asset
from offload_trainer.models import architecture_config

pytest.importorskip("bitsandbytes")
IDS = torch.tensor([[1, 5, 9, 33, 200, 7, 64, 3, 17, 90, 12, 4]])


def save_base(path, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = architecture_config("tiny-llama", {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=dtype).save_pretrained(path, max_shard_size="200KB")
    AutoTokenizer.from_pretrained(builtin_asset("tokenizer")).save_pretrained(path)
    return path


def logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


def test_merge_shard_by_shard_equals_peft_merge_and_unload(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base_dir = save_base(tmp_path / "base", torch.float32)
    assert len(list(base_dir.glob("*.safetensors"))) > 2  # several shards: merged one at a time
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    torch.manual_seed(1)
    for name, p in model.named_parameters():  # (B starts at zero: give the adapters something to merge)
        if "lora_B" in name:
            p.data.normal_(std=0.05)
    model.save_pretrained(tmp_path / "adapters")
    want = logits(model.merge_and_unload())
    assert cli.main(["merge", str(tmp_path / "adapters"), "--base", str(base_dir)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "adapters" / "merged", dtype=torch.float32)
    base = logits(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32))
    got = logits(merged)
    assert not torch.allclose(got, base, atol=1e-3)  # the adapters did change it
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_merge_refuses_adapters_of_another_model(tmp_path, capsys):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base_dir = save_base(tmp_path / "base", torch.float32)
    cfg = architecture_config("tiny-llama", {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2})
    other = get_peft_model(AutoModelForCausalLM.from_config(cfg), LoraConfig(r=4, target_modules="all-linear"))
    other.save_pretrained(tmp_path / "adapters")
    assert cli.main(["merge", str(tmp_path / "adapters"), "--base", str(base_dir)]) == 2
    assert "these adapters were trained on another model" in capsys.readouterr().err
    assert not (tmp_path / "adapters" / "merged").exists()


def test_merge_refuses_an_out_that_is_not_new(tmp_path, capsys):
    """--out the base, the adapters' run, another run, or a directory with a model of its own: refused, nothing
    written; a merge written before is replaced."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from cli_cases import tree_hash

    base_dir = save_base(tmp_path / "base", torch.float32)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.save_pretrained(tmp_path / "adapters")
    run = tmp_path / "run"
    run.mkdir()
    (run / "trainer_state.json").write_text("{}")
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"an older model")
    other = save_base(tmp_path / "other", torch.float32)  # another model: the same file names as the base's
    for out, needle in ((base_dir, "is the base model's directory"), (tmp_path / "adapters", "is the adapters' run"),
                        (run, "holds a training run"), (stale, "holds files this merge did not write"),
                        (other, "holds files this merge did not write")):
        before = (tree_hash(base_dir), tree_hash(out))
        assert cli.main(["merge", str(tmp_path / "adapters"), "--base", str(base_dir), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err
        assert (tree_hash(base_dir), tree_hash(out)) == before
    again = tmp_path / "merged"
    for _ in range(2):  # (the second replaces the first)
        assert cli.main(["merge", str(tmp_path / "adapters"), "--base", str(base_dir), "--out", str(again)]) == 0
    assert AutoModelForCausalLM.from_pretrained(again, dtype=torch.float32) is not None
    # a merge of other adapters there is not replaced by this one
    model.save_pretrained(tmp_path / "adapters2")
    before = tree_hash(again)
    assert cli.main(["merge", str(tmp_path / "adapters2"), "--base", str(base_dir), "--out", str(again)]) == 2
    assert "holds a merge of other adapters or another base" in capsys.readouterr().err and tree_hash(again) == before


def test_merge_interrupted_leaves_nothing_and_retries(tmp_path, capsys, monkeypatch):
    """SIGTERM during a merge: one sentence, exit 143, no staging directory left (the default action killed it and
    left `.partial-save`); a staging directory a SIGKILL left does not stop the retry (it was refused as "files this
    merge did not write"); the retried merge is the merge."""
    import os
    import signal

    import safetensors.torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base_dir = save_base(tmp_path / "base", torch.float32)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.save_pretrained(tmp_path / "adapters")
    out = tmp_path / "out"
    real, calls = safetensors.torch.save_file, []

    def save_then_signal(*a, **k):
        real(*a, **k)
        calls.append(1)
        if len(calls) == 2:  # the second shard written: a SIGTERM arrives
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(safetensors.torch, "save_file", save_then_signal)
    argv = ["merge", str(tmp_path / "adapters"), "--base", str(base_dir), "--out", str(out)]
    assert cli.main(argv) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "interrupted: SIGTERM during merge: nothing was written to" in err and "Traceback" not in err, err
    assert not out.exists() or os.listdir(out) == []
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    (out / ".partial-save").mkdir(parents=True, exist_ok=True)  # as a SIGKILL would leave it
    (out / ".partial-save" / "model-00001-of-00009.safetensors").write_bytes(b"half")
    assert cli.main(argv) == 0
    assert not (out / ".partial-save").exists()
    assert AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32) is not None


@pytest.mark.parametrize("shard", ["/ABS/victim.safetensors", "../victim.safetensors", "sub/../../victim.safetensors"])
def test_merge_refuses_a_shard_outside_the_base(tmp_path, capsys, shard):
    """A base whose index names a shard by an absolute path or through `..`: refused before anything is read or
    written; the file it names is untouched and --out gets nothing."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from cli_cases import tree_hash

    base_dir = save_base(tmp_path / "base", torch.float32)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.save_pretrained(tmp_path / "adapters")
    index = base_dir / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = sorted(set(data["weight_map"].values()))[0]
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes((base_dir / first).read_bytes())  # a valid shard, outside the base
    name = shard.replace("/ABS/", str(tmp_path) + "/")
    data["weight_map"] = {k: (name if v == first else v) for k, v in data["weight_map"].items()}
    index.write_text(json.dumps(data))
    before = (tree_hash(tmp_path / "base"), victim.read_bytes())
    out = tmp_path / "out"
    assert cli.main(["merge", str(tmp_path / "adapters"), "--base", str(base_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "which is not a file of" in err and "Traceback" not in err, err
    assert (tree_hash(tmp_path / "base"), victim.read_bytes()) == before and not out.exists()


def test_merge_with_a_broken_adapter_config(tmp_path, capsys):
    """adapter_config.json cut short, or without a rank: one sentence, nothing written."""
    from safetensors.torch import save_file

    base_dir = save_base(tmp_path / "base", torch.float32)
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    save_file({"base_model.model.x.lora_A.weight": torch.zeros(1, 1)}, adapters / "adapter_model.safetensors")
    for text in ('{"r": 8, "lora_al', '{"lora_alpha": 16}'):
        (adapters / "adapter_config.json").write_text(text)
        assert cli.main(["merge", str(adapters), "--base", str(base_dir)]) == 2
        err = capsys.readouterr().err
        assert "adapter_config.json: not a LoRA adapter config" in err and "Traceback" not in err, err
        assert not (adapters / "merged").exists()


def test_qlora_run_writes_adapters_that_reload_with_plain_transformers_and_peft(tmp_path, capsys, monkeypatch):
    """QLoRA through the command: the adapters (no merged model), the log names the merge command; reloaded with
    transformers' own 4-bit load and peft they give the trained model's logits; merged into the bf16 base they give
    peft's merge of the same adapters into it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    base_dir = save_base(tmp_path / "base", torch.bfloat16)
    out = tmp_path / "out"
    trained = {}
    real = recipe.write_outputs

    def capture(trainer, tokenizer, model_args):
        trained["logits"] = logits(trainer.model)
        return real(trainer, tokenizer, model_args)

    monkeypatch.setattr(recipe, "write_outputs", capture)
    log_to_current_stderr()
    rc = cli.main(["train", "configs/tiny-cpu.yaml", "model_config=null", f"model_name_or_path={base_dir}",
                   "torch_dtype=bfloat16", "lora_r=8", "lora_alpha=16", "load_in_4bit=true", "max_steps=3",
                   "logging_steps=1", "save_strategy=no", "eval_fraction=0", "per_device_train_batch_size=2",
                   "max_seq_length=32", "learning_rate=1e-2", f"output_dir={out}"])
    err = capsys.readouterr().err
    assert rc == 0, err[-3000:]
    assert (out / "adapter_model.safetensors").exists() and not (out / "merged").exists()
    assert f"To merge into the bf16 base, one shard at a time: offload-trainer merge {out} --base {base_dir}" in err
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                               bnb_4bit_use_double_quant=True)
    base4 = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=quant, dtype=torch.bfloat16,
                                                 device_map={"": "cpu"})
    reloaded = PeftModel.from_pretrained(base4, out)
    torch.testing.assert_close(logits(reloaded), trained["logits"], rtol=0, atol=0)
    assert cli.main(["merge", str(out), "--base", str(base_dir)]) == 0
    merged = logits(AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.bfloat16))
    bf16 = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16), out)
    torch.testing.assert_close(merged, logits(bf16.merge_and_unload()), rtol=0.02, atol=0.02)  # bf16 rounding
    cfg = json.loads((out / "merged" / "config.json").read_text())
    assert "quantization_config" not in cfg


def _trained_adapters(base_dir, out, **lora):
    """Adapters of `lora`'s kind over the base, their B (and any module saved whole) given values to merge."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", **lora))
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name or "modules_to_save" in name:
            p.data.normal_(std=0.05)
        elif "lora_magnitude_vector" in name:
            p.data.mul_(1.5)
    model.save_pretrained(out)
    return model


@pytest.mark.parametrize("lora", [dict(use_dora=True),
                                  dict(rank_pattern={"q_proj": 2, "down_proj": 8}, alpha_pattern={"v_proj": 3}),
                                  dict(modules_to_save=["lm_head"]),
                                  dict(use_rslora=True, rank_pattern={"up_proj": 2})],
                         ids=["dora", "rank-alpha-pattern", "modules-to-save", "rslora-pattern"])
def test_merge_equals_peft_for_each_kind(lora, tmp_path):
    """DoRA magnitudes, per-module ranks and alphas, modules trained whole: every weight of the merge equals peft's
    merge_and_unload (it ignored them: weights off by up to 0.5, exit 0)."""
    from safetensors.torch import load_file

    base_dir = save_base(tmp_path / "base", torch.float32)
    want = {k: v.detach() for k, v in _trained_adapters(base_dir, tmp_path / "adapters", **lora)
            .merge_and_unload().state_dict().items()}
    assert cli.main(["merge", str(tmp_path / "adapters"), "--base", str(base_dir)]) == 0
    got = {}
    for shard in (tmp_path / "adapters" / "merged").glob("*.safetensors"):
        got.update(load_file(shard))
    base = {}
    for shard in base_dir.glob("*.safetensors"):
        base.update(load_file(shard))
    assert got.keys() == base.keys()
    changed = [k for k in got if not torch.equal(got[k], base[k])]
    assert len(changed) >= 14, changed  # every linear of both layers (and lm_head saved whole)
    for k in got:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_merge_refuses_nonfinite_adapters_and_links_out_of_the_base(tmp_path, capsys):
    """NaN adapters are refused (they merged silently); a base file that links outside the base (a planted
    `vocab.txt -> ~/.ssh/...`) is refused, not copied into --out; a Hub snapshot's links into its blobs/ are the
    model's own."""
    from safetensors.torch import load_file, save_file

    base_dir = save_base(tmp_path / "base", torch.float32)
    _trained_adapters(base_dir, tmp_path / "adapters")
    ad = tmp_path / "adapters" / "adapter_model.safetensors"
    good = load_file(ad)
    bad = dict(good)
    key = next(k for k in bad if "lora_B" in k)
    bad[key] = bad[key].clone()
    bad[key][0, 0] = float("nan")
    save_file(bad, ad)
    argv = ["merge", str(tmp_path / "adapters"), "--base", str(base_dir), "--out", str(tmp_path / "m")]
    assert cli.main(argv) == 2
    assert "holds non-finite values (NaN or inf)" in capsys.readouterr().err and not (tmp_path / "m").exists()
    save_file(good, ad)
    secret = tmp_path / "id_secret"
    secret.write_text("PRIVATE KEY")
    (base_dir / "vocab.txt").symlink_to(secret)
    assert cli.main(argv) == 2
    assert "is a link to" in capsys.readouterr().err and not (tmp_path / "m").exists()
    (base_dir / "vocab.txt").unlink()
    # a Hub cache: snapshots/<rev>/ holds links into blobs/
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for f in base_dir.iterdir():
        (repo / "blobs" / f.name).write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(repo / "blobs" / f.name)
    assert cli.main(["merge", str(tmp_path / "adapters"), "--base", str(snap), "--out", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "config.json").is_file() and not (tmp_path / "m" / "config.json").is_symlink()


def test_remerge_after_the_base_was_resharded_leaves_no_stale_file(tmp_path):
    """A merge into a whole-file base, then again after the base was re-sharded: the earlier merge's
    model.safetensors is removed (loading picked it instead of the new shards)."""
    from transformers import AutoModelForCausalLM

    base_dir = tmp_path / "base"
    cfg = architecture_config("tiny-llama", {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(base_dir)
    assert (base_dir / "model.safetensors").is_file()
    _trained_adapters(base_dir, tmp_path / "adapters")
    argv = ["merge", str(tmp_path / "adapters"), "--base", str(base_dir)]
    assert cli.main(argv) == 0
    merged = tmp_path / "adapters" / "merged"
    assert (merged / "model.safetensors").is_file()
    for f in base_dir.glob("model*"):
        f.unlink()
    model.save_pretrained(base_dir, max_shard_size="200KB")
    assert cli.main(argv) == 0
    names = sorted(p.name for p in merged.iterdir())
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names, names
