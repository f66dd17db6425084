"""The least host memory available while a command runs: MemAvailable of /proc/meminfo sampled every 0.2 s, its
minimum written (GiB) to FILE at each new low -- so a run that the kernel kills still leaves its figure.

    python3 bench/runs/host_watch.py FILE &      # kill it when the run is done
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from offload_trainer.sysinfo import proc_gib  # noqa: E402  (nothing heavy: torch only inside its GPU function)


def main() -> None:
    low = float("inf")
    while True:
        now = proc_gib("/proc/meminfo", "MemAvailable")
        if now < low:
            low = now
            with open(sys.argv[1], "w") as f:
                f.write(f"{low:.2f}\n")
        time.sleep(0.2)


if __name__ == "__main__":
    main()
