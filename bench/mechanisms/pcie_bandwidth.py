"""Pinned host <-> GPU copy bandwidth, each direction alone and both at once, for host buffers pinned the two ways
the package can pin them: cudaHostRegister on a plain allocation (streams.pinned_empty) and PyTorch's caching host
allocator (pin_memory=True).

    python bench/mechanisms/pcie_bandwidth.py [--gib 2] [--reps 5]
"""
import argparse
import json
import time

import torch

from offload_trainer.engine.streams import pinned_empty


def timed(fn, reps):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    n = int(a.gib * 2**30)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(n, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    out = {}
    for how in ("registered", "caching_allocator"):
        if how == "registered":
            h1, h2 = pinned_empty(n, torch.uint8, pin=True), pinned_empty(n, torch.uint8, pin=True)
        else:
            h1, h2 = torch.empty(n, dtype=torch.uint8, pin_memory=True), torch.empty(n, dtype=torch.uint8,
                                                                                      pin_memory=True)
        h1.fill_(1)
        h2.fill_(2)

        def h2d():
            with torch.cuda.stream(s1):
                dev.copy_(h1, non_blocking=True)

        def d2h():
            with torch.cuda.stream(s2):
                h2.copy_(dev2, non_blocking=True)

        def both():
            h2d()
            d2h()

        t_h2d, t_d2h, t_both = timed(h2d, a.reps), timed(d2h, a.reps), timed(both, a.reps)
        out[how] = {"h2d_gb_s": round(n / t_h2d / 1e9, 1), "d2h_gb_s": round(n / t_d2h / 1e9, 1),
                    "both_each_gb_s": round(n / t_both / 1e9, 1), "pinned": bool(h1.is_pinned())}
    print("PCIE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
