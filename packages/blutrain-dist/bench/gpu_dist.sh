#!/usr/bin/env bash
# blutrain-dist on ONE GPU, in one device call (~6 minutes on an H200: BUDGET=360 s):
#   1. world size 1 over NCCL (tests/test_dist_gpu.py, with blutrain-tensor's stream / event /
#      record_stream tests): every collective and dtype, the comm stream's ordering, the divide
#      and ordered-sum kernels against numpy, DDP / ZeRO-1 / ZeRO-2 bitwise equal to the plain
#      step, bf16 ZeRO memory against 2 + 2 + 12 bytes/param;
#   2. two ranks on one GPU over the MPI backend (mpirun; staged through pinned host memory):
#      tests/dist_worker.py's collectives against numpy and DDP gradients / ZeRO losses against
#      one process on the GPU;
#   3. GPT-2 124M ("small") through `blutrain train --dist` on those two ranks against one rank
#      with the same global batch (--grad-accum 2), deterministic mode: DDP, ZeRO-1 and ZeRO-2
#      must give the one-rank run's losses, gradient norms and final weights bit for bit; then a
#      rank killed mid-run (Open MPI must end the job naming it) and the run resumed on one
#      rank, bitwise equal to an uninterrupted one (multi_gpu.py --parts parity,fault);
#   4. collective bandwidth at world size 1 next to torch.distributed's NCCL (bench_dist.py);
#   5. GPT-2 124M bf16, B16 x T1024: plain, DDP, ZeRO-1, ZeRO-2 (NCCL at world size 1), PyTorch
#      eager and DDP; plain and DDP twice, interleaved: the DDP step's cost over the plain one
#      (aim: <= 2%) from the faster of each pair.
# Prints a summary; exits 1 when a check fails (1, 2, 3 or a part that did not run), never for
# slowness. Run after scripts/gpu.sh has built or installed alloc linalg tensor dist (it does,
# in that order): bash scripts/gpu.sh --prebuilt --tests none --no-bench --dist. Logs and JSON
# go to $OUT (default ./out).
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTHONPATH=$PWD/packages/blutrain-models/python${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
T=packages/blutrain-dist/tests
B=packages/blutrain-dist/bench
BUDGET=${BUDGET:-360}
START=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - START))); }
declare -A S  # part -> "PASS ...", "FAIL ..." or "SKIP ..."
FAILED=0
fail() { S[$1]="FAIL $2"; FAILED=1; }

export BLUTRAIN_TEST_DEVICE=cuda BLUTRAIN_TEST_TIMEOUT=120  # for part 2's ranks
MPIRUN=(mpirun -n 2)
if mpirun --version 2>&1 | grep -q "Open MPI"; then  # no core binding; the variables we set
  MPIRUN=(mpirun -n 2 --oversubscribe --bind-to none)
  for v in PYTHONPATH NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS \
           OMP_NUM_THREADS BLUTRAIN_TEST_DEVICE BLUTRAIN_TEST_TIMEOUT LD_LIBRARY_PATH; do
    [ -n "${!v:-}" ] && MPIRUN+=(-x "$v")
  done
fi
$PY -c "import blutrain.dist as d; print('blutrain.dist', 'NCCL', d.nccl_version())" \
  >"$OUT/dist-preflight.log" 2>&1 || { cat "$OUT/dist-preflight.log"; echo "FAILED: import"; exit 1; }

# 1 ---------------------------------------------------------------------------------------------
timeout 150 $PY -m pytest -q -s -m gpu "$T/test_dist_gpu.py" \
  packages/blutrain-tensor/tests/test_tensor_flat_buffers.py -p no:cacheprovider -o addopts="" \
  >"$OUT/dist-gpu-tests.log" 2>&1
rc=$?
line=$(grep -E "passed|failed|error" "$OUT/dist-gpu-tests.log" | tail -1)
if [ $rc -eq 0 ]; then S[1-nccl-world1-tests]="PASS $line"; else fail 1-nccl-world1-tests "rc=$rc $line"; fi
grep -E "^ZeRO-" "$OUT/dist-gpu-tests.log"

