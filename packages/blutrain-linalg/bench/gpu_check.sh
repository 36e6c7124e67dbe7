#!/usr/bin/env bash
# GPU check of blutrain-linalg, for the GPU machine (run from the repo root):
#   build blutrain-alloc and blutrain-linalg with CUDA, a smoke test per configuration in
#   subprocesses (native crash traces; gpu_diag.py), the package's tests (CPU and GPU), then
#   the GEMM benchmark. Logs and the benchmark JSON go to $OUT (default ./out).
# Wheels missing on the machine (scipy-openblas32) are carried in .whl/ (see the device notes).
set -u -o pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
REPO=$PWD
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, torch.version.cuda)'
  python3 -c 'import nvidia, os; [print(p, os.listdir(p)) for p in nvidia.__path__]' || true
} 2>&1 | tee "$OUT/linalg_env.txt"

export BLUTRAIN_CUDA=ON BLUTRAIN_CUDA_ARCHS=${BLUTRAIN_CUDA_ARCHS:-90-real}
BT=${BLUTRAIN_BUILD_TYPE:-RelWithDebInfo}  # symbols for the crash traces; -O2
# alloc first: linalg's CMake reads alloc's headers from the installed package.
( time python3 -m pip install --no-build-isolation --no-deps -v \
    --config-settings=cmake.build-type=$BT ./packages/blutrain-alloc &&
  time python3 -m pip install --no-build-isolation --no-deps -v \
    --config-settings=cmake.build-type=$BT ./packages/blutrain-linalg ) \
  > "$OUT/linalg_build.log" 2>&1
rc=$?
grep -E "CUDA backend|error|real" "$OUT/linalg_build.log" | tail -20
if [ $rc -ne 0 ]; then echo "build failed ($rc)"; tail -60 "$OUT/linalg_build.log"; exit $rc; fi

cd /tmp  # import the installed package, not the source tree
timeout ${DIAG_TIMEOUT:-150} python3 "$REPO/packages/blutrain-linalg/bench/gpu_diag.py" 2>&1 |
  tee "$OUT/linalg_diag.txt"
opts=$(sed -n "s/^== chosen BLUTRAIN_LINALG_OPTIONS: '\(.*\)'$/\1/p" "$OUT/linalg_diag.txt")
[ "$opts" = "NONE" ] && opts=""
export BLUTRAIN_LINALG_OPTIONS="$opts" BLUTRAIN_TEST_EAGER=1
echo "tests and benchmark run with BLUTRAIN_LINALG_OPTIONS='$opts'"

timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -rs -p no:cacheprovider \
  "$REPO/packages/blutrain-linalg/tests" > "$OUT/linalg_pytest.log" 2>&1
test_rc=$?
grep -E "^FAILED|passed|failed|Fatal|NATIVE" "$OUT/linalg_pytest.log" | tail -40
cd "$REPO"

timeout ${BENCH_TIMEOUT:-200} python3 packages/blutrain-linalg/bench/bench_gemm.py \
  --json "$OUT/bench_gemm.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/linalg_bench.txt"
bench_rc=${PIPESTATUS[0]}
echo "pytest rc=$test_rc bench rc=$bench_rc"
exit $(( test_rc != 0 ? test_rc : bench_rc ))
