"""Image-text finetuning of a vision-language model (a tiny Mllama) through the command: records with image parts and
an `images` list, the processor's batch, loss on the assistant turns only (checked token by token), and a sentence
naming the row for an image that is missing, unreadable or not matched to an image part."""
import json

import numpy as np
import pytest
import torch

from cli_cases import log_to_current_stderr, stderr_of
from offload_trainer import cli

COLOURS = {"red": [255, 0, 0], "green": [0, 255, 0], "blue": [0, 0, 255]}


def record(i: int, image: str, colour: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": f"It is {colour}."}]}],
            "images": [image]}


def write_data(tmp_path, n: int = 12, records=None):
    from PIL import Image

    recs = []
    for i in range(n):
        colour = list(COLOURS)[i % 3]
        Image.fromarray((np.ones((20 + i, 30, 3)) * COLOURS[colour]).astype("uint8")).save(tmp_path / f"img{i}.png")
        recs.append(record(i, f"img{i}.png", colour))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (records or recs)))
    return data


def config(tmp_path, data, **extra) -> str:
    body = {"model_config": "tiny-mllama", "torch_dtype": "float32", "dataset_path": str(data), "max_seq_length": 64,
            "output_dir": str(tmp_path / "out"), "max_steps": 8, "per_device_train_batch_size": 4,
            "learning_rate": 3e-3, "logging_steps": 4, "save_strategy": "no", "report_to": "none",
            "offload_optimizer": True, **extra}
    path = tmp_path / "c.yaml"
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in body.items()))
    return str(path)


def train(tmp_path, capsys, cfg) -> tuple[int, str]:
    log_to_current_stderr()
    return cli.main(["train", cfg]), stderr_of(capsys)


@pytest.mark.slow
def test_a_tiny_vision_language_model_trains_through_the_command(tmp_path, capsys):
    rc, err = train(tmp_path, capsys, config(tmp_path, write_data(tmp_path)))
    assert rc == 0, err[-3000:]
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    losses = [h["loss"] for h in state["log_history"] if "loss" in h]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert "image-text records; loss on the assistant turns" in err


def test_labels_are_the_assistant_turns_token_by_token(tmp_path):
    from offload_trainer.cli.run_args import DataArguments, ModelArguments
    from offload_trainer.data import build_image_text, build_processor, data_collator
    from offload_trainer.models import architecture_config, load_tokenizer

    cfg = architecture_config("tiny-mllama")
    tok = load_tokenizer(ModelArguments(model_config="tiny-mllama"))
    processor = build_processor(cfg, tok)
    args = DataArguments(dataset_path=str(write_data(tmp_path, 3)), max_seq_length=64)
    train, _ = build_image_text(args, config=cfg)
    batch = data_collator(args, tok, processor, train)([train[i] for i in range(3)])
    assert batch["pixel_values"].shape[:3] == (3, 1, cfg.vision_config.max_num_tiles)
    assert batch["cross_attention_mask"].shape[:3] == (3, batch["input_ids"].shape[1], 1)
    for b, colour in enumerate(["red", "green", "blue"]):
        ids, labels = batch["input_ids"][b], batch["labels"][b]
        trained = ids[labels != -100].tolist()
        assert trained == tok(f"It is {colour}.<|endoftext|>\n", add_special_tokens=False)["input_ids"]
        assert torch.equal(labels[labels != -100], ids[labels != -100])
        assert cfg.image_token_index in ids.tolist() and cfg.image_token_index not in trained


def test_full_finetune_with_layer_swap_and_activation_offload(tmp_path, capsys):
    """The 11B-Vision config's path at tiny size: every weight trains (streamed 8-bit AdamW), decoder layers swapped,
    layer inputs offloaded."""
    cfg = config(tmp_path, write_data(tmp_path), layer_swap=2, activation_checkpointing=True,
                 activation_offload=True, max_grad_norm=0.0, max_steps=4, logging_steps=2)
    rc, err = train(tmp_path, capsys, cfg)
    assert rc == 0, err[-3000:]
    assert "layer swap" in err.lower() and "8-bit states" in err, err[-3000:]
    losses = [h["loss"] for h in json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"]
              if "loss" in h]
    assert len(losses) == 2 and losses[1] < losses[0], losses


