"""stitching.function as a drop-in for tf.function (issue 38): its interface, argument
names, outputs, captures, nested gradients, retracing, relaxed-shape broadcasting."""
import gc
import inspect
import logging
import subprocess
import sys
import weakref

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import stitching  # noqa: E402


def test_signature_is_tf_functions_plus_options():
    tf_params = list(inspect.signature(tf.function).parameters)
    ours = list(inspect.signature(stitching.function).parameters)
    assert ours == tf_params + ["options"]
    f = stitching.function(func=lambda x: x * 2.0, experimental_implements="name",
                           experimental_autograph_options=(),
                           experimental_attributes={"_noinline": True})
    assert float(f(tf.constant(2.0))) == 4.0


def test_is_a_tf_function_with_the_users_parameter_names():
    @stitching.function
    def scale(x, factor=2.0, *, shift=1.0):
        return tf.nn.softmax(x) * factor + shift

    assert isinstance(scale, tf.types.experimental.PolymorphicFunction)
    assert scale.python_function.__name__ == "scale"
    assert list(scale.function_spec.fullargspec.args) == ["x", "factor"]
    x = tf.random.normal([3, 5])
    want = tf.nn.softmax(x) * 3.0 + 1.0
    np.testing.assert_allclose(scale(x, 3.0), want, rtol=1e-6)
    np.testing.assert_allclose(scale(x=x, factor=3.0), want, rtol=1e-6)
    cf = scale.get_concrete_function(x=tf.TensorSpec([None, 5]), shift=0.0)
    assert [t.op.name for t in cf.inputs] == ["x"]
    assert "scale" in cf.name.decode() and "_trace" not in cf.name.decode()
    assert "x (POSITIONAL_OR_KEYWORD)" in cf.pretty_printed_signature()
    np.testing.assert_allclose(cf(x=x), tf.nn.softmax(x) * 2.0, rtol=1e-6)
    assert scale.experimental_get_tracing_count() == 2
    assert len(scale._list_all_concrete_functions()) == 2


def test_outputs_that_are_none_or_hold_no_tensor():
    @stitching.function
    def f(x):
        return {"y": tf.exp(x) * 2.0, "none": None, "n": 3}

    out = f(tf.zeros([4]))
    assert out["none"] is None and int(out["n"]) == 3
    np.testing.assert_allclose(out["y"], 2.0)
    assert stitching.function(lambda x: None)(tf.zeros([2])) is None
    v = tf.Variable(1.0)

    @stitching.function
    def assign_only(x):
        v.assign_add(tf.reduce_sum(x))

    assert assign_only(tf.ones([3])) is None
    assert float(v) == 4.0


def test_modifying_an_input_list_is_tfs_error():
    @stitching.function
    def append(values):
        values.append(tf.constant(0.0))

    with pytest.raises(ValueError, match="should not modify"):
        append([tf.constant(1.0)])


def test_captures_are_tf_functions():
    y = tf.constant(1)

    @stitching.function
    def foo(x):
        return {"input": x, "capture": y}

    cf = foo.get_concrete_function(tf.TensorSpec([], tf.int32))
    assert len(cf.function_type.captures) == 1
    assert int(cf(tf.constant(2))["capture"]) == 1


def test_small_captured_constants_stay_inputs_of_the_stitched_graph():
    """TF captures an eager tensor of at most 128 elements as a Const node but feeds it
    as an argument at each call (stock Grappler never folds it): stitched, replacing
    the capture afterwards changes the result, as with tf.function."""
    from tensorflow.python.framework import tensor as tensor_lib
    x, y, z = tf.constant(1.0), tf.constant(2.0), tf.constant([3.0, 4.0])

    @stitching.function
    def fn():
        return (x + y) * z + 1.0

    cf = fn.get_concrete_function()
    np.testing.assert_array_equal(cf().numpy(), [10.0, 13.0])
    assert len(fn.report.kernels) == 1, fn.report.summary()
    value = tf.constant(4.0)
    cf.replace_capture_with_deferred_capture(
        cf.captured_inputs[1], lambda: value,
        spec=tensor_lib.TensorSpec(shape=(), dtype=tf.float32), placeholder=cf.inputs[1])
    np.testing.assert_array_equal(cf().numpy(), [16.0, 21.0])
    value = tf.constant(5.0)
    np.testing.assert_array_equal(cf().numpy(), [19.0, 25.0])


def test_nested_stitched_functions_differentiate():
    """A stitched function called by another: Grappler inlines it, its kernels keep
    their originals (looked up in the eager context) and iterated gradients import."""
    @stitching.function
    def inner(a, b):
        return a * tf.add(a, b)

    @stitching.function
    def outer(x):
        return inner(x, 1.0)

    x = tf.constant(5.0)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = outer(x)
    assert float(tape.gradient(y, x)) == 11.0

    def grad(f):
        def g(v):
            with tf.GradientTape() as t:
                t.watch(v)
                out = f(v)
            return t.gradient(out, v)
        return g

    f = stitching.function(lambda v: tf.cos(v))
    for _ in range(3):
        f = stitching.function(grad(f))
    assert abs(float(f(tf.constant(1.0))) - np.sin(1.0)) < 1e-6   # cos''' = sin