# 2 ---------------------------------------------------------------------------------------------
if [ "$(left)" -lt 240 ]; then S[2-two-ranks-worker]="SKIP $(left) s left"; FAILED=1; else
  rm -rf "$OUT/dist-mpi2" && mkdir -p "$OUT/dist-mpi2"
  timeout 150 "${MPIRUN[@]}" $PY "$T/dist_worker.py" "$OUT/dist-mpi2" \
    collectives_vs_numpy uneven_chunks_and_async training_matches_one_rank \
    >"$OUT/dist-mpi2.log" 2>&1
  rc=$?
  res=$($PY - "$OUT/dist-mpi2" <<'PYEOF'
import json, pathlib, sys
d = pathlib.Path(sys.argv[1])
ranks = [json.loads(p.read_text()) for p in sorted(d.glob("rank*.json"))]
bad = [(i, k) for i, r in enumerate(ranks) for k, v in r["results"].items() if v != "ok"]
n = sum(len(r["results"]) for r in ranks)
print(f"{'PASS' if len(ranks) == 2 and not bad else 'FAIL'} {n - len(bad)}/{n} ok, {len(ranks)} ranks, failed {bad}")
if ranks:
    figs = {k: v for k, v in ranks[0]["figures"].items() if "error" in k}
    print("   ", json.dumps(figs))
PYEOF
  )
  if [ $rc -eq 0 ] && [[ $res == PASS* ]]; then S[2-two-ranks-worker]="$res"; else
    fail 2-two-ranks-worker "rc=$rc ${res#FAIL }"; tail -30 "$OUT/dist-mpi2.log"; fi
fi

# 3 ---------------------------------------------------------------------------------------------
if [ "$(left)" -lt 200 ]; then S[3-two-ranks-gpt2-parity-fault]="SKIP $(left) s left"; FAILED=1; else
  # ~170 s (4 one-rank and 4 two-rank GPT-2 124M runs), leaving parts 4 and 5 about 100 s
  P3=$(( $(left) - 100 < 200 ? $(left) - 100 : 200 ))
  timeout $(( P3 + 20 )) $PY "$B/multi_gpu.py" --ranks 2 --parts parity,fault \
    --parity-plans det-ddp,det-zero1,det-zero2 --parity-steps 6 --parity-batch 4 --parity-seq 256 \
    --fault-steps 12 --fault-every 4 --budget-s $P3 --out "$OUT/two-ranks-gpt2" \
    >"$OUT/two-ranks-gpt2.log" 2>&1
  rc=$?
  sed -n '/multi_gpu summary/,$p' "$OUT/two-ranks-gpt2.log"
  if grep -q "SKIPPED" "$OUT/two-ranks-gpt2.log"; then
    fail 3-two-ranks-gpt2-parity-fault "a part did not fit in $P3 s (see above)"
  elif [ $rc -eq 0 ]; then S[3-two-ranks-gpt2-parity-fault]="PASS (see above)"
  else fail 3-two-ranks-gpt2-parity-fault "rc=$rc: $OUT/two-ranks-gpt2.log"; tail -25 "$OUT/two-ranks-gpt2.log"; fi
fi

# 4 ---------------------------------------------------------------------------------------------
if [ "$(left)" -lt 60 ]; then S[4-bench-collectives]="SKIP $(left) s left"; else
  timeout 60 $PY "$B/bench_dist.py" --json "$OUT/bench_dist.json" --max-bytes $((1 << 30)) \
    --min-seconds 0.01 >"$OUT/bench_dist.txt" 2>&1
  rc=$?
  S[4-bench-collectives]="rc=$rc (no figure fails the run)"
  tail -12 "$OUT/bench_dist.txt"
fi

# 5 ---------------------------------------------------------------------------------------------
if [ "$(left)" -lt 40 ]; then S[5-bench-gpt2]="SKIP $(left) s left"; else
  timeout $(( $(left) > 60 ? $(left) : 60 )) $PY "$B/bench_dist.py" --gpt2 \
    --configs bf16:plain,bf16:ddp,bf16:plain,bf16:ddp,bf16:zero1,bf16:zero2,bf16:torch,bf16:torch_ddp \
    --seconds 1.5 --deadline $(( $(date +%s) + $(left) - 25 )) --json "$OUT/bench_dist_gpt2.json" \
    >"$OUT/bench_dist_gpt2.txt" 2>&1
  rc=$?
  S[5-bench-gpt2]="rc=$rc $(grep -E 'costs' "$OUT/bench_dist_gpt2.txt" | tail -1)"
  grep -E "^gpt2|costs" "$OUT/bench_dist_gpt2.txt"
fi

grep -h -E "^(FAILED|ERROR)" "$OUT/dist-gpu-tests.log" | cut -c1-200 | head -20
echo "==================== blutrain-dist on one GPU ($(( $(date +%s) - START )) s) ===================="
for k in $(printf '%s\n' "${!S[@]}" | sort); do printf '%-34s %s\n' "$k" "${S[$k]}"; done
if [ $FAILED -ne 0 ]; then echo "FAILED: blutrain-dist GPU checks (see above and $OUT)"; exit 1; fi
echo "blutrain-dist GPU checks: all passed"
