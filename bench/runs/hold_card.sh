# Sourced by the device scripts. `hold_card` holds all but 23.5 GiB of the GPU in another process (a real 24 GB card:
# .gpu/hold_gpu_memory.py, a copy of ../shared/gpu/hold_gpu_memory.py), waits for its READY line and sets $hold, the
# process to kill when the held rows are done.
hold_card() {
  python3 .gpu/hold_gpu_memory.py 23.5 --seconds 3000 > /tmp/hold.log 2>&1 &
  hold=$!
  until_ready /tmp/hold.log 60
}
# `until_ready LOG SECONDS`: wait for a hold's READY line in LOG (at most SECONDS), then show the log.
until_ready() {
  for _ in $(seq "$2"); do grep -q READY "$1" && break; sleep 1; done
  cat "$1"
}
# `hold_host LEAVE`: hold the host's RAM (locked pages) until only LEAVE GiB stay available (57: a 64 GB machine;
# .gpu/hold_host_memory.py, a copy of ../shared/gpu/hold_host_memory.py), wait for its READY line, set $host_hold.
hold_host() {
  python3 .gpu/hold_host_memory.py "$1" --seconds 3000 > /tmp/host_hold.log 2>&1 &
  host_hold=$!
  until_ready /tmp/host_hold.log 180
}
