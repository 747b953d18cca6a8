"""Where a cold kernel's compile time goes, Numba backend against the direct LLVM one.

    python tools/compile_phases.py collect DIR --model transformer --model llama_decoder
    python tools/compile_phases.py collect DIR --cache CACHE_DIR   # a cold run's kernels
    python tools/compile_phases.py time DIR [--rounds 3]

``collect`` writes the generated kernel modules (``<code>.py``) of the models' cold
first call (traced and planned, stopped before compiling, as tools/cold_profile.py
does), or copies those a cold run left in a kernel cache (``kernels/*/k_*.py``).

``time`` compiles every module in DIR with both backends in one warm process (Numba's
target set up and the math helpers loaded first), ``--rounds`` times each, in turn,
and reports the median of each phase per kernel, summed over the kernels:

    front end      Numba: importing the module text, bytecode analysis, typing,
                   lowering to llvmlite IR and printing it; direct: codegen/cpu/llvm.py
                   typing and writing the IR, printing and parsing it
    LLVM function  the per-function pass pipeline Numba runs on each new module
    LLVM module    linking the helpers in and the O3 module pipeline (vectorization)
    object         machine code for the target (native.export_ir, less the link)
    link           the system compiler driver making the .so
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("front", "function", "module", "object", "link")


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
    cold first call."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import cold_profile

    from stitching.compile import kernel, parallel
    captured = []

    class Planned(BaseException):       # not an Exception: nothing on the way catches it
        pass

    def capture(specs, jobs, progress, workers):
        captured.extend(specs)
        raise Planned
    parallel._warm_cache = capture
    fn, args = cold_profile._model_call(model)
    try:
        fn(*args)
    except Planned:
        pass
    codes = {}
    for s in captured:
        code = kernel.uncached_code(s)
        if code is not None:
            codes[code[2]] = code[1]
    return codes


class _Clock:
    """Seconds spent in the hooked steps of one compile."""

    def __init__(self):
        self.t = dict.fromkeys(("function", "module", "export", "link"), 0.0)

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

    from stitching.compile import native
    clock.wrap(codegen.CPUCodeLibrary, "_optimize_functions", "function")
    clock.wrap(codegen.CPUCodeLibrary, "_optimize_final_module", "module")
    clock.wrap(native, "export_ir", "export")
    clock.wrap(native.subprocess, "run", "link")


def _compile_once(text, backend, stem, clock) -> dict:
    from stitching.compile import direct, kernel, native
    for k in clock.t:
        clock.t[k] = 0.0
    t = time.perf_counter()
    if backend == "llvm":
        direct.build(text, stem, kernel.BODY_SYMBOL)
    else:
        module = kernel._load_module(text, f"phases_{stem.name}")
        native.build(module.body, module.h.BODY_SIG, module.h.BODY_OPTIONS, stem,
                     kernel.BODY_SYMBOL)
    total = time.perf_counter() - t
    c = clock.t
    return {"front": total - c["function"] - c["module"] - c["export"],
            "function": c["function"], "module": c["module"],
            "object": c["export"] - c["link"], "link": c["link"], "total": total}


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
    runs = {(b, n): [] for b in ("numba", "llvm") for n in texts}
    for _ in range(2):      # warm: every helper signature the kernels call loaded
        for n, text in texts.items():
            _compile_once(text, "llvm", work / f"w_{n}", clock)
    for r in range(rounds):
        for n, text in texts.items():
            for b in ("numba", "llvm"):
                runs[(b, n)].append(_compile_once(text, b, work / f"{b}_{r}_{n}", clock))
    lines = sum(len(t.splitlines()) for t in texts.values())
    print(f"{len(texts)} kernels, {lines} generated lines; median of {rounds} rounds "
          f"per kernel and phase, summed (s)")
    print("| backend | total | " + " | ".join(PHASES) + " |")
    print("|---|---:|" + "---:|" * len(PHASES))
    sums = {}
    for b in ("numba", "llvm"):
        s = {p: sum(statistics.median(x[p] for x in runs[(b, n)]) for n in texts)
             for p in PHASES + ("total",)}
        sums[b] = s
        print(f"| {b} | {s['total']:.2f} | " + " | ".join(
            f"{s[p]:.2f} ({s[p] / s['total']:.0%})" for p in PHASES) + " |")
    print(f"speed-up of the total: {sums['numba']['total'] / sums['llvm']['total']:.2f}x; "
          f"front end {sums['numba']['front'] / max(sums['llvm']['front'], 1e-9):.1f}x")
    for n in texts:
        a = statistics.median(x["total"] for x in runs[("numba", n)])
        d = statistics.median(x["total"] for x in runs[("llvm", n)])
        print(f"  {n}: {len(texts[n].splitlines())} lines, numba {a:.3f} s, "
              f"llvm {d:.3f} s ({a / d:.1f}x)")
    shutil.rmtree(work, ignore_errors=True)


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
    args = ap.parse_args(argv)
    sys.path.insert(0, REPO)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.what == "collect":
        if args.model:
            os.environ["STITCHING_CACHE_DIR"] = tempfile.mkdtemp(prefix="phases-collect-")
        collect(args.out, args.model, args.cache)
    else:
        time_dir(args.src, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
