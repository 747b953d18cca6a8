#!/usr/bin/env python
"""Sweep a kernel's launch on a GPU: threads per block x threads per row (row kernels)
or x ways the reduced axis is split (column kernels).

    python tools/gpu_sweep.py softmax_tf attention_softmax [--threads 128,256,512]
    python tools/gpu_sweep.py swiglu --threads 128,256,512,1024       # element-wise

For each pattern at the large size, every (block, tpr or split) pair that the kernel
accepts is checked against the float64 reference once and timed the way gpu_bench.py times (device
time of a captured graph of back-to-back calls, rotating data); the default plan's time
is printed next to the best.  Data for the rule in stitching/codegen/cuda/launch.py.
"""
from __future__ import annotations

import argparse
import sys

import gpu_bench   # this folder is on sys.path when run as a script; it adds the repo


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("patterns", nargs="+")
    ap.add_argument("--threads", default="128,256,512")
    ap.add_argument("--tpr", default="4,8,16,32,64,128", help="row kernels")
    ap.add_argument("--split", default="1,2,4,9,16,32", help="column kernels")
    ap.add_argument("--variant", default=None,
                    help="row kernels: chunks | regs | smem | global | looped (the "
                         "looped kernels' own choice; default: the planner's)")
    ap.add_argument("--col-unroll", type=int, default=None,
                    help="experiment: column kernels with this many rows per loop trip "
                         "(emitter.COL_UNROLL) instead of the emitter's")
    args = ap.parse_args(argv)
    if args.col_unroll:
        from stitching.codegen.cuda import emitter
        emitter.COL_UNROLL = args.col_unroll   # before any kernel is generated
    import torch
    from numba import cuda

    from stitching.compile.cuda import compile_cuda_kernel
    bad = 0
    for pat in gpu_bench.load_patterns(",".join(args.patterns)):
        spec, names = gpu_bench.kernels(pat, "large")[0]
        k = compile_cuda_kernel(spec)
        batch = gpu_bench.batch_of(pat, "large")
        sets = []
        for seed in range(3):
            arrays = gpu_bench.make_inputs(spec, names, pat, batch, seed=seed)
            dev = [cuda.to_device(a) for a in arrays]
            sets.append((arrays, dev, k(*dev)))
        shapes = [a.shape for a in sets[0][0]]

        def timed(launch):
            def call(d, o):
                return lambda: k(*d, out=o, launch=launch, stream=cuda.external_stream(
                    torch.cuda.current_stream().cuda_stream))
            return gpu_bench.device_per_call([call(d, o) for _, d, o in sets])[0]

        default = k.plan(shapes)
        results = [("default", default.strategy, timed(default))]
        # row kernels: threads per row; column kernels: ways the reduced axis is split;
        # element-wise kernels: threads per block alone
        kind = k.schedule.kind.value
        second = ("split", args.split) if kind == "column" else \
            ("tpr", args.tpr) if kind == "row" else ("threads", "0")
        for th in map(int, args.threads.split(",")):
            for v in map(int, second[1].split(",")):
                if second[0] == "tpr" and v > th:
                    continue
                try:
                    force = {"threads": th} if kind == "elementwise" else \
                        {"threads": th, second[0]: v}
                    if second[0] == "tpr" and args.variant == "looped":
                        force["chunks"] = False
                    elif second[0] == "tpr" and args.variant:
                        force["variant"] = args.variant
                    lau = k.plan(shapes, **force)
                    outs = k(*sets[0][1], launch=lau)
                    err = gpu_bench.check(None, spec, sets[0][0],
                                          outs=[o.copy_to_host() for o in outs])
                except ValueError as e:     # more threads than the compiled kernel allows
                    print(f"  {pat['name']} threads={th} {second[0]}={v}: {e}")
                    continue
                if err > 1.0:
                    bad += 1
                    print(f"  {pat['name']} {force}: BAD error {err:.3g}")
                    continue
                results.append((" ".join(f"{a}={b}" for a, b in force.items()), lau.strategy,
                                timed(lau)))
        best = min(results[1:] or results, key=lambda r: r[2])
        print(f"{pat['name']}: default {results[0][2] * 1e6:.1f} µs ({results[0][1]}); "
              f"best {best[2] * 1e6:.1f} µs at {best[0]} ({best[1]})")
        for name, _, t in sorted(results, key=lambda r: r[2]):
            print(f"    {t * 1e6:8.1f} µs  {name}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