@pytest.mark.parametrize("seed", range(4))
def test_relaxed_dims_broadcast_as_tf_does(seed):
    """Two calls of one family relax the batch dim; later calls with a size-1 dim in
    either argument broadcast as TF broadcasts (the kernel's guard runs the original
    ops), equal to tf.function, never an error where TF runs."""
    rng = np.random.default_rng(seed)

    def fn(a, c):
        return tf.nn.softmax(a + c) * 2.0 - c

    f, ref = stitching.function(fn), tf.function(fn)
    for n in (8, 9):                               # relaxes dim 0 of both
        a, c = (rng.standard_normal((n, 16), np.float32) for _ in range(2))
        np.testing.assert_allclose(f(a, c), ref(a, c), rtol=1e-5, atol=1e-6)
    for _ in range(6):
        n = int(rng.integers(1, 12))
        sa, sc = [n, 16], [n, 16]
        which = rng.integers(0, 4)
        if which == 0:
            sa[0] = 1
        elif which == 1:
            sc[0] = 1
        elif which == 2:
            sc[1] = 1
        a = tf.constant(rng.standard_normal(sa).astype(np.float32))
        c = tf.constant(rng.standard_normal(sc).astype(np.float32))
        np.testing.assert_allclose(f(a, c), ref(a, c), rtol=1e-5, atol=1e-6,
                                   err_msg=f"{sa} + {sc}")


def test_a_concrete_function_called_with_another_rank_runs_like_tf():
    @stitching.function
    def fn(a, b):
        return a + b, a * b

    fn(tf.ones([]), tf.ones([]))
    cf = fn.get_concrete_function(tf.TensorSpec([None]), tf.TensorSpec([]))
    got = cf(tf.constant(1.0), tf.constant(2.0))
    assert [float(t) for t in got] == [3.0, 2.0]


def test_a_deleted_function_is_freed_without_the_garbage_collector():
    gc.disable()
    try:
        f = stitching.function(lambda x: tf.exp(x) + 1.0)
        f(tf.zeros([3]))
        ref = weakref.ref(f)
        del f
        assert ref() is None
    finally:
        gc.enable()


def test_tfs_retracing_warning_names_the_users_function(caplog):
    @stitching.function(reduce_retracing=False)
    def my_step(x):
        return x * 2.0

    with caplog.at_level(logging.WARNING):
        for n in range(1, 8):
            my_step(tf.zeros([n]))
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "retracing" in text and "my_step" in text and "_trace" not in text


