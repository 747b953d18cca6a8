#!/usr/bin/env python
"""The GPU launcher (stitching/runtime/gpu/launcher.cc) on a GPU, through ctypes, on
streams that PyTorch owns; and whole functions as one CUDA graph.

    python tools/gpu_launcher_check.py [--json PATH]          # on a GPU (PyTorch, no TF)
    python tools/gpu_launcher_check.py --dry                  # no GPU: PTX + plans only

1. Each pattern's kernel, launched by the launcher (PTX from numba-cuda loaded with
   cuModuleLoadDataEx, cuLaunchKernel on a PyTorch stream), into outputs poisoned with
   NaN: equal bit for bit to numba-cuda's own launch of the same kernel, within
   tolerance of the float64 reference (codegen/cuda/ref.py), and within float rounding
   of the numba-cuda simulator's result (run in a subprocess: the simulator and the
   driver cannot share a process).  A misaligned input view runs the scalar-access twin.
2. Wrong calls refused: another dtype, another rank, a wrong static dim, a spec that
   was never registered.
3. CUDA graphs (the PyGraph idea): the kernels of a function (a chain of patterns at
   small sizes, N launches) recorded once, then run per call either as N launches or
   as one graph replay; host wall time per call (launch overhead) and device time per
   call, both ways.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import gpu_bench   # this folder is on sys.path when run as a script; it adds the repo

CHECKS = {            # pattern -> size: the column ones large, so the reduced axis splits
    "softmax_tf": "small", "layernorm_keras": "small", "logsumexp": "small",
    "dien_masked_softmax": "small", "bias_gelu_erf": "small", "bn_swish": "small",
    "center_axis0": "large", "squeeze_excite": "large",
}
# a function of many small kernels: a Transformer block's memory-bound part, twice
CHAIN = ["add_layernorm", "attention_softmax", "bias_gelu_erf", "add_layernorm",
         "layernorm_keras", "softmax_tf", "bias_gelu_tanh", "rmsnorm"] * 2
SIM_BATCH = 1
CALLS = 200


def simulator_outputs(path) -> None:
    """Child process: the simulator's outputs of every CHECKS pattern at SIM_BATCH."""
    import numpy as np
    from stitching.compile.cuda import compile_cuda_kernel
    res = {}
    for pat in gpu_bench.load_patterns(",".join(CHECKS)):
        spec, names = gpu_bench.kernels(pat, "small")[0]
        arrays = gpu_bench.make_inputs(spec, names, pat, SIM_BATCH, seed=7)
        for i, o in enumerate(compile_cuda_kernel(spec)(*arrays)):
            res[f"{pat['name']}:{i}"] = o
    np.savez(path, **res)


def device_buffers(arrays):
    import torch
    return [torch.as_tensor(a).cuda() for a in arrays]


