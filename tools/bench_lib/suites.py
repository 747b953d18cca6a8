"""The three suites: patterns (both sizes), models, compile (fresh processes)."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

from . import measure, modes
from .machine import REPO

# allclose tolerances vs stock TF: (rtol, atol as a fraction of max|ref|).  XLA and
# stitching both use their own exp/tanh/erf approximations and summation orders; a
# real bug (wrong axis, missing term) is off by far more than this.
PATTERN_TOL = (1e-3, 1e-4)
# Whole networks: 50+ layers of reordered float sums; a wrong kernel still shows as
# errors of order max|ref|.
MODEL_TOL = (1e-2, 1e-3)


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def run_case(*, suite, name, fn, signature, args_np, mode_list, planner, repeats,
             warmup, min_time, tol, extra=None, bandwidth=True) -> dict:
    """One row: build every mode, call once, check against stock TF, count kernels,
    time side by side."""
    args = [tf.constant(a) for a in args_np]
    runners = [modes.build(m, fn, signature, planner) for m in mode_list]
    outputs = {r.mode: modes.first_call(r, args) for r in runners}
    by_mode = {r.mode: r for r in runners}

    ref = None
    if by_mode.get("tf") is not None and by_mode["tf"].ok:
        ref = measure.to_numpy(outputs["tf"])
    for r in runners:
        if r.ok:
            modes.collect_counts(r, args)

    checks = {}
    for r in runners:
        if r.mode == "tf" or not r.ok:
            continue
        checks[r.mode] = (measure.compare(ref, measure.to_numpy(outputs[r.mode]), *tol)
                          if ref is not None else {"ok": None, "why": "no stock TF output"})

    bytes_in = measure.nbytes(args_np)
    bytes_out = measure.nbytes(ref) if ref is not None else None
    del outputs
    times = measure.time_modes(runners, args, repeats=repeats, warmup=warmup,
                               min_time=min_time)

    row = {"suite": suite, "name": name, "bytes_in": bytes_in, "bytes_out": bytes_out,
           "shapes": [list(np.shape(a)) for a in args_np], "modes": {}}
    row.update(extra or {})
    for r in runners:
        m = {"ok": r.ok, "error": r.error, "first_call_s": r.first_call_s,
             "time": times.get(r.mode), "check": checks.get(r.mode)}
        m.update({k: v for k, v in r.info.items() if k != "traceback"})
        if r.error and "traceback" in r.info:
            m["traceback"] = r.info["traceback"]
        if bandwidth and m["time"] and bytes_out is not None:
            m["bw_gbs"] = (bytes_in + bytes_out) / m["time"]["median_s"] / 1e9
        row["modes"][r.mode] = m
    if "tf" in row["modes"]:
        row["memory_intensive_ops"] = row["modes"]["tf"].get("memory_intensive_ops")
    _log_row(row)
    return row


def _log_row(row):
    parts = []
    for mode, m in row["modes"].items():
        if m["time"]:
            parts.append(f"{mode} {m['time']['median_s'] * 1e3:.3f} ms")
        else:
            parts.append(f"{mode} FAILED ({m['error']})")
        if m.get("check") and m["check"].get("ok") is False:
            parts.append(f"!! {mode} MISMATCH vs TF {m['check']}")
    tag = row["name"] + (f"/{row['size']}" if "size" in row else f"/b{row.get('batch')}")
    _log(f"  {tag}: " + ", ".join(parts))


# ---- patterns and models: rows named by keys ("softmax_tf/large", "resnet50/b8")

def case_keys(suite, *, only=None, sizes=("large", "small"), batches=None) -> list[str]:
    """The rows a suite run covers, in order."""
    if suite == "patterns":
        from stitching.testing import patterns as P
        return [f"{p.name}/{size}" for p in P.all_patterns()
                if not only or p.name in only for size in sizes]
    if suite == "models":
        from stitching.testing import models as M
        return [f"{m.name}/b{b}" for m in M.all_models() if not only or m.name in only
                for b in (batches or m.batch_sizes)]
    if suite == "train":
        from . import train
        return train.case_keys(only)
    raise ValueError(f"suite {suite!r} has no rows by key")


def run_rows(suite, keys, *, mode_list=modes.MODES, planner=None, repeats=None,
             warmup=None, min_time=None, drop_stitching=None, on_start=None,
             on_row=None, train_opts=None) -> list[dict]:
    """Run the rows ``keys`` of ``suite`` in this process.  ``drop_stitching``: keys to
    run without the stitching mode (it crashed the process on them before)."""
    from stitching.testing import models as M
    from stitching.testing import patterns as P
    drop = drop_stitching or {}
    rows = []
    model_fns = {}
    for key in keys:
        name, variant = key.rsplit("/", 1)
        ml = tuple(m for m in mode_list if not (m == "stitching" and key in drop))
        if on_start:
            on_start(key)
        _log(f"[{suite}] {key}")
        if suite == "patterns":
            p = P.get(name)
            row = run_case(
                suite="patterns", name=name, fn=p.fn, signature=p.input_signature(variant),
                args_np=p.inputs(variant), mode_list=ml, planner=planner,
                repeats=10 if repeats is None else repeats,
                warmup=2 if warmup is None else warmup,
                min_time=0.02 if min_time is None else min_time, tol=PATTERN_TOL,
                extra={"size": variant, "expected_kernels": p.expected_kernels,
                       "description": p.description})
            if variant in ("large", "16m", "64m"):          # beyond the caches
                from .machine import cores, spot_copy_gbs
                row["copy_gbs"] = round(spot_copy_gbs(cores()), 2)
        elif suite == "train":
            from . import train
            row = train.run_row(name, mode_list=ml, planner=planner,
                                repeats=5 if repeats is None else repeats,
                                warmup=2 if warmup is None else warmup,
                                min_time=0.1 if min_time is None else min_time,
                                **(train_opts or {}))
        else:
            case = M.get(name)
            if name not in model_fns:
                model_fns[name] = case.make_fn()
            row = run_case(
                suite="models", name=name, fn=model_fns[name],
                signature=case.input_signature(), args_np=case.inputs(int(variant[1:])),
                mode_list=ml, planner=planner, repeats=5 if repeats is None else repeats,
                warmup=1 if warmup is None else warmup,
                min_time=0.0 if min_time is None else min_time, tol=MODEL_TOL,
                extra={"batch": int(variant[1:]), "kind": case.kind,
                       "description": case.description},
                bandwidth=False)
        if key in drop and "stitching" in mode_list:
            row["modes"]["stitching"] = {"ok": False, "error": drop[key], "time": None,
                                         "check": None, "first_call_s": None}
        rows.append(row)
        if on_row:
            on_row(key, row)
        gc.collect()
    return rows


def call_overhead(mode_list, planner=None, repeats=10) -> dict:
    """{mode: median seconds per call} of ``tf.identity`` on an 8x1024 float32 tensor:
    what each mode costs per call before any kernel runs (stitching.function sends
    eager tensors straight to the concrete function; tf.function canonicalises first)."""
    x = tf.constant(np.zeros((8, 1024), np.float32))
    sig = [tf.TensorSpec([None, 1024], tf.float32)]
    runners = [modes.build(m, lambda t: tf.identity(t), sig, planner) for m in mode_list]
    for r in runners:
        modes.first_call(r, [x])
    times = measure.time_modes(runners, [x], repeats=repeats, warmup=20)
    return {m: t["median_s"] for m, t in times.items()}


def run_patterns(*, only=None, sizes=("large", "small"), **kw) -> list[dict]:
    return run_rows("patterns", case_keys("patterns", only=only, sizes=sizes), **kw)


def run_models(*, only=None, batches=None, **kw) -> list[dict]:
    return run_rows("models", case_keys("models", only=only, batches=batches), **kw)


# ---- compile: first calls in fresh processes

COMPILE_STEPS = (
    # (row key, mode, cache: "fresh" | "reuse" | "sync" | None)
    ("tf_first", "tf", None),
    ("xla_first", "xla", None),
    # stitching.function as a user gets it by default, with an empty cache: tiered,
    # the first call on stock TF while the kernels compile behind it; the child then
    # waits for them (ready_s: when the stitched graph could take over)
    ("stitching_cold", "stitching_default", "fresh"),
    # a second process reusing that cache: the result cache serves the first call
    ("stitching_warm", "stitching_default", "reuse"),
    # synchronous (Options(background_compile=False)), an empty cache of its own: the
    # first call waits for planning and compiling (what the compiler costs)
    ("stitching_sync", "stitching", "sync"),
)
_MARK = "@@BENCH_CHILD@@"


def run_compile(*, only=None, batch=1, planner=None, mode_list=modes.MODES,
                timeout=600, rounds=3) -> list[dict]:
    """First calls in fresh processes, ``rounds`` times (each round: its own empty kernel
    cache for the cold run, reused by the warm one).  A step's cell is the round with
    the median first call; every round's time is kept in ``samples_s``."""
    rows = []
    prebuild = _prebuild_op_library() if "stitching" in mode_list else None
    for case in _compile_cases(batch):
        if only and case.name not in only:
            continue
        row = {"suite": "compile", "op_library_prebuild": prebuild, "name": case.name,
               "batch": case.batch, "kind": case.kind, "steps": {}, "rounds": rounds}
        runs = {}
        for rnd in range(max(1, rounds)):
            with tempfile.TemporaryDirectory(prefix="stitching-bench-cache-") as cache, \
                    tempfile.TemporaryDirectory(prefix="stitching-bench-cache-") as cache_sync:
                for key, mode, cache_use in COMPILE_STEPS:
                    if (mode if mode != "stitching_default" else "stitching") not in mode_list:
                        continue
                    _log(f"[compile] {case.name} {key} (round {rnd + 1}/{rounds})")
                    env = dict(os.environ)
                    env.pop("STITCHING_BACKGROUND_COMPILE", None)    # the default's
                    if cache_use:
                        env["STITCHING_CACHE_DIR"] = cache_sync if cache_use == "sync" \
                            else cache
                    s = _child(mode, case.name, case.batch, planner, env, timeout)
                    runs.setdefault(key, []).append(s)
                    _log(f"  {key}: " + (f"{s['first_call_s']:.2f} s" if s.get("ok")
                                         else f"FAILED ({s.get('error')})"))
        for key, results in runs.items():
            row["steps"][key] = median_run(results)
        rows.append(row)
    return rows


