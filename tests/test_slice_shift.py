"""Slices that drop c elements of a dim known only at run time: ``x[:, 1:]``, ``x[:, :-1]``.

A causal language model's loss compares ``logits[:, :-1]`` with ``labels[:, 1:]``, and
decoders take ``x[:, 1:] - x[:, :-1]``.  At a sequence length n known only at run time
the slice's length is max(n - c, 0) (TF's StridedSlice clamps): a dim class the kernel's
shape program computes from n (schedule/layout.py View.less), so the slices fold into
their reader as views at offset c, meet each other element-wise and in reductions, and
one compiled kernel serves every length, 0 and lengths below c included.  Layout ops are
exact: every element-wise result here equals TF's bit for bit.
"""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
import stitching  # noqa: E402

OPTS = stitching.Options(min_ops=1)
RNG = np.random.default_rng(11)
SIG = [tf.TensorSpec([None, None, 8], tf.float32)]
LENGTHS = range(17)


def _x(batch, seq, width=8):
    x = RNG.standard_normal((batch, seq, width)).astype(np.float32)
    x.reshape(-1)[:5] = [np.nan, -np.inf, np.inf, 0.0, -0.0][:x.size]
    return tf.constant(x)


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def _kernel_ops(sf):
    return [[t for _, t in k.ops if t != "Identity"] for k in sf.report.kernels]


EXACT = {
    "difference": lambda x: x[:, 1:] - x[:, :-1],
    "middle": lambda x: x[:, 2:-1] * 2.0 + x[:, :-3],
    "with_static_slices": lambda x: x[:, 1:, 2:6] - x[:, :-1, :4],
    "begin_and_end": lambda x: x[:, 1:-1] - 0.5 * x[:, 2:],
}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_shifted_slices_meet_in_one_kernel_at_every_length(name):
    """One kernel, one trace, every length 0..16 (below the drop too: TF's empty
    result); bits equal to TF's, NaN, Inf and -0 included."""
    fn = EXACT[name]
    sf = stitching.function(fn, input_signature=SIG, options=OPTS)
    ref = tf.function(fn, input_signature=SIG)
    for n in LENGTHS:
        x = _x(3, n)
        _same_bits(sf(x), ref(x))
    assert len(sf.report.kernels) == 1 and not sf.report.unfused, sf.report.summary()
    assert len(sf.reports) == 1
    (ops_,) = _kernel_ops(sf)
    assert ops_.count("StridedSlice") >= 2


@pytest.mark.parametrize("rank", [1, 2])
def test_a_shift_of_the_innermost_dim(rank):
    """The shifted dim innermost (its stride 1; an outer dim's stride is n, a kernel
    parameter): one kernel, TF's bits."""
    fn = lambda x: x[..., 1:] * 3.0 - x[..., :-1]   # noqa: E731
    sig = [tf.TensorSpec([None] * rank, tf.float32)]
    sf = stitching.function(fn, input_signature=sig, options=OPTS)
    for n in (0, 1, 2, 9):
        x = tf.constant(RNG.standard_normal([3] * (rank - 1) + [n]).astype(np.float32))
        _same_bits(sf(x), fn(x))
    assert len(sf.report.kernels) == 1 and not sf.report.unfused, sf.report.summary()


def test_a_reduction_along_the_shifted_axis_is_one_column_kernel():
    fn = lambda x: tf.reduce_sum(x[:, 1:] * x[:, :-1], axis=1)   # noqa: E731
    sf = stitching.function(fn, input_signature=SIG, options=OPTS)
    for n in LENGTHS:
        x = RNG.standard_normal((2, n, 8)).astype(np.float32)
        got = sf(tf.constant(x)).numpy()
        want = (x[:, 1:].astype(np.float64) * x[:, :-1]).sum(1)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert len(sf.report.kernels) == 1 and not sf.report.unfused, sf.report.summary()
    assert "column kernel" in sf.report.kernels[0].schedule
    assert len(sf.reports) == 1


def test_shift_difference_and_layer_norm_are_one_row_kernel():
    norm = keras.layers.LayerNormalization(epsilon=1e-5)
    norm.build((None, None, 32))
    fn = lambda x: norm(x[:, 1:] - x[:, :-1])   # noqa: E731
    sig = [tf.TensorSpec([None, None, 32], tf.float32)]
    sf = stitching.function(fn, input_signature=sig, options=OPTS)
    for n in (0, 1, 2, 9):
        x = tf.constant(RNG.standard_normal((2, n, 32)).astype(np.float32))
        np.testing.assert_allclose(sf(x).numpy(), fn(x).numpy(), rtol=1e-5, atol=1e-5)
    assert len(sf.report.kernels) == 1 and not sf.report.unfused, sf.report.summary()
    assert "row kernel" in sf.report.kernels[0].schedule


