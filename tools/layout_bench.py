"""Layout ops' gradients and the reuse choice for a layout op (issue 43), timed against
stock TF and XLA in one process: ``python tools/layout_bench.py [--rounds N]``.

Cases (float32; the batch dim unknown to the trace, but for the gather along it):
- the gradient of a gather by constant indices (TF: UnsortedSegmentSum; stitched: the
  SegmentSum composite, tf/frontend.py) on axis 1 and axis 0;
- the gradient of a strided slice (TF: StridedSliceGrad; stitched: tf/passes/
  strided_grad.py's Pad) with strides 2 and 3;
- a keras_hub-style position embedding at a sequence length known only at run time:
  ``ops.slice(table, (0, 0), (ops.shape(x)[-2], d))`` broadcast to x, added, then a
  LayerNorm (a Slice to a run-time count, tf/frontend.py's SliceTo);
- a rotate-half (rotary embeddings' split, negate, concatenate) of an expensive value
  (six transcendentals) and of a cheap one (an add): the planner's reuse choice
  (plan/cost.py, reuse_reason) reloads the expensive value and folds the cheap one.
  "always fold" is the same function (plus a 1e-30 that keeps the result cache from
  serving the other plan) planned with the choice turned off;
- the six transcendentals alone (no layout op), at the rotate-half's shape and at 8x its
  batch: a compute-bound chain the cost model prices per op (plan/cost.py,
  ``op_cost``; fused only where that beats TF's six ops), and a chain of Sin and Cos
  (ours call scalar libm: left to TF).
- a causal shift at a sequence length known only at run time: ``x[:, 1:] - x[:, :-1]``
  then a LayerNorm, and a language model's shifted loss, sparse softmax cross-entropy
  of ``logits[:, :-1]`` against ``labels[:, 1:]`` (slices that drop c elements of a
  run-time dim, ops.rest_size).

``--cases WORD`` keeps the cases whose name contains WORD (e.g. ``--cases chain``).

Each round times every mode once, in turn (an order fixed per round but rotated every
round); a cell is the median per call over the rounds.  Printed as a markdown table.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import stitching  # noqa: E402
from stitching.plan import search  # noqa: E402
from stitching.testing.train import input_gradient  # noqa: E402


_SIX = (tf.tanh, tf.exp, tf.sigmoid, tf.math.erf, tf.tanh, tf.sigmoid)


def _chain(v, ops=_SIX):
    for op in ops:
        v = op(v)
    return v


def _trig(v):
    return _chain(v, (tf.sin, tf.cos) * 3)


def _rotate_half(expensive, tag=0.0):
    def f(x):
        v = x + x
        if expensive:
            v = _chain(v)
        v1, v2 = tf.split(v, 2, axis=-1)
        return v + tf.concat([-v2, v1], axis=-1) + tag
    return f


def _shift_layer_norm():
    import keras
    norm = keras.layers.LayerNormalization(epsilon=1e-5)
    norm.build((None, None, 512))
    return lambda x: norm(x[:, 1:] - x[:, :-1])


def _shifted_loss(logits, labels):
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels[:, 1:],
                                                          logits=logits[:, :-1])


def _inputs(name, shape):
    """(signature, arguments) of a case."""
    x = tf.constant(np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    if "static" in name:
        return [tf.TensorSpec(shape, tf.float32)], [x]
    if "run-time sequence" not in name:
        return [tf.TensorSpec((None,) + shape[1:], tf.float32)], [x]
    sig = [tf.TensorSpec((None, None) + shape[2:], tf.float32)]
    if "loss" not in name:
        return sig, [x]
    labels = np.random.default_rng(1).integers(0, shape[-1], shape[:2]).astype(np.int32)
    return sig + [tf.TensorSpec((None, None), tf.int32)], [x, tf.constant(labels)]


def _position_embedding():
    import keras
    from keras import ops
    d = 256
    table = tf.Variable(np.random.default_rng(1).standard_normal((512, d)).astype(np.float32))
    norm = keras.layers.LayerNormalization(epsilon=1e-5)
    norm.build((None, None, d))

    def f(x):
        p = ops.slice(table, (0, 0), (ops.shape(x)[-2], d))
        return norm(x + ops.broadcast_to(p, ops.shape(x)))
    return f


CASES = [
    ("gather grad, axis 1", input_gradient(lambda v: tf.gather(v, [4, 5, 0, 2, 4, 9, 10, 11], axis=1)),
     (64, 16, 1024)),
    ("gather grad, axis 0 (static shape)", input_gradient(lambda v: tf.gather(v, [3, 1, 1, 0, 6, 7], axis=0)),
     (8, 256, 1024)),
    ("strided slice grad, x[:, ::2]", input_gradient(lambda v: v[:, ::2]), (64, 255, 256)),
    ("strided slice grad, x[..., 1::3]", input_gradient(lambda v: v[..., 1::3]), (64, 256, 255)),
    ("position embedding + LayerNorm (run-time sequence)", _position_embedding(),
     (8, 128, 256)),
    ("rotate-half of 6 transcendentals", _rotate_half(True), (64, 32, 4, 64)),
    ("rotate-half of an add", _rotate_half(False), (64, 32, 4, 64)),
    ("chain of 6 transcendentals", _chain, (64, 32, 4, 64)),
    ("chain of 6 transcendentals, 8x batch", _chain, (8 * 64, 32, 4, 64)),
    ("chain of 6 sin/cos", _trig, (64, 32, 4, 64)),
    ("x[:, 1:] - x[:, :-1] + LayerNorm (run-time sequence)", _shift_layer_norm(),
     (8, 128, 512)),
    ("LM shifted loss (run-time sequence)", _shifted_loss, (8, 128, 512)),
]
FOLDED = {"rotate-half of 6 transcendentals": _rotate_half(True, 1e-30),
          "rotate-half of an add": _rotate_half(False, 1e-30)}


def _stitched(fn, sig, args, fold_always=False):
    """A stitching.function of ``fn``, called once on ``args`` so that it is planned now
    (with the reuse choice off if asked)."""
    f = stitching.function(fn, input_signature=sig,
                           options=stitching.Options(background_compile=False, progress=False))
    saved = search.reuse_reason
    if fold_always:
        search.reuse_reason = lambda spec, profile: None
    try:
        f(*args)
    finally:
        search.reuse_reason = saved
    return f


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--cases", default="", help="only the cases whose name contains this")
    args = ap.parse_args(argv)
    from stitching.compile import parallel
    print(f"load average {os.getloadavg()[0]:.2f} at start; {args.rounds} rounds")
    print("| case | shape | TF ms | XLA ms | stitched ms | vs TF | vs XLA | kernels |"
          " always fold ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, fn, shape in [c for c in CASES if args.cases in c[0]]:
        sig, x = _inputs(name, shape)
        modes = {"tf": tf.function(fn, input_signature=sig),
                 "xla": tf.function(fn, input_signature=sig, jit_compile=True),
                 "st": _stitched(fn, sig, x)}
        if name in FOLDED:
            modes["fold"] = _stitched(FOLDED[name], sig, x, fold_always=True)
        for f in modes.values():
            f(*x)
        parallel.wait_upgrades()
        for f in modes.values():
            for _ in range(3):
                f(*x).numpy()
        times = {k: [] for k in modes}
        keys = list(modes)
        for r in range(args.rounds):
            for k in keys[r % len(keys):] + keys[:r % len(keys)]:
                t = time.perf_counter()
                modes[k](*x).numpy()
                times[k].append(time.perf_counter() - t)
        ms = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
        fold = f"{ms['fold']:.2f}" if "fold" in ms else ""
        print(f"| {name} | {list(shape)} | {ms['tf']:.2f} | {ms['xla']:.2f} | {ms['st']:.2f} | "
              f"{ms['tf'] / ms['st']:.2f}x | {ms['xla'] / ms['st']:.2f}x | "
              f"{len(modes['st'].report.kernels)} | {fold} |", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
