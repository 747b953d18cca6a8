"""Where a cold kernel's compile time goes, Numba backend against the direct LLVM one.

    python tools/compile_phases.py collect DIR --model transformer --model llama_decoder
    python tools/compile_phases.py collect DIR --cache CACHE_DIR   # a cold run's kernels
    python tools/compile_phases.py time DIR [--rounds 3]
    python tools/compile_phases.py speed [--rounds 7]
    python tools/compile_phases.py tiers MODEL [--rounds 3] [--calls 20] [--batch 1]
    python tools/compile_phases.py tier1 [--size large] [--calls 10] PATTERN...
    python tools/compile_phases.py window MODEL [--batch 1]

``collect`` writes the generated kernel modules (``<code>.py``) of the models' cold
first call (traced and planned, stopped before compiling, as tools/cold_profile.py
does), or copies those a cold run left in a kernel cache (``kernels/*/k_*.py``).

``time`` compiles every module in DIR with both backends in one warm process (Numba's
target set up and the math helpers loaded first), ``--rounds`` times each, in turn,
and reports the median of each phase per kernel, summed over the kernels:

    front end      Numba: importing the module text, bytecode analysis, typing,
                   lowering to llvmlite IR and printing it; direct: codegen/cpu/llvm.py
                   typing and writing the IR, printing and parsing it; both: the
                   checks before code generation (native._prepare)
    LLVM function  the per-function pass pipeline Numba runs on each new module
                   (none on the direct backend)
    LLVM module    the module pipeline: Numba's cheap and full O3 passes, or the
                   direct backend's one O3 pass (direct.optimize), or its tier-1
                   pipeline (direct.quick_optimize; backend "tier1": the quick code
                   a tiered compile runs first, compile/parallel.py)
    object         machine code for the target (native.emit_object)
    link           the system compiler driver making the .so, the files written

``speed`` builds the kernels of a few patterns (element-wise with broadcasts, GELU,
SwiGLU, LayerNorm, RMSNorm, softmax, log-softmax, a column reduction; ``--rows`` x
1024 float32) with each
backend, and the direct backend's tier-1 code, and times each kernel alone on this
thread (CompiledKernel.__call__: its units one after another), the backends
interleaved, each the best of 3 calls, median of ``--rounds``.

``tiers`` times a model's cold first call (``stitching.function`` with
``background_compile=False``, batch ``--batch`` (default 1), a fresh process and an
empty kernel cache each) without and with tiered compiles (STITCHING_TIERED_COMPILE=0 and 1: tier-1 kernels
first, the default, compile/parallel.py), the modes
interleaved, ``--rounds`` each: the first call, ``--calls`` calls right after it
(with tiers: on tier-1 code while tier 2 compiles), the time until every kernel runs
tier-2 code, ``--calls`` calls then, and stock TF's first and steady calls in the
same process.

``window`` compares a model's calls while tier 2 compiles with stock TF's under the same
load: a synchronous first call (empty kernel cache, tiered compile), stock TF's first
call, then the two called in turn until every kernel runs tier 2, then ten pairs more;
medians.  (``tiers``' TF column times TF after the compile, on an idle machine.)

``tier1`` runs patterns of the patterns suite (stitching/testing/patterns.py) through
the op, tiered, in one process with an empty kernel cache: each pattern's calls on its
tier-1 code (right after the first call, while tier 2 compiles; a row is left out if
the switch came before the calls ended), then on tier 2, and stock TF's
(``tf.function``), median of ``--calls`` calls each: whether tier-1 code is slower than
the TF ops it replaces.  A region that holds at tier 1 (kernel.slow_at_tier1: its node
runs the region's TF ops until the switch) shows those ops' time in the tier-1 column.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("front", "function", "module", "object", "link")
BACKENDS = ("numba", "llvm", "tier1")


def collect(out: Path, models, cache) -> None:
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    if cache:
        for f in sorted(Path(cache).glob("kernels/*/k_*.py")):
            shutil.copy(f, out / f.name)
            n += 1
    for model in models:
        for name, text in _model_codes(model).items():
            (out / f"{name}.py").write_text(text)
            n += 1
    print(f"{n} kernel modules in {out}")


def _model_codes(model) -> dict:
    """{code name: module text} of ``model``'s kernels at batch 1, planned as in a
    cold first call (tools/cold_profile.py)."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import cold_profile
    return {name: text for name, (_, text) in cold_profile.planned_codes(model)[1].items()}


