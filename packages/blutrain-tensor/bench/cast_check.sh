#!/usr/bin/env bash
# Build and run the standalone check + timing of the bf16 -> fp32 cast variants and bandwidth
# baselines (needs an sm_90 GPU).  bash bench/cast_check.sh [--check | --bench]   (exit 1 on any FAIL)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$HERE/../src
OUT=${TMPDIR:-/tmp}/cast_check
nvcc -arch=sm_90a -O3 -std=c++17 -Xptxas -warn-spills --expt-relaxed-constexpr \
  -I"$SRC" -I"$HERE/../include" -I"$HERE/../../blutrain-alloc/include" -o "$OUT" \
  "$HERE/cast_check.cu"
"$OUT" "$@"