def test_creating_a_function_leaves_tf_runtime_configurable():
    code = """if True:
        import tensorflow as tf, stitching
        f = stitching.function(lambda x: x + 1.0)
        tf.config.threading.set_intra_op_parallelism_threads(1)
        cpus = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
        print(float(f(tf.constant(1.0))))
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("2.0"), out.stderr[-2000:]


def test_pickled_and_cloned_functions_keep_their_settings():
    import pickle
    f = stitching.function(abs, reduce_retracing=True,
                           options=stitching.Options(min_ops=1))
    g = pickle.loads(pickle.dumps(f))
    assert isinstance(g, stitching.StitchedFunction) and g._reduce_retracing is True
    assert g.options.min_ops == 1
    h = f._clone(python_function=None)
    assert isinstance(h, stitching.StitchedFunction) and h.options.min_ops == 1


def _kernel_specs(cf):
    return sorted(n.attr["spec"].s for n in cf.graph.as_graph_def().node
                  if n.op == "StitchedKernel")


def test_new_python_scalars_share_one_compiled_kernel():
    """f(x, 1.0), f(x, 2.0): TF traces each value as a constant; a float scalar that
    only feeds arithmetic is a kernel input, so every value has the same spec (one
    compile)."""
    @stitching.function
    def f(x, scale, shift):
        return tf.nn.softmax(x * scale) + shift

    x = tf.random.normal([16, 32])
    specs = []
    for scale, shift in ((1.0, 0.5), (2.0, -3.0), (0.25, 7.0)):
        got = f(x, scale, shift)
        np.testing.assert_allclose(got, tf.nn.softmax(x * scale) + shift, rtol=1e-5,
                                   atol=1e-6)
        specs.append(_kernel_specs(f.get_concrete_function(x, scale, shift)))
    assert specs[0] and specs[0] == specs[1] == specs[2]


def test_the_background_compile_hint_only_where_it_applies(monkeypatch, capsys, tiered):
    """Not for get_concrete_function (stitching-rewrite's way in) nor a call inside
    another tf.function (Keras's fit): tiering cannot serve those; nor a tiered call.
    An eager call through TF's call path (a keyword a ``**kwargs`` function binds)
    waited: it says which calls are tiered."""
    from stitching.tf import function as fn_module
    monkeypatch.setattr(fn_module, "HINT_SECONDS", 0.0)
    monkeypatch.setattr(fn_module, "_hinted", False)
    monkeypatch.delenv("STITCHING_NO_HINTS", raising=False)
    f = stitching.function(lambda x: tf.tanh(x) * 2.0 + 1.0)
    f.get_concrete_function(tf.TensorSpec([2, 3]))
    tf.function(lambda x: f(x) * 2.0)(tf.zeros([4, 3]))
    f(tf.zeros([5, 3]))
    assert f.wait(timeout=300)
    assert "run stock TF while" not in capsys.readouterr().err
    stitching.function(lambda **k: tf.tanh(k["x"]) * 2.0 + 1.0)(x=tf.zeros([6, 3]))
    assert "as named parameters, run stock TF while" in capsys.readouterr().err


@pytest.mark.parametrize("value, hinted", [("0", True), ("1", False)])
def test_no_hints_reads_its_value_as_the_other_switches_do(monkeypatch, capsys, value, hinted):
    """STITCHING_NO_HINTS=0 leaves the hints on, as STITCHING_STRICT=0 and
    STITCHING_NO_AUTOLOAD=0 leave theirs off."""
    from stitching.tf import function as fn_module
    monkeypatch.setattr(fn_module, "HINT_SECONDS", 0.0)
    monkeypatch.setattr(fn_module, "_hinted", False)
    monkeypatch.setenv("STITCHING_NO_HINTS", value)
    fn_module._hint_background_compile(1.0)
    assert ("as named parameters, run stock TF while" in capsys.readouterr().err) == hinted


def test_keras_stitch_tiers_with_background_compile():
    """Options(background_compile=True) under keras.stitch is its default: tiered
    (keras.py), not refused as it was when Keras's steps could only compile first."""
    keras = pytest.importorskip("keras")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    stitching.keras.stitch(model, stitching.Options(background_compile=True))
    assert {type(f).__name__ for f in model._stitching_steps.values()} == {"_Tiered"}


def test_reports_name_the_users_function():
    class Block(tf.Module):
        @stitching.function
        def __call__(self, x):
            return tf.nn.softmax(x) * 2.0

    import functools
    scaled = stitching.function(functools.partial(
        lambda x, s: tf.nn.softmax(x) * s, s=3.0))
    b = Block()
    b(tf.zeros([2, 4]))
    scaled(tf.zeros([2, 4]))
    assert b.__call__.report.function.endswith("Block.__call__")
    assert "partial" not in scaled.report.function


def _body_kernels(report):
    return {name: len(r.kernels) for name, r, why in report.bodies if r is not None
            and not why}


def test_a_loop_body_is_stitched_counted_and_differentiable():
    """AutoGraph's `for _ in tf.range(3)` over a softmax + axpy: the While body is
    planned like any function (its kernels in the report, per body), equal to TF, and
    a tape outside differentiates through the stitched loop.  (A loop of 3 steps is
    unrolled by default, tests/test_unroll.py: ``unroll_loops=0`` keeps it a loop.)"""
    def fn(x, w):
        for _ in tf.range(3):
            x = tf.nn.softmax(x * 2.0) * w + x
        return x

    f = stitching.function(fn, options=stitching.Options(unroll_loops=0))
    ref = tf.function(fn)
    rng = np.random.default_rng(3)
    x = tf.constant(rng.standard_normal((8, 32)).astype(np.float32))
    w = tf.constant(rng.standard_normal(32).astype(np.float32))
    np.testing.assert_allclose(f(x, w), ref(x, w), rtol=1e-5, atol=1e-5)
    bodies = _body_kernels(f.report)
    assert any(n.startswith("while_body") and k >= 1 for n, k in bodies.items()), \
        f.report.summary()
    assert "while_body" in f.report.summary()
    assert "control flow runs: fused " in f.report.summary()
    grads = []
    for g in (f, ref):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(g(x, w) ** 2)
        grads.append(tape.gradient(y, x))
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-4, atol=1e-4)


def test_cond_branches_are_stitched_and_reported_like_the_function():
    """Each branch is planned on its own; the summary gives each branch's kernels with
    their counted ops (Identity named apart, as at the top level) and the ops a branch
    leaves to TF with the reason."""
    def fn(x, p):
        return tf.cond(p > 0, lambda: tf.nn.softmax(x) * 2.0 + 1.0,
                       lambda: tf.math.cumsum(tf.tanh(x) - 1.0, axis=-1) * 2.0) * 3.0

    f = stitching.function(fn)
    x = tf.random.normal([4, 16])
    for p in (1.0, -1.0):
        np.testing.assert_allclose(f(x, tf.constant(p)), fn(x, tf.constant(p)),
                                   rtol=1e-5, atol=1e-5)
    bodies = _body_kernels(f.report)
    assert sum(1 for n in bodies if n.startswith("cond_")) == 2, f.report.summary()
    text = f.report.summary()
    assert "Cumsum (cond/Cumsum): Cumsum is not supported" in text, text
    for _, r, _ in f.report.bodies:
        listed = [ln for ln in text.splitlines() if ln.startswith("    stitching/")]
        assert not any("Identity]" in ln or "Identity," in ln for ln in listed), text
        assert r.fused_ops == sum(len(k.split_ops()[0]) for k in r.kernels)
        assert r.memory_intensive_ops == r.fused_ops + len(r.unfused)


def test_the_tf_function_suite_runner_compares_per_method():
    """tools/tf_function_suite.py: a method passes when every case that ran passed;
    the stock-passing ones are the denominator; known differences are reported apart
    (never skipped), and each names a test method of the suite."""
    import os
    import re
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    import tf_function_suite as suite
    stock = {"a::T.m1": [["m1", "pass", ""]], "a::T.m2": [["m2a", "pass", ""],
                                                          ["m2b", "skip", "gpu"]],
             "a::T.m3": [["m3", "fail", "x"]], "b::T.m4": [["m4", "pass", ""]]}
    stitched = {"a::T.m1": [["m1", "pass", ""]], "a::T.m2": [["m2a", "error",
                                                              "ValueError: no\n"]],
                "b::T.m4": [["m4", "fail", "AssertionError: differs"]]}
    suite.KNOWN["b::T.m4"] = "a reason"
    try:
        c = suite.compare(stock, stitched, ["a", "b"])
    finally:
        del suite.KNOWN["b::T.m4"]
    assert c["per_file"] == {"a": [2, 1, 0], "b": [1, 0, 1]}
    assert c["unexpected"] == [("a::T.m2", "ValueError: no")]
    assert c["known"] == [("b::T.m4", "a reason")]
    assert suite.ORDER_DEPENDENT <= set(suite.KNOWN)
    if os.path.isdir(suite.SUITE):
        for key in suite.KNOWN:
            f, method = key.split("::")
            text = open(os.path.join(suite.SUITE, f + ".py")).read()
            assert re.search(rf"def {method.split('.')[1]}\b", text), key


_LOAD = """if True:
    import sys, builtins, json
    if {block_numba}:
        real = builtins.__import__
        def guarded(name, *a, **k):
            if name == "numba" or name.startswith("numba."):
                raise ImportError("No module named 'numba' (blocked by the test)")
            return real(name, *a, **k)
        builtins.__import__ = guarded
    import numpy as np, stitching, tensorflow as tf
    m = tf.saved_model.load({path!r})
    x = tf.constant(np.load({x!r}))
    want = np.load({want!r})
    sig = m.signatures["serving_default"]
    out = {{"call": float(np.abs(m(x).numpy() - want).max()),
           "signature": float(np.abs(sig(x=x)["output_0"].numpy() - want).max()),
           "numba": "numba" in sys.modules,
           "fallbacks": stitching.runtime.stats()["fallbacks"]}}
    print(json.dumps(out))
"""


@pytest.mark.slow          # two fresh processes: ~20 s here
def test_a_saved_module_loads_in_a_fresh_process_without_compiling(tmp_path):
    """tf.saved_model.save of a tf.Module holding a StitchedFunction: its ConcreteFunction
    with the StitchedKernel nodes, the input's name, the kernels shipped in assets/.
    A fresh process with an empty kernel cache loads it without Numba (the shipped
    kernels); without the assets and without Numba, the original ops serve."""
    import json
    import shutil

    class Block(tf.Module):
        def __init__(self):
            self.w = tf.Variable(tf.linspace(0.5, 1.5, 64))

        @stitching.function(input_signature=[tf.TensorSpec([None, 64], tf.float32)])
        def __call__(self, x):
            return tf.nn.softmax(x * self.w) + 1.0

    m = Block()
    x = np.random.default_rng(5).standard_normal((4, 64)).astype(np.float32)
    want = m(x).numpy()
    np.testing.assert_allclose(want, tf.nn.softmax(x * m.w) + 1.0, rtol=1e-6, atol=1e-6)
    path = tmp_path / "block"
    tf.saved_model.save(m, str(path), signatures=m.__call__)
    assert (path / "assets" / "stitching_kernels.json").exists()
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "want.npy", want)

    def load(block_numba, cache):
        code = _LOAD.format(block_numba=block_numba, path=str(path),
                            x=str(tmp_path / "x.npy"), want=str(tmp_path / "want.npy"))
        env = dict(__import__("os").environ, STITCHING_CACHE_DIR=str(tmp_path / cache))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    shipped = load(False, "cache1")
    assert shipped["call"] < 1e-6 and shipped["signature"] < 1e-6
    assert not shipped["numba"] and shipped["fallbacks"] == 0
    shutil.rmtree(path / "assets")
    (path / "assets").mkdir()
    original = load(True, "cache2")
    assert original["call"] < 1e-6 and original["fallbacks"] >= 1


