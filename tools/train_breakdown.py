"""Per-op time of one train-suite step under stock TF, XLA and stitching, side by side.

    python tools/train_breakdown.py                        # the Transformer classifier's step
    python tools/train_breakdown.py --case mlp --stat min --nodes 'MatMul|dot'

The train suite's step (stitching.testing.train: forward, loss, gradients, optimizer
update) of ``--case``, each mode training its own copy of the model on the same batch,
traced call by call in one profiler session (tools/op_breakdown.py's interleaved
measurement and rows: TF ops by type, XLA thunks by name, stitched kernels from the
op's counters, each mode split into contractions, memory-intensive ops, kernels and
the rest).  Which ops of the step are the gap between two modes is what this shows;
the wall-clock line (untraced, interleaved medians) is the number to compare.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import op_breakdown as ob  # noqa: E402  (tools/ is not a package)


def prepare(case: str, wanted):
    """({mode: zero-argument step}, None): each mode's step on its own model copy,
    traced and warm."""
    import tensorflow as tf

    import stitching
    from stitching.testing import train as T
    make = {"tf": lambda f: tf.function(f),
            "xla": lambda f: tf.function(f, jit_compile=True),
            "stitched": lambda f: stitching.function(
                f, options=stitching.Options(background_compile=False)),
            "tf_gemm": lambda f: stitching.function(
                f, options=stitching.Options(background_compile=False, blas_gemm=False))}
    unknown = set(wanted) - set(make)
    if unknown:
        raise SystemExit(f"unknown mode(s) {sorted(unknown)}; choose from {sorted(make)}")
    modes = {}
    for m in wanted:
        step = T.make_step(case)
        fn = make[m](step.fn)
        modes[m] = (lambda f, x, y: lambda _: f(x, y))(fn, step.x, step.y)
        modes[m].traced = fn     # the stitched function's report (kernel names)
        for _ in range(3):
            float(modes[m](None))
    return modes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="transformer", help="train-suite case")
    ap.add_argument("--modes", default="tf,xla,stitched")
    ap.add_argument("--calls", type=int, default=20, help="traced calls per mode")
    ap.add_argument("--top", type=int, default=24, help="rows per mode")
    ap.add_argument("--stat", choices=("mean", "min"), default="min")
    ap.add_argument("--nodes", metavar="REGEX", help="also list these op classes' nodes")
    args = ap.parse_args(argv)
    wanted = args.modes.split(",")
    modes = prepare(args.case, wanted)
    wall = ob.wall_ms(modes, None, max(args.calls, 10))
    run, marks = ob._interleaved(modes, None, args.calls)
    traced = []

    def trace():
        traced.append(ob._profile(run))
    if "stitched" in modes:
        kernels = ob._kernel_rows(modes["stitched"].traced, trace, args.calls, args.stat)
    else:
        trace()
        kernels = {}
    per_mode = ob.node_events(traced[0], marks)
    rows = {m: ob.rows_of(per_mode[m], args.calls, args.stat, args.nodes) for m in modes}
    rows.get("stitched", {}).update(kernels)
    print(f"load average {os.getloadavg()[0]:.2f}; wall ms (median, untraced): " +
          ", ".join(f"{m} {t:.2f}" for m, t in wall.items()))
    for m, r in rows.items():
        parts = ob.split({k: v for k, v in r.items() if not k.startswith("  ")})
        print(f"\n== {m}: op time {sum(parts.values()):.0f} us per step; " +
              ", ".join(f"{k} {v:.0f}" for k, v in parts.items()))
        for name, us in sorted(r.items(), key=lambda kv: -(kv[1] if isinstance(kv[1], float)
                                                           else kv[1][0]))[:args.top]:
            cell = f"{us:9.1f}" if isinstance(us, float) else f"{us[0]:9.1f} (median {us[1]:.1f})"
            print(f"  {cell}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
