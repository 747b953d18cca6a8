"""stitching.keras.stitch: Keras fit/evaluate/predict/train_on_batch run stitched
graphs and give stock Keras's numbers."""
import numpy as np
import pytest
import tensorflow as tf

import stitching

keras = pytest.importorskip("keras")


def _data(n=80):
    rs = np.random.RandomState(0)
    return rs.randn(n, 16).astype("float32"), rs.randn(n, 4).astype("float32")


def _model(steps_per_execution=1, jit_compile=False, compile=True):
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="gelu"),
                          keras.layers.LayerNormalization(),
                          keras.layers.Dense(4, dtype="float32")])
    if compile:
        m.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"],
                  steps_per_execution=steps_per_execution, jit_compile=jit_compile)
    return m


class _BatchLosses(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def _run(m):
    x, y = _data()
    cb = _BatchLosses()
    # 80 rows in batches of 32: a last partial batch of 16 (unknown batch dim)
    hist = m.fit(x, y, batch_size=32, epochs=3, verbose=0, shuffle=False,
                 validation_data=(x[:40], y[:40]), callbacks=[cb])
    return {"history": hist.history, "batches": cb.losses,
            "evaluate": m.evaluate(x, y, batch_size=32, verbose=0),
            "predict": m.predict(x, batch_size=32, verbose=0),
            "on_batch": m.train_on_batch(x[:32], y[:32]),
            "weights": [w.numpy() for w in m.weights]}


def _assert_close(a, b, rtol):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_close(a[k], b[k], rtol)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for p, q in zip(a, b):
            _assert_close(p, q, rtol)
    else:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=rtol)


def test_fit_evaluate_predict_train_on_batch_match_keras_with_steps_per_execution():
    stock = _run(_model(steps_per_execution=2))
    m = _model(steps_per_execution=2)
    assert stitching.keras.stitch(m) is m
    got = _run(m)
    _assert_close(got, stock, rtol=1e-5)
    assert len(got["batches"]) > 0 and got["history"]["loss"][-1] < got["history"]["loss"][0]
    rep = m.stitching_report
    for step in ("train", "test", "predict"):
        assert rep[step] is not None and len(rep[step].kernels) >= 1, step
    assert "[train_step]" in rep.summary()


def test_refuses_jit_compile_and_uncompiled_models_clearly():
    with pytest.raises(ValueError, match="jit_compile=True"):
        stitching.keras.stitch(_model(jit_compile=True))
    with pytest.raises(ValueError, match="compile"):
        stitching.keras.stitch(_model(compile=False))


@pytest.mark.slow
def test_mixed_float16_matches_keras_within_half_precision():
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = _data()

        def losses(m):
            return m.fit(x, y, batch_size=32, epochs=2, verbose=0,
                         shuffle=False).history["loss"]

        stock = losses(_model())
        m = stitching.keras.stitch(_model())
        got = losses(m)
        np.testing.assert_allclose(got, stock, rtol=5e-4)
        assert len(m.stitching_report.train.kernels) >= 1
    finally:
        keras.mixed_precision.set_global_policy(policy)
