#!/usr/bin/env bash
# blutrain-compiler on the GPU machine, in one device call of BUDGET seconds (default 300):
#   1. the MLIR bindings from the carried bundle (.mlir/mlir-bundle.tar.xz, made here by
#      bash /work/shared/tools/mlir-device-bundle.sh .mlir/mlir-bundle.tar.xz), unpacked to
#      /tmp/mlir; our CUDA wheels (compiler included) already in /tmp/site from an earlier call
#      of scripts/gpu.sh --prebuilt
#   2. the compiler's GPU tests (pytest -m gpu: every fused kernel against eager, bf16, the
#      LLaMA-style step in fp32 and bf16 against eager)
#   3. bench/bench_gpt2_compiled.py: GPT-2 124M step, ours eager / ours compiled / torch eager /
#      torch.compile, tokens/s and peak memory (allocator statistics), same run
#   4. a summary, last
# PARTS (comma-separated, default tests,gpt2) picks among: tests (2), check (bench/check_steps.py
# --device cuda llama32:check gpt2bf16:check: each program step against eager's replay), alloc
# (bench/alloc_steps.py --device cuda: the steps that still call the allocator in the steady
# state), llama (bench/bench_compiler.py: the fused kernels' share of copy bandwidth, LLaMA small
# ours eager / compiled / torch eager / torch.compile), gpt2 (3), in that order.
# usage: bash packages/blutrain-compiler/bench/gpu_call.sh [BUDGET_S]
#   env: PARTS, B, T (default 8, 1024), MODE (tf32 | fp32), OUT, SKIP_TESTS=1 (the whole budget
#   to the benchmark: compiling GPT-2 124M's step is the longest row, run last)
# --cpu-check runs steps 1-4 on a CPU machine (no GPU tests, GPT-2 tiny): the script's own test.
set -uo pipefail
cd "$(dirname "$0")/../../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
CPU=0
[ "${1:-}" = "--cpu-check" ] && { CPU=1; shift; }
BUDGET=${1:-300}
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
declare -A S
PARTS=${PARTS:-tests,gpt2}
[ "${SKIP_TESTS:-0}" = 1 ] && PARTS=${PARTS//tests/}
part() { [[ ",$PARTS," == *",$1,"* ]]; }

# ---- 1. environment ---------------------------------------------------------------------
# (the bundle is for CPython 3.12; --cpu-check uses the bindings installed here)
if [ "$CPU" = 1 ]; then :
elif [ -f .mlir/mlir-bundle.tar.xz ]; then
  if [ ! -f /tmp/mlir/.unpacked ]; then  # a partial unpack is redone, not trusted
    rm -rf /tmp/mlir && mkdir -p /tmp/mlir && tar xJf .mlir/mlir-bundle.tar.xz -C /tmp/mlir \
      && touch /tmp/mlir/.unpacked
  fi
  [ -f /tmp/mlir/.unpacked ] && S[bundle]="ok" || S[bundle]="UNPACK FAILED"
  export PYTHONPATH=/tmp/mlir${PYTHONPATH:+:$PYTHONPATH}
else
  S[bundle]="MISSING .mlir/mlir-bundle.tar.xz (carry it)"
fi
[ "$CPU" = 0 ] && [ -d /tmp/site ] && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$ROOT/packages/blutrain-models/python
export PYTHONUNBUFFERED=1 BLUTRAIN_COMPILE_CACHE=${BLUTRAIN_COMPILE_CACHE:-/tmp/btc-cache}
$PY - <<'EOF' 2>&1 | tee "$OUT/compiler-env.txt"
import mlir.ir, blutrain.tensor as bt, blutrain.compiler as btc
from blutrain.compiler import backend_cpu
print("mlir", mlir.ir.__file__)
print("blutrain.compiler", btc.__file__, "cpu omp threads", backend_cpu.omp_threads())
print("blutrain.tensor cuda", bt.cuda_built(), "devices", bt.cuda_device_count())
EOF
[ "${PIPESTATUS[0]}" = 0 ] && S[env]="ok" || S[env]="FAILED (see above)"
# the tests and benchmarks come from the working tree, the package from a wheel: a stale wheel
# fails them for no fault of the code (session 51) (rebuild: scripts/build_wheels.sh compiler)
inst=$($PY -c "import blutrain.compiler as c, os; print(os.path.dirname(c.__file__))" 2>/dev/null)
if [ -n "$inst" ] && [ "$inst" != "$ROOT/packages/blutrain-compiler/python/blutrain/compiler" ] &&
  ! diff -rq -x '__pycache__' -x '*.so' -x '*.pyi' -x 'py.typed' -x '_native*' \
    "$ROOT/packages/blutrain-compiler/python/blutrain/compiler" "$inst" >/dev/null 2>&1; then
  S[env]="${S[env]}; STALE: $inst differs from the working tree's Python (rebuild the wheel)"
  echo "gpu_call.sh: the installed blutrain.compiler ($inst) differs from the working tree's" \
    "Python: rebuild its wheel (scripts/build_wheels.sh compiler)" >&2
fi

# ---- 2. GPU tests -----------------------------------------------------------------------
if [ "$CPU" = 0 ] && part tests; then
  t0=$(date +%s)
  timeout 110 $PY -m pytest -q -m gpu packages/blutrain-compiler/tests -o addopts="" \
    -p no:cacheprovider >"$OUT/compiler-gpu-tests.log" 2>&1
  rc=$?
  S[gpu-tests]="rc=$rc [$(( $(date +%s) - t0 )) s] $(tail -1 "$OUT/compiler-gpu-tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/compiler-gpu-tests.log" | cut -c1-200 | head -20
fi

# ---- check_steps, alloc_steps, bench_compiler (PARTS) -----------------------------------
dev=cuda
[ "$CPU" = 1 ] && dev=cpu
run_part() {  # name, minimum seconds, log, command...
  local name=$1 min=$2 log=$3 lim t0; shift 3
  lim=$(( $(left) - 10 ))
  if [ "$lim" -lt "$min" ]; then S[$name]="skipped (time budget: $lim s left)"; return; fi
  t0=$(date +%s)
  timeout "$lim" "$@" >"$OUT/$log" 2>&1
  S[$name]="rc=$? [$(( $(date +%s) - t0 )) s]"
  echo "---- $name"; tail -"${TAIL:-12}" "$OUT/$log"
}
B_DIR=packages/blutrain-compiler/bench
part check && run_part check 30 check_steps.txt \
  $PY $B_DIR/check_steps.py --device $dev llama32:check gpt2bf16:check
part alloc && run_part alloc 30 alloc_steps.txt \
  $PY $B_DIR/alloc_steps.py --device $dev --json "$OUT/alloc_steps.json"
if part llama; then
  largs=(--device $dev --json "$OUT/bench_compiler.json")
  [ "$CPU" = 1 ] && largs+=(--steps 2 --warmup 1 --no-torch-compile)
  TAIL=30 run_part llama 120 bench_compiler.txt $PY $B_DIR/bench_compiler.py "${largs[@]}"
fi

# ---- 3. GPT-2 benchmark -----------------------------------------------------------------
lim=$(( $(left) - 10 ))
if ! part gpt2; then :
elif [ "$lim" -lt 60 ]; then
  S[bench]="skipped (time budget: $lim s left)"
else
  t0=$(date +%s)
  args=(--mode "${MODE:-tf32}" --steps 10 --warmup 3 --json "$OUT/bench_gpt2_compiled.json")
  if [ "$CPU" = 1 ]; then args+=(--device cpu --model tiny -B 2 -T 64 --steps 2 --warmup 2)
  else args+=(--device cuda --model gpt2 -B "${B:-8}" -T "${T:-1024}" --budget-s $(( lim - 5 )))
  fi
  timeout "$lim" $PY packages/blutrain-compiler/bench/bench_gpt2_compiled.py "${args[@]}" \
    >"$OUT/bench_gpt2_compiled.txt" 2>&1
  S[bench]="rc=$? [$(( $(date +%s) - t0 )) s]"
fi

# ---- 4. summary -------------------------------------------------------------------------
if part gpt2; then
  echo
  echo "---- bench_gpt2_compiled"
  tail -14 "$OUT/bench_gpt2_compiled.txt" 2>/dev/null
fi
echo
echo "==================== blutrain-compiler summary ($(( $(date +%s) - START )) s) ===================="
for k in $(printf '%s\n' "${!S[@]}" | sort); do printf '%-12s %s\n' "$k" "${S[$k]}"; done
