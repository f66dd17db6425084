"""What the Trainer shell builds from the run's settings, once per run: the plan (sized from the longest row the data
gives), the layer-swap engine on the model's decoder layers, and the streamed optimizer over the Trainer's parameter
groups. Each reads the switches from `run.settings` (never the arguments) and keeps what it built in `run`."""
from __future__ import annotations

import logging

import torch

from ..errors import ConfigError
from ..engine.distributed import Sharding
from ..models import base_model
from ..engine.optim import StreamedAdamW8bit
from ..planner import Machine, make_plan, run_budget
from .conflicts import check_layer_swap, check_swapped_training
from .run_state import RunState
from .seams import claim_device_map
from ..engine.fit import CudaProbe, ResidencyFit
from ..engine.layers import decoder_layers
from ..engine.swap import LayerSwap
from ..engine.tiled_mlp import tile_mlps
from ..models.tiled_layers import TILED_LAYER_CLASSES, TILED_LAYER_TAG, tile_decoder_layers
from ..engine.wrap import on_unwrap, wrapped
from ..settings import LAYER_SWAP_FIT_STEPS, MLP_TILE_TOKENS, gradients_offloaded
from ..sysinfo import gpu_budget_gib, host_available_gib

logger = logging.getLogger("offload_trainer")


def apply_gpu_memory_limit(gib: float | None) -> None:
    """Cap this process's CUDA memory at `gib` GiB (emulates a smaller card on a bigger one)."""
    if not gib:
        return
    if not torch.cuda.is_available():
        raise ConfigError(f"gpu_memory_limit_gb={gib:g} caps GPU memory, but PyTorch sees no CUDA GPU (a CPU-only "
                          f"torch build, or no driver). Remove gpu_memory_limit_gb to train on the CPU; "
                          f"`offload-trainer plan` plans for a GPU without one.")
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if gib * 2**30 >= total:  # (a "24 GB" card has 23.99 GiB: the shipped configs' 24 is that card, not an error)
        logger.info("gpu_memory_limit_gb=%g is not below this GPU's %.2f GiB: no cap, the card itself is the limit "
                    "(the plan is made for the lesser of the two)", gib, total / 2**30)
        return
    torch.cuda.set_per_process_memory_fraction(gib * 2**30 / total)


def plan_the_run(trainer, run: RunState) -> None:
    """Run the planner once (logged), and let it decide the switches left unset."""
    peft = hasattr(trainer.model, "get_base_model")
    if run.plan is not None or not (run.streaming or peft):
        return
    limit = run.settings.gpu_memory_limit_gb
    if not limit and trainer.args.device.type != "cuda":
        return  # (a plan is of GPU memory, PCIe traffic and GPU step time: none applies on a CPU)
    lora = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad) if peft else 0
    bits = 4 if getattr(base_model(trainer.model), "is_loaded_in_4bit", False) else 16
    config = getattr(trainer.model, "config", None)
    seq = row_tokens(trainer, run)
    if config is None or not seq:
        return
    # plan for the card (its free memory and what the model already holds), or the cap where it is less, so the
    # switches left unset (gradient and activation offload, layer swap, states kept on the GPU) suit it
    gpu_gb = gpu_budget_gib(Machine().cuda_context_gib) if trainer.args.device.type == "cuda" else None
    others = reference_model_gib(trainer)
    if others:
        logger.info("plan: the reference model holds %.2f GiB of the GPU beside the trained one", others)
    # (the host's RAM too, as the command plans: speculative clipping is chosen only where it has room)
    budget = run_budget(run.settings, gpu_gb=gpu_gb, host_gb=host_available_gib(), other_models_gib=others)
    run.plan = make_plan(run.settings, budget, required=False, config=config, seq=seq, lora_params=lora,
                         weight_bits=bits)
    if run.plan is None:
        return
    logger.info("plan:\n%s", run.plan.table())


