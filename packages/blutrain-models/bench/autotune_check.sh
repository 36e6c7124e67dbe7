#!/usr/bin/env bash
# GPT-2 step with blutrain-linalg's GEMM autotune off and on, interleaved (the machine's speed
# drifts between runs), next to torch eager from the same call. Wheels from .whl/ (see
# scripts/gpu.sh --prebuilt). Usage: bash bench/autotune_check.sh [MODES] [STEPS] [ROUNDS]
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
MODES=${1:-bf16}; STEPS=${2:-30}; ROUNDS=${3:-2}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl .whl/bt/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/packages/blutrain-models/python
# Each arm its own algorithm cache: a persisted cache is read with autotune off too.
H=BLUTRAIN_CACHE_DIR=$OUT/cache_heuristic
T=BLUTRAIN_CACHE_DIR=$OUT/cache_tuned
B=packages/blutrain-models/bench/bench_gpt2.py
one() {  # label, framework, mode, extra env...
  local label=$1 fw=$2 mode=$3; shift 3
  local r; r=$(env "$@" python3 $B --worker "$fw" --mode "$mode" --steps "$STEPS" --warmup 3 \
    2>>"$OUT/autotune_stderr.log" | grep '^RESULT ' | cut -c8-)
  python3 -c "import json,sys; r=json.loads(sys.argv[1] or '{}'); print(f\"{sys.argv[2]:28s} {sys.argv[3]:5s} {r.get('tokens_per_s',0):10,.0f} tok/s {r.get('step_ms',0):7.2f} ms {r.get('peak_bytes',0)/2**30:6.2f} GiB  gpu/step {r.get('gpu_step_ms','')}\", r.get('error',''))" "$r" "$label" "$mode"
}
# SM clock and power every 50 ms (read only): do the clocks drop under a sustained step loop?
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 50 >"$OUT/smi.csv" 2>/dev/null &
SMI=$!
for mode in ${MODES//,/ }; do
  # the first tuned run fills the cache (its warm-up steps do the timing)
  one "tune (fills cache)" ours+graph "$mode" $T BLUTRAIN_LINALG_OPTIONS=autotune=1,autotune_log=1
  for r in $(seq "$ROUNDS"); do
    one "graph, heuristic" ours+graph "$mode" $H
    one "graph, autotuned" ours+graph "$mode" $T BLUTRAIN_LINALG_OPTIONS=autotune=1
    one "eager, heuristic" ours "$mode" $H
    one "eager, autotuned" ours "$mode" $T BLUTRAIN_LINALG_OPTIONS=autotune=1
    one "torch eager" torch "$mode"
  done
done 2>&1 | tee "$OUT/autotune_table.txt"
kill $SMI 2>/dev/null
grep -c "picked" "$OUT/autotune_stderr.log"
python3 - "$OUT/smi.csv" <<'PY'
import sys, collections
rows = [l.split(", ") for l in open(sys.argv[1]) if l.count(",") >= 5]
busy = [r for r in rows if float(r[3].split()[0]) > 300]  # under load (W)
if busy:
    clk = sorted(int(r[1].split()[0]) for r in busy)
    pw = sorted(float(r[3].split()[0]) for r in busy)
    print(f"under load ({len(busy)} samples of {len(rows)}): SM MHz min {clk[0]} median "
          f"{clk[len(clk)//2]} max {clk[-1]}; W median {pw[len(pw)//2]:.0f} max {pw[-1]:.0f}")
    print("throttle reasons:", collections.Counter(r[5].strip() for r in busy).most_common(4))
PY
prof() {  # label, mode, cache env: where a graph step's GPU time goes, kernels split by grid
  BT_PROFILE_GRID=1 BT_PROFILE_NAME_CHARS=60 env "$3" python3 $B --worker ours+graph --mode "$2" \
    --steps 10 --warmup 3 --profile 1 2>>"$OUT/autotune_stderr.log" | grep '^RESULT ' \
    | cut -c8- >"$OUT/profile_$2_$1.json"
  python3 -c "
import json,sys
r=json.load(open(sys.argv[1])); ks=r.get('kernels',[])
print(sys.argv[2], 'graph', round(r.get('tokens_per_s',0)), 'tok/s; kernel ms/step', round(sum(k[1] for k in ks),3))
for k in ks[:int(sys.argv[3])]: print(f'{k[1]:8.4f} ms {k[2]:6.1f}x  {k[0]}')" "$OUT/profile_$2_$1.json" "$2 $1" "${PROFILE_TOP:-30}"
}
if [ "${PROFILE:-0}" != 0 ]; then
  for mode in ${MODES//,/ }; do prof tuned "$mode" "$T"; prof heuristic "$mode" "$H"; done
fi 2>&1 | tee "$OUT/profile_table.txt"
