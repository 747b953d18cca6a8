"""Chained transcendentals: what the cost model's chain pricing rests on.

    python tools/chain_bench.py                           # tables on stdout
    python tools/chain_bench.py --markdown BENCHMARKS.md  # section chains[@class]

The per-op compute costs (tools/calibrate.py --ops) are measured on independent
evaluations: six of one op on shifted inputs, summed.  Where one transcendental
consumes another's result the evaluations of an element wait on each other
(plan/cost.py: ``chained_evaluations``).  Two tables, all in one process, modes timed
interleaved (bench_lib.measure.time_modes, medians of ``--repeats`` calls):

1. Per op, on 4 MiB of float32, one generated kernel each, planned with the
   ``cpu-reference`` profile (no factors) and chains priced as independent ops, so that
   each is one kernel whatever this machine's model says:
   six chained (``op(op(...op(x)))``) against six independent (``sum op(x + k/8)``),
   less the independent kernel of Neg (the adds, the traffic, the call).  'chained /
   independent' is the latency's price.
2. Three functions at [64, 32, 4, 64] with this machine's own plan (default options)
   against stock TF and against the whole function forced into one kernel (as in 1):
   a chain of six Tanh/Exp/Sigmoid/Erf, a chain of six Sin/Cos, and
   RoPE's ``y cos p + reverse(y) sin p`` (its Sin and Cos independent).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("STITCHING_TIERED_COMPILE", "0")   # time the final code only
# A cache of its own: the stored plans and results are keyed on the graph and profile,
# not on the CHAIN_LATENCY this tool patches to force one kernel (_first_call).
os.environ["STITCHING_CACHE_DIR"] = __import__("tempfile").mkdtemp(prefix="chain-bench-")

OPS = ("Exp", "Tanh", "Sigmoid", "Erf", "Sin", "Cos")
SHAPE = (64, 32, 4, 64)


def _stitched(fn):
    import stitching
    return stitching.function(fn, options=stitching.Options(background_compile=False,
                                                            progress=False))


def _first_call(st, args, profile=None):
    """Call ``st`` once, planned with ``profile`` (None: the default); its kernels.
    With a profile, chains are priced as independent ops (CHAIN_LATENCY 1), so a
    chain is one kernel: the layout this tool compares against."""
    from stitching.plan import cost
    saved, latency = os.environ.get("STITCHING_DEVICE_PROFILE"), cost.CHAIN_LATENCY
    if profile:
        os.environ["STITCHING_DEVICE_PROFILE"] = profile
        cost.CHAIN_LATENCY = 1.0
    try:
        st(*args)
    finally:
        cost.CHAIN_LATENCY = latency
        if saved is None:
            os.environ.pop("STITCHING_DEVICE_PROFILE", None)
        else:
            os.environ["STITCHING_DEVICE_PROFILE"] = saved
    return len(st.report.kernels)


def per_op(repeats: int) -> list[dict]:
    import numpy as np
    import tensorflow as tf

    from bench_lib.measure import time_modes
    from bench_lib.modes import Runner
    n = (4 << 20) // 4
    x = tf.constant(np.random.default_rng(0).uniform(-0.5, 0.5, (n // 1024, 1024))
                    .astype(np.float32))
    fns = {"Neg": tf.negative, "Exp": tf.exp, "Tanh": tf.tanh, "Sigmoid": tf.sigmoid,
           "Erf": tf.math.erf, "Sin": tf.sin, "Cos": tf.cos}
    times = {}
    for name, fn in fns.items():
        def many(v, fn=fn):
            return tf.add_n([fn(v + k / 8) for k in range(6)])

        def chain(v, fn=fn):
            for _ in range(6):
                v = fn(v)
            return v
        runners = []
        for label, f in (("independent", many), ("chained", chain)):
            if name == "Neg" and label == "chained":
                continue                  # Grappler folds a double negation away
            st = _stitched(f)
            if _first_call(st, (x,), "cpu-reference") != 1:
                raise RuntimeError(f"{name} {label}: not one kernel")
            runners.append(Runner(label, st))
        t = time_modes(runners, (x,), repeats=repeats, warmup=3)
        times[name] = {k: v["median_s"] for k, v in t.items()}
    base = times.pop("Neg")["independent"]
    exp = times["Exp"]["independent"] - base
    rows = []
    for name, t in times.items():
        ind, ch = t["independent"] - base, t["chained"] - base
        rows.append({"op": name, "independent ms": ind * 1e3, "chained ms": ch * 1e3,
                     "chained / independent": ch / ind, "chained op, Exps": ch / exp})
    return rows


def functions(repeats: int) -> list[dict]:
    import numpy as np
    import tensorflow as tf

    from bench_lib.measure import time_modes
    from bench_lib.modes import Runner
    rng = np.random.default_rng(0)
    x = tf.constant(rng.uniform(-3, 3, SHAPE).astype(np.float32))
    y = tf.constant(rng.standard_normal(SHAPE).astype(np.float32))

    def six(v, w):
        for fn in (tf.tanh, tf.exp, tf.sigmoid, tf.math.erf, tf.tanh, tf.sigmoid):
            v = fn(v)
        return v + w

    def trig(v, w):
        for fn in (tf.sin, tf.cos) * 3:
            v = fn(v)
        return v + w

    def rope(v, w):
        p = v * 3.0 + 1.0
        return w * tf.cos(p) + tf.reverse(w, [-1]) * tf.sin(p)
    rows = []
    for name, fn in (("chain of Tanh, Exp, Sigmoid, Erf, Tanh, Sigmoid", six),
                     ("chain of Sin, Cos x 3", trig), ("RoPE: y cos p + reverse(y) sin p", rope)):
        plan, one = _stitched(fn), _stitched(fn)
        kernels = _first_call(plan, (x, y))
        _first_call(one, (x, y), "cpu-reference")
        t = time_modes([Runner("tf", tf.function(fn)), Runner("planned", plan),
                        Runner("one kernel", one)], (x, y), repeats=repeats, warmup=3)
        m = {k: v["median_s"] * 1e3 for k, v in t.items()}
        rows.append({"function": name, "TF ms": m["tf"], "planned ms": m["planned"],
                     "planned kernels": kernels, "one kernel ms": m["one kernel"],
                     "planned vs TF": m["tf"] / m["planned"]})
    return rows


def _table(rows) -> tuple:
    cols = list(rows[0])
    fmt = [[f"{r[c]:.2f}x" if c.endswith((" / independent", "vs TF")) else
            f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols]
           for r in rows]
    return cols, fmt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=21, help="interleaved calls per mode")
    ap.add_argument("--markdown", metavar="PATH")
    args = ap.parse_args(argv)
    from bench_lib.output import render_markdown, render_text
    ops, fns = per_op(args.repeats), functions(args.repeats)
    print(render_text(*_table(ops)))
    print(render_text(*_table(fns)))
    if args.markdown:
        from bench_lib.output import write_probe_section
        write_probe_section(
            args.markdown, "chains", "transcendentals that wait on each other",
            f"python tools/chain_bench.py --repeats {args.repeats}",
            [_table(ops), _table(fns)], "`tools/chain_bench.py` says what each column runs.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
