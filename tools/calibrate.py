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
    python tools/calibrate.py --ops --ship            # only the per-op compute costs
        (op_costs), written into that file beside the factors already there

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

Those factors are fitted on one op per kernel, where memory dominates; they scale only
a kernel's memory-bound part.  Compute is calibrated apart (``--ops``, ``op_costs``):
each transcendental op's cost per element relative to Exp in a generated kernel
(``kernel_op_cost``) and in TF (``tf_op_cost``), and the factor that takes the model's
price of a compute-bound kernel of Exps to its measured time (``kernel_compute_scale``).
"""
from __future__ import annotations

import argparse
import json
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
OP_COST_MIB = 4              # the per-op compute costs' input size (op_costs)
OP_COST_COPIES = 6           # evaluations of the op per element in the fused kernel


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


def _tf_unary(op: str):
    """TF's function for a transcendental IR op (``profiles.OP_COST_OPS``), and the
    input range it is timed on (inside its domain)."""
    import tensorflow as tf
    fns = {"Exp": tf.exp, "Expm1": tf.math.expm1, "Log": tf.math.log,
           "Log1p": tf.math.log1p, "Tanh": tf.tanh, "Sigmoid": tf.sigmoid, "Elu": tf.nn.elu,
           "Selu": tf.nn.selu, "Softplus": tf.nn.softplus, "Erf": tf.math.erf,
           "Erfc": tf.math.erfc, "Sin": tf.sin, "Cos": tf.cos, "Neg": tf.negative}
    return fns[op], ((0.5, 1.5) if op in ("Log", "Log1p") else (-2.0, 2.0))


def op_costs(base, mib=OP_COST_MIB, rounds=3, log=print) -> tuple:
    """(our kernels' per-element cost of each transcendental op relative to Exp, TF's,
    the kernel compute factor): ``profiles.OP_COST_OPS`` on ``mib`` MiB of float32.

    Ours: one kernel evaluating the op ``OP_COST_COPIES`` times per element on shifted
    inputs (sum of op(x + k/8): compute-bound, read once, written once), less the same
    kernel of Neg (the adds, the traffic and the call); over Exp's.  TF's: the op alone
    in a ``tf.function``, less Neg alone (its traffic and call), over Exp's.  The
    compute factor (``DeviceProfile.kernel_compute_scale``): our Exp's time per element
    over TF's Exp's, both measured here, times the profile's price of TF's Exp per
    element (calibrated: its tf_time_scale) in units of ``base.transcendental_per_s``:
    the kernel's compute is priced against the TF side's calibration, so the ratio of our
    code to TF's (measured in one process, robust under load, and about the same on
    machines of one ISA) carries over where NumPy's exp speed (the profile's rate) does
    not (2.1 G/s on an AVX-512 EPYC, 0.87 on the AVX2 one)."""
    import tensorflow as tf

    import stitching
    n = int(mib * (1 << 20)) // 4
    ops = ("Neg",) + profiles.OP_COST_OPS
    # planned with a profile without factors, where fusing the copies always pays
    saved = os.environ.get("STITCHING_DEVICE_PROFILE")
    os.environ["STITCHING_DEVICE_PROFILE"] = "cpu-reference"
    times: dict = {op: [] for op in ops}
    for _ in range(rounds):
        for op in ops:
            fn, (lo, hi) = _tf_unary(op)
            x = tf.constant(np.random.default_rng(0).uniform(lo, hi, (n // 1024, 1024))
                            .astype(np.float32))

            def many(v, fn=fn):
                return tf.add_n([fn(v + k / 8) for k in range(OP_COST_COPIES)])
            st = stitching.function(many, options=stitching.Options(
                background_compile=False, progress=False))
            st(x)
            if len(st.report.kernels) != 1:
                raise RuntimeError(f"op_costs: {OP_COST_COPIES} {op}s became "
                                   f"{len(st.report.kernels)} kernels, not 1 (plan with a "
                                   "profile that fuses them: STITCHING_DEVICE_PROFILE)")
            t = time_modes([Runner("tf", tf.function(fn)), Runner("stitched", st)], (x,),
                           repeats=7, warmup=3)
            times[op].append((t["tf"]["median_s"], t["stitched"]["median_s"]))
    if saved is None:
        os.environ.pop("STITCHING_DEVICE_PROFILE")
    else:
        os.environ["STITCHING_DEVICE_PROFILE"] = saved
    med = {op: (statistics.median(a for a, _ in ts), statistics.median(b for _, b in ts))
           for op, ts in times.items()}
    tf0, k0 = med["Neg"]
    tf_exp, k_exp = med["Exp"][0] - tf0, med["Exp"][1] - k0
    lo, hi = profiles.OP_COST_RANGE
    ours = {op: round(min(max(lo, (k - k0) / k_exp), hi), 2) for op, (_, k) in med.items()
            if op != "Neg"}
    theirs = {op: round(min(max(lo, (t - tf0) / tf_exp), hi), 2)
              for op, (t, _) in med.items() if op != "Neg"}
    g = _graph("Exp", {}, (n // 1024, 1024))
    order = g.topo_order()
    priced = profiles.calibrated(base)
    tf_model = GraphCosts(g, priced, order).unfused[order.index("y")] - \
        (priced.launch_s + priced.task_s)
    ratio = (k_exp / OP_COST_COPIES) / tf_exp
    compute = round(ratio * tf_model * base.transcendental_per_s / n, 3)
    log(f"{'op':10s} {'kernel ms':>9s} {'ours':>6s} {'TF ms':>8s} {'TF':>6s}   "
        f"({OP_COST_COPIES} per element in a kernel, one in TF; Neg's time subtracted: "
        f"{k0 * 1e3:.3f} / {tf0 * 1e3:.3f} ms)")
    for op in profiles.OP_COST_OPS:
        log(f"{op:10s} {med[op][1] * 1e3:9.3f} {ours[op]:6.2f} {med[op][0] * 1e3:8.3f} "
            f"{theirs[op]:6.2f}")
    log(f"kernel compute factor {compute}: our Exp {ratio:.3f}x TF's per element, TF's "
        f"priced at {tf_model / n * 1e9:.3f} ns ({priced.source}), Exps at "
        f"{base.transcendental_per_s / 1e9:.2f} G/s")
    return ours, theirs, compute


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
    ap.add_argument("--ops", action="store_true",
                    help="measure the per-op compute costs (op_costs: kernel_op_cost, "
                         "tf_op_cost, kernel_compute_scale) only, and write them into the "
                         "file --out / --ship / --install names, keeping its other numbers")
    args = ap.parse_args(argv)
    cls = profiles.cpu_facts()["cpu_class"]
    if args.ship and cls not in profiles.CALIBRATION_FILES:
        ap.error(f"--ship: this CPU's class {cls!r} has no named machine model; "
                 f"known: {', '.join(profiles.CALIBRATION_FILES)}")
    # Shipped factors scale the class model's estimates, so they are measured against them.
    model = profiles.MACHINES[cls] if args.ship else None
    if args.ops:
        return _ops_main(args, cls, model)
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


def _ops_main(args, cls, model):
    """--ops: the per-op compute costs measured and written into the named files."""
    base = model or profiles.measured_cpu(remeasure=True)
    ours, theirs, compute = op_costs(base, rounds=args.rounds)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    note = (f"per-op compute costs: tools/calibrate.py --ops at {when}, "
            f"{OP_COST_MIB} MiB, {args.rounds} round(s), load average "
            f"{os.getloadavg()[0]:.1f}")
    targets = [(args.out, False), (args.ship and profiles.CALIBRATION_FILES[cls], False),
               (args.install and profiles.local_calibration_path(), True)]
    for path, mine in filter(lambda t: t[0], targets):
        try:
            doc = json.loads(open(path).read())
            prof = profiles.with_overrides(profiles.load_file(path),
                                           source=doc["profile"].get("source", ""))
            old = doc.get("note", "")
        except (OSError, ValueError):
            prof, old = base, ""
        prof = profiles.with_overrides(prof, kernel_op_cost=ours, tf_op_cost=theirs,
                                       kernel_compute_scale=compute)
        profiles.save_file(prof, path, f"{old}; {note}" if old else note, this_machine=mine)
        print("wrote", path)


if __name__ == "__main__":
    main()
