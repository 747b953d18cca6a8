"""Slices whose counts are known only at run time: a position table cut to a sequence length.

keras_hub's PositionEmbedding cuts its static ``[max_len, d]`` table to the input's
sequence length (``ops.slice(table, (0, 0), (ops.shape(x)[-2], d))``), and hand-written
models write ``table[:tf.shape(x)[1]]``.  The frontend turns both into a SliceTo that
reads x's dims; the kernel reads the table through a view whose extent is x's dim, and
its shape function checks that extent fits the table (TF's Slice fails the same way).
Layout ops are exact, so every result here must equal TF's bit for bit.
"""
import re

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
import stitching  # noqa: E402
from stitching.testing import accuracy  # noqa: E402
from keras import ops  # noqa: E402

OPTS = stitching.Options(min_ops=1)
RNG = np.random.default_rng(7)
SIG = [tf.TensorSpec([None, None, 8], tf.float32)]


def _table(max_len=16):
    t = RNG.standard_normal((max_len, 8)).astype(np.float32)
    t[1, :3] = [np.nan, np.inf, -np.inf]
    t[2, 0] = -0.0
    return tf.Variable(t)


def _x(batch, seq):
    x = RNG.standard_normal((batch, seq, 8)).astype(np.float32)
    x.reshape(-1)[:4] = [np.nan, -np.inf, 0.0, -0.0][:x.size]
    return tf.constant(x)


def _kernel_ops(sf):
    return [[t for _, t in k.ops if t != "Identity"] for k in sf.report.kernels]


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def _run(fn, sizes, sig=SIG):
    """fn stitched and stock on inputs of each (batch, seq) in ``sizes``: equal bits."""
    sf = stitching.function(fn, input_signature=sig, options=OPTS)
    ref = tf.function(fn, input_signature=sig)
    for batch, seq in sizes:
        x = _x(batch, seq)
        _same_bits(sf(x), ref(x))
    return sf


def _keras_slice(table):
    def fn(x):
        p = ops.slice(table, (0, 0), (ops.shape(x)[-2], 8))
        return x + p
    return fn


def _strided(table):
    return lambda x: x + table[:tf.shape(x)[1]]


@pytest.mark.parametrize("make", [_keras_slice, _strided], ids=["Slice", "StridedSlice"])
def test_position_table_cut_to_the_sequence_is_one_kernel(make):
    """One kernel, compiled once for every batch and sequence length (the symbols,
    not the values, are compiled); bits equal to TF's, NaN, Inf and -0 included."""
    sf = _run(make(_table()), [(1, 5), (3, 5), (3, 16), (2, 1), (2, 0)])
    assert len(sf.report.kernels) == 1, sf.report.summary()
    (ops_,) = _kernel_ops(sf)
    assert "AddV2" in ops_ and ("Slice" in ops_ or "StridedSlice" in ops_)
    assert len(sf.reports) == 1         # one trace, one compiled kernel, every size


@pytest.mark.parametrize("make", [_keras_slice, _strided], ids=["Slice", "StridedSlice"])
def test_a_sequence_longer_than_the_table_fails_as_tf_does(make):
    """Past the table's 16 rows TF fails (Slice: its size check; StridedSlice: the
    clamped 16 rows do not broadcast against 17).  The kernel's shape function refuses
    the call before any load, and the op runs the region's original ops (op.cc Guard),
    which raise TF's own error."""
    fn = make(_table())
    sf = stitching.function(fn, input_signature=SIG, options=OPTS)
    sf(_x(2, 4))
    assert len(sf.report.kernels) == 1, sf.report.summary()
    with pytest.raises(tf.errors.InvalidArgumentError) as theirs:
        tf.function(fn, input_signature=SIG)(_x(2, 17))
    error = re.search(r"Expected size\[0\] in \[0, 16\], but got 17|Incompatible shapes",
                      str(theirs.value)).group(0)
    with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(error)):
        sf(_x(2, 17))


