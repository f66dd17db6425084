"""`offload_trainer.plan`: the planner from a model config and keywords, for a bare loop or a notebook, without
`OffloadSettings`. A thin adapter: it makes the three values the planner's entry takes (`search.plan(shape,
settings, budget)`) and nothing else."""
from __future__ import annotations

from ..settings import CHUNK_NUMEL, INFLIGHT_CHUNKS, LOSS_CHUNK, OffloadSettings
from .inputs import Budget, RunShape
from .search import plan as _plan
from .shape import Machine, ModelShape
from .table import Plan


def plan(config, *, batch: int, seq: int, accum: int = 1, fold: int | None = 1, suggest: bool = True,
         gpu_memory_limit_gb: float | None = None, host_memory_gb: float | None = None, max_grad_norm: float = 1.0,
         loss_chunk: int = LOSS_CHUNK, chunk_numel: int = CHUNK_NUMEL, inflight: int = INFLIGHT_CHUNKS,
         activation_offload: bool | None = None, offload_gradients: bool | None = None, params: int | None = None,
         layer_swap: bool | int | None = False, lora_params: int = 0, weight_bits: int = 16, ranks: int = 1,
         node_ranks: int | None = None, fused_update: bool = True, device_states: str | float = 0,
         save_shard_bytes: int = 0, weight_bytes: int = 2, speculative: bool | None = None,
         tiled_mlp: bool | None = False, tiled_layers: bool | None = False, workers: int = 0,
         host_budget_source: str = "", machine: Machine = Machine()) -> Plan:
    """The fastest configuration that fits the budgets, for micro-batches of `batch` x `seq` tokens of the model of
    `config`, `accum` per optimizer step (None for a switch: the planner chooses). The keywords are the settings'
    (settings.py) under their planner names -- `speculative` is `speculative_clipping`, `inflight`
    `offload_inflight_chunks`, `loss_chunk` `loss_chunk_size`, `workers` `dataloader_num_workers` -- and the budget's
    (`gpu_memory_limit_gb`, `host_memory_gb` and where it comes from, `ranks`, `node_ranks`, `machine`); the run's
    shape (`lora_params`, `weight_bits`, `weight_bytes`, `save_shard_bytes`, `params`) is `inputs.RunShape`'s.
    `search.plan` says what each does; raises PlanError (HostPlanError) when none fits, naming what to change."""
    shape = RunShape(ModelShape.from_config(config), seq, lora_params=lora_params, weight_bits=weight_bits,
                     weight_bytes=weight_bytes, save_shard_bytes=save_shard_bytes, params=params)
    settings = OffloadSettings(
        offload_gradients=offload_gradients, speculative_clipping=speculative, activation_offload=activation_offload,
        tiled_mlp=tiled_mlp, tiled_layers=tiled_layers, chunk_numel=chunk_numel, inflight_chunks=inflight,
        fused_update=fused_update, device_states=device_states, loss_chunk_size=loss_chunk, layer_swap=layer_swap,
        fold=fold, batch=batch, max_grad_norm=float(max_grad_norm or 0.0), accumulation=accum, world_size=ranks,
        data_workers=workers)
    budget = Budget(gpu_gb=gpu_memory_limit_gb, host_gb=host_memory_gb, host_source=host_budget_source, ranks=ranks,
                    node_ranks=node_ranks, machine=machine)
    return _plan(shape, settings, budget, suggest=suggest)
