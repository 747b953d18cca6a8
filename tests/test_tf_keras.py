"""stitching.keras.stitch on tf_keras (Keras 2: ``TF_USE_LEGACY_KERAS=1``'s tf.keras,
what HF transformers' TF models, TF Model Garden and TF Recommenders are built on).
tf_keras is not a dependency of stitching: skipped where it is not installed."""
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import stitching

tf_keras = pytest.importorskip("tf_keras")


def _data(n=80):
    rs = np.random.RandomState(0)
    return rs.randn(n, 16).astype("float32"), rs.randn(n, 4).astype("float32")


def _model(weights=None, steps_per_execution=1):
    m = tf_keras.Sequential([tf_keras.Input((16,)),
                             tf_keras.layers.Dense(32, activation="gelu"),
                             tf_keras.layers.Dense(4)])
    if weights is not None:
        m.set_weights(weights)
    m.compile(optimizer=tf_keras.optimizers.Adam(1e-2), loss="mse",
              steps_per_execution=steps_per_execution)
    return m


def _fit(m):
    x, y = _data()
    # 80 rows in batches of 32: a last partial batch of 16 (unknown batch dim)
    return m.fit(x, y, batch_size=32, epochs=3, verbose=0, shuffle=False).history["loss"]


def test_a_compiled_tf_keras_model_is_stitched_and_fits_as_stock():
    """tf_keras says ``model._is_compiled`` where Keras 3 says ``model.compiled``:
    stitch refused every tf_keras model with "call model.compile(...) first"."""
    stock = _model()
    m = _model(stock.get_weights())
    stitching.keras.stitch(m)
    np.testing.assert_allclose(_fit(m), _fit(stock), rtol=1e-5)
    report = m.stitching_report.train
    assert report is not None and len(report.kernels) >= 1, m.stitching_report.summary()
    x, _ = _data()
    np.testing.assert_allclose(m.predict(x, verbose=0), stock.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-5)


def test_an_uncompiled_tf_keras_model_is_refused():
    m = tf_keras.Sequential([tf_keras.Input((16,)), tf_keras.layers.Dense(4)])
    with pytest.raises(ValueError, match="call model.compile"):
        stitching.keras.stitch(m)


def test_tiered_tf_keras_steps_are_counted_in_ints(tiered, monkeypatch):
    """tf_keras's ``steps_per_execution`` is a tf.Variable: the tiered step counts
    became tensors."""
    monkeypatch.setenv("STITCHING_TIER_UP_SECONDS", "0")
    stock = _model(steps_per_execution=2)
    m = _model(stock.get_weights(), steps_per_execution=2)
    stitching.keras.stitch(m)
    np.testing.assert_allclose(_fit(m), _fit(stock), rtol=1e-5)
    steps = m._stitching_steps["train"]
    assert type(steps.stock_steps) is int and type(steps.stitched_steps) is int
    # 3 epochs of 3 batches (tf_keras runs an epoch's last call with the variable at 1)
    assert steps.stock_steps + steps.stitched_steps == 9


def test_a_stitched_tf_keras_model_exports_a_stitched_serve_endpoint(tmp_path):
    """tf_keras's ``model.export(filepath)``: stitch replaced it by Keras 3's export,
    which refused the model ("The model must be a `keras.Model`")."""
    m = _model()
    stitching.keras.stitch(m)
    path = str(tmp_path / "exported")
    m.export(path)
    x, _ = _data(8)
    want = m.predict(x, verbose=0)
    np.save(tmp_path / "x.npy", x)
    code = ("import sys, numpy as np, stitching, tensorflow as tf\n"
            "loaded = tf.saved_model.load(sys.argv[1])\n"
            "ops = {n.op for f in loaded.serve.get_concrete_function().graph.as_graph_def()"
            ".library.function for n in f.node_def} | {n.op for n in "
            "loaded.serve.get_concrete_function().graph.as_graph_def().node}\n"
            "assert 'StitchedKernel' in ops, sorted(ops)\n"
            "np.save(sys.argv[2], loaded.serve(tf.constant(np.load(sys.argv[3]))).numpy())\n")
    subprocess.run([sys.executable, "-c", code, path, str(tmp_path / "got.npy"),
                    str(tmp_path / "x.npy")], check=True)
    np.testing.assert_allclose(np.load(tmp_path / "got.npy"), want, rtol=1e-5, atol=1e-5)


_MIRRORED = """
import json, numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import tf_keras, stitching
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
x = np.random.RandomState(0).randn(64, 16).astype("float32"); y = x[:, :1] * 2.0
losses = []
for stitched in (False, True):
    with strategy.scope():
        m = tf_keras.Sequential([tf_keras.Input((16,)),
                                 tf_keras.layers.Dense(32, activation="gelu"),
                                 tf_keras.layers.Dense(1)])
        if losses:
            m.set_weights(weights)
        weights = m.get_weights()
        m.compile(optimizer=tf_keras.optimizers.SGD(0.05), loss="mse",
                  steps_per_execution=2)
    if stitched:
        stitching.keras.stitch(m)
    losses.append(m.fit(x, y, batch_size=16, epochs=2, verbose=0,
                        shuffle=False).history["loss"])
print("RESULT", json.dumps({"losses": losses,
                            "kernels": len(m.stitching_report.train.kernels)}))
"""


def test_a_tf_keras_model_under_mirrored_strategy_fits_stitched():
    """Under a multi-replica strategy stitch wraps Keras's strategy.run step: it built
    it from Keras 3's trainer (``model._autoconvert_optionals``: an AttributeError on
    a tf_keras model), and tf_keras's steps_per_execution is a MirroredVariable."""
    import json
    out = subprocess.run([sys.executable, "-c", _MIRRORED], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.split("RESULT", 1)[1])
    stock, stitched = result["losses"]
    np.testing.assert_allclose(stitched, stock, rtol=1e-5)
    assert result["kernels"] >= 1
