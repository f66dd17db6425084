"""Every float32 in [-1, 1], both of torchao's 8-bit maps: the fused kernel's two-lookup quantizer
(`update_kernel.quantize_with_table`) against torchao's `quantize_8bit_with_qmap`. Prints the mismatch counts.

    python bench/mechanisms/quantizer_exhaustive.py      # ~20 min on one CPU core; run 2026-11-30 at 0bd893b: [0, 0]
"""
import time

import torch
from torchao.optim.quant_utils import quantize_8bit_with_qmap

from offload_trainer.engine.optim.kernel import default_tables, quantize_with_table


def main() -> None:
    torch.set_num_threads(1)
    qmaps, signed, unsigned = default_tables()
    one = 0x3F800000  # the bits of 1.0: every non-negative float32 up to 1.0 is a bit pattern below it
    bad, t0, step = [0, 0], time.time(), 1 << 23
    for sign in (0, 1):
        for start in range(0, one + 1, step):
            bits = torch.arange(start, min(start + step, one + 1), dtype=torch.int64) - sign * 2**31
            x = bits.to(torch.int32).view(torch.float32)  # with sign: the same magnitudes, negative (-0.0 .. -1.0)
            for i, (q, t) in enumerate(((qmaps[:256], signed), (qmaps[256:], unsigned))):
                bad[i] += int((quantize_8bit_with_qmap(x, q) != quantize_with_table(x, t)).sum())
        print(f"sign {sign}: {time.time() - t0:.0f} s, mismatches (signed map, unsigned map) {bad}", flush=True)


if __name__ == "__main__":
    main()
