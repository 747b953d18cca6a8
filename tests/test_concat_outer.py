"""Concatenations and Pads on an outer (non-innermost) axis, fused (schedule/domain.py
Domain.clamped): a piece read over the whole concatenated axis takes its row index
clamped into its own range, and the piece selector drops what the clamped rows read.

Layout is exact: element-wise kernels equal NumPy/TF bit for bit; row reductions equal
a float64 reference within float32 rounding.  A NaN or Inf a piece holds, or that its
arithmetic makes, at a row the clamp reads in place of another piece's must not leak
into that piece's rows."""
import re

import numpy as np
import pytest

from stitching.compile import compile_kernel
from stitching.ir.builder import SpecBuilder
from stitching.schedule import KernelKind, build_schedule

RNG = np.random.default_rng(4343)
C = 16


def layer_norm(b, x):
    m = b.Mean(x, axes=[2], keep_dims=True)
    d = b.Sub(x, m)
    v = b.Mean(b.Mul(d, d), axes=[2], keep_dims=True)
    return b.Mul(d, b.Rsqrt(b.Add(v, b.const(1e-5))))


def layer_norm_ref(x):
    x = x.astype(np.float64)
    d = x - x.mean(-1, keepdims=True)
    return d / np.sqrt((d * d).mean(-1, keepdims=True) + 1e-5)


def assert_rounding_close(got, want):
    """float32 results within a few ulp of a float64 reference, NaN where it is NaN."""
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=3e-6, atol=3e-6)


def cls_token_spec(reduce: bool):
    """ViT's class token: concat([a[:, :1] * 2, sqrt(x)], axis=1) + pos, [?, 7, C],
    then a LayerNorm (reduce) or an element-wise tail (sqrt is correctly rounded:
    equal bits to NumPy's)."""
    b = SpecBuilder()
    a = b.input("float32", [-1, 4, C])
    x = b.input("float32", [-1, 6, C])
    pos = b.input("float32", [7, C])
    cls = b.Slice(a, begin=[0, 0, 0], size=[-1, 1, -1], strides=[1, 1, 1],
                  shape=[-1, 1, C])
    cat = b.Add(b.ConcatV2(b.Mul(cls, b.const(2.0)), b.Sqrt(x), axis=1), pos)
    return b.build([layer_norm(b, cat) if reduce else b.Mul(cat, b.const(3.0))])


def cls_token_inputs(batch):
    a = RNG.standard_normal((batch, 4, C)).astype(np.float32)
    x = RNG.uniform(0.5, 2.0, (batch, 6, C)).astype(np.float32)
    pos = RNG.standard_normal((7, C)).astype(np.float32)
    # row 0 of x is what the clamped row 0 of the concatenation reads (and drops):
    # a NaN, an Inf and a square root of a negative there belong to row 1 only
    x[:, 0, 0], x[:, 0, 1], x[:, 0, 2] = np.nan, np.inf, -1.0
    a[:, 1:, :] = np.nan                  # outside the slice: never read
    return a, x, pos


def cls_token_ref(a, x, pos):
    with np.errstate(invalid="ignore"):
        return np.concatenate([a[:, :1] * np.float32(2), np.sqrt(x)], 1) + pos


@pytest.mark.parametrize("reduce", [True, False], ids=["layernorm", "elementwise"])
def test_class_token_concat_on_the_token_axis_is_one_kernel(reduce):
    spec = cls_token_spec(reduce)
    sched = build_schedule(spec)
    assert sched.kind == (KernelKind.ROW if reduce else KernelKind.ELEMENTWISE)
    # the token axis stays an axis of its own (not merged with the batch), clamped
    assert [ax.size for ax in sched.domain.axes] == [-1, 7, C]
    assert list(sched.domain.clamped.values()) == [{1: (1, 6)}]   # x: rows 1-6 of 7
    k = compile_kernel(spec)
    for batch in (1, 3):              # one compiled kernel, every batch size
        a, x, pos = cls_token_inputs(batch)
        (got,) = k(a, x, pos)
        cat = cls_token_ref(a, x, pos)
        if reduce:
            assert_rounding_close(got, layer_norm_ref(cat))
            assert np.isfinite(got[:, 0]).all() and np.isnan(got[:, 1]).all()
        else:
            np.testing.assert_array_equal(got, cat * np.float32(3))
            assert np.isfinite(got[:, 0]).all()


