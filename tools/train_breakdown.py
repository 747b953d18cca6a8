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


def prepare(case: str, wanted) -> dict:
    """{mode: step}: each mode's step (a function of one ignored argument, as
    op_breakdown's modes take their input) on its own copy of the model, traced and
    warm; a stitched step's ``traced`` is its stitching function (the report)."""
    import tensorflow as tf

    import stitching
    from stitching.testing import train as T
    opts = stitching.Options(background_compile=False)
    make = {"tf": tf.function,
            "xla": lambda f: tf.function(f, jit_compile=True),
            "stitched": lambda f: stitching.function(f, options=opts),
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
        modes[m].traced = fn
        for _ in range(3):
            float(modes[m](None))
    return modes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="transformer", help="train-suite case")
    ap.add_argument("--modes", default="tf,xla,stitched",
                    help="any of tf,xla,stitched,tf_gemm (stitched with the matrix "
                         "products left to TF)")
    ap.add_argument("--calls", type=int, default=20, help="traced calls per mode")
    ap.add_argument("--top", type=int, default=24, help="rows per mode")
    ap.add_argument("--stat", choices=("mean", "min"), default="min")
    ap.add_argument("--nodes", metavar="REGEX", help="also list these op classes' nodes")
    args = ap.parse_args(argv)
    modes = prepare(args.case, args.modes.split(","))
    wall = ob.wall_ms(modes, None, max(args.calls, 10))
    stitched = modes["stitched"].traced if "stitched" in modes else None
    per_mode = ob.interleaved_rows(modes, None, args.calls, args.stat, args.nodes, stitched)
    print(f"train step {args.case}; load average {os.getloadavg()[0]:.2f}; wall ms per "
          "step (median, interleaved): " + ", ".join(f"{m} {t:.2f}" for m, t in wall.items()))
    ob.print_rows(per_mode, args.stat, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
