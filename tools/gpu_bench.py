#!/usr/bin/env python
"""CUDA backend bench: the pattern suite as serialized KernelSpecs, no TensorFlow needed.

    python tools/gpu_bench.py --simulator           # no GPU: small shapes, numba-cuda simulator
    python tools/gpu_bench.py --ptx [--cc 8.0]      # no GPU: compile every kernel to PTX (libnvvm)
    python tools/gpu_bench.py [--size large]        # on a GPU, with PyTorch for the baselines

Specs come from tools/gpu_patterns/*.json (written with TensorFlow by
tools/gpu_patterns/export.py from stitching.testing.patterns).  Every mode checks every
output against a float64 NumPy interpreter of the op table (stitching/codegen/cuda/ref.py,
written independently of the generated code) and exits 1 on any mismatch.

Inputs: activations (spec inputs with the unknown batch dim) are standard normal, the
pattern's boolean / 0-1 mask arguments are 90% true, static-shaped weights are uniform in
[0.5, 1.5] (so a variance stays positive).

On a GPU each pattern is also timed against a hand-written PyTorch equivalent, eager and
under torch.compile, on the same data; bandwidth is compulsory bytes (inputs read once +
outputs written once) / time, next to the device's measured copy bandwidth.

Timing is device time, the same way for every column: ``REPS`` back-to-back calls are
captured into one CUDA graph and the graph's replays are timed with CUDA events (median
of 7).  Successive calls cycle through several input/output sets so that one call's data
is out of L2 by its next use.  Device time is what the kernels cost once launched from
C++ (the TF op launches them so, docs/internals/gpu.md); the Python launch cost of
this harness, numba-cuda's dispatcher plus our shape checks, is a separate column
("host µs": wall time per call of back-to-back calls) and is not the product's cost.
A column whose capture fails falls back to events around back-to-back calls, marked '*'.
The simulator and --ptx modes measure no speed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PATTERNS = os.path.join(HERE, "gpu_patterns")
sys.path.insert(0, REPO)

SIM_BATCH = 1          # arbitrary: batch in --simulator (one Python thread per CUDA thread)
WEIGHT_LO, WEIGHT_HI = 0.5, 1.5
MASK_TRUE = 0.9


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--simulator", action="store_true",
                      help="run under NUMBA_ENABLE_CUDASIM=1 (no GPU), small shapes")
    mode.add_argument("--ptx", action="store_true",
                      help="compile every kernel to PTX with libnvvm (no GPU), report")
    ap.add_argument("--cc", default="8.0", help="--ptx: compute capability (e.g. 7.0, 9.0)")
    ap.add_argument("--kernels", default="", metavar="REGEX",
                    help="--ptx: only kernels whose name matches (re.search)")
    ap.add_argument("--size", default="large", choices=["small", "large"],
                    help="GPU mode: shapes to time (correctness is also checked at small)")
    ap.add_argument("--only", default="", help="comma-separated pattern names")
    ap.add_argument("--repeats", type=int, default=20, help="GPU mode: calls per host timing")
    ap.add_argument("--profile", default=None, help="v100 | a100 | h100 (default: detect)")
    ap.add_argument("--json", metavar="PATH", help="write the rows (and run facts) as JSON")
    ap.add_argument("--markdown", metavar="PATH",
                    help="GPU mode: write the 'gpu' section of this BENCHMARKS.md")
    ap.add_argument("--digest", action="store_true",
                    help="print the digest of stitching/ a GPU run records, and exit")
    ap.add_argument("--render", metavar="JSON",
                    help="no runs: write --markdown from a --json file of a GPU run")
    return ap.parse_args(argv)


# ---- the suite --------------------------------------------------------------------------

def load_patterns(only: str) -> list:
    names = [n for n in only.split(",") if n]
    pats = []
    for f in sorted(os.listdir(PATTERNS)):
        if f.endswith(".json"):
            with open(os.path.join(PATTERNS, f)) as fh:
                d = json.load(fh)
            if not names or d["name"] in names:
                pats.append(d)
    missing = set(names) - {p["name"] for p in pats}
    if missing:
        raise SystemExit(f"unknown pattern(s): {', '.join(sorted(missing))}")
    return pats


def kernels(pat, size) -> list:
    """[(KernelSpec, spec input names)] of one pattern at one size."""
    from stitching.ir.spec import KernelSpec
    return [(KernelSpec.from_dict(k["spec"]), k["inputs"]) for k in pat["kernels"][size]]


def make_inputs(spec, names, pat, batch, seed=0) -> list:
    import numpy as np
    rng = np.random.default_rng(seed)
    kinds = dict(zip(pat["args"], pat["input_kinds"]))
    out = []
    for t, name in zip(spec.inputs, names):
        shape = tuple(batch if d == -1 else d for d in t.shape)
        kind = kinds.get(name, "float" if -1 in t.shape else "weight")
        if t.dtype == "bool" or kind in ("bool", "mask01"):
            a = rng.random(shape) < MASK_TRUE
            a = a if t.dtype == "bool" else a.astype(t.dtype)
        elif kind == "weight":
            a = rng.uniform(WEIGHT_LO, WEIGHT_HI, shape).astype(t.dtype)
        else:
            a = rng.standard_normal(shape).astype(t.dtype)
        out.append(a)
    return out


def batch_of(pat, size) -> int:
    return pat["shapes"][size][0][0]


def check(kernel, spec, arrays, outs=None) -> float:
    """Worst error over the outputs, in units of the tolerance (<= 1 passes)."""
    from stitching.codegen.cuda.ref import compare, evaluate
    outs = kernel(*arrays) if outs is None else outs
    return max(compare(o, r) for o, r in zip(outs, evaluate(spec, arrays)))


# ---- --simulator ------------------------------------------------------------------------

def run_simulator(pats) -> list:
    from stitching.compile.cuda import compile_cuda_kernel
    from stitching.codegen.cuda.launch import describe
    rows = []
    for pat in pats:
        for i, (spec, names) in enumerate(kernels(pat, "small")):
            t0 = time.perf_counter()
            k = compile_cuda_kernel(spec)
            arrays = make_inputs(spec, names, pat, min(SIM_BATCH, batch_of(pat, "small")))
            err = check(k, spec, arrays)
            lau = k.plan([a.shape for a in arrays])
            rows.append({"pattern": pat["name"], "kernel": i, "kind": k.schedule.kind.value,
                         "shapes": [list(a.shape) for a in arrays], "error": err,
                         "ok": err <= 1.0, "launch": describe(lau),
                         "seconds": time.perf_counter() - t0})
            print(f"{pat['name']:<22} {'ok ' if err <= 1 else 'BAD'} err {err:6.3f}  "
                  f"{time.perf_counter() - t0:5.1f} s  {describe(lau)}", flush=True)
    return rows


# ---- --ptx ------------------------------------------------------------------------------

def allow_ptx_without_gpu() -> None:
    """numba-cuda asks NVRTC only for the list of supported architectures before
    handing the IR to libnvvm; with no NVRTC installed, answer that list ourselves."""
    from numba.cuda import cuda_paths
    from numba.cuda.cudadrv import nvrtc
    try:
        cuda_paths.get_cuda_paths()
    except Exception:   # noqa: BLE001 - NVRTC missing: the path lookup raises
        cuda_paths._get_nvrtc_path = lambda: cuda_paths._env_path_tuple("absent", None)
        nvrtc.get_supported_ccs = lambda: ((7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0))


# what the PTX says about each kernel: shuffles, barriers, local memory (spills or arrays
# not in registers), 16-byte global accesses
PTX_FEATURES = ("shfl.sync", "bar.sync", "ld.local", "ld.global.v4", "st.global.v4")


def run_ptx(pats, cc, only_kernels="") -> list:
    from numba import cuda
    from stitching.compile.cuda import compile_cuda_kernel
    allow_ptx_without_gpu()
    cc = tuple(int(x) for x in cc.split("."))
    rows = []
    for pat in pats:
        for spec, _ in kernels(pat, "small"):
            k = compile_cuda_kernel(spec, profile="a100")
            for name in k.source.kernels:
                if only_kernels and not re.search(only_kernels, name):
                    continue
                row = {"pattern": pat["name"], "kernel": name, "ok": True}
                try:
                    t0 = time.perf_counter()
                    ptx, _ = cuda.compile_ptx(getattr(k._module, name).py_func,
                                              k.signature(name), cc=cc)
                    row.update(seconds=time.perf_counter() - t0,
                               **{f: ptx.count(f) for f in PTX_FEATURES})
                    desc = " ".join(f"{f}={row[f]}" for f in PTX_FEATURES)
                    print(f"PTX {pat['name']:<22} {name:<12} ok   {desc}", flush=True)
                except Exception as e:   # noqa: BLE001 - report every kernel
                    row.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
                    print(f"PTX {pat['name']:<22} {name:<12} FAIL {row['error']}", flush=True)
                rows.append(row)
    return rows


# ---- GPU: timings against PyTorch ---------------------------------------------------------

def torch_equivalents():
    """Hand-written PyTorch for what each pattern's kernel computes; arguments are the
    spec inputs in spec order (see the JSON's "inputs").  gpu_bench checks each against
    the float64 reference, so a reordered export shows up as a torch mismatch."""
    import torch
    import torch.nn.functional as F

    def ln(x, g, b, eps):
        return F.layer_norm(x, x.shape[-1:], g, b, eps)

    def rms(x, w):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * w

    def lse(x):
        s = torch.logsumexp(x, -1)
        return [s - x.amax(-1), s]

    def bn_relu6(var, gamma, x, mean, beta):
        scale = gamma * torch.rsqrt(var + 1e-3)
        return torch.clamp(x * scale + (beta - mean * scale), 0.0, 6.0)

    return {
        "layernorm_manual": lambda x, g, b: ln(x, g, b, 1e-6),
        "layernorm_keras": lambda x, g, b: ln(x, g, b, 1e-6),
        "add_layernorm": lambda x, bias, r, g, b: ln(x + bias + r, g, b, 1e-12),
        "rmsnorm": rms,
        "softmax_tf": lambda x: torch.softmax(x, -1),
        "softmax_manual": lambda x: torch.softmax(x, -1),
        "attention_softmax": lambda m, s: torch.softmax(s * 0.125 + (1.0 - m) * -10000.0, -1),
        "log_softmax": lambda x: torch.log_softmax(x, -1),
        "logsumexp": lse,
        "bias_gelu_erf": lambda x, b: F.gelu(x + b),
        "bias_gelu_tanh": lambda x, b: F.gelu(x + b, approximate="tanh"),
        "bias_gelu_tanh_manual": lambda x, b: F.gelu(x + b, approximate="tanh"),
        "bias_gelu_residual": lambda x, b, r: F.gelu(x + b) + r,
        "swiglu": F.silu,
        "bn_swish": lambda x, g, b, m, v: F.silu((x - m) * torch.rsqrt(v + 1e-3) * g + b),
        "bn_relu6": bn_relu6,
        "squeeze_excite": lambda x: x * torch.sigmoid(x.mean((1, 2), keepdim=True)),
        "l2_normalize": lambda x: F.normalize(x, dim=-1, eps=1e-6),
        "center_axis0": lambda x: x - x.mean(0, keepdim=True),
        "dien_masked_softmax": lambda s, m: torch.softmax(
            torch.where(m, s, torch.full_like(s, -4294967296.0)), -1),
    }


REPS = 20              # calls per captured graph
ROTATE_BYTES = 256 << 20   # input/output sets cycled through: at least this much data


def host_per_call(fn, repeats) -> float:
    """Wall seconds per call of ``repeats`` back-to-back calls, one synchronize (best of 3)."""
    import torch
    fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best


def device_per_call(calls) -> tuple:
    """(device seconds per call, captured?) of ``REPS`` calls cycling through ``calls``
    (each a no-argument function that launches on torch's current stream)."""
    import statistics
    import torch

    def timed(fn, n) -> float:
        ts = []
        for _ in range(7):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) / 1e3 / n)
        return statistics.median(ts)

    def run_all():
        for i in range(REPS):
            calls[i % len(calls)]()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):          # warm-up off the default stream, as torch asks
        run_all()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run_all()
        g.replay()
        torch.cuda.synchronize()
        return timed(g.replay, REPS), True
    except Exception as e:   # noqa: BLE001 - not capturable: time the stream instead
        print(f"  (graph capture failed: {type(e).__name__}: {str(e)[:120]}; stream timing)")
        torch.cuda.synchronize()
        return timed(run_all, REPS), False