def test_keras_position_embedding_broadcast_to_the_input_is_one_kernel():
    """keras_hub's PositionEmbedding: the cut table broadcast to ops.shape(x)."""
    table = _table()

    def fn(x):
        p = ops.slice(table, (0, 0), (ops.shape(x)[-2], 8))
        return x + ops.broadcast_to(p, ops.shape(x))

    sf = _run(fn, [(1, 5), (3, 9)])
    assert len(sf.report.kernels) == 1, sf.report.summary()


def test_position_embedding_and_layer_norm_are_one_row_kernel():
    """The table cut to the sequence, broadcast, added and normalized: one row kernel
    (the dims the broadcast reads from x are never loaded)."""
    table = tf.Variable(RNG.standard_normal((64, 32)).astype(np.float32))
    norm = keras.layers.LayerNormalization(epsilon=1e-5)
    norm.build((None, None, 32))

    def fn(x):
        p = ops.slice(table, (0, 0), (ops.shape(x)[-2], 32))
        return norm(x + ops.broadcast_to(p, ops.shape(x)))

    sig = [tf.TensorSpec([None, None, 32], tf.float32)]
    sf = stitching.function(fn, input_signature=sig, options=OPTS)
    for batch, seq in ((2, 5), (3, 64), (1, 1)):
        x = tf.constant(RNG.standard_normal((batch, seq, 32)).astype(np.float32))
        np.testing.assert_allclose(sf(x).numpy(), fn(x).numpy(), rtol=1e-5, atol=1e-5)
    assert len(sf.report.kernels) == 1 and not sf.report.unfused, sf.report.summary()
    assert "row kernel" in sf.report.kernels[0].schedule


def test_a_table_cut_to_another_tensors_length():
    """Slice: the kernel reads x's length and checks y's against it (equal, or the op
    runs its original ops: y's length 1 broadcasts in TF).  StridedSlice: y's length is
    not proven to be x's, so a clamped table might broadcast: it stays TF's."""
    table = _table()
    sig = SIG * 2

    def sliced(x, y):
        return y + tf.slice(table, [0, 0], tf.stack([tf.shape(x)[1], 8]))

    def strided(x, y):
        return y + table[:tf.shape(x)[1]]

    sf = stitching.function(sliced, input_signature=sig, options=OPTS)
    for ys in (5, 1):
        x, y = _x(2, 5), _x(2, ys)
        _same_bits(sf(x, y), sliced(x, y))
    assert len(sf.report.kernels) == 1, sf.report.summary()
    sf = stitching.function(strided, input_signature=sig, options=OPTS)
    x, y = _x(2, 5), _x(2, 5)
    _same_bits(sf(x, y), strided(x, y))
    assert "combines it with a tensor not proven to" in sf.report.summary()


def test_slice_begin_is_checked_with_the_count():
    """table[3:3 + seq]: the kernel allows at most 13 rows."""
    table = _table()

    def fn(x):
        return x - tf.slice(table, tf.stack([3, 0]), tf.stack([tf.shape(x)[1], 8]))

    sf = _run(fn, [(2, 13), (1, 4)])
    assert len(sf.report.kernels) == 1, sf.report.summary()
    with pytest.raises(tf.errors.InvalidArgumentError, match="Expected size"):
        sf(_x(1, 14))


def test_strided_slice_read_by_another_op_stays_tf_with_the_reason():
    """TF clamps ``table[:seq]`` to the table: where nothing fails on a clamped count
    (here the slice is reduced, not combined with x), fusing would change the answer."""
    table = _table(4)

    def fn(x):
        return x + tf.reduce_max(table[:tf.shape(x)[1]], 0)

    sf = _run(fn, [(2, 3), (2, 6)])
    assert "TF clamps an end past the dim" in sf.report.summary()


