#!/usr/bin/env bash
# Write speed of the disk under DIR, for comparison with what extraction must write:
#   bash bench/disk_write.sh DIR
# 8 GiB of incompressible bytes (1 GiB held in /dev/shm), once as 8 files written in turn
# through the page cache and then synced, once as 8 concurrent streams through the page cache
# and then synced (extraction's disk queue writes so, with 4 threads), once as 8 concurrent
# O_DIRECT streams: the second against the third tells what direct writes would add.
set -euo pipefail
dir=${1:?usage: bash bench/disk_write.sh DIR}
src=/dev/shm/disk_write_src.$$
trap 'kill $(jobs -p) 2>/dev/null || true; wait || true; rm -f "$src" "$dir"/disk_write_[wd].$$.*' EXIT
df -h "$dir" | tail -1
if ! dd if=/dev/urandom of="$src" bs=16M count=64 status=none; then
    echo "could not hold 1 GiB in /dev/shm (df -h /dev/shm)" >&2
    exit 1
fi
s=$(date +%s.%N)
for i in $(seq 8); do cat "$src" > "$dir/disk_write_w.$$.$i"; done
sync
e=$(date +%s.%N)
python3 -c "print('8 GiB written+synced: %.2f GB/s' % (8 * 2**30 / ($e - $s) / 1e9))"
rm -f "$dir"/disk_write_w.$$.*
# 8 concurrent streams of the source, `dd` given "$@"; then synced; prints GB/s after label $1.
streams() {
    local label=$1 s e pid pids=()
    shift
    s=$(date +%s.%N)
    for i in $(seq 8); do
        dd if="$src" of="$dir/disk_write_d.$$.$i" bs=16M status=none "$@" & pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; done  # a failed stream fails the script
    sync
    e=$(date +%s.%N)
    python3 -c "print('$label: %.2f GB/s' % (8 * 2**30 / ($e - $s) / 1e9))"
    rm -f "$dir"/disk_write_d.$$.*
}
streams "8 GiB in 8 streams, synced"
streams "8 GiB direct, 8 streams" oflag=direct
