#!/usr/bin/env bash
# Builds bench/cpu_kernels_check.cpp and bench/reduce_rows_check.cpp once per x86-64 level that BT_CPU_CLONES compiles for
# (v4 = AVX-512, v3 = AVX2 + FMA, the baseline) and runs each this machine can: every kernel
# must match its v1 bit for bit. Extra arguments go to the binary (e.g. --reps 20).
set -euo pipefail
cd "$(dirname "$0")"
out=${TMPDIR:-/tmp}/bt_cpu_kernels_check
mkdir -p "$out"
status=0
for arch in x86-64-v4 x86-64-v3 x86-64; do
  # The two files as CMakeLists.txt compiles their kernels: contraction off (norm, softmax and
  # GELU backward), and GCC's default (softmax forward, the Tanh op's loop).
  flags="-O3 -std=gnu++17 -march=$arch -fno-trapping-math -DBT_CPU_CLONES="
  # widen.h's AVX2 loops where the level has AVX2, its plain loops on the baseline (as at run
  # time on such a CPU: Note [widening loops])
  [ $arch = x86-64 ] && flags="$flags -DBT_CPU_WIDEN=0"
  ${CXX:-g++} $flags -ffp-contract=off -c cpu_kernels_check.cpp -o "$out/check_$arch.o"
  ${CXX:-g++} $flags -c cpu_kernels_check_fwd.cpp -o "$out/check_fwd_$arch.o"
  ${CXX:-g++} "$out/check_$arch.o" "$out/check_fwd_$arch.o" -o "$out/check_$arch"
  # the reductions (reduce.cpp: contraction off); -Wno-psabi: vector arguments of its helpers
  ${CXX:-g++} $flags -ffp-contract=off -Wno-psabi reduce_rows_check.cpp -o "$out/reduce_$arch"
  case $arch in
    x86-64-v4) grep -q avx512f /proc/cpuinfo || { echo "== $arch: not on this CPU, skipped"; continue; } ;;
    x86-64-v3) grep -q avx2 /proc/cpuinfo || { echo "== $arch: not on this CPU, skipped"; continue; } ;;
  esac
  echo "== $arch"
  "$out/check_$arch" "$@" || status=1
  "$out/reduce_$arch" "$@" || status=1
done
exit $status
