#!/usr/bin/env bash
# A / B of our GPT-2 step under environment settings, the arms interleaved over rounds (the
# machine's speed drifts between runs), one subprocess each (bench_gpt2.py --worker):
#   bash bench/ab_step.sh MODE FRAMEWORK STEPS ROUNDS "label|VAR=x VAR2=y|--arg v" "label|..." ...
# e.g. ab_step.sh tf32 ours+graph 10 2 "split|BT_ATTN_TF32_FUSED=0" "dq-atomic|"
#      ab_step.sh bf16 ours+graph 10 2 "heuristic||--gemm-autotune off" "tuned||"
# An arm may run another build: BENCH=path in its variables picks that build's bench_gpt2.py, and
# PYTHONPATH its packages, e.g. the code before a change (a `git worktree` of the old commit, its
# wheels from its scripts/build_wheels.sh installed with `pip install --target SITE`), with
#   M=OLD/packages/blutrain-models
#   ab_step.sh bf16 ours+graph 10 2 "old|PYTHONPATH=SITE:$M/python BENCH=$M/bench/bench_gpt2.py|" new
# Needs the packages importable (scripts/gpu.sh --prebuilt, or PYTHONPATH). Rows go to stdout
# and $OUT/ab_MODE.txt, each arm's worker result to $OUT/ab_MODE_LABEL_rROUND.json (with
# "--profile N" among an arm's args, its kernels: bench/profile_diff.py compares two arms);
# the workers' stderr to $OUT/ab_stderr.log.
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
MODE=$1 FW=$2 STEPS=$3 ROUNDS=$4; shift 4
B=packages/blutrain-models/bench/bench_gpt2.py
for r in $(seq "$ROUNDS"); do
  for arm in "$@"; do
    IFS='|' read -r label vars args <<<"$arm"
    bench=$B
    for v in $vars; do [[ $v == BENCH=* ]] && bench=${v#BENCH=}; done
    res=$(env $vars python3 $bench --worker "$FW" --mode "$MODE" --steps "$STEPS" --warmup 3 $args \
      2>>"$OUT/ab_stderr.log" | grep '^RESULT ' | cut -c8-)
    [ -n "$res" ] && printf '%s\n' "$res" >"$OUT/ab_${MODE}_${label}_r${r}.json"
    python3 -c "
import json, sys
r = json.loads(sys.argv[1] or '{}')
g = r.get('gpu_step_ms', {})
print(f\"{sys.argv[2]:5s} {sys.argv[3]:12s} {sys.argv[4]:14s} {r.get('tokens_per_s', 0):10,.0f} tok/s \"
      f\"{r.get('step_ms', 0):7.2f} ms  gpu first/median/last {g.get('first')}/{g.get('median')}/\"
      f\"{g.get('last')}  {r.get('peak_bytes', 0) / 2**30:.2f} GiB\", r.get('error', ''))
" "$res" "$MODE" "$FW" "$label" | tee -a "$OUT/ab_$MODE.txt"
  done
done
