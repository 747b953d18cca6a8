#!/usr/bin/env bash
# One call on a lent GPU machine (no TF there): GPU checks and timings of the CUDA
# backend, results under $OUT (JSON + logs).  Steps are named on the command line, run in
# that order, each under its own timeout and only while the call has time left, so a
# slow one cannot take the rest with it:
#
#   bash tools/gpu_device_run.sh [--budget SECONDS] STEP...
#
#   bench     tools/gpu_bench.py --size large: ours, eager PyTorch, torch.compile, one run
#   launcher  the C++ launcher through ctypes on PyTorch streams, refusals, CUDA graphs
#   triton    torch.compile's generated Triton source for the patterns in $PATTERNS
#   ncu       ncu (speed of light, occupancy, warp stalls) of our kernels for $PATTERNS
#   sweep     tools/gpu_sweep.py over column splits and rows per loop trip
#   tests     tests/test_codegen_cuda.py on the GPU (NUMBA_ENABLE_CUDASIM=0), those that
#             match $TESTS_K if set
set -u
OUT=${OUT:-/tmp/stitching_out}
BUDGET=540
if [ "${1:-}" = "--budget" ]; then BUDGET=$2; shift 2; fi
PATTERNS=${PATTERNS:-dien_masked_softmax,bn_swish,center_axis0}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD STITCHING_CACHE_DIR=/tmp/stitching_cache
PY=python3
# run STEP_TIMEOUT cmd...: only if the budget leaves that much, and under that timeout
step() {
  local t=$1; shift
  if [ $((SECONDS + t)) -gt "$BUDGET" ]; then
    echo "skipped (budget): $*"; return 0
  fi
  timeout "$t" "$@"
}
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu \
    --format=csv
  $PY -c "import sys, numba, torch, numba_cuda; print(sys.version.split()[0], 'numba', \
numba.__version__, 'numba_cuda', numba_cuda.__version__, 'torch', torch.__version__)"
  nvcc --version | tail -2
  $PY tools/gpu_bench.py --digest
} 2>&1 | tee "$OUT/env.log"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for s in "$@"; do
  echo "== $s at ${SECONDS}s"
  case $s in
    bench) step 330 $PY tools/gpu_bench.py --size large --json "$OUT/bench.json" \
             2>&1 | tee "$OUT/bench.log" ;;
    launcher) step 200 $PY tools/gpu_launcher_check.py --json "$OUT/launcher.json" \
             2>&1 | tee "$OUT/launcher.log" ;;
    triton) step 120 env TORCH_LOGS=output_code $PY tools/gpu_profile.py --torch-compile \
             --calls 3 ${PATTERNS//,/ } > "$OUT/triton.log" 2>&1
           grep -E "def triton|num_warps|XBLOCK|RBLOCK|R0_BLOCK|calls," "$OUT/triton.log" \
             | head -60 ;;
    ncu) if [ -n "$NCU" ]; then
           step 90 "$NCU" --clock-control none --kernel-name regex:^k_ --launch-count 12 \
             --section SpeedOfLight --section Occupancy --section LaunchStats \
             --section WarpStateStats $PY tools/gpu_profile.py --calls 1 ${PATTERNS//,/ } \
             > "$OUT/ncu.log" 2>&1
           grep -E "^  k_|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Theoretical Occ|Stall|cycles being stalled" \
             "$OUT/ncu.log" | head -80
         else echo "no ncu"; fi ;;
    sweep) { step 50 $PY tools/gpu_sweep.py center_axis0 squeeze_excite --threads 256 \
               --split 8,9,16,17
             step 50 $PY tools/gpu_sweep.py center_axis0 squeeze_excite --threads 256 \
               --split 8,16 --col-unroll 8; } 2>&1 | tee "$OUT/sweep.log" ;;
    tests) step 240 env NUMBA_ENABLE_CUDASIM=0 $PY -m pytest -q -x -p no:cacheprovider \
             tests/test_codegen_cuda.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tail -15 \
             | tee "$OUT/tests.log" ;;
    *) echo "unknown step $s" ;;
  esac
done
echo "device run done at ${SECONDS}s"
