#!/usr/bin/env bash
# Issue 38 on one GPU, in one call (about 3-4 min): does the bf16 policy's float32 residual
# stream (GPT2.residual_dtype "float32", the model's default; convergence.py's ours:bf16) train
# like fp32?
#   1. the GPU tests of the mixed kernels (layer_norm / add_layer_norm with a float32 stream in
#      and a bf16 / fp16 output) and of the bf16 policy against autocast and float64;
#   2. bench/convergence.py, ours:bf16 (in A with an unfused control), in issue 38's two
#      settings against the PyTorch runs of call 1 (bench/baselines/*.json: no PyTorch reruns):
#        A: B16 x T1024, 300 steps (the issue's setting, which overfits)
#        B: B2 x T256, 1000 steps (does not overfit)
#   3. one table: ours bf16 next to torch bf16, both against torch fp32;
#   4. with --speed N: the float32 stream's cost, bench/ab_step.sh bf16 ours+graph, N rounds of
#      --residual-dtype float32 / compute / float32 with --residual-grad-dtype float32
#      interleaved (about 25 s a worker: N=2 takes ~150 s)
#
#   bash packages/blutrain-models/bench/gpu_bf16.sh [--budget SECONDS] [--runs LIST] [--runs-a LIST]
#        [--limit-a SECONDS] [--extra-a "ARGS"] [--seeds-a "S1 S2"] [--runs-seeds LIST] [--speed N]
#   --budget  seconds this script may take (default 240): a part that cannot finish in what is
#             left is skipped and says so
#   --runs    ours runs of convergence.py in B (default ours:bf16; e.g. ours:bf16,ours:bf16/bf16res
#             adds the bf16 stream, the policy before issue 38, for a same-call control: +40 s;
#             none: no B)
#   --runs-a  the same in A (default ours:bf16,ours:bf16/unfused: the unfused control carries the
#             stream's gradient in float32 where the fused kernels carry it in bf16; +35 s;
#             ours:fp32 adds the fp32-against-fp32 floor: +85 s)
#   --limit-a seconds A may take (default 110)
#   --extra-a more convergence.py arguments for A, e.g. "--probe --probe-ref ours:fp32
#             --checkpoints 10,100,300 --probe-batches 4" (gradient error and scale bias of each
#             kind at ours:fp32's weights: chaos-free)
#   --seeds-a A again with these train-loader seeds (no PyTorch baseline there: --runs-seeds,
#             default ours:fp32,torch:bf16,ours:bf16, with ours:fp32 the reference; ~150 s each)
#   --speed   rounds of the A / B of the residual stream's dtype (default 0: none)
# Needs the CUDA wheels installed (scripts/gpu.sh --prebuilt puts them in /tmp/site; this
# script installs .whl/bt/*.whl there itself when /tmp/site has no blutrain.tensor).
# Logs and JSON go to $OUT (default ./out).
set -uo pipefail
cd "$(dirname "$0")/../../.."
ROOT=$PWD
export OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
START=$(date +%s)
BUDGET=240 RUNS=ours:bf16 RUNS_A=ours:bf16,ours:bf16/unfused SPEED=0
LIMIT_A=110 EXTRA_A="" SEEDS_A="" RUNS_SEEDS=ours:fp32,torch:bf16,ours:bf16
while [ $# -gt 0 ]; do
  case "$1" in
    --budget) BUDGET=$2; shift ;;
    --runs) RUNS=$2; shift ;;
    --runs-a) RUNS_A=$2; shift ;;
    --speed) SPEED=$2; shift ;;
    --limit-a) LIMIT_A=$2; shift ;;
    --extra-a) EXTRA_A=$2; shift ;;
    --seeds-a) SEEDS_A=$2; shift ;;
    --runs-seeds) RUNS_SEEDS=$2; shift ;;
    *) echo "gpu_bf16.sh: unknown argument $1 (--budget SECONDS, --runs LIST, --runs-a LIST, --limit-a SECONDS, --extra-a ARGS, --seeds-a SEEDS, --runs-seeds LIST, --speed N)"; exit 2 ;;
  esac
  shift
done
left() { echo $(( BUDGET - ($(date +%s) - START) )); }

