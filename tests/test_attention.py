"""StitchedAttention (runtime/attention.cc) and the pass that makes it
(tf/passes/attention.py): numerics against TF and float64, layouts, masks, NaN/Inf,
unknown batch, clear errors, and the models' attentions fused one per layer."""
import json
import pathlib

import numpy as np
import pytest
import tensorflow as tf

import stitching
from stitching.runtime import blas
from stitching.tf.passes import attention

pytest.importorskip("scipy_openblas32")

EIGEN = "amd-avx2"            # a machine model whose TF runs Eigen's GEMM (oneDNN off)
OFF = stitching.Options(fused_attention=False)   # the default is on


@pytest.fixture(scope="module")
def ops():
    return blas.load()


def _rand(shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _swap(t):
    """[.., H, M, N] <-> [.., M, H, N]: the head transpose of the transpose_ attrs."""
    r = t.ndim
    return np.transpose(t, list(range(r - 3)) + [r - 2, r - 3, r - 1])


def _adj(t):
    return np.swapaxes(t, -1, -2)


def _reference(q, k, v, mask, scale, xp):
    """softmax(scale q k^T + mask) v in plain layouts: TF's ops (xp=tf) or float64
    numpy (xp=np)."""
    if xp is tf:
        s = tf.linalg.matmul(q, k, adjoint_b=True) * scale
        s = s + mask if mask is not None else s
        return tf.linalg.matmul(tf.nn.softmax(s, -1), v).numpy()
    q, k, v = (t.astype(np.float64) for t in (q, k, v))
    s = q @ _adj(k) * scale + (0.0 if mask is None else mask.astype(np.float64))
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def _call(ops, q, k, v, mask=None, scale=1.0, aq=False, ak=True, av=False, tq=False,
          tk=False, tv=False, to=False, cond=None, fill=0.0, keeps=True):
    """The op on plain-layout q [.., M, D], k [.., N, D], v [.., N, E], each stored as
    the flags say; the output turned back to [.., M, E]."""
    qs = _adj(q) if aq else q
    ks = k if ak else _adj(k)
    vs = _adj(v) if av else v
    qs, ks, vs = (_swap(t).copy() if f else np.ascontiguousarray(t)
                  for t, f in ((qs, tq), (ks, tk), (vs, tv)))
    out = ops.stitched_attention(q=qs, k=ks, v=vs, mask=[] if mask is None else [mask],
                                 cond=[] if cond is None else [cond], fill=fill,
                                 cond_keeps=keeps, scale=scale, adj_q=aq, adj_k=ak, adj_v=av,
                                 transpose_q=tq,
                                 transpose_k=tk, transpose_v=tv, transpose_out=to).numpy()
    return _swap(out) if to else out


CAUSAL = np.triu(np.full((40, 40), -1e9, np.float32), 1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("qs, ks, vs, mask", [
    ((2, 3, 40, 16), (2, 3, 40, 16), (2, 3, 40, 24), CAUSAL),      # causal, [M, N]
    ((2, 3, 50, 8), (1, 3, 700, 8), (2, 1, 700, 5), "pad"),        # broadcast; blocks
    ((4, 2, 8), (4, 9, 8), (4, 9, 8), None),                        # gemv rows, tails
    ((2, 2, 33, 8), (2, 2, 13, 8), (2, 2, 13, 8), "row"),           # a per-row mask
])
@pytest.mark.parametrize("flags", [{}, dict(aq=True, ak=False, av=True),
                                   dict(tq=True, tk=True, tv=True, to=True)])
def test_equals_tf_and_float64(ops, dtype, qs, ks, vs, mask, flags):
    q, k, v = _rand(qs, dtype, 1), _rand(ks, dtype, 2), _rand(vs, dtype, 3)
    if isinstance(mask, str):       # [B, 1, 1, N] padding, or [.., M, 1] per row
        shape = (qs[0], 1, 1, ks[-2]) if mask == "pad" else (qs[-2], 1)
        mask = np.where(_rand(shape, seed=4) > 1.0, -1e9, 0.0)
    if mask is not None:
        mask = mask.astype(dtype)
    got = _call(ops, q, k, v, mask, 0.25, **flags)
    want, ref = _reference(q, k, v, mask, 0.25, tf), _reference(q, k, v, mask, 0.25, np)
    assert got.shape == want.shape and got.dtype == dtype
    # no less accurate than TF's own ops (both sum in their own orders, and the float
    # exp is a polynomial); the floor is a few ulps of the largest value
    ulp = np.finfo(dtype).eps * np.abs(ref).max()
    err = lambda a: float(np.abs(a.astype(np.float64) - ref).max())  # noqa: E731
    assert err(got) <= 2 * err(want) + 16 * ulp


def test_nan_and_inf_rows_as_in_tf(ops):
    q, k, v = _rand((2, 2, 20, 8), seed=5), _rand((2, 2, 20, 8), seed=6), \
        _rand((2, 2, 20, 8), seed=7)
    q[0, 1, 3, 2] = np.nan                          # one query's scores NaN
    k[1, 0, 4, 1] = np.inf                          # one key's scores +-inf
    v[1, 1, 5, 0] = -np.inf                         # one value's column -inf
    mask = np.triu(np.full((20, 20), -np.inf, np.float32), 1)   # -inf masks: exp 0
    got = _call(ops, q, k, v, mask, 0.5)
    want = _reference(q, k, v, mask, 0.5, tf)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-5)


KERAS_FILL = -0.7 * float(np.finfo(np.float32).max)    # Keras's large negative number


def _select_reference(q, k, v, cond, keeps, fill, scale, xp):
    """softmax(where(cond == keeps, scale q k^T, fill)) v: TF's ops or float64 numpy."""
    keep = cond if keeps else ~cond
    if xp is tf:
        s = tf.linalg.matmul(q, k, adjoint_b=True) * scale
        s = tf.where(keep, s, tf.constant(fill, s.dtype))
        return tf.linalg.matmul(tf.nn.softmax(s, -1), v).numpy()
    q, k, v = (t.astype(np.float64) for t in (q, k, v))
    s = np.where(keep, q @ _adj(k) * scale, np.float64(np.float32(fill)))
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def _assert_as_accurate_as_tf(got, want, ref):
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    fin = np.isfinite(ref)
    ulp = np.finfo(got.dtype).eps * np.abs(ref[fin]).max()
    err = lambda a: float(np.abs(a[fin].astype(np.float64) - ref[fin]).max())  # noqa: E731
    assert err(got) <= 2 * err(want) + 16 * ulp


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cond, keeps, fill", [
    ("causal", True, KERAS_FILL),      # Keras's [1, 1, T, T] band: blocks skip keys
    ("causal", False, -1e9),           # where(cond, fill, scores): the negation
    ("pad", True, -1e9),               # [B, 1, 1, N] trailing padding, per batch
    ("rows", True, KERAS_FILL),        # [.., M, 1]: fully masked rows (uniform)
    ("full", True, -1e4),              # [B, H, M, N], fill not far below the scores
])
def test_bool_masks_equal_tf_and_float64(ops, dtype, cond, keeps, fill):
    if dtype == np.float64 and fill == KERAS_FILL:
        fill = -1e30                   # (a float attribute: float32's range)
    q, k, v = _rand((2, 3, 70, 8), dtype, 1), _rand((2, 3, 70, 8), dtype, 2), \
        _rand((2, 3, 70, 6), dtype, 3)
    rng = np.random.default_rng(4)
    if cond == "causal":
        c = np.tril(np.ones((70, 70), bool))[None, None]
    elif cond == "pad":
        c = np.arange(70)[None, None, None, :] < np.array([70, 45])[:, None, None, None]
    elif cond == "rows":
        c = rng.random((70, 1)) > 0.3
    else:
        c = rng.random((2, 3, 70, 70)) > 0.5
    c = c if keeps else ~c
    got = _call(ops, q, k, v, scale=0.5, cond=c, fill=fill, keeps=keeps)
    want = _select_reference(q, k, v, c, keeps, fill, 0.5, tf)
    _assert_as_accurate_as_tf(got, want, _select_reference(q, k, v, c, keeps, fill, 0.5, np))


