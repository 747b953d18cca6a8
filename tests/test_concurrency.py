"""Serving from many threads: one loaded SavedModel, one @stitching.function, and a
tf.data pipeline with parallel calls.  Correct results, and no deadlock: every thread
must finish within a generous bound (a hang fails the test instead of the run).

The first calls race on purpose: eight threads make the first call of a fresh
function at once (tracing, stitching, compiling and registering the kernel), which is
where locks meet (the compiler callback takes the GIL on a TF thread).
"""
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import stitching

THREADS = 8
TIMEOUT = 180


def _in_threads(work):
    """Run work(i) on THREADS daemon threads started together; re-raise the first
    failure; fail if any thread is still running after TIMEOUT seconds."""
    errors, start = [], threading.Barrier(THREADS)

    def run(i):
        try:
            start.wait()
            work(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "deadlock: threads still running"
    if errors:
        raise errors[0]


def _layernorm(x):
    m = tf.reduce_mean(x, -1, keepdims=True)
    v = tf.reduce_mean(tf.square(x - m), -1, keepdims=True)
    return tf.nn.gelu((x - m) * tf.math.rsqrt(v + 1e-5))


def _ref(x):
    return _layernorm(tf.constant(x, tf.float64)).numpy()


def _inputs(i, n=3):
    rng = np.random.default_rng(i)
    return [rng.standard_normal((1 + (i + k) % 5, 48)).astype(np.float32) for k in range(n)]


def test_one_stitched_function_from_eight_threads():
    f = stitching.function(_layernorm)

    def work(i):
        for x in _inputs(i):
            np.testing.assert_allclose(f(tf.constant(x)), _ref(x), rtol=2e-5, atol=2e-5)
    _in_threads(work)
    assert f.report.to_dict()["kernels"] == 1


def test_one_loaded_saved_model_from_eight_threads(tmp_path):
    class M(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 48], tf.float32, name="x")])
        def serve(self, x):
            return {"y": _layernorm(x)}

    m = M()
    tf.saved_model.save(m, str(tmp_path / "src"), signatures={"serving_default": m.serve})
    from stitching.saved_model import rewrite_saved_model
    reports = rewrite_saved_model(str(tmp_path / "src"), str(tmp_path / "dst"))
    assert reports["serving_default"].to_dict()["kernels"] == 1
    sig = tf.saved_model.load(str(tmp_path / "dst")).signatures["serving_default"]

    def work(i):
        for x in _inputs(i, 5):
            np.testing.assert_allclose(sig(x=tf.constant(x))["y"], _ref(x), rtol=2e-5,
                                       atol=2e-5)
    _in_threads(work)


def test_tf_data_parallel_map_runs_the_stitched_function():
    f = stitching.function(_layernorm,
                           input_signature=[tf.TensorSpec([None, 48], tf.float32)])
    xs = np.random.default_rng(7).standard_normal((64, 6, 48)).astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices(xs).map(
        f, num_parallel_calls=THREADS, deterministic=True)
    got = np.stack([y.numpy() for y in ds])
    np.testing.assert_allclose(got, _ref(xs.reshape(-1, 48)).reshape(xs.shape),
                               rtol=2e-5, atol=2e-5)
    assert f.report.to_dict()["kernels"] == 1     # the map ran the stitched graph


_FRESH = """
import sys, threading, numpy as np
sys.path.insert(0, {tests!r})
import stitching, tensorflow as tf
import test_concurrency as t
sig = tf.saved_model.load({path!r}).signatures["serving_default"]
def work(i):
    for x in t._inputs(i, 3):
        np.testing.assert_allclose(sig(x=tf.constant(x))["y"], t._ref(x), rtol=2e-5,
                                   atol=2e-5)
t._in_threads(work)
print("ok", "numba" in sys.modules)
"""


