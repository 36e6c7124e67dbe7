#!/usr/bin/env bash
# blutrain-dist on the GPU machine, in one device call (~5 minutes on one H200):
#   1. world size 1 over NCCL: tests/test_dist_gpu.py (every collective and dtype, the comm
#      stream's ordering, the divide / ordered-sum kernels against numpy, DDP and ZeRO-1/2
#      bitwise equal to the plain step, bf16 ZeRO memory against 2 + 2 + 12 bytes/param);
#   2. two ranks on one GPU over the MPI backend (mpirun; staged through pinned memory): the
#      collectives against numpy, DDP / ZeRO against one rank, and the deterministic digests of
#      1 and 2 ranks (must be equal);
#   3. bench_dist.py: collective bandwidth next to torch.distributed's NCCL (world size 1);
#   4. bench_dist.py --gpt2: GPT-2 124M bf16 B16 T1024, plain / DDP / ZeRO-1 / ZeRO-2 / torch /
#      torch DDP at world size 1 (DDP must cost <= 2% of the plain step).
# Run after scripts/gpu.sh has built or installed alloc linalg tensor dist (it does, in that
# order), e.g.  bash scripts/gpu.sh --prebuilt --tests dist --bench dist  then this script, or
# from scripts/gpu.sh --dist.  Logs and JSON go to $OUT (default ./out).
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTHONPATH=$PWD/packages/blutrain-models/python${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
T=packages/blutrain-dist/tests
B=packages/blutrain-dist/bench
START=$(date +%s)
declare -A S

MPIRUN=(mpirun)
if mpirun --version 2>&1 | grep -q "Open MPI"; then
  MPIRUN=(mpirun --oversubscribe -x PYTHONPATH -x NCCL_NVLS_ENABLE -x OMP_NUM_THREADS
          -x BLUTRAIN_TEST_DEVICE -x BLUTRAIN_TEST_TIMEOUT -x LD_LIBRARY_PATH)
fi

# 1 ---------------------------------------------------------------------------------------------
# (with blutrain-tensor's stream / event / record_stream tests, which dist relies on)
timeout 240 $PY -m pytest -q -s -m gpu "$T/test_dist_gpu.py" \
  packages/blutrain-tensor/tests/test_tensor_flat_buffers.py -p no:cacheprovider -o addopts="" \
  >"$OUT/dist-gpu-tests.log" 2>&1
S[1-nccl-world1-tests]="rc=$? $(tail -1 "$OUT/dist-gpu-tests.log")"
grep -E "^ZeRO-" "$OUT/dist-gpu-tests.log"

# 2 ---------------------------------------------------------------------------------------------
export BLUTRAIN_TEST_DEVICE=cuda BLUTRAIN_TEST_TIMEOUT=120
CASES="collectives_vs_numpy uneven_chunks_and_async bad_arguments training_matches_one_rank deterministic_bitwise"
for n in 1 2; do
  rm -rf "$OUT/dist-mpi$n" && mkdir -p "$OUT/dist-mpi$n"
  timeout 200 "${MPIRUN[@]}" -n $n $PY "$T/dist_worker.py" "$OUT/dist-mpi$n" $CASES \
    >"$OUT/dist-mpi$n.log" 2>&1
  S[2-mpi-$n-ranks-one-gpu]="rc=$? $(
    $PY - "$OUT/dist-mpi$n" <<'PYEOF'
import json, pathlib, sys
d = pathlib.Path(sys.argv[1])
ranks = [json.loads(p.read_text()) for p in sorted(d.glob("rank*.json"))]
if not ranks:
    print("no results"); sys.exit()
bad = [(i, k) for i, r in enumerate(ranks) for k, v in r["results"].items() if v != "ok"]
print(f"{sum(len(r['results']) for r in ranks) - len(bad)} ok, failed: {bad}")
(d / "figures.json").write_text(json.dumps(ranks[0]["figures"], indent=1))
PYEOF
  )"
done
unset BLUTRAIN_TEST_DEVICE
S[2-deterministic-1-vs-2-ranks]=$($PY - "$OUT" <<'PYEOF'
import json, pathlib, sys
o = pathlib.Path(sys.argv[1])
try:
    f1 = json.loads((o / "dist-mpi1/figures.json").read_text())
    f2 = json.loads((o / "dist-mpi2/figures.json").read_text())
    print({m: f1[f"deterministic {m} digest"] == f2[f"deterministic {m} digest"] for m in ("ddp", "zero1", "zero2")})
except Exception as e:
    print("missing:", e)
PYEOF
)

# 3 ---------------------------------------------------------------------------------------------
timeout 150 $PY "$B/bench_dist.py" --json "$OUT/bench_dist.json" --max-bytes $((1 << 30)) \
  >"$OUT/bench_dist.txt" 2>&1
S[3-bench-collectives]="rc=$?"
# 4 ---------------------------------------------------------------------------------------------
timeout 240 $PY "$B/bench_dist.py" --gpt2 --json "$OUT/bench_dist_gpt2.json" \
  >"$OUT/bench_dist_gpt2.txt" 2>&1
S[4-bench-gpt2]="rc=$?"

for f in "$OUT/bench_dist.txt" "$OUT/bench_dist_gpt2.txt"; do echo "---- $f"; tail -40 "$f"; done
grep -h -E "^(FAILED|ERROR)" "$OUT/dist-gpu-tests.log" | cut -c1-200 | head -20
echo "==================== blutrain-dist GPU ($(( $(date +%s) - START )) s) ===================="
for k in $(printf '%s\n' "${!S[@]}" | sort); do printf '%-32s %s\n' "$k" "${S[$k]}"; done
