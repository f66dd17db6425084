"""Layer swap against the unswapped model: identical losses, gradients and weights (CPU; `gpu` on CUDA)."""
import contextlib
import copy

import pytest
import torch

from helpers import tiny_setup
from offload_trainer.engine.optim import StreamedAdamW8bit
from offload_trainer.engine.swap import LayerSwap, spread_swapped

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def test_spread_swapped():
    assert spread_swapped(8, 4) == [1, 3, 5, 7]
    assert spread_swapped(6, 2) == [2, 5]
    assert spread_swapped(4, 0) == []
    assert spread_swapped(4, 4) == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        spread_swapped(4, 5)


def setup(device, layers=6, dtype=torch.float32, hidden=None):
    model, _, train = tiny_setup(layers=layers)
    model.to(dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    swapped = copy.deepcopy(model)
    model.to(device)
    batches = [{k: torch.stack([train[i + j][k] for j in range(2)]).to(device) for k in train[0]}
               for i in range(0, 16, 2)]
    return model, swapped, batches


def install(model, device, resident, prefetch):
    model.model.embed_tokens.to(device)
    model.model.norm.to(device)
    model.model.rotary_emb.to(device)
    model.lm_head.to(device)
    return LayerSwap(model.model.layers, device, resident=resident, prefetch=prefetch)


def optimizers(ref, model, swap, model_kw=None, **kw):
    """The same streamed optimizer for the unswapped reference and the swapped model (bound to the swap)."""
    ref_opt = StreamedAdamW8bit(ref.parameters(), **kw)
    opt = StreamedAdamW8bit(model.parameters(), **kw, **(model_kw or {}))
    ref_opt.attach(ref)
    opt.attach(model)
    opt.set_residency(swap.touch, ahead=swap.prefetch)
    return ref_opt, opt


def watch_residency(model, swap):
    """Count, for every run of a swapped layer's MLP (forward, and recompute in backward), whether its weights
    were in a slot; on CPU the host copies hold the same values, so only this shows a missed fetch."""
    seen = {"fwd": 0, "bwd": 0, "missed": 0}

    def check(i):
        def hook(module, args):
            seen["bwd" if torch._C._current_autograd_node() is not None else "fwd"] += 1
            if swap._layers[i].slot is None:
                seen["missed"] += 1
        return hook

    for i in swap.swapped_indices:
        model.model.layers[i].mlp.register_forward_pre_hook(check(i))
    return seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefetch", [0, 1])
def test_swapped_gradients_are_identical(device, prefetch):
    ref, model, batches = setup(device)
    swap = install(model, device, resident=2, prefetch=prefetch)
    assert swap.swapped_indices == [1, 2, 4, 5]
    seen = watch_residency(model, swap)
    for batch in batches[:2]:
        for m in (ref, model):
            m.zero_grad()
            m(**batch).loss.backward()
        for (name, a), b in zip(ref.named_parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad.to(device)), name
    # eval under no_grad walks the layers in forward order only
    with torch.no_grad():
        assert torch.equal(ref(**batches[2]).logits, model(**batches[2]).logits)
    assert seen["fwd"] >= 8 and seen["bwd"] == 8 and seen["missed"] == 0  # recomputes ran on fetched weights
    stats = swap.memory_stats()
    assert stats["swapped_layers"] == 4 and stats["resident_layers"] == 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("clip", [False, True], ids=["update_in_backward", "exact_clip"])
@pytest.mark.slow
def test_full_finetune_with_streamed_optimizer_matches_unswapped(device, clip):
    """Swapped layers are updated in their slots and copied back; the next fetch sees the new weights."""
    ref, model, batches = setup(device)
    swap = install(model, device, resident=2, prefetch=0)  # 2 slots for 4 swapped layers: evictions every pass
    ref_opt, opt = optimizers(ref, model, swap, lr=1e-2, update_in_backward=not clip, offload_gradients=clip,
                              chunk_numel=4096, inflight_chunks=2, bf16_stochastic_round=False)
    train_both_and_compare(ref, model, ref_opt, opt, swap, batches, clip, device)
    assert swap.stats["d2h_bytes"] > 0  # changed layers were copied back


def train_both_and_compare(ref, model, ref_opt, opt, swap, batches, clip, device, before_step=None):
    """Train the reference and the swapped model on `batches` (clipping at 0.5 with `clip`; `before_step(k)` first
    at each step): the same losses, falling, and the same weights at the end, bit for bit."""
    losses = {id(ref): [], id(model): []}
    for k, batch in enumerate(batches):
        if before_step is not None:
            before_step(k)
        for m, o in ((ref, ref_opt), (model, opt)):
            loss = m(**batch).loss
            loss.backward()
            if clip:
                o.clip_grad_norm_(0.5)
            o.step()
            o.zero_grad()
            losses[id(m)].append(loss.item())
    ref_opt.synchronize()  # (weights are read next: the last step's updates are queued and run first)
    opt.synchronize()
    swap.synchronize()
    assert losses[id(ref)] == losses[id(model)]
    assert losses[id(ref)][-1] < losses[id(ref)][0]
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b.to(device)), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow
def test_exact_clipping_updates_swapped_layers_where_their_forward_fetches_them(device):
    """With clipping, step() leaves the updates of swapped layers to the next forward, whose prefetch brings each
    layer into a slot anyway: no layer is fetched for its update alone. Same losses and weights as the unswapped
    model, in bf16; on the GPU with stochastic rounding (the small tensors' updates, queued by step() itself, find
    their weights on the GPU). On CPU without it: there every update takes torchao's, which draws from the global
    RNG, so step() queues them all."""
    ref, model, batches = setup(device, dtype=torch.bfloat16)
    swap = install(model, device, resident=2, prefetch=1)
    for i in swap.swapped_indices:  # trained vectors stay on the GPU; matrices live in the host copy
        layer = model.model.layers[i]
        assert layer.input_layernorm.weight.device.type == device
        assert swap._layers[i].slot is not None or layer.mlp.up_proj.weight.device.type == "cpu"
    ref_opt, opt = optimizers(ref, model, swap, lr=1e-2, offload_gradients=True, chunk_numel=4096, inflight_chunks=2,
                              bf16_stochastic_round=device == "cuda")
    losses = {id(ref): [], id(model): []}
    for step, batch in enumerate(batches[:4]):
        for m, o in ((ref, ref_opt), (model, opt)):
            torch.manual_seed(step)  # the same stochastic rounding for both models
            loss = m(**batch).loss
            loss.backward()
            o.clip_grad_norm_(0.5)
            o.step()
            o.zero_grad()
            losses[id(m)].append(loss.item())
    reloads = swap.stats["reloads_for_update"]  # (before synchronize() queues the last step's remaining updates)
    ref_opt.synchronize()
    opt.synchronize()
    swap.synchronize()
    assert reloads == 0
    assert losses[id(ref)] == losses[id(model)]
    assert losses[id(ref)][-1] < losses[id(ref)][0]
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b.to(device)), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("clip", [False, True], ids=["update_in_backward", "exact_clip"])
@pytest.mark.slow
def test_accumulation_sums_swapped_gradients_on_the_host(device, clip):
    """3 micro-batches per step: the swapped model's gradients wait summed in pinned memory between them (none
    left on the device), against the unswapped model accumulating on the device as autograd does."""
    ref, model, batches = setup(device)
    swap = install(model, device, resident=2, prefetch=1)
    ref_opt, opt = optimizers(ref, model, swap, model_kw=dict(offload_gradients=True), lr=1e-2,
                              update_in_backward=not clip, chunk_numel=4096, inflight_chunks=2,
                              bf16_stochastic_round=False)
    swapped = [p for i in swap.swapped_indices for p in model.model.layers[i].parameters() if opt._states.is_8bit(p)]
    losses = {id(ref): [], id(model): []}
    for step in range(2):
        for m, o in ((ref, ref_opt), (model, opt)):
            for micro, batch in enumerate(batches[3 * step:3 * step + 3]):
                with o.no_update() if micro < 2 else contextlib.nullcontext():
                    loss = m(**batch).loss / 3
                    loss.backward()
                losses[id(m)].append(loss.item())
                if m is model and micro < 2:
                    assert swapped and all(p.grad is None for p in swapped)
            if clip:
                o.clip_grad_norm_(0.5)
            o.step()
            o.zero_grad()
    ref_opt.synchronize()
    opt.synchronize()
    swap.synchronize()
    assert losses[id(ref)] == losses[id(model)]
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b.to(device)), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow
def test_speculative_clipping_of_swapped_layers_equals_exact_clipping_unswapped(device):
    """Speculative clipping with 4 of 6 layers swapped (2 slots: evictions every pass) against exact clipping of the
    unswapped model: a swapped layer is backed up and updated in its slot, restored there on a rollback, and copied
    back; the clip fires on some steps and not on others. fp32: no stochastic rounding, so every streamed tensor's
    update is speculative on CPU too."""
    from offload_trainer.engine.optim.speculation import ClipPolicy

    ref, model, batches = setup(device)
    probe = copy.deepcopy(ref)
    norms = []
    for batch in batches:  # norms of an unclipped run: clip at their median
        probe(**batch).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(probe.parameters(), 1e9)))
        probe.zero_grad()
    max_norm = sorted(norms)[len(norms) // 2]
    swap = install(model, device, resident=2, prefetch=0)
    kw = dict(lr=1e-3, chunk_numel=4096, inflight_chunks=2, bf16_stochastic_round=False)
    ref_opt = StreamedAdamW8bit(ref.parameters(), offload_gradients=True, **kw)
    opt = StreamedAdamW8bit(model.parameters(), speculative=True, clip_policy=ClipPolicy(to_exact=10**9), **kw)
    ref_opt.attach(ref)
    opt.attach(model)
    opt.set_residency(swap.touch, ahead=swap.prefetch, swapped=swap.swaps)
    ref_norms = []
    for batch in batches:
        loss = ref(**batch).loss
        loss.backward()
        ref_norms.append(float(ref_opt.clip_grad_norm_(max_norm)))
        ref_opt.step()
        ref_opt.zero_grad()
        got = model(**batch).loss
        got.backward()
        assert float(opt.clip_grad_norm_(max_norm, redo=lambda: model(**batch).loss.backward())) == ref_norms[-1]
        opt.step()
        opt.zero_grad()
        assert got.item() == loss.item()
    ref_opt.synchronize()
    opt.synchronize()
    swap.synchronize()
    clipped = sum(max_norm / (n + 1e-6) < 1 for n in ref_norms)  # (torch's coefficient under 1)
    assert 0 < clipped < len(batches) and opt._spec.counts["redone"] == clipped
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b.to(device)), name


