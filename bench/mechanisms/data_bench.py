"""Tokenizing and packing a large jsonl of chat records: wall time and peak RSS, the command's data path before
(`--impl old`: the hand-written reader of an earlier commit, Python lists in memory) and after (`--impl new`:
`datasets`, memory-mapped Arrow, cached).

    python bench/mechanisms/data_bench.py make --mb 1000 --out /tmp/chat-1g.jsonl
    python bench/mechanisms/data_bench.py run --path /tmp/chat-1g.jsonl --impl new --num-proc 2   # one JSON row
    python bench/mechanisms/data_bench.py all --mb 100 1000 --old-mb 100 --rows bench/results/<date>-data.json

Each measurement runs in a process of its own (`all` starts them), so its peak RSS (VmHWM) is its own; `new` runs
twice on the same file, the second time from the cache. The tokenizer is the built-in one (512 tokens: about 3
characters a token, so more tokens per GB than a real tokenizer would make, the harder case).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

OLD_COMMIT = "867bd16"  # the last commit with the hand-written data.py
WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be or has had "
         "not but what all when can there one been if would who will more no out so said up about into than them "
         "could some time may only other new these two first any like very after our well also even most").split()


def make(mb: int, out: str, seed: int = 0) -> None:
    rng = random.Random(seed)
    target = mb * 2**20
    with open(out, "w") as f:
        while f.tell() < target:
            turns = []
            for k in range(rng.choice((2, 4, 6))):
                n = rng.randint(20, 250)
                turns.append({"role": "user" if k % 2 == 0 else "assistant",
                              "content": " ".join(rng.choice(WORDS) for _ in range(n))})
            f.write(json.dumps({"messages": turns}) + "\n")


def status_gib(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 2**20


def peak_rss_gib() -> float:
    """VmHWM: the peak of resident memory, the pages of memory-mapped files it has read included (the kernel can drop
    those at any time; they are counted while they stay)."""
    return status_gib("VmHWM")


class AnonPeak:
    """The peak of RssAnon (memory of the process's own: Python objects, buffers), sampled every 50 ms."""

    def __init__(self):
        import threading

        self.peak, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, status_gib("RssAnon"))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, status_gib("RssAnon"))


def old_module():
    """data.py as of OLD_COMMIT, imported inside the package (its relative imports resolve)."""
    import importlib.util

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    src = subprocess.run(["git", "show", f"{OLD_COMMIT}:offload_trainer/data.py"], capture_output=True, text=True,
                         check=True, cwd=root).stdout
    path = os.path.join(tempfile.mkdtemp(), "old_data.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("offload_trainer._old_data", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclasses look their module up there)
    spec.loader.exec_module(mod)
    return mod


def run(path: str, impl: str, num_proc: int | None, seq: int) -> dict:
    from offload_trainer.cli.run_args import DataArguments, ModelArguments
    from offload_trainer.models import load_tokenizer

    tok = load_tokenizer(ModelArguments(model_config="tiny-llama"))
    anon = AnonPeak()
    t0 = time.perf_counter()
    if impl == "old":
        from types import SimpleNamespace

        mod = old_module()  # (its arguments had these fields)
        old_args = SimpleNamespace(dataset_path=path, max_seq_length=seq, text_field="text", eval_fraction=0.0)
        train, _ = mod.build_datasets(old_args, tok, vocab_size=512)
        tokens = sum(int(b["input_ids"].numel()) for b in train.blocks)
    else:
        import datasets

        datasets.disable_progress_bars()
        from offload_trainer.data import build_datasets

        train, _ = build_datasets(DataArguments(dataset_path=path, max_seq_length=seq, dataset_num_proc=num_proc),
                                  tok, vocab_size=512)
        import pyarrow.compute as pc

        table = train.data.table  # (rows' tokens, padding included, as the old blocks'; from the offsets alone)
        tokens = int(pc.sum(pc.list_value_length(table.column("input_ids"))).as_py())
    wall = time.perf_counter() - t0
    return {"impl": impl, "rows": len(train), "row_tokens": tokens, "wall_s": round(wall, 1),
            "peak_rss_gib": round(peak_rss_gib(), 3), "peak_anon_gib": round(anon.stop(), 3), "num_proc": num_proc}


def row(result: dict, mb: int, commit: str, run_id: str, second: dict | None = None) -> dict:
    cores = os.cpu_count()
    return {"run_id": run_id, "commit": commit, "machine": f"CPU x{cores} cores (no GPU)", "model": "tiny-llama",
            "method": "data", "system": f"data_{result['impl']}", "gpus": 0, "gpu_cap_gib": None,
            "seq_len": 2048, "micro_batch": None, "grad_accum": None, "tokens_per_step": None,
            "tok_per_s": round(result["row_tokens"] / result["wall_s"]), "step_s_median": None,
            "peak_alloc_gib": None, "peak_reserved_gib": None, "host_peak_gib": result["peak_rss_gib"],
            "pinned_gib": None, "error": result.get("error"),
            "extra": {"file_mb": mb, **result, **({"cached_second_run": second} if second else {})}}


def measure(path: str, impl: str, num_proc: int | None, seq: int, env: dict) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "run", "--path", path, "--impl", impl, "--seq", str(seq)]
    if num_proc:
        cmd += ["--num-proc", str(num_proc)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        return {"impl": impl, "error": (r.stderr.strip().splitlines() or ["failed"])[-1][:200], "row_tokens": 0,
                "wall_s": 1, "peak_rss_gib": None}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--mb", type=int, required=True)
    m.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--path", required=True)
    r.add_argument("--impl", choices=("old", "new"), required=True)
    r.add_argument("--num-proc", type=int, default=None)
    r.add_argument("--seq", type=int, default=2048)
    a = sub.add_parser("all")
    a.add_argument("--mb", type=int, nargs="+", required=True)
    a.add_argument("--old-mb", type=int, nargs="*", default=[])
    a.add_argument("--num-proc", type=int, default=2)
    a.add_argument("--rows", required=True)
    a.add_argument("--dir", default=tempfile.gettempdir())
    args = p.parse_args()
    if args.cmd == "make":
        return make(args.mb, args.out)
    if args.cmd == "run":
        print(json.dumps(run(args.path, args.impl, args.num_proc, args.seq)))
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "offload_trainer"], capture_output=True, text=True).stdout
    commit += "+dirty" if dirty.strip() else ""
    run_id = time.strftime("%Y%m%d-data-%H%M")
    cache = tempfile.mkdtemp(dir=args.dir, prefix="hf-datasets-")
    env = {**os.environ, "HF_DATASETS_CACHE": cache, "HF_DATASETS_OFFLINE": "1"}
    rows = []
    for mb in sorted(set(args.mb) | set(args.old_mb)):
        path = os.path.join(args.dir, f"chat-{mb}mb.jsonl")
        if not os.path.exists(path):
            make(mb, path)
        if mb in args.old_mb:
            rows.append(row(measure(path, "old", None, 2048, env), mb, commit, run_id))
            print(json.dumps(rows[-1]["extra"]), flush=True)
        if mb in args.mb:
            first = measure(path, "new", args.num_proc, 2048, env)
            second = measure(path, "new", args.num_proc, 2048, env)
            rows.append(row(first, mb, commit, run_id, second))
            print(json.dumps(rows[-1]["extra"]), flush=True)
    with open(args.rows, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
