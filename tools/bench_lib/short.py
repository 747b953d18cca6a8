"""The short suite: whole short Keras jobs, each in a fresh process, cold and warm.

A user's first minutes: build a model, ``compile``, a short ``fit`` or a few
``predict`` calls.  Each job runs four ways, every one in its own process
(``tools/bench.py --_short JOB:MODE``):

    tf              stock Keras (``jit_compile=False``)
    xla             ``jit_compile=True``
    stitching_cold  ``stitching.keras.stitch(model)`` after ``compile``, with an empty
                    ``STITCHING_CACHE_DIR`` (a temporary directory per round)
    stitching_warm  the same again in a new process, reusing that round's cache once
                    it is warm: between the two, an untimed ``stitching_prime``
                    process runs the job and then ``stitching.keras.wait(model)``, so
                    every step function the job runs has its kernels, plan and
                    stitched graph cached (the cold job itself ends before its
                    kernels would be ready: tiered execution's point)

Jobs (data from a fixed seed, weights from ``keras.utils.set_random_seed(0)``):

    mlp_fit     Dense 32->64, GELU (exact), LayerNorm, Dense 64->1; Adam, MSE;
                ``fit`` 2 epochs of 8 steps (256 samples, batch 32), then ``evaluate``
    cnn_fit     stitching.testing.models.small_cnn at 32x32x3, 16 channels, 10 classes;
                Adam, sparse categorical cross-entropy; ``fit`` 1 epoch of 8 steps
    predict100  the same CNN, compiled; 100 ``predict`` calls on a batch of 32

The timings and the comparison are method_text()'s.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from . import suites

JOBS = ("mlp_fit", "cnn_fit", "predict100")
MODES = ("tf", "xla", "stitching_cold", "stitching_warm")
_MARK = "@@SHORT_RESULT@@"
SAMPLES, BATCH = 256, 32


def run_short(*, only=None, rounds=3, timeout=900) -> list[dict]:
    """One row per job: each mode ``rounds`` times in fresh processes, interleaved."""
    prebuild = suites._prebuild_op_library()
    rows = []
    for job in JOBS:
        if only and job not in only:
            continue
        runs = {m: [] for m in MODES}
        for rnd in range(max(1, rounds)):
            with tempfile.TemporaryDirectory(prefix="stitching-short-cache-") as cache:
                for mode in MODES:
                    if mode == "stitching_warm":
                        primed = _run_child(job, "stitching_prime", cache, timeout)
                        if not primed.get("ok"):
                            suites._log(f"  priming the cache FAILED ({primed.get('error')})")
                    suites._log(f"[short] {job} {mode} (round {rnd + 1}/{rounds})")
                    s = _run_child(job, mode, cache, timeout)
                    runs[mode].append(s)
                    suites._log(f"  {mode}: " + (
                        f"job {s['job_s']:.2f} s, process {s['process_wall_s']:.2f} s"
                        if s.get("ok") else f"FAILED ({s.get('error')})"))
        rows.append({"suite": "short", "name": job, "rounds": rounds,
                     "op_library_prebuild": prebuild,
                     "steps": {m: suites.median_run(r, "process_wall_s", 2)
                               for m, r in runs.items()}})
    return rows


def _run_child(job, mode, cache, timeout) -> dict:
    cmd = [sys.executable, os.path.join(suites.REPO, "tools", "bench.py"), "--_short",
           f"{job}:{mode}"]
    env = dict(os.environ)
    if mode.startswith("stitching"):
        env["STITCHING_CACHE_DIR"] = cache
    return suites.run_child(cmd, env, timeout, _MARK)


# ---- the child: one job, one mode

def child(spec: str) -> None:
    """Runs in a fresh process (TensorFlow imported by bench.py before the clock)."""
    job, _, mode = spec.partition(":")
    res = {"job": job, "mode": mode}
    try:
        t0 = time.perf_counter()
        res["result"] = _JOBS[job](mode)
        res["job_s"] = time.perf_counter() - t0
        res["tiers"] = _tiers()
        if mode == "stitching_prime":       # the untimed process that warms the cache
            import stitching.keras
            res["primed"] = stitching.keras.wait(_MODELS[0])
        res["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported as the cell's error
        res["ok"] = False
        res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    print(_MARK + json.dumps(res), flush=True)


_MODELS = []                     # the stitched model of this child's job


def _tiers() -> dict:
    """Per step function of the stitched model (tiered execution, stitching/keras.py)
    that ran: the steps stock TF ran, the steps the kernels ran, and the step that
    first ran stitched (0: none)."""
    if not _MODELS:
        return {}
    return {kind: {"stock": f.stock_steps, "stitched": f.stitched_steps,
                   "from": f.switch[0] if f.switch else 0}
            for kind, f in _MODELS[0]._stitching_steps.items()
            if f.stock_steps or f.stitched_steps}


def _data(shape, seed, classes=None):
    import numpy as np
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((SAMPLES, *shape)).astype(np.float32)
    if classes:
        return x, rng.integers(0, classes, SAMPLES).astype(np.int32)
    return x, (x[:, :1] * 0.5 + np.sin(x[:, 1:2])).astype(np.float32)


def _compiled(model, mode, loss):
    import keras
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss,
                  jit_compile=(mode == "xla"))
    if mode.startswith("stitching"):
        import stitching.keras
        stitching.keras.stitch(model)
        _MODELS.append(model)
    return model


def _mlp_fit(mode):
    import keras
    keras.utils.set_random_seed(0)
    x, y = _data((32,), 1)
    L = keras.layers
    model = keras.Sequential([keras.Input((32,)), L.Dense(64), L.Activation("gelu"),
                              L.LayerNormalization(), L.Dense(1)])
    _compiled(model, mode, "mse")
    hist = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False)
    return {"fit_loss": float(hist.history["loss"][-1]),
            "eval_loss": float(model.evaluate(x, y, batch_size=BATCH, verbose=0))}


def _cnn(mode):
    import keras

    from stitching.testing.models import small_cnn
    keras.utils.set_random_seed(0)
    return _compiled(small_cnn(size=32, channels=16, classes=10), mode,
                     "sparse_categorical_crossentropy")


def _cnn_fit(mode):
    model = _cnn(mode)
    x, y = _data((32, 32, 3), 2, classes=10)
    hist = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    return {"fit_loss": float(hist.history["loss"][-1])}


def _predict100(mode):
    model = _cnn(mode)
    x, _ = _data((32, 32, 3), 3, classes=10)
    for _ in range(100):
        out = model.predict(x[:BATCH], batch_size=BATCH, verbose=0)
    return {"predict_mean": float(out.mean())}


_JOBS = {"mlp_fit": _mlp_fit, "cnn_fit": _cnn_fit, "predict100": _predict100}


# ---- the table

def _result_gap(step, ref) -> str:
    """Largest relative difference of the job's results from stock TF's."""
    a, b = (step or {}).get("result") or {}, (ref or {}).get("result") or {}
    gaps = [abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for k in b if k in a]
    return f"{max(gaps):.1e}" if gaps else "-"


def short_table(rows):
    head = ["job", "TF process s", "XLA process s", "st cold process s",
            "st warm process s", "cold / XLA", "warm / TF", "job s TF/XLA/cold/warm",
            "result vs TF, XLA/cold/warm (rel)", "steps stock/stitched, cold | warm"]
    body = []
    for r in rows:
        s = r["steps"]

        def val(mode, key="process_wall_s"):
            v = s.get(mode) or {}
            return v.get(key) if v.get("ok") else None

        def cell(mode):
            v = val(mode)
            return f"{v:.2f}" if v is not None else "FAILED"
        tf_, xla, cold, warm = (val(m) for m in MODES)
        body.append([
            r["name"], cell("tf"), cell("xla"), cell("stitching_cold"), cell("stitching_warm"),
            f"{cold / xla:.2f}x" if cold and xla else "-",
            f"{warm / tf_:.2f}x" if warm and tf_ else "-",
            "/".join(f"{val(m, 'job_s'):.2f}" if val(m, "job_s") is not None else "-"
                     for m in MODES),
            " / ".join(_result_gap(s.get(m), s.get("tf")) for m in MODES[1:]),
            " | ".join(_tier_cell(s.get(m)) for m in MODES[2:])])
    return head, body


def _tier_cell(step) -> str:
    """What ran, per step function: 'train 16/0, test 8/0' (stock steps / stitched)."""
    tiers = (step or {}).get("tiers") or {}
    return ", ".join(f"{k} {t['stock']}/{t['stitched']}" for k, t in tiers.items()) \
        or "-"


def round_lines(rows) -> list[str]:
    """Every round's process time per job and mode: on a shared machine the rounds of
    one cell differ by tens of percent, and the reader should see by how much."""
    out = []
    for r in rows:
        cells = [f"{m} " + "/".join(f"{v:.1f}" for v in (r["steps"].get(m) or {}).get(
            "samples_s") or []) for m in MODES]
        out.append(f"{r['name']} rounds (process s): " + "; ".join(cells))
    return out


def target_lines(rows) -> list[str]:
    """The issue's bars: warm whole process <= 1.1x stock TF's, cold <= XLA's."""
    lines = []
    for r in rows:
        s = r["steps"]
        t = {m: (s.get(m) or {}).get("process_wall_s") if (s.get(m) or {}).get("ok")
             else None for m in MODES}
        if None in t.values():
            lines.append(f"FAIL  short {r['name']}: a mode failed")
            continue
        warm_ok = t["stitching_warm"] <= 1.1 * t["tf"]
        cold_ok = t["stitching_cold"] <= t["xla"]
        lines.append(f"{'PASS' if warm_ok else 'FAIL'}  short {r['name']}: warm process "
                     f"<= 1.1x stock TF's: {t['stitching_warm'] / t['tf']:.2f}x")
        lines.append(f"{'PASS' if cold_ok else 'FAIL'}  short {r['name']}: cold process "
                     f"<= XLA's: {t['stitching_cold'] / t['xla']:.2f}x")
    return lines


