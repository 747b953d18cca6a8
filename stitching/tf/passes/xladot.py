"""Matrix products run by XLA's dot where TF's own GEMM is Eigen's.

Stitching generates no GEMM: the products between its kernels stay TF ops.  Where TF's
oneDNN is off (the AMD EPYC machines here: ``IsMklEnabled()`` False), TF's ``MatMul``
and ``BatchMatMulV2`` are Eigen's tensor contraction, and XLA:CPU's dot, shipped in the
same TF, is faster on every product of the models suite's Transformer at batch 1
(``tools/op_breakdown.py --interleave --stat min --nodes 'MatMul|dot'``, per product,
fastest of 30 calls: feed-forward [128, 256] x [256, 1024] 1.35-1.6 ms TF vs 0.8 ms
XLA, projections [128, 256] x [256, 256] 0.25 vs 0.2 ms, attention [4, 128, 64] x
[4, 64, 128] 0.13-0.16 vs 0.1 ms): at batch 1 those products were all of the stitched
graph's remaining gap to XLA, whose memory-intensive fusions our kernels already beat.

So each product becomes a call of a one-product function that XLA compiles, the way a
``tf.function(jit_compile=True)`` called from a plain ``tf.function`` is run:

    MatMul(a, b) [-> BiasAdd(., bias)]  ->  PartitionedCall(a, b[, bias], f=xla_dot_N)
                                            with _XlaMustCompile on the node and on f

- The call keeps the name of the node it replaces (the BiasAdd's when a MatMul's only
  consumer is a BiasAdd, which then runs inside the dot's function as TF's remapper ran
  it inside ``_FusedMatMul``), so consumers and fetches are untouched.
- Products of one signature (op, attributes, dtype, bias or not) share one function:
  XLA compiles each function once per input shapes (its compilation cache), the
  projections of every layer share one compile.
- ``_noinline`` keeps Grappler from inlining the function back into the graph.
- Only float32 and float64 products on the CPU, and only where the device profile says
  TF runs Eigen's GEMM (``remapper.onednn``): oneDNN's GEMM was not measured against
  XLA's, and XLA has no kernel for our own op, which never enters these functions.

Numerics: XLA's dot sums in its own order, as a different GEMM kernel does (float
rounding, checked against TF and float64 in tests/test_xladot.py).  The first call at
each new input shape compiles the products (once per process, shape and signature: a
4-layer encoder's first call at a new batch size took ~0.2 s more, docs/internals/
notes.md), where the kernels alone serve every batch size.

Opt-in (``Options(xla_gemm=True)``, ``--xla-gemm``): XLA's dot measured ~3x TF's
largest error against float64 on a [128, 1024] x [1024, 256] product, which the
project's bar (never less accurate than stock TF) does not allow by default, and the
gain was ~4% at batch 1 on the Transformer (none shown at batch 8).
"""
from __future__ import annotations

import hashlib

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, function_pb2, types_pb2

from ..passmanager import Pass
from ..tfgraph import drop_nodes
from . import original

PRODUCTS = ("MatMul", "BatchMatMulV2", "BatchMatMul")
# The functions must be in the runtime's library when the stitched graph, imported into
# the caller's trace, runs: the imported graph's own library does not reach it, and
# tf/function.py defines there the library functions named with the regions' original
# functions' prefix, whether the graph was just stitched or read from the result cache.
PREFIX = original.PREFIX + "xla_dot_"
_DTYPES = (types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE)
# the product's attributes that change what it computes (the rest, such as grad_a,
# are hints): part of the shared function's signature
_PRODUCT_ATTRS = {"MatMul": ("transpose_a", "transpose_b"),
                  "BatchMatMulV2": ("adj_x", "adj_y"), "BatchMatMul": ("adj_x", "adj_y")}
_OUTPUT_ARG = {"MatMul": "product", "BatchMatMulV2": "output", "BatchMatMul": "output"}