def test_bool_mask_nan_and_inf_as_in_tf(ops):
    q, k, v = _rand((1, 2, 64, 8), seed=5), _rand((1, 2, 64, 8), seed=6), \
        _rand((1, 2, 64, 8), seed=7)
    q[0, 0, 3, 2] = np.nan                  # one query's kept scores NaN
    k[0, 1, 60, 1] = np.inf                 # a key only the last rows keep: masked
    v[0, 0, 50, 0] = np.inf                 # a value masked for rows < 50: 0 * inf
    band = np.tril(np.ones((64, 64), bool))
    got = _call(ops, q, k, v, scale=0.5, cond=band, fill=KERAS_FILL)
    want = _select_reference(q, k, v, band, True, KERAS_FILL, 0.5, tf)
    assert np.isnan(want).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["causal", "pad", "shallow", "overtaken"])
def test_additive_mask_skipping_is_exact(ops, case):
    # keys past a block's last kept one are skipped only where their weights are 0
    q, k, v = _rand((2, 2, 96, 8), seed=8), _rand((2, 2, 96, 8), seed=9), \
        _rand((2, 2, 96, 8), seed=10)
    if case == "causal":          # Llama's triu(-1e9)
        mask = np.triu(np.full((96, 96), -1e9, np.float32), 1)
    elif case == "pad":           # [B, 1, 1, N]: batch 1's last 30 keys padding
        mask = np.zeros((2, 1, 1, 96), np.float32)
        mask[1, ..., 66:] = -1e4
    elif case == "shallow":       # too shallow to count as masked: every key computed
        mask = np.triu(np.full((96, 96), -20.0, np.float32), 1)
    else:                         # deep enough to be a candidate, but the masked
        # scores grow faster than the mask: the later keys dominate each row in TF too
        mask = np.triu(np.full((96, 96), -150.0, np.float32), 1)
        q = np.ones_like(q)
        k = np.ones_like(k) * (3.0 * np.arange(96, dtype=np.float32))[:, None]
    got = _call(ops, q, k, v, mask, 1.0)
    want, ref = _reference(q, k, v, mask, 1.0, tf), _reference(q, k, v, mask, 1.0, np)
    _assert_as_accurate_as_tf(got, want, ref)
    if case == "overtaken":       # (the masked keys' weights are not 0 here)
        assert not np.allclose(want, _reference(q, k, v, mask - 1e9 * (mask < 0), 1.0, tf))