def test_class_token_layernorm_with_split_rows():
    """The same LayerNorm with each row cut into pieces run in phases (split_rows=1,
    a column block shorter than the row): each piece's base is clamped too."""
    spec = cls_token_spec(True).with_schedule(split_rows=1, col_block=5, rows_per_task=1)
    k = compile_kernel(spec)
    assert k.schedule.split_rows
    a, x, pos = cls_token_inputs(2)
    (got,) = k(a, x, pos)
    assert_rounding_close(got, layer_norm_ref(cls_token_ref(a, x, pos)))
    assert np.isfinite(got[:, 0]).all() and np.isnan(got[:, 1]).all()


def test_concat_on_the_leading_axis():
    """axis 0 of a rank-3 value (static): two pieces, each read at clamped rows."""
    b = SpecBuilder()
    x = b.input("float32", [2, 5, C])
    y = b.input("float32", [3, 5, C])
    cat = b.ConcatV2(b.Neg(x), b.Sqrt(y), axis=0)
    specs = [b.build([layer_norm(b, cat)])]
    b2 = SpecBuilder()
    b2.inputs, b2.nodes = list(b.inputs), list(b.nodes[:cat + 1])
    specs.append(b2.build([b2.Add(cat, b2.const(1.0))]))
    X = RNG.standard_normal((2, 5, C)).astype(np.float32)
    Y = RNG.uniform(0.5, 2.0, (3, 5, C)).astype(np.float32)
    # read in place of the other piece: x[1] at rows 2-4, y[0] at rows 0-1
    X[1, :, 0] = np.nan
    Y[0, :, 1:3] = [np.inf, -1.0]
    with np.errstate(invalid="ignore"):
        ref = np.concatenate([-X, np.sqrt(Y)], 0)
    for spec, axes in zip(specs, ([5, 5, C], [5, 5 * C])):
        dom = build_schedule(spec).domain
        assert [ax.size for ax in dom.axes] == axes
        assert sorted(map(str, dom.clamped.values())) == ['{0: (0, 1)}', '{0: (2, 4)}']
    (got,) = compile_kernel(specs[0])(X, Y)
    assert_rounding_close(got, layer_norm_ref(ref))
    (got,) = compile_kernel(specs[1])(X, Y)
    np.testing.assert_array_equal(got, ref + np.float32(1))


def test_pad_on_an_outer_axis():
    """Pad on the token axis of [?, 6, C] (2 rows before, 1 after), unknown batch:
    element-wise and under a softmax; the padding rows read x's clamped rows."""
    b = SpecBuilder()
    x = b.input("float32", [-1, 6, C])
    p = b.Pad(b.Sqrt(x), paddings=[0, 0, 2, 1, 0, 0], value=0.5)
    ew = b.build([b.Mul(p, b.const(2.0))])
    m = b.Max(p, axes=[2], keep_dims=True)
    e = b.Exp(b.Sub(p, m))
    sm = b.build([b.Div(e, b.Sum(e, axes=[2], keep_dims=True))])
    assert build_schedule(ew).kind == KernelKind.ELEMENTWISE
    assert build_schedule(sm).kind == KernelKind.ROW
    k_ew, k_sm = compile_kernel(ew), compile_kernel(sm)
    for batch in (1, 2):
        X = RNG.uniform(0.1, 4.0, (batch, 6, C)).astype(np.float32)
        X[:, 0, :3] = [np.nan, np.inf, -1.0]        # read at rows 0-1 too: row 2 only
        X[:, 5, 4] = np.nan                         # read at row 8 too: row 7 only
        with np.errstate(invalid="ignore"):
            ref = np.pad(np.sqrt(X), [(0, 0), (2, 1), (0, 0)], constant_values=0.5)
        (got,) = k_ew(X)
        np.testing.assert_array_equal(got, ref * np.float32(2))
        (got,) = k_sm(X)
        r = ref.astype(np.float64)
        with np.errstate(invalid="ignore"):
            e = np.exp(r - r.max(-1, keepdims=True))
            want = e / e.sum(-1, keepdims=True)
        assert_rounding_close(got, want)
        for row in (0, 1, 8):           # the padding rows: a uniform softmax
            np.testing.assert_allclose(got[:, row], 1.0 / C, rtol=1e-6)


