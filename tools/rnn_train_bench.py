"""The models suite's recurrent encoder as a training step, stock tf.function against
stitching.function, interleaved in one process (BENCHMARKS.md ``rnn_encoder``).

    python tools/rnn_train_bench.py 16          # batch 16: medians of 30 steps per mode

The step: ``stitching.testing.models.rnn_encoder`` (LSTM -> GRU -> LayerNorm ->
bidirectional LSTM), a Dense head on its output, a mean-squared loss, a tape inside the
function and SGD.  Each mode's function is built on its own copy of the model (same
seed), traced and run twice, then the tier-2 kernels are waited for; the timed steps
alternate the two modes' order each round.  Prints the medians and their ratio.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def _step_function(tf, keras, models):
    keras.utils.set_random_seed(1)
    model = models.rnn_encoder(**models.RNN_CONFIG)
    head, opt = keras.layers.Dense(1), keras.optimizers.SGD(0.01)

    def step(x, y):
        with tf.GradientTape() as tape:
            h = model(x, training=True)
            out = head(h if h.shape.rank == 2 else tf.reduce_mean(h, axis=1))
            loss = tf.reduce_mean((out - y) ** 2)
        variables = model.trainable_variables + head.trainable_variables
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss
    return step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("batch", type=int, nargs="?", default=16)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per mode")
    args = ap.parse_args(argv)
    import keras
    import tensorflow as tf

    import stitching
    from stitching.compile.parallel import wait_upgrades
    from stitching.testing import models

    rng = np.random.default_rng(0)
    cfg = models.RNN_CONFIG
    x = tf.constant(rng.standard_normal((args.batch, cfg["seq_len"], cfg["features"]))
                    .astype(np.float32))
    y = tf.constant(rng.standard_normal((args.batch, 1)).astype(np.float32))
    fns = {"tf": tf.function(_step_function(tf, keras, models)),
           "st": stitching.function(_step_function(tf, keras, models),
                                    options=stitching.Options(background_compile=False))}
    for f in fns.values():
        f(x, y)
        f(x, y)
    wait_upgrades(300)
    times = {k: [] for k in fns}
    for r in range(args.steps):
        for k in (("tf", "st") if r % 2 else ("st", "tf")):
            t0 = time.perf_counter()
            fns[k](x, y).numpy()
            times[k].append(time.perf_counter() - t0)
    med = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    print(f"batch {args.batch}: stock TF {med['tf']:.2f} ms, stitched {med['st']:.2f} ms, "
          f"stitched vs TF {med['tf'] / med['st']:.2f}x")
    print(fns["st"].report.summary().splitlines()[1].strip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
