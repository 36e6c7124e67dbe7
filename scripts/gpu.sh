#!/usr/bin/env bash
# The GPU machine's one job: build (or install prebuilt wheels of) every package with CUDA, run
# the GPU tests and the benchmarks, and print a short table last. Runs without nox (that machine
# has none):
#   bash scripts/gpu.sh [--prebuilt] [--only alloc,linalg] [--tests a,b] [--bench a,b]
#                       [--no-bench] [--sanitize] [--budget SECONDS] [--dist] [--multi-gpu]
#                       [--multi-gpu-parts check,headline,...]
#   --prebuilt   install .whl/bt/*.whl (CUDA wheels built elsewhere by scripts/build_wheels.sh)
#                instead of building from source here: saves the GPU machine minutes
#   --tests      packages whose GPU tests run ('root' = the repo's tests/); default all
#   --bench      packages whose bench/bench_*.py run; default all
#   --budget     seconds this script may take: later steps are skipped (and say so) when the
#                remaining time is short; default 540
#   --dist       after the tests and benchmarks, blutrain-dist's GPU script (two ranks on one GPU
#                over mpirun, GPT-2 DDP / ZeRO next to PyTorch DDP): packages/blutrain-dist/bench/
#                gpu_dist.sh
#   --multi-gpu  last, issue 35 on every GPU of the machine (an x2 / x4 / x8 kind): blutrain-dist
#                against PyTorch DDP, scaling, parity, a killed rank (packages/blutrain-dist/bench/
#                multi_gpu.py, given what is left of the budget)
#   --multi-gpu-parts  --multi-gpu with only these parts of multi_gpu.py (its --parts), e.g.
#                headline; default all of them, in multi_gpu.py's order
# Test files run in parallel (one pytest per file: the GPU has room and the CPU references
# dominate); benchmarks run one at a time, alone on the GPU.
# Logs and JSON go to $OUT (default ./out), packed into logs.tar.gz (8 files come back at most).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16}
PY=${PYTHON:-python3}
START=$(date +%s)
BENCH=1 PREBUILT=0 SANITIZE=0 BUDGET=540 DIST=0 MULTI=0
ONLY="" BENCH_ONLY="" TESTS_ONLY="" MULTI_PARTS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-bench) BENCH=0 ;;
    --prebuilt) PREBUILT=1 ;;
    --only) ONLY=$2; shift ;;
    --bench) BENCH_ONLY=$2; shift ;;
    --tests) TESTS_ONLY=$2; shift ;;
    --sanitize) SANITIZE=1 ;;
    --budget) BUDGET=$2; shift ;;
    --dist) DIST=1 ;;
    --multi-gpu) MULTI=1 ;;
    --multi-gpu-parts) MULTI=1; MULTI_PARTS=(--parts "$2"); shift ;;
  esac
  shift
done
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
selected() { [ -z "$1" ] || [[ ",$1," == *",$2,"* ]]; }