def test_eight_threads_make_the_first_calls_of_a_fresh_process(tmp_path):
    """A fresh process, an empty kernel cache, a model shipped without kernels: the
    eight first calls all miss, and the compile-on-miss callback runs from TF threads
    while the others wait on it."""
    import os
    import subprocess
    import sys

    class M(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 48], tf.float32, name="x")])
        def serve(self, x):
            return {"y": _layernorm(x) * 3.0}

    m = M()
    tf.saved_model.save(m, str(tmp_path / "src"), signatures={"serving_default": m.serve})
    from stitching.saved_model import rewrite_saved_model
    rewrite_saved_model(str(tmp_path / "src"), str(tmp_path / "dst"), embed_kernels=False)
    tests = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run(
        [sys.executable, "-c", _FRESH.format(tests=tests, path=str(tmp_path / "dst"))
         .replace("t._ref(x)", "3.0 * t._ref(x)")], capture_output=True, text=True,
        timeout=300, env=dict(os.environ, PYTHONPATH=os.path.dirname(tests),
                              STITCHING_CACHE_DIR=str(tmp_path / "cache"),
                              TF_CPP_MIN_LOG_LEVEL="3"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ok True" in r.stdout       # compiled here (Numba), not loaded from anywhere


@pytest.mark.parametrize("tiered", [True, False])
def test_threads_making_a_signatures_first_calls_at_once_make_one_entry(monkeypatch, tiered):
    """Eight threads calling a new signature at once each made its entry: tiered, a
    stock tier and a background compile apiece (the serving audit saw 7 compiles for
    4 signatures, and a switch delayed past 45 s); and each told TF's retracing
    warning of the one trace ("6 out of the last 6 calls ... triggered
    tf.function retracing").  The entry is made once, and only its maker tells."""
    from tensorflow.python.eager.polymorphic_function import polymorphic_function as tf_pf

    from stitching.tf import function as fmod
    made, told = [], []
    concrete_for = fmod.StitchedFunction._concrete_for

    def slow(self, key, args):          # every thread reaches it before one stores
        made.append(key)
        time.sleep(0.3)
        return concrete_for(self, key, args)
    monkeypatch.setattr(fmod.StitchedFunction, "_concrete_for", slow)
    detector = tf_pf._frequent_tracing_detector_manager

    class Counting:
        def called_with_tracing(self, *a):
            told.append(a)
            return detector.called_with_tracing(*a)

        def __getattr__(self, name):
            return getattr(detector, name)
    monkeypatch.setattr(tf_pf, "_frequent_tracing_detector_manager", Counting())
    f = stitching.function(_layernorm, options=stitching.Options(background_compile=tiered))
    x = np.random.default_rng(3).standard_normal((4, 48)).astype(np.float32)
    want = _ref(x)
    _in_threads(lambda i: np.testing.assert_allclose(f(tf.constant(x)).numpy(), want,
                                                     rtol=1e-5, atol=1e-5))
    assert len(made) == 1, len(made)
    assert f.wait(timeout=TIMEOUT)
    assert len(f.reports) == 1 and f.report.kernels
    if not tiered:
        assert len(told) == 1, len(told)        # the one thread that traced
    else:
        assert f.report.tiering                 # the tier found its trace's report


def test_batch_sizes_arriving_during_the_first_stock_call_share_one_stitched_trace(tiered):
    """A second batch size called while the first one's first stock call still runs
    compiles a relaxed trace; the first one's own compile, started after that call,
    traced its exact shape, and held TF's lock while the relaxed trace waited (the
    serving audit: batch sizes 1-3 stock for 56 s, 26 s for the first).  Started
    after another shape of its family, it compiles the relaxed trace too: one trace,
    one plan, every batch size switched when it is ready."""
    started = threading.Event()

    def fn(x):
        started.set()
        time.sleep(0.5)                  # the stock trace: long enough to overlap
        return _layernorm(x)
    f = stitching.function(fn)
    xs = {n: np.random.default_rng(n).standard_normal((n, 48)).astype(np.float32)
          for n in (8, 3)}
    out = {}

    def first(n):
        out[n] = f(tf.constant(xs[n])).numpy()
    a = threading.Thread(target=first, args=(8,))
    a.start()
    assert started.wait(TIMEOUT)
    first(3)                            # while batch 8's first stock call runs
    a.join(TIMEOUT)
    assert f.wait(timeout=TIMEOUT)
    for n in xs:
        np.testing.assert_allclose(out[n], _ref(xs[n]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(f(tf.constant(xs[n])).numpy(), _ref(xs[n]),
                                   rtol=1e-5, atol=1e-5)
    assert len(f.reports) == 1, [r.summary().splitlines()[0] for r in f.reports]
    tiers = list(f._concrete.values())
    assert len(tiers) == 2 and tiers[0] is tiers[1]     # both on the relaxed trace
