#!/usr/bin/env python
"""Run a few patterns' CUDA kernels at the large size for a profiler (no PyTorch, no TF).

    python tools/gpu_profile.py softmax_tf layernorm_keras            # resources + timing
    ncu --kernel-name regex:^k_ --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats python tools/gpu_profile.py softmax_tf

For each pattern: the launch plan, and per compiled kernel the registers per thread,
local (spill) bytes per thread, static shared bytes and the most threads a block of it
can have; then ``--calls`` launches on the default stream.

``--torch-compile`` runs the pattern's torch.compile equivalent (tools/gpu_bench.py)
instead, on the same data, for a profiler to look at Triton's kernels (``ncu
--kernel-name regex:^triton``; ``TORCH_LOGS=output_code`` prints their source).
"""
from __future__ import annotations

import argparse
import sys
import time

import gpu_bench   # this folder is on sys.path when run as a script; it adds the repo


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("patterns", nargs="+")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--size", default="large", choices=["small", "large"])
    ap.add_argument("--torch-compile", action="store_true",
                    help="run the torch.compile equivalents instead of our kernels")
    args = ap.parse_args(argv)
    if args.torch_compile:
        return run_torch_compile(args)
    from numba import cuda

    from stitching.compile.cuda import compile_cuda_kernel
    from stitching.codegen.cuda.launch import describe
    for pat in gpu_bench.load_patterns(",".join(args.patterns)):
        for spec, names in gpu_bench.kernels(pat, args.size):
            k = compile_cuda_kernel(spec)
            arrays = gpu_bench.make_inputs(spec, names, pat, gpu_bench.batch_of(pat, args.size))
            dev = [cuda.to_device(a) for a in arrays]
            outs = k(*dev)
            cuda.synchronize()
            print(f"{pat['name']}: {describe(k.plan([a.shape for a in arrays]))}")
            for name, fn in k._specialized.items():
                print(f"  {name}: {fn.get_regs_per_thread()} registers/thread, "
                      f"{fn.get_local_mem_per_thread()} B local/thread, "
                      f"{fn.get_shared_mem_per_block()} B static shared, "
                      f"at most {fn.get_max_threads_per_block()} threads/block")
            t0 = time.perf_counter()
            for _ in range(args.calls):
                k(*dev, out=outs)
            cuda.synchronize()
            print(f"  {args.calls} calls: {(time.perf_counter() - t0) / args.calls * 1e6:.1f} "
                  f"µs each (wall, host overhead included)")
    return 0


def run_torch_compile(args) -> int:
    import torch
    eq = gpu_bench.torch_equivalents()
    for pat in gpu_bench.load_patterns(",".join(args.patterns)):
        spec, names = gpu_bench.kernels(pat, args.size)[0]
        arrays = gpu_bench.make_inputs(spec, names, pat, gpu_bench.batch_of(pat, args.size))
        dev = [torch.as_tensor(a, device="cuda") for a in arrays]
        fn = torch.compile(eq[pat["name"]])
        with torch.no_grad():
            fn(*dev)                       # compiles
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn(*dev)
            torch.cuda.synchronize()
        print(f"{pat['name']} (torch.compile): {args.calls} calls, "
              f"{(time.perf_counter() - t0) / args.calls * 1e6:.1f} µs each (wall)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