def test_unknown_batch_in_a_function(ops):
    @tf.function(input_signature=[tf.TensorSpec([None, 2, None, 8], tf.float32)] * 3)
    def f(q, k, v):
        return ops.stitched_attention(q=q, k=k, v=v, mask=[], cond=[], scale=0.25,
                                      adj_k=True)
    assert f.get_concrete_function().output_shapes.as_list() == [None, 2, None, 8]
    for b, n in [(1, 3), (5, 37)]:
        q, k, v = (_rand((b, 2, n, 8), seed=s) for s in (8, 9, 10))
        np.testing.assert_allclose(f(q, k, v), _reference(q, k, v, None, 0.25, tf),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("inline", [True, False])
def test_tfs_profiler_shows_the_op_inline_or_not(ops, inline):
    """An inline op (no inter-op hand-off: TF traces it only at a verbose level) traces
    itself; an expensive one is TF's to trace: one event per call either way."""
    from stitching.testing.counting import profiled_ops
    q, k, v = (tf.constant(_rand((2, 2, 16, 8), seed=s)) for s in (1, 2, 3))
    f = tf.function(lambda q, k, v: ops.stitched_attention(
        q=q, k=k, v=v, mask=[], cond=[], scale=0.5, adj_k=True, inline=inline))
    f(q, k, v)
    assert profiled_ops(lambda: [f(q, k, v) for _ in range(3)])["StitchedAttention"] == 3


@pytest.mark.parametrize("kwargs, message", [
    (dict(q=_rand((2, 4, 8)), k=_rand((2, 5, 7)), v=_rand((2, 5, 3)), adj_k=True),
     "inner dimensions differ|Dimensions must be equal"),
    (dict(q=_rand((2, 4, 8)), k=_rand((2, 5, 8)), v=_rand((2, 5, 3)), adj_k=True,
          mask=[_rand((3, 5))]), "does not broadcast to the scores"),
    (dict(q=_rand((2, 4, 8)), k=_rand((3, 5, 8)), v=_rand((2, 5, 3)), adj_k=True),
     "do not broadcast|Incompatible shapes|must be equal"),
])
def test_bad_operands_are_refused_with_the_reason(ops, kwargs, message):
    kwargs.setdefault("mask", [])
    kwargs.setdefault("cond", [])
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match=message):
        ops.stitched_attention(**kwargs)


@pytest.mark.parametrize("flags", [dict(tq=True, tk=True, tv=True, to=True),
                                   dict(aq=True, ak=False, av=True)])
def test_gradient_equals_tf(ops, flags):
    # a tape outside a stitched function: q, k, v and a broadcast mask
    q, k, v = _rand((2, 3, 6, 4), seed=13), _rand((1, 3, 5, 4), seed=14), \
        _rand((2, 3, 5, 7), seed=15)
    mask = _rand((6, 1), seed=16)
    args = [tf.constant(t) for t in (q, k, v, mask)]
    w = tf.constant(_rand((2, 3, 6, 7), seed=17))
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(args)
        qs = _swap_t(tf.linalg.matrix_transpose(args[0]) if flags.get("aq") else args[0],
                     flags.get("tq"))
        ks = _swap_t(args[1] if flags.get("ak", True) else tf.linalg.matrix_transpose(args[1]),
                     flags.get("tk"))
        vs = _swap_t(tf.linalg.matrix_transpose(args[2]) if flags.get("av") else args[2],
                     flags.get("tv"))
        out = ops.stitched_attention(
            q=qs, k=ks, v=vs, mask=[args[3]], cond=[], scale=0.5, adj_q=flags.get("aq", False),
            adj_k=flags.get("ak", True), adj_v=flags.get("av", False),
            transpose_q=flags.get("tq", False), transpose_k=flags.get("tk", False),
            transpose_v=flags.get("tv", False), transpose_out=flags.get("to", False))
        ours = tf.reduce_sum(_swap_t(out, flags.get("to")) * w)
        s = tf.linalg.matmul(args[0], args[1], adjoint_b=True) * 0.5 + args[3]
        theirs = tf.reduce_sum(tf.linalg.matmul(tf.nn.softmax(s, -1), args[2]) * w)
    for g, want in zip(tape.gradient(ours, args), tape.gradient(theirs, args)):
        assert g.shape == want.shape
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5)


def _swap_t(t, swapped):
    r = len(t.shape)
    return tf.transpose(t, list(range(r - 3)) + [r - 2, r - 3, r - 1]) if swapped else t


# ---- the pass -------------------------------------------------------------------------

def _spec(nodes, inputs=((-1, 2, 8, 8), (8, 8)), outputs=None):
    return {"inputs": [{"dtype": "float32", "shape": list(s)} for s in inputs],
            "nodes": nodes, "outputs": outputs or [len(nodes) - 1]}


def _softmax_nodes(axis=3):
    s, r = [-1, 2, 8, 8], [-1, 2, 8, 1]
    return [{"op": "Const", "args": [], "attrs": {"value": 0.5}, "shape": []},
            {"op": "Mul", "args": [-1, 0], "attrs": {}, "shape": s},
            {"op": "Add", "args": [-2, 1], "attrs": {}, "shape": s},
            {"op": "Max", "args": [2], "attrs": {"axes": [axis], "keep_dims": True}, "shape": r},
            {"op": "Sub", "args": [2, 3], "attrs": {}, "shape": s},
            {"op": "Exp", "args": [4], "attrs": {}, "shape": s},
            {"op": "Sum", "args": [5], "attrs": {"axes": [axis], "keep_dims": True}, "shape": r},
            {"op": "Reciprocal", "args": [6], "attrs": {}, "shape": r},
            {"op": "Mul", "args": [7, 5], "attrs": {}, "shape": s}]