if [ ! -d /tmp/site/blutrain/tensor ] && compgen -G ".whl/bt/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl .whl/bt/*.whl >"$OUT/install.log" 2>&1 || tail -20 "$OUT/install.log"
fi
export PYTHONPATH=/tmp/site:$ROOT/packages/blutrain-models/python${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
$PY -c "import blutrain.tensor as bt; assert bt.cuda_built() and bt.cuda_device_count(), 'no CUDA'; print('blutrain.tensor', bt.__file__)" \
  || { echo "gpu_bf16.sh: blutrain.tensor with CUDA is not importable (scripts/gpu.sh --prebuilt first)"; exit 2; }

declare -A STATUS
# ---- 1. GPU tests, one pytest per file, in the background (limit 120 s) while setting B runs:
# B's small steps leave the GPU mostly idle; its tok/s is then not a clean figure (A's is)
T=packages/blutrain-tensor/tests
tests=(
  "$T/test_tensor_cuda_nn.py|-k mixed"
  "$T/test_tensor_recompute.py|-k mixed"
  "tests/test_models_gpu_fidelity.py|-k bf16"
)
pids=() logs=()
for t in "${tests[@]}"; do
  IFS='|' read -r f k <<<"$t"
  log="$OUT/tests-$(basename "$f" .py).log"
  timeout 120 $PY -m pytest -q "$f" -k "${k#-k }" -o addopts="" -p no:cacheprovider \
    -p no:randomly >"$log" 2>&1 &
  pids+=($!) logs+=("$log")
done
wait_tests() {
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"; local rc=$?
    local key; key=$(basename "${logs[$i]}" .log)
    STATUS[$key]="$( [ $rc = 124 ] && echo 'TIMEOUT (120 s): ')$(tail -1 "${logs[$i]}")"
    [ $rc = 0 ] || grep -E "^(FAILED|ERROR)" "${logs[$i]}" | head -10
  done
}

# ---- 2. convergence, ours only, against call 1's PyTorch runs --------------------------------
BENCH=packages/blutrain-models/bench
conv() {  # name runs need_s limit_s args...
  local name=$1 runs=$2 need=$3 limit=$4; shift 4
  if [ "$(left)" -lt "$need" ]; then STATUS[conv-$name]="skipped (time budget: $(left) s left)"; return; fi
  [ "$(left)" -lt "$limit" ] && limit=$(left)
  local t0; t0=$(date +%s)
  timeout "$limit" $PY $BENCH/convergence.py --device cuda --runs "$runs" \
    --json "$OUT/conv_$name.json" "$@" >"$OUT/conv_$name.log" 2>&1
  local rc=$?
  STATUS[conv-$name]="rc $rc ($(( $(date +%s) - t0 )) s)"
  [ $rc = 0 ] || tail -15 "$OUT/conv_$name.log"
}
if [ "$RUNS" != none ]; then
  conv b "$RUNS" 60 120 -B 2 -T 256 --steps 1000 --warmup 50 --eval-batches 16 \
    --baseline $BENCH/baselines/conv_b_torch.json
fi
wait_tests
# shellcheck disable=SC2086  # EXTRA_A: several arguments
conv a "$RUNS_A" 45 "$LIMIT_A" -B 16 -T 1024 --steps 300 --warmup 20 --eval-batches 4 \
  --baseline $BENCH/baselines/conv_a_torch.json $EXTRA_A
TABLES=("$OUT/conv_a.json")
[ "$RUNS" != none ] && TABLES+=("$OUT/conv_b.json")
for seed in $SEEDS_A; do  # A's chaos: the same runs from other batch orders
  conv "a_seed$seed" "$RUNS_SEEDS" 120 200 -B 16 -T 1024 --steps 300 --warmup 20 \
    --eval-batches 4 --seed "$seed" --checkpoints ""
  TABLES+=("$OUT/conv_a_seed$seed.json")
done

# ---- 4. (--speed N) the float32 stream's cost in the CUDA-graph bf16 step -----------------------
if [ "$SPEED" -gt 0 ]; then
  need=$(( SPEED * 3 * 25 ))
  if [ "$(left)" -lt "$need" ]; then
    STATUS[speed]="skipped (time budget: $(left) s left, ~$need s needed)"
  else
    timeout "$(left)" bash $BENCH/ab_step.sh bf16 ours+graph 10 "$SPEED" \
      "f32-stream||--residual-dtype float32" "bf16-stream||--residual-dtype compute" \
      "f32-grad||--residual-dtype float32 --residual-grad-dtype float32" \
      >"$OUT/speed.log" 2>&1
    STATUS[speed]="rc $? (rows in $OUT/ab_bf16.txt, printed below)"
  fi
fi

# ---- 3. the table (last) ---------------------------------------------------------------------------
echo
for k in $(printf '%s\n' "${!STATUS[@]}" | sort); do printf '%-34s %s\n' "$k" "${STATUS[$k]}"; done
$PY $BENCH/gpu_bf16_table.py "${TABLES[@]}"
if [ -f "$OUT/ab_bf16.txt" ]; then
  echo; echo "the residual stream's cost (ours+graph bf16, B16 T1024; the lead's bar: <= 2%):"
  cat "$OUT/ab_bf16.txt"
fi
echo "gpu_bf16.sh: $(( $(date +%s) - START )) s of $BUDGET"