def test_softmax_over_long_rows_prefetches_clamped_rows():
    """Rows of 1024 under a softmax: the kernel prefetches the next row's inputs
    (cpu/emitter.py _prefetch_next_row), whose addresses are clamped too."""
    from stitching.codegen.cpu.emitter import emit
    n = 1024
    b = SpecBuilder()
    x = b.input("float32", [-1, 3, n])
    y = b.input("float32", [-1, 5, n])
    cat = b.ConcatV2(b.Mul(x, b.const(2.0)), y, axis=1)
    e = b.Exp(b.Sub(cat, b.Max(cat, axes=[2], keep_dims=True)))
    spec = b.build([b.Div(e, b.Sum(e, axes=[2], keep_dims=True))])
    text = emit(build_schedule(spec)).text
    # y's next-row base, its token index clamped to rows 3-7 of the concatenation
    assert re.search(r"pf_i\d+ = qn0 \* st_i\d+_0 \+ min\(max\(qn1, 3\), 7\)", text)
    X = RNG.standard_normal((2, 3, n)).astype(np.float32)
    Y = RNG.standard_normal((2, 5, n)).astype(np.float32)
    X[:, 2, 0], Y[:, 0, 0] = np.inf, np.nan     # read at the other piece's rows
    (got,) = compile_kernel(spec)(X, Y)
    c = np.concatenate([X * np.float32(2), Y], 1).astype(np.float64)
    with np.errstate(invalid="ignore"):
        e = np.exp(c - c.max(-1, keepdims=True))
        assert_rounding_close(got, e / e.sum(-1, keepdims=True))


@pytest.mark.parametrize("channels", [False, True], ids=["hw", "hwc"])
def test_pad_of_height_and_width(channels):
    """ResNet's pool1_pad: relu(x * s + t) padded by one pixel on H and W of NHWC, both
    outer axes clamped (and C, the innermost, guarded too: ``channels``)."""
    pc = [1, 2] if channels else [0, 0]
    b = SpecBuilder()
    x = b.input("float32", [-1, 5, 6, C])
    s = b.input("float32", [C])
    t = b.input("float32", [C])
    y = b.Pad(b.Relu(b.Add(b.Mul(x, s), t)), paddings=[0, 0, 1, 1, 2, 1, *pc], value=0.0)
    spec = b.build([b.Mul(y, b.const(2.0))])
    dom = build_schedule(spec).domain
    assert list(dom.clamped.values()) == [{1: (1, 5), 2: (2, 7)}]
    assert len(dom.inner_guard) == (3 if channels else 0)     # x, s and t, along C
    k = compile_kernel(spec)
    for batch in (1, 2):
        X = RNG.standard_normal((batch, 5, 6, C)).astype(np.float32)
        X[:, 0, 0, :2] = [np.nan, np.inf]           # the corner: read at clamped pixels
        X[:, 4, 5, 3] = -np.inf
        S = RNG.standard_normal(C).astype(np.float32)
        T = RNG.standard_normal(C).astype(np.float32)
        with np.errstate(invalid="ignore"):
            ref = np.pad(np.maximum(X * S + T, np.float32(0)),
                         [(0, 0), (1, 1), (2, 1), tuple(pc)]) * np.float32(2)
        (got,) = k(X, S, T)
        np.testing.assert_array_equal(got, ref)


def test_column_reduction_over_a_concatenated_outer_axis():
    """Sum over the concatenated axis (a column kernel): the clamp is in the
    per-row bases of its reduced rows too."""
    b = SpecBuilder()
    x = b.input("float32", [-1, 3, C])
    y = b.input("float32", [-1, 5, C])
    cat = b.ConcatV2(b.Exp(x), y, axis=1)
    spec = b.build([b.Sum(cat, axes=[1], keep_dims=False)])
    assert build_schedule(spec).kind == KernelKind.COLUMN
    X = RNG.standard_normal((2, 3, C)).astype(np.float32)
    Y = RNG.standard_normal((2, 5, C)).astype(np.float32)
    X[:, 2, 0], Y[:, 0, 1] = np.inf, np.nan     # read at the other piece's rows
    (got,) = compile_kernel(spec)(X, Y)
    want = np.concatenate([np.exp(X.astype(np.float64)), Y], 1).sum(1)
    assert_rounding_close(got, want)


# ---- through TF ------------------------------------------------------------------------

