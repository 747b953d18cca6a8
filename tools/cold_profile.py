"""Where a cold first call's time goes, for one model of the suite.

    python tools/cold_profile.py timeline resnet50     # stages of the first call
    python tools/cold_profile.py kernels resnet50      # each Numba compile, split

``timeline``: a fresh process with an empty kernel cache (a temporary
STITCHING_CACHE_DIR) times the first call of ``stitching.function`` and stamps the
pipeline's stages (frontend, planning, compile, rewrite) and the compile workers'
progress.  What follows ``stitch_graph_def`` is TF's own work on the rewritten
graph (import, Grappler, the first run), which stock TF's first call pays too.

``kernels``: the model's kernel specs are planned as in a cold call, then the codes
that would be compiled are compiled one by one in this process, each split into
Numba's front end (bytecode to LLVM IR: typing, lowering -- which includes LLVM's
per-function passes; its slowest passes named), LLVM's module optimization and object
code + link, summed over the codes at the end.  The first compile in a process also
sets Numba's target up; it is timed apart ("warm-up").
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T0 = time.perf_counter()


def _stamp(marks, what):
    marks.append((time.perf_counter() - T0, what))


def _wrap(module, name, marks):
    orig = getattr(module, name)

    def timed(*a, **k):
        _stamp(marks, f"> {name}")
        try:
            return orig(*a, **k)
        finally:
            _stamp(marks, f"< {name}")
    setattr(module, name, timed)


def _model_call(model):
    """(the stitched function, its arguments) for ``model`` at batch 1."""
    import tensorflow as tf

    import stitching
    from stitching.testing import models as M
    case = M.get(model)
    args = [tf.constant(a) for a in case.inputs(1)]
    return stitching.function(case.make_fn(), input_signature=case.input_signature(),
                              options=stitching.Options(background_compile=False)), args


def timeline(model) -> None:
    from stitching.compile import parallel
    from stitching.tf import frontend, pipeline
    from stitching.tf.passes import grappler, rewrite
    marks = []
    fn, args = _model_call(model)
    for mod, names in ((grappler, ["optimize"]), (frontend, ["import_for_shapes", "to_ir"]),
                       (pipeline, ["stitch_graph_def", "get_planner", "_compile"]),
                       (rewrite, ["rewrite"])):
        for n in names:
            _wrap(mod, n, marks)
    spawn = parallel._spawn

    def spawned():
        _stamp(marks, "compile worker started")
        return spawn()
    parallel._spawn = spawned
    warm = parallel._warm_cache

    def warm_cache(specs, jobs, progress, workers):
        def done(d, n):
            _stamp(marks, f"  worker compiled {d}/{n}")
            if progress is not None:
                progress(d, n)
        return warm(specs, jobs, done, workers)
    parallel._warm_cache = warm_cache
    _stamp(marks, "first call")
    t = time.perf_counter()
    fn(*args)
    _stamp(marks, "first call returned")
    print(f"{model}: first call {time.perf_counter() - t:.2f} s (empty kernel cache)")
    start = next(s for s, w in marks if w == "first call")
    for s, what in marks:
        print(f"  {s - start:7.3f}  {what}")


def planned_codes(model) -> tuple:
    """(the kernel specs of ``model``'s first call at batch 1, {code name: (the spec
    compiled for it, its generated module text)} of those not in the kernel cache):
    traced and planned as in a cold call, stopped before compiling."""
    from stitching.compile import kernel, parallel
    captured = []

    class Planned(BaseException):       # not an Exception: nothing on the way catches it
        pass

    def capture(specs, jobs, progress, workers):
        captured.extend(specs)
        raise Planned
    warm, parallel._warm_cache = parallel._warm_cache, capture
    fn, args = _model_call(model)
    try:
        fn(*args)                       # traces and plans, stops before compiling
    except Planned:
        pass
    finally:
        parallel._warm_cache = warm
    todo = {}
    for s in captured:
        code = kernel.uncached_code(s)
        if code is not None:
            todo.setdefault(code[2], code[:2])
    return captured, todo


def kernels(model) -> None:
    from stitching.compile import kernel, native
    captured, todo = planned_codes(model)
    split = {}
    compile_ = native._compile

    def timed_compile(pyfunc, sig, options, pipeline=None):
        from numba.core import sigutils
        from numba.core.compiler_lock import global_compiler_lock
        a, r = sigutils.normalize_signature(sig)
        cf = native._aot_cfunc_class()(pyfunc, (a, r), {}, dict(options),
                                       pipeline_class=pipeline or native._lean_pipeline())
        with global_compiler_lock, native._memo_scalar_typing():
            t = time.perf_counter()
            cres = cf._compile_uncached()
            split["front"] = time.perf_counter() - t
            times = cres.metadata.get("pipeline_times", {})
            passes = times.get("stitching", times.get("nopython", {}))
            split["passes"] = sorted(((v.init + v.run + v.finalize, k.split("_", 1)[-1])
                                      for k, v in passes.items()), reverse=True)[:3]
            t = time.perf_counter()
            cres.library.finalize()
            split["llvm"] = time.perf_counter() - t
        return cres.library, cres.fndesc.llvm_cfunc_wrapper_name
    export = native.export_ir

    def timed_export(*a):
        t = time.perf_counter()
        export(*a)
        split["object"] = time.perf_counter() - t
    native._compile, native.export_ir = timed_compile, timed_export
    t = time.perf_counter()
    compile_(lambda x: x + 1, "int64(int64)", {})
    print(f"{model}: {len(captured)} specs, {len(todo)} codes to compile; "
          f"warm-up {time.perf_counter() - t:.3f} s")
    total = 0.0
    sums = dict.fromkeys(("front", "llvm", "object"), 0.0)
    for target, text in sorted(todo.values(), key=lambda c: -len(c[1])):
        t = time.perf_counter()
        kernel.compile_kernel(target)
        dt = time.perf_counter() - t
        total += dt
        for k in sums:
            sums[k] += split[k]
        slow = ", ".join(f"{n} {v:.3f}" for v, n in split.get("passes", []))
        print(f"  {dt:.3f} s  {len(text.splitlines()):4d} lines  front {split['front']:.3f} "
              f"(slowest: {slow})  llvm {split['llvm']:.3f}  object {split['object']:.3f}")
    print(f"  sum {total:.3f} s: " + ", ".join(
        f"{k} {v:.3f} ({v / total:.0%})" for k, v in sums.items())
        + f", rest (code generation, load) {total - sum(sums.values()):.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["timeline", "kernels"])
    ap.add_argument("model", help="a model of stitching.testing.models")
    args = ap.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ["STITCHING_CACHE_DIR"] = tempfile.mkdtemp(prefix="stitching-profile-")
    sys.path.insert(0, REPO)
    if args.what == "kernels":
        os.environ.setdefault("NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING", "1")  # as workers
    (timeline if args.what == "timeline" else kernels)(args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