TRAIN_PREFIX = "train:"


def _compile_cases(batch: int) -> list:
    """The compile suite's rows: every inference model at ``batch``, then each training
    case of the train suite (``train:<name>``, its own batch): the first call of one
    training step (forward, gradients, optimizer update)."""
    from types import SimpleNamespace

    from stitching.testing import models as M
    from stitching.testing import train as T
    return ([SimpleNamespace(name=c.name, batch=batch, kind=c.kind) for c in M.all_models()]
            + [SimpleNamespace(name=TRAIN_PREFIX + n, batch=c.batch, kind="train")
               for n, c in T.CASES.items()])


def median_run(results: list, key: str = "first_call_s", digits: int = 3) -> dict:
    """The run with the median ``key`` (a failure if any round failed); its
    ``samples_s`` lists every round's ``key``."""
    bad = [r for r in results if not r.get("ok")]
    if bad:
        return bad[0]
    ordered = sorted(results, key=lambda r: r[key])
    out = dict(ordered[(len(ordered) - 1) // 2])
    out["samples_s"] = [round(r[key], digits) for r in results]
    return out


def _prebuild_op_library() -> dict:
    """Run the install step into the default cache first (untimed).

    ``python -m stitching.runtime.build`` (like a wheel's compiled extension) builds
    the StitchedKernel op library, the shape-program interpreter and the math helpers
    kernels call (compile/helper_cache.py): none is per-model compilation, and
    stitching reuses them from the default cache when STITCHING_CACHE_DIR points
    elsewhere, so the cold runs below start with an empty *kernel* cache but do not
    pay for g++ on op.cc or for compiling exp/tanh/erf.

    The package's bytecode is written too, as installing a wheel does: TensorFlow's
    and Keras's modules come with theirs, and where ``PYTHONDONTWRITEBYTECODE`` is
    set (as on this project's machines) every stitching process compiled its ~110
    modules from source again (0.9 s measured on a loaded machine), in each mode
    that imports stitching and in each compile worker."""
    import compileall
    compileall.compile_dir(os.path.join(REPO, "stitching"), quiet=1)
    env = dict(os.environ)
    env.pop("STITCHING_CACHE_DIR", None)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "stitching.runtime.build"], env=env,
                           capture_output=True, text=True, timeout=600, cwd=REPO)
    except Exception as e:
        return {"ok": False, "error": modes.first_line(e)}
    res = {"ok": p.returncode == 0, "seconds": round(time.perf_counter() - t0, 1)}
    if p.returncode:
        res["error"] = (p.stderr.strip().splitlines() or ["?"])[-1]
    _log(f"[compile] op library prebuild: {res}")
    return res


