"""Train-step benchmark: now ``tools/bench.py --suite train`` (bench_lib/train.py).

    python tools/train_bench.py --models mlp,cnn,transformer --repeats 5 [--memory]

is kept as an alias: it runs that suite with these arguments translated
(``--models`` -> ``--only``, ``--memory`` -> ``--memory-runs 5``, else 0; mode
``stitched`` -> ``stitching``).
"""
from __future__ import annotations

import argparse
import os
import sys


def translate(argv=None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mlp,cnn,transformer")
    ap.add_argument("--modes", default="tf,xla,stitching")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--memory-runs", type=int, default=5)
    args, rest = ap.parse_known_args(argv)
    modes = ",".join("stitching" if m == "stitched" else m for m in args.modes.split(","))
    return (["--suite", "train", "--only", *args.models.split(","), "--modes", modes,
             "--steps", str(args.steps), "--repeats", str(args.repeats),
             "--memory-runs", str(args.memory_runs if args.memory else 0)] + rest)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench
    sys.exit(bench.main(translate()))
