"""The quick-start notebook runs top to bottom (short runs: QUICKSTART_STEPS)."""
import os

import pytest

nbformat = pytest.importorskip("nbformat")  # (the test extra has them; the GPU machine's environment does not)
NotebookClient = pytest.importorskip("nbclient").NotebookClient

# (one xdist worker runs both SmolLM2 tests: the session fixture converts the model once per worker)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("smollm2")]
HERE = os.path.dirname(os.path.abspath(__file__))


def test_quickstart_notebook_executes(tmp_path, monkeypatch, smollm2_dir):
    os.symlink(smollm2_dir, tmp_path / "smollm2-135m")  # the notebook's `example-model` finds it converted
    monkeypatch.setenv("QUICKSTART_STEPS", "8")
    monkeypatch.setenv("QUICKSTART_ROOT", os.path.join(HERE, ".."))
    monkeypatch.setenv("QUICKSTART_OUT", str(tmp_path))
    nb = nbformat.read(os.path.join(HERE, "..", "notebooks", "01_quickstart.ipynb"), as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": os.path.join(HERE, "..", "notebooks")}}).execute()
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # tiny loss + throughput, SmolLM2 loss
    assert (tmp_path / "smollm2-sft" / "merged" / "config.json").exists()
