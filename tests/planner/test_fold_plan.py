"""The planner's choice of how many of a step's micro-batches run as one (`fold`): the fastest divisor of the
accumulation whose plan fits, each planned as micro-batches of `batch * j`, `accum / j` per step."""
import pytest

from offload_trainer.models import architecture_config
from offload_trainer.planner import PlanError, plan_for_run, run_budget, run_shape
from offload_trainer.planner import plan_from_keywords as plan
from offload_trainer.settings import OffloadSettings, parse_fold

BUDGET = dict(gpu_memory_limit_gb=24, host_memory_gb=57, device_states="auto", activation_offload=None,
              offload_gradients=None, speculative=None)


def test_one_by_2048_by_4_runs_as_one_batch_of_4_and_clips_speculatively():
    cfg = architecture_config("llama3-8b")
    p = plan(cfg, batch=1, seq=2048, accum=4, fold=None, max_grad_norm=1.0, **BUDGET)
    whole = plan(cfg, batch=4, seq=2048, accum=1, max_grad_norm=1.0, **BUDGET)
    assert (p.fold, p.batch, p.accum) == (4, 4, 1)
    assert p.step_s == whole.step_s and p.gpu_peak_gib == whole.gpu_peak_gib and p.host_peak_gib == whole.host_peak_gib
    assert p.speculative_clipping  # (no gradient sums wait in the spare buffer)
    unfolded = plan(cfg, batch=1, seq=2048, accum=4, max_grad_norm=1.0, **BUDGET)
    assert unfolded.fold == 1 and unfolded.step_s > 1.5 * p.step_s
    assert "4 x 2048 tokens (4 of the Trainer's micro-batches of 1 x 2048 run as one" in p.table()
    assert p.notes[0].startswith("gradient accumulation: 4 micro-batches of 1 x 2048 run as one of 4 x 2048")


@pytest.mark.parametrize("swap", [False, None])
def test_the_fastest_fold_that_fits_is_taken(swap):
    """2 x 2048 x 4: 8 x 2048 fits only with layers swapped; each divisor's plan is what `plan` gives for its shape,
    and the fastest one that fits is taken."""
    cfg = architecture_config("llama3-8b")
    p = plan(cfg, batch=2, seq=2048, accum=4, fold=None, max_grad_norm=0, layer_swap=swap, **BUDGET)
    options = {}
    for j in (1, 2, 4):
        try:
            options[j] = plan(cfg, batch=2 * j, seq=2048, accum=4 // j, max_grad_norm=0, layer_swap=swap, **BUDGET)
        except PlanError:
            pass
    assert (4 in options) == (swap is None)
    assert p.fold == min(options, key=lambda j: (options[j].step_s, -j))
    assert p.step_s == options[p.fold].step_s and p.batch == 2 * p.fold and p.accum == 4 // p.fold


def test_a_micro_batch_that_fills_the_card_is_not_folded():
    p = plan(architecture_config("llama3.1-8b"), batch=1, seq=32768, accum=2, fold=None, max_grad_norm=1.0,
             layer_swap=None, **BUDGET)
    assert p.fold == 1 and p.accum == 2 and p.batch == 1


def test_a_fold_given_is_planned_as_given_or_refused():
    cfg = architecture_config("llama3-8b")
    with pytest.raises(PlanError, match="fold_accumulation=3 must divide gradient_accumulation_steps=4"):
        plan(cfg, batch=1, seq=2048, accum=4, fold=3, **BUDGET)
    with pytest.raises(PlanError, match="GPU: needs"):  # 8 x 2048 with every layer on the GPU
        plan(cfg, batch=2, seq=2048, accum=4, fold=4, max_grad_norm=0, **BUDGET)
    assert plan(cfg, batch=1, seq=2048, accum=4, fold=2, **BUDGET).fold == 2


def test_without_a_gpu_budget_auto_folds_nothing_and_a_count_folds():
    cfg = architecture_config("tiny-llama")
    auto = OffloadSettings(batch=2, accumulation=4, max_grad_norm=1.0)
    assert plan_for_run(auto, run_shape(cfg, 128), run_budget(auto)).fold == 1
    two = OffloadSettings(batch=2, accumulation=4, fold=2)
    assert plan_for_run(two, run_shape(cfg, 128), run_budget(two)).fold == 2


def test_fold_words_and_counts():
    assert [parse_fold(v) for v in ("auto", "on", True, None)] == [None] * 4
    assert [parse_fold(v) for v in ("off", False, "no", "1")] == [1] * 4
    assert parse_fold("4") == 4 and parse_fold(8) == 8
    for bad in ("0", "two", "-2", "1.5"):
        with pytest.raises(ValueError, match="fold_accumulation"):
            parse_fold(bad)
    from types import SimpleNamespace

    from offload_trainer.trainer.conflicts import check_settings

    with pytest.raises(ValueError, match="fold_accumulation=3: each optimizer step's 4 micro-batches"):
        check_settings(OffloadSettings(accumulation=4, fold=3), SimpleNamespace())


def test_accumulating_on_the_host_clips_speculatively_in_the_same_host_memory():
    """The gradient sums and the weights' backups share the spare buffer (each backup is taken once its sum is read):
    speculation with accumulation costs the second bank of states only, as without it."""
    cfg = architecture_config("llama3-8b")
    spec = plan(cfg, batch=4, seq=2048, accum=2, max_grad_norm=1.0, **BUDGET)
    exact = plan(cfg, batch=4, seq=2048, accum=2, max_grad_norm=1.0, **{**BUDGET, "speculative": False})
    free = plan(cfg, batch=4, seq=2048, accum=2, max_grad_norm=0, **BUDGET)
    assert spec.speculative_clipping and spec.offload_gradients and not exact.speculative_clipping
    assert spec.step_s == pytest.approx(free.step_s, rel=0.01) and exact.step_s > 1.1 * spec.step_s
    states = exact.host_breakdown["8-bit optimizer states (pinned)"]
    assert spec.host_breakdown["second bank of states (speculative clipping)"] == pytest.approx(states)
    assert spec.host_peak_gib == pytest.approx(exact.host_peak_gib + states)
