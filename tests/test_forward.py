"""Stitched kernels write outputs over dead inputs (tf/passes/forward.py, runtime/op.cc), as
TF's element-wise kernels do: which pairs are marked, that values TF still holds (a
variable's buffer, a value returned or read again) are never overwritten, that the
peak of TF's allocator drops, and that a bad attr from a graph is refused."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import stitching
from stitching.tf import pipeline
from stitching.tf.passes import forward

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stitched(fn, *specs):
    cf = tf.function(fn).get_concrete_function(*specs)
    return pipeline.stitch_graph_def(cf.graph.as_graph_def(), [t.name for t in cf.outputs])


def _forward_attrs(gd):
    return {n.name: list(n.attr[forward.ATTR].list.i) for n in gd.node
            if n.op == "StitchedKernel" and forward.ATTR in n.attr}


def test_elementwise_kernels_mark_same_shape_pairs_and_reductions_none():
    spec = tf.TensorSpec([64, 32], tf.float32)
    res = _stitched(lambda x, b: tf.exp(x * 2.0 + b) - x, spec,
                    tf.TensorSpec([32], tf.float32))
    assert list(_forward_attrs(res.graph_def).values()) == [[0, 0]]   # x -> out, not b
    res = _stitched(lambda x: tf.nn.softmax(x * 2.0), spec)                  # row kernel
    assert _forward_attrs(res.graph_def) == {}
    # one pass over columns: dy -> ReluGrad output, beside its BiasAddGrad
    res = _stitched(lambda g, y: _relu_bias_grad(g, y)[:2], spec, spec)
    assert list(_forward_attrs(res.graph_def).values()) == [[0, 0]]


def _relu_bias_grad(g, y):
    dx = tf.raw_ops.ReluGrad(gradients=g * 2.0, features=y)
    return dx, tf.raw_ops.BiasAddGrad(out_backprop=dx), tf.reduce_sum(dx)


def test_in_place_loop_nest_stores_through_the_input_pointer():
    """The CPU code has a second loop nest for the aliased case (schedule/inplace.py:
    through two pointers that alias, LLVM's overlap check keeps the loop scalar)."""
    from stitching.codegen import cpu
    spec = tf.TensorSpec([64, 32], tf.float32)
    res = _stitched(lambda x: tf.math.erf(x * 0.5 + 1.0) * x, spec)
    (k,) = res.kernels
    text = cpu.emit(k.schedule).text
    assert "h.same_address(ins[0], outs[0])" in text
    assert "p_i0[j] = " in text and "p_o0[j] = " in text
    res = _stitched(lambda x: tf.nn.softmax(x * 2.0), spec)
    assert "same_address" not in cpu.emit(res.kernels[0].schedule).text


@pytest.mark.parametrize("shape", [(64, 32), (8192, 16), (3, 5)])
def test_column_kernel_in_place_matches_tf(shape):
    """The ReluGrad + BiasAddGrad kernel of a Dense layer's backward writes dx over the
    incoming gradient (a MatMul's output, dead after it): split into row chunks at
    (8192, 16), whole at the others."""
    w = tf.constant(np.random.RandomState(2).randn(shape[1], shape[1]).astype(np.float32))

    def f(x, y):
        g = tf.matmul(x, w)
        dx, db, _ = _relu_bias_grad(g, y)
        return tf.matmul(dx, w), db
    rs = np.random.RandomState(3)
    x = tf.constant(rs.randn(*shape).astype(np.float32))
    y = tf.constant(rs.randn(*shape).astype(np.float32))
    st = stitching.function(f)
    # db sums 8192 rows: TF's float32 sum is off by up to ~200 ulp there, so db is
    # held to float64 (never less accurate than TF), the product through dx to TF
    g = (tf.matmul(x, w) * 2.0).numpy()
    db64 = np.where(y.numpy() > 0, g.astype(np.float64), 0.0).sum(0)
    ours_tf = tf.function(f)(x, y)
    tf_err = np.abs(ours_tf[1].numpy() - db64).max()
    for _ in range(2):
        out, db = st(x, y)
        np.testing.assert_allclose(out, ours_tf[0], rtol=1e-5, atol=1e-4)
        err = np.abs(db.numpy() - db64).max()
        assert err <= max(tf_err, 4 * np.spacing(np.float32(np.abs(db64).max()))), \
            (err, tf_err)


def _bn_backward_like(w):
    def f(x, y):
        g = tf.matmul(x, w)                       # dead after the kernel
        s = tf.reduce_sum(g * y, axis=0)          # first pass: the per-column sums
        dx = (g - s * (1.0 / 64)) * y             # second pass: stored, over g
        return tf.matmul(dx, w), s
    return f


@pytest.mark.parametrize("shape", [(64, 32), (8192, 16)])
def test_two_pass_column_kernel_writes_its_last_pass_output_in_place(shape):
    """A BatchNorm backward's shape (per-column sums, then the gradient from them) in
    one column kernel of two passes: the gradient, stored by the last pass only, is
    written over the incoming gradient (a MatMul's output, dead after it); whole at
    (64, 32), split into row chunks (a phase per pass) at (8192, 16).  The sums are
    stored per column: no pair."""
    from stitching.schedule.inplace import pairs
    w = tf.constant(np.random.RandomState(4).randn(shape[1], shape[1]).astype(np.float32))
    f = _bn_backward_like(w)
    spec = tf.TensorSpec(shape, tf.float32)
    res = _stitched(f, spec, spec)
    (k,) = res.kernels
    assert len(k.schedule.passes) == 2
    assert list(_forward_attrs(res.graph_def).values()) == [
        [i for p in pairs(k.spec, k.schedule) for i in p]] != [[]]
    rs = np.random.RandomState(5)
    x = tf.constant(rs.randn(*shape).astype(np.float32))
    y = tf.constant(rs.randn(*shape).astype(np.float32))
    want = tf.function(f)(x, y)
    st = stitching.function(f)
    g64 = x.numpy().astype(np.float64) @ w.numpy().astype(np.float64)
    s64 = (g64 * y.numpy()).sum(0)
    for _ in range(2):
        out, s = st(x, y)
        np.testing.assert_allclose(out, want[0], rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(s, s64, rtol=1e-4, atol=1e-3)


def test_forwarded_kernels_never_overwrite_values_still_in_use():
    v = tf.Variable(np.linspace(-1, 1, 256 * 64, dtype=np.float32).reshape(256, 64))
    w = tf.constant(np.random.RandomState(0).randn(64, 64).astype(np.float32))

    def f(x):
        r = v.read_value()
        a = tf.matmul(x, w)                      # dead after the kernel: forwarded
        y = tf.tanh(a * 0.5 + 1.0) * 3.0
        z = tf.exp(r * 0.1) + r                   # a variable's buffer: never forwarded
        kept = x * 2.0 + 1.0                      # x is returned too: never forwarded
        return y, z, kept, x, tf.reduce_sum(a)    # a is read again after the kernel
    x = tf.constant(np.random.RandomState(1).randn(256, 64).astype(np.float32))
    before = v.numpy().copy()
    want = [t.numpy() for t in tf.function(f)(x)]
    st = stitching.function(f)
    for _ in range(3):
        got = [t.numpy() for t in st(x)]
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-5)
    np.testing.assert_array_equal(v.numpy(), before)
    np.testing.assert_array_equal(x.numpy(), got[3])


_PEAK = textwrap.dedent("""
    import numpy as np, tensorflow as tf, stitching
    w = tf.constant(np.ones((512, 512), np.float32) / 512)
    w1 = tf.constant(np.ones((512, 1), np.float32))
    def f(x):
        a = tf.matmul(x, w)
        b = tf.tanh(a * 0.5 + 1.0) * 3.0 + a
        return tf.matmul(b, w1)
    x = tf.constant(np.ones((1024, 512), np.float32))
    for name, fn in (("tf", tf.function(f)), ("st", stitching.function(f))):
        fn(x)
        tf.config.experimental.reset_memory_stats("CPU:0")
        fn(x)
        print(name, tf.config.experimental.get_memory_info("CPU:0")["peak"])
""")


def test_forwarding_keeps_the_peak_below_tfs():
    # At the kernel, TF holds x, a and a temporary (a has two readers, so its Mul
    # cannot reuse it); the stitched kernel writes b over a: one [1024, 512] float32
    # (2 MiB) less.  Without forwarding both peaks are equal.
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _PEAK], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    peaks = dict(line.split() for line in p.stdout.splitlines() if line[:3] in ("tf ", "st "))
    assert int(peaks["st"]) <= int(peaks["tf"]) - 2**19, peaks