declare -A STATUS
shopt -s nullglob  # no carried wheels: an empty list, not the literal pattern
wheels=(.whl/*.whl)
[ "$PREBUILT" = 1 ] && wheels+=(.whl/bt/*.whl)
shopt -u nullglob
if [ "$PREBUILT" = 1 ] && ! compgen -G ".whl/bt/*.whl" >/dev/null; then
  echo "--prebuilt: no wheels in .whl/bt (run scripts/build_wheels.sh first)"; exit 2
fi
if [ ${#wheels[@]} -gt 0 ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "${wheels[@]}" >"$OUT/install.log" 2>&1 || tail -20 "$OUT/install.log"
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
# blutrain-compiler's MLIR bindings: the bundle packed by shared/tools/mlir-device-bundle.sh
# (this machine reaches no registry), carried in .mlir/ (git-ignored).
if [ -f .mlir/mlir-bundle.tar.xz ]; then
  mkdir -p /tmp/mlir && tar xJf .mlir/mlir-bundle.tar.xz -C /tmp/mlir \
    && export PYTHONPATH=/tmp/mlir${PYTHONPATH:+:$PYTHONPATH}
fi
# blutrain-models is pure Python: run it from the source tree.
export PYTHONPATH=$ROOT/packages/blutrain-models/python${PYTHONPATH:+:$PYTHONPATH}

export BLUTRAIN_CUDA=ON BLUTRAIN_CUDA_ARCHS=${BLUTRAIN_CUDA_ARCHS:-90a-real}
PKGS=()
for name in alloc linalg tensor dist compiler models; do
  [ -f "packages/blutrain-$name/pyproject.toml" ] || continue
  selected "$ONLY" "$name" || continue
  PKGS+=("$name")
done

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader \
  | tee "$OUT/gpu.txt"
if [ "$PREBUILT" = 0 ]; then
  for name in "${PKGS[@]}"; do
    [ "$name" = models ] && continue
    t0=$(date +%s)
    if SKBUILD_BUILD_DIR=/tmp/bt-build/$name $PY -m pip install -v --no-build-isolation \
        --no-deps "./packages/blutrain-$name" >"$OUT/build-$name.log" 2>&1; then
      STATUS[build-$name]="ok ($(( $(date +%s) - t0 )) s)"
    else
      STATUS[build-$name]="FAILED"
      tail -40 "$OUT/build-$name.log"
    fi
  done
fi
$PY -c "import blutrain.tensor as bt; print('blutrain.tensor', bt.__file__, 'cuda', bt.cuda_built(), bt.cuda_device_count())" 2>&1 | tail -3

# ---- GPU tests: one pytest per file, all at once ------------------------------------------
t0=$(date +%s)
pids=()
logs=()
for name in "${PKGS[@]}" root; do
  selected "$TESTS_ONLY" "$name" || continue
  dir=packages/blutrain-$name/tests; [ "$name" = root ] && dir=tests
  [ -d "$dir" ] || continue
  # alloc's whole suite is quick; the others run their GPU-marked tests.
  marker=(-m gpu); [ "$name" = alloc ] && marker=()
  for f in "$dir"/test_*.py; do
    grep -q "gpu" "$f" || [ "$name" = alloc ] || continue
    log="$OUT/tests-$name-$(basename "$f" .py).log"
    timeout 240 $PY -m pytest -q "${marker[@]}" "$f" -o addopts="" -p no:cacheprovider \
      -p no:randomly >"$log" 2>&1 &
    pids+=($!)
    logs+=("$log")
  done
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"; rc=$?
  log=${logs[$i]}
  key=$(basename "$log" .log)
  last=$(tail -1 "$log")
  if [ "$rc" = 124 ]; then
    STATUS[$key]="TIMEOUT (240 s): $last"
  elif [[ "$last" == *passed* || "$last" == *failed* || "$last" == *error* ]]; then
    STATUS[$key]="$last"
  fi
done
STATUS[tests-wall]="$(( $(date +%s) - t0 )) s"

# ---- benchmarks: one at a time; the GPT-2 one first ----------------------------------------
if [ "$BENCH" = 1 ]; then
  benches=()
  for name in "${PKGS[@]}"; do
    selected "$BENCH_ONLY" "$name" || continue
    [ "$name" = models ] && benches=(packages/blutrain-models/bench/bench_*.py "${benches[@]}") \
      && continue
    benches+=(packages/blutrain-$name/bench/bench_*.py)
  done
  for b in "${benches[@]}"; do
    [ -f "$b" ] || continue
    base=$(basename "$b" .py)
    [ "$base" = bench_ops ] && continue  # the CPU kernels' bench: not for this machine's minutes
    limit=75; [ "$base" = bench_gpt2 ] && limit=170; [ "$base" = bench_compiler ] && limit=240
    if [ "$(left)" -lt $(( limit / 2 )) ]; then STATUS[$base]="skipped (time budget)"; continue; fi
    [ "$(left)" -lt "$limit" ] && limit=$(left)
    t0=$(date +%s)
    if timeout "$limit" $PY "$b" --json "$OUT/$base.json" >"$OUT/$base.txt" 2>&1; then
      STATUS[$base]="ok [$(( $(date +%s) - t0 )) s]"
    else
      STATUS[$base]="FAILED rc=$? [$(( $(date +%s) - t0 )) s]"
    fi
  done
fi

# ---- compute-sanitizer on the kernel tests (slow: opt-in) --------------------------------
# Each kernel test file runs under memcheck and under racecheck (one tool at a time), split into
# SAN_SHARDS shards (its tests dealt round-robin, each shard its own process, all at once), each
# shard SANITIZE_S seconds at most (default 240).  Knobs: SANITIZE_TOOLS (default "memcheck
# racecheck"); SANITIZE_FILES (e.g. "attention,precision": files by their name after
# test_tensor_cuda_); SANITIZE_SHARDS (e.g. "attention=6"); SANITIZE_K narrows every file
# (pytest -k).  Per-file filters below skip the very large shapes (the tools slow kernels
# 10-100x).  memcheck runs with the allocator's caching off (BLUTRAIN_ALLOC_CONF=caching:0: every
# tensor its own cudaMalloc of exactly its size), so an access past a tensor's end is reported
# instead of landing in a cached neighbour.  racecheck reports hazards inside cuBLASLt's own kernels (nvjet*: not
# ours; their split-K reductions), which fail the shard (rc 99): each racecheck status also counts
# the hazard reports that name any other kernel ("ours"), the number that must be 0.  (The tool's
# --kernel-name-exclude kns=nvjet would skip them, but compute-sanitizer 2025.x then fails with
# "Internal Sanitizer Error ... hardware exception" on the first cuBLASLt kernel: session 16.)
if [ "$SANITIZE" = 1 ]; then
  declare -A SAN_K=(
    [test_tensor_cuda_nn]="not vocab"
    [test_tensor_cuda_elementwise]="not 2_31 and not statistics"
    [test_tensor_cuda_reduce_index]="not large"
    [test_tensor_cuda_attention]="not deterministic"
    [test_tensor_cuda_optim]="not gpt2"
    [test_tensor_cuda_precision]="not checkpoint"
  )
  # racecheck is slower still on the attention kernels (large shared-memory tiles): T=1024 cases
  # and the many-item case are left to memcheck (the same kernels run at T=64 and 200, with
  # several key blocks; bench/attn_sm90_bwd_check.sh runs the persistent backward on 3 blocks)
  declare -A SAN_K_RACE=(
    [test_tensor_cuda_attention]="not deterministic and not 1024 and not more_blocks"
  )
  declare -A SAN_SHARDS=(
    [test_tensor_cuda_nn]=4 [test_tensor_cuda_elementwise]=2 [test_tensor_cuda_attention]=4
    [test_tensor_cuda_precision]=3
  )
  shard_conf=${SANITIZE_SHARDS:-}
  for kv in ${shard_conf//,/ }; do SAN_SHARDS[test_tensor_cuda_${kv%%=*}]=${kv#*=}; done
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    if [ "$(left)" -lt 60 ]; then STATUS[sanitize-$tool]="skipped (time budget)"; continue; fi
    t0=$(date +%s)
    spids=() slogs=() ssize=()
    for base in "${!SAN_K[@]}"; do
      f=packages/blutrain-tensor/tests/$base.py
      [ -f "$f" ] || continue
      selected "${SANITIZE_FILES:-}" "${base#test_tensor_cuda_}" || continue
      n=${SAN_SHARDS[$base]:-1}
      k=${SAN_K[$base]}
      [ "$tool" = racecheck ] && k=${SAN_K_RACE[$base]:-$k}
      ids=$OUT/ids-$tool-$base.txt
      $PY -m pytest -q --collect-only -m gpu -o addopts="" -p no:cacheprovider \
        -k "${SANITIZE_K:-$k}" "$f" 2>/dev/null | grep "::" | sed "s#^[^:]*::#$f::#" >"$ids"
      conf=""; [ "$tool" = memcheck ] && conf=caching:0
      for ((s = 0; s < n; s++)); do
        log="$OUT/sanitize-$tool-$base-$s.log"
        mapfile -t shard < <(awk -v n="$n" -v s="$s" '(NR - 1) % n == s' "$ids")
        [ ${#shard[@]} -gt 0 ] || continue
        BLUTRAIN_ALLOC_CONF=$conf timeout "${SANITIZE_S:-240}" \
          compute-sanitizer --tool $tool --error-exitcode 99 \
          --target-processes all $PY -m pytest -q -m gpu -o addopts="" -p no:cacheprovider \
          "${shard[@]}" >"$log" 2>&1 &
        spids+=($!) slogs+=("$log") ssize+=(${#shard[@]})
      done
    done
    for i in "${!spids[@]}"; do
      wait "${spids[$i]}"; rc=$?
      log=${slogs[$i]}
      key=sanitize-$tool-$(basename "$log" .log | sed "s/sanitize-$tool-test_tensor_cuda_//")
      # tests run: pytest -q's progress dots (also when the shard hit its time limit)
      ran=$(grep -E "\[ *[0-9]+%\]$" "$log" | tr -cd '.' | wc -c)
      ours=""
      if [ "$tool" = racecheck ]; then  # hazard reports naming a kernel other than cuBLASLt's
        ours=" ours=$(grep -E "Race reported|^=+ +and .* access at" "$log" | grep -vc nvjet)"
      fi
      STATUS[$key]="rc=$rc passed>=$ran/${ssize[$i]}$ours $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1) | $(grep -E "passed|failed" "$log" | tail -1)"
    done
    STATUS[sanitize-$tool-wall]="$(( $(date +%s) - t0 )) s"
  done
fi

if [ "$DIST" = 1 ]; then
  if [ "$(left)" -lt 120 ]; then STATUS[dist-gpu]="skipped (time budget)"
  else
    t0=$(date +%s)
    OUT=$OUT BUDGET=$(( $(left) - 10 )) timeout "$(left)" bash packages/blutrain-dist/bench/gpu_dist.sh \
      >"$OUT/dist-gpu.txt" 2>&1
    STATUS[dist-gpu]="rc=$? [$(( $(date +%s) - t0 )) s] $(grep -c . "$OUT/dist-gpu.txt") lines"
    grep -E "^ZeRO-|costs" "$OUT/dist-gpu.txt"  # memory vs formula, the DDP step's cost
    sed -n '/blutrain-dist on one GPU/,$p' "$OUT/dist-gpu.txt"
  fi
fi

if [ "$MULTI" = 1 ]; then
  if [ "$(left)" -lt 120 ]; then STATUS[multi-gpu]="skipped (time budget)"
  else
    t0=$(date +%s)
    timeout "$(left)" $PY packages/blutrain-dist/bench/multi_gpu.py --out "$OUT" \
      --budget-s $(( $(left) - 15 )) ${MULTI_PARTS[@]+"${MULTI_PARTS[@]}"} >"$OUT/multi-gpu.txt" 2>&1
    STATUS[multi-gpu]="rc=$? [$(( $(date +%s) - t0 )) s] (table: multi-gpu.txt, summary.txt)"
    tail -60 "$OUT/multi-gpu.txt"
  fi
fi

for f in "$OUT"/bench_*.txt; do
  [ -f "$f" ] && { echo; echo "---- $(basename "$f")"; tail -40 "$f"; }
done
grep -h -E "^(FAILED|ERROR)" "$OUT"/tests-*.log 2>/dev/null | cut -c1-220 | head -40 \
  >/tmp/bt-failures
# Only a few files come back from the GPU machine: pack logs and JSON.
( cd "$OUT" && tar czf logs.tar.gz --remove-files ./*.log ./*.txt ./*.json 2>/dev/null )
echo
echo "==================== summary ($(( $(date +%s) - START )) s) ===================="
for key in $(printf '%s\n' "${!STATUS[@]}" | sort); do
  printf '%-44s %s\n' "$key" "${STATUS[$key]}"
done
cat /tmp/bt-failures
