"""Memory planner: predict GPU peak, host peak, PCIe traffic and step time of a finetune before any weight is loaded,
pick what to offload for a GPU budget, and refuse plans that cannot fit.

Inputs are a model config (a transformers config or any object with its fields), the micro-batch shape and the
budgets. The model of memory (estimate.py) is the sum of what the step holds (weights, streamed-optimizer slots,
checkpointed layer inputs) plus the largest transient phase (loss chunk and LM-head gradient at the start of
backward; one layer's recompute and gradients in the middle), plus the allocator's slack, with constants calibrated
on the H200 runs in bench/results (`Machine`). shape.py reads the config; search.py finds the fastest plan that fits
(or says what to change); table.py is the Plan and its table; from_args.py plans for a run's settings.
The entry is `plan(shape, settings, budget)` (inputs.py: `RunShape`, `Budget`; settings.py: `OffloadSettings`);
`offload_trainer.plan` is `plan_from_keywords` (keywords.py), an adapter for a bare loop.
"""
from .from_args import (SAVE_SHARD_BYTES, dtype_bytes, make_plan, plan_at_resident, plan_for_run, run_budget,
                        run_shape)
from .inputs import Budget, RunShape
from .search import DEVICE_STATE_FILL_FRACTION, DEVICE_STATE_FILL_MARGIN_GIB, DEVICE_STATE_MARGIN_GIB, plan
from .keywords import plan as plan_from_keywords
from .shape import GiB, KNOWN_TYPES, HostPlanError, Machine, ModelShape, PlanError, UnknownArchitecture, machine_for
from .table import Plan

__all__ = ["plan", "plan_from_keywords", "make_plan", "plan_for_run", "run_shape", "run_budget", "plan_at_resident",
           "RunShape", "Budget", "Plan", "PlanError", "HostPlanError",
           "UnknownArchitecture", "Machine", "machine_for",
           "ModelShape", "GiB",
           "SAVE_SHARD_BYTES", "KNOWN_TYPES", "dtype_bytes",
           "DEVICE_STATE_MARGIN_GIB", "DEVICE_STATE_FILL_MARGIN_GIB", "DEVICE_STATE_FILL_FRACTION"]
