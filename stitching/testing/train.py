"""Training steps for the train benchmark (``tools/bench.py --suite train``) and its tests.

A case is one Keras model, its optimizer and one fixed batch; ``make_step`` builds a
fresh copy (weights from ``keras.utils.set_random_seed(0)``, so every mode starts from
the same ones) and returns the custom step users write: GradientTape forward, tape
gradient, ``optimizer.apply_gradients``, returning the loss.

Node names tell the step's three parts apart (``phase_of``): TF names the tape's gradient
ops ``gradient_tape/...`` and Keras 3 puts an optimizer's update under its own name
scope (``adam/...``, ``sgd/...``); everything else is the forward pass (and the loss).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

PHASES = ("forward", "backward", "optimizer")


def input_gradient(take):
    """``x -> d(sum(take(x * 1.5)^2 / 2))/dx * 2``: the backward of a layout op ``take``
    (a gather, a strided slice) between exact multiplications, so stock TF and the
    kernels compute the same bits (tests/test_layout_grad.py, tools/layout_bench.py)."""
    import tensorflow as tf

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.square(take(x * 1.5)) * 0.5)
        return tape.gradient(loss, x) * 2.0
    return step


@dataclass(frozen=True)
class TrainCase:
    name: str
    description: str
    build: Callable      # () -> (keras model, optimizer, x shape, classes)
    batch: int


def _mlp(width=512, features=256, classes=10, batch=128):
    def build():
        import keras
        return (keras.Sequential([keras.Input((features,)),
                                  keras.layers.Dense(width, activation="relu"),
                                  keras.layers.Dense(width, activation="relu"),
                                  keras.layers.Dense(classes)]),
                keras.optimizers.Adam(1e-3), (batch, features), classes)
    return build


def _cnn():
    def build():
        import keras
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
    return build


def _transformer():
    def build():
        import keras
        seq, d, heads, ff = 64, 128, 4, 512
        inp = keras.Input((seq, d))
        a = keras.layers.MultiHeadAttention(heads, d // heads)(inp, inp)
        x = keras.layers.LayerNormalization()(inp + a)
        f = keras.layers.Dense(ff, activation="gelu")(x)
        x = keras.layers.LayerNormalization()(x + keras.layers.Dense(d)(f))
        out = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(x))
        return keras.Model(inp, out), keras.optimizers.AdamW(1e-3), (8, seq, d), 10
    return build


def _tiny():
    def build():
        import keras
        return (keras.Sequential([keras.Input((16,)),
                                  keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(4)]),
                keras.optimizers.SGD(0.05, momentum=0.9), (8, 16), 4)
    return build


CASES = {c.name: c for c in (
    TrainCase("mlp", "MLP Dense 256-512-512-10, ReLU, Adam", _mlp(), 128),
    TrainCase("cnn", "ResNet-style CNN: Conv + BatchNorm + ReLU/swish, residual add, "
              "SGD momentum, 32x32x3", _cnn(), 32),
    TrainCase("transformer", "post-LN Transformer encoder block, d_model 128, 4 heads, "
              "ff 512, seq 64, AdamW", _transformer(), 8),
)}
# For tests only (not in the benchmark's default rows): seconds to trace and compile.
EXTRA = {"tiny": TrainCase("tiny", "Dense 16-16-4, tanh, SGD momentum (tests)", _tiny(), 8)}


def get(name: str) -> TrainCase:
    case = CASES.get(name) or EXTRA.get(name)
    if case is None:
        raise KeyError(f"unknown train case {name!r}; known: {sorted(CASES) + sorted(EXTRA)}")
    return case


@dataclass
class Step:
    fn: Callable          # (x, y) -> loss, not yet wrapped in tf.function / stitching
    x: object
    y: object
    model: object
    optimizer: object

    @property
    def optimizer_scope(self) -> str:
        return self.optimizer.name.lower()


def make_step(name: str) -> Step:
    """A fresh model and optimizer (same initial weights every call) and its raw step."""
    import keras
    import tensorflow as tf
    keras.utils.set_random_seed(0)
    model, opt, xshape, classes = get(name).build()
    opt.build(model.trainable_variables)
    rs = np.random.RandomState(0)           # the same batch for every mode
    x = tf.constant(rs.randn(*xshape).astype("float32"))
    y = tf.constant(np.arange(xshape[0]) % classes)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return Step(keras_step(model, opt, loss_fn), x, y, model, opt)


def keras_step(model, opt, loss_fn):
    """The custom train step Keras users write: ``step(x, y) -> loss`` (a tape over
    the forward, the optimizer's update of every trainable variable), unwrapped."""
    import tensorflow as tf

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step


def phase_of(node: str, optimizer_scope: str) -> str:
    """'forward', 'backward' or 'optimizer' for a node name of the traced step."""
    head = node.split("/", 1)[0].lower()
    if head == "gradient_tape":
        return "backward"
    # Keras 3 scopes the update as ``<optimizer name>``, uniquified with a suffix
    # (``adam_1``) when the step is traced more than once in one graph.
    if head == optimizer_scope or head.rstrip("0123456789").rstrip("_") == optimizer_scope:
        return "optimizer"
    return "forward"


def phase_counts(report: dict, optimizer_scope: str) -> dict:
    """From a stitching report's ``to_dict()``: per phase, memory-intensive ops, how
    many of them are fused, and kernels; a kernel holding ops of several phases counts
    once under 'mixed' (e.g. a bias gradient fused with the optimizer's update)."""
    out = {p: {"ops": 0, "fused": 0, "kernels": 0} for p in PHASES}
    out["mixed"] = {"kernels": 0}
    for k in report.get("kernel_details", []):
        phases = {phase_of(n, optimizer_scope) for n in k["nodes"]}
        for n in k["nodes"]:
            p = phase_of(n, optimizer_scope)
            out[p]["ops"] += 1
            out[p]["fused"] += 1
        out[phases.pop() if len(phases) == 1 else "mixed"]["kernels"] += 1
    for u in report.get("unfused_nodes", []):
        out[phase_of(u["node"], optimizer_scope)]["ops"] += 1
    for p in PHASES:
        ops = out[p]["ops"]
        out[p]["coverage"] = round(out[p]["fused"] / ops, 4) if ops else None
    return out
