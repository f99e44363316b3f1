#!/usr/bin/env bash
# Every benchmark figure of stage two and of speculative decoding in one command on one H200,
# most important first, inside ~9 minutes, from the project root: bash bench/run_all.sh
# `bash bench/run_all.sh extract` runs stage one's benchmarks instead, `flex` the two
# `--compile flex` settings, `kernels` the flex_attention backward configurations (each set
# under ten minutes).
# Writes $OUT/<name>.json per run, $OUT/logs/<name>.log, $OUT/status.txt; prints a table last.
# Each run gets the smaller of its own cap and what is left of BENCH_BUDGET_S (default 520 s);
# a run that would start with less than 30 s left is skipped and listed as such.
# BENCH_TINY=1 runs the same sequence on the CPU with the tiny shapes, sdpa and few steps: a
# check that the scripts work end to end, not a measurement.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$OUT/logs"
: >"$OUT/status.txt"

# A GPU host without zarr, numcodecs, webdataset or flash-linear-attention (and no package
# registry) can bring them as wheels in .device-wheels/: installed beside the project.
if compgen -G ".device-wheels/*.whl" >/dev/null; then
  if python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .device-wheels/*.whl; then
    export PYTHONPATH=/tmp/site:$PWD
  else
    echo "the carried wheels do not install here; using this Python's packages"
  fi
fi
export PYTHONUNBUFFERED=1
BUDGET=${BENCH_BUDGET_S:-520}
WORK=${BENCH_WORKDIR:-/tmp/dflash-bench}
mkdir -p "$WORK"

if [ "${BENCH_TINY:-0}" = 1 ]; then
  S8=tiny; S27=tiny-hybrid; FLEX=sdpa; MODEL=none; CFLEX=none; TOK8=20000; TOK27=10000
  STEPS=(--steps 2 --warmup 1); SPEC=(--context 64,128 --repeats 3 --warmup 1)
  BUDGET=${BENCH_BUDGET_S:-1200}
else
  S8=qwen3-8b; S27=qwen3.6-27b; FLEX=flex; MODEL=model; CFLEX=flex; TOK8=1200000; TOK27=250000
  STEPS=(--steps 15 --warmup 4); SPEC=(--context 1024,4096 --repeats 15 --warmup 3)
fi

# bench NAME CAP SCRIPT ARGS...: one benchmark process under `timeout`, its JSON to $OUT.
bench() {
  local name=$1 cap=$2 script=$3
  shift 3
  local left=$((BUDGET - SECONDS - 10))
  if [ "$left" -lt 30 ]; then
    echo "$name: skipped, ${left}s of the budget left" | tee -a "$OUT/status.txt"
    return
  fi
  local limit=$((cap < left ? cap : left)) start=$SECONDS
  timeout -k 10 "$limit" python3 "bench/$script" "$@" --json "$OUT/$name.json" \
    >"$OUT/logs/$name.log" 2>&1
  local rc=$?
  local how=ok
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && how="timed out at ${limit}s"
  [ "$rc" != 0 ] && [ "$how" = ok ] && how="failed (rc $rc), see logs/$name.log"
  echo "$name: $how, $((SECONDS - start))s (t=${SECONDS}s)" | tee -a "$OUT/status.txt"
  [ "$rc" != 0 ] && tail -n 5 "$OUT/logs/$name.log"
  return 0
}

case "${1:-train}" in
extract)
  # Extraction vs the pure forward of the same batches, parts written to local disk. Long enough
  # (about 40 s of 8B forward) that the last part's drain after the last forward weighs little.
  bench extract-8b 240 extract_bench.py --shape $S8 --tokens $TOK8 --out "$WORK/x8"
  bench extract-27b 270 extract_bench.py --shape $S27 --tokens $TOK27 --out "$WORK/x27"
  # The writers' cost to a thread launching torch ops (GIL contention), CPU only.
  bench gil 90 gil_bench.py --threads 4,8,12 --repeats 3 --seconds 2 --out "$WORK"
  ;;
kernels)
  # flex_attention backward block configurations of one drafter layer (GPU only).
  if [ "${BENCH_TINY:-0}" = 1 ]; then
    echo "kernels: skipped, flex_bench.py needs a GPU" | tee -a "$OUT/status.txt"
  else
    bench flex-27b 200 flex_bench.py --shape $S27
    bench flex-8b 200 flex_bench.py --shape $S8
  fi
  ;;
flex)
  # --compile flex also compiles the BlockMask builder: over three minutes before the first step.
  bench train-8b-$FLEX-$CFLEX 260 train_bench.py --shape $S8 --attention $FLEX --compile $CFLEX "${STEPS[@]}"
  bench train-27b-$FLEX-$CFLEX 260 train_bench.py --shape $S27 --attention $FLEX --compile $CFLEX "${STEPS[@]}"
  ;;
train)
  # The product default (flex + compiled drafter) first: the MFU goal and "the default is best".
  bench train-8b-$FLEX-$MODEL 200 train_bench.py --shape $S8 --attention $FLEX --compile $MODEL "${STEPS[@]}"
  bench train-8b-sdpa-none 60 train_bench.py --shape $S8 --attention sdpa --compile none "${STEPS[@]}"
  # Streaming from disk vs in memory, default setting (its compile hits Inductor's on-disk cache).
  bench datapath-8b 150 datapath_bench.py --shape $S8 --attention $FLEX --compile $MODEL "${STEPS[@]}"
  bench speculate-8b 60 speculate_bench.py --shape $S8 "${SPEC[@]}"
  bench train-27b-$FLEX-$MODEL 200 train_bench.py --shape $S27 --attention $FLEX --compile $MODEL "${STEPS[@]}"
  # The offline ratio reuses the 27B drafter step just measured on this GPU (no second compile).
  bench offline-27b 150 offline_bench.py --shape $S27 --attention $FLEX --compile $MODEL \
    --drafter-json "$OUT/train-27b-$FLEX-$MODEL.json" "${STEPS[@]}"
  bench speculate-27b 120 speculate_bench.py --shape $S27 "${SPEC[@]}"
  bench train-27b-sdpa-none 70 train_bench.py --shape $S27 --attention sdpa --compile none "${STEPS[@]}"
  ;;
*)
  echo "usage: bash bench/run_all.sh [train|flex|kernels|extract]" >&2
  exit 2
  ;;
esac
rm -rf "$WORK"

python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
paths = sorted(out.glob("*.json"), key=lambda p: p.stat().st_mtime)  # the order they ran in
runs = [json.loads(p.read_text()) | {"name": p.stem} for p in paths]
f = lambda v, n=1: "-" if v is None else f"{v:.{n}f}"
if any(r["bench"] == "train" for r in runs):
    print(f"\n{'train':<22} {'first s':>7} {'step ms':>8} {'ctx tok/s':>9} {'TFLOP/s':>7} "
          f"{'MFU':>5} {'MFU need':>8} {'peak GB':>7}")
for r in (r for r in runs if r["bench"] == "train"):
    print(f"{r['name']:<22} {f(r['first_step_s']):>7} {f(r['step_ms']):>8} "
          f"{f(r['context_tok_s'], 0):>9} {f(r['tflops'], 0):>7} {f(100 * r['mfu']):>4}% "
          f"{f(100 * r['mfu_needed']):>7}% {f(r['peak_gpu_GB']):>7}"
          + ("  (default)" if r["is_default"] else ""))
for r in (r for r in runs if r["bench"] == "extract"):
    print(f"extract {r['shape']}: extraction / forward {r['ratio']:.3f} (goal >= 0.95; "
          f"{r['ratio_before_drain']:.3f} until the last forward, device waited "
          f"{r['device_waited_for_writers_s']:.1f} s for writers), "
          f"{r['extract_tok_s']:,.0f} vs {r['forward_tok_s']:,.0f} tok/s, "
          f"{r['disk_bytes_per_token'] / 1e3:.1f} KB/token on disk (random weights), "
          f"{r['disk_MB_s']:,.0f} MB/s, host RSS {r['peak_host_rss_GB']:.1f} GB, "
          f"{r['writer_threads']} writer threads")
    h = r.get("host_during_extraction") or {}
    if h:
        print(f"  host while extracting: {h['busy_cores_mean']} cores busy on average "
              f"(10th percentile {h['busy_cores_p10']}), disk {h['write_GB_s_mean']} GB/s "
              f"(max {h['write_GB_s_max']}), dirty cache up to {h['dirty_GB_max']} GB")
for r in (r for r in runs if r["bench"] == "gil"):
    for g in r["runs"]:
        print(f"gil: with {g['writer_threads']} writer threads a torch-op loop runs at "
              f"{g['ratio']:.3f} of its speed alone (writers {g['raw_GB_s']:.2f} GB/s raw)")
for r in (r for r in runs if r["bench"] == "flex"):
    print(f"\nflex_attention, one {r['shape']} drafter layer, q {r['q_shape']}, kv {r['kv_shape']}:")
    for row in r["rows"]:
        if "error" in row:
            print(f"  {row['config']:<26} failed: {row['error'][:80]}")
        else:
            print(f"  {row['config']:<26} forward {row['fwd_ms']:.2f} ms, forward + backward "
                  f"{row['fwd_bwd_ms']:.2f} ms, backward vs default {row['bwd_vs_default']:.3f}")
for r in (r for r in runs if r["bench"] == "datapath"):
    print(f"\ndatapath {r['shape']}: streaming / in-memory {r['ratio']:.3f} (goal >= 0.97), "
          f"data wait {100 * r['data_wait_fraction']:.1f}%, {r['stream_step_ms']:.0f} vs "
          f"{r['memory_step_ms']:.0f} ms, {r['workers']} workers, "
          f"{r['disk_bytes_per_token'] / 1e3:.1f} KB/token on disk")
for r in (r for r in runs if r["bench"] == "offline"):
    print(f"\noffline {r['shape']}: online / offline step {r['ratio']:.2f}x (target "
          f"{r['target_ms_per_sequence']:.0f} ms per sequence, drafter {r['drafter_step_ms']:.0f}"
          f" ms, co-resident {r['co_resident']})")
for r in (r for r in runs if r["bench"] == "speculate"):
    for c in r["contexts"]:
        ups = " ".join(f"{t}:{v:.2f}" for t, v in c["speedup"].items())
        print(f"speculate {r['shape']} ctx {c['context']}: draft {c['draft_ms']:.1f} ms, verify "
              f"{c['verify_ms']:.1f} ms, step {c['step_ms']:.1f} ms; speedup by tau {ups}")
print("\n" + (out / "status.txt").read_text())
EOF
