#!/usr/bin/env bash
# Issue 38's aim over many seeds, in one GPU call: setting B of bench/convergence.py (GPT-2 124M,
# B2 x T256, 1000 steps, 50 warmup steps) for each seed, every run of a seed from one initial state
# and one batch stream (--seed S --init-seed S), then bench/gpu_bf16_table.py --across over the
# seeds that finished. One seed ranks nothing (ours:fp32 sits as far from torch:fp32 as either bf16
# run, from summation order alone), so many are needed.
#
# Setting B's steps are small (512 tokens): one process leaves the GPU idle most of the time, so
# JOBS processes run seeds side by side. The runs' numbers do not depend on that (no autotuning,
# no timing-dependent choices); only tok/s does, and this script's tok/s are not a speed figure.
# PyTorch's runs repeat bit for bit from call to call; ours' do not (float atomics in CUDA kernels,
# session 55: a rerun of 13 seeds moved ours:tf32's table slightly): --extra "--device cuda
# --deterministic" makes them repeat, and a rerun is otherwise another sample of the same noise.
# JSON and logs land in $OUT/seeds: on the GPU machine, tar them there (only 8 files come back).
#
#   bash packages/blutrain-models/bench/conv_seeds.sh [--seeds "5 6 7"] [--jobs 8]
#        [--runs LIST] [--budget SECONDS] [--steps N]
#   --seeds   seeds to run, in order (default 1..16)
#   --jobs    processes at once (default 8)
#   --runs    convergence.py runs of each seed (default: torch and ours in fp32, tf32 and bf16)
#   --budget  seconds for the whole script (default 540): a seed is not started when less time is
#             left than the median finished seed took (or 60 s), a seed still running at the end
#             is stopped and left out of the table
#   --steps   steps per run (default 1000; fewer for a smoke run)
#   --baseline-dir DIR  an earlier call's conv_b_seedS.json files (this script's, finished or
#             stopped): a seed reruns only the runs its file lacks, and its JSON holds them all
#   --extra   more convergence.py arguments (they win over the above), e.g. "--device cpu --model tiny --compact-vocab"
# PyTorch's runs of seeds 1-64 are kept in bench/baselines/conv_b_seeds (session 49: seeds 1-13 on
# an H100, 15-16 on an H200, 14 both; session 51: seeds 17-24 on an H100; session 54: 25-48 on an
# H100; session 55: torch:tf32 of seeds 1-31, with ours:tf32 in conv_b_seeds_ours, 16 seeds in
# 338-345 s with 16 processes; session 59: 49-64 on an H100, with ours' runs; session 61:
# torch:bf16 alone of 65-88, H100; session 62: torch:bf16 alone of 89-150, H100; session 63:
# torch:bf16 alone of 151-240, H100; session 64: torch:fp32 of 65-84, H100, 8 seeds with 8
# processes in about 200 s and 12 with 12 in 304 s; session 65: torch:fp32 of 85-92, 8 with 8 in
# 368 s, beside ours:fp32 of 65-72, 8 with 8 in 330 s), so a change to ours needs only its own runs
# (ours:bf16 is about 4 s of GPU a seed; torch:fp32 takes 195 s with 8 processes sharing an
# H100, 408 s with 16, so new seeds need a call of their own):
#   bash packages/blutrain-models/bench/conv_seeds.sh --runs torch:fp32,torch:bf16,ours:bf16 \
#     --baseline-dir packages/blutrain-models/bench/baselines/conv_b_seeds
# (session 53, one H100, --jobs 16: ours:bf16 of 24 seeds in 166 s; ours:fp32 of 16 seeds beside
# ours:bf16 in 446 s; session 54, --jobs 12 beside four probe processes: torch:bf16 and ours:bf16
# of 24 seeds in 491 s; session 57, ours:fp32 alone: 16 seeds in 325 s.)  New seeds with all
# four runs: two calls side by side, each with its own OUT, one for PyTorch's runs and one for
# ours' (a process runs its runs one after the other; gpu_bf16_table.py --across merges the two
# files of a seed):
#   OUT=$OUT/t bash .../conv_seeds.sh --seeds "$S" --jobs 8 --runs torch:fp32,torch:bf16 &
#   OUT=$OUT/o bash .../conv_seeds.sh --seeds "$S" --jobs 8 --runs ours:fp32,ours:bf16 & wait
# (session 59, one H100: 8 seeds in 481 s, ours' side in 423 s).  The paired final val alone
# (the figure issue 38's bf16 aim misses) needs only the cheap pair, torch:bf16 on one side and
# ours:bf16 on the other, the same way: about 22% of a seed's four runs in session 59's
# process-seconds (an estimate); measured in session 61 (one H100, 8 processes a side, 512 s):
# PyTorch's side 24 seeds in 450 s, ours' 42 in 473 s, so about 19 s of wall time a paired seed,
# PyTorch's side the bottleneck. Session 62 (one H100, --jobs 12 for PyTorch's side, 4 for
# ours'): PyTorch's 36 seeds in 469 s, ours' 24 in 488 s, so a process takes about 155 s for a
# PyTorch seed and 80 s for ours': --jobs 11 and 5 balance the sides, about 15 s a paired seed.
# Session 63 (one H100, --jobs 10 and 6, three calls of 453-473 s): 30 paired seeds a call.
# gpu_bf16_table.py --across counts such a seed in the paired final val only, and names apart
# (in no figure) a seed with one side alone.  Ours' runs of seeds
# 1-64 (1-24 at 2e21f52; 25-48's ours:bf16 at 54b3ad6, the same compiled code, their ours:fp32 in
# session 57; 49-64 in session 59, session 57's compiled code; 65-240's ours:bf16 in sessions 61
# to 64, the same C++ as session 57's, clang-formatted in 63 with identical SASS; 65-72's
# ours:fp32 in session 65, session 63's wheels) are kept in
# bench/baselines/conv_b_seeds_ours, to set a later ours beside (gpu_bf16_table.py --across
# merges a seed's files); they are not a --baseline-dir for a change to ours, whose runs must
# rerun.
# Needs the packages importable (PYTHONPATH, as gpu_bf16.sh sets it). JSON and logs go to
# $OUT/seeds (default ./out/seeds).
set -uo pipefail
cd "$(dirname "$0")/../../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
DIR=$OUT/seeds
mkdir -p "$DIR"
PY=${PYTHON:-python3}
SEEDS=$(seq -s ' ' 1 16) JOBS=8 BUDGET=540 STEPS=1000 EXTRA="--device cuda" BASE=""
RUNS=torch:fp32,torch:bf16,ours:bf16,ours:fp32,torch:tf32,ours:tf32
while [ $# -gt 0 ]; do
  case "$1" in
    --seeds) SEEDS=$2; shift ;;
    --jobs) JOBS=$2; shift ;;
    --runs) RUNS=$2; shift ;;
    --budget) BUDGET=$2; shift ;;
    --steps) STEPS=$2; shift ;;
    --extra) EXTRA=$2; shift ;;
    --baseline-dir) BASE=$2; shift ;;
    *) echo "conv_seeds.sh: unknown argument $1 (--seeds LIST, --jobs N, --runs LIST, --budget SECONDS, --steps N, --baseline-dir DIR, --extra ARGS)"; exit 2 ;;
  esac
  shift
