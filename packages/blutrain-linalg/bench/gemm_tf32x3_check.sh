#!/usr/bin/env bash
# Build and run the standalone 3xTF32 GEMM check + bench (needs an sm_80+ GPU and cuBLAS).
#   bash bench/gemm_tf32x3_check.sh [--bench]   (--bench: skip the correctness checks)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${TMPDIR:-/tmp}/gemm_tf32x3_check
nvcc -arch=sm_90 -O3 -std=c++17 -Xptxas -warn-spills,-v -o "$OUT" "$HERE/gemm_tf32x3_check.cu" -lcublas 2>&1 \
  | grep -E "registers|spill|error|warning" || true
test -x "$OUT"
"$OUT" "$@"