def test_the_kernel_is_matched_on_its_ir():
    assert attention.softmax_of(_spec(_softmax_nodes())) == \
        attention.Softmax(scores=0, scale=0.5, mask=1)
    # along another axis, or the max of something else: not a softmax of the scores
    assert attention.softmax_of(_spec(_softmax_nodes(axis=2))) is None
    nodes = _softmax_nodes()
    nodes[4]["args"] = [1, 3]
    assert attention.softmax_of(_spec(nodes)) is None
    # scores scaled by a tensor (an input), not a constant
    nodes = _softmax_nodes()
    nodes[1]["args"] = [-1, -2]
    assert attention.softmax_of(_spec(nodes)) is None


def _select_nodes(fill_shape=()):
    """where(cond, scores * 0.5, fill) and its softmax (the cond input -1, bool)."""
    nodes = _softmax_nodes()
    s = [-1, 2, 8, 8]
    nodes[2] = {"op": "Const", "args": [], "attrs": {"value": -3e38}, "shape": list(fill_shape)}
    nodes.append({"op": "Select", "args": [-1, 1, 2], "attrs": {}, "shape": s})
    for nd in nodes[3:9]:     # the softmax reads the select (node 9)
        nd["args"] = [9 if a == 2 else a for a in nd["args"]]
    return nodes


def test_a_select_mask_is_matched_on_its_ir():
    inputs = [(-1, 1, 8, 8), (-1, 2, 8, 8)]
    spec = _spec(_select_nodes(), inputs, outputs=[8])
    spec["inputs"][0]["dtype"] = "bool"
    nodes, ref = spec["nodes"], attention.Softmax(scores=1, scale=0.5, cond=0, fill=-3e38)
    nodes[1]["args"] = [-2, 0]
    assert attention.softmax_of(spec) == ref
    nodes[9]["args"] = [-1, 2, 1]                 # where(cond, fill, scores)
    assert attention.softmax_of(spec) == ref._replace(keeps=False)
    spec["inputs"][0]["dtype"] = "float32"        # a float condition: not a mask
    assert attention.softmax_of(spec) is None
    spec = _spec(_select_nodes(fill_shape=(8,)), inputs, outputs=[8])
    spec["inputs"][0]["dtype"] = "bool"
    spec["nodes"][1]["args"] = [-2, 0]
    assert attention.softmax_of(spec) is None     # the fill a tensor, not a scalar


def test_a_malformed_kernel_spec_is_not_matched():
    from tensorflow.core.framework import graph_pb2
    g = graph_pb2.GraphDef()
    for name, op, inputs in (("s", "StitchedBatchMatMul", ["q", "k"]),
                             ("p", "StitchedKernel", ["s"]),
                             ("o", "StitchedBatchMatMul", ["p", "v"])):
        nd = g.node.add(name=name, op=op)
        nd.input.extend(inputs)
        nd.attr["T"].type = tf.float32.as_datatype_enum
    for spec in (b"not json", b'{"nodes": [{"op": "Mul"}], "outputs": [0]}', b"[1]"):
        g.node[1].attr["spec"].s = spec
        assert attention.fuse(g, set()) == 0 and len(g.node) == 3


def _model(name):
    from stitching.testing import models
    import keras
    keras.utils.set_random_seed(5)
    if name == "llama":
        return models.llama_decoder(num_layers=2, d_model=32, heads=4, kv_heads=2, ff=48,
                                    seq_len=8)
    return models.transformer_encoder(num_layers=2, d_model=32, heads=2, ff=64, seq_len=8)


@pytest.mark.parametrize("name", ["llama", "transformer"])
def test_the_models_get_one_attention_per_layer(monkeypatch, tmp_path, name):
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", EIGEN)
    model = _model(name)
    sig = [tf.TensorSpec([None, 8, 32], tf.float32)]
    # (autotune, every kernel marked: the softmax kernels are gone into the attentions)
    on = stitching.function(lambda t: model(t), input_signature=sig,
                            options=stitching.Options(fused_attention=True,
                                                      autotune=name == "llama",
                                                      autotune_margin=1e9,
                                                      dump_dir=str(tmp_path)))
    off = stitching.function(lambda t: model(t), input_signature=sig, options=OFF)
    x = _rand((3, 8, 32), seed=11)
    x[1, 2, 5] = np.nan                              # one token's row goes NaN
    want = model(x).numpy()
    for f in (on, off):
        got = f(tf.constant(x)).numpy()
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(on(x[:1]).numpy(), model(x[:1]).numpy(), rtol=2e-5, atol=2e-5)
    ops_on, ops_off = ([n.op for n in f.get_concrete_function(*sig).graph.as_graph_def().node]
                       for f in (on, off))
    assert ops_on.count("StitchedAttention") == 2 and "StitchedAttention" not in ops_off
    # each took two products and the softmax kernel
    assert ops_off.count("StitchedBatchMatMul") - ops_on.count("StitchedBatchMatMul") == 4
    assert ops_off.count("StitchedKernel") - ops_on.count("StitchedKernel") == 2
    assert "2 attention(s) fused into StitchedAttention" in " ".join(on.report.notes)
    # the report lists the kernels the graph runs (not the softmax kernels taken into
    # the attentions); their ops still count as fused
    assert len(on.report.kernels) == ops_on.count("StitchedKernel") == \
        len(off.report.kernels) - 2
    assert on.report.coverage == off.report.coverage
    # ... listed where they went: the kernels' ops and the products' ops add up
    rep = on.report
    in_kernels = sum(len(k.split_ops()[0]) for k in rep.kernels)
    assert in_kernels + len(rep.folded) == rep.fused_ops, rep.summary()
    taken = [op for _, op, where in rep.folded if "StitchedAttention" in where]
    assert taken.count("Softmax") == 2, rep.summary()
    # the dump describes the same kernels, each one region (its nodes are its ops')
    dump = stitching.load_dump(on.report.dump_path)
    assert [k.name for k in dump.kernels] == [k.name for k in rep.kernels]
    doc = json.loads((pathlib.Path(rep.dump_path) / "dump.json").read_text())
    for entry in doc["kernels"]:
        assert entry["nodes"] == [o["node"] for o in entry["ops"]], entry["name"]


