#!/usr/bin/env bash
# Build and run the standalone TF32 flash-attention check + bench (needs an sm_90 GPU).
#   bash bench/attn_tf32_check.sh [--bench]   (--bench: skip the correctness checks)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${TMPDIR:-/tmp}/attn_tf32_check
nvcc -arch=sm_90 -O3 -std=c++17 -Xptxas -warn-spills -o "$OUT" "$HERE/attn_tf32_check.cu"
"$OUT" "$@"