def candidates(graph_def, fetched, excluded=frozenset()) -> list:
    """[(product node, BiasAdd node or None)] of every product this pass replaces (the
    blas pass's too).  ``excluded`` (Options(exclude)): node names left as they are:
    such a product is not replaced, and such a BiasAdd is not taken into its
    product's op (the product is replaced, the BiasAdd stays TF's)."""
    consumers: dict = {}
    for nd in graph_def.node:
        for i in nd.input:
            consumers.setdefault(i.lstrip("^").split(":")[0], []).append(nd)
    out = []
    for nd in graph_def.node:
        if nd.op not in PRODUCTS or "T" not in nd.attr or nd.attr["T"].type not in _DTYPES or \
                len([i for i in nd.input if not i.startswith("^")]) != 2 or \
                nd.name in excluded:
            continue
        bias = _bias_of(nd, consumers.get(nd.name, []), fetched)
        out.append((nd, None if bias is not None and bias.name in excluded else bias))
    return out


def _bias_of(product, users, fetched):
    """The BiasAdd that is a MatMul's only consumer, reading it as its value (the
    remapper's _FusedMatMul pattern), or None; the MatMul then disappears, so it must
    not be fetched nor carry control inputs of its own."""
    if product.op != "MatMul" or len(users) != 1 or product.name in fetched or \
            any(i.startswith("^") for i in product.input):
        return None
    bias = users[0]
    if bias.op != "BiasAdd" or bias.input[0] not in (product.name, product.name + ":0") \
            or any(i.split(":")[0] == product.name for i in bias.input[1:]):
        return None
    return bias


def _attr(node, key):
    """A node's attribute as bytes, None when absent (reading a protobuf map's missing
    key would add an empty, invalid AttrValue to the node)."""
    return node.attr[key].SerializeToString() if key in node.attr else None


def _signature(product, bias) -> tuple:
    attrs = tuple(_attr(product, a) for a in ("T",) + _PRODUCT_ATTRS[product.op])
    fmt = _attr(bias, "data_format") if bias is not None else None
    return (product.op, attrs, bias is not None, fmt)


def _function(name: str, product, bias) -> function_pb2.FunctionDef:
    """The one-product FunctionDef XLA compiles: inputs a, b (and bias), output y."""
    fdef = function_pb2.FunctionDef()
    fdef.signature.name = name
    dtype = product.attr["T"].type
    args = ["a", "b"] + (["bias"] if bias is not None else [])
    for arg in args:
        fdef.signature.input_arg.add(name=arg, type=dtype)
    fdef.signature.output_arg.add(name="y", type=dtype)
    # "dot": XLA names its thunk after the node, so profiles show XLA's own word
    body = fdef.node_def.add(name="dot", op=product.op, input=["a", "b"])
    for key in ("T",) + _PRODUCT_ATTRS[product.op]:
        if key in product.attr:
            body.attr[key].CopyFrom(product.attr[key])
    out = "dot:" + _OUTPUT_ARG[product.op] + ":0"
    if bias is not None:
        add = fdef.node_def.add(name="bias_add", op="BiasAdd", input=[out, "bias"])
        for key in ("T", "data_format"):
            if key in bias.attr:
                add.attr[key].CopyFrom(bias.attr[key])
        out = "bias_add:output:0"
    fdef.ret["y"] = out
    fdef.attr["_XlaMustCompile"].b = True
    fdef.attr["_noinline"].b = True
    return fdef


def _call(node, fname: str, inputs, dtype, product, bias) -> None:
    """``node`` (its name, device, control inputs and ``_output_shapes`` kept) turned
    into the call of ``fname``, carrying what the gradient needs (``_dot_grad``)."""
    kind = product.op                   # read before the node (maybe the product) clears
    adjoint = [product.attr[a].b if a in product.attr else False
               for a in _PRODUCT_ATTRS[kind]]
    fmt = (bias.attr["data_format"].s if "data_format" in bias.attr else b"NHWC") \
        if bias is not None else None
    controls = [i for i in node.input if i.startswith("^")]
    shapes = (attr_value_pb2.AttrValue().FromString(
        node.attr["_output_shapes"].SerializeToString())
        if "_output_shapes" in node.attr else None)
    name, device = node.name, node.device
    node.Clear()
    node.name, node.op, node.device = name, "PartitionedCall", device
    node.input.extend(list(inputs) + controls)
    node.attr["Tin"].list.type.extend([dtype] * len(inputs))
    node.attr["Tout"].list.type.append(dtype)
    node.attr["f"].func.name = fname
    node.attr["_XlaMustCompile"].b = True
    node.attr[GRADIENT_ATTR].s = GRADIENT.encode()
    node.attr["_stitching_dot_op"].s = kind.encode()
    node.attr["_stitching_dot_adjoint"].list.b.extend(adjoint)
    if fmt is not None:
        node.attr["_stitching_dot_bias_format"].s = fmt
    if shapes is not None:
        node.attr["_output_shapes"].CopyFrom(shapes)