def copy_bandwidth() -> float:
    """Device-to-device copy of 256 MiB, bytes read + written per second."""
    import torch
    src = torch.empty(64 << 20, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    t, _ = device_per_call([lambda: dst.copy_(src)])
    return 2 * src.numel() * 4 / t


def gpu_meta(bw, size) -> dict:
    """What a GPU run ran on: device, versions, commit, date, command."""
    import subprocess

    import numba
    import torch
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "device": torch.cuda.get_device_name(), "copy_gbs": bw / 1e9, "size": size,
            "numba": numba.__version__, "torch": torch.__version__,
            "cuda": torch.version.cuda, "command": " ".join(["python"] + sys.argv)}
    for mod in ("numba_cuda", "triton"):
        try:
            meta[mod] = __import__(mod).__version__
        except Exception:   # noqa: BLE001 - not installed: leave it out
            pass
    try:
        meta["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    # a copied checkout's git metadata can be stale (the device machines'), so the run
    # names the sources it ran by content: `python tools/gpu_bench.py --digest` here
    meta["source_digest"] = source_digest()
    return meta


def source_digest() -> str:
    """sha256 (12 hex) of stitching/**/*.py, for matching a run to a commit."""
    import glob
    import hashlib
    h = hashlib.sha256()
    for f in sorted(glob.glob(os.path.join(REPO, "stitching", "**", "*.py"), recursive=True)):
        h.update(os.path.relpath(f, REPO).encode())
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:12]


