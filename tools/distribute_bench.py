"""A training step under ``tf.distribute.MirroredStrategy``, stitched against stock TF.

    python tools/distribute_bench.py mlp --batch 256 --steps 60
    python tools/distribute_bench.py cnn --batch 128 --steps 60 --devices 4

The strategy mirrors the step over ``--devices`` logical CPU devices (one process,
the machine's cores shared by them).  The step is a custom loop's: ``strategy.run``
of a replica step (forward, loss, ``GradientTape``, Adam) and the loss's reduction,
inside ``tf.function`` or ``stitching.function``.  After the stitched function's
first call (it plans and compiles: nothing is tiered under a strategy) and ``wait``
(its kernels' optimized code in), the two steps run interleaved, the order swapped
every step; the medians and the ratio are printed, with how many single steps the
stitched one lost and the report's headline.

Models (small on purpose, so a run takes a minute): ``mlp`` (Dense-gelu, LayerNorm,
Dense-relu, Dense on 32 features), ``cnn`` (two 3x3 Conv2D with 8 channels, each with
BatchNormalization, then relu / swish, global average pooling, dropout, Dense) on
16x16x3 images; 10 classes.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_lib.machine import machine_line  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=["mlp", "cnn"])
    ap.add_argument("--batch", type=int, default=128, help="global batch (all replicas)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--devices", type=int, default=4, help="logical CPU devices")
    a = ap.parse_args()

    import numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * a.devices)
    import keras

    import stitching
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(a.devices)])
    shape = (32,) if a.model == "mlp" else (16, 16, 3)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((a.batch, *shape)).astype("float32")
    y = rng.integers(0, 10, a.batch).astype("int32")

    def build():
        L = keras.layers
        if a.model == "mlp":
            return keras.Sequential([keras.Input(shape), L.Dense(64, activation="gelu"),
                                     L.LayerNormalization(), L.Dense(64, activation="relu"),
                                     L.Dense(10)])
        return keras.Sequential([keras.Input(shape), L.Conv2D(8, 3, padding="same"),
                                 L.BatchNormalization(), L.Activation("relu"),
                                 L.Conv2D(8, 3, padding="same"), L.BatchNormalization(),
                                 L.Activation("swish"), L.GlobalAveragePooling2D(),
                                 L.Dropout(0.3, seed=1), L.Dense(10)])

    def make(wrap):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model, opt = build(), keras.optimizers.Adam(1e-3)
            opt.build(model.trainable_variables)
        lossf = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

        def replica_step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(lossf(y, model(x, training=True)),
                                                  global_batch_size=a.batch)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        @wrap
        def step(x, y):
            return strategy.reduce("SUM", strategy.run(replica_step, args=(x, y)), axis=None)
        return step

    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(a.batch).repeat()
    xb, yb = next(iter(strategy.experimental_distribute_dataset(data)))
    steps = {"stock": make(tf.function), "stitched": make(stitching.function)}
    t0 = time.perf_counter()
    steps["stitched"](xb, yb).numpy()
    first = time.perf_counter() - t0
    steps["stitched"].wait()
    for _ in range(3):
        for f in steps.values():
            f(xb, yb).numpy()
    times = {k: [] for k in steps}
    for i in range(a.steps):
        for k in (list(steps) if i % 2 == 0 else list(steps)[::-1]):
            t = time.perf_counter()
            steps[k](xb, yb).numpy()
            times[k].append(time.perf_counter() - t)
    med = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
    lost = sum(s > t for s, t in zip(times["stitched"], times["stock"]))
    print(f"{machine_line()} ({os.cpu_count()} cores); TF {tf.__version__}; "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"{a.model} under MirroredStrategy({a.devices}), global batch {a.batch}: "
          f"stock {med['stock']:.2f} ms, stitched {med['stitched']:.2f} ms, "
          f"{med['stock'] / med['stitched']:.2f}x stock (medians of {a.steps} interleaved "
          f"steps; stitched lost {lost}); its first call {first:.1f} s")
    print(steps["stitched"].report.summary().splitlines()[1].strip())


if __name__ == "__main__":
    main()