class _Clock:
    """Seconds spent in the hooked steps of one compile."""

    def __init__(self):
        self.t = dict.fromkeys(("function", "module", "object", "link"), 0.0)

    def wrap(self, owner, name, key):
        orig = getattr(owner, name)
        clock = self

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                clock.t[key] += time.perf_counter() - t
        setattr(owner, name, timed)


def _hook(clock) -> None:
    from numba.core import codegen

    from stitching.compile import direct, native
    clock.wrap(codegen.CPUCodeLibrary, "_optimize_functions", "function")
    clock.wrap(codegen.CPUCodeLibrary, "_optimize_final_module", "module")
    clock.wrap(direct, "optimize", "module")
    clock.wrap(direct, "quick_optimize", "module")
    clock.wrap(native, "emit_object", "object")
    clock.wrap(direct, "_emit_quick", "object")
    clock.wrap(native, "_link", "link")


def _compile_once(text, backend, stem, clock) -> dict:
    from stitching.compile import direct, kernel, native
    for k in clock.t:
        clock.t[k] = 0.0
    t = time.perf_counter()
    if backend in ("llvm", "tier1"):
        direct.build(text, stem, kernel.BODY_SYMBOL, 1 if backend == "tier1" else 2)
    else:
        module = kernel._load_module(text, f"phases_{stem.name}")
        native.build(module.body, module.h.BODY_SIG, module.h.BODY_OPTIONS, stem,
                     kernel.BODY_SYMBOL)
    total = time.perf_counter() - t
    c = clock.t
    return {"front": total - sum(c.values()), **c, "total": total}


def time_dir(src: Path, rounds: int) -> None:
    os.environ.setdefault("STITCHING_CACHE_DIR", tempfile.mkdtemp(prefix="phases-"))
    from stitching.compile import kernel, native
    from stitching.compile.helper_cache import preload
    kernel.use_helper_cache()
    preload()
    native.compile_only(lambda x: x + 1, "int64(int64)", {})    # Numba's target set up
    texts = {f.stem: f.read_text() for f in sorted(src.glob("*.py"))}
    clock = _Clock()
    _hook(clock)
    work = Path(tempfile.mkdtemp(prefix="phases-out-"))
    runs = {(b, n): [] for b in BACKENDS for n in texts}
    for _ in range(2):      # warm: every helper signature the kernels call loaded
        for n, text in texts.items():
            _compile_once(text, "llvm", work / f"w_{n}", clock)
    for r in range(rounds):
        for n, text in texts.items():
            for b in BACKENDS:
                runs[(b, n)].append(_compile_once(text, b, work / f"{b}_{r}_{n}", clock))
    lines = sum(len(t.splitlines()) for t in texts.values())
    print(f"{len(texts)} kernels, {lines} generated lines; median of {rounds} rounds "
          f"per kernel and phase, summed (s)")
    print("| backend | total | " + " | ".join(PHASES) + " |")
    print("|---|---:|" + "---:|" * len(PHASES))
    sums = {}
    for b in BACKENDS:
        s = {p: sum(statistics.median(x[p] for x in runs[(b, n)]) for n in texts)
             for p in PHASES + ("total",)}
        sums[b] = s
        print(f"| {b} | {s['total']:.2f} | " + " | ".join(
            f"{s[p]:.2f} ({s[p] / s['total']:.0%})" for p in PHASES) + " |")
    print(f"speed-up of the total: {sums['numba']['total'] / sums['llvm']['total']:.2f}x, "
          f"tier 1 {sums['numba']['total'] / sums['tier1']['total']:.2f}x; "
          f"front end {sums['numba']['front'] / max(sums['llvm']['front'], 1e-9):.1f}x")
    for n in texts:
        a, d, q = (statistics.median(x["total"] for x in runs[(b, n)]) for b in BACKENDS)
        print(f"  {n}: {len(texts[n].splitlines())} lines, numba {a:.3f} s, "
              f"llvm {d:.3f} s ({a / d:.1f}x), tier1 {q:.3f} s ({a / q:.1f}x)")
    shutil.rmtree(work, ignore_errors=True)