def test_keras_export_after_stitch_exports_the_stitched_serving_function(tmp_path):
    keras = pytest.importorskip("keras")
    inp = keras.Input((32,))
    h = keras.layers.LayerNormalization()(keras.layers.Dense(64)(inp))
    model = keras.Model(inp, keras.layers.Activation("gelu")(h))
    model.compile(optimizer="sgd", loss="mse")
    stitching.keras.stitch(model)
    model.export(str(tmp_path / "m"), verbose=False)
    x = np.random.default_rng(0).standard_normal((5, 32)).astype(np.float32)
    loaded = tf.saved_model.load(str(tmp_path / "m"))
    np.testing.assert_allclose(loaded.serve(x), model(x), rtol=1e-5, atol=1e-5)
    gd = loaded.signatures["serving_default"].graph.as_graph_def()
    assert "StitchedKernel" in {n.op for f in gd.library.function for n in f.node_def}
    assert (tmp_path / "m" / "assets" / "stitching_kernels.json").exists()


def test_a_cond_inside_a_loop_and_a_tape_inside_the_function():
    """Bodies calling other bodies are stitched each on its own (the calls renamed);
    a tape inside the function differentiates the loop (its gradient loop is traced
    too) and matches tf.function."""
    def nested(x):
        def body(i, v):
            v = tf.cond(tf.reduce_sum(v) > 0, lambda: tf.tanh(v) * 2.0,
                        lambda: tf.exp(v) - 1.0)
            return i + 1, v
        return tf.while_loop(lambda i, v: i < 3, body, [tf.constant(0), x])[1]

    def grad(x, w):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = x
            for _ in tf.range(2):
                y = tf.nn.softmax(y * 2.0) * w + y
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, x)

    x = tf.random.normal([8, 32])
    w = tf.random.normal([32])
    f = stitching.function(nested)
    np.testing.assert_allclose(f(x), tf.function(nested)(x), rtol=1e-5, atol=1e-6)
    assert not [why for _, r, why in f.report.bodies if r is None], f.report.summary()
    assert sum(1 for n in _body_kernels(f.report) if "cond_" in n) == 2, \
        f.report.summary()
    g = stitching.function(grad)
    want = tf.function(grad)(x, w)
    np.testing.assert_allclose(g(x, w), want, rtol=1e-5, atol=1e-5 * float(
        tf.reduce_max(tf.abs(want))))


