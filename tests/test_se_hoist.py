"""Squeeze-excite gates computed once per (batch, channel), not once per element.

The excite of an SE block is ``x * sigmoid(z + b)`` with x [N,H,W,C] and z [N,1,1,C]:
an element-wise kernel over the collapsed domain [N, H*W, C] in which the gate carries
the batch and channel axes but not H*W.  The CPU emitter computes such values
(Schedule.hoisted) into a last-axis scratch once per group of rows that shares them
(Schedule.hoist_per_group) and the element loop only multiplies.  These tests hold the
schedule's choice, the numerics against float64 (NaN and infinities through the
hoisted part, a hoisted value with two consumers, float64 kernels) and, through TF,
the number of kernels an SE block becomes and one compiled kernel for every batch.
"""
import numpy as np
import pytest

from stitching.compile import compile_kernel
from stitching.ir.builder import SpecBuilder

C = 24


def _ulps(out, ref):
    """Max error of ``out`` in ulps of its dtype against the float64 ``ref`` (finite
    elements; NaN and infinities must match exactly)."""
    dt = out.dtype
    assert np.array_equal(np.isnan(out), np.isnan(ref))
    inf = np.isinf(ref)
    assert np.array_equal(out[inf], ref[inf].astype(dt))
    fin = np.isfinite(ref)
    r = ref[fin]
    spacing = np.spacing(np.abs(r).astype(dt)).astype(np.float64)
    spacing = np.maximum(spacing, np.finfo(dt).smallest_subnormal)
    return float(np.max(np.abs(out[fin].astype(np.float64) - r) / spacing, initial=0.0))


def _sigmoid64(v):
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-v))


def _gate64(z, bias):
    """The gate in float64 from z + bias rounded as the kernel (and TF) rounds it: the
    sigmoid of a negative argument magnifies that one rounding by |z + bias|."""
    return _sigmoid64((z + bias).astype(np.float64))


def _gate_spec(dtype="float32", two_consumers=False, **launch):
    b = SpecBuilder()
    x = b.input(dtype, (-1, 5, 7, C))
    z = b.input(dtype, (-1, 1, 1, C))
    bias = b.input(dtype, (C,))
    s = b.Sigmoid(b.Add(z, bias))
    outs = [b.Mul(x, s)]
    if two_consumers:   # the gate feeds a second element-wise consumer and output
        outs.append(b.Sub(b.Mul(x, x), s))
    return b.build(outs, **launch)


def _data(n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 5, 7, C)).astype(dtype)
    z = (3 * rng.standard_normal((n, 1, 1, C))).astype(dtype)
    bias = rng.standard_normal(C).astype(dtype)
    return x, z, bias


@pytest.mark.parametrize("launch", [{}, {"rows_per_task": 3, "col_block": C},
                                    {"rows_per_task": 1, "col_block": 8}],
                         ids=["auto", "3-row-units", "column-block-units"])
def test_se_gate_is_computed_once_per_batch_and_channel(launch):
    """Units of whole rows, of 3 rows (a group of 35 rows spans units) and of 8-column
    pieces of a row (the prologue fills the whole row for the group's first piece)."""
    k = compile_kernel(_gate_spec(**launch))
    s = k.schedule
    assert s.kind.value == "elementwise" and s.rank == 3       # [N, H*W, C]
    hoist, front = s.hoisted()
    assert [s.spec.nodes[i].op for i in front] == ["Sigmoid"]
    assert s.hoist_per_group()
    assert "once per group of rows" in s.describe()
    # the sigmoid sits in the group prologue only, not in the element loop
    body = k.source[k.source.index("def body"):]
    assert body.count("sigmoid_f32") == 2        # in-place and ordinary loop nests
    assert "if g != hg:" in body
    for n in (1, 3, 4):                          # groups change within and across units
        x, z, bias = _data(n, np.float32, seed=n)
        ref = x.astype(np.float64) * _gate64(z, bias)
        assert _ulps(k(x, z, bias)[0], ref) <= 4


def test_per_channel_only_values_keep_the_once_per_call_prologue():
    """A value carrying only the channel (batch norm's scale) needs no group check."""
    b = SpecBuilder()
    x = b.input("float32", (-1, 5, 7, C))
    g = b.input("float32", (C,))
    k = compile_kernel(b.build([b.Mul(x, b.Sigmoid(g))]))
    assert k.schedule.hoisted()[1] and not k.schedule.hoist_per_group()
    assert "hg" not in k.source and "once per call" in k.schedule.describe()
    X = np.random.default_rng(1).standard_normal((2, 5, 7, C)).astype(np.float32)
    G = np.random.default_rng(2).standard_normal(C).astype(np.float32)
    assert _ulps(k(X, G)[0], X.astype(np.float64) * _sigmoid64(G.astype(np.float64))) <= 4


