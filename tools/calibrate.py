#!/usr/bin/env python
"""Calibrate the cost model's price of ops left to TF, on this machine.

    python tools/calibrate.py                         # print the table, write nothing
    python tools/calibrate.py --out my-profile.json   # a profile file for this machine:
        STITCHING_DEVICE_PROFILE=my-profile.json python ...   plans with it
    python tools/calibrate.py --install               # this machine's factors, used by
        every process here ($STITCHING_CACHE_DIR/calibration-cpu.json, bound to the CPU)
    python tools/calibrate.py --ship                  # the package's default factors
                                                      # (stitching/plan/calibration-cpu.json)

For each op class the cost model tells apart (``plan.cost.tf_class``: element-wise,
transcendental, row reduction, column reduction, softmax) and each size (1, 4, 16, 64 MiB
of float32 input), one TF op runs alone in a ``tf.function``, timed as tools/bench.py
times a mode (median per call, less the same function's call overhead measured on an
identity);
the cost model prices the same op from the measured device profile
(``GraphCosts.unfused`` with no calibration).  A class's factors are, per size, the median
of measured over modelled across its shapes: a table the cost model interpolates in
log(size) and holds flat beyond 1 and 64 MiB (``profiles.tf_factor``); the profile file
holds the measured device profile with those tables (``DeviceProfile.tf_time_scale``).  Recalibrate after a
change of machine, TF version or cost model; on a shared machine run it when idle (it
prints the copy bandwidth it saw, to judge).
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


def modelled(profile, op, attrs, shape) -> float:
    """The cost model's time for ``op`` on a float32 input of ``shape`` left to TF."""
    x = TensorType("float32", tuple(shape))
    axes = attrs.get("axes", ())
    y = TensorType("float32", tuple(d for i, d in enumerate(shape) if i not in axes))
    g = Graph([Node("x", "Placeholder", outputs=[x]),
               Node("y", op, [ValueRef("x")], dict(attrs), [y])], [ValueRef("y")])
    order = g.topo_order()
    return GraphCosts(g, profile, order).unfused[order.index("y")]


def measured(fn, shape) -> float:
    """Median seconds per call of ``tf.function(fn)`` on a float32 input of ``shape``,
    timed as tools/bench.py times a mode (bench_lib.measure)."""
    import tensorflow as tf
    x = tf.constant(np.random.default_rng(0).standard_normal(shape, np.float32))
    times = time_modes([Runner("tf", tf.function(fn))], (x,), repeats=7, warmup=3)
    return times["tf"]["median_s"]


def calibrate(sizes=SIZES_MIB, rounds=3, log=print) -> tuple:
    """(the measured CPU profile, class -> factor table): every case timed ``rounds``
    times, rounds after one another (a burst of load hits one round, not one size); a
    case's ratio is its median over the rounds."""
    base = profiles.measured_cpu(remeasure=True)
    call = statistics.median(measured(lambda x: x + 0.0, (1, 1)) for _ in range(3))
    log(f"device: {base.lanes} cores, copy bandwidth {base.bandwidth / 1e9:.1f} GB/s "
        f"(measured now); tf.function call overhead {call * 1e6:.0f} us (subtracted); "
        f"{rounds} round(s)")
    runs: dict = {}          # (class, MiB, shape) -> [ratio per round]
    for _ in range(rounds):
        for mib in sizes:
            for cls, fn, op, attrs, shape in cases(mib):
                assert tf_class(op, attrs, TensorType("float32", shape),
                                op in ("Exp",)) == cls, (op, cls)
                t_model = modelled(base, op, attrs, shape)
                t_tf = max(measured(fn, shape) - call, t_model * 0.05)
                runs.setdefault((cls, mib, shape), []).append((t_tf, t_model))
    log(f"{'class':18s} {'shape':>16s} {'MiB':>4s} {'TF ms':>8s} {'model ms':>9s} {'ratio':>6s}"
        f"  {'rounds':s}")
    ratios: dict = {c: {} for c in profiles.TF_CLASSES}     # class -> MiB -> [ratio]
    for (cls, mib, shape), ts in runs.items():
        each = [t / m for t, m in ts]
        r = statistics.median(each)
        t_tf = statistics.median(t for t, _ in ts)
        ratios[cls].setdefault(mib, []).append(r)
        log(f"{cls:18s} {str(shape):>16s} {mib:4g} {t_tf * 1e3:8.3f} {ts[0][1] * 1e3:9.3f} "
            f"{r:6.2f}  {' '.join(f'{x:.2f}' for x in each)}")
    return base, factor_tables(ratios)


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
                    help=f"write the package's default factors ({profiles.CALIBRATION_FILE})")
    ap.add_argument("--install", action="store_true",
                    help="write this machine's factors into the cache directory "
                         f"({profiles.local_calibration_path()}), which every process "
                         "on this CPU then plans with (before the shipped default)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES_MIB)),
                    help="input sizes in MiB (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="times each case is measured; its median counts (default 3)")
    args = ap.parse_args(argv)
    base, scale = calibrate(tuple(float(s) for s in args.sizes.split(",")), args.rounds)
    print("tf_time_scale:", scale)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    prof = profiles.with_overrides(base, tf_time_scale=scale, name="cpu-calibrated",
                                   source=f"tools/calibrate.py, {when}")
    note = (f"tools/calibrate.py at {when} on {os.cpu_count()} cores, "
            f"sizes {args.sizes} MiB, {args.rounds} round(s)")
    for path in filter(None, (args.out, args.ship and profiles.CALIBRATION_FILE)):
        profiles.save_file(prof, path, note)
        print("wrote", path)
    if args.install:
        path = profiles.local_calibration_path()
        profiles.save_file(prof, path, note, this_machine=True)
        print("wrote", path, "(this machine's calibration)")


if __name__ == "__main__":
    main()
