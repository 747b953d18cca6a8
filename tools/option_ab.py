#!/usr/bin/env python
"""One stitching option on and off, side by side with stock TF, in one process.

    python tools/option_ab.py --model mobilenet_v2 --batches 1,8 --off depthwise
    python tools/option_ab.py --model efficientnet_b0 --off pad_fold --rounds 21

A models-suite case (the batch unknown, as the suite traces it) as ``tf.function``,
``stitching.function`` with default Options (``on``) and with ``Options(<off>=False)``
(``off``), both compiled before the first call (``background_compile=False``); the
calls interleaved (each round in the other order than the last), so a busy machine
slows all three alike.  Prints medians and minimums in ms, the ratios, and
the largest difference of each stitched output from stock TF's.  For a change behind
an option this is a fairer A/B than two whole benchmark runs minutes apart.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a models-suite case")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--off", required=True, help="a boolean stitching.Options field")
    ap.add_argument("--rounds", type=int, default=15, help="timed calls per mode")
    args = ap.parse_args(argv)

    import numpy as np
    import tensorflow as tf

    import stitching
    from stitching.testing import models
    flags = {f.name for f in dataclasses.fields(stitching.Options) if f.type == "bool"}
    if args.off not in flags:
        ap.error(f"--off must be one of {', '.join(sorted(flags))}")
    case = models.get(args.model)
    fn = case.make_fn()
    sig = list(case.input_signature())
    # synchronous: tiered (the default), the first calls and the timed ones until the
    # switch would be stock TF's, and the stitched outputs compared would be TF's own
    modes = {"tf": tf.function(fn, input_signature=sig),
             "on": stitching.function(fn, input_signature=sig, options=stitching.Options(
                 background_compile=False)),
             "off": stitching.function(fn, input_signature=sig, options=stitching.Options(
                 background_compile=False, **{args.off: False}))}
    for b in (int(v) for v in args.batches.split(",")):
        x = tf.constant(case.inputs(b)[0])
        ref = modes["tf"](x).numpy()
        diffs = {m: float(np.max(np.abs(modes[m](x).numpy() - ref))) for m in ("on", "off")}
        for f in modes.values():
            f(x)
        times = {m: [] for m in modes}
        order = list(modes.items())
        for r in range(args.rounds):
            for m, f in (order if r % 2 == 0 else order[::-1]):
                t0 = time.perf_counter()
                f(x)
                times[m].append(1e3 * (time.perf_counter() - t0))
        med = {m: float(np.median(v)) for m, v in times.items()}
        low = {m: float(np.min(v)) for m, v in times.items()}
        print(f"{args.model} b{b}, load {os.getloadavg()[0]:.1f}, {args.off} off/on: "
              f"median {med['off'] / med['on']:.3f}, min {low['off'] / low['on']:.3f}")
        for m in modes:
            extra = f", max |diff| vs tf {diffs[m]:.3g}" if m in diffs else ""
            print(f"  {m:>3}: median {med[m]:.2f} ms, min {low[m]:.2f} ms, "
                  f"tf/{m} {med['tf'] / med[m]:.2f}x{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
