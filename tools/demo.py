"""Demo: stitch a Keras Transformer encoder block, show the report, time it vs tf.function.

    python tools/demo.py [--batch 8] [--seq 128] [--d-model 256]
"""
import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import stitching  # noqa: E402
from stitching.testing.models import transformer_encoder  # noqa: E402


def median_ms(fn, x, repeats=20):
    fn(x)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args()
    model = transformer_encoder(num_layers=a.layers, d_model=a.d_model, heads=4,
                                ff=4 * a.d_model, seq_len=a.seq)
    sig = [tf.TensorSpec([None, a.seq, a.d_model], tf.float32)]
    x = np.random.default_rng(0).standard_normal((a.batch, a.seq, a.d_model)).astype(np.float32)
    stock = tf.function(lambda t: model(t, training=False), input_signature=sig)
    stitched = stitching.function(lambda t: model(t, training=False), input_signature=sig)
    t0 = time.perf_counter()
    stitched(x)       # tiered (the default): stock TF answers while the kernels compile
    first = time.perf_counter() - t0
    stitched.wait()
    print(f"first call: {first:.2f} s (stock TF answered it); stitched kernels ready "
          f"{time.perf_counter() - t0:.1f} s after it started (trace + plan + compile)")
    print(stitched.report.summary())
    y = stitched(x)                                     # the first stitched call
    err = float(np.max(np.abs(np.asarray(y) - np.asarray(stock(x)))))
    ms_tf, ms_st = median_ms(stock, x), median_ms(stitched, x)
    print(f"\nmax |stitched - tf.function| = {err:.2e}")
    print(f"tf.function: {ms_tf:.2f} ms   stitching: {ms_st:.2f} ms   "
          f"speedup {ms_tf / ms_st:.2f}x  (batch {a.batch}, median of 20)")


if __name__ == "__main__":
    main()
