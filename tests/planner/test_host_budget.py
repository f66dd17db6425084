"""The host budget (`host_memory_limit_gb`): a plan for a 32, 64 or 128 GB machine made from this one, the refusal
that names the machine a run needs, and the host peak's breakdown, which sums to the prediction."""
import json

import pytest

from offload_trainer import cli, sysinfo
from offload_trainer.models import architecture_config
from offload_trainer.planner import HostPlanError, PlanError, machine_for, plan_from_keywords as plan

# what a machine of N GB leaves a run: N * 1e9 bytes less what an OS and a desktop keep (2.6 GiB)
AVAILABLE = {32: 27.2, 64: 57.0, 128: 116.6}


def plan_json(capsys, config: str, *keys: str) -> dict:
    assert cli.main(["plan", f"configs/{config}.yaml", "--json", *keys]) == 0
    return json.loads(capsys.readouterr().out)


def refusal(capsys, config: str, *keys: str) -> str:
    assert cli.main(["plan", f"configs/{config}.yaml", *keys]) == 2
    return capsys.readouterr().err


@pytest.fixture
def tiny_machine(monkeypatch):
    """This machine: 8 GiB available, so a plan that fits 57 GiB was made for the key, not for it."""
    monkeypatch.setattr(sysinfo, "host_available_gib", lambda: 8.0)


def test_8b_planned_for_32_64_and_128_gb_machines_from_this_one(capsys, tiny_machine):
    """8B 4 x 2048 with clipping: speculative on 64 and 128 GB (47.9 GiB: two banks of 8-bit states and the weights'
    backups, the embedding's states on the GPU, its layer inputs pinned); on 32 GB exact clipping needs 33.7 GiB, so
    it is refused, naming max_grad_norm: 0 (17.8 GiB) and the machine exact clipping needs."""
    for gb in (64, 128):
        p = plan_json(capsys, "llama3-8b-full-24gb", f"host_memory_limit_gb={AVAILABLE[gb]}")
        assert p["speculative_clipping"] and p["host_peak_gib"] == pytest.approx(47.9, abs=0.05)
        assert p["host_budget_gib"] == AVAILABLE[gb] and p["host_budget_source"] == "host_memory_limit_gb"
    err = refusal(capsys, "llama3-8b-full-24gb", f"host_memory_limit_gb={AVAILABLE[32]}")
    assert "the host budget is 27.2 GiB (host_memory_limit_gb): the kernel would kill the run" in err
    assert "Use max_grad_norm: 0 (no clipping" in err and "a 48 GB machine" in err
    # --host-gb is the same budget
    assert plan_json(capsys, "llama3-8b-full-24gb", "--host-gb", "57")["host_budget_gib"] == 57
    # and what it suggests fits
    p = plan_json(capsys, "llama3-8b-full-24gb", f"host_memory_limit_gb={AVAILABLE[32]}", "max_grad_norm=0")
    assert p["host_peak_gib"] <= AVAILABLE[32]


def test_64k_tokens_need_a_96_gb_machine_with_clipping(capsys, tiny_machine):
    """Llama-3.1-8B at 64k tokens with exact clipping: 8-bit states, gradients, 32 layers' activations and the
    swapped layers pinned, over 57 GiB: refused on a 64 GB machine, planned on a 128 GB one."""
    err = refusal(capsys, "llama3.1-8b-32k-24gb", "max_seq_length=65536", "host_memory_limit_gb=57")
    assert "gradients waiting (pinned) 15.0" in err and "offloaded activations (pinned) 16.0" in err
    assert "Use max_grad_norm: 0" in err and "a 96 GB machine" in err
    p = plan_json(capsys, "llama3.1-8b-32k-24gb", "max_seq_length=65536", "host_memory_limit_gb=116.6")
    assert p["tiled_mlp"] and p["host_peak_gib"] <= 116.6


def test_without_the_key_the_plan_is_for_what_is_available(capsys, monkeypatch):
    monkeypatch.setattr(sysinfo, "host_available_gib", lambda: 40.0)
    p = plan_json(capsys, "llama3-8b-full-24gb")
    assert p["host_budget_gib"] == 40.0 and p["host_budget_source"] == "available on this machine"
    assert not p["speculative_clipping"] and any("the host budget is 40.0 GiB" in n for n in p["notes"])


