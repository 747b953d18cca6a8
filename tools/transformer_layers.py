#!/usr/bin/env python
"""The issue's Transformer setting: a Keras encoder (seq 128, d_model 256, 4 heads, FFN 1024)
at several depths, stock TF vs XLA vs stitching, timed interleaved as tools/bench.py times
modes (bench_lib.measure: shuffled order every repeat, medians).

    python tools/transformer_layers.py                     # 2, 8, 24 layers at batch 8
    python tools/transformer_layers.py --layers 4 --batch 1

Outputs are checked against stock TF before timing (allclose 1e-3, as the models suite).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tools")]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def run(layers: int, batch: int, repeats: int, whole: bool = False) -> dict:
    import keras
    import numpy as np
    import tensorflow as tf

    import stitching
    from bench_lib.measure import time_modes
    from bench_lib.modes import Runner
    from stitching.testing.models import transformer_encoder
    keras.utils.set_random_seed(layers)
    model = transformer_encoder(num_layers=layers, d_model=256, heads=4, ff=1024, seq_len=128)

    def fn(x):
        return model(x, training=False)
    sig = [tf.TensorSpec((None, 128, 256), tf.float32)]
    x = tf.constant(np.random.default_rng(0).standard_normal((batch, 128, 256), np.float32))
    sync = stitching.Options(background_compile=False)   # timed: kernels from call 1
    modes = {"tf": tf.function(fn, input_signature=sig),
             "xla": tf.function(fn, input_signature=sig, jit_compile=True),
             "stitched": stitching.function(fn, input_signature=sig, options=sync)}
    if whole:       # the A/B of tf/passes/seqsplit.py: token-wise blocks kept whole
        modes["whole"] = stitching.function(
            fn, input_signature=sig, options=dataclasses.replace(sync, seq_split=False))
    ref = modes["tf"](x).numpy()
    for name in [m for m in modes if m != "tf"]:
        np.testing.assert_allclose(modes[name](x).numpy(), ref, rtol=1e-3, atol=1e-3,
                                   err_msg=name)
    t = time_modes([Runner(k, f) for k, f in modes.items()], (x,), repeats=repeats, warmup=1)
    out = {k: v["median_s"] * 1e3 for k, v in t.items()}
    out["kernels"] = len(modes["stitched"].report.kernels)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="2,8,24", help="comma-separated depths")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--whole", action="store_true",
                    help="also time stitching with Options(seq_split=False)")
    args = ap.parse_args(argv)
    for layers in (int(n) for n in args.layers.split(",")):
        m = run(layers, args.batch, args.repeats, args.whole)
        extra = (f"; whole blocks {m['whole']:.1f} ms (split vs whole "
                 f"{m['whole'] / m['stitched']:.3f}x)" if args.whole else "")
        print(f"layers {layers} batch {args.batch}: TF {m['tf']:.1f} ms, XLA {m['xla']:.1f} ms, "
              f"stitched {m['stitched']:.1f} ms; stitched vs XLA {m['xla'] / m['stitched']:.3f}x, "
              f"vs TF {m['tf'] / m['stitched']:.3f}x; {m['kernels']} kernels{extra}", flush=True)


if __name__ == "__main__":
    main()