def test_hoisted_gate_with_two_consumers_and_float64():
    for dtype, bar in (("float32", 4), ("float64", 4)):
        k = compile_kernel(_gate_spec(dtype, two_consumers=True))
        assert k.schedule.hoist_per_group()
        x, z, bias = _data(3, dtype, seed=7)
        x64 = x.astype(np.float64)
        s64 = _gate64(z, bias)
        y, w = k(x, z, bias)
        assert y.dtype == np.dtype(dtype) and _ulps(y, x64 * s64) <= bar
        # x*x - s cancels where x*x ~ s: hold it in ulps of the operands' scale
        err = np.abs(w.astype(np.float64) - (x64 * x64 - s64))
        scale = np.spacing(np.maximum(x64 * x64, s64).astype(dtype)).astype(np.float64)
        assert float(np.max(err / scale)) <= bar


def test_nan_and_infinities_propagate_through_the_hoisted_gate():
    k = compile_kernel(_gate_spec())
    x, z, bias = _data(3, np.float32, seed=3)
    z[1, 0, 0, 5] = np.nan                 # one (batch, channel): NaN there only
    z[2, 0, 0, 7] = np.inf                 # sigmoid(inf) = 1: y = x
    z[0, 0, 0, 2] = -np.inf                # sigmoid(-inf) = 0: y = 0 * x
    x[0, 1, 2, 9] = np.inf                 # an infinite element times a finite gate
    y = k(x, z, bias)[0]
    ref = x.astype(np.float64) * _gate64(z, bias)
    nan = np.isnan(y)
    assert nan[1, :, :, 5].all() and nan.sum() == 5 * 7
    np.testing.assert_array_equal(y[2, :, :, 7], x[2, :, :, 7])
    assert (y[0, :, :, 2] == 0).all()
    assert _ulps(y, ref) <= 4


def _se_block(tf, rng, H=14, Cb=96, S=8):
    """An EfficientNet SE block: global mean, 1x1 conv + bias + swish, 1x1 conv + bias
    + sigmoid, gate times the input."""
    w1 = tf.constant(rng.standard_normal((1, 1, Cb, S)).astype(np.float32) * 0.2)
    b1 = tf.constant(rng.standard_normal(S).astype(np.float32))
    w2 = tf.constant(rng.standard_normal((1, 1, S, Cb)).astype(np.float32) * 0.2)
    b2 = tf.constant(rng.standard_normal(Cb).astype(np.float32))

    def se(x):
        m = tf.reduce_mean(x, axis=[1, 2], keepdims=True)
        y = tf.nn.bias_add(tf.nn.conv2d(m, w1, 1, "VALID"), b1)
        y = y * tf.sigmoid(y)
        g = tf.sigmoid(tf.nn.bias_add(tf.nn.conv2d(y, w2, 1, "VALID"), b2))
        return x * g
    return se


def test_se_block_is_one_kernel_and_one_compiled_excite_for_every_batch():
    """Through TF: the squeeze's two 1x1 convolutions (SmallMatMul), its swish, the
    gate's sigmoid and the excite are one kernel (the lone Mean stays TF's here), the
    excite hoists its gate, and one trace with an unknown batch serves batch 1, 3 and 6
    equal to TF."""
    tf = pytest.importorskip("tensorflow")
    import stitching
    from stitching.schedule import build_schedule
    rng = np.random.default_rng(0)
    se = _se_block(tf, rng)
    f = stitching.function(se, input_signature=[tf.TensorSpec((None, 14, 14, 96))],
                           options=stitching.Options(planner="greedy"))
    for n in (1, 3, 6):
        x = rng.standard_normal((n, 14, 14, 96)).astype(np.float32)
        np.testing.assert_allclose(f(x).numpy(), se(x).numpy(), rtol=2e-6, atol=1e-6)
    assert len(f.reports) == 1                       # traced once
    r = f.report
    assert len(r.kernels) == 1 and r.code_objects == 1, r.summary()
    ops = sorted(t for _, t in r.kernels[0].ops)
    assert ops == ["BiasAdd", "BiasAdd", "Conv2D", "Conv2D", "Identity", "Mul", "Mul",
                   "Sigmoid", "Sigmoid"], r.summary()
    assert "?x196x96" in r.kernels[0].schedule
    cf = f.get_concrete_function(tf.TensorSpec((None, 14, 14, 96)))
    specs = [s for s in _kernel_specs(cf.graph.as_graph_def())
             if s.hash == r.kernels[0].spec_hash]
    assert len(specs) == 1 and build_schedule(specs[0]).hoist_per_group()


def _kernel_specs(graph_def):
    """The KernelSpecs of the StitchedKernel nodes of a graph and its functions."""
    from stitching.ir.spec import KernelSpec
    nodes = list(graph_def.node) + [n for fd in graph_def.library.function
                                    for n in fd.node_def]
    return [KernelSpec.from_json(n.attr["spec"].s.decode()) for n in nodes
            if n.op == "StitchedKernel"]