def run_gpu(pats, size, repeats, profile, json_path=None) -> tuple:
    import torch
    from stitching.compile.cuda import compile_cuda_kernel
    from stitching.codegen.cuda.launch import describe
    eq = torch_equivalents()
    bw = copy_bandwidth()
    meta = gpu_meta(bw, size)
    print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e9:.0f} GB/s "
          f"(device time of a 256 MiB copy, read + write)")
    _print_gpu_header()
    rows = []
    for pat in pats:
        for spec, names in kernels(pat, size):
            k = compile_cuda_kernel(spec, profile=profile)
            small = kernels(pat, "small")[0]
            small_arrays = make_inputs(small[0], small[1], pat, batch_of(pat, "small"))
            err_small = check(compile_cuda_kernel(small[0], profile=profile), small[0],
                              small_arrays)
            try:
                row = _time_pattern(pat, spec, names, k, size, repeats, eq.get(pat["name"]),
                                    bw)
            except Exception as e:   # noqa: BLE001 - report the pattern, time the rest
                row = {"pattern": pat["name"], "ok": False, "kind": k.schedule.kind.value,
                       "error": f"{type(e).__name__}: {e}"[:300]}
                print(f"{pat['name']:<22} FAIL {row['error']}", flush=True)
                rows.append(row)
                continue
            row.update(error_small=err_small, launch=describe(k.plan(row.pop("_shapes"))))
            row["ok"] = row["ok"] and err_small <= 1.0
            rows.append(row)
            _print_gpu_row(row)
            if json_path:                  # after every row: a cut-off run keeps its rows
                _write_json(json_path, rows, meta)
    for line in summary_lines(rows):
        print(line)
    return rows, meta