def test_state_dict_tensors_do_not_share_storage(tmp_path):
    ref, model, _ = setup("cpu", layers=4)
    install(model, "cpu", resident=1, prefetch=0)
    model.save_pretrained(tmp_path)  # refuses (or silently drops) tensors that share storage
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for (name, a), b in zip(ref.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("device", DEVICES)
def test_lora_swaps_frozen_weights_only(device):
    from peft import LoraConfig, get_peft_model

    ref, model, batches = setup(device, layers=4)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    ref = get_peft_model(ref, cfg)
    torch.manual_seed(1)
    for n, p in ref.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)  # non-zero so the base weights matter for the adapters' grads
    model = get_peft_model(model, cfg)
    model.load_state_dict({k: v.cpu() for k, v in ref.state_dict().items()})
    inner = model.get_base_model()
    swap = install(inner, device, resident=1, prefetch=1)
    seen = watch_residency(inner, swap)
    adapters = [p for p in model.parameters() if p.requires_grad]
    assert all(p.device.type == torch.device(device).type for p in adapters)  # adapters stay on the device
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (ref, model)]
    for batch in batches[:6]:
        losses = []
        for m, o in zip((ref, model), opts):
            loss = m(**batch).loss
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1]
    assert swap.stats["d2h_bytes"] == 0  # frozen weights are never copied back
    assert seen["bwd"] > 0 and seen["missed"] == 0