done
START=$(date +%s)
DEADLINE=$(( START + BUDGET - 15 ))  # 15 s for the table
MIN_LEFT=${CONV_SEEDS_MIN_LEFT:-60}  # s: a seed with less time left is not started
TOOK=$DIR/.seed_seconds  # how long each finished seed took, one line each
rm -f "$TOOK"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} PYTHONUNBUFFERED=1

one_seed() {  # seed: runs it if it can finish by the deadline; the run stops at the deadline
  local s=$1 left=$(( DEADLINE - $(date +%s) )) median
  # A seed that cannot finish in the time left is not started: stopped at the deadline its runs
  # are lost, and they hold the GPU until then (session 54: 8 seeds stopped after 143 s, when
  # each of the 16 before them had taken 408 s).  The median finished seed is the estimate: the
  # quickest was too hopeful where the load changes (session 62, PyTorch's side: 10 seeds started
  # with 136-145 s left, the quickest finished seed having taken 130 s and the median over 150;
  # all 10 were stopped at the deadline).
  median=$(sort -n "$TOOK" 2>/dev/null |
    awk '{t[NR] = $1} END {if (NR) print t[int((NR + 1) / 2)]}')
  if [ "$left" -lt "$MIN_LEFT" ] || { [ -n "$median" ] && [ "$left" -lt "$median" ]; }; then
    echo "seed $s: not started ($left s left${median:+; the median seed took $median s})"
    return
  fi
  local t0 runs=$RUNS base=() old=${BASE:+$BASE/conv_b_seed$s.json}
  t0=$(date +%s)
  if [ -n "$old" ] && [ -f "$old" ]; then  # only the runs the earlier call did not finish
    runs=$($PY -c "import json, sys; have = json.load(open(sys.argv[1]))['runs']
print(','.join(r for r in sys.argv[2].split(',') if r not in have))" "$old" "$RUNS")
    if [ -z "$runs" ]; then cp "$old" "$DIR/"; echo "seed $s: every run in $old"; return; fi
    base=(--baseline "$old")
  fi
  # shellcheck disable=SC2086  # EXTRA: several arguments
  timeout "$left" $PY packages/blutrain-models/bench/convergence.py \
    --runs "$runs" -B 2 -T 256 --steps "$STEPS" --warmup 50 --eval-batches 16 \
    --seed "$s" --init-seed "$s" --checkpoints "" --json "$DIR/conv_b_seed$s.json" "${base[@]}" $EXTRA \
    >"$DIR/conv_b_seed$s.log" 2>&1
  local rc=$? took=$(( $(date +%s) - t0 ))
  [ $rc = 0 ] && echo "$took" >>"$TOOK"
  echo "seed $s: rc $rc, $took s$( [ $rc = 124 ] && echo ' (stopped at the deadline)')"
  [ $rc = 0 ] || [ $rc = 124 ] || tail -5 "$DIR/conv_b_seed$s.log"
}
export -f one_seed
export DIR PY RUNS STEPS DEADLINE EXTRA BASE MIN_LEFT TOOK
# shellcheck disable=SC2086  # SEEDS: a list
printf '%s\n' $SEEDS | xargs -P "$JOBS" -I{} bash -c 'one_seed {}'

done_json=()
for s in $SEEDS; do
  f=$DIR/conv_b_seed$s.json
  # a finished seed's JSON has its summary; a stopped one's holds only the runs that ended
  if [ -f "$f" ] && $PY -c "import json,sys; sys.exit('summary' not in json.load(open('$f')))"; then
    done_json+=("$f")
  fi
done
echo "conv_seeds.sh: ${#done_json[@]} seeds finished in $(( $(date +%s) - START )) s"
[ ${#done_json[@]} -gt 0 ] && $PY packages/blutrain-models/bench/gpu_bf16_table.py --across "${done_json[@]}"