def test_a_frozen_vision_tower_records_no_graph_and_the_adapters_the_same_gradients(tmp_path):
    """LoRA on the language model: the frozen vision tower runs without autograd (nothing saved for backward, the image
    features need no grad), and the adapters' gradients equal those of the tower run with autograd (as
    enable_input_require_grads made it); an unfrozen projector, or tower, still trains."""
    from offload_trainer.cli.run_args import DataArguments, ModelArguments
    from offload_trainer.data import build_image_text, build_processor, data_collator
    from offload_trainer.models import architecture_config, load_model, load_tokenizer

    cfg = architecture_config("tiny-mllama")
    margs = ModelArguments(model_config="tiny-mllama", torch_dtype="float32", lora_r=4, lora_alpha=8,
                           lora_target_modules="all-linear")
    tok = load_tokenizer(margs)
    args = DataArguments(dataset_path=str(write_data(tmp_path, 2)), max_seq_length=64)
    train, _ = build_image_text(args, config=cfg)
    batch = data_collator(args, tok, build_processor(cfg, tok), train)([train[i] for i in range(2)])

    def grads(model, frozen_path=True):
        inner = model.get_base_model()
        inner.enable_input_require_grads()  # what peft and the Trainer do for checkpointing: vision embeddings too
        tower = inner.model.vision_model
        if not frozen_path:
            del tower.forward  # (the class's forward: autograd on, as before)
        saved, features = [], []
        inner.model.multi_modal_projector.register_forward_hook(lambda m, i, o: features.append(o.requires_grad))

        def pack(t):
            saved.append(t.numel())
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        tower.register_forward_pre_hook(lambda *a: hooks.__enter__())
        tower.register_forward_hook(lambda *a: hooks.__exit__(None, None, None))
        model.zero_grad()
        model(**batch).loss.backward()
        return sum(saved), features[0], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    torch.manual_seed(0)
    model = load_model(margs)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    saved, needs_grad, got = grads(model)
    model.load_state_dict(state)
    saved_before, needed_before, want = grads(model, frozen_path=False)
    assert saved == 0 and not needs_grad  # nothing recorded in the tower
    assert saved_before > 0 and needed_before  # what enable_input_require_grads made of it
    assert got.keys() == want.keys() and got and all("lora" in n for n in got)
    assert all(torch.allclose(got[n], want[n], atol=1e-6) for n in got)

    for part in ("multi_modal_projector", "vision_model"):
        torch.manual_seed(0)
        model = load_model(margs)
        module = getattr(model.get_base_model().model, part)
        next(module.parameters()).requires_grad_(True)
        _, _, grad = grads(model)
        assert any(part in n for n in grad), part


@pytest.mark.parametrize("case, needle", [
    ("image-missing", "row 2: image 'nowhere.png' does not exist"),
    ("image-unreadable", "row 2: image 'broken.png' cannot be read as an image"),
    ("image-part-without-image", "row 2: 1 image part(s) in messages but 0 image(s) in images"),
    ("image-as-a-number", "row 2: image 7 (int) is neither a path nor an image"),
])
def test_bad_image_records_name_the_row(case, needle, tmp_path, capsys, no_model_load):
    data = write_data(tmp_path, 3)
    recs = [json.loads(line) for line in data.read_text().splitlines()]
    if case == "image-missing":
        recs[1]["images"] = ["nowhere.png"]
    elif case == "image-as-a-number":
        recs[1]["images"] = [7]
    elif case == "image-unreadable":
        (tmp_path / "broken.png").write_text("not an image")
        recs[1]["images"] = ["broken.png"]
    else:
        recs[1]["images"] = []
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    rc, err = train(tmp_path, capsys, config(tmp_path, data))
    assert rc == 2 and needle in err, err[-2000:]


def test_data_image_text_records_that_train_no_token(tmp_path, caplog):
    """A record whose answer's role is misspelt trained nothing, silently (the collator trains the assistant turns
    only): a warning names how many and the first; when none has an assistant turn, the error."""
    from offload_trainer.cli.run_args import DataArguments
    from offload_trainer.data import DataError, build_image_text

    data = write_data(tmp_path, 3)
    recs = [json.loads(line) for line in data.read_text().splitlines()]
    recs[1]["messages"][1]["role"] = "assistent"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with caplog.at_level("WARNING", logger="offload_trainer"):
        train, _ = build_image_text(DataArguments(dataset_path=str(data)), config=None)
    assert len(train) == 3
    assert ("1 of 3 records train no token (the first: row 2: only messages whose role is 'assistant' are trained, "
            "and its roles are ['user', 'assistent'])") in caplog.text
    for r in recs:
        r["messages"][1]["role"] = "gpt"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(DataError, match=r"no record trains a token \(the first: row 1: .* its roles are \['user', "
                                        r"'gpt'\]\); fix the data"):
        build_image_text(DataArguments(dataset_path=str(data)), config=None)


def test_random_image_text_rows_train(tmp_path, capsys):
    """`dataset_path: random` for a vision-language model: random tokens and images (the throughput check)."""
    rc, err = train(tmp_path, capsys, config(tmp_path, "random", random_num_samples=8, max_steps=2))
    assert rc == 0, err[-3000:]


def test_lora_with_layer_swap_trains_the_language_model_only(tmp_path, capsys):
    """The 90B-Vision config's path at tiny size: LoRA on every linear layer of the language model (the vision
    encoder frozen) with the decoder layers swapped; the saved adapters name no vision module."""
    cfg = config(tmp_path, write_data(tmp_path), lora_r=4, lora_alpha=8, lora_target_modules="all-linear",
                 layer_swap=2, activation_checkpointing=True, activation_offload=True, max_steps=4, logging_steps=2,
                 learning_rate=1e-2)
    rc, err = train(tmp_path, capsys, cfg)
    assert rc == 0, err[-3000:]
    assert "layer swap" in err.lower(), err[-3000:]
    from safetensors.torch import load_file

    names = list(load_file(tmp_path / "out" / "adapter_model.safetensors"))
    assert names and not [n for n in names if "vision" in n or "multi_modal_projector" in n], names[:5]
    assert any("cross_attn" in n for n in names) and any("self_attn" in n for n in names)
    losses = [h["loss"] for h in json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"]
              if "loss" in h]
    assert len(losses) == 2 and losses[1] < losses[0], losses