def test_a_loop_body_that_reads_a_variable_is_stitched_with_the_variables_shape():
    """A loop body reads a captured variable through a resource argument, which a
    FunctionDef gives no shape: Grappler refused the body ("Failed to import
    metagraph") and the body was kept as traced.  The variable's shape now comes from
    the graph that passes it in, so every op of the body fuses; the gradient to the
    variable and a later assign hold.  (``unroll_loops=0``: kept a loop, as above.)"""
    rng = np.random.default_rng(11)
    w = tf.Variable(rng.standard_normal(32).astype(np.float32))

    def fn(x):
        def body(i, v):
            return i + 1, tf.tanh(v * w + 0.1) * tf.sigmoid(v)
        return tf.while_loop(lambda i, v: i < 4, body, [tf.constant(0), x])[1]

    f = stitching.function(fn, options=stitching.Options(unroll_loops=0))
    ref = tf.function(fn)
    x = tf.constant(rng.standard_normal((8, 32)).astype(np.float32))
    np.testing.assert_allclose(f(x), ref(x), rtol=1e-5, atol=1e-6)
    (body,) = [(r, why) for n, r, why in f.report.bodies if n.startswith("while_body")]
    assert body[1] == "" and body[0].unfused == [], f.report.summary()
    assert any({"Tanh", "Sigmoid", "Mul"} <= {t for _, t in k.split_ops()[0]}
               for k in body[0].kernels), f.report.summary()
    grads = []
    for g in (f, ref):
        with tf.GradientTape() as tape:
            y = tf.reduce_sum(g(x) ** 2)
        grads.append(tape.gradient(y, w))
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5, atol=1e-5)
    w.assign(w * 2.0)
    np.testing.assert_allclose(f(x), ref(x), rtol=1e-5, atol=1e-6)