def _time_pattern(pat, spec, names, k, size, repeats, tfn, bw) -> dict:
    import torch
    from numba import cuda
    arrays = make_inputs(spec, names, pat, batch_of(pat, size))
    dev = [cuda.to_device(a) for a in arrays]
    outs = k(*dev)
    ours = [o.copy_to_host() for o in outs]
    err = check(k, spec, arrays, outs=ours)
    nbytes = sum(a.nbytes for a in arrays) + sum(o.nbytes for o in ours)
    # several data sets (fresh random draws), cycled through by successive calls
    nsets = max(2, min(8, -(-ROTATE_BYTES // max(nbytes, 1))))
    sets = [(dev, outs)] + [([cuda.to_device(a) for a in
                              make_inputs(spec, names, pat, batch_of(pat, size), seed=s)],
                             [cuda.device_array_like(o) for o in outs])
                            for s in range(1, nsets)]

    def ours_call(d, o, launch=None):
        return lambda: k(*d, out=o, launch=launch, stream=cuda.external_stream(
            torch.cuda.current_stream().cuda_stream))

    t_ours, cap = device_per_call([ours_call(d, o) for d, o in sets])
    plan = k.plan([a.shape for a in arrays])
    scalar = None
    if any(step[0].endswith("_v4") for step in plan.steps):
        # the same launch with 4-byte accesses, for the record of what 16 bytes bought
        narrow = k.plan([a.shape for a in arrays], wide=False)
        scalar = device_per_call([ours_call(d, o, narrow) for d, o in sets])[0]
    row = {"pattern": pat["name"], "kind": k.schedule.kind.value, "error": err,
           "ok": err <= 1.0, "bytes": nbytes, "ours_s": t_ours, "ours_graph": cap,
           "ours_gbs": nbytes / t_ours / 1e9, "copy_gbs": bw / 1e9, "data_sets": nsets,
           "ours_host_s": host_per_call(ours_call(dev, outs), repeats),
           **({"ours_scalar_s": scalar} if scalar else {}),
           "_shapes": [a.shape for a in arrays]}
    if tfn is not None:
        tsets = [[torch.as_tensor(x, device="cuda") for x in d] for d, _ in sets]
        with torch.no_grad():
            got = tfn(*tsets[0])
            got = got if isinstance(got, (list, tuple)) else [got]
            row["torch_error"] = check(None, spec, arrays,
                                       outs=[g.detach().cpu().numpy() for g in got])
            if row["torch_error"] > 1.0:   # the timing compares different functions
                row["ok"] = False
                print(f"  {pat['name']}: the PyTorch equivalent disagrees with the "
                      f"reference (error {row['torch_error']:.3g} x tolerance)")
            row["torch_eager_s"], row["eager_graph"] = device_per_call(
                [(lambda t=t: tfn(*t)) for t in tsets])
            try:
                comp = torch.compile(tfn)
                for t in tsets:
                    comp(*t)
                row["torch_compile_s"], row["compile_graph"] = device_per_call(
                    [(lambda t=t: comp(*t)) for t in tsets])
            except Exception as e:   # noqa: BLE001 - no Triton / compiler: report, go on
                row["torch_compile_error"] = f"{type(e).__name__}: {e}"[:200]
    return row


def _write_json(path, rows, meta=None) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta or {}, "rows": rows} if meta is not None else rows, f,
                  indent=1, default=str)


def _print_gpu_header() -> None:
    print(f"{'pattern':<22} ok  {'ours µs':>8} {'eager µs':>9} {'compile µs':>10} "
          f"{'GB/s':>6} {'%copy':>5} {'host µs':>8}  launch")


def _print_gpu_row(r) -> None:
    def us(key, graph):
        if key not in r:
            return "n/a"
        return f"{r[key] * 1e6:.1f}" + ("" if r.get(graph, True) else "*")
    print(f"{r['pattern']:<22} {'ok ' if r['ok'] else 'BAD'} {us('ours_s', 'ours_graph'):>8} "
          f"{us('torch_eager_s', 'eager_graph'):>9} {us('torch_compile_s', 'compile_graph'):>10} "
          f"{r['ours_gbs']:6.0f} {100 * r['ours_gbs'] / r['copy_gbs']:5.0f} "
          f"{r['ours_host_s'] * 1e6:8.1f}  {r['launch']}", flush=True)


def _geomean(rows, key) -> tuple:
    """(geomean of ``key`` time / our time, patterns counted)."""
    xs = [r[key] / r["ours_s"] for r in rows if key in r and "ours_s" in r]
    return (math.exp(sum(map(math.log, xs)) / len(xs)), len(xs)) if xs else (math.nan, 0)


def summary_lines(rows) -> list:
    """Geomean speedups, bandwidth and the ceiling, then issue 42's bars."""
    ge, ne = _geomean(rows, "torch_eager_s")
    gc, nc = _geomean(rows, "torch_compile_s")
    out = [f"geomean speedup: {ge:.2f}x over PyTorch eager ({ne} patterns), "
           f"{gc:.2f}x over torch.compile ({nc})"]
    timed = [r for r in rows if "ours_gbs" in r and "torch_compile_s" in r]
    if timed:
        # every pattern at the copy bandwidth: the most any kernel of these bytes can do
        ceil = math.exp(sum(math.log(r["torch_compile_s"] * r["copy_gbs"] * 1e9 / r["bytes"])
                            for r in timed) / len(timed))
        out.append(f"ceiling: every pattern at the copy bandwidth would be {ceil:.2f}x "
                   f"torch.compile (geomean over {len(timed)})")
    pct = sorted((100 * r["ours_gbs"] / r["copy_gbs"], r["pattern"]) for r in rows
                 if "ours_gbs" in r)
    if pct:
        out.append(f"bandwidth: worst {pct[0][0]:.0f}% of copy ({pct[0][1]}), median "
                   f"{pct[len(pct) // 2][0]:.0f}%, {sum(p >= 80 for p, _ in pct)} of "
                   f"{len(pct)} at 80% or more")
    worst = min(((r["torch_compile_s"] / r["ours_s"], r["pattern"]) for r in timed),
                default=None)

    def verdict(ok, text):
        return f"{'PASS' if ok else 'FAIL'} {text}"
    out.append(verdict(gc >= 1.3, f"geomean >= 1.3x torch.compile: {gc:.2f}x"))
    if worst:
        below = sum(r["torch_compile_s"] / r["ours_s"] < 0.9 for r in timed)
        out.append(verdict(worst[0] >= 0.9, f"none below 0.9x torch.compile: {below} below, "
                           f"worst {worst[0]:.2f}x ({worst[1]})"))
    if pct:
        out.append(verdict(pct[0][0] >= 80, f"every pattern >= 80% of copy bandwidth: "
                           f"worst {pct[0][0]:.0f}% ({pct[0][1]})"))
    return out


def markdown_section(rows, meta) -> str:
    """The 'gpu' section of BENCHMARKS.md."""
    from bench_lib.output import render_markdown

    def us(r, key, graph):
        return f"{r[key] * 1e6:.1f}" + ("" if r.get(graph, True) else "*") if key in r \
            else "n/a"
    versions = ", ".join(f"{k} {meta[k]}" for k in ("numba", "numba_cuda", "torch", "triton",
                                                    "cuda", "driver") if meta.get(k))
    out = ["<!-- suite:gpu -->", "## gpu (CUDA backend, pattern suite, no TensorFlow)", "",
           f"Measured {meta.get('date')} on {meta.get('device')} ({versions}); stitching "
           f"`{meta.get('rev') or meta.get('source_digest', '?')}`; command "
           f"`{meta.get('command', '')}`. Copy bandwidth "
           f"{meta.get('copy_gbs', 0):.0f} GB/s (device-to-device copy of 256 MiB, bytes "
           f"read + written).", "",
           "Device time per call, every column timed the same way: back-to-back calls "
           "captured into one CUDA graph, replays timed with CUDA events (median of 7), "
           "successive calls cycling through enough input/output sets to leave L2. PyTorch "
           "columns are hand-written equivalents of each pattern on the same data (checked "
           "against the same float64 reference as ours). \"host µs\" is this harness's "
           "Python launch cost per call (numba-cuda dispatch and shape checks), which the "
           "TF op would not pay (docs/internals/gpu.md). BW: compulsory bytes / our time. \"4-byte "
           "accesses\": the same launch with the scalar-access kernel, where ours used a "
           "16-byte one.", ""]
    header = ["pattern", "kind", "ours µs", "eager µs", "compile µs", "vs eager",
              "vs compile", "BW % copy", "ours, 4-byte accesses µs", "host µs", "launch"]
    body = []
    for r in rows:
        if "ours_s" not in r:
            body.append([r["pattern"], r.get("kind", ""), "FAIL", "", "", "", "", "", "",
                         "", r.get("error", "")])
            continue
        ratio = [f"{r[k] / r['ours_s']:.2f}x" if k in r else "n/a"
                 for k in ("torch_eager_s", "torch_compile_s")]
        launch = r.get("launch", "").split(" [")[0]
        body.append([r["pattern"], r["kind"], us(r, "ours_s", "ours_graph"),
                     us(r, "torch_eager_s", "eager_graph"),
                     us(r, "torch_compile_s", "compile_graph"), *ratio,
                     f"{100 * r['ours_gbs'] / r['copy_gbs']:.0f}%",
                     us(r, "ours_scalar_s", "ours_graph"),
                     f"{r['ours_host_s'] * 1e6:.0f}", launch])
    out.append(render_markdown(header, body))
    out.append("")
    for line in summary_lines(rows):
        out.append(f"- **{line[:4]}** {line[5:]}" if line[:4] in ("PASS", "FAIL")
                   else f"- {line}")
    out.append("<!-- /suite:gpu -->")
    return "\n".join(out)


def write_markdown(path, rows, meta) -> None:
    from bench_lib.output import replace_sections
    replace_sections(path, {"gpu": markdown_section(rows, meta)})


# ---- main ---------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    if args.digest:
        print(source_digest())
        return 0
    if args.render:
        with open(args.render) as f:
            data = json.load(f)
        if not args.markdown or not isinstance(data, dict):
            raise SystemExit("--render needs --markdown and a JSON written by a GPU run")
        write_markdown(args.markdown, data["rows"], data["meta"])
        return 0
    if args.simulator:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"    # before numba.cuda is first imported
    pats = load_patterns(args.only)
    t0 = time.perf_counter()
    meta = None
    if args.simulator:
        rows = run_simulator(pats)
    elif args.ptx:
        rows = run_ptx(pats, args.cc, args.kernels)
    else:
        rows, meta = run_gpu(pats, args.size, args.repeats, args.profile, args.json)
        if args.markdown:
            write_markdown(args.markdown, rows, meta)
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)}/{len(rows)} ok in {time.perf_counter() - t0:.1f} s"
          + (f"; FAILED: {', '.join(sorted({r['pattern'] for r in bad}))}" if bad else ""))
    if args.json:
        _write_json(args.json, rows, meta)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
