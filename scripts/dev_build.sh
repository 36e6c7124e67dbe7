#!/usr/bin/env bash
# Incremental developer build of blutrain-tensor's Python module without pip (fast rebuilds):
#   bash scripts/dev_build.sh NAME [cpu|cuda]   then   export PYTHONPATH=/tmp/bt-site-NAME
# Builds in /tmp/bt-dev-NAME-MODE with the current venv's python (which must have blutrain-alloc
# and blutrain-linalg installed) and assembles /tmp/bt-site-NAME/blutrain/tensor from the sources'
# Python files (symlinked) and the built module.  A CUDA build compiles here but needs a GPU to run.
set -euo pipefail
NAME=${1:?usage: dev_build.sh NAME [cpu|cuda]}
MODE=${2:-cpu}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=$(command -v python)
BUILD=/tmp/bt-dev-$NAME-$MODE
SITE=/tmp/bt-site-$NAME
CUDA=OFF; [ "$MODE" = cuda ] && CUDA=ON
if [ ! -f "$BUILD/build.ninja" ]; then
  cmake -S "$ROOT/packages/blutrain-tensor" -B "$BUILD" -G Ninja -DSKBUILD=ON \
    -DBLUTRAIN_CUDA=$CUDA -DCMAKE_CUDA_ARCHITECTURES=90-real -DPython_EXECUTABLE="$PY" \
    -Dnanobind_DIR="$("$PY" -m nanobind --cmake_dir)" >"$BUILD.config.log" 2>&1 ||
    { tail -30 "$BUILD.config.log"; exit 1; }
fi
ninja -C "$BUILD" -j"${JOBS:-2}" _tensor _tensor_stub
mkdir -p "$SITE/blutrain/tensor"
for f in "$ROOT"/packages/blutrain-tensor/python/blutrain/tensor/*.py; do
  ln -sf "$f" "$SITE/blutrain/tensor/"
done
ln -sfn "$ROOT/packages/blutrain-tensor/include" "$SITE/blutrain/tensor/include" 2>/dev/null || true
cp "$BUILD"/_tensor*.so "$BUILD"/_tensor.pyi "$BUILD"/py.typed "$SITE/blutrain/tensor/"
echo "built: export PYTHONPATH=$SITE"