def test_slice_counts_from_two_tensors_stay_tf_with_the_reason():
    table = tf.Variable(RNG.standard_normal((6, 5)).astype(np.float32))
    sig = [tf.TensorSpec([None, None], tf.float32), tf.TensorSpec([None, None], tf.float32)]

    def fn(a, b):
        s = tf.slice(table, [0, 0], tf.stack([tf.shape(a)[0], tf.shape(b)[1]]))
        return s * 2.0 + 1.0

    sf = stitching.function(fn, input_signature=sig, options=OPTS)
    a, b = tf.zeros([3, 2]), tf.zeros([2, 4])
    _same_bits(sf(a, b), fn(a, b))
    assert "run-time counts come from two tensors" in sf.report.summary()


# ---- the kernel itself: its shape function checks the count ------------------------------

def _position_spec(max_len=16, begin=0):
    """x + table[begin:begin + x.shape[1]] as the frontend's SliceTo expands it."""
    from stitching.ir.builder import SpecBuilder
    from stitching.ir.ops import RUN_TIME_COUNT
    b = SpecBuilder()
    x = b.input("float32", [-1, -1, 8])
    t = b.input("float32", [max_len, 8])
    v = b.Slice(t, begin=[begin, 0], size=[RUN_TIME_COUNT, 8], strides=[1, 1], shape=[-1, 8])
    seq = b.Slice(x, begin=[0, 0, 0], size=[1, -1, 1], strides=[1, 1, 1], shape=[-1, 1])
    ones = b.FillLike(seq, value=1.0, dtype="float32")
    return b.build([b.Add(x, b.Mul(v, ones))])


def test_the_kernel_checks_the_count_before_any_load():
    from stitching.compile import compile_kernel
    from stitching.schedule import build_schedule
    spec = _position_spec(begin=3)
    (bound,) = build_schedule(spec).domain.bounds
    assert bound[1] == 13                        # rows 3..15 of 16
    k = compile_kernel(spec)
    table = RNG.standard_normal((16, 8)).astype(np.float32)
    for batch, seq in ((1, 13), (3, 5), (2, 0)):     # one compiled kernel, every size
        x = _x(batch, seq).numpy()
        (y,) = k(x, table)
        _same_bits(y, x + table[3:3 + seq] * np.float32(1))
    with pytest.raises(ValueError, match="more elements than the 13"):
        k(_x(1, 14).numpy(), table)


def test_a_run_time_count_of_a_dim_of_one_or_unknown_is_a_spec_error():
    from stitching.ir.builder import SpecBuilder
    from stitching.ir.ops import RUN_TIME_COUNT
    from stitching.ir.spec import SpecError
    for shape in ([1, 8], [-1, 8]):
        b = SpecBuilder()
        t = b.input("float32", shape)
        with pytest.raises((SpecError, ValueError), match="run-time count needs a static"):
            b.Slice(t, begin=[0, 0], size=[RUN_TIME_COUNT, 8], strides=[1, 1],
                    shape=[-1, 8])


# ---- one element of a dim known only at run time: x[:, -1] --------------------------------

LAST = {
    "last": lambda x: x[:, -1] * 2.0,
    "first": lambda x: x[:, 0] * 2.0,
    "third_from_end_of_a_slice": lambda x: x[:, -3, 2:6] * 2.0,
    "last_and_first": lambda x: x[:, -1] - x[:, 0],
    "last_beside_every_token": lambda x: x - x[:, -1][:, None, :],
}


@pytest.mark.parametrize("name", sorted(LAST))
def test_one_token_at_an_unknown_sequence_length_is_fused(name):
    """GPT's last-token logits: the view's offset along the sequence ((n - 1) * 8) and
    its stride along the batch (n * 8) are kernel parameters the shape function
    computes; one kernel serves every batch and length, bits equal to TF's."""
    fn = LAST[name]
    sf = _run(fn, [(2, 5), (3, 16), (1, 3), (2, 4)])
    assert len(sf.report.kernels) == 1 and not sf.report.unfused, sf.report.summary()
    assert len(sf.reports) == 1


