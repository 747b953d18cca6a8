#!/usr/bin/env python
"""Plan audit: did the cost model decide right?  Predicted against measured, per pattern.

    python tools/plan_audit.py                         # every pattern, both sizes
    python tools/plan_audit.py --only softmax_tf center_axis0 --sizes large --repeats 20
    python tools/plan_audit.py --fuzz 20 --seed 0 --fuzz-mib 4    # random fuzzer graphs
    python tools/plan_audit.py --seed 1 --fuzz-index 12 28 --fuzz-mib 16 --repeats 20

For each pattern of the suite (stitching/testing/patterns.py) three runs of the same
function in one process, timed as tools/bench.py times modes (bench_lib.measure:
interleaved in shuffled order, so drift hits them alike):

    tf       stock tf.function
    unfused  stitching.function planning no kernel (min_ops too large): the same
             Grappler rewrites and call path as the next two, every op left to TF --
             the "unfused" side of the model's comparison (stock tf.function's own
             call costs ~0.15 ms more per call here, which would otherwise count as
             a gain of fusing on small graphs)
    search   stitching.function as shipped: the cost model decides what to fuse
    greedy   stitching with the legality-only planner: everything legal fused

The search plan's dump (stitching.inspect) gives the model's view of each kernel: its
fused time and the time of its ops left to TF (``estimate.fused_us`` / ``unfused_us``).
A decision is *wrong* when the choice the model did not make measures faster by more
than ``--margin`` (10%): the model fused and its ops left to TF (unfused) are faster, or the model left ops
to TF (search has fewer kernels than greedy) and greedy is faster.  The table also shows
the model's predicted speed-up next to the measured one, which is what calibration
(tools/calibrate.py) adjusts.  Exit status 1 when a decision is wrong.

``--fuzz N`` audits N random programs of the project's fuzzer instead
(stitching/testing/fuzz.py: chains of unary, broadcasting binary, row and column
reductions, selects and casts over x:[8, R, C], w:[C], s:[8, R, 1]), x of
``--fuzz-mib`` MiB with C drawn from 64..4096: graphs nobody wrote for the model.  Graph
i of seed S is drawn from ``numpy.random.default_rng([S, i])``, so a row is reproduced
alone with its seed and index (the table prints the program too).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tools")]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("STITCHING_NO_HINTS", "1")

import tensorflow as tf  # noqa: E402

import stitching  # noqa: E402
from bench_lib.measure import time_modes  # noqa: E402
from bench_lib.modes import Runner  # noqa: E402
from stitching.testing import fuzz  # noqa: E402
from stitching.testing import patterns as P  # noqa: E402

_NOTHING = 1 << 30                    # min_ops no region reaches: nothing is fused
FUZZ_BATCH = 8
FUZZ_COLS = (64, 256, 1024, 4096)     # arbitrary: short rows to long ones


def judge(n_search, n_greedy, t_unfused, t_search, t_greedy, margin,
          differ=False) -> list:
    """The model's wrong decisions for one function (empty: none), from the kernel
    counts of the search and greedy plans and the measured times with nothing fused,
    the model's plan and everything fused.  ``differ``: the two plans group the ops
    differently (other kernels, or the same ops split otherwise)."""
    wrong = []
    if n_search and t_unfused < t_search / (1 + margin):
        wrong.append("fused, but stock TF is faster")
    if n_search < n_greedy and t_greedy < t_search / (1 + margin):
        wrong.append("left ops to TF that fused (greedy) run faster")
    elif differ and t_greedy < t_search / (1 + margin):
        wrong.append("greedy's other grouping of the same ops runs faster")
    return wrong


def audit_one(pattern, size, repeats, margin, dump_root) -> dict:
    args = [tf.constant(a) for a in pattern.inputs(size)]
    return audit_fn(pattern.name, size, pattern.fn, args, repeats, margin, dump_root)


def audit_fn(name, size, fn, args, repeats, margin, dump_root) -> dict:
    """One function timed three ways (stock TF, the cost model's plan, greedy) beside
    the model's prediction for its kernels."""
    stock = tf.function(fn)
    sync = functools.partial(stitching.Options, background_compile=False)   # timed
    search = stitching.function(fn, options=sync(dump_dir=dump_root))
    greedy = stitching.function(fn, options=sync(planner="greedy"))
    unfused = stitching.function(fn, options=sync(min_ops=_NOTHING))
    # bench.py's timing: modes interleaved in shuffled order, loops of calls, lead-ins
    times = time_modes([Runner("tf", stock), Runner("unfused", unfused),
                        Runner("search", search), Runner("greedy", greedy)], args,
                       repeats=repeats, warmup=2)
    t_tf, t_unf, t_search, t_greedy = (times[m]["median_s"]
                                       for m in ("tf", "unfused", "search", "greedy"))
    dump = stitching.load_dump(search.report.dump_path)
    fused = sum(k.estimate.get("fused_us") or 0 for k in dump.kernels)
    est_unfused = sum(k.estimate.get("unfused_us") or 0 for k in dump.kernels)
    n_search, n_greedy = len(search.report.kernels), len(greedy.report.kernels)
    differ = _groups(search.report) != _groups(greedy.report)
    wrong = judge(n_search, n_greedy, t_unf, t_search, t_greedy, margin, differ)
    return {"pattern": name, "size": size, "kernels": n_search,
            "greedy_kernels": n_greedy, "tf_ms": t_tf * 1e3, "unfused_ms": t_unf * 1e3,
            "search_ms": t_search * 1e3, "greedy_ms": t_greedy * 1e3,
            "predicted": est_unfused / fused if fused and est_unfused else None,
            "measured": t_unf / t_search, "wrong": wrong,
            # what fusing saves, in µs per call: the model's (its kernels only) and
            # measured (the whole function: fixed call costs cancel out)
            "predicted_saving_us": est_unfused - fused, "measured_saving_us":
                (t_unf - t_search) * 1e6,
            "unfused": [f"{op}: {why}" for _, op, why in search.report.unfused]}


def _groups(report) -> set:
    return {frozenset(n for n, _ in k.ops) for k in report.kernels}


def fuzz_case(seed: int, i: int, mib: float):
    """(name, program, args) of fuzz graph i of ``seed``: a random program and inputs
    with x about ``mib`` MiB."""
    import numpy as np
    rng = np.random.default_rng([seed, i])
    program = fuzz.random_program(rng)
    cols = FUZZ_COLS[int(rng.integers(len(FUZZ_COLS)))]
    rows = max(1, int(mib * (1 << 20)) // (4 * FUZZ_BATCH * cols))
    shapes = ((FUZZ_BATCH, rows, cols), (cols,), (FUZZ_BATCH, rows, 1))
    args = [tf.constant(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    return f"fuzz {seed}/{i} [{FUZZ_BATCH},{rows},{cols}]", program, args


def _cases(args):
    """(name, size label, fn, tf args) to audit."""
    if args.fuzz or args.fuzz_index:
        for i in args.fuzz_index or range(args.fuzz):
            name, program, tf_args = fuzz_case(args.seed, i, args.fuzz_mib)
            yield name, fuzz.describe(program), fuzz.build(program), tf_args
        return
    pats = [P.get(n) for n in args.only] if args.only else P.all_patterns()
    for p in pats:
        for size in args.sizes.split(","):
            yield p.name, size, p.fn, [tf.constant(a) for a in p.inputs(size)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="pattern names (default: all)")
    ap.add_argument("--sizes", default="large,small")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--margin", type=float, default=0.10)
    ap.add_argument("--fuzz", type=int, default=0, metavar="N",
                    help="audit N random fuzzer graphs instead of the pattern suite")
    ap.add_argument("--seed", type=int, default=0, help="the fuzzer's seed")
    ap.add_argument("--fuzz-index", type=int, nargs="*",
                    help="audit only these fuzz graphs of the seed (a row again)")
    ap.add_argument("--fuzz-mib", type=float, default=4.0,
                    help="size of each fuzz graph's x input, MiB")
    args = ap.parse_args(argv)
    rows = []
    print("| case | size / program | kernels (greedy) | TF ms | unfused ms | stitched ms | "
          "greedy ms | model speed-up | measured | model saves µs | measured µs | "
          "wrong decision |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory(prefix="plan-audit-") as root:
        for name, size, fn, tf_args in _cases(args):
            try:
                r = audit_fn(name, size, fn, tf_args, args.repeats, args.margin, root)
            except Exception as e:  # noqa: BLE001 - a graph that fails is a finding too
                print(f"| {name} | {size} | error: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:160]} |", flush=True)
                continue
            rows.append(r)
            pred = "-" if r["predicted"] is None else f"{r['predicted']:.2f}x"
            print(f"| {r['pattern']} | {size} | {r['kernels']} ({r['greedy_kernels']}) | "
                  f"{r['tf_ms']:.3f} | {r['unfused_ms']:.3f} | {r['search_ms']:.3f} | "
                  f"{r['greedy_ms']:.3f} | "
                  f"{pred} | {r['measured']:.2f}x | {r['predicted_saving_us']:.0f} | "
                  f"{r['measured_saving_us']:.0f} | {'; '.join(r['wrong'])} |",
                  flush=True)
    bad = [r for r in rows if r["wrong"]]
    print(f"\n{len(bad)} wrong decision(s) of {len(rows)} (margin {args.margin:.0%})")
    for r in bad:           # what the model did, for the ones it got wrong
        print(f"- {r['pattern']} ({r['size']}): {'; '.join(r['wrong'])}; unfused "
              f"{r['unfused_ms']:.3f} ms, stitched {r['search_ms']:.3f}, greedy "
              f"{r['greedy_ms']:.3f}; left to TF: {'; '.join(r['unfused']) or 'nothing'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