def run_launcher(L, k, arrays, stream, offset=False):
    """The kernel on ``arrays`` through the launcher; NumPy outputs."""
    import torch
    shapes = [a.shape for a in arrays]
    info = L.prepare(k, shapes)
    ins = device_buffers(arrays)
    if offset:   # the same values 4 bytes into a larger buffer: not 16-byte aligned
        ins = [_misaligned(t) for t in ins]
    outs = [torch.full(s, float("nan") if d.startswith("float") else 0,
                       dtype=_torch_dtype(d), device="cuda")
            for s, d in zip(info["out_shapes"], k.out_dtypes)]
    temp = torch.empty(max(1, info["temp_bytes"]), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    L.launch(k.spec.hash, k.in_dtypes, shapes, [t.data_ptr() for t in ins], k.out_dtypes,
             [o.data_ptr() for o in outs], temp.data_ptr(), info["temp_bytes"],
             stream.cuda_stream)
    stream.synchronize()
    return [o.cpu().numpy() for o in outs], info


def _misaligned(t):
    import torch
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")
    flat[1:].copy_(t.reshape(-1))
    return flat[1:].view(t.shape)


def _torch_dtype(name):
    import torch
    return {"float32": torch.float32, "float64": torch.float64, "int32": torch.int32,
            "int64": torch.int64, "float16": torch.float16, "bool": torch.bool}[name]


def check_patterns(L, stream, sim) -> list:
    import numpy as np
    from numba import cuda
    from stitching.compile.cuda import compile_cuda_kernel
    rows = []
    for pat in gpu_bench.load_patterns(",".join(CHECKS)):
        size = CHECKS[pat["name"]]
        spec, names = gpu_bench.kernels(pat, size)[0]
        k = compile_cuda_kernel(spec)
        arrays = gpu_bench.make_inputs(spec, names, pat, gpu_bench.batch_of(pat, size), seed=3)
        t0 = time.perf_counter()
        ours, info = run_launcher(L, k, arrays, stream)
        prep = time.perf_counter() - t0
        numba_outs = [o.copy_to_host() for o in k(*[cuda.to_device(a) for a in arrays])]
        same = all(np.array_equal(a, b, equal_nan=True) for a, b in zip(ours, numba_outs))
        err = gpu_bench.check(None, spec, arrays, outs=ours)
        mis, _ = run_launcher(L, k, arrays, stream, offset=True)
        mis_same = all(np.array_equal(a, b, equal_nan=True) for a, b in zip(mis, ours)) \
            or gpu_bench.check(None, spec, arrays, outs=mis) <= 1.0
        spec_s, names_s = gpu_bench.kernels(pat, "small")[0]
        ks = compile_cuda_kernel(spec_s)
        small = gpu_bench.make_inputs(spec_s, names_s, pat, SIM_BATCH, seed=7)
        got, _ = run_launcher(L, ks, small, stream)
        sim_err = max(_close(g, sim[f"{pat['name']}:{i}"]) for i, g in enumerate(got))
        row = {"pattern": pat["name"], "size": size, "shapes": [list(a.shape) for a in arrays],
               "plan": describe(info["launch"]), "temp_bytes": info["temp_bytes"],
               "equal_numba": same, "error_vs_float64": err, "misaligned_ok": mis_same,
               "sim_error": sim_err, "prepare_s": prep,
               "ok": same and err <= 1.0 and mis_same and sim_err <= 1.0}
        rows.append(row)
        print(f"launcher {pat['name']:<20} {'ok ' if row['ok'] else 'BAD'} "
              f"=numba {same} err {err:.3f} sim {sim_err:.3f} misaligned {mis_same} "
              f"temp {info['temp_bytes']} B  {row['plan']}", flush=True)
    return rows


def _close(a, b) -> float:
    """Worst |a - b| / (1e-5 |b| + 1e-6), NaN where either is NaN and the other not."""
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape or (np.isnan(a) != np.isnan(b)).any():
        return float("inf")
    ok = ~np.isnan(a)
    return float((np.abs(a - b)[ok] / (1e-5 * np.abs(b[ok]) + 1e-6)).max(initial=0.0))


def describe(launch):
    from stitching.codegen.cuda.launch import describe as d
    return d(launch).split(" [")[0]


def check_refusals(L, stream) -> list:
    from stitching.compile.cuda import compile_cuda_kernel
    from stitching.runtime.gpu_launcher import LauncherError
    import torch
    pat = gpu_bench.load_patterns("softmax_tf")[0]
    spec, names = gpu_bench.kernels(pat, "small")[0]
    k = compile_cuda_kernel(spec)
    arrays = gpu_bench.make_inputs(spec, names, pat, 4)
    info = L.prepare(k, [a.shape for a in arrays])
    x = device_buffers(arrays)[0]
    out = torch.empty(info["out_shapes"][0], device="cuda")
    shape = arrays[0].shape
    cases = {"float64 input": (k.spec.hash, ["float64"], [shape]),
             "rank 3 input": (k.spec.hash, ["float32"], [shape + (1,)]),
             "wrong static dim": (k.spec.hash, ["float32"], [(shape[0], shape[1] + 4)]),
             "unregistered spec": ("0" * 24, ["float32"], [shape])}
    rows = []
    for what, (h, dts, shapes) in cases.items():
        try:
            L.launch(h, dts, shapes, [x.data_ptr()], k.out_dtypes, [out.data_ptr()], 0, 0,
                     stream.cuda_stream)
            msg, ok = "launched", False
        except LauncherError as e:
            msg, ok = str(e), True
        rows.append({"case": what, "refused": ok, "message": msg})
        print(f"refusal  {what:<20} {'ok ' if ok else 'BAD'} {msg}", flush=True)
    return rows


def check_graphs(L, stream, batch) -> dict:
    """A function of len(CHAIN) kernels at ``batch``: per call, direct launches vs one
    graph replay (host wall time of CALLS back-to-back calls, then device time)."""
    import torch
    from stitching.compile.cuda import compile_cuda_kernel
    fn = L.function()
    keep, launches = [], 0
    for name in CHAIN:
        pat = gpu_bench.load_patterns(name)[0]
        spec, names = gpu_bench.kernels(pat, "small")[0]
        k = compile_cuda_kernel(spec)
        arrays = gpu_bench.make_inputs(spec, names, pat, batch)
        shapes = [a.shape for a in arrays]
        info = L.prepare(k, shapes)
        ins = device_buffers(arrays)
        outs = [torch.empty(s, dtype=_torch_dtype(d), device="cuda")
                for s, d in zip(info["out_shapes"], k.out_dtypes)]
        temp = torch.empty(max(1, info["temp_bytes"]), dtype=torch.uint8, device="cuda")
        fn.add(k.spec.hash, shapes, [t.data_ptr() for t in ins], [o.data_ptr() for o in outs],
               temp.data_ptr())
        keep.append((ins, outs, temp))
        launches += len(info["launch"].steps)
    s = stream.cuda_stream
    res = {"kernels": len(CHAIN), "launches": launches, "batch": batch}
    for graph in (False, True):
        fn.run(s, graph)                 # warm-up (and the capture, for the graph)
        stream.synchronize()
        before = [o.clone() for _, outs, _ in keep for o in outs]
        walls, devs = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(CALLS):
                fn.run(s, graph)
            walls.append((time.perf_counter() - t0) / CALLS)   # enqueue cost per call
            stream.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(stream)
            for _ in range(CALLS):
                fn.run(s, graph)
            e1.record(stream)
            e1.synchronize()
            devs.append(e0.elapsed_time(e1) / 1e3 / CALLS)
        after = [o for _, outs, _ in keep for o in outs]
        same = all(torch.equal(a, b) or torch.allclose(a, b, equal_nan=True)
                   for a, b in zip(before, after))
        key = "graph" if graph else "direct"
        res[f"{key}_host_us"] = statistics.median(walls) * 1e6
        res[f"{key}_device_us"] = statistics.median(devs) * 1e6
        res[f"{key}_same_outputs"] = bool(same)
    res["saved_host_us_per_call"] = res["direct_host_us"] - res["graph_host_us"]
    res["saved_host_us_per_launch"] = res["saved_host_us_per_call"] / launches
    res["saved_device_us_per_call"] = res["direct_device_us"] - res["graph_device_us"]
    print(f"graphs   batch {batch}: {launches} launches per call; host µs/call direct "
          f"{res['direct_host_us']:.1f} graph {res['graph_host_us']:.1f}; device µs/call "
          f"direct {res['direct_device_us']:.1f} graph {res['graph_device_us']:.1f}",
          flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--dry", action="store_true", help="no GPU: PTX and plans only")
    ap.add_argument("--sim-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.sim_child:
        simulator_outputs(args.sim_child)
        return 0
    from stitching.runtime import gpu_launcher as gl
    if args.dry:
        gpu_bench.allow_ptx_without_gpu()
        from stitching.compile.cuda import compile_cuda_kernel
        L = gl.Launcher(gl.build(), cc=(9, 0))
        for pat in gpu_bench.load_patterns(",".join(set(CHECKS) | set(CHAIN))):
            for size in ("small", "large"):
                spec, names = gpu_bench.kernels(pat, size)[0]
                k = compile_cuda_kernel(spec, profile="h100")
                arrays = gpu_bench.make_inputs(spec, names, pat, gpu_bench.batch_of(pat, size))
                info = L.prepare(k, [a.shape for a in arrays])
                print(f"dry {pat['name']:<22} {size:<6} temp {info['temp_bytes']:>8} B  "
                      f"{describe(info['launch'])}", flush=True)
        return 0
    import numpy as np
    import torch
    sim_path = "/tmp/stitching_sim_outputs.npz"
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, __file__, "--sim-child", sim_path],
                             env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"))
    L = gl.Launcher(gl.build(), cc=torch.cuda.get_device_capability())
    stream = torch.cuda.Stream()
    refusals = check_refusals(L, stream)
    if child.wait() != 0:
        print("simulator child failed")
        return 1
    sim = dict(np.load(sim_path))
    rows = check_patterns(L, stream, sim)
    graphs = [check_graphs(L, stream, b) for b in (1, 64)]
    ok = all(r["ok"] for r in rows) and all(r["refused"] for r in refusals) and \
        all(g["graph_same_outputs"] for g in graphs)
    print(f"launcher check {'PASS' if ok else 'FAIL'} in {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "patterns": rows,
                       "refusals": refusals, "graphs": graphs}, f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
