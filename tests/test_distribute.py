"""tf.distribute: stitched train steps under MirroredStrategy over two logical CPU
devices give the same losses as the same strategy without stitching.

Logical devices must be configured before TensorFlow initializes its devices, which
another test in this process may already have done, so each case runs in a fresh
interpreter."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The model, data and replica step both scripts train (inside ``run``; SEED picks the
# data shard).
_MODEL_AND_STEP = r"""    with strategy.scope():
        w = tf.Variable(tf.random.stateless_normal([16, 8], seed=[1, 2]))
        b = tf.Variable(tf.zeros([8]))
        opt = tf.keras.optimizers.SGD(0.1, momentum=0.9)
        opt.build([w, b])
    x = tf.random.stateless_normal([32, 16], seed=[3, SEED])

    def step_fn(x):
        with tf.GradientTape() as t:
            h = tf.nn.relu(tf.matmul(x, w) + b)
            loss = tf.reduce_mean(tf.square(tf.tanh(h) * 0.5 - 1.0))
        g = t.gradient(loss, [w, b])
        opt.apply_gradients(zip(g, [w, b]))
        return loss
"""

_PRELUDE = r"""
import json, sys
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
import stitching

def run(stitched, mode):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
MODEL_AND_STEP
    wrap = stitching.function if stitched else tf.function
    if mode == "run_inside":          # strategy.run inside the stitched function
        @wrap
        def step(x):
            return strategy.reduce("SUM", strategy.run(step_fn, args=(x,)), axis=None)
    else:                             # the stitched function inside strategy.run
        # (TF refuses a synchronization point -- apply_gradients' all-reduce -- inside
        # a function nested in strategy.run, stitched or not: the nested function
        # computes loss and gradients, the replica function applies them)
        @wrap
        def inner(x):
            with tf.GradientTape() as t:
                h = tf.nn.relu(tf.matmul(x, w) + b)
                loss = tf.reduce_mean(tf.square(tf.tanh(h) * 0.5 - 1.0))
            return loss, t.gradient(loss, [w, b])

        def replica_fn(x):
            loss, g = inner(x)
            opt.apply_gradients(zip(g, [w, b]))
            return loss

        @tf.function
        def step(x):
            return strategy.reduce("SUM", strategy.run(replica_fn, args=(x,)), axis=None)
    losses = [float(step(x)) for _ in range(4)]
    kernels = 0
    for r in getattr(step, "reports", None) or getattr(locals().get("inner"), "reports", []):
        kernels += len(r.kernels)
    return losses, [v.numpy().tolist() for v in (w, b)], kernels
""".replace("MODEL_AND_STEP\n", _MODEL_AND_STEP.replace("SEED", "4"), 1)


def _run(mode):
    code = _PRELUDE + f"""