def test_gpt2_gets_one_attention_per_layer_with_its_causal_mask(monkeypatch):
    # Keras's causal MultiHeadAttention: where(band & ones_like(scores), scores * c,
    # fill) before the softmax, the scaled scores' shape read for the band.  (heads=2:
    # a head of 8 floats keeps TF's Einsum, tf/passes/einsum.py's _MIN_ROW.)
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", EIGEN)
    from stitching.testing import models
    import keras
    keras.utils.set_random_seed(5)
    model = models.gpt2_decoder(num_layers=2, d_model=32, heads=2, ff=48, seq_len=8)
    sig = [tf.TensorSpec([None, 8, 32], tf.float32)]
    f = stitching.function(lambda t: model(t), input_signature=sig)
    for batch in (3, 1):
        x = _rand((batch, 8, 32), seed=11)
        np.testing.assert_allclose(f(tf.constant(x)).numpy(), model(x).numpy(), rtol=2e-5,
                                   atol=2e-5)
    graph = f.get_concrete_function(*sig).graph.as_graph_def()
    ops_ = [n.op for n in graph.node]
    assert ops_.count("StitchedAttention") == 2 and "StitchedBatchMatMul" not in ops_
    # the scale Mul is folded into the op, the band fed to it unbroadcast
    assert "Mul" not in ops_ and "LogicalAnd" not in ops_ and "SelectV2" not in ops_
    # the band's sequence lengths are TF's static dims: constants, so the band is a
    # constant TF folds, not shape arithmetic run at every call
    assert not {"Shape", "BroadcastArgs", "GatherV2", "ConcatV2"} & set(ops_), ops_
    # ... and the report counts it fused, not as a lone op left to TF
    assert not [n for n, op, _ in f.report.unfused if op == "Mul"]
    taken = [op for _, op, where in f.report.folded if "StitchedAttention" in where]
    assert sorted(taken) == ["Mul", "Mul", "SelectV2", "SelectV2", "Softmax", "Softmax"], \
        f.report.summary()
    for nd in graph.node:
        if nd.op == "StitchedAttention":
            assert nd.attr["n_cond"].i == 1 and nd.attr["cond_keeps"].b
            assert nd.attr["scale"].f == pytest.approx(32 ** -0.5 * 2 ** 0.5)


def test_gradient_with_a_bool_mask_equals_tf(ops):
    q, k, v = _rand((2, 2, 6, 4), seed=13), _rand((2, 2, 6, 4), seed=14), \
        _rand((2, 2, 6, 3), seed=15)
    band = tf.constant(np.tril(np.ones((6, 6), bool)))
    args = [tf.constant(t) for t in (q, k, v)]
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(args)
        ours = tf.reduce_sum(ops.stitched_attention(
            q=args[0], k=args[1], v=args[2], mask=[], cond=[band], fill=-1e9, scale=0.5,
            adj_k=True) ** 2)
        s = tf.where(band, tf.linalg.matmul(args[0], args[1], adjoint_b=True) * 0.5, -1e9)
        theirs = tf.reduce_sum(tf.linalg.matmul(tf.nn.softmax(s, -1), args[2]) ** 2)
    for g, want in zip(tape.gradient(ours, args), tape.gradient(theirs, args)):
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5)


def test_a_training_step_is_left_unfused(monkeypatch):
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", EIGEN)
    model = _model("llama")
    sig = [tf.TensorSpec([None, 8, 32], tf.float32)]

    def step(t):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(t)))
        return loss, tape.gradient(loss, model.trainable_variables)

    f = stitching.function(step, input_signature=sig,
                           options=stitching.Options(fused_attention=True))
    x = _rand((2, 8, 32), seed=12)
    (loss, grads), (want_loss, want_grads) = f(tf.constant(x)), step(tf.constant(x))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-4)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-3)
    ops_ = [n.op for n in f.get_concrete_function(*sig).graph.as_graph_def().node]
    assert "StitchedAttention" not in ops_
    assert not any("StitchedAttention" in n for n in f.report.notes)


# Where TF's GEMM is oneDNN's (a pinned model that says so), the blas pass takes only
# the products of the masked attentions the attention pass fuses (blas.mode ATTENTION,
# blas._attention_products): every other product stays TF's.
ONEDNN = "intel-avx512"
_BLAS_OPS = {"StitchedMatMul", "StitchedBatchMatMul"}


def _graph_ops(f, sig):
    return [n.op for n in f.get_concrete_function(*sig).graph.as_graph_def().node]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_onednn_fuses_each_masked_attention_and_leaves_the_other_products(monkeypatch,
                                                                          name):
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", ONEDNN)
    from stitching.testing import models
    import keras
    if name == "gpt2":
        keras.utils.set_random_seed(5)
        model = models.gpt2_decoder(num_layers=2, d_model=32, heads=2, ff=48, seq_len=8)
    else:
        model = _model("llama")
    sig = [tf.TensorSpec([None, 8, 32], tf.float32)]
    f = stitching.function(lambda t: model(t), input_signature=sig)
    for batch in (3, 1):
        x = _rand((batch, 8, 32), seed=11)
        if batch == 3:
            x[1, 2, 5] = np.nan                      # one token's row goes NaN
        got, want = f(tf.constant(x)).numpy(), model(x).numpy()
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ops_ = _graph_ops(f, sig)
    assert ops_.count("StitchedAttention") == 2
    # the projections and the feed-forward products stay TF's (oneDNN's)
    assert not _BLAS_OPS & set(ops_)
    assert "MatMul" in ops_ or "BatchMatMulV2" in ops_
    notes = " ".join(f.report.notes)
    assert "4 of 4 batch matrix product(s) run by OpenBLAS" in notes
    assert "2 attention(s) fused into StitchedAttention" in notes


