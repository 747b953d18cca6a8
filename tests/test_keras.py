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


SYNC = stitching.Options(background_compile=False)   # every step stitched from the first


def test_fit_evaluate_predict_train_on_batch_match_keras_with_steps_per_execution():
    stock = _run(_model(steps_per_execution=2))
    m = _model(steps_per_execution=2)
    assert stitching.keras.stitch(m, SYNC) is m
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
        m = stitching.keras.stitch(_model(), SYNC)
        got = losses(m)
        np.testing.assert_allclose(got, stock, rtol=5e-4)
        assert len(m.stitching_report.train.kernels) >= 1
    finally:
        keras.mixed_precision.set_global_policy(policy)


class _WaitAt(_BatchLosses):
    """Per-step losses; after step ``n`` the step's background compile is waited
    for, so the next step is the first stitched one (a switch mid-run, made
    deterministic)."""

    def __init__(self, n):
        super().__init__()
        self.n = n

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        if len(self.losses) == self.n:
            assert stitching.keras.wait(self.model, timeout=300)


@pytest.fixture
def cold_results(monkeypatch):
    """First tiers run stock Keras whatever the result cache holds (a cache kept
    between test runs would otherwise serve a graph traced the same way before)."""
    monkeypatch.setattr(stitching.keras, "_probing", lambda hint: False)


def test_tiered_fit_switches_mid_run_and_keeps_the_loss_curve_of_keras(capsys,
                                                                        cold_results,
                                                                        tiered):
    """Tiered (the default): the first steps run stock Keras while the train step
    compiles in the background; the switch happens at a step boundary and every
    step's loss equals plain Keras's within float rounding, before and after it.
    The report and a progress line say where the switch was.  evaluate and predict
    are tiered the same way."""
    x, y = _data(160)
    stock, cb = _model(), _BatchLosses()
    stock.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False, callbacks=[cb])
    m, tiered = stitching.keras.stitch(_model()), _WaitAt(3)
    m.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False, callbacks=[tiered])
    np.testing.assert_allclose(tiered.losses, cb.losses, rtol=1e-5)
    train = m._stitching_steps["train"]
    assert train.switch[0] == 4 and len(m.stitching_report.all["train"]) == 1
    assert "stock TF ran steps 1-3" in m.stitching_report.train.tiering
    assert "stitched from step 4" in m.stitching_report.summary()
    err = capsys.readouterr().err
    assert "train step: stock TF ran steps 1-3" in err
    # ... and said when the compile began, while stock Keras ran the steps
    assert "train step: planning and compiling its kernels in the background" in err
    # evaluate and predict: stock on their first call, stitched after the wait
    for run in (lambda model: model.evaluate(x, y, batch_size=32, verbose=0),
                lambda model: model.predict(x, batch_size=32, verbose=0)):
        _assert_close(run(m), run(stock), rtol=1e-5)
        assert stitching.keras.wait(m, timeout=300)
        _assert_close(run(m), run(stock), rtol=1e-5)
    for step in ("test", "predict"):
        assert m._stitching_steps[step].switch is not None, step
        assert len(m.stitching_report[step].kernels) >= 1, step


def test_the_stock_tier_is_let_go_at_the_switch(cold_results, tiered):
    """After the switch the stock tier never runs again, but its Keras function and
    the traces it held stayed for the model's life (EfficientNetB0 at 96x96: ~200 MiB
    of RSS after a switched fit).  The switch lets them go."""
    import gc
    import weakref
    x, y = _data(160)
    m, held = stitching.keras.stitch(_model()), []

    class Hold(_WaitAt):
        def on_train_batch_begin(self, batch, logs=None):
            if not held:
                held.append(weakref.ref(self.model._stitching_steps["train"]._stock_fn))
    m.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False, callbacks=[Hold(3)])
    train = m._stitching_steps["train"]
    assert train.switch[0] == 4 and train._stock_fn is None
    gc.collect()
    assert held and held[0]() is None
    m.fit(x, y, batch_size=32, epochs=1, verbose=0)      # and it keeps training
    assert train.stitched_steps == 7 + 5


