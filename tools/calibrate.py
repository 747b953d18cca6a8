#!/usr/bin/env python
"""Calibrate the cost model against measurements on this machine: its price of ops left
to TF, and its price of the kernels it generates.

    python tools/calibrate.py                         # print the table, write nothing
    python tools/calibrate.py --out my-profile.json   # a profile file for this machine:
        STITCHING_DEVICE_PROFILE=my-profile.json python ...   plans with it
    python tools/calibrate.py --install               # this machine's factors, used by
        every process here ($STITCHING_CACHE_DIR/calibration-cpu.json, bound to the CPU)
    python tools/calibrate.py --ship                  # the package's factors for this
                                  # CPU's class (stitching/plan/calibration-cpu-<class>.json)

For each op class the cost model tells apart (``plan.cost.tf_class``: element-wise,
transcendental, row reduction, column reduction, softmax) and each size (1, 4, 16, 64 MiB
of float32 input), one op runs alone two ways, timed interleaved as tools/bench.py times
modes (median per call, less each way's call overhead measured on a function doing next
to nothing): as stock TF in a ``tf.function``, and as one generated kernel in a
``stitching.function`` (``min_ops=1``).  The cost model prices the same op both ways from
the measured device profile, uncalibrated (``GraphCosts.unfused``; the search planner's
launch time for the kernel).  A class's factors are, per size, the median of measured
over modelled (less the profile's fixed launch and task cost, which calibration does not
scale: ``cost.calibrated_s``) across its shapes and ``--rounds``: tables the cost model interpolates in
log(size) and holds flat beyond 1 and 64 MiB (``profiles.tf_factor``).  The profile file
holds the measured device profile with them (``DeviceProfile.tf_time_scale`` for TF,
``kernel_time_scale`` for kernels: calibrating one side only would tilt every decision
toward the other).  Recalibrate after a change of machine, TF version, code generator or
cost model; on a shared machine run it when idle (it prints the copy bandwidth it saw,
to judge).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tools")]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

from bench_lib.measure import time_modes  # noqa: E402
from bench_lib.modes import Runner  # noqa: E402
from stitching.ir.graph import Graph, Node, TensorType, ValueRef  # noqa: E402
from stitching.plan import profiles  # noqa: E402
from stitching.plan.cost import GraphCosts, tf_class  # noqa: E402

SIZES_MIB = (1, 4, 16, 64)   # below 1 MiB the call overhead (~0.2 ms) swamps the op


def cases(mib: int):
    """(class, TF function builder, IR op, attrs, input shape) per op class at one size."""
    import tensorflow as tf
    n = int(mib * (1 << 20)) // 4
    yield ("elementwise", lambda x: x * 1.5, "Mul", {}, (n // 1024, 1024))   # one op
    yield ("transcendental", tf.exp, "Exp", {}, (n // 1024, 1024))
    for cols in (64, 1024):
        yield ("row_reduction", lambda x: tf.reduce_sum(x, axis=-1), "Sum",
               {"axes": [1], "keep_dims": False}, (n // cols, cols))
        yield ("column_reduction", lambda x: tf.reduce_sum(x, axis=0), "Sum",
               {"axes": [0], "keep_dims": False}, (n // cols, cols))
    yield ("softmax", tf.nn.softmax, "Softmax", {}, (n // 1024, 1024))


_BINARY = ("Mul",)     # cases() multiplies by a scalar constant


def _graph(op, attrs, shape) -> Graph:
    x = TensorType("float32", tuple(shape))
    axes = attrs.get("axes", ())
    y = TensorType("float32", tuple(d for i, d in enumerate(shape) if i not in axes))
    nodes, ins = [Node("x", "Placeholder", outputs=[x])], [ValueRef("x")]
    if op in _BINARY:
        nodes.append(Node("c", "Const", [], {"value": 1.5, "dtype": "float32", "shape": []},
                          [TensorType("float32", ())]))
        ins.append(ValueRef("c"))
    return Graph(nodes + [Node("y", op, ins, dict(attrs), [y])], [ValueRef("y")])


def modelled(profile, op, attrs, shape) -> tuple:
    """The cost model's times for ``op`` on a float32 input of ``shape``: (left to TF,
    as a generated kernel of its own), both uncalibrated (``profile`` has no factors)."""
    from stitching.plan import search
    from stitching.tf.pipeline import legal
    g = _graph(op, attrs, shape)
    order = g.topo_order()
    t_tf = GraphCosts(g, profile, order).unfused[order.index("y")]
    plan = search.plan(g, legal, min_ops=1, config=search.SearchConfig(profile=profile))
    kernel = [c for c in plan.alternatives if c.deployed]
    assert len(kernel) == 1, (op, shape, plan.unfused)
    return t_tf, kernel[0].launch.time_s


def measured(fn, shape) -> tuple:
    """Median seconds per call of ``tf.function(fn)`` and of ``stitching.function(fn)``
    with its one op as one kernel (min_ops=1) on a float32 input of ``shape``, timed
    interleaved as tools/bench.py times modes (bench_lib.measure)."""
    import tensorflow as tf

    import stitching
    x = tf.constant(np.random.default_rng(0).standard_normal(shape, np.float32))
    st = stitching.function(fn, options=stitching.Options(min_ops=1, background_compile=False))
    st(x)
    if len(st.report.kernels) != 1:
        raise RuntimeError(f"calibrate: {fn} on {shape} became {len(st.report.kernels)} "
                           "kernels, not 1")
    times = time_modes([Runner("tf", tf.function(fn)), Runner("stitched", st)], (x,),
                       repeats=7, warmup=3)
    return times["tf"]["median_s"], times["stitched"]["median_s"]


def _call_overheads() -> tuple:
    """(tf.function, stitching.function) seconds per call of a function that does next to
    nothing (the stitched one with nothing fused: its call path without a kernel)."""
    import tensorflow as tf

    import stitching
    x = tf.constant(np.zeros((1, 1), np.float32))
    st = stitching.function(lambda x: x + 0.0,
                            options=stitching.Options(min_ops=1 << 30, background_compile=False))
    times = time_modes([Runner("tf", tf.function(lambda x: x + 0.0)), Runner("st", st)],
                       (x,), repeats=7, warmup=3)
    return times["tf"]["median_s"], times["st"]["median_s"]


def calibrate(sizes=SIZES_MIB, rounds=3, log=print, base=None) -> tuple:
    """(the CPU profile the model priced with, TF factor tables, kernel factor tables):
    every case timed ``rounds`` times, rounds after one another (a burst of load hits
    one round, not one size); a case's ratio is its median over the rounds.  ``base``:
    the profile the model prices with (default: this machine, measured now)."""
    base = base or profiles.measured_cpu(remeasure=True)
    if base.provisional:
        log(f"warning: this machine's measurement is provisional ({base.why_provisional})")
    calls = [_call_overheads() for _ in range(3)]
    call_tf = statistics.median(c[0] for c in calls)
    call_st = statistics.median(c[1] for c in calls)
    log(f"device: {base.lanes} cores, copy bandwidth {base.bandwidth / 1e9:.1f} GB/s "
        f"({base.source}); call overhead subtracted: tf.function {call_tf * 1e6:.0f} us, "
        f"stitching.function {call_st * 1e6:.0f} us; {rounds} round(s)")
    runs: dict = {}          # (class, MiB, shape) -> [(tf s, kernel s) per round]
    models: dict = {}        # (class, MiB, shape) -> (model tf s, model kernel s)
    for _ in range(rounds):
        for mib in sizes:
            for cls, fn, op, attrs, shape in cases(mib):
                assert tf_class(op, attrs, TensorType("float32", shape),
                                op in ("Exp",)) == cls, (op, cls)
                key = (cls, mib, shape)
                if key not in models:
                    models[key] = modelled(base, op, attrs, shape)
                m_tf, m_k = models[key]
                t_tf, t_st = measured(fn, shape)
                runs.setdefault(key, []).append((max(t_tf - call_tf, m_tf * 0.05),
                                                 max(t_st - call_st, m_k * 0.05)))
    log(f"{'class':18s} {'shape':>16s} {'MiB':>4s} {'TF ms':>8s} {'model':>7s} {'ratio':>6s}"
        f" {'kernel ms':>9s} {'model':>7s} {'ratio':>6s}  TF ratio per round")
    tf_ratios: dict = {c: {} for c in profiles.TF_CLASSES}    # class -> MiB -> [ratio]
    k_ratios: dict = {c: {} for c in profiles.TF_CLASSES}
    fixed = base.launch_s + base.task_s      # not scaled (cost.calibrated_s)
    for key, ts in runs.items():
        cls, mib, shape = key
        m_tf, m_k = models[key]
        r_tf = statistics.median((t - fixed) / (m_tf - fixed) for t, _ in ts)
        r_k = statistics.median((k - fixed) / (m_k - fixed) for _, k in ts)
        tf_ratios[cls].setdefault(mib, []).append(r_tf)
        k_ratios[cls].setdefault(mib, []).append(r_k)
        log(f"{cls:18s} {str(shape):>16s} {mib:4g} "
            f"{statistics.median(t for t, _ in ts) * 1e3:8.3f} {m_tf * 1e3:7.3f} {r_tf:6.2f} "
            f"{statistics.median(k for _, k in ts) * 1e3:9.3f} {m_k * 1e3:7.3f} {r_k:6.2f}  "
            f"{' '.join(f'{(t - fixed) / (m_tf - fixed):.2f}' for t, _ in ts)}")
    return base, factor_tables(tf_ratios), factor_tables(k_ratios)


def factor_tables(ratios: dict) -> dict:
    """class -> [[MiB, factor], ...]: per size, the median ratio over the class's shapes
    (clamped to the profile's sanity range); a class measured at one size gets a flat
    factor."""
    lo, hi = profiles.SCALE_RANGE
    out = {}
    for cls, by_size in ratios.items():
        table = [[mib, round(min(max(statistics.median(r), lo), hi), 3)]
                 for mib, r in sorted(by_size.items()) if r]
        if table:
            out[cls] = table if len(table) > 1 else table[0][1]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write a profile file for this machine")
    ap.add_argument("--ship", action="store_true",
                    help="write the package's factors for this CPU's class "
                         "(stitching/plan/calibration-cpu-<class>.json), priced against "
                         "the class's named machine model (plan/profiles.py: MACHINES)")
    ap.add_argument("--install", action="store_true",
                    help="write this machine's factors into the cache directory "
                         f"({profiles.local_calibration_path()}), which every process "
                         "on this CPU then plans with (before the shipped default)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES_MIB)),
                    help="input sizes in MiB (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="times each case is measured; its median counts (default 3)")
    args = ap.parse_args(argv)
    cls = profiles.cpu_facts()["cpu_class"]
    if args.ship and cls not in profiles.CALIBRATION_FILES:
        ap.error(f"--ship: this CPU's class {cls!r} has no named machine model; "
                 f"known: {', '.join(profiles.CALIBRATION_FILES)}")
    # Shipped factors scale the class model's estimates, so they are measured against them.
    model = profiles.MACHINES[cls] if args.ship else None
    base, scale, kscale = calibrate(tuple(float(s) for s in args.sizes.split(",")),
                                    args.rounds, base=model)
    print("tf_time_scale:", scale)
    print("kernel_time_scale:", kscale)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    prof = profiles.with_overrides(base, tf_time_scale=scale, kernel_time_scale=kscale,
                                   name="cpu-calibrated",
                                   source=f"tools/calibrate.py, {when}")
    note = (f"tools/calibrate.py at {when} on {os.cpu_count()} cores, "
            f"sizes {args.sizes} MiB, {args.rounds} round(s)")
    for path in filter(None, (args.out, args.ship and profiles.CALIBRATION_FILES[cls])):
        profiles.save_file(prof, path, note)
        print("wrote", path)
    if args.install:
        path = profiles.local_calibration_path()
        profiles.save_file(prof, path, note, this_machine=True)
        print("wrote", path, "(this machine's calibration)")


if __name__ == "__main__":
    main()
