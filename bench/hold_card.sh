# Sourced by the device scripts: `hold_card` holds all but 23.5 GiB of the GPU in another process (a real 24 GB card:
# .gpu/hold_gpu_memory.py, a copy of ../shared/gpu/hold_gpu_memory.py), waits for its READY line and sets $hold, the
# process to kill when the held rows are done.
hold_card() {
  python3 .gpu/hold_gpu_memory.py 23.5 --seconds 3000 > /tmp/hold.log 2>&1 &
  hold=$!
  for _ in $(seq 60); do grep -q READY /tmp/hold.log && break; sleep 1; done
  cat /tmp/hold.log
}
