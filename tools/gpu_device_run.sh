#!/usr/bin/env bash
# One call on a lent GPU machine (no TF there): every GPU check and timing of the CUDA
# backend, results under $OUT (JSON + logs).  Steps, most important first, each under its
# own timeout so a slow one cannot take the rest with it:
#   1. the launcher through ctypes on PyTorch streams, refusals, CUDA graphs
#   2. tools/gpu_bench.py --size large (ours, eager PyTorch, torch.compile in one run)
#   3. sweeps for the rules in codegen/cuda/launch.py (element-wise blocks; column
#      kernels with 8 rows per loop trip instead of 4)
#   4. registers / spills of the column kernels, and one ncu look at them where ncu runs
set -u
OUT=${OUT:-/tmp/stitching_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD STITCHING_CACHE_DIR=/tmp/stitching_cache
PY=python3
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu \
    --format=csv
  $PY -c "import sys, numba, torch, numba_cuda; print(sys.version.split()[0], 'numba', \
numba.__version__, 'numba_cuda', numba_cuda.__version__, 'torch', torch.__version__)"
  nvcc --version | tail -2
  $PY tools/gpu_bench.py --digest
} 2>&1 | tee "$OUT/env.log"

timeout 200 $PY tools/gpu_launcher_check.py --json "$OUT/launcher.json" 2>&1 \
  | tee "$OUT/launcher.log"
timeout 300 $PY tools/gpu_bench.py --size large --json "$OUT/bench.json" 2>&1 \
  | tee "$OUT/bench.log"
# the rest only while the call has time left (its limit is 600 s)
left() { [ "$SECONDS" -lt "$1" ]; }
{
  left 470 && timeout 50 $PY tools/gpu_sweep.py swiglu bn_swish --threads 128,256,512,1024
  left 500 && timeout 60 $PY tools/gpu_sweep.py center_axis0 squeeze_excite --threads 256 \
    --split 9,17,32 --col-unroll 8
  left 530 && timeout 20 $PY tools/gpu_profile.py center_axis0 --calls 3
} 2>&1 | tee "$OUT/sweep.log"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ] && left 540; then
  timeout 40 "$NCU" --clock-control none --kernel-name regex:^k_col --launch-skip 2 \
    --launch-count 2 --section SpeedOfLight --section Occupancy \
    $PY tools/gpu_profile.py center_axis0 --calls 3 2>&1 | tail -80 > "$OUT/ncu.log"
fi
echo "device run done"