stock = run(False, {mode!r})
st = run(True, {mode!r})
print("RESULT" + json.dumps([stock, st]))
"""
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


@pytest.mark.parametrize("mode", ["run_inside",
                                  pytest.param("stitched_inside_run", marks=pytest.mark.slow)])
def test_mirrored_call_time_captures_are_fed(mode):
    """Regression: the import of the rewritten graph mapped only by-value captures, so
    MirroredStrategy's call-time (by-reference) captures -- the collectives' keys --
    were left as unfed placeholders ("You must feed a value for placeholder tensor
    'stitched/sgd/Placeholder_1'")."""
    (loss0, w0, _), (loss1, w1, kernels) = _run(mode)
    assert kernels > 0, "nothing was stitched: the test would not exercise the rewrite"
    for a, b in zip(loss0, loss1):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (loss0, loss1)
    for va, vb in zip(w0, w1):
        flat_a = [x for row in (va if isinstance(va[0], list) else [va]) for x in row]
        flat_b = [x for row in (vb if isinstance(vb[0], list) else [vb]) for x in row]
        assert max(abs(p - q) for p, q in zip(flat_a, flat_b)) <= 1e-5
    assert loss0[-1] < loss0[0]


_ADAM_RELU = r"""
import json
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
import keras
import stitching

def run(wrap):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    keras.utils.set_random_seed(0)
    with strategy.scope():
        m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
        opt = keras.optimizers.Adam(1e-3)
        opt.build(m.trainable_variables)
    x = tf.random.stateless_normal([16, 8], seed=[3, 4])
    data = strategy.experimental_distribute_dataset(     # each replica its own half
        tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(16).repeat(3))

    def step_fn(x, y):
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(tf.square(m(x) - y)) / 16.0
        g = t.gradient(loss, m.trainable_variables)
        opt.apply_gradients(zip(g, m.trainable_variables))
        return loss

    @wrap
    def step(x, y):
        return strategy.reduce("SUM", strategy.run(step_fn, args=(x, y)), axis=None)
    losses = [float(step(a, b)) for a, b in data]
    graphs = [cf.graph.as_graph_def() for cf in step._list_all_concrete_functions()]
    devices = sorted({n.device for g in graphs for n in list(g.node) + [
        m for f in g.library.function for m in f.node_def] if n.op == "StitchedKernel"})
    return losses, devices

print("RESULT" + json.dumps([run(tf.function), run(stitching.function)]))
"""


def test_mirrored_adam_step_does_not_fuse_across_replicas():
    """Regression (a hang): Adam over a ReLU MLP under MirroredStrategy.  The planner
    put one replica's gradient (before its all-reduce) and another's update (after
    it) in one kernel, which then waited for a collective waiting for it -- a cycle
    no graph edge shows -- and the first step never returned.  A kernel now holds the
    ops of one device and runs there."""
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    p = subprocess.run([sys.executable, "-c", _ADAM_RELU], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")][-1]
    (stock, _), (stitched, devices) = json.loads(line[len("RESULT"):])
    np.testing.assert_allclose(stitched, stock, rtol=1e-5)
    assert any(d.endswith("CPU:0") for d in devices) and \
        any(d.endswith("CPU:1") for d in devices), devices


_WORKER = r"""
import json, os
import tensorflow as tf
import stitching
strategy = tf.distribute.MultiWorkerMirroredStrategy()
task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]

def run(stitched):
MODEL_AND_STEP
    @(stitching.function if stitched else tf.function)
    def step(x):
        return strategy.reduce("SUM", strategy.run(step_fn, args=(x,)), axis=None)

    losses = [float(step(x)) for _ in range(4)]
    return losses, sum(len(r.kernels) for r in getattr(step, "reports", []))

print("RESULT" + json.dumps([run(False), run(True)]), flush=True)
""".replace("MODEL_AND_STEP\n", _MODEL_AND_STEP.replace("SEED", "4 + task"), 1)


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_multi_worker_mirrored_two_processes_match_unstitched():
    """MultiWorkerMirroredStrategy, two worker processes on localhost (TF_CONFIG): the
    stitched step's losses equal the same strategy's without stitching."""
    workers = [f"localhost:{_free_port()}" for _ in range(2)]
    procs = []
    for i in range(2):
        cfg = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}
        env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2",
                   TF_CONFIG=json.dumps(cfg))
        procs.append(subprocess.Popen([sys.executable, "-c", _WORKER], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        line = [ln for ln in out.splitlines() if ln.startswith("RESULT")][-1]
        results.append(json.loads(line[len("RESULT"):]))
    for (stock, _), (stitched, kernels) in results:
        assert kernels > 0
        np.testing.assert_allclose(stitched, stock, rtol=1e-5)
    assert results[0][1][0] == results[1][1][0]     # one all-reduced loss on both workers


_KERAS = _PRELUDE.split("def run(")[0] + r"""
import keras, numpy as np

def fit(stitched):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="gelu"),
                              keras.layers.LayerNormalization(), keras.layers.Dense(4)])
        m.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    if stitched:
        stitching.keras.stitch(m)
    rs = np.random.RandomState(0)
    x, y = rs.randn(80, 16).astype("float32"), rs.randn(80, 4).astype("float32")
    h = m.fit(x, y, batch_size=32, epochs=3, verbose=0, shuffle=False).history
    ev = m.evaluate(x, y, batch_size=32, verbose=0)
    p = m.predict(x, batch_size=32, verbose=0)
    k = {s: len(m.stitching_report[s].kernels) for s in ("train", "test", "predict")} \
        if stitched else {}
    return [h, ev, p.tolist(), k]

print("RESULT" + json.dumps([fit(False), fit(True)]))
"""


@pytest.mark.slow
def test_keras_fit_under_mirrored_strategy_matches_unstitched():
    """Keras calls train_step inside strategy.run, where a nested function may not hold
    the gradient all-reduce: stitch() stitches strategy.run + the reduction instead."""
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    p = subprocess.run([sys.executable, "-c", _KERAS], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    stock, st = json.loads([ln for ln in p.stdout.splitlines()
                            if ln.startswith("RESULT")][-1][len("RESULT"):])
    for key in ("loss", "mae"):
        np.testing.assert_allclose(st[0][key], stock[0][key], rtol=1e-5)
    np.testing.assert_allclose(st[1], stock[1], rtol=1e-5)
    np.testing.assert_allclose(st[2], stock[2], rtol=1e-5, atol=1e-5)
    assert all(n >= 1 for n in st[3].values()), st[3]
