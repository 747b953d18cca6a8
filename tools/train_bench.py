"""Train-step benchmark: one custom training step (GradientTape + optimizer) per model,
under tf.function, stitching.function and (where asked) tf.function(jit_compile=True).

    python tools/train_bench.py --models mlp,cnn,transformer --steps 20 --repeats 5
    python tools/train_bench.py --memory     # + peak allocator bytes per mode

Each mode trains its own copy of the model from the same initial weights; the table
gives the median step time over ``--repeats`` rounds of ``--steps`` steps (after one
untimed round that traces and compiles), the speedup against tf.function, the final
loss of each mode (they must agree), and the stitched kernels of the step.  Models:

  mlp          Dense 256-512-512-10, ReLU, Adam, batch 128
  cnn          ResNet-style: Conv + BatchNorm + ReLU/swish, a residual add, SGD with
               momentum, batch 32 of 32x32x3 (the issue's case)
  transformer  one post-LN encoder block, d_model 128, 4 heads, ff 512, seq 64,
               batch 8, AdamW
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def _models():
    import keras

    def mlp():
        return (keras.Sequential([keras.Input((256,)),
                                  keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(10)]),
                keras.optimizers.Adam(1e-3), (128, 256), 10)

    def cnn():
        inp = keras.Input((32, 32, 3))
        x = keras.layers.Conv2D(32, 3, padding="same", use_bias=False)(inp)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.Activation("relu")(x)
        y = keras.layers.Conv2D(32, 3, padding="same", use_bias=False)(x)
        y = keras.layers.BatchNormalization()(y)
        y = keras.layers.Activation("swish")(y)
        x = keras.layers.Add()([x, y])
        x = keras.layers.GlobalAveragePooling2D()(x)
        out = keras.layers.Dense(10)(x)
        return (keras.Model(inp, out), keras.optimizers.SGD(0.01, momentum=0.9),
                (32, 32, 32, 3), 10)

    def transformer():
        seq, d, heads, ff = 64, 128, 4, 512
        inp = keras.Input((seq, d))
        a = keras.layers.MultiHeadAttention(heads, d // heads)(inp, inp)
        x = keras.layers.LayerNormalization()(inp + a)
        f = keras.layers.Dense(ff, activation="gelu")(x)
        x = keras.layers.LayerNormalization()(x + keras.layers.Dense(d)(f))
        out = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(x))
        return keras.Model(inp, out), keras.optimizers.AdamW(1e-3), (8, seq, d), 10

    return {"mlp": mlp, "cnn": cnn, "transformer": transformer}


def _step_fn(model, opt, loss_fn):
    import tensorflow as tf

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step


def _build_step(build, mode):
    import keras
    import tensorflow as tf

    import stitching
    keras.utils.set_random_seed(0)
    model, opt, xshape, classes = build()
    opt.build(model.trainable_variables)
    rs = np.random.RandomState(0)           # the same batch for every mode
    x = tf.constant(rs.randn(*xshape).astype("float32"))
    y = tf.constant(np.arange(xshape[0]) % classes)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    fn = _step_fn(model, opt, loss_fn)
    step = (stitching.function(fn) if mode == "stitched" else
            tf.function(fn, jit_compile=(mode == "xla")))
    return step, x, y


def run_model(name, modes, steps, repeats):
    """Rounds interleave the modes (tf, stitched, tf, stitched, ...), so a change of
    load on a shared machine hits every mode alike."""
    build = _models()[name]
    state, rows = {}, {}
    for mode in modes:
        step, x, y = _build_step(build, mode)
        t0 = time.perf_counter()
        losses = [float(step(x, y)) for _ in range(steps)]
        state[mode] = (step, x, y)
        rows[mode] = {"first_round_s": time.perf_counter() - t0, "losses": losses,
                      "times": []}
    for _ in range(repeats):
        for mode in modes:
            step, x, y = state[mode]
            t0 = time.perf_counter()
            for _ in range(steps):
                loss = step(x, y)
            float(loss)
            rows[mode]["times"].append((time.perf_counter() - t0) / steps)
    for mode in modes:
        rep = getattr(state[mode][0], "report", None)
        r = rows[mode]
        r.update(ms=1e3 * statistics.median(r["times"]), loss=r["losses"][-1],
                 kernels=len(rep.kernels) if rep else None,
                 coverage=rep.coverage if rep else None)
    return rows


def _memory_child(name, mode, steps):
    """Peak bytes TF's CPU allocator held during ``steps`` steps after the first
    (tracing, compiling) round; run in a fresh process with TF_CPU_ALLOCATOR_USE_BFC."""
    import tensorflow as tf
    step, x, y = _build_step(_models()[name], mode)
    for _ in range(2):
        float(step(x, y))
    tf.config.experimental.reset_memory_stats("CPU:0")
    for _ in range(steps):
        loss = step(x, y)
    float(loss)
    print("PEAK", tf.config.experimental.get_memory_info("CPU:0")["peak"])


def peak_memory(name, mode, steps):
    import os
    import subprocess
    import sys
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2")
    p = subprocess.run([sys.executable, __file__, "--_memory", f"{name}:{mode}",
                        "--steps", str(steps)], env=env, capture_output=True, text=True)
    peaks = [ln.split()[1] for ln in p.stdout.splitlines() if ln.startswith("PEAK")]
    if p.returncode or not peaks:
        raise RuntimeError(f"memory child {name}:{mode} failed:\n{p.stderr[-2000:]}")
    return int(peaks[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mlp,cnn,transformer")
    ap.add_argument("--modes", default="tf,stitched")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--memory", action="store_true",
                    help="also the peak of TF's CPU allocator (BFC, a fresh process per "
                         "mode) over the timed steps")
    ap.add_argument("--memory-runs", type=int, default=3,
                    help="fresh processes per mode for --memory (median, range)")
    ap.add_argument("--_memory", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._memory:
        _memory_child(*args._memory.split(":"), args.steps)
        return
    modes = args.modes.split(",")
    print(f"{'model':12} {'mode':9} {'ms/step':>9} {'vs tf':>6} {'loss rel':>9} "
          f"{'kernels':>7} {'coverage':>8}")
    for name in args.models.split(","):
        rows = run_model(name, modes, args.steps, args.repeats)
        base = rows.get("tf", {}).get("ms")
        ref = rows.get("tf", {}).get("losses")
        for mode, r in rows.items():
            rel = (max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(r["losses"], ref))
                   if ref else float("nan"))
            speed = f"{base / r['ms']:.2f}x" if base else "-"
            cov = f"{100 * r['coverage']:.0f}%" if r["coverage"] is not None else "-"
            mem = ""
            if args.memory:     # TF's own peak varies run to run (op scheduling order)
                peaks = sorted(peak_memory(name, mode, args.steps) / 2**20
                               for _ in range(args.memory_runs))
                mem = (f" {statistics.median(peaks):7.1f} MiB peak "
                       f"({peaks[0]:.1f}-{peaks[-1]:.1f})")
            print(f"{name:12} {mode:9} {r['ms']:9.2f} {speed:>6} {rel:9.1e} "
                  f"{r['kernels'] if r['kernels'] is not None else '-':>7} {cov:>8}{mem}")


if __name__ == "__main__":
    main()
