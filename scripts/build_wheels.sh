#!/usr/bin/env bash
# Builds CUDA wheels of the C++ packages for the GPU machine, here, so a device call spends its
# minutes on tests rather than on compiling (scripts/gpu.sh --prebuilt installs them):
#   bash scripts/build_wheels.sh [alloc,linalg,tensor,dist,compiler]
# Needs a CPython 3.12 venv (the GPU machine's python; the modules use the stable ABI, so the
# wheels are cp312-abi3) with the build tools, created once:
#   python3.12 -m venv .venv-whl312 && .venv-whl312/bin/pip install scikit-build-core \
#     nanobind==3.1.0 numpy cmake ninja hatchling pip nvidia-cublas nvidia-cuda-runtime \
#     nvidia-nccl-cu13
# (pip, which reads the machine's package index settings; uv found no index on the CPU machines
# of session 53. With pyenv, python3.12 may be /root/.pyenv/versions/3.12.*/bin/python.)
# Wheels land in .whl/bt/ (git-ignored); build dirs persist in /tmp/bt-whl-NAME (incremental).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-$PWD/.venv-whl312}
export PATH=$VENV/bin:$PATH BLUTRAIN_CUDA=ON BLUTRAIN_CUDA_ARCHS=${BLUTRAIN_CUDA_ARCHS:-90a-real}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
mkdir -p .whl/bt
for name in $(echo "${1:-alloc,linalg,tensor,dist,compiler}" | tr , ' '); do
  rm -f .whl/bt/blutrain_"$name"-*.whl
  SKBUILD_BUILD_DIR=/tmp/bt-whl-$name python -m pip wheel -q --no-build-isolation --no-deps \
    -w .whl/bt "packages/blutrain-$name"
  # later packages read the earlier ones' headers and import them while generating stubs
  python -m pip install -q --no-build-isolation --no-deps --force-reinstall .whl/bt/blutrain_"$name"-*.whl
done
# The GPU machine reaches no registry and lacks blutrain-linalg's CPU BLAS (scipy-openblas32): the
# CPU references of the tensor GPU tests need it (session 53's call without it: 457 failures,
# each "scipy-openblas32 could not be loaded"). scripts/gpu.sh installs .whl/*.whl.
python -m pip download -q --no-deps --only-binary :all: --python-version 3.12 \
  --platform manylinux2014_x86_64 -d .whl "scipy-openblas32>=0.3.27"
ls -la .whl/bt .whl/*.whl