def test_onednn_leaves_an_unmasked_attention_to_tf(monkeypatch):
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", ONEDNN)
    model = _model("transformer")
    sig = [tf.TensorSpec([None, 8, 32], tf.float32)]
    f = stitching.function(lambda t: model(t), input_signature=sig)
    x = _rand((3, 8, 32), seed=11)
    np.testing.assert_allclose(f(tf.constant(x)).numpy(), model(x).numpy(), rtol=2e-5,
                               atol=2e-5)
    ops_ = _graph_ops(f, sig)
    assert "StitchedAttention" not in ops_ and not _BLAS_OPS & set(ops_)
    # the einsum pass's moves stay row gathers, as where no product is ours
    assert "Transpose" not in ops_ and "GatherV2" in ops_
    notes = " ".join(f.report.notes)
    assert "no product run by OpenBLAS: TF's GEMM here is oneDNN's; 2 unmasked " \
        "attention(s) left to oneDNN's products (the fused op gains over them only " \
        "where a mask removes key blocks)" in notes
    # where the products run by OpenBLAS, the same attentions are fused
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", EIGEN)
    g = stitching.function(lambda t: model(t), input_signature=sig)
    np.testing.assert_allclose(g(tf.constant(x)).numpy(), model(x).numpy(), rtol=2e-5,
                               atol=2e-5)
    assert _graph_ops(g, sig).count("StitchedAttention") == 2


def test_onednn_without_fused_attention_or_in_training_leaves_every_product(monkeypatch):
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", ONEDNN)
    model = _model("llama")
    sig = [tf.TensorSpec([None, 8, 32], tf.float32)]
    off = stitching.function(lambda t: model(t), input_signature=sig, options=OFF)

    def step(t):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(t)))
        return loss, tape.gradient(loss, model.trainable_variables)

    train = stitching.function(step, input_signature=sig)
    x = tf.constant(_rand((2, 8, 32), seed=12))
    np.testing.assert_allclose(off(x).numpy(), model(x).numpy(), rtol=2e-5, atol=2e-5)
    (loss, grads), (want_loss, want_grads) = train(x), step(x)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-4)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-3)
    for f in (off, train):
        ops_ = _graph_ops(f, sig)
        assert "StitchedAttention" not in ops_ and not _BLAS_OPS & set(ops_), ops_


# Where TF's GEMM is oneDNN's, each fused attention times itself against its unfused
# products (TF's, around the softmax kernel) on its first calls per shape class and
# keeps the faster (runtime/attention.cc, op.cc's Tuner; tf/passes/attention.py
# unfused_function).  Decisions are process-wide per (hash, class) and the Tuner asks
# the disk cache once per hash: each test below uses a model of its own widths, so its
# attentions hash to decisions no other test made.
CALLS_TO_DECIDE = 12      # op.cc: (kTuneWarmup 1 + kTuneSamples 5) runs of each way


@pytest.fixture
def no_decisions():
    """No decision a run before this one stored in the cache directory."""
    import shutil
    from stitching import cachedir
    shutil.rmtree(cachedir.root() / "autotune", ignore_errors=True)


def _tuned_model(name, d_model):
    from stitching.testing import models
    import keras
    keras.utils.set_random_seed(5)
    if name == "gpt2":
        return models.gpt2_decoder(num_layers=2, d_model=d_model, heads=2, ff=48, seq_len=8)
    return models.llama_decoder(num_layers=2, d_model=d_model, heads=4, kv_heads=2, ff=48,
                                seq_len=8)


def _tuned_llama(d_model, seed):
    """A stitched 2-layer Llama decoder of width ``d_model`` (its attentions timed:
    the oneDNN profile), the hash its two attentions share, an input and stock TF's
    output for it."""
    model = _tuned_model("llama", d_model)
    sig = [tf.TensorSpec([None, 8, d_model], tf.float32)]
    f = stitching.function(lambda t: model(t), input_signature=sig)
    (h,) = {n.attr[attention.TUNE_ATTR].s.decode() for n in _attentions(f, sig)}
    x = _rand((2, 8, d_model), seed=seed)
    return f, h, x, model(x).numpy()


def _attentions(f, sig):
    return [n for n in f.get_concrete_function(*sig).graph.as_graph_def().node
            if n.op == "StitchedAttention"]


def _attention_counts():
    from stitching import runtime
    return {k: v for k, v in runtime.stats().items() if k.startswith("attention_")}


def _delta(before):
    return {k: v - before[k] for k, v in _attention_counts().items()}


