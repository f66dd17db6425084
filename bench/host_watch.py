"""The least host memory available while a command runs: MemAvailable of /proc/meminfo sampled every 0.2 s, its
minimum written (GiB) to FILE at each new low -- so a run that the kernel kills still leaves its figure.

    python3 bench/host_watch.py FILE &      # kill it when the run is done
"""
import sys
import time


def available_gib() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) / 2**20 for line in f if line.startswith("MemAvailable:"))


def main() -> None:
    low = float("inf")
    while True:
        now = available_gib()
        if now < low:
            low = now
            with open(sys.argv[1], "w") as f:
                f.write(f"{low:.2f}\n")
        time.sleep(0.2)


if __name__ == "__main__":
    main()