def reference_model_gib(trainer) -> float:
    """GiB of a frozen model the trainer also runs on the GPU: TRL's `ref_model` (DPO, KTO; None with PEFT, whose
    disabled adapters give the reference)."""
    ref = getattr(trainer, "ref_model", None)
    if not isinstance(ref, torch.nn.Module) or ref is trainer.model:
        return 0.0
    tensors = [*ref.parameters(), *ref.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**30


def row_tokens(trainer, run: RunState) -> int | None:
    """`longest_row`, read once per training dataset: the plan, the resume check and every checkpoint's record of
    the hyperparameters take it."""
    ds = trainer.train_dataset
    if run.row_tokens is None or run.row_tokens[0] is not ds:
        run.row_tokens = (ds, longest_row(trainer))
    return run.row_tokens[1]


def longest_row(trainer) -> int | None:
    """Tokens in the longest row the training data can give, which the plan must hold: the configured maximum
    (TRL's `max_length`) when there is one; else the longest `input_ids` of a `datasets.Dataset` (read from its
    Arrow column, nothing decoded) or of the first 1,000 rows of another map-style dataset. None: no plan
    (a stream without a maximum, or rows that are not token ids)."""
    limit = getattr(trainer.args, "max_length", None) or getattr(trainer.args, "max_seq_length", None)
    if isinstance(limit, int) and limit > 0:
        return limit
    ds = trainer.train_dataset
    if ds is None or not hasattr(ds, "__len__") or not len(ds):
        if ds is not None:
            logger.info("plan: skipped -- a streaming dataset and no max_length to size it from")
        return None
    table = getattr(getattr(ds, "data", None), "table", None)
    if table is not None and "input_ids" in table.column_names:
        import pyarrow.compute as pc

        return pc.max(pc.list_value_length(table.column("input_ids"))).as_py()
    rows = [ds[i] for i in range(min(len(ds), 1000))]
    lengths = [len(r["input_ids"]) for r in rows if isinstance(r, dict) and "input_ids" in r]
    return max(lengths) if lengths else None


def install_layer_swap(trainer, run: RunState) -> None:
    """Keep `layer_swap` decoder layers on the device (planner's choice for 'auto'); the rest swap."""
    setting = run.settings.layer_swap  # False: off, None: auto, else resident layers
    if setting is False:
        return
    model = trainer.model
    inner = base_model(model) if model is not None else None
    layers = decoder_layers(inner) if inner is not None else None
    check_layer_swap(run.settings, model_init=trainer.model_init, layers=layers, streaming=run.streaming)
    if setting is None:
        plan_the_run(trainer, run)
        if run.plan is None:
            raise ConfigError("layer_swap: auto asks the planner, which models decoder-only LMs trained on "
                              "tokenized sequences; give the number of layers to keep on the GPU instead "
                              f"(e.g. layer_swap: {len(layers) // 2})")
        resident = run.plan.resident_layers
    else:
        resident = min(setting, len(layers))
    device = trainer.args.device
    in_layers = {id(m) for m in layers.modules()}
    for m in inner.modules():  # everything but the decoder layers lives on the device
        if id(m) not in in_layers:
            for name, p in m._parameters.items():
                if p is not None:
                    p.data = p.data.to(device)
            for name, b in m._buffers.items():
                if b is not None:
                    m._buffers[name] = b.to(device)
    if resident < len(layers):  # (pinning several GiB takes seconds: said before it starts)
        logger.info("layer swap: pinning %d of %d decoder layers in CPU memory", len(layers) - resident, len(layers))
    run.swap = swap = LayerSwap(layers, device, resident=resident, prefetch=run.settings.layer_swap_prefetch)
    on_unwrap(model, lambda: _let_go_of_layers(run))
    check_swapped_training(swap.trainable_swapped, run.streaming)
    claim_device_map(model, layers, device, swap.swapped_indices)
    if setting is None and device.type == "cuda" and run.settings.world_size == 1:
        # the planner's count is a prediction: the first full-size steps measure the peak and move layers to fit it
        run.fit = ResidencyFit(swap, run.plan.batch * run.plan.seq, steps=LAYER_SWAP_FIT_STEPS,
                               probe=CudaProbe(device, limit_bytes=gpu_limit_bytes(run.settings)), say=logger.info)
    stats = swap.memory_stats()
    logger.info("layer swap: %d of %d decoder layers on %s, %d in pinned CPU memory (%.2f GiB), "
                "%.2f GiB of GPU slots, prefetch %d", stats["resident_layers"], len(layers), device,
                stats["swapped_layers"], stats["host_bytes"] / 2**30, stats["gpu_slot_bytes"] / 2**30,
                swap.prefetch)


def _let_go_of_layers(run: RunState) -> None:
    """The layer swap lets go of the model (`wrap.unwrap`): its hooks removed, each swapped layer's weights left in
    (pinned) CPU memory, where `hf_device_map` says they are."""
    swap, run.swap, run.fit = run.swap, None, None
    if swap is not None:
        swap.offload_all()
        swap.synchronize()
        swap.remove()


def install_tiling(trainer, run: RunState) -> None:
    """`tiled_layers` and `tiled_mlp` as given, or as the plan decided (each said once): each decoder layer of a
    known structure run in tiles around its attention; each MLP in tiles (of the layers tiled whole too, where it
    then sees one tile, so that a layer of another structure still has its MLP tiled)."""
    tiled_layers, tiled_mlp = run.decided("tiled_layers"), run.decided("tiled_mlp")
    if not (tiled_layers or tiled_mlp):
        return
    layers = decoder_layers(base_model(trainer.model))
    if layers is None:
        return
    # (a module tiled already is left as it is: a train() after hand_back_model() tiles the modules again; said once)
    if tiled_layers:
        tile_decoder_layers(layers, MLP_TILE_TOKENS)
        n = sum(wrapped(m, TILED_LAYER_TAG) for m in layers)
        if run.first_time("tiled layers"):
            logger.info("tiled layers: %d of %d decoder layers run in tiles of %d tokens around their attention "
                        "(norms, projections, residuals and MLP; each tile recomputed in backward)", n, len(layers),
                        MLP_TILE_TOKENS)
            if n < len(layers):
                kinds = sorted({type(m).__name__ for m in layers if not wrapped(m, TILED_LAYER_TAG)})
                logger.warning("tiled layers: %s run whole (tiled layers know %s); their MLPs are tiled",
                               ", ".join(kinds), ", ".join(TILED_LAYER_CLASSES))
    n = tile_mlps(layers, MLP_TILE_TOKENS)
    if tiled_mlp and run.first_time("tiled mlp"):
        logger.info("tiled MLP: %d MLPs run in tiles of %d tokens, each recomputed in backward (their intermediate "
                    "activations exist for one tile at a time)", n, MLP_TILE_TOKENS)


def gpu_limit_bytes(settings) -> int | None:
    """What `gpu_memory_limit_gb` leaves the allocator on a card of that size (the CUDA context taken off, as the
    planner does: the per-process cap that emulates the card counts the allocator's memory only), in bytes."""
    gib = settings.gpu_memory_limit_gb
    return int((gib - Machine().cuda_context_gib) * 2**30) if gib else None


def device_state_bytes(run: RunState) -> int:
    """`offload_device_states` in bytes: 'auto' takes the planner's choice (none without a plan)."""
    value = run.settings.device_states
    if value == "auto":
        value = run.plan.device_state_gib if run.plan is not None and not run.sharded else 0.0
    return int(value * 2**30)


def streamed_optimizer(trainer, run: RunState, model=None):
    """The streamed AdamW over the Trainer's two parameter groups (decay, no decay), attached to the model, with the
    switches left unset decided by the plan; logged once. (The AdamW hyperparameters are the Trainer's own
    arguments, read as its own optimizer would.)"""
    if trainer.optimizer is not None:
        return trainer.optimizer
    s, args = run.settings, trainer.args
    model = model if model is not None else trainer.model
    decay = set(trainer.get_decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    accumulate = run.accumulation > 1
    speculative = s.clips and run.decided("speculative_clipping")
    on_device = device_state_bytes(run)
    offload_grads = gradients_offloaded(run.decided("offload_gradients"), asked=s.offload_gradients, clips=s.clips,
                                        accumulation=run.accumulation,
                                        swapped_trainable=run.swap is not None and run.swap.trainable_swapped)
    run.optimizer = opt = StreamedAdamW8bit(
        groups,  # both, also when one is empty: get_learning_rates() lists them as the Trainer's do
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
        bf16_stochastic_round=s.stochastic_rounding,
        update_in_backward=not s.clips,
        speculative=speculative,
        offload_gradients=offload_grads,
        chunk_numel=s.chunk_numel,
        inflight_chunks=s.inflight_chunks,
        sharding=Sharding() if run.sharded else None,
        fused=s.fused_update,
        device_state_bytes=on_device,
    )
    attach_optimizer(run, opt, model)
    opt.sync_weights()  # data parallel: every rank starts from rank 0's weights
    trainer.optimizer = opt
    mode = ("during backward, clipped to max_grad_norm speculatively (a step whose clip fires is rolled back and "
            "redone)" if speculative else "after backward, clipped to max_grad_norm" if s.clips else
            "during backward (no clipping)")
    if opt.offload_gradients:
        mode += "; gradients wait in host memory" + (" between micro-batches" if accumulate else "")
    logger.info("optimizer: AdamW, 8-bit states in %s memory, updates streamed %s%s",
                "pinned CPU" if opt.device.type == "cuda" else "CPU", mode,
                (f"; data parallel over {s.world_size} ranks, each holding its share of the states"
                 if run.sharded else "")
                + (f"; up to {opt.device_state_bytes / 2**30:.2f} GiB of them (the model's first "
                   f"tensors) kept on the GPU" if opt.device_state_bytes else ""))
    return opt


def attach_optimizer(run: RunState, opt, model) -> None:
    """The streamed optimizer's hooks on `model` (taken off again by `wrap.unwrap`), over the layer swap's layers."""
    opt.attach(model)
    on_unwrap(model, opt.detach)
    if run.swap is not None:
        opt.set_residency(run.swap.touch, ahead=run.swap.prefetch, swapped=run.swap.swaps)


def say_not_streaming(trainer, run: RunState, optimizer, model=None) -> None:
    """The Trainer's own optimizer runs (the streamed one does not: `streams_optimizer` says why): said once."""
    if run.not_streaming_why and run.first_time("not streaming"):
        m = model if model is not None else trainer.model
        weights = sum(p.numel() * p.element_size() for p in m.parameters()) / 2**30
        grads = sum(p.numel() * p.element_size() for p in m.parameters() if p.requires_grad) / 2**30
        logger.info("optimizer: %s, so the Trainer's own %s runs and nothing is offloaded: the %s holds the weights "
                    "(%.2f GiB), their gradients (%.2f GiB) and its states", run.not_streaming_why,
                    type(optimizer).__name__, "GPU" if trainer.args.device.type == "cuda" else trainer.args.device.type,
                    weights, grads)