def method_text() -> str:
    return (
        "Whole short Keras jobs, each run in a fresh process (`tools/bench.py --_short "
        "JOB:MODE`): stock Keras (`jit_compile=False`), XLA (`jit_compile=True`), "
        "`stitching.keras.stitch(model)` with an empty `STITCHING_CACHE_DIR` (cold) and "
        "again in a new process reusing that cache (warm). Jobs: **mlp_fit**, Dense "
        "32->64, exact GELU, LayerNorm, Dense 64->1, Adam, MSE, `fit` 2 epochs of 8 steps "
        "(256 samples, batch 32) then `evaluate`; **cnn_fit**, "
        "`stitching.testing.models.small_cnn` at 32x32x3 (16 channels, 10 classes), Adam, "
        "`fit` 1 epoch of 8 steps; **predict100**, the same CNN, 100 `predict` calls on a "
        "batch of 32. 'process s' is the child's whole life (Python start and `import "
        "tensorflow` included): what a user waits for when the job is a script; 'job s' "
        "is timed inside the child from before the model is built (`import stitching` "
        "included) to the job's end. Modes run interleaved, a round of all four in turn; "
        "a cell is the median round. 'cold / XLA' and 'warm / TF' are ratios of "
        "process times (the issue's bars: <= 1x and <= 1.1x). The last column is the "
        "relative difference of the "
        "job's final loss (or last prediction's mean) from stock TF's. Stitching is "
        "tiered (stitching.keras's default): a step runs stock Keras until its stitched "
        "twin is compiled in the background, which starts once the step's stock calls "
        "after the first have run 1 s (STITCHING_TIER_UP_SECONDS), except where the "
        "result cache already holds the stitched step (graph, plan and kernels): then "
        "it runs stitched from step 1. Between the cold and the warm process an "
        "untimed one runs the job and then `stitching.keras.wait(model)`, so the warm "
        "process finds every step it runs cached (a cold short job ends before its "
        "kernels would be ready, and leaves the cache as cold as it found it). The last "
        "column says, for the median round, how many steps each of train/test/predict "
        "ran on stock TF and how many on the kernels. The install step "
        "(op library, shape interpreter, math helpers) runs first, untimed, and writes "
        "the package's bytecode, as installing a wheel does (TF's and Keras's modules "
        "have theirs).")