def _pattern_specs(rows: int = 8192) -> dict:
    """{name: (spec, input shapes)}: ``rows`` x 1024 float32 (8192: the patterns
    suite's "large" size)."""
    from stitching.ir.builder import SpecBuilder
    R, C = rows, 1024
    out = {}

    def case(name, fn, shapes):
        b = SpecBuilder()
        ins = [b.input("float32", tuple(-1 if i == 0 and len(s) > 1 else d
                                        for i, d in enumerate(s))) for s in shapes]
        out[name] = (b.build(fn(b, *ins)), shapes)

    def ln(b, x, g, be):
        m = b.Mean(x, axes=[1], keep_dims=True)
        c = b.Sub(x, m)
        v = b.Mean(b.Square(c), axes=[1], keep_dims=True)
        return [b.Add(b.Mul(b.Mul(c, b.Rsqrt(b.Add(v, b.const(1e-5)))), g), be)]

    def softmax(b, x):
        e = b.Exp(b.Sub(x, b.Max(x, axes=[1], keep_dims=True)))
        return [b.Div(e, b.Sum(e, axes=[1], keep_dims=True))]

    def log_softmax(b, x):
        sh = b.Sub(x, b.Max(x, axes=[1], keep_dims=True))
        return [b.Sub(sh, b.Log(b.Sum(b.Exp(sh), axes=[1], keep_dims=True)))]

    def rms(b, x, g):
        v = b.Mean(b.Square(x), axes=[1], keep_dims=True)
        return [b.Mul(b.Mul(x, b.Rsqrt(b.Add(v, b.const(1e-6)))), g)]

    def gelu_erf(b, x, bias):
        y = b.Add(x, bias)
        return [b.Mul(b.Mul(y, b.const(0.5)),
                      b.Add(b.const(1.0), b.Erf(b.Mul(y, b.const(0.7071067811865476)))))]

    def gelu_tanh(b, x, bias):
        y = b.Add(x, bias)
        inner = b.Mul(b.const(0.7978845608), b.Add(y, b.Mul(b.const(0.044715),
                                                            b.Mul(y, b.Mul(y, y)))))
        return [b.Mul(b.Mul(y, b.const(0.5)), b.Add(b.const(1.0), b.Tanh(inner)))]

    def swiglu(b, x, gate):
        return [b.Mul(b.Mul(x, b.Sigmoid(x)), gate)]

    def bn_relu6(b, x, s, t):
        return [b.Relu6(b.Add(b.Mul(x, s), t))]

    def center0(b, x):
        return [b.Sub(x, b.Mean(x, axes=[0], keep_dims=True))]

    case("layernorm", ln, [(R, C), (C,), (C,)])
    case("softmax", softmax, [(R, C)])
    case("log_softmax", log_softmax, [(R, C)])
    case("rmsnorm", rms, [(R, C), (C,)])
    case("bias_gelu_erf", gelu_erf, [(R, C), (C,)])
    case("bias_gelu_tanh", gelu_tanh, [(R, C), (C,)])
    case("swiglu", swiglu, [(R, C), (R, C)])
    case("bn_relu6", bn_relu6, [(R, C), (C,), (C,)])
    case("center_axis0", center0, [(R, C)])
    return out