def rewrite(graph_def, pairs) -> list:
    """Replace each (product, bias) of ``pairs`` in ``graph_def`` (in place) by its call;
    returns the FunctionDefs they call (named by a hash of their signature: one
    definition per name in any process)."""
    have = {f.signature.name for f in graph_def.library.function}
    functions: dict = {}
    fused = set()
    for product, bias in pairs:
        key = _signature(product, bias)
        if key not in functions:
            digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
            functions[key] = _function(f"{PREFIX}{digest}", product, bias)
            if functions[key].signature.name not in have:
                graph_def.library.function.add().CopyFrom(functions[key])
        fname = functions[key].signature.name
        dtype = product.attr["T"].type
        ins = [i for i in product.input if not i.startswith("^")]
        if bias is None:
            _call(product, fname, ins, dtype, product, None)
        else:                               # the BiasAdd's node calls product + bias
            _call(bias, fname, ins + [bias.input[1]], dtype, product, bias)
            fused.add(product.name)
    drop_nodes(graph_def, fused)
    return list(functions.values())


# A tape outside the stitched function differentiates each call through this gradient
# (TF's own for a function call, SymbolicGradient, cannot instantiate an XLA-compiled
# function's gradient): the product written again as TF ops, differentiated by TF's
# registered gradients.  The product itself is dead code in the backward graph (the
# gradients of a product read its inputs, not its value), which Grappler prunes.
GRADIENT_ATTR = "_gradient_op_type"
GRADIENT = "StitchingXlaDot"


_NOT_SAVED = ("the gradient of a stitched function's matrix products (XLA dots, "
              "tf/passes/xladot.py) is not in this SavedModel: import stitching before "
              "tf.saved_model.load (its registered gradient serves), or save the "
              "function with stitching.Options(xla_gemm=False)")


@tf.RegisterGradient(GRADIENT)
def _dot_grad(op, *grads):
    if op is None:
        # tf.saved_model.save traces each custom gradient once, with no op (it passes
        # the op's inputs where the output gradients go), and keeps the result under
        # this name; a process that imports stitching -- which the StitchedKernel op
        # needs anyway -- keeps this registration instead.  The stand-in fails with
        # the reason if ever run.
        check = tf.debugging.Assert(tf.equal(tf.size(grads[0]), -1), [_NOT_SAVED])
        with tf.control_dependencies([check]):
            return [tf.zeros_like(g) for g in grads]
    grad, = grads
    kind = op.get_attr("_stitching_dot_op").decode()
    adj = list(op.get_attr("_stitching_dot_adjoint"))
    # one tensor per input, so each gets its own partial (attention's y y^T reads one
    # tensor twice: tf.gradients would give both entries the sum)
    xs = [tf.identity(t) for t in op.inputs]
    a, b = xs[0], xs[1]
    if kind == "MatMul":
        y = tf.raw_ops.MatMul(a=a, b=b, transpose_a=adj[0], transpose_b=adj[1])
    else:
        y = getattr(tf.raw_ops, kind)(x=a, y=b, adj_x=adj[0], adj_y=adj[1])
    if len(xs) == 3:
        fmt = op.get_attr("_stitching_dot_bias_format").decode()
        y = tf.nn.bias_add(y, xs[2], data_format=fmt)
    return tf.gradients(y, xs, grad_ys=grad)


def _run(ctx):
    from ...plan import profiles
    from . import remapper
    prof = profiles.default()
    if prof.backend != "cpu" or remapper.onednn(prof):
        return None          # measured against Eigen's GEMM only (the module's docstring)
    pairs = candidates(ctx.graph_def, ctx.fetched, ctx.excluded)
    if not pairs:
        return None
    shared = len(rewrite(ctx.graph_def, pairs))
    biased = sum(b is not None for _, b in pairs)
    return (f"{len(pairs)} matrix product(s) run by XLA's dot ({biased} with their "
            f"BiasAdd), {shared} compiled function(s) shared by signature: TF's GEMM "
            f"here is Eigen's (oneDNN off), slower than XLA's (tf/passes/xladot.py; "
            f"Options(xla_gemm=True) asked for it)")


PASS = Pass("xladot", _run, option="xla_gemm")
