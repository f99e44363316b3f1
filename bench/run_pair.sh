#!/usr/bin/env bash
# Both benchmark sets at once on a host with two GPUs: stage two and decoding
# (`run_all.sh train`) on GPU 0, stage one (`run_all.sh extract`) on GPU 1, each process tree
# pinned to its own half of the cores, with its own scratch folder. Each half sees what a
# one-GPU host with half the cores would give, except for the shared disk and memory bandwidth.
# Results: $OUT/train/ and $OUT/extract/ as run_all.sh writes them; both tables printed last.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/bench-out}
cores=$(nproc)
half=$((cores / 2))
if [ "$half" -lt 1 ]; then
  echo "run_pair.sh needs at least two cores" >&2
  exit 2
fi
mkdir -p "$OUT/train" "$OUT/extract"
OUT=$OUT/train CUDA_VISIBLE_DEVICES=0 BENCH_WORKDIR=/tmp/dflash-bench-train \
  taskset -c "0-$((half - 1))" bash bench/run_all.sh train >"$OUT/train/table.txt" 2>&1 &
OUT=$OUT/extract CUDA_VISIBLE_DEVICES=1 BENCH_WORKDIR=/tmp/dflash-bench-extract \
  taskset -c "$half-$((cores - 1))" bash bench/run_all.sh extract >"$OUT/extract/table.txt" 2>&1 &
wait
echo "== stage two and decoding (GPU 0, cores 0-$((half - 1)))"
cat "$OUT/train/table.txt"
echo "== stage one (GPU 1, cores $half-$((cores - 1)))"
cat "$OUT/extract/table.txt"
