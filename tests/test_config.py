"""Config loading: every shipped config parses; user errors fail before any model is loaded."""
import glob
import os

import pytest

from offload_trainer import cli
from offload_trainer.cli.config import load_config, parse_args
from offload_trainer.errors import ConfigError

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "*.yaml")))


@pytest.fixture
def no_model_load(monkeypatch):
    """Any attempt to load a model fails the test: errors must come first."""
    import offload_trainer.models as models

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the config error was reported")

    monkeypatch.setattr(models, "load_model", boom)
    monkeypatch.setattr(models, "load_tokenizer", boom)


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_config_loads(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (a fresh directory: smollm2's outputs/smollm2-135m is written by example-model)
    model_args, data_args, training_args = parse_args(load_config(os.path.abspath(path) if not os.path.isabs(path)
                                                                  else path))
    assert training_args.output_dir
    assert (model_args.model_name_or_path is None) != (model_args.model_config is None)


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


BASE = "model_config: tiny-llama\noutput_dir: {out}\n"


@pytest.mark.parametrize("body, needle", [
    ("learning_rat: 1e-3\n", "unknown key 'learning_rat'. Did you mean 'learning_rate'?"),
    ("max_steps: ten\n", "key 'max_steps' = 'ten' (str) has the wrong type; expected int"),
    ("offload_optimizer: 3\n", "key 'offload_optimizer' = 3 (int) has the wrong type; expected bool or null"),
    ("dataset_path: /nonexistent/data.jsonl\n", "'/nonexistent/data.jsonl' does not exist"),
    ("model_name_or_path: ./no/such/model\n", "directory './no/such/model' does not exist"),
    ("optim: sgd\noffload_optimizer: true\n", "offload_optimizer=True streams 8-bit AdamW states, but optim='sgd'"),
    ("offload_chunk_numel: 1000\n", "offload_chunk_numel=1000: use a multiple of 256"),
    ("offload_device_states: lots\n", "offload_device_states='lots': use auto, off, or a number of GiB"),
    ("max_steps: [1\n", "(while parsing a flow sequence at line 3)"),
])
def test_user_errors_name_the_key_and_fail_before_model_load(tmp_path, capsys, no_model_load, body, needle):
    path = write(tmp_path, BASE.format(out=tmp_path / "out") + body)
    assert cli.main(["train", path]) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_override_typo_and_type(tmp_path, capsys, no_model_load):
    path = write(tmp_path, BASE.format(out=tmp_path / "out"))
    assert cli.main(["train", path, "max_step=3"]) == 2
    assert "unknown key 'max_step'. Did you mean 'max_steps'?" in capsys.readouterr().err
    assert cli.main(["train", path, "learning_rate=fast"]) == 2
    assert "'learning_rate' = 'fast'" in capsys.readouterr().err


def test_overrides_are_typed_yaml_scalars(tmp_path):
    cfg = load_config(write(tmp_path, BASE.format(out=tmp_path)), ["max_steps=7", "learning_rate=1e-4", "bf16=false"])
    assert cfg["max_steps"] == 7 and cfg["learning_rate"] == 1e-4 and cfg["bf16"] is False


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("no-such.yaml")


def test_model_source_must_be_exactly_one(tmp_path):
    with pytest.raises(ConfigError, match="exactly one of"):
        parse_args(load_config(write(tmp_path, f"output_dir: {tmp_path}\n")))


def test_types_are_checked_as_declared_after_a_parse(tmp_path):
    """HfArgumentParser rewrites the dataclass fields' types in place (str | None -> str): a second config
    in the same process must still accept `model_config: null`."""
    parse_args(load_config(write(tmp_path, BASE.format(out=tmp_path))))
    cfg = load_config(write(tmp_path, f"model_name_or_path: {tmp_path}\nmodel_config: null\noutput_dir: {tmp_path}\n"))
    assert cfg["model_config"] is None


def test_layer_swap_off_and_on_survive_yaml_booleans(tmp_path):
    """YAML 1.1 reads bare yes/no/on/off as booleans: `layer_swap: off` and `save_strategy: no` must keep their
    meaning (the config reads YAML 1.2 booleans); a boolean key still takes yes/no/on/off."""
    base = BASE.format(out=tmp_path) + "activation_checkpointing: true\n"
    from offload_trainer.settings import OffloadSettings

    for text, want in (("off", False), ("on", None), ("auto", None), ("3", 3)):
        _, _, targs = parse_args(load_config(write(tmp_path, base), [f"layer_swap={text}"]))
        assert OffloadSettings.from_args(targs).layer_swap == want, (text, targs.layer_swap)
        assert targs.layer_swap == text  # (the field as written: the settings are what reads it)
    _, _, targs = parse_args(load_config(write(tmp_path, base), ["save_strategy=no", "bf16=no", "fp16=off"]))
    assert getattr(targs.save_strategy, "value", targs.save_strategy) == "no" and targs.bf16 is False