def _lm_loss(logits, labels):
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels[:, 1:],
                                                          logits=logits[:, :-1])


def _lm_grad(logits, labels):
    with tf.GradientTape() as tape:
        tape.watch(logits)
        loss = tf.reduce_sum(_lm_loss(logits, labels))
    return tape.gradient(loss, logits)


LM_SIG = [tf.TensorSpec([None, None, 16], tf.float32), tf.TensorSpec([None, None], tf.int32)]


def _lm_inputs(n):
    logits = RNG.standard_normal((2, n, 16)).astype(np.float32) * 3
    if n > 2:
        logits[0, 1, 3], logits[1, 2, 5], logits[0, 2, 7] = -np.inf, np.nan, np.inf
    return tf.constant(logits), tf.constant(RNG.integers(0, 16, (2, n)).astype(np.int32))


@pytest.mark.parametrize("fn", [_lm_loss, _lm_grad], ids=["loss", "gradient"])
def test_language_model_shifted_loss_is_one_kernel_at_every_length(fn):
    """Sparse cross-entropy of logits[:, :-1] against labels[:, 1:]: TF reshapes both
    to rows (the batch and the shortened sequence merged, which no view can read), so
    tf/passes/sparse_xent.py computes the loss at the sequence's own rank, and the
    logits slice and the loss (and its backprop) are one kernel.  The labels' slice is
    TF's range check's input too (a kernel of its own here, min_ops=1); the gradient's
    StridedSliceGrad stays TF's (its reason).  One trace for every length; TF's
    values, -inf, NaN and Inf logits included."""
    sf = stitching.function(fn, input_signature=LM_SIG, options=OPTS)
    ref = tf.function(fn, input_signature=LM_SIG)
    for n in LENGTHS:
        args = _lm_inputs(n)
        got, want = sf(*args).numpy(), ref(*args).numpy()
        assert got.shape == want.shape
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    assert len(sf.reports) == 1
    ops_ = _kernel_ops(sf)
    (loss,) = [k for k in ops_ if "Log" in k]
    assert "StridedSlice" in loss and "Max" in loss and "SelectV2" in loss, ops_
    assert ["StridedSlice"] in ops_, ops_
    assert len(ops_) == (2 if fn is _lm_loss else 3), sf.report.summary()
    if fn is _lm_grad:
        assert "where the length is below c TF gives zeros" in sf.report.summary()


def test_a_label_out_of_range_fails_as_tf_does():
    sf = stitching.function(_lm_loss, input_signature=LM_SIG, options=OPTS)
    logits, labels = _lm_inputs(4)
    sf(logits, labels)
    bad = tf.constant([[0, 1, 16, 2], [3, 4, 5, 6]], tf.int32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="16 is not in"):
        sf(logits, bad)
    sf(logits, tf.constant([[16, 1, 2, 3], [3, 4, 5, 6]], tf.int32))  # dropped: no error


