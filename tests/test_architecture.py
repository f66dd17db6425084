"""The package's shape, read from its source: three layers that import only downwards, no import circle, small
modules, and every offload switch's default and bound written once (settings.py)."""
import ast
import dataclasses
import pathlib
import re
import sys

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "offload_trainer"
MAX_LINES = 400


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = list(f.relative_to(PKG).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Each module's imports of the package's own modules, at the top and inside functions alike."""
    edges = {}
    for mod, f in mods.items():
        package = mod.split(".") if f.name == "__init__.py" else mod.split(".")[:-1]
        package = [p for p in package if p]
        found = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                elif (node.module or "").startswith("offload_trainer"):
                    target = node.module[len("offload_trainer."):] if node.module != "offload_trainer" else ""
                else:
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}" if target else alias.name
                    found.add(sub if sub in mods else target)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("offload_trainer."):
                        found.add(alias.name[len("offload_trainer."):])
        found.discard(mod)  # (a module's `if __name__ == "__main__"` importing itself by name)
        edges[mod] = {m for m in found if m in mods}
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    edges = _imports(_modules())
    assert edges["trainer.mixin"] and edges["cli.recipe"]  # (the graph was read: a negative control below)
    assert _cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# Each layer and what it may import of the package ("" is the package itself, loaded lazily).
SHARED = {"", "digest", "errors", "limits", "settings", "sysinfo"}
LAYERS = {
    "engine": SHARED,
    "planner": SHARED | {"engine"},
    "models": SHARED | {"engine", "data"},  # (not the planner: callers count what a model needs from its config)
    "data": SHARED,
    "trainer": SHARED | {"engine", "planner", "models"},
    "cli": SHARED | {"engine", "planner", "models", "data", "trainer"},
    # the other tools' entry points (TRL, axolotl, LLaMA-Factory) wire the Trainer shell in and log as the command does
    "integrations": SHARED | {"engine", "planner", "models", "data", "trainer", "cli"},
}


def _layer(mod: str) -> str:
    return mod.split(".")[0] if mod else ""


def test_layers_import_only_downwards():
    edges = _imports(_modules())
    unplaced = {_layer(m) for m in edges if "." in m} - set(LAYERS)  # (every package has its row)
    assert unplaced == set()
    wrong = [(m, t) for m, targets in edges.items() if _layer(m) in LAYERS for t in targets
             if _layer(t) != _layer(m) and _layer(t) not in LAYERS[_layer(m)]]
    assert wrong == []


def test_mechanisms_and_planner_import_torch_and_torchao_only():
    heavy = re.compile(r"^\s*(?:from|import)\s+(transformers|peft|datasets|accelerate|trl|bitsandbytes)\b", re.M)
    found = [str(f.relative_to(PKG)) for sub in ("engine", "planner") for f in (PKG / sub).rglob("*.py")
             if heavy.search(f.read_text())]
    assert found == []


def test_no_module_over_400_lines():
    long = {str(f.relative_to(PKG)): n for f in PKG.rglob("*.py") if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def _our_fields():
    from offload_trainer.trainer.args import OffloadFields

    return {f.name: f.default for f in dataclasses.fields(OffloadFields) if f.name != "activation_checkpointing"}


def test_every_switch_default_is_the_settings_one():
    """The arguments' defaults and a plain TrainingArguments' resolved settings are the same values."""
    from transformers import TrainingArguments

    from offload_trainer.settings import OffloadSettings

    fields = _our_fields()
    from_ours = OffloadSettings.from_args(type("Args", (), dict(fields))())
    from_plain = OffloadSettings.from_args(TrainingArguments(output_dir="/nonexistent", report_to="none"))
    ignore = {"check_nonfinite", "max_nonfinite_steps", "batch", "max_grad_norm", "world_size"}
    assert {k: v for k, v in dataclasses.asdict(from_ours).items() if k not in ignore} == \
        {k: v for k, v in dataclasses.asdict(from_plain).items() if k not in ignore}
    assert from_ours.max_nonfinite_steps == fields["max_nonfinite_steps"] > 0


def test_defaults_and_bounds_are_written_once():
    """Outside settings.py no module spells a switch's default (2**25, the chunk counts) or reads one of our fields
    with a fallback of its own (`getattr(args, "layer_swap", "off")`): that is how two defaults drifted apart."""
    names = "|".join(_our_fields())
    fallback = re.compile(rf"getattr\([^,]+,\s*\"({names})\",")
    literal = re.compile(r"2\s*\*\*\s*25\b|33554432|inflight_chunks\s*[:=]\s*(?:int\s*=\s*)?4\b|"
                         r"chunk_size\s*:\s*int\s*=\s*1024|<\s*2\s*:.*inflight")
    found = []
    for f in PKG.rglob("*.py"):
        if f.name == "settings.py":
            continue
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if fallback.search(line) or literal.search(line):
                found.append(f"{f.relative_to(PKG)}:{i}: {line.strip()}")
    assert found == []


@pytest.mark.parametrize("line", ['x = getattr(args, "layer_swap", "off")', "chunk_numel: int = 2**25,",
                                  "inflight_chunks: int = 4,"])
def test_the_defaults_check_catches_a_second_default(line, tmp_path, monkeypatch):
    """Negative control: a module that writes a default again fails the check above."""
    fake = tmp_path / "offload_trainer"
    fake.mkdir()
    (fake / "rogue.py").write_text(line + "\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", fake)
    with pytest.raises(AssertionError):
        test_defaults_and_bounds_are_written_once()


def _count_settings_made(monkeypatch) -> tuple[list, list]:
    """(callers of OffloadSettings.from_args, switch parses), recorded from here on."""
    import sys as _sys

    from offload_trainer import settings as S

    made, parsed = [], []
    real = S.OffloadSettings.from_args.__func__
    monkeypatch.setattr(S.OffloadSettings, "from_args",
                        classmethod(lambda cls, args: made.append(_sys._getframe(1).f_code.co_name) or real(cls, args)))
    for name in ("parse_layer_swap", "parse_device_states", "parse_fold"):
        fn = getattr(S, name)
        monkeypatch.setattr(S, name, lambda v, fn=fn, name=name: parsed.append(name) or fn(v))
    return made, parsed


def test_settings_are_made_once_per_run_and_handed_down(tmp_path, monkeypatch):
    """One `OffloadSettings` per run, made by one function and handed down: through the command, the arguments make
    a throwaway one as they are built (their check, as TrainingArguments checks its fields) and the command makes
    the run's, plans with it and hands it to the Trainer, which makes none; through the class, the Trainer makes it
    once in its constructor and nothing asks again during train(). Each switch is parsed once per value made, and
    no module keeps a copy (the settings module holds no mutable global). Breaks that fail it: the Trainer
    ignoring `offload_settings` (a third make), a getter on the arguments parsing layer_swap on each read (more
    parses than makes), a cache dict in settings.py."""
    from cli_cases import Case, log_to_current_stderr
    from helpers import tiny_setup
    from offload_trainer import OffloadTrainer, cli
    from offload_trainer import settings as S
    from transformers import TrainingArguments

    made, parsed = _count_settings_made(monkeypatch)
    case = Case(tmp_path)
    log_to_current_stderr()
    assert cli.main(["train", str(case.config)]) == 0
    assert made == ["__post_init__", "run_settings"], made
    assert sorted(parsed) == sorted(["parse_layer_swap", "parse_device_states", "parse_fold"] * 2), parsed

    del made[:], parsed[:]
    model, tok, train = tiny_setup()
    args = TrainingArguments(output_dir=str(tmp_path / "class"), max_steps=1, per_device_train_batch_size=2,
                             save_strategy="no", report_to="none")
    trainer = OffloadTrainer(model=model, args=args, train_dataset=train)
    trainer.train()
    assert made == ["make_settings"] and len(parsed) == 3, (made, parsed)

    kept = [name for name, value in vars(S).items() if isinstance(value, (dict, list, set)) and not name.isupper()
            and not name.startswith("__")]
    assert kept == [], f"settings.py keeps state: {kept}"


def _planner_functions_over(limit: int, root=None) -> list[str]:
    """Every function of planner/ (nested ones and methods too) taking more than `limit` parameters, as file:name."""
    import ast

    root = root or PKG / "planner"
    over = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                n = (len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None)
                     + (a.kwarg is not None))
                if n > limit:
                    over.append(f"{path.name}:{node.name}")
    return over


def test_planner_functions_take_few_values(tmp_path):
    """The planner's entry is `plan(shape, settings, budget)`; the functions behind it take those few values (they
    took 10-27 keywords), but the public keyword adapter (`offload_trainer.plan`, keywords.py). The check fails on a
    function of nine."""
    assert _planner_functions_over(8) == ["keywords.py:plan"]
    (tmp_path / "wide.py").write_text("def f(a, b, c, d, e, f, g, h, *, i=0):\n    pass\n")
    assert _planner_functions_over(8, tmp_path) == ["wide.py:f"]


def test_forwards_are_replaced_only_through_the_wrap_helper():
    """A module's forward is replaced only by `engine/wrap.py` (which records it, so that `unwrap` -- the model
    handed back -- puts the module's own back: tests/test_hand_back.py checks that on a trained model); a hook on a
    model goes through `wrap.add_hook` or a mechanism's detach registered with `wrap.on_unwrap`. An assignment
    `module.forward = ...` anywhere else fails this."""
    import re

    pattern = re.compile(r"^[^#\n]*\.forward\s*=(?!=)", re.M)
    assert pattern.search("    mlp.forward = forward  # ...") and not pattern.search("x.forward == y")
    offenders = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
                 if p.name != "wrap.py" and pattern.search(p.read_text())]
    assert offenders == []
    hooks = re.compile(r"register_(forward_pre|forward|full_backward|full_backward_pre|post_accumulate_grad)_hook\(")
    # each registering module and what takes its hooks off: the optimizer's schedule (detach, wiring registers it
    # with on_unwrap), the layer swap (remove, likewise), activation offload (add_hook)
    assert sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if hooks.search(p.read_text())) == [
        "engine/activations.py", "engine/optim/schedule.py", "engine/swap.py"]


def test_each_run_state_field_is_written_where_its_table_says():
    """`RunState` stays one object (run_state.py says why); `WRITERS` names the module that writes each field. Every
    assignment `run.<field> = ...` / `self._run.<field> = ...` in trainer/ and cli/ must be by a module the table
    names, and every field must be in it: a new writer elsewhere fails this (the check is shown to catch one)."""
    import re

    from offload_trainer.trainer.run_state import WRITERS, RunState
    from offload_trainer.settings import OffloadSettings

    assert set(vars(RunState(OffloadSettings()))) == set(WRITERS)
    pattern = re.compile(r"\b(?:run|_run)\.(\w+)(?:\s*,\s*(?:run|_run|self\._run)\.(\w+))*\s*=(?!=)")

    def writers(text: str) -> set[str]:
        return {name for m in pattern.finditer(text) for name in m.groups() if name}

    assert writers("run.plan = None\nrun.streaming, run.not_streaming_why = f()\nx = run.plan == y") == {
        "plan", "streaming", "not_streaming_why"}
    wrong = []
    for path in [*(PKG / "trainer").glob("*.py"), *(PKG / "cli").glob("*.py")]:
        if path.name == "run_state.py":
            continue
        for field in writers(path.read_text()):
            if path.stem not in WRITERS.get(field, ()):
                wrong.append(f"{path.stem} writes run.{field}")
    assert wrong == []


def test_the_trainer_shell_loads_no_data_layer():
    """`import offload_trainer.trainer` (what a Trainer user imports) loads neither our data layer nor `datasets` or
    `peft`: those load where a run uses them."""
    import subprocess

    code = ("import sys, offload_trainer.trainer; "
            "print(sorted(m for m in ('datasets', 'peft', 'offload_trainer.data') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_resolving_the_trainer_loads_no_data_layer():
    """`from offload_trainer import OffloadTrainer` -- the class resolved, not only the lazy package -- loads no module
    of our data layer (models/loading.py imported it for one asset path). (transformers' Trainer itself imports
    `datasets` and `peft`: not ours to keep out.)"""
    import subprocess

    code = ("import sys; from offload_trainer import OffloadTrainer, OffloadTrainingArguments; "
            "print(sorted(m for m in sys.modules if m.startswith('offload_trainer.data')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_one_vocabulary_of_switch_words(tmp_path):
    """The config's booleans and the switches' off / auto read the same words (settings.switch_word)."""
    from cli_cases import Case
    from offload_trainer.cli.config import load_config
    from offload_trainer.settings import OFF_WORDS, ON_WORDS, parse_device_states, parse_layer_swap, switch_word

    for word in ON_WORDS:
        assert switch_word(word.upper()) is True and parse_layer_swap(word) is None
    for word in OFF_WORDS:
        assert switch_word(word) is False and parse_layer_swap(word) is False and parse_device_states(word) == 0.0
    assert switch_word("auto") is None and switch_word("2") is None
    config = str(Case(tmp_path).config)
    for word in (*ON_WORDS, *OFF_WORDS[:3]):  # a bool key given as a word: the same reading
        assert load_config(config, [f"bf16='{word.upper()}'"])["bf16"] is switch_word(word)


def test_every_switch_reads_every_word(tmp_path):
    """One vocabulary for every switch of ours: each on word, each off word and `auto`, through a config override.
    A switch with a planner's choice reads `on` as auto (layer_swap, fold_accumulation, offload_device_states: it
    raised for the last); an on / off switch reads `auto` as unset, the planner's or the run's choice (it was a type
    error)."""
    from cli_cases import Case
    from offload_trainer.cli.config import auto_switches, load_config
    from offload_trainer.settings import OFF_WORDS, ON_WORDS, parse_device_states, parse_fold, parse_layer_swap

    config = str(Case(tmp_path).config)
    counted = {"layer_swap": (parse_layer_swap, None, False), "fold_accumulation": (parse_fold, None, 1),
               "offload_device_states": (parse_device_states, "auto", 0.0)}
    switches = sorted(auto_switches())
    assert {"activation_offload", "tiled_mlp", "tiled_layers", "speculative_clipping", "offload_optimizer"} <= set(
        switches)
    for word in (*ON_WORDS, *OFF_WORDS[:3], "auto"):
        for spelled in (word, word.upper()):
            want = True if word in ON_WORDS else None if word == "auto" else False
            for key in switches:
                assert load_config(config, [f"{key}='{spelled}'"])[key] is want, (key, spelled)
            for key, (parse, auto, off) in counted.items():
                value = load_config(config, [f"{key}='{spelled}'"])[key]
                assert parse(value) == (off if want is False else auto), (key, spelled)
