#!/usr/bin/env bash
# Build and run the standalone bf16 flash-attention check + configuration sweep (needs an sm_90
# GPU).  bash bench/attn_tune.sh [--check | --bench]   (default: both; exit 1 on any FAIL)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$HERE/../src
OUT=${TMPDIR:-/tmp}/attn_tune
PYINC=$(python -c "import blutrain.alloc, os; print(os.path.dirname(blutrain.alloc.__file__))" \
  2>/dev/null || true)
nvcc -arch=sm_90 -O3 -std=c++17 -Xptxas -warn-spills --expt-relaxed-constexpr \
  -I"$SRC" -I"$HERE/../include" ${PYINC:+-I"$PYINC/include"} -o "$OUT" "$HERE/attn_tune.cu"
"$OUT" "$@"