def speed(rounds: int, rows: int) -> None:
    import numpy as np

    os.environ.setdefault("STITCHING_CACHE_DIR", tempfile.mkdtemp(prefix="phases-speed-"))
    from stitching.compile import kernel
    rng = np.random.default_rng(0)
    calls = max(1, 8192 // rows)        # ~ the same time per measurement at any size
    kernels = {}
    for b in BACKENDS:      # tier1: the direct backend's tier-1 code (never upgraded here)
        os.environ["STITCHING_CPU_BACKEND"] = "llvm" if b == "tier1" else b
        if b == "tier1":    # a cache without the tier-2 code just built
            os.environ["STITCHING_CACHE_DIR"] = tempfile.mkdtemp(prefix="phases-speed-")
        kernel.clear_memory_cache()
        for name, (spec, shapes) in _pattern_specs(rows).items():
            k = kernel.compile_kernel(spec, 1 if b == "tier1" else 2)
            assert k.backend_note is None and k.tier == (1 if b == "tier1" else 2), name
            kernels[(b, name)] = (k, shapes)
    times = {key: [] for key in kernels}
    for _ in range(rounds):
        for name in _pattern_specs(rows):
            args = [rng.standard_normal(s).astype(np.float32)
                    for s in kernels[("numba", name)][1]]
            outs = {}
            for b in BACKENDS:
                k = kernels[(b, name)][0]
                best = math.inf
                for _ in range(3):          # best of 3 calls: other processes' noise
                    t = time.perf_counter()
                    for _ in range(calls):
                        outs[b] = k(*args)
                    best = min(best, (time.perf_counter() - t) / calls)
                times[(b, name)].append(best)
            same = all(np.array_equal(x, y, equal_nan=True)
                       for x, y in zip(outs["numba"], outs["llvm"]))
            times.setdefault(("same", name), []).append(same)
    print(f"{rows}x1024 float32, kernel alone, one thread, median of {rounds} rounds "
          "interleaved (ms); "
          "llvm/numba < 1: the direct backend's code is faster")
    print("| pattern | numba ms | llvm ms | llvm / numba | outputs bit-identical | "
          "tier1 ms | tier1 / llvm |")
    print("|---|---:|---:|---:|---|---:|---:|")
    ratios, slow = [], []
    for name in _pattern_specs(rows):
        a, d, q = (statistics.median(times[(b, name)]) * 1e3 for b in BACKENDS)
        ratios.append(d / a)
        slow.append(q / d)
        print(f"| {name} | {a:.2f} | {d:.2f} | {d / a:.3f} | "
              f"{'yes' if all(times[('same', name)]) else 'NO'} | {q:.2f} | {q / d:.2f} |")
    print(f"geomean llvm / numba: {statistics.geometric_mean(ratios):.3f}; "
          f"tier1 / llvm: {statistics.geometric_mean(slow):.2f}")


_MARK = "@@TIERS@@"


def tiers(model: str, rounds: int, calls: int, batch: int = 1) -> None:
    import json
    import subprocess
    rows = {False: [], True: []}
    for _ in range(rounds):
        for tiered in (False, True):
            env = dict(os.environ, STITCHING_TIERED_COMPILE="1" if tiered else "0",
                       STITCHING_CACHE_DIR=tempfile.mkdtemp(prefix="phases-tiers-"))
            r = subprocess.run([sys.executable, __file__, "_tiers_child", model,
                                str(calls), str(batch)], env=env, capture_output=True,
                               text=True)
            line = [x for x in r.stdout.splitlines() if x.startswith(_MARK)]
            if not line:
                raise RuntimeError(f"child failed: {r.stderr[-2000:]}")
            rows[tiered].append(json.loads(line[0][len(_MARK):]))
            shutil.rmtree(env["STITCHING_CACHE_DIR"], ignore_errors=True)
    print(f"{model}, batch {batch}, median of {rounds} fresh processes per mode (s; per call: ms); "
          f"load {os.getloadavg()[0]:.1f}")
    keys = ("first_s", "early_ms", "ready_s", "steady_ms", "tf_first_s", "tf_ms", "max_diff")
    print("| mode | first call s | next calls ms | all tier 2 s | then ms | TF first s | "
          "TF ms | max diff vs TF |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for tiered in (False, True):
        med = {k: statistics.median(r[k] for r in rows[tiered]) for k in keys}
        print(f"| {'tiered' if tiered else 'plain'} | " + " | ".join(
            f"{med[k]:.3g}" for k in keys) + " |")


def _tiers_child(model: str, calls: int, batch: int) -> None:
    import json

    import numpy as np
    import tensorflow as tf

    import stitching
    from stitching.compile import parallel
    from stitching.testing import models as M
    case = M.get(model)
    args = [tf.constant(a) for a in case.inputs(batch)]
    # a caller that waits for its kernels (tiered execution, stock TF first, would
    # time TF's first call instead, as it did once that became the default)
    fn = stitching.function(case.make_fn(), input_signature=case.input_signature(),
                            options=stitching.Options(background_compile=False))

    def per_call(f):
        t = time.perf_counter()
        for _ in range(calls):
            out = f(*args)
        return (time.perf_counter() - t) / calls * 1e3, out
    t0 = time.perf_counter()
    fn(*args)
    first = time.perf_counter() - t0
    early, out = per_call(fn)
    parallel.wait_upgrades()
    ready = time.perf_counter() - t0
    steady, _ = per_call(fn)
    ref = tf.function(case.make_fn(), input_signature=case.input_signature())
    t = time.perf_counter()
    ref(*args)
    tf_first = time.perf_counter() - t
    tf_ms, want = per_call(ref)
    flat = lambda o: [np.asarray(x) for x in tf.nest.flatten(o)]   # noqa: E731
    diff = max(float(np.max(np.abs(a.astype(np.float64) - b))) for a, b in
               zip(flat(out), flat(want)))
    print(_MARK + json.dumps(dict(first_s=first, early_ms=early, ready_s=ready,
                                  steady_ms=steady, tf_first_s=tf_first, tf_ms=tf_ms,
                                  max_diff=diff)), flush=True)


def window(model: str, batch: int) -> None:
    import threading

    import numpy as np
    os.environ.setdefault("STITCHING_CACHE_DIR", tempfile.mkdtemp(prefix="phases-window-"))
    os.environ["STITCHING_TIERED_COMPILE"] = "1"
    import tensorflow as tf

    import stitching
    from stitching.compile import parallel
    from stitching.testing import models as M
    case = M.get(model)
    args = [tf.constant(a) for a in case.inputs(batch)]
    fn = case.make_fn()
    st = stitching.function(fn, input_signature=case.input_signature(),
                            options=stitching.Options(background_compile=False))
    ref = tf.function(fn, input_signature=case.input_signature())
    t0 = time.perf_counter()
    st(*args)
    first = time.perf_counter() - t0
    ref(*args)
    done = threading.Event()
    threading.Thread(target=lambda: (parallel.wait_upgrades(), done.set()),
                     daemon=True).start()

    def pair(times):
        for f, ts in zip((st, ref), times):
            t = time.perf_counter()
            f(*args)
            ts.append((time.perf_counter() - t) * 1e3)
    during = ([], [])
    while not done.is_set():
        pair(during)
    ready = time.perf_counter() - t0
    after = ([], [])
    for _ in range(10):
        pair(after)
    med = [float(np.median(v)) if v else float("nan") for v in during + after]
    print(f"{model}, batch {batch}, load {os.getloadavg()[0]:.1f}: first call {first:.2f} s, "
          f"tier 2 in at {ready:.2f} s; while tier 2 compiled ({len(during[0])} pairs): "
          f"stitched {med[0]:.1f} ms, TF {med[1]:.1f} ms ({med[0] / med[1]:.2f}x); "
          f"then stitched {med[2]:.1f} ms, TF {med[3]:.1f} ms")


def tier1(patterns, size: str, calls: int) -> None:
    os.environ["STITCHING_TIERED_COMPILE"] = "1"
    os.environ.setdefault("STITCHING_CACHE_DIR", tempfile.mkdtemp(prefix="phases-tier1-"))
    import tensorflow as tf

    import stitching
    from stitching.compile import parallel
    from stitching.testing import patterns as P

    def ms(f, args):
        out = []
        for _ in range(calls):
            t = time.perf_counter()
            f(*args)
            out.append((time.perf_counter() - t) * 1e3)
        return statistics.median(out)
    print(f"patterns at size {size}, through the op (TF's intra-op threads), median of "
          f"{calls} calls (ms); load {os.getloadavg()[0]:.1f}")
    print("| pattern | held kernels | TF ms | tier 1 ms | tier 2 ms | tier 1 / TF | "
          "tier 2 / TF |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in patterns:
        p = P.get(name)
        args = [tf.constant(a) for a in p.inputs(size)]
        ref = tf.function(p.fn, input_signature=p.input_signature(size))
        # a caller that waits for its kernels (tiered execution would run stock TF)
        st = stitching.function(p.fn, input_signature=p.input_signature(size),
                                options=stitching.Options(background_compile=False))
        ref(*args)
        st(*args)
        held = sum(k.hold_until_upgrade for _, k in st.report.code_tiers)
        early = ms(st, args)
        pending = not parallel.wait_upgrades(0)
        parallel.wait_upgrades()
        late, base = ms(st, args), ms(ref, args)
        t1 = f"{early:.2f}" if pending else "(switched)"
        r1 = f"{early / base:.2f}x" if pending else "-"
        print(f"| {name} | {held}/{len(st.report.code_tiers)} | {base:.2f} | {t1} | "
              f"{late:.2f} | {r1} | {late / base:.2f}x |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("collect")
    c.add_argument("out", type=Path)
    c.add_argument("--model", action="append", default=[])
    c.add_argument("--cache", help="a kernel cache directory a cold run filled")
    t = sub.add_parser("time")
    t.add_argument("src", type=Path)
    t.add_argument("--rounds", type=int, default=3)
    sp = sub.add_parser("speed")
    sp.add_argument("--rounds", type=int, default=7)
    sp.add_argument("--rows", type=int, default=8192,
                    help="rows of 1024 floats (64: the data stays in L2, code speed "
                         "alone; 8192: the patterns suite's large size)")
    tr = sub.add_parser("tiers")
    tr.add_argument("model")
    tr.add_argument("--rounds", type=int, default=3)
    tr.add_argument("--calls", type=int, default=20)
    tr.add_argument("--batch", type=int, default=1)
    wi = sub.add_parser("window")
    wi.add_argument("model")
    wi.add_argument("--batch", type=int, default=1)
    t1 = sub.add_parser("tier1")
    t1.add_argument("patterns", nargs="+")
    t1.add_argument("--size", default="large")
    t1.add_argument("--calls", type=int, default=10)
    ch = sub.add_parser("_tiers_child")
    ch.add_argument("model")
    ch.add_argument("calls", type=int)
    ch.add_argument("batch", type=int)
    args = ap.parse_args(argv)
    sys.path.insert(0, REPO)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.what == "collect":
        if args.model:
            os.environ["STITCHING_CACHE_DIR"] = tempfile.mkdtemp(prefix="phases-collect-")
        collect(args.out, args.model, args.cache)
    elif args.what == "time":
        time_dir(args.src, args.rounds)
    elif args.what == "tiers":
        tiers(args.model, args.rounds, args.calls, args.batch)
    elif args.what == "window":
        window(args.model, args.batch)
    elif args.what == "tier1":
        tier1(args.patterns, args.size, args.calls)
    elif args.what == "_tiers_child":
        _tiers_child(args.model, args.calls, args.batch)
    else:
        speed(args.rounds, args.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
