#!/usr/bin/env bash
# Build and run the standalone check + timing of the Hopper wgmma attention backward (needs an
# sm_90 GPU).  bash bench/attn_sm90_bwd_check.sh [--check | --check-small | --bench]   (exit 1 on any FAIL)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$HERE/../src
OUT=${TMPDIR:-/tmp}/attn_sm90_bwd_check
nvcc -arch=sm_90a -O3 -std=c++17 -Xptxas -warn-spills --expt-relaxed-constexpr \
  -I"$SRC" -I"$HERE/../include" -I"$HERE/../../blutrain-alloc/include" -o "$OUT" \
  "$HERE/attn_sm90_bwd_check.cu"
"$OUT" "$@"
