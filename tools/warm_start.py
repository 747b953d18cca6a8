#!/usr/bin/env python
"""What a warm process spends beyond stock TF, by phase (issue 39: warm starts).

    python tools/warm_start.py --rounds 5 [--repo OTHER_CHECKOUT ...]

The short suite's mlp_fit job (tools/bench_lib/short.py: Keras MLP 32-64-1, GELU,
LayerNorm, Adam, ``fit`` 2 epochs x 8 steps, then ``evaluate``) in fresh processes:
stock Keras, and ``stitching.keras.stitch`` with a warm cache, both synchronous
(``background_compile=False``) and with the default tiering: two priming processes,
untimed, ran the job first, one synchronously and one tiered that then called
``stitching.keras.wait(model)``, so every kernel, plan and stored result of either
way is there (the two trace different graphs: Keras's batch size, or any).  Each ``--repo`` is a checkout of stitching run the same way (its own
cache), so two versions compare in one run; rounds are interleaved.

Per process: the wall time of the whole process and of the job, CPU seconds, and
the stitching phases timed by wrapping their functions (inclusive seconds; the
step's own Python, which stock TF traces too, is taken out of ``trace``):

    import     ``import stitching.keras`` (the op library's load included)
    trace      StitchedFunction._stitched_trace minus the step's Python and minus stitch
    stitch     pipeline.stitch_graph_def, or the result cache's probe (plan, rewrite,
               kernel loads)
    register   runtime.register (kernel registration, inside stitch)

A cell is the median over rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MARK = "@@WARM@@"
CHILD = r"""
import functools, json, os, sys, time
t_start = time.perf_counter()
import tensorflow as tf
import keras
sys.path.insert(0, os.environ["WARM_TOOLS"])
from bench_lib import short
mode = os.environ["WARM_MODE"]
acc = {}
def timed(owner, name, label):
    f = getattr(owner, name)
    @functools.wraps(f)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[label] = acc.get(label, 0.0) + time.perf_counter() - t
    setattr(owner, name, w)
from keras.src.backend.tensorflow import trainer
for step in ("train_step", "test_step", "predict_step"):
    timed(trainer.TensorFlowTrainer, step, "step python")
t0 = time.perf_counter()
keras.utils.set_random_seed(0)
x, y = short._data((32,), 1)
L = keras.layers
model = keras.Sequential([keras.Input((32,)), L.Dense(64), L.Activation("gelu"),
                          L.LayerNormalization(), L.Dense(1)])
model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
if mode != "tf":
    ti = time.perf_counter()
    import stitching, stitching.keras
    acc["import"] = time.perf_counter() - ti
    from stitching.tf import function as sf, pipeline
    from stitching.runtime import registry
    timed(sf.StitchedFunction, "_stitched_trace", "trace")
    timed(pipeline, "stitch_graph_def", "stitch")
    if hasattr(sf.StitchedFunction, "_stitch"):
        timed(sf.StitchedFunction, "_stitch", "stitch")
    timed(registry, "register", "register")
    opts = stitching.Options(background_compile=False) if mode in ("sync", "prime") \
        else None
    stitching.keras.stitch(model, opts)
hist = model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
loss = model.evaluate(x, y, batch_size=32, verbose=0)
t1 = time.perf_counter()
if mode == "prime_tiered":
    assert stitching.keras.wait(model)
cpu = os.times()
res = {"job_s": t1 - t0, "cpu_s": cpu.user + cpu.system, "loss": float(loss),
       "phases": acc}
if mode != "tf":
    res["steps"] = {k: [getattr(f, "stock_steps", None), getattr(f, "stitched_steps", None)]
                    for k, f in model._stitching_steps.items()}
print("@@WARM@@" + json.dumps(res), flush=True)
"""


def run(repo, mode, cache) -> dict:
    env = dict(os.environ, WARM_MODE=mode, WARM_TOOLS=HERE, STITCHING_CACHE_DIR=cache,
               PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TF_CPP_MIN_LOG_LEVEL="2")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                       text=True, cwd=repo, timeout=900)
    wall = time.perf_counter() - t0
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(MARK):
            res = json.loads(line[len(MARK):])
            res["process_s"] = wall
            ph = res["phases"]
            if "trace" in ph:        # the step's Python is traced by stock TF too
                ph["trace"] -= ph.get("step python", 0.0) + ph.get("stitch", 0.0)
            return res
    raise RuntimeError(f"{repo} {mode}: {p.stderr[-2000:]}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repo", action="append", default=[],
                    help="another checkout to compare (default: this one only)")
    args = ap.parse_args(argv)
    repos = [REPO] + [os.path.abspath(r) for r in args.repo]
    caches = {r: tempfile.mkdtemp(prefix="stitching-warm-") for r in repos}
    for r in repos:
        run(r, "prime", caches[r])
        run(r, "prime_tiered", caches[r])
    cells = [("tf", REPO)] + [(m, r) for r in repos for m in ("sync", "tiered")]
    runs = {c: [] for c in cells}
    for i in range(args.rounds):
        for mode, repo in cells:
            runs[(mode, repo)].append(run(repo, mode, caches[repo]))
            print(f"round {i + 1} {mode:6s} {os.path.basename(repo)}: "
                  f"{runs[(mode, repo)][-1]['process_s']:.2f} s", file=sys.stderr)
    med = statistics.median
    tf_ = {k: med(r[k] for r in runs[("tf", REPO)]) for k in ("process_s", "job_s", "cpu_s")}
    print("| checkout | mode | process s | / TF | job s | CPU s | CPU over TF | import | "
          "trace | stitch | register | steps stock/stitched |")
    print("|" + "---|" * 12)
    for (mode, repo), rs in runs.items():
        m = {k: med(r[k] for r in rs) for k in ("process_s", "job_s", "cpu_s")}
        ph = {k: med(r["phases"].get(k, 0.0) for r in rs)
              for k in ("import", "trace", "stitch", "register")}
        steps = rs[0].get("steps") or {}
        print(f"| {os.path.basename(repo)} | {mode} | {m['process_s']:.2f} | "
              f"{m['process_s'] / tf_['process_s']:.2f}x | {m['job_s']:.2f} | "
              f"{m['cpu_s']:.2f} | {m['cpu_s'] - tf_['cpu_s']:+.2f} | "
              + " | ".join(f"{ph[k]:.3f}" for k in ph) + " | "
              + ", ".join(f"{k} {s[0]}/{s[1]}" for k, s in steps.items()
                          if s[0] is not None) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
