import os

# Before torch is imported: torchao's optimizers compile at every new shape (32-54 s each on 2 CPU cores);
# the tests run them eagerly, except the ones marked `compile`.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# MKL (torch's CPU BLAS) may pick its code path per call by alignment and load, so the same matmul can differ in
# the last bits between runs: the data-parallel tests, which compare processes bit for bit, failed about 1 run in 5
# (also before stop 16). Conditional numerical reproducibility makes it repeatable (inherited by spawned ranks).
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
# Under pytest-xdist (the README's `-n 2`) each worker computes on one thread, and the processes tests start inherit
# it: two workers of two OpenMP threads each on a 2-core machine spin against each other and ran the suite slower than
# one process did.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# The tests mirror the package (tests/optim/, tests/planner/, tests/data/); their shared helpers live here, in tests/.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Without a GPU, Triton kernels (when Triton is installed) run in its interpreter on CPU tensors: read at import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def no_model_load(monkeypatch):
    import offload_trainer.models as models

    def boom(*a, **k):
        raise AssertionError("weights were loaded before the error was reported")

    monkeypatch.setattr(models, "load_model", boom)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step tiny run with checkpoint-1 and checkpoint-2 (copied by the checkpoint rows)."""
    from cli_cases import Case, log_to_current_stderr
    from offload_trainer import cli

    tmp = tmp_path_factory.mktemp("trained")
    case = Case(tmp)
    log_to_current_stderr()
    assert cli.main(["train", str(case.config)]) == 0
    return case.out


