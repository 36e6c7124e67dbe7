#!/usr/bin/env bash
# Build and run the standalone check + timing of the softmax and cross-entropy kernels (the
# library's and the v1 references; needs an sm_90 GPU).  bash bench/nn_check.sh [--check | --bench]
# (exit 1 on any FAIL)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$HERE/../src
OUT=${TMPDIR:-/tmp}/nn_check
nvcc -arch=sm_90a -O3 -std=c++17 -Xptxas -warn-spills --expt-relaxed-constexpr \
  -I"$SRC" -I"$HERE/../include" -I"$HERE/../../blutrain-alloc/include" -o "$OUT" \
  "$HERE/nn_check.cu"
"$OUT" "$@"