@pytest.mark.parametrize("pairs", [[0, 5], [7, 0], [0]])
def test_a_bad_forward_attr_is_refused_naming_it(pairs):
    res = _stitched(lambda x: tf.exp(x * 2.0) - x, tf.TensorSpec([8, 4], tf.float32))
    gd = res.graph_def
    node = next(n for n in gd.node if n.op == "StitchedKernel")
    node.attr[forward.ATTR].list.i[:] = pairs
    x = np.ones((8, 4), np.float32)
    fn = tf.compat.v1.wrap_function(
        lambda a: tf.compat.v1.import_graph_def(gd, {"x:0": a}, [res.fetches[0]
                                                                 if hasattr(res, "fetches")
                                                                 else "Identity:0"],
                                                name=""),
        [tf.TensorSpec([8, 4], tf.float32)])
    with pytest.raises(tf.errors.InvalidArgumentError, match="_stitching_forward"):
        fn(tf.constant(x))


def test_packed_outputs_only_take_buffers_their_own_segment_reads():
    """A packed kernel runs its segments' loops one after another, in units on several
    threads: an output written over an input of another segment (two chains of the
    same shape) would be read after it was overwritten.  Each pair stays in one pass."""
    import sys as _sys
    _sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_packed import sgd_spec
    from stitching.schedule import KernelKind, build_schedule
    from stitching.schedule.inplace import pairs
    spec = sgd_spec([(32,), (9216,), (32,)])          # chains 0 and 2: the same shape
    sched = build_schedule(spec)
    assert sched.kind == KernelKind.PACKED and len(sched.passes) == 3
    got = pairs(spec, sched)
    assert len(got) == 6
    for i, o in got:
        (p,) = [p for p in sched.passes if spec.outputs[o] in p.stores]
        assert i in p.loads, (i, o)
        # and no other pass reads it (Adam's m and v chains both read the gradient:
        # test_packed's Adam training run against TF is the whole-step check)
        assert not any(i in q.loads for q in sched.passes if q is not p), (i, o)