def test_tf_class_token_concat_and_layernorm_are_one_kernel():
    """tf.concat of a class token (a plain input, no BroadcastTo) and patch tokens on
    the token axis, + position embeddings, then a LayerNorm: one kernel, with an
    unknown batch; the element-wise form equals TF bit for bit.  A tf.pad on the token
    axis under the same LayerNorm: one kernel too."""
    import stitching
    tf = pytest.importorskip("tensorflow")
    pos = tf.constant(RNG.standard_normal((7, C)).astype(np.float32))

    def tokens(a, x):
        return tf.concat([a[:, :1] * 2.0, x], axis=1) + pos

    def ln(a, x):
        t = tokens(a, x)
        m, v = tf.nn.moments(t, axes=[2], keepdims=True)
        return (t - m) * tf.math.rsqrt(v + 1e-5)

    def padded(a, x):       # a Pad on the token axis under the same LayerNorm
        t = tf.pad(x * 2.0, [[0, 0], [1, 0], [0, 0]], constant_values=1.0) + pos
        m, v = tf.nn.moments(t, axes=[2], keepdims=True)
        return (t - m) * tf.math.rsqrt(v + 1e-5)

    sig = [tf.TensorSpec([None, 4, C], tf.float32), tf.TensorSpec([None, 6, C], tf.float32)]
    f_ew = stitching.function(lambda a, x: tokens(a, x) * 3.0, input_signature=sig)
    f_ln = stitching.function(ln, input_signature=sig)
    f_pad = stitching.function(padded, input_signature=sig)
    for batch in (1, 3):
        a = RNG.standard_normal((batch, 4, C)).astype(np.float32)
        x = RNG.standard_normal((batch, 6, C)).astype(np.float32)
        x[:, 0, :2] = [np.nan, np.inf]
        np.testing.assert_array_equal(f_ew(a, x).numpy(),
                                      tf.function(lambda a, x: tokens(a, x) * 3.0)(a, x))
        for f, fn in ((f_ln, ln), (f_pad, padded)):
            got, want = f(a, x).numpy(), tf.function(fn)(a, x).numpy()
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            assert np.isfinite(got[:, 0]).all()
    for f in (f_ew, f_ln, f_pad):
        assert f.report.coverage == 1.0, f.report.summary()
        assert len(f.report.kernels) == 1, f.report.summary()
    assert "ConcatV2" in [op for _, op in f_ln.report.kernels[0].ops]
    assert "PadV2" in [op for _, op in f_pad.report.kernels[0].ops]


@pytest.mark.parametrize("axis,indices", [
    (1, [4, 5, 0, 2, 4]),           # two runs on the token axis: x[4:6], x[0:5:2]
    (1, [5, 4, 3, 2, 1, 0]),        # one run backwards (a reverse)
    (1, 3),                         # a scalar index: the axis goes
    (2, [1, 0, 3, 2, 5, 4, 7, 6]),  # pairs swapped along the innermost axis
])
def test_gather_by_constant_indices_is_slices_concatenated(axis, indices):
    """GatherV2 by constant indices (tf/frontend.py, the composite Gather): one
    strided slice per arithmetic run of the indices, concatenated along the axis, in
    one kernel with its neighbours; a layout map, so the element-wise form equals TF
    bit for bit, NaN and Inf where they are gathered.  Unknown batch, one kernel."""
    import stitching
    tf = pytest.importorskip("tensorflow")

    def fn(x):
        return tf.gather(x * 2.0 - 1.0, indices, axis=axis) * 3.0

    sig = [tf.TensorSpec([None, 6, 8], tf.float32)]
    f = stitching.function(fn, input_signature=sig)
    for batch in (1, 3):
        x = RNG.standard_normal((batch, 6, 8)).astype(np.float32)
        x[:, 0, :3] = [np.nan, np.inf, -np.inf]
        np.testing.assert_array_equal(f(x).numpy(), tf.function(fn)(x).numpy())
    assert len(f.report.kernels) == 1 and f.report.coverage == 1.0, f.report.summary()
    assert "GatherV2" in [op for _, op in f.report.kernels[0].ops]


def test_gathers_that_stay_tf_say_why():
    import stitching
    tf = pytest.importorskip("tensorflow")
    x = RNG.standard_normal((2, 12, 4)).astype(np.float32)
    idx = np.array([3, 1], np.int32)
    cases = {
        # ten runs of one (an index repeated: step 0 ends a run), over the limit of 8
        "arithmetic runs": lambda a, i: tf.gather(a * 2.0, [4] * 10, axis=1) + 1.0,
        "run-time indices": lambda a, i: tf.gather(a * 2.0, i, axis=1) + 1.0,
    }
    for reason, fn in cases.items():
        f = stitching.function(fn)
        np.testing.assert_array_equal(f(x, idx).numpy(), fn(x, idx).numpy())
        assert [w for _, op, w in f.report.unfused if op == "GatherV2" and reason in w], \
            f.report.summary()