def _child(mode, model, batch, planner, env, timeout) -> dict:
    cmd = [sys.executable, os.path.join(REPO, "tools", "bench.py"), "--_child", mode,
           "--only", model, "--batch", str(batch)]
    if planner:
        cmd += ["--planner", planner]
    return run_child(cmd, env, timeout)


def run_child(cmd, env, timeout, mark=_MARK) -> dict:
    """Run ``cmd`` in a fresh process (this repository first on its path): its result
    is the JSON on its last stdout line that starts with ``mark``, plus
    ``process_wall_s``, the process's whole life as seen from here."""
    env = dict(env)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"child timed out after {timeout} s"}
    wall = time.perf_counter() - t0
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(mark):
            res = json.loads(line[len(mark):])
            res["process_wall_s"] = wall
            return res
    tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"ok": False, "error": f"child exited {p.returncode}: {tail}",
            "process_wall_s": wall}


def compile_child(mode, model, batch, planner) -> None:
    """Runs in a fresh process: build the model (not timed), then time the first call
    (trace + graph optimization / XLA compile / stitching plan + kernel compile + run)
    and one more call for reference."""
    res = {"mode": mode, "model": model, "batch": batch}
    try:
        if model.startswith(TRAIN_PREFIX):      # one training step, its case's batch
            from stitching.testing import train as T
            step = T.make_step(model[len(TRAIN_PREFIX):])
            fn, args, signature = step.fn, [step.x, step.y], None
        else:
            from stitching.testing import models as M
            case = M.get(model)
            fn, signature = case.make_fn(), case.input_signature()
            args = [tf.constant(a) for a in case.inputs(batch)]
        r = modes.build(mode, fn, signature, planner)
        modes.first_call(r, args)
        res["ok"] = r.ok
        res["error"] = r.error
        res["first_call_s"] = r.first_call_s
        if r.ok and mode == "stitching_default":
            t0 = time.perf_counter()
            res["ok"] = r.fn.wait(timeout=600)
            res["ready_s"] = r.first_call_s + time.perf_counter() - t0
            if not res["ok"]:
                res["error"] = "background compile failed: " + "; ".join(
                    modes.first_line(e) for e in r.fn.background_errors)
        if res["ok"]:
            t0 = time.perf_counter()
            r.fn(*args)
            res["second_call_s"] = time.perf_counter() - t0
            if mode in ("stitching", "stitching_default"):
                modes.collect_counts(r, args)
                rep = r.info.get("report") or {}
                res["kernels"] = rep.get("kernels")
                res["codes"] = rep.get("code_objects")
                res["compile_seconds"] = rep.get("compile_seconds")
            res["notes"] = r.info.get("notes", [])
    except Exception as e:
        res["ok"] = False
        res["error"] = modes.first_line(e)
    print(_MARK + json.dumps(res), flush=True)