@pytest.mark.parametrize("name,d_model", [("llama", 40), ("gpt2", 44)])
def test_onednn_attention_decided_unfused_runs_unfused_and_equals_tf(monkeypatch,
                                                                      no_decisions,
                                                                      name, d_model):
    """A decision for the unfused way in the cache (as if an earlier process measured
    it): every call runs the unfused function -- head transposes, oneDNN's products,
    Keras's scale and broadcast band (gpt2) -- and equals stock TF."""
    from stitching.runtime import autotune
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", ONEDNN)
    model = _tuned_model(name, d_model)
    sig = [tf.TensorSpec([None, 8, d_model], tf.float32)]
    f = stitching.function(lambda t: model(t), input_signature=sig)
    (h,) = {n.attr[attention.TUNE_ATTR].s.decode() for n in _attentions(f, sig)}
    for cls in range(autotune.N_CLASSES):
        autotune.write(h, cls, "native", 2.0, 1.0)
    before = _attention_counts()
    for batch in (3, 1, 3):
        x = _rand((batch, 8, d_model), seed=batch)
        np.testing.assert_allclose(f(tf.constant(x)).numpy(), model(x).numpy(),
                                   rtol=2e-5, atol=2e-5)
    d = _delta(before)
    assert d["attention_autotune_unfused_calls"] == 6, d       # 2 layers, 3 calls
    assert d["attention_autotune_timed_calls"] == 0, d
    assert d["attention_autotune_cached"] == 4, d              # (node, class) pairs
    assert d["attention_autotune_untuned"] == 0, d
    assert "timed against their unfused products" in " ".join(f.report.notes)


