#!/usr/bin/env bash
# The GPU machine's one job: build every package with CUDA, run the GPU tests and the
# benchmarks, and print a short table last. Runs without nox (that machine has none):
#   bash scripts/gpu.sh [--no-bench] [--only alloc,linalg]
# Logs and JSON go to $OUT (default ./out). Wheels the machine lacks travel in .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16}
PY=${PYTHON:-python3}
BENCH=1
ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --no-bench) BENCH=0 ;;
    --only) ONLY=$2; shift ;;
  esac
  shift
done

if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi

export BLUTRAIN_CUDA=ON BLUTRAIN_CUDA_ARCHS=${BLUTRAIN_CUDA_ARCHS:-90-real}
declare -A STATUS
PKGS=()
for name in alloc linalg tensor dist compiler models; do
  [ -f "packages/blutrain-$name/pyproject.toml" ] || continue
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then continue; fi
  PKGS+=("$name")
done

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader \
  | tee "$OUT/gpu.txt"
for name in "${PKGS[@]}"; do
  t0=$(date +%s)
  if SKBUILD_BUILD_DIR=/tmp/bt-build/$name $PY -m pip install -v --no-build-isolation --no-deps \
      "./packages/blutrain-$name" >"$OUT/build-$name.log" 2>&1; then
    STATUS[build-$name]="ok ($(( $(date +%s) - t0 )) s)"
  else
    STATUS[build-$name]="FAILED"
    tail -40 "$OUT/build-$name.log"
  fi
done

for name in "${PKGS[@]}"; do
  dir=packages/blutrain-$name/tests
  [ -d "$dir" ] || continue
  # alloc's whole suite is quick; the others run their GPU-marked tests.
  marker=(-m gpu); [ "$name" = alloc ] && marker=()
  $PY -m pytest -q "${marker[@]}" "$dir" -x --timeout=600 -o addopts="" \
      >"$OUT/tests-$name.log" 2>&1
  STATUS[tests-$name]=$(tail -1 "$OUT/tests-$name.log")
  grep -E "^(FAILED|ERROR)" "$OUT/tests-$name.log" | head -20
done

if [ "$BENCH" = 1 ]; then
  for name in "${PKGS[@]}"; do
    for b in packages/blutrain-$name/bench/bench_*.py; do
      [ -f "$b" ] || continue
      base=$(basename "$b" .py)
      if $PY "$b" --json "$OUT/$base.json" >"$OUT/$base.txt" 2>&1; then
        STATUS[$base]="ok"
      else
        STATUS[$base]="FAILED"
        tail -20 "$OUT/$base.txt"
      fi
    done
  done
fi

for f in "$OUT"/bench_*.txt; do
  [ -f "$f" ] && { echo; tail -60 "$f"; }
done
grep -h -E "^(FAILED|ERROR)" "$OUT"/tests-*.log 2>/dev/null | head -30 >/tmp/bt-failures
# Only a few files come back from the GPU machine: keep the JSON, pack the logs.
( cd "$OUT" && tar czf logs.tar.gz --remove-files ./*.log ./*.txt ./*.npy 2>/dev/null )
echo
echo "==================== summary ===================="
for key in $(printf '%s\n' "${!STATUS[@]}" | sort); do
  printf '%-24s %s\n' "$key" "${STATUS[$key]}"
done
cat /tmp/bt-failures
