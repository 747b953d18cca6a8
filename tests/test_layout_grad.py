"""Gradients of the fused layout ops fused on the backward side too, without scatters.

The tape's gradient of a GatherV2 by constant indices is an UnsortedSegmentSum of the
upstream gradient by those indices (with Transposes around it for an axis other than
0): the SegmentSum composite, strided slices of the rows padded to every segment and
summed in TF's order (tf/frontend.py, ir/composites.py).  The gradient of a strided
slice (``x[:, ::2]``) is a StridedSliceGrad with zeros between its elements: a Pad of
dy with a size-1 axis after the strided one, then a regrouping Reshape
(tf/passes/strided_grad.py).  Both are inside kernels and give TF's bits, NaN and Inf
included; what stays TF's (an id past the segments, too many pieces) says why.
"""
import numpy as np
import pytest
import tensorflow as tf

import stitching
from stitching.tf.frontend import _segment_pieces
from stitching.testing.train import input_gradient

RNG = np.random.default_rng(92)


def _data(shape, specials=True):
    x = RNG.standard_normal(shape).astype(np.float32)
    if specials:
        x.flat[1], x.flat[len(x.flat) // 2] = np.nan, np.inf
    return tf.constant(x)


def _fused_ops(rep):
    return [(name, op) for k in rep.kernels for name, op in k.ops]


def _check_equal(step, sig, xs):
    """The stitched step equals TF's bit for bit (NaN and Inf where TF has them) on each
    input; its report."""
    f, ref = stitching.function(step, input_signature=sig), tf.function(step)
    for x in xs:
        np.testing.assert_array_equal(f(x).numpy(), ref(x).numpy())
    return f.report


def test_segment_pieces_are_layers_of_runs():
    # segment 4 takes rows 0 and 4 (two layers); 4 and 5 read rows 0, 1 (one run)
    assert _segment_pieces([4, 5, 0, 2, 4]) == [[0, 2, 1, 1], [2, 3, 1, 1], [4, 0, 2, 1],
                                                [4, 4, 1, 1]]
    assert _segment_pieces([3, 2, 1, 0]) == [[0, 3, 4, -1]]          # one reversed run
    assert _segment_pieces([-1, 0, 0]) == [[0, 1, 1, 1], [0, 2, 1, 1]]   # -1: dropped


@pytest.mark.parametrize("axis,ids,shape", [
    (0, [3, 1, 1, 0], (4, 8, 6)),             # repeated, a segment without rows
    (0, [0, 1, 2, 3, 5, 4], (6, 5)),          # unique: a permutation
    (1, [4, 5, 0, 2, 4], (None, 8, 6)),       # axis 1 (Transposes), unknown batch
    # runs x[4:6] and x[9:12] read x at one map over the 8 gathered rows (the views
    # of one input differed only in shape, and were taken for one: a Select refused)
    (1, [4, 5, 0, 2, 4, 9, 10, 11], (None, 16, 8)),
])
def test_gather_gradient_by_constant_indices_is_fused_bitwise(axis, ids, shape):
    step = input_gradient(lambda v: tf.gather(v, ids, axis=axis))
    batches = (1, 3) if shape[0] is None else (shape[0],)
    rep = _check_equal(step, [tf.TensorSpec(shape, tf.float32)],
                       [_data((b,) + shape[1:]) for b in batches])
    assert "UnsortedSegmentSum" in [op for _, op in _fused_ops(rep)], rep.summary()
    assert not {"UnsortedSegmentSum", "Transpose", "GatherV2"} & {
        op for _, op, _ in rep.unfused}, rep.summary()


def test_segment_sum_by_constant_ids_drops_negative_ids_and_keeps_tfs_errors():
    def ok(g):
        return tf.math.unsorted_segment_sum(g * 2.0, [2, -1, 0, 2, 3], 5) + 1.0

    def past(g):
        return tf.math.unsorted_segment_sum(g * 2.0, [2, 0, 5], 5) + 1.0

    def scattered(g):             # a shuffle: about one piece per two segments
        ids = np.random.RandomState(0).permutation(24)
        return tf.math.unsorted_segment_sum(g * 2.0, ids, 24) + 1.0
    sig = [tf.TensorSpec([None, 3], tf.float32)]
    g = _data((5, 3))
    rep = _check_equal(lambda v: ok(tf.transpose(v)), [tf.TensorSpec([3, 5], tf.float32)],
                       [tf.transpose(g)])
    assert "UnsortedSegmentSum" in [op for _, op in _fused_ops(rep)], rep.summary()

    f = stitching.function(past, input_signature=sig)
    with pytest.raises(tf.errors.InvalidArgumentError):
        f(g[:3])
    why = {op: r for _, op, r in f.report.unfused}
    assert "outside [0, 5)" in why["UnsortedSegmentSum"], f.report.summary()

    f = stitching.function(scattered, input_signature=[tf.TensorSpec([24, 3], tf.float32)])
    x = _data((24, 3))
    np.testing.assert_array_equal(f(x).numpy(), tf.function(scattered)(x).numpy())
    why = {op: r for _, op, r in f.report.unfused}
    assert "limit 8" in why["UnsortedSegmentSum"], f.report.summary()


@pytest.mark.parametrize("take,shape", [
    (lambda v: v[:, ::2], (None, 9, 7)),              # 9 = 5 rows of 2, trimmed
    (lambda v: v[..., 1::3], (None, 4, 9)),            # 3 divides 9: no trim
    (lambda v: v[:, ::-2, 1:6:2], (None, 9, 7)),       # reversed, two strided axes
    (lambda v: v[1, 7:0:-3], (4, 9, 7)),               # shrink axis, negative stride
])
def test_strided_slice_gradient_is_a_fused_pad_bitwise(take, shape):
    step = input_gradient(take)
    batches = (1, 3) if shape[0] is None else (shape[0],)
    rep = _check_equal(step, [tf.TensorSpec(shape, tf.float32)],
                       [_data((b,) + shape[1:]) for b in batches])
    fused = _fused_ops(rep)
    assert any(op == "Pad" and "StridedSliceGrad/stitching_strided_grad" in name
               for name, op in fused), rep.summary()
    assert not {"StridedSliceGrad", "Pad", "ReverseV2", "Slice"} & {
        op for _, op, _ in rep.unfused}, rep.summary()


def test_pad_of_a_concatenation_reads_its_end_pieces_guarded():
    """A Pad of a concatenation reads it outside its pieces in the padding (the
    segment sum's padded slices of a gather's concatenated runs): the end pieces are
    read there guarded, and the Pad's select drops what they read; bit-exact."""
    from stitching.compile import compile_kernel
    from stitching.ir.builder import SpecBuilder
    b = SpecBuilder()
    x = b.input("float32", [-1, 6, 5])
    c = b.ConcatV2(b.Neg(b.Slice(x, begin=[0, 4, 0], size=[-1, 2, 5], strides=[1, 1, 1],
                                 shape=[-1, 2, 5])),
                   b.Slice(x, begin=[0, 0, 0], size=[-1, 3, 5], strides=[1, 2, 1],
                           shape=[-1, 3, 5]), axis=1)
    spec = b.build([b.Mul(b.Pad(c, paddings=[0, 0, 2, 3, 0, 0], value=0.0),
                          b.const(2.0))])
    X = RNG.standard_normal((3, 6, 5)).astype(np.float32)
    X[1, 4, 2] = np.nan
    (got,) = compile_kernel(spec)(X)
    ref = np.pad(np.concatenate([-X[:, 4:6], X[:, 0:6:2]], 1), [(0, 0), (2, 3), (0, 0)]) * 2
    np.testing.assert_array_equal(got, ref)


def test_strided_grad_pass_rewrites_into_tf_ops_and_drops_the_shape_it_read():
    """The pass alone, on TF's graph: the StridedSliceGrad's name now holds the trimming
    Slice, the Shape of x that only it read is gone, and the graph runs equal to TF."""
    from stitching.tf import tfgraph
    from stitching.tf.passes import strided_grad
    step = input_gradient(lambda v: v[:, ::2])
    cf = tf.function(step).get_concrete_function(tf.TensorSpec([None, 9, 7], tf.float32))
    gd = cf.graph.as_graph_def()
    new = strided_grad.rewrite(tfgraph.import_for_shapes(gd), gd)
    ops = {n.name: n.op for n in new.node}
    grads = [n for n, op in ops.items() if n.endswith("StridedSliceGrad")]
    assert grads and all(ops[n] == "Slice" for n in grads)
    assert "StridedSliceGrad" not in ops.values()
    assert not any(n.endswith("strided_slice/Shape") for n in ops)
    x = _data((2, 9, 7))
    run = tf.compat.v1.wrap_function(
        lambda v: tf.graph_util.import_graph_def(new, {cf.inputs[0].name: v},
                                                 [cf.outputs[0].name]),
        [tf.TensorSpec([None, 9, 7], tf.float32)])
    np.testing.assert_array_equal(run(x)[0].numpy(), tf.function(step)(x).numpy())


def test_strided_grad_pass_leaves_the_gradient_to_tf_on_a_cuda_profile(monkeypatch):
    """On a CUDA profile nothing would fuse the Pad (that emitter reads no views), so
    the pass keeps TF's one StridedSliceGrad instead of a Pad and a Slice."""
    from stitching.tf import passmanager
    from stitching.tf.passes import strided_grad
    step = input_gradient(lambda v: v[:, ::2])
    gd = tf.function(step).get_concrete_function(
        tf.TensorSpec([None, 9, 7], tf.float32)).graph.as_graph_def()

    def ops_after_the_pass():
        ctx = passmanager.Context(gd, [], [], stitching.Options())
        strided_grad.PASS.run(ctx)
        return {n.op for n in ctx.graph_def.node}
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", "h100")
    assert "StridedSliceGrad" in ops_after_the_pass()
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", "amd-avx2")
    assert "StridedSliceGrad" not in ops_after_the_pass()


def test_training_step_with_a_constant_index_gather_updates_like_tf():
    """A training step (a variable, a tape, an SGD update) through a gather by constant
    indices on axis 0 and a strided slice: both gradients fused; the variable after two
    steps equals TF's bit for bit (its gradient has no sum in another order)."""
    init = RNG.standard_normal((6, 8)).astype(np.float32)

    def make():
        v = tf.Variable(init)

        def train(x):
            with tf.GradientTape() as tape:
                h = tf.gather(v * x, [5, 0, 0, 3, 1], axis=0)
                loss = tf.reduce_sum(tf.square(h[:, 1::2]) * 0.5)
            v.assign_sub(tape.gradient(loss, v) * 0.1)
            return loss
        return v, train
    v_tf, train_tf = make()
    v_st, train_st = make()
    f, ref = stitching.function(train_st), tf.function(train_tf)
    x = _data((6, 8), specials=False)
    for _ in range(2):   # the loss's sum is added in another order than Eigen's
        np.testing.assert_allclose(f(x).numpy(), ref(x).numpy(), rtol=1e-6)
    np.testing.assert_array_equal(v_st.numpy(), v_tf.numpy())
    assert "UnsortedSegmentSum" in [op for _, op in _fused_ops(f.report)], f.report.summary()
    # at this size the cost model may keep the Pad apart from dy's kernel (it cannot
    # join the forward's [5, 4] domain): a choice, not a refusal
    assert all("cost model" in why for _, op, why in f.report.unfused
               if op in ("Pad", "StridedSliceGrad", "UnsortedSegmentSum")), f.report.summary()