def test_softmax_of_the_last_token_is_one_row_kernel():
    sf = stitching.function(lambda x: tf.nn.softmax(x[:, -1] * 0.5), input_signature=SIG,
                            options=OPTS)
    for batch, seq in ((2, 5), (3, 1)):
        x = _x(batch, seq)
        got, want = sf(x).numpy(), tf.nn.softmax(x[:, -1] * 0.5).numpy()
        z = x.numpy()[:, -1].astype(np.float64) * 0.5
        with np.errstate(invalid="ignore"):
            e = np.exp(z - z.max(-1, keepdims=True))
            ref64 = e / e.sum(-1, keepdims=True)
        # A row with a NaN is NaN throughout (Eigen's Softmax and float64 agree; oneDNN's
        # leaves its other elements 0): as TF's or as the exact result, per element.
        assert accuracy.nonfinite_like(got, want, ref64, "float32"), (got, want)
        rows = np.isfinite(want).all(-1)
        np.testing.assert_allclose(got[rows], want[rows], rtol=2e-6, atol=1e-7)
    assert len(sf.report.kernels) == 1 and not sf.report.unfused, sf.report.summary()


def test_an_index_past_an_unknown_length_fails_as_tf_does():
    """x[:, -3] of a sequence of 2: TF's error (the kernel's check fails first, and
    the op runs the original ops; TF names the index wrapped once, -3 + 2)."""
    fn = LAST["third_from_end_of_a_slice"]
    sf = stitching.function(fn, input_signature=SIG, options=OPTS)
    sf(_x(2, 5))
    assert len(sf.report.kernels) == 1, sf.report.summary()
    with pytest.raises(tf.errors.InvalidArgumentError, match="slice index -1 of dimension 1 out"):
        sf(_x(2, 2))


def test_the_kernel_checks_the_index_exists():
    from stitching.compile import compile_kernel
    from stitching.ir.builder import SpecBuilder
    from stitching.schedule import build_schedule
    b = SpecBuilder()
    x = b.input("float32", [-1, -1, 8])
    v = b.Slice(x, begin=[0, -2, 0], size=[-1, 1, -1], strides=[1, 1, 1], shape=[-1, 8])
    spec = b.build([b.Neg(v)])
    dom = build_schedule(spec).domain
    assert [p[2] for p in dom.picks] == [-2] and [s[2] for s in dom.scaled] == [8]
    k = compile_kernel(spec)
    for batch, seq in ((1, 2), (3, 7)):
        xs = _x(batch, seq).numpy()
        (y,) = k(xs)
        _same_bits(y, -xs[:, -2])
    with pytest.raises(ValueError, match="indexed at -2 along a dim known only at run time"):
        k(_x(2, 1).numpy())


def test_a_transpose_of_outer_dims_with_run_time_strides():
    """[B, 8, N] -> [8, B, N]: both outer strides depend on N (kernel parameters)."""
    from stitching.compile import compile_kernel
    from stitching.ir.builder import SpecBuilder
    b = SpecBuilder()
    x = b.input("float32", [-1, 8, -1])
    k = compile_kernel(b.build([b.Neg(b.Transpose(x, perm=[1, 0, 2]))]))
    for batch, n in ((1, 3), (3, 17), (2, 0)):
        xs = RNG.standard_normal((batch, 8, n)).astype(np.float32)
        (y,) = k(xs)
        _same_bits(y, -xs.transpose(1, 0, 2))


def test_the_gradient_of_the_last_token_stays_tf_with_the_reason():
    """d(x[:, -1])/dx pads dy to the run-time length: TF's StridedSliceGrad."""
    sig = SIG + [tf.TensorSpec([None, 8], tf.float32)]

    def fn(x, dy):
        return tf.raw_ops.StridedSliceGrad(
            shape=tf.shape(x), begin=[0, -1, 0], end=[0, 0, 0], strides=[1, 1, 1],
            dy=dy * 2.0, begin_mask=5, end_mask=5, shrink_axis_mask=2) + 1.0

    sf = stitching.function(fn, input_signature=sig, options=OPTS)
    x, dy = _x(2, 5), _x(2, 1)[:, 0]
    _same_bits(sf(x, dy), fn(x, dy))
    assert "StridedSliceGrad of part of a dim known only at run time" in sf.report.summary()
