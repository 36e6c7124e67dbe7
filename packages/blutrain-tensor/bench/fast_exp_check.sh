#!/usr/bin/env bash
# Builds bench/fast_exp_check.cpp per x86-64 level (as cpu_kernels_check.sh) with FMA contraction
# off and on, and runs each this machine can: fast_exp must give v1's bits on all 2^32 inputs.
# About a minute on one core.
set -euo pipefail
cd "$(dirname "$0")"
out=${TMPDIR:-/tmp}/bt_fast_exp_check
mkdir -p "$out"
status=0
for arch in x86-64-v4 x86-64-v3 x86-64; do
  case $arch in
    x86-64-v4) grep -q avx512f /proc/cpuinfo || { echo "== $arch: not on this CPU, skipped"; continue; } ;;
    x86-64-v3) grep -q avx2 /proc/cpuinfo || { echo "== $arch: not on this CPU, skipped"; continue; } ;;
  esac
  for contract in off fast; do
    ${CXX:-g++} -O3 -std=gnu++17 -march=$arch -fno-trapping-math -ffp-contract=$contract \
      -DBT_CPU_CLONES= fast_exp_check.cpp -o "$out/check_${arch}_$contract"
    echo "== $arch, -ffp-contract=$contract"
    "$out/check_${arch}_$contract" || status=1
  done
done
exit $status