def test_onednn_attention_measures_equals_tf_on_every_call_and_keeps_its_decision(
        monkeypatch, no_decisions):
    from stitching import runtime
    from stitching.runtime import autotune
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", ONEDNN)
    f, h, x, want = _tuned_llama(48, seed=21)
    before, measured = _attention_counts(), runtime.stats()["autotune_measured"]
    # two layers share the decision: each call times both of them
    for _ in range(CALLS_TO_DECIDE // 2 + 2):
        np.testing.assert_allclose(f(tf.constant(x)).numpy(), want, rtol=2e-5, atol=2e-5)
    d = _delta(before)
    assert d["attention_autotune_timed_calls"] == CALLS_TO_DECIDE, d
    assert runtime.stats()["autotune_measured"] == measured + 1
    ((key, decision),) = [(k, v) for k, v in runtime.autotune_decisions().items()
                          if k[0] == h]
    assert decision["choice"] in ("kernel", "native") and decision["source"] == "measured"
    assert decision["kernel_us"] > 0 and decision["native_us"] > 0
    on_disk = autotune.read(h)                  # a second process reads it
    assert on_disk[key[1]]["choice"] == decision["choice"]
    # ... and the report shows it, per attention node
    entries = [e for e in f.report.autotune_decisions() if e.get("attention")]
    assert len(entries) == 2 and all(e["decisions"] for e in entries), entries
    way = "fused" if decision["choice"] == "kernel" else "unfused"
    assert f"(measured) -> {way}" in f.report.summary()


def test_onednn_attention_measures_only_once_no_kernel_runs_tier1_code(monkeypatch,
                                                                       no_decisions):
    """While any kernel of the process runs tier-1 code (here a marker body, as a
    tiered compile registers one until its upgrade) the op does not measure: the
    unfused function's softmax kernel may be that code, 2.4-3.3x slower than it will
    be, and a decision made then is kept on disk.  Its calls run fused, equal to TF;
    once the code is upgraded, it measures as before."""
    import ctypes
    from stitching import runtime
    from stitching.runtime import registry
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", ONEDNN)
    f, h, x, want = _tuned_llama(56, seed=31)
    lib = registry.library()
    marker = ctypes.create_string_buffer(16)          # an address no code has
    lib.stitching_tier1_body(ctypes.addressof(marker))
    before = _attention_counts()
    try:
        for _ in range(CALLS_TO_DECIDE):
            np.testing.assert_allclose(f(tf.constant(x)).numpy(), want, rtol=2e-5,
                                       atol=2e-5)
        d = _delta(before)
        assert d["attention_autotune_timed_calls"] == 0, d
        assert d["attention_autotune_unfused_calls"] == 0, d
        assert all(v["choice"] is None for k, v in runtime.autotune_decisions().items()
                   if k[0] == h)                         # still undecided
        assert [k for k in runtime.autotune_pending() if k[0] == h], \
            runtime.autotune_pending()                   # ... and listed as pending
    finally:               # its upgrade: no tier-1 code is left in the process
        lib.stitching_upgrade_body(ctypes.addressof(marker), ctypes.addressof(marker) + 8)
    for _ in range(CALLS_TO_DECIDE // 2 + 2):
        np.testing.assert_allclose(f(tf.constant(x)).numpy(), want, rtol=2e-5, atol=2e-5)
    assert _delta(before)["attention_autotune_timed_calls"] == CALLS_TO_DECIDE
    ((_, decision),) = [(k, v) for k, v in runtime.autotune_decisions().items()
                        if k[0] == h]
    assert decision["choice"] in ("kernel", "native"), decision
    assert not [k for k in runtime.autotune_pending() if k[0] == h]


def test_a_missing_unfused_function_runs_fused(monkeypatch, no_decisions):
    """A graph whose library lost the unfused function (its op names one no library
    has): the op runs fused, never an error, even where the cache says unfused."""
    from stitching.runtime import autotune
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", ONEDNN)
    mask = np.triu(np.full((16, 16), -1e9, np.float32), 1)

    def attend(q, k, v):
        s = tf.matmul(q, k, transpose_b=True) * 0.3
        return tf.matmul(tf.nn.softmax(s + mask), v)

    sig = [tf.TensorSpec([None, 2, 16, 12], tf.float32)] * 3
    cf = stitching.function(attend, input_signature=sig).get_concrete_function(*sig)
    graph = cf.graph.as_graph_def()
    (nd,) = [n for n in graph.node if n.op == "StitchedAttention"]
    nd.attr[attention.UNFUSED_ATTR].s = b"stitching_original_" + b"0" * 24
    for cls in range(autotune.N_CLASSES):
        autotune.write(nd.attr[attention.TUNE_ATTR].s.decode(), cls, "native", 2.0, 1.0)
    imported = tf.compat.v1.wrap_function(
        lambda *xs: tf.graph_util.import_graph_def(
            graph, input_map={p.name: x for p, x in zip(cf.inputs, xs)},
            return_elements=[cf.outputs[0].name])[0], sig)
    args = [tf.constant(_rand((3, 2, 16, 12), seed=s)) for s in (22, 23, 24)]
    before = _attention_counts()
    for _ in range(2):
        np.testing.assert_allclose(imported(*args).numpy(), attend(*args).numpy(),
                                   rtol=2e-5, atol=2e-5)
    d = _delta(before)
    assert d["attention_autotune_untuned"] == 1, d
    assert d["attention_autotune_unfused_calls"] == 0, d


def test_attentions_are_timed_only_where_tf_runs_onednn(monkeypatch):
    """Where the products are OpenBLAS's (Eigen's GEMM) the op is not timed (the
    unfused way runs the same kernels), nor with STITCHING_ATTENTION_AUTOTUNE=0; where
    TF runs oneDNN each op names its unfused function, which the graph's library has."""
    model = _model("llama")
    sig = [tf.TensorSpec([None, 8, 32], tf.float32)]
    for profile, env, tuned in ((EIGEN, None, False), (ONEDNN, "0", False),
                                (ONEDNN, None, True)):
        monkeypatch.setenv("STITCHING_DEVICE_PROFILE", profile)
        if env is None:
            monkeypatch.delenv(attention.AUTOTUNE_ENV, raising=False)
        else:
            monkeypatch.setenv(attention.AUTOTUNE_ENV, env)
        f = stitching.function(lambda t: model(t), input_signature=sig)
        graph = f.get_concrete_function(*sig).graph.as_graph_def()
        nodes = [n for n in graph.node if n.op == "StitchedAttention"]
        assert len(nodes) == 2
        assert all((attention.UNFUSED_ATTR in n.attr) == tuned for n in nodes), profile
        if tuned:
            names = {n.attr[attention.UNFUSED_ATTR].s.decode() for n in nodes}
            library = {fd.signature.name: fd for fd in graph.library.function}
            assert names <= set(library)
            (body,) = [library[n] for n in names]       # one per kind of attention
            ops_ = sorted(n.op for n in body.node_def)
            assert ops_.count(attention._product_op()) == 2 and "StitchedKernel" in ops_


_LOAD_TUNED = """
    import json, numpy as np
    import stitching, tensorflow as tf
    from stitching import runtime
    m = tf.saved_model.load({path!r})
    args = [tf.constant(np.load({d!r} + f"/{{n}}.npy")) for n in "qkv"]
    want = np.load({d!r} + "/y.npy")
    got = m.attend(*args)
    stats = {{k: v for k, v in runtime.stats().items() if k.startswith("attention_")}}
    print("RESULT", json.dumps({{"err": float(np.abs(got.numpy() - want).max()), **stats}}))
"""


def test_a_rewritten_saved_model_serves_its_decision_in_a_fresh_process(monkeypatch,
                                                                        tmp_path,
                                                                        no_decisions):
    """stitching-rewrite's path where TF runs oneDNN: the op's unfused function travels
    in the SavedModel's library, and a fresh process that finds the unfused way decided
    in the cache runs it (through the loader's renamed function), with TF's answer."""
    import os
    import subprocess
    import sys
    import textwrap
    from tensorflow.core.protobuf import saved_model_pb2
    from stitching.runtime import autotune
    from stitching.saved_model import rewrite_saved_model
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", ONEDNN)
    mask = np.triu(np.full((24, 24), -1e9, np.float32), 1)
    module = tf.Module()
    module.attend = tf.function(
        lambda q, k, v: tf.matmul(tf.nn.softmax(tf.matmul(q, k, transpose_b=True) * 0.25
                                                + mask), v),
        input_signature=[tf.TensorSpec([None, 2, 24, 8], tf.float32)] * 3)
    tf.saved_model.save(module, str(tmp_path / "src"))
    rewrite_saved_model(str(tmp_path / "src"), str(tmp_path / "dst"))
    saved = saved_model_pb2.SavedModel()
    saved.ParseFromString((tmp_path / "dst" / "saved_model.pb").read_bytes())
    graph = saved.meta_graphs[0].graph_def
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    (h,) = {n.attr[attention.TUNE_ATTR].s.decode() for n in nodes
            if n.op == "StitchedAttention"}
    for cls in range(autotune.N_CLASSES):
        autotune.write(h, cls, "native", 2.0, 1.0)
    q, k, v = (_rand((3, 2, 24, 8), seed=s) for s in (31, 32, 33))
    for name, t in (("q", q), ("k", k), ("v", v),
                    ("y", module.attend(q, k, v).numpy())):
        np.save(tmp_path / f"{name}.npy", t)
    code = textwrap.dedent(_LOAD_TUNED.format(path=str(tmp_path / "dst"), d=str(tmp_path)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ), timeout=600)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, out.stderr[-3000:]
    res = json.loads(line[0][len("RESULT "):])
    assert res["err"] < 1e-5, res
    assert res["attention_autotune_unfused_calls"] == 1, res
    assert res["attention_autotune_untuned"] == 0, res