def test_threads_at_a_models_first_use_start_one_background_compile(
        monkeypatch, capsys, cold_results, tiered):
    """Threads calling a stitched model at once (a server's predict) each started the
    step's background compile: 2-4 starts, and its progress line as many times.  One
    starts now, whatever the number of threads; the switch is said once too."""
    import threading
    import time
    real, started = stitching.keras.run_in_background, []

    def slow_start(*args):
        started.append(threading.get_ident())
        time.sleep(0.3)             # a start that takes a while: the others arrive
        return real(*args)
    monkeypatch.setattr(stitching.keras, "run_in_background", slow_start)
    x, _ = _data(24)
    stock = _model().predict(x, verbose=0)
    m = stitching.keras.stitch(_model())
    m.predict(x, verbose=0)         # Keras's trace: the step's inputs are known
    step = m._stitching_steps["predict"]
    threads = [threading.Thread(target=step._start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(started) == 1
    assert stitching.keras.wait(m, timeout=300)
    outs = []
    threads = [threading.Thread(target=lambda: outs.append(m.predict(x, verbose=0)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outs) == 4 and step.switch is not None and step.stitched_steps >= 1
    for out in outs:
        np.testing.assert_allclose(out, stock, rtol=1e-5, atol=1e-6)
    err = capsys.readouterr().err
    assert err.count("predict step: planning and compiling") == 1, err
    assert err.count("stitched from step") == 1, err


def test_a_step_with_seeded_random_ops_stays_stock_keras(capsys, cold_results, tiered):
    """A predict step drawing seeded random numbers (tf.nn.dropout with a seed): the
    stitched step's random ops would start again from the seed at the switch, so the
    step stays stock Keras, says why, and every batch's numbers are Keras's."""
    def make():
        keras.utils.set_random_seed(4)
        inp = keras.Input((16,))
        out = keras.layers.Lambda(lambda v: tf.nn.dropout(v, 0.5, seed=3) * 2.0)(inp)
        model = keras.Model(inp, out)
        model.compile(loss="mse")
        return model
    x = np.ones((4, 16), np.float32)
    runs = []
    for model in (make(), stitching.keras.stitch(make())):
        tf.random.set_seed(9)
        out = [model.predict(x, verbose=0)]
        if hasattr(model, "_stitching_steps"):
            assert stitching.keras.wait(model, timeout=300)
        out += [model.predict(x, verbose=0) for _ in range(3)]
        runs.append(np.array(out))
    np.testing.assert_array_equal(runs[1], runs[0])
    assert len({r.tobytes() for r in runs[0]}) == 4
    step = model._stitching_steps["predict"]
    assert step.stock_only and step.switch is None
    assert "holds seeded random ops (RandomUniform)" in capsys.readouterr().err


def test_a_job_whose_stock_steps_stay_under_the_tier_up_time_never_compiles(
        monkeypatch, cold_results, tiered):
    """The background compile starts once a step's stock calls (after Keras's trace)
    have run STITCHING_TIER_UP_SECONDS: a short fit of tiny steps never starts one
    (no compile, no kernels, stock numbers); 0 starts it after the first step; a
    value that is not a number of seconds is refused at stitch()."""
    x, y = _data(64)
    m = stitching.keras.stitch(_model())
    m.fit(x, y, batch_size=32, epochs=2, verbose=0)
    train = m._stitching_steps["train"]
    assert train._thread is None and train.switch is None and train.report is None
    monkeypatch.setattr(stitching.keras, "TIER_UP_SECONDS", 0.0)
    m = stitching.keras.stitch(_model())
    m.fit(x, y, batch_size=32, epochs=1, verbose=0)
    train = m._stitching_steps["train"]
    assert train._thread is not None
    assert stitching.keras.wait(m, timeout=300)
    if train.switch is None:     # ready before a step called it: the report says so
        steps = "step 1" if train.stock_steps == 1 else f"steps 1-{train.stock_steps}"
        assert m.stitching_report.train.tiering == (
            f"stock TF ran {steps}; the stitched step is ready and runs from the next step")
    monkeypatch.setenv("STITCHING_TIER_UP_SECONDS", "soon")
    with pytest.raises(ValueError, match="STITCHING_TIER_UP_SECONDS"):
        stitching.keras.stitch(_model())


def _named_model():
    """_model with every name fixed: traced again in this process, its steps are the
    same graphs (as a script's are, run again in a new process), and their kernels
    _model's."""
    keras.utils.set_random_seed(0)
    L = keras.layers
    m = keras.Sequential([keras.Input((16,)), L.Dense(32, activation="gelu", name="wd1"),
                          L.LayerNormalization(name="wln"),
                          L.Dense(4, dtype="float32", name="wd2")], name="warm_mlp")
    m.compile(optimizer=keras.optimizers.Adam(1e-2, name="warm_adam"), loss="mse",
              metrics=["mae"])
    return m


def test_a_warm_cache_runs_every_step_stitched_from_the_first(capsys, tiered):
    """Where the result cache holds a step's stitched graph (its plan and kernels
    built by an earlier run, here one that waited for them), the step runs stitched
    from step 1: no stock step, no background compile, Keras's losses; the report
    and a progress line say so."""
    x, y = _data(96)
    stock, cb = _named_model(), _BatchLosses()
    stock.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False, callbacks=[cb])
    first = stitching.keras.stitch(_named_model())
    first.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
    first.evaluate(x, y, batch_size=32, verbose=0)
    first.predict(x, batch_size=32, verbose=0)
    assert stitching.keras.wait(first, timeout=300)
    capsys.readouterr()
    m, warm = stitching.keras.stitch(_named_model()), _BatchLosses()
    m.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False, callbacks=[warm])
    np.testing.assert_allclose(warm.losses, cb.losses, rtol=1e-5)
    _assert_close(m.evaluate(x, y, batch_size=32, verbose=0),
                  stock.evaluate(x, y, batch_size=32, verbose=0), rtol=1e-5)
    _assert_close(m.predict(x, batch_size=32, verbose=0),
                  stock.predict(x, batch_size=32, verbose=0), rtol=1e-5)
    for kind, steps in (("train", 6), ("test", 3), ("predict", 3)):
        f = m._stitching_steps[kind]
        assert (f.stock_steps, f.stitched_steps, f.switch) == (0, steps, (1, 0.0)), kind
        assert f._thread is None and f.probe.cache_misses == 0, kind
        assert len(m.stitching_report[kind].kernels) >= 1, kind
        assert "stitched from step 1" in m.stitching_report[kind].tiering
    assert "train step: stitched from step 1" in capsys.readouterr().err
    # another model (other names, so other graphs): not probed, stock steps first
    other = stitching.keras.stitch(_model())
    other.fit(x, y, batch_size=32, epochs=1, verbose=0)
    f = other._stitching_steps["train"]
    assert (f.stock_steps, f.probe.cache_hits, f.probe.cache_misses) == (3, 0, 0)


def test_synchronous_when_asked():
    """Options(background_compile=False): no stock steps, the first step waits."""
    m = stitching.keras.stitch(_model(), SYNC)
    x, y = _data(32)
    m.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert m.stitching_report.train is not None and not m.stitching_report.train.tiering
    assert "train_function" not in type(m).__dict__ and \
        "make_train_function" not in vars(m)


def test_a_synchronously_stitched_model_saves_after_fit(tmp_path):
    """Regression: after a synchronous stitch and fit, tf.saved_model.save(model) failed
    with a KeyError (the stitched step, a tf.function among the model's attributes,
    was saved too, and its trace captures Keras's metric variables).  A compile that
    goes around the model's own (keras.Model.compile(m)) leaves stale steps: the next
    one says what to do."""
    m = stitching.keras.stitch(_model(), SYNC)
    x, y = _data(32)
    m.fit(x, y, batch_size=32, epochs=1, verbose=0)
    tf.saved_model.save(m, str(tmp_path / "sm"))
    assert (tmp_path / "sm" / "saved_model.pb").exists()
    keras.Model.compile(m, optimizer="sgd", loss="mae")
    with pytest.raises(RuntimeError, match=r"call stitch\(model\) again after it"):
        m.fit(x, y, batch_size=32, epochs=1, verbose=0)
    stitching.keras.stitch(m, SYNC)
    m.fit(x, y, batch_size=32, epochs=1, verbose=0)


@pytest.mark.parametrize("mode", ["sync", "tiered"])
def test_a_later_compile_stitches_the_new_steps(request, mode):
    """A second compile (a new optimizer and loss) rebuilds Keras's steps; the stitched
    ones held the old optimizer's variables: synchronous steps raised, tiered ones failed
    in TF ("a function referencing variables which have been deleted").  The model's
    compile now stitches the new steps: the losses are stock Keras's."""
    if mode == "tiered":
        request.getfixturevalue("tiered")
    x, y = _data(64)

    def run(stitched):
        m = _model()
        if stitched:
            stitching.keras.stitch(m, SYNC if mode == "sync" else None)
        first = m.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mae")
        if stitched:
            stitching.keras.wait(m)
        second = m.fit(x, y, batch_size=32, epochs=3, verbose=0, shuffle=False)
        if stitched:
            stitching.keras.wait(m)
            assert m.stitching_report.train is not None
        return first.history["loss"] + second.history["loss"], m

    want, _ = run(False)
    got, m = run(True)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    with pytest.raises(ValueError, match="a stitched model cannot run that way"):
        m.compile(optimizer="sgd", loss="mse", run_eagerly=True)


_SHORT_JOB = r"""
import sys, time
import numpy as np, keras, stitching.keras
keras.utils.set_random_seed(0)
m = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="gelu"),
                      keras.layers.LayerNormalization(), keras.layers.Dense(4)])
m.compile(optimizer="adam", loss="mse")
stitching.keras.stitch(m)
x = np.ones((64, 16), np.float32)
m.fit(x, x[:, :4], batch_size=32, epochs=1, verbose=0)
print("PENDING", not m._stitching_steps["train"]._ready, flush=True)
print("END", time.time(), flush=True)
"""


@pytest.mark.slow
def test_a_short_job_exits_without_waiting_for_its_kernels(tmp_path, tiered):
    """A job that ends while its train step still compiles exits promptly (the
    background compile is stopped at exit, its workers killed), with status 0."""
    import os
    import subprocess
    import sys
    import time
    env = dict(os.environ, STITCHING_CACHE_DIR=str(tmp_path / "cache"))
    p = subprocess.run([sys.executable, "-c", _SHORT_JOB], capture_output=True,
                       text=True, timeout=300, env=env)
    done = time.time()
    assert p.returncode == 0, p.stderr[-3000:]
    lines = dict(ln.split(" ", 1) for ln in p.stdout.splitlines() if " " in ln)
    # interpreter and TF teardown take ~0.5-1.5 s here; compiling the step, ~10 s
    assert done - float(lines["END"]) < 8.0, (lines, done)
