"""The serving suite: a Keras model exported as a SavedModel, served three ways.

    tf          the exported SavedModel, ``tf.saved_model.load`` + its signature
    xla         the same, with XLA auto-clustering on (``tf.config.optimizer.set_jit``)
    stitching   ``stitching-rewrite`` of it (kernels shipped in its assets), loaded
                after ``import stitching`` with an empty kernel cache

Each measurement is a fresh process (``tools/bench.py --_serve MODE``, which has imported
TensorFlow before the clock starts): the time from ``import stitching`` (its mode only)
through ``tf.saved_model.load`` to the first call's result at batch 1 ("load + first
call"),
then steady-state latency at batch 1 and 32 (``--serve-calls`` calls after 3 warm-up
calls each; p50 and p99).  ``rounds`` processes per mode, in turn; a cell is the round
with the median load + first call.  Outputs are compared with stock TF's on the same
inputs.  The artifacts are prepared once per model in another process (not timed).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from . import suites

MODES = ("tf", "xla", "stitching")
BATCHES = (1, 32)
_MARK = "SERVING_RESULT "
DEFAULT_MODELS = ("mobilenet_v2", "transformer")


def run_serving(*, only=None, rounds=3, calls=50, timeout=900) -> list[dict]:
    from stitching.testing import models as M
    rows = []
    prebuild = suites._prebuild_op_library()
    names = only or DEFAULT_MODELS
    for case in M.all_models():
        if case.name not in names:
            continue
        with tempfile.TemporaryDirectory(prefix="stitching-serving-") as d:
            suites._log(f"[serving] {case.name}: export + stitching-rewrite (untimed)")
            prep = _run_child("prepare", case.name, d, calls, timeout)
            row = {"suite": "serving", "name": case.name, "batch": "1/32",
                   "op_library_prebuild": prebuild, "prepare": prep, "steps": {},
                   "rounds": rounds}
            if not prep.get("ok"):
                row["steps"] = {m: prep for m in MODES}
                rows.append(row)
                continue
            runs = {m: [] for m in MODES}
            for rnd in range(rounds):
                for mode in MODES:
                    suites._log(f"[serving] {case.name} {mode} (round {rnd + 1}/{rounds})")
                    runs[mode].append(_run_child(mode, case.name, d, calls, timeout))
            for mode, results in runs.items():
                row["steps"][mode] = suites.median_run(results, "load_first_s", 2)
            _check(row, d)
        rows.append(row)
    return rows


def _check(row, d):
    """Max abs difference of each mode's batch-32 output from stock TF's."""
    try:
        ref = np.load(os.path.join(d, "out_tf.npy"))
    except OSError:
        return
    for mode in MODES:
        s = row["steps"].get(mode) or {}
        try:
            s["max_abs_err"] = float(np.abs(np.load(os.path.join(d, f"out_{mode}.npy"))
                                            - ref).max())
        except OSError:
            pass


def _run_child(what, model, d, calls, timeout) -> dict:
    cmd = [sys.executable, os.path.join(suites.REPO, "tools", "bench.py"), "--_serve", what,
           "--only", model, "--_serve-dir", d, "--serve-calls", str(calls)]
    env = dict(os.environ)
    env["PYTHONPATH"] = suites.REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with tempfile.TemporaryDirectory(prefix="stitching-serving-cache-") as cache:
        env["STITCHING_CACHE_DIR"] = cache            # empty: kernels come from the model
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                               timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timed out after {timeout} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"ok": False, "error": f"child exited {p.returncode}: {tail}"}


# ---- in the child processes -----------------------------------------------------------

def child(what, model, d, calls) -> None:
    t0 = time.perf_counter()
    try:
        res = _prepare(model, d) if what == "prepare" else _serve(what, model, d, calls, t0)
        res["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported as a failed cell
        res = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    print(_MARK + json.dumps(res), flush=True)


def _prepare(model, d) -> dict:
    from stitching.testing import models as M
    from stitching.saved_model import rewrite_saved_model
    case = M.get(model)
    keras_model = case.model          # seeded weights
    t = time.perf_counter()
    keras_model.export(os.path.join(d, "src"), verbose=False)
    reports = rewrite_saved_model(os.path.join(d, "src"), os.path.join(d, "stitching"))
    rng = np.random.default_rng(0)
    for b in BATCHES:
        np.save(os.path.join(d, f"x{b}.npy"),
                rng.standard_normal((b,) + tuple(case.input_shape)).astype(np.float32))
    rep = reports["serving_default"].to_dict()
    return {"rewrite_s": round(time.perf_counter() - t, 1), "kernels": rep.get("kernels"),
            "assets": sorted(os.listdir(os.path.join(d, "stitching", "assets")))}


def _serve(mode, model, d, calls, t0) -> dict:
    if mode == "stitching":
        import stitching  # noqa: F401  (registers the ops)
    import tensorflow as tf
    if mode == "xla":
        # XLA for a loaded SavedModel is auto-clustering: a restored signature cannot be
        # wrapped in tf.function(jit_compile=True) (TF asserts while tracing it)
        tf.config.optimizer.set_jit("autoclustering")
    path = os.path.join(d, "stitching" if mode == "stitching" else "src")
    sig = tf.saved_model.load(path).signatures["serving_default"]
    name = list(sig.structured_input_signature[1])[0]

    def call(x):
        return sig(**{name: x})
    xs = {b: tf.constant(np.load(os.path.join(d, f"x{b}.npy"))) for b in BATCHES}
    first = list(call(xs[1]).values())[0].numpy()
    res = {"load_first_s": time.perf_counter() - t0, "first_shape": list(first.shape)}
    for b in BATCHES:
        for _ in range(3):
            out = list(call(xs[b]).values())[0]
        times = []
        for _ in range(calls):
            s = time.perf_counter()
            out = list(call(xs[b]).values())[0].numpy()
            times.append(time.perf_counter() - s)
        res[f"p50_b{b}_ms"] = float(np.percentile(times, 50)) * 1e3
        res[f"p99_b{b}_ms"] = float(np.percentile(times, 99)) * 1e3
    np.save(os.path.join(d, f"out_{mode}.npy"), out)
    res["numba_imported"] = "numba" in sys.modules
    return res


# ---- output ---------------------------------------------------------------------------

def serving_table(rows):
    head = ["model", "mode", "load + first call s", "p50 b1 ms", "p99 b1 ms",
            "p50 b32 ms", "p99 b32 ms", "max abs err vs TF", "Numba imported"]
    body = []
    for r in rows:
        for mode in MODES:
            s = r["steps"].get(mode) or {}
            if not s.get("ok"):
                body.append([r["name"], mode, "FAILED"] + ["-"] * 6)
                continue
            body.append([r["name"], mode,
                         f"{s['load_first_s']:.2f} ({'/'.join(map(str, s.get('samples_s', [])))})",
                         *(f"{s[k]:.2f}" for k in ("p50_b1_ms", "p99_b1_ms", "p50_b32_ms",
                                                    "p99_b32_ms")),
                         f"{s['max_abs_err']:.2g}" if "max_abs_err" in s else "-",
                         "yes" if s.get("numba_imported") else "no"])
    return head, body


def target_lines(rows) -> list[str]:
    """The issue's bar: the rewritten model's load + first call <= stock TF's + 10%,
    without Numba."""
    out = []
    for r in rows:
        tf_, st = r["steps"].get("tf") or {}, r["steps"].get("stitching") or {}
        if not (tf_.get("ok") and st.get("ok")):
            out.append(f"FAIL  serving: {r['name']}: a mode failed")
            continue
        ok = st["load_first_s"] <= 1.10 * tf_["load_first_s"] and not st["numba_imported"]
        out.append(f"{'PASS' if ok else 'FAIL'}  serving: {r['name']} load + first call "
                   f"{st['load_first_s']:.2f} s vs stock TF {tf_['load_first_s']:.2f} s "
                   f"(bar: <= +10% and no Numba; "
                   f"{'Numba imported' if st['numba_imported'] else 'Numba not imported'})")
    return out