def test_a_keras_lstm_training_step_stitches_its_loop_bodies_and_their_gradients():
    """A Keras LSTM runs its cell in a while loop that reads the weights (above); its
    gradient loop's body, made from a FunctionDef, names inputs ``node:0``, which
    made Grappler's constant folding write a control input its next optimizer
    rejected, and sums TensorLists with an AddN, which was expanded into AddV2 of
    variants: both bodies were kept as traced with an error as the report's reason.
    Then the gradient bodies stitched but fused next to nothing: they pop the forward
    values from accumulators with an unknown element shape, so the cell's gradient
    math had unknown rank.  The accumulators' shapes now come from the lists the
    graph made (control_flow.body_list_shapes); test_a_while_loops_gradient_body_
    fuses_the_values_it_pops checks the fusion at a planned size."""
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(5)
    inp = keras.Input((6, 4))
    seq = keras.layers.LSTM(8, return_sequences=True)(inp)     # TensorList writes
    model = keras.Model(inp, keras.layers.Dense(2)(keras.layers.GRU(8)(seq)))

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        return loss, tape.gradient(loss, model.trainable_variables)

    rng = np.random.default_rng(2)
    x = tf.constant(rng.standard_normal((3, 6, 4)).astype(np.float32))
    y = tf.constant(rng.standard_normal((3, 2)).astype(np.float32))
    f = stitching.function(step)
    (loss, grads), (want_loss, want) = f(x, y), tf.function(step)(x, y)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
    errors = [(n, why) for n, r, why in f.report.bodies if r is None]
    assert errors == [], errors
    # the forward loops' accumulators feed the gradient loops: neither is unrolled
    # (tf/passes/unroll.py), and the report says why
    loops = [n for n in f.report.notes if n.startswith("loop ")]
    assert loops and not [n for n in loops if "unrolled" in n], loops
    assert any("another loop or call reads its results" in n for n in loops), loops
    forward = [r for n, r, _ in f.report.bodies if "while_body" in n and "_grad" not in n]
    assert forward and all(r.kernels and not r.unfused for r in forward), \
        f.report.summary()
    backward = [r for n, r, _ in f.report.bodies if "while_body" in n and "_grad" in n]
    assert len(backward) == 2, f.report.summary()
    for r in backward:   # at these sizes the cost model may leave them; never for rank
        assert r.unfused and not [why for _, _, why in r.unfused if "unknown rank" in why], \
            r.summary()


def test_a_while_loops_gradient_body_fuses_the_values_it_pops():
    """A tape inside the function differentiates a while loop: the gradient loop pops
    each step's forward values from accumulators (TensorLists) whose element shape a
    FunctionDef does not carry, so all its math had unknown rank and stayed TF's.  The
    shapes come from the lists the graph made: the gradient body's element-wise math
    fuses, and the gradients equal tf.function's (also under a relaxed batch dim)."""
    rng = np.random.default_rng(4)
    w = tf.Variable(rng.standard_normal((64, 64)).astype(np.float32) * 0.1)

    def step(xs):
        with tf.GradientTape() as tape:
            def body(i, h):
                z = tf.matmul(h, w) + xs[i]
                return i + 1, tf.tanh(z) * tf.sigmoid(h) + 0.5 * h
            _, h = tf.while_loop(lambda i, h: i < 6, body,
                                 [tf.constant(0), tf.zeros_like(xs[0])])
            loss = tf.reduce_sum(h * h)
        return loss, tape.gradient(loss, w)

    f, ref = stitching.function(step), tf.function(step)
    for batch in (256, 192, 128):       # the third call runs the relaxed trace
        xs = tf.constant(rng.standard_normal((6, batch, 64)).astype(np.float32))
        (loss, g), (want_loss, want) = f(xs), ref(xs)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4)
    (grad,) = [r for n, r, _ in f.report.bodies if "while_body" in n and "_grad" in n]
    assert grad is not None and not [w for _, _, w in grad.unfused if "unknown rank" in w], \
        f.report.summary()
    fused = {t for k in grad.kernels for _, t in k.split_ops()[0]}
    assert {"TanhGrad", "SigmoidGrad", "Mul"} <= fused, grad.summary()


def test_trace_time_errors_name_the_users_function_and_warn_nothing_more():
    """TF's trace-time errors name the function traced: the user's, not stitching's
    inner closure; a Python float too large for a float16 tensor it meets is TF's
    inf, without a NumPy overflow warning from stitching on top."""
    import warnings

    @stitching.function
    def user_fn(x):
        return tf.no_op()
    with pytest.raises(TypeError, match=r"in compilation of <function \S*user_fn at"):
        user_fn(tf.ones([2]))

    f = stitching.function(lambda x, s: x * s)
    x = tf.ones([3], tf.float16)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = f(x, 70000.0)                 # TF's own cast may warn, as under tf.function
        want = tf.function(lambda x, s: x * s)(x, 70000.0)
    ours = [w for w in seen if "/stitching/" in w.filename.replace("\\", "/")]
    assert ours == [], [str(w.message) for w in ours]
    np.testing.assert_array_equal(got, want)