REFUSED = {
    # (function, the reason the report gives)
    "from_the_end": (lambda x: x[:, -3:] * 2.0, "its count is not the dim less a constant"),
    "to_a_static_end": (lambda x: x[:, :5] * 2.0, "its count is not the dim less a constant"),
    "strided": (lambda x: x[:, 1::2] * 2.0, "its count is not the dim less a constant"),
    # x[1:] starts n * 8 elements in: an offset known only at run time
    "a_shifted_batch": (lambda x: x[1:, 1:] * x[:-1, :-1],
                        "and dims after it are known only at run time"),
    "a_slice_op": (lambda x: tf.slice(x, [0, 1, 0], [-1, -1, -1]) * 2.0,
                   "a Slice from 1 to the end of a dim known only at run time"),
    "a_gather": (lambda x: tf.gather(x, [0, 2], axis=1) * 2.0,
                 "GatherV2 along a dim known only at run time"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_other_slices_of_a_run_time_dim_stay_tf_with_the_reason(name):
    fn, why = REFUSED[name]
    sf = stitching.function(fn, input_signature=SIG, options=OPTS)
    for n in (3, 6):
        x = _x(2, n)
        _same_bits(sf(x), fn(x))
    assert why in sf.report.summary(), sf.report.summary()


def test_the_gradient_of_a_shift_stays_tf_with_the_reason():
    """d(x[:, 1:])/dx is a Pad of dy by constants, but where the length is below the
    drop TF gives zeros of the input's length, which a Pad does not: TF's op."""
    sig = SIG + [tf.TensorSpec([None, None, 8], tf.float32)]

    def fn(x, dy):
        return tf.raw_ops.StridedSliceGrad(
            shape=tf.shape(x), begin=[0, 1, 0], end=[0, 0, 0], strides=[1, 1, 1],
            dy=dy * 2.0, begin_mask=5, end_mask=7) + 1.0

    sf = stitching.function(fn, input_signature=sig, options=OPTS)
    x, dy = _x(2, 5), _x(2, 4)
    _same_bits(sf(x, dy), fn(x, dy))
    assert "zeros of its length, which a Pad does not" in sf.report.summary()


# ---- the kernel itself: its shape program computes and checks the shifted dims ----------

def _two_shifts_spec():
    """x[:, 1:] - y[:, :-1], x and y of unrelated run-time lengths."""
    from stitching.ir.builder import SpecBuilder
    from stitching.ir.ops import rest_size
    b = SpecBuilder()
    x = b.input("float32", [-1, -1, 8])
    y = b.input("float32", [-1, -1, 8])
    u = b.Slice(x, begin=[0, 1, 0], size=[-1, rest_size(0), -1], strides=[1, 1, 1],
                shape=[-1, -1, 8])
    v = b.Slice(y, begin=[0, 0, 0], size=[-1, rest_size(1), -1], strides=[1, 1, 1],
                shape=[-1, -1, 8])
    return b.build([b.Sub(u, v)])


def test_the_kernel_computes_the_shifted_length_and_checks_the_two_agree():
    from stitching.compile import compile_kernel
    from stitching.schedule import build_schedule
    spec = _two_shifts_spec()
    dom = build_schedule(spec).domain
    assert sorted((j, i, c) for _, j, i, c in dom.less) == [(0, 1, 1), (1, 1, 1)]
    k = compile_kernel(spec)
    for batch, seq in ((1, 0), (2, 1), (3, 7), (2, 16)):
        x, y = _x(batch, seq).numpy(), _x(batch, seq).numpy()
        (out,) = k(x, y)
        _same_bits(out, x[:, 1:] - y[:, :-1])
    (out,) = k(_x(2, 0).numpy(), _x(2, 1).numpy())       # both empty: TF agrees
    assert out.shape == (2, 0, 8)
    with pytest.raises(ValueError, match="input 1 dim 1 less 1 .* differs"):
        k(_x(2, 5).numpy(), _x(2, 7).numpy())


BAD_SLICES = {
    "a_static_dim": ([6, 8], [1, 0], [-3, -1], [1, 1]),
    "a_stride": ([-1, 8], [1, 0], [-3, -1], [2, 1]),
    "a_negative_begin": ([-1, 8], [-1, 0], [-3, -1], [1, 1]),
    "a_begin_past_the_bound": ([-1, 8], [5000, 0], [-3, -1], [1, 1]),
    "a_drop_past_the_bound": ([-1, 8], [0, 0], [-3 - 5000, -1], [1, 1]),
}


@pytest.mark.parametrize("name", sorted(BAD_SLICES))
def test_a_bad_rest_of_a_dim_is_a_spec_error(name):
    """Specs are untrusted: a rest-of-dim size anywhere it cannot be checked (a static
    dim, a stride, a begin or drop that is negative or past ops.MAX_SHIFT) is refused
    with the reason, from JSON too."""
    import json

    from stitching.ir.spec import VERSION, KernelSpec, SpecError
    shape, begin, size, strides = BAD_SLICES[name]
    out = [-1, 8]
    spec = {"version": VERSION, "inputs": [{"dtype": "float32", "shape": shape}],
            "nodes": [{"op": "Slice", "args": [-1],
                       "attrs": {"begin": begin, "size": size, "strides": strides,
                                 "shape": out},
                       "dtype": "float32", "shape": out}],
            "outputs": [0]}
    with pytest.raises(SpecError, match="the rest of a dim .* needs a dim known only at "
                       "run time, stride 1, and a begin and a drop from 0 to 4096"):
        KernelSpec.from_json(json.dumps(spec))