def test_qlora_4bit_base_swaps_with_its_quantization_state():
    """bitsandbytes NF4 weights and their QuantState (absmax, code, nested state) move as one layer."""
    pytest.importorskip("bitsandbytes")

    from offload_trainer.engine.loss import chunked_causal_lm_loss
    from offload_trainer.models import architecture_config

    cfg = architecture_config("tiny-llama", {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4})
    cfg._attn_implementation, cfg.use_cache = "sdpa", False
    model, inner = qlora(cfg, "all-linear", task_type="CAUSAL_LM")
    ids = torch.randint(0, 512, (2, 32))

    def grads():
        model.zero_grad()
        loss = chunked_causal_lm_loss(inner.model(input_ids=ids)[0], ids, inner.lm_head.weight, chunk_size=16)
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    ref = grads()
    swap = LayerSwap(inner.model.layers, "cpu", resident=1, prefetch=0)
    seen = watch_residency(inner, swap)
    got = grads()
    assert ref[0] == got[0] and all(torch.equal(ref[1][k], got[1][k]) for k in ref[1])
    assert seen["bwd"] == 3 and seen["missed"] == 0
    refs = next(iter(swap._layers.values())).refs
    assert any(r.kind == "attr" and r.name == "absmax" for r in refs)  # the quantization state travels too