def test_integers_that_only_feed_shapes_stay_tf_ops_for_shape_inference():
    """TF's testShapeInferencePropagateConst*: ``concat([[d1], [d2], [d3]])`` as a
    Fill's dims, fused into a kernel, hid its values from TF's shape inference, so
    ``f(1, 2, 3)`` inside another function had the shape [None, None, None]."""
    @stitching.function(input_signature=[tf.TensorSpec((), tf.int32)] * 3)
    def f(d1, d2, d3):
        return tf.ones(tf.concat([[d1], [d2], [d3]], axis=-1), tf.int32)

    @stitching.function
    def g():
        y = f(1, 2, 3)
        assert y.shape.as_list() == [1, 2, 3], y.shape.as_list()
        return y

    np.testing.assert_array_equal(g(), np.ones([1, 2, 3]))
    assert not f.report.kernels


def test_a_function_rebuilt_from_its_function_def_alone_runs():
    """TF's test_generate_from_def with a plan that fuses: the FunctionDef of a
    stitched trace names its kernels' original functions by a string attr, not a func
    attr, so a ConcreteFunction rebuilt from it alone (no library) instantiates; the
    originals stay reachable for a call the kernel was not built for (the process's
    library, op.cc InstantiateOriginal)."""
    from tensorflow.python.eager.polymorphic_function import atomic_function
    from tensorflow.python.eager.polymorphic_function import concrete_function

    f = stitching.function(lambda x, c: tf.nn.softmax(x * 2.0) + c)
    spec = tf.TensorSpec([None, 8], tf.float32)
    original = f.get_concrete_function(spec, spec)
    fdef, function_type = original.function_def, original.function_type
    assert any(n.op == "StitchedKernel" for n in fdef.node_def)
    assert not [n.name for n in fdef.node_def for v in n.attr.values()
                if v.HasField("list") and v.list.func], "a func attr names a function"
    del f, original
    gc.collect()
    rebuilt = concrete_function.ConcreteFunction(
        atomic_function.from_function_def(fdef, function_type))
    x = np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)
    for c in (x, x[:1]):    # [1, 8]: a relaxed dim that broadcasts runs the originals
        np.testing.assert_allclose(rebuilt(tf.constant(x), tf.constant(c)),
                                   tf.nn.softmax(x * 2.0) + c, rtol=1e-6, atol=1e-6)


def test_a_variable_argument_is_not_kept_by_the_trace_as_tf_function_does():
    """Regression: the inner trace marked a tf.Variable *argument* as a variable the
    function reads, in the outer ConcreteFunction's ``variables`` (tf.function keeps
    only the variables it captures); a tape asks for those at every call, so once the
    first call's variable was deleted every later call under a tape failed."""
    w = tf.Variable(tf.fill([4], 0.5))                   # captured: kept, as TF does

    def fn(x):
        return tf.exp(x * w) + 1.0

    got, want = [], []
    for f, out in ((stitching.function(fn), got), (tf.function(fn), want)):
        for i in range(3):
            v = tf.Variable(tf.fill([2, 4], float(i)) + tf.range(4, dtype=tf.float32))
            with tf.GradientTape() as tape:
                y = f(v)
                loss = tf.reduce_sum(y)
            out.append((y.numpy(), tape.gradient(loss, v).numpy()))
            del v, tape
        (cf,) = f._list_all_concrete_functions()
        assert [x is w for x in cf.graph.variables] == [True]
    for (y, g), (y_ref, g_ref) in zip(got, want):
        np.testing.assert_allclose(y, y_ref, rtol=1e-6)
        np.testing.assert_allclose(g, g_ref, rtol=1e-6)


def test_a_stitched_function_called_inside_an_xla_function_is_traced_as_is():
    """Regression: inside a caller's tf.function(jit_compile=True) the stitched graph's
    StitchedKernel failed at run time ("unsupported operations ... XLA_CPU_JIT"); XLA
    compiles the ops itself, so they are traced there as they are."""
    body = stitching.function(lambda x: tf.nn.softmax(x * 2.0) + 1.0)
    outer = tf.function(lambda x: body(x) * 3.0, jit_compile=True)
    x = tf.constant(np.random.default_rng(4).standard_normal((4, 8)).astype(np.float32))
    want = (tf.nn.softmax(x * 2.0) + 1.0) * 3.0
    np.testing.assert_allclose(outer(x).numpy(), want.numpy(), rtol=1e-5)
    assert body.reports == []                  # traced, not stitched
    # a signature stitched by an eager call first: its trace is not reused under XLA
    y = tf.constant(np.random.default_rng(5).standard_normal((6, 8)).astype(np.float32))
    np.testing.assert_allclose(body(y).numpy(), (tf.nn.softmax(y * 2.0) + 1.0).numpy(),
                               rtol=1e-5)
    assert body.report.kernels
    np.testing.assert_allclose(outer(y).numpy(), (body(y) * 3.0).numpy(), rtol=1e-5)