def test_train_plans_for_the_lesser_of_the_key_and_what_is_available():
    """(`plan` plans for the key on any machine; a run plans for what it can have: the key, or less)"""
    from offload_trainer.planner import plan_for_run, run_budget, run_shape
    from offload_trainer.settings import OffloadSettings

    s = OffloadSettings(batch=4, max_grad_norm=1.0, host_memory_limit_gb=57, gpu_memory_limit_gb=24)
    cfg = architecture_config("llama3-8b")
    short = plan_for_run(s, run_shape(cfg, 2048), run_budget(s, host_gb=40.0))
    assert (short.host_budget_gib, short.host_budget_source) == (40.0, "available on this machine, less than "
                                                                       "host_memory_limit_gb")
    assert not short.speculative_clipping and "of 40.0 GiB (available on this machine, less" in short.table()
    roomy = plan_for_run(s, run_shape(cfg, 2048), run_budget(s, host_gb=120.0))
    assert (roomy.host_budget_gib, roomy.host_budget_source) == (57, "host_memory_limit_gb")
    assert roomy.speculative_clipping


CASES = {  # (plan keyword arguments beyond the shape) -> what the peak must hold
    "speculative": (dict(max_grad_norm=1.0), "second bank of states (speculative clipping)"),
    "exact": (dict(max_grad_norm=1.0, speculative=False), "gradients waiting (pinned)"),
    "no clip, loader workers": (dict(max_grad_norm=0, workers=4), "data loader workers"),
    "swapped, offloaded activations": (dict(max_grad_norm=0, seq=16384, batch=1, layer_swap=None),
                                       "offloaded activations (pinned)"),
    "two ranks": (dict(max_grad_norm=1.0, ranks=2), "8-bit optimizer states (pinned)"),
    "QLoRA, the layers' load": (dict(model="llama3-70b", lora_params=207_093_760, weight_bits=4, layer_swap=None,
                                     batch=1), "every decoder layer, loaded before the swap places it"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_host_breakdown_sums_to_the_prediction(case):
    kw, part = CASES[case]
    kw = dict(dict(batch=4, seq=2048, gpu_memory_limit_gb=24, host_memory_gb=500, save_shard_bytes=2 * 10**9), **kw)
    p = plan(architecture_config(kw.pop("model", "llama3-8b")), **kw)
    assert part in p.host_breakdown
    assert sum(p.host_breakdown.values()) == pytest.approx(p.host_peak_gib, rel=1e-9)
    assert all(v > 0 for v in p.host_breakdown.values())
    assert "host memory breakdown (GiB): " + ", ".join(f"{k} {v:.2f}" for k, v in p.host_breakdown.items()) \
        in p.table()


def test_loader_workers_count_on_the_host():
    kw = dict(batch=4, seq=2048, gpu_memory_limit_gb=24, max_grad_norm=0)
    cfg = architecture_config("llama3-8b")
    assert plan(cfg, workers=4, **kw).host_peak_gib == pytest.approx(plan(cfg, **kw).host_peak_gib + 4 * 0.2)


def test_a_plan_that_only_the_host_refuses_is_a_host_error():
    """(the command and the Trainer refuse these even with no GPU cap; a GPU that does not fit only warns there)"""
    with pytest.raises(HostPlanError):
        plan(architecture_config("llama3-8b"), batch=4, seq=2048, gpu_memory_limit_gb=24, host_memory_gb=10)
    with pytest.raises(PlanError, match="GPU: needs") as e:
        plan(architecture_config("llama3-8b"), batch=4, seq=2048, gpu_memory_limit_gb=4, host_memory_gb=10)
    assert not isinstance(e.value, HostPlanError)


@pytest.mark.parametrize("gib, machine", [(27.2, "a 32 GB machine"), (27.3, "a 48 GB machine"),
                                           (57.0, "a 64 GB machine"), (60.7, "a 96 GB machine"),
                                           (116.6, "a 128 GB machine"), (3000, "a machine with 3224 GB of RAM")])
def test_the_machine_a_budget_needs(gib, machine):
    assert machine_for(gib).startswith(machine)


def test_the_key_is_checked_and_resolved_once():
    from offload_trainer import OffloadTrainingArguments
    from offload_trainer.settings import OffloadSettings

    args = OffloadTrainingArguments(output_dir="/tmp/x", host_memory_limit_gb=57, dataloader_num_workers=2,
                                    report_to="none")
    s = OffloadSettings.from_args(args)
    assert s.host_memory_limit_gb == 57 and s.data_workers == 2
    with pytest.raises(ValueError, match="host_memory_limit_gb=0: give a positive number of GiB"):
        OffloadTrainingArguments(output_dir="/tmp/x", host_memory_limit_gb=0, report_to="none")


def test_when_a_plan_error_stops_a_run(caplog):
    """The one rule the command and the Trainer follow (`make_plan`): no plan fitting the card's own memory, or an
    architecture the planner does not know, is said and training goes on; a plan asked for, a GPU cap, or a host
    short of every plan (the kernel would kill the run) stops it."""
    from types import SimpleNamespace

    from offload_trainer.planner import PlanError, UnknownArchitecture, make_plan, run_budget
    from offload_trainer.settings import OffloadSettings

    config = architecture_config("llama3-8b")
    settings = OffloadSettings(offload_optimizer=True, batch=4, checkpointing=True)

    def planned(s, model, required, **machine):
        return make_plan(s, run_budget(s, **machine), required=required, config=model, seq=2048)

    with caplog.at_level("WARNING", logger="offload_trainer"):
        assert planned(settings, config, False, gpu_gb=4.0, host_gb=100.0) is None
    assert "the planner finds no plan that fits this GPU (4.0 GiB)" in caplog.text
    with pytest.raises(PlanError):
        planned(settings, config, True, gpu_gb=4.0, host_gb=100.0)
    with pytest.raises(PlanError):
        planned(OffloadSettings(offload_optimizer=True, batch=4, checkpointing=True, gpu_memory_limit_gb=4.0),
                config, False, host_gb=100.0)
    with pytest.raises(HostPlanError):
        planned(settings, config, False, gpu_gb=22.6, host_gb=4.0)
    unknown = SimpleNamespace(model_type="no-such-model")
    caplog.clear()
    with caplog.at_level("WARNING", logger="offload_trainer"):
        assert planned(settings, unknown, False, gpu_gb=22.6, host_gb=100.0) is None
    assert "no plan: " in caplog.text
    with pytest.raises(UnknownArchitecture):
        planned(settings, unknown, True, gpu_gb=22.6, host_gb=100.0)


def test_a_refusal_names_what_refused_it(capsys, tiny_machine):
    """8B at 64k with tiled layers on a 64 GB machine: the plan with 17 layers resident fits the GPU budget (23.08 of
    23.30 GiB) and the host (55.8 of 57), but not layer_swap: auto's start margin. The refusal said the host budget
    would kill the run and proposed a 64 GB machine -- the one the user has. Now it names the margin, its size and the
    count that runs; the count it names does run; and every refusal lists each key that fits as the only change,
    with the figures of the plan it gives (the same as planning with it)."""
    err = refusal(capsys, "llama3.1-8b-32k-24gb", "max_seq_length=65536", "tiled_layers=true",
                  "host_memory_limit_gb=57")
    assert "with 17 of 32 decoder layers on the GPU the plan needs 23.08 GiB of the 23.30 usable" in err
    assert "layer_swap: auto starts 2.31 GiB under the budget" in err and "Set layer_swap: 17" in err
    assert "kernel would kill" not in err and "64 GB machine" not in err
    p = plan_json(capsys, "llama3.1-8b-32k-24gb", "max_seq_length=65536", "tiled_layers=true",
                  "host_memory_limit_gb=57", "layer_swap=17")
    assert p["resident_layers"] == 17 and p["host_peak_gib"] <= 57
    err = refusal(capsys, "llama3-8b-full-24gb", f"host_memory_limit_gb={AVAILABLE[32]}")
    assert "a 48 GB machine (~42.1 GiB available; this run needs 33.7)" in err
    clip0 = plan_json(capsys, "llama3-8b-full-24gb", f"host_memory_limit_gb={AVAILABLE[32]}", "max_grad_norm=0")
    assert (f"Each of these fits as the only change: max_grad_norm: 0 ({clip0['gpu_peak_gib']:.1f} GiB GPU, "
            f"{clip0['host_peak_gib']:.1f} GiB host, {clip0['step_s']:.2f} s a step)") in err


@pytest.mark.parametrize("need, have, machine", [(33.7, 28.0, "a 48 GB machine"), (57.5, 57.0, "a 96 GB machine"),
                                                 (56.0, 56.0, "a 96 GB machine"), (18.8, 8.0, "a 24 GB machine")])
def test_never_the_machine_the_user_has(need, have, machine):
    """The machine a refusal proposes leaves more than the run needs and more than the budget it has now."""
    assert machine_for(need, above=have).startswith(machine)