def test_vision_language_qlora_swaps_both_kinds_of_decoder_layer():
    """Mllama (Llama-3.2-Vision) structure: NF4 base, LoRA on the language model, its self- and cross-attention
    layers swapped (two slot pools) while an image flows through the vision encoder: the same grads."""
    pytest.importorskip("bitsandbytes")

    from offload_trainer.engine.loss import chunked_causal_lm_loss
    from offload_trainer.data.vision import random_image_text_batch
    from offload_trainer.models import architecture_config

    cfg = architecture_config("tiny-mllama")
    cfg._attn_implementation = "sdpa"
    cfg.text_config.use_cache = False
    model, inner = qlora(cfg, r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)")
    batch = random_image_text_batch(cfg, 2, 24, generator=torch.Generator().manual_seed(1))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("language_model" in n for n in trained)

    def grads():
        model.zero_grad()
        h = inner.model(**batch)[0]
        loss = chunked_causal_lm_loss(h, batch["input_ids"], inner.lm_head.weight, chunk_size=16)
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    ref = grads()
    cross = [n for n in trained if ".layers.1." in n and "cross_attn" in n]
    assert cross and all(ref[1][n].abs().sum() > 0 for n in cross)  # the image reaches the loss
    layers = inner.model.language_model.layers
    swap = LayerSwap(layers, "cpu", resident=2, prefetch=1)
    assert len(swap._pools) == 2  # self-attention and cross-attention layers differ in shape
    seen = {"missed": 0}

    def check(i):
        def hook(module, args):
            seen["missed"] += swap._layers[i].slot is None
        return hook

    for i in swap.swapped_indices:
        layers[i].mlp.register_forward_pre_hook(check(i))
    got = grads()
    assert ref[0] == got[0] and all(torch.equal(ref[1][k], got[1][k]) for k in ref[1])
    assert swap.swapped_indices == [1, 3, 4]  # both cross-attention layers and a self-attention one
    assert seen["missed"] == 0 and swap.stats["loads"] >= 3


def qlora(cfg, targets: str, **lora_kw):
    """A random-init NF4 base with LoRA r=4 on `targets`, B matrices non-zero (so the base weights matter for the
    adapters' gradients), checkpointed, in train mode. Returns (peft model, base model)."""
    from peft import LoraConfig, get_peft_model

    from offload_trainer.models import random_init_4bit

    torch.manual_seed(0)
    model = get_peft_model(random_init_4bit(cfg, "cpu"), LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                                    **lora_kw))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model, model.get_base_model()