def test_updates_in_a_cond_branch_that_returns_nothing_run_after_stitching():
    """A branch whose only effects are variable updates (Keras's LossScaleOptimizer
    applies gradients so; so does gradient accumulation applied every k steps): its
    stitched body keeps the updates as control outputs.  Without them TF's inlining of
    the lowered branch pruned them: the weights never moved, silently."""
    v = tf.Variable(tf.zeros([4]))
    n = tf.Variable(0, dtype=tf.int64)

    def step(x):
        def update():
            v.assign_add(x * 2.0 + 1.0)          # fused into a kernel in the branch
            n.assign_add(1)
        tf.cond(tf.reduce_all(tf.math.is_finite(x)), update, lambda: None)
        return tf.reduce_sum(x)

    for fn in (tf.function(step),
               stitching.function(step, options=stitching.Options(background_compile=False))):
        v.assign(tf.zeros([4]))
        n.assign(0)
        for _ in range(3):
            fn(tf.ones([4]))
        fn(tf.constant([1.0, np.nan, 0.0, 0.0]))  # the other branch: nothing changes
        np.testing.assert_array_equal(v.numpy(), [9.0] * 4)
        assert int(n.numpy()) == 3
    (then,) = [r for name, r, _ in fn.report.bodies if name.startswith("cond_true")]
    assert then.kernels, fn.report.summary()      # the branch was stitched
    (why,) = [w for name, _, w in fn.report.bodies if name.startswith("cond_false")]
    assert why.startswith("an empty function"), why   # not Grappler's import error


def test_nested_control_flow_runs_its_stitched_bodies():
    """A tf.cond inside a while body, and inside a tf.function the body calls: every
    function on the way down that calls a stitched body is itself renamed, so what the
    graph runs reaches the stitched bodies only (an edited caller kept its old name,
    and the runtime's original definition of that name ran the unstitched bodies)."""
    v = tf.Variable(tf.zeros([8]))

    @tf.function
    def inner(x):
        return tf.cond(tf.reduce_sum(x) > 0, lambda: tf.nn.relu(x * 2.0 + 1.0),
                       lambda: tf.tanh(x - 1.0) * 3.0)

    def fn(x):
        def body(i, y):
            y = tf.cond(tf.reduce_max(y) > 2.0, lambda: y * 0.5 - 0.1,
                        lambda: tf.sigmoid(y) * 3.0)
            return i + 1, inner(y) * 0.9
        _, y = tf.while_loop(lambda i, y: i < 4, body, [0, x])
        v.assign_add(tf.reduce_mean(y, 0))
        return y
    f = stitching.function(fn, options=stitching.Options(background_compile=False))
    ref = tf.function(fn)
    for shift in (1.0, -1.0):
        x = tf.constant(np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
                        + shift)
        np.testing.assert_allclose(f(x), ref(x), rtol=1e-5, atol=1e-5)
    stitched = [name for name, r, _ in f.report.bodies if r is not None and r.kernels]
    assert len(stitched) >= 4, f.report.summary()
    gd = f.get_concrete_function(x).graph.as_graph_def()
    library = {fn.signature.name: fn for fn in gd.library.function}
    reached, todo = set(), [n for n in gd.node]
    while todo:
        for attr in todo.pop().attr.values():
            for called in ([attr.func] if attr.HasField("func") else attr.list.func):
                if called.name in library and called.name not in reached:
                    reached.add(called.name)
                    todo.extend(library[called.name].node_def)
    assert not reached & set(stitched), sorted(reached & set(stitched))
    assert all(any(r.startswith(name + "_stitched_") for r in reached) for name in stitched)


def test_ops_placed_with_tf_device_fuse_as_unplaced_ones_do():
    """Under ``tf.device`` (and under every tf.distribute strategy) each op carries a
    device, and a region folding in a constant was refused: "Const: unknown
    attribute(s) ['_device']", 4 of 7 ops fused into 2 kernels (the distribute
    audit: 56-71% of a strategy's train step).  A folded constant's placement is
    not part of its value."""
    def body(x, b):
        h = tf.nn.relu((x * 2.0 + 1.0) + b) * 0.5
        return tf.reduce_sum(h * h, axis=-1)

    def placed(x, b):
        with tf.device("/cpu:0"):
            return body(x, b)
    sync = stitching.Options(background_compile=False)
    rng = np.random.default_rng(8)
    x = tf.constant(rng.standard_normal((64, 128)).astype(np.float32))
    b = tf.constant(rng.standard_normal((128,)).astype(np.float32))
    want = tf.function(body)(x, b).numpy()
    for fn in (body, placed):
        f = stitching.function(fn, options=sync)
        np.testing.assert_allclose(f(x, b).numpy(), want, rtol=1e-5)
        rep = f.report
        assert (rep.fused_ops, rep.memory_intensive_ops, len(rep.kernels)) == (7, 7, 1), \
            rep.summary()
