"""An attention's product -> softmax kernel -> product as one OpenBLAS op.

After the blas pass, an attention is three nodes:

    s = StitchedBatchMatMul(q, k)                       [.., M, N] scores
    p = StitchedKernel[s, mask](softmax(c * s [+ mask]) along the last axis)
    o = StitchedBatchMatMul(p, v)

and the [.., M, N] scores pass through memory four times (written, read and written
by the kernel, read): 4 MiB per layer of the Llama decoder at batch 8.  Where each
intermediate has no other reader and is not fetched, the three become
``StitchedAttention(q, k, v[, mask])`` (runtime/attention.cc), which keeps the scores
of one block of query rows in cache between its two products and its softmax.  The
node keeps ``o``'s name, so its readers and fetches are untouched.

Why match the generated kernel rather than TF's ops before planning: the products
exist only after the gemm, einsum and blas passes (after planning), and the planner
may fuse the scale, mask and softmax with other ops; the kernel's IR (its ``spec``)
says exactly what it computes, so the match is structural: its one output must be
``Mul(e, Reciprocal(Sum(e)))`` with ``e = Exp(Sub(t, Max(t)))`` along the last axis,
``t`` the scores, optionally times a scalar constant and plus a mask input of the
scores' shape or one broadcast to it -- the stitched softmax's (and TF's) order of
operations, which the op follows.

Training graphs are left alone by that rule: the backward reads the softmax's output
(the kernel then has another reader or output).  The registered gradient, for a tape
outside the stitched function, runs the forward again in TF's ops and differentiates
that.

Gated as the blas pass is (TF's GEMM is Eigen's, the library loads);
``Options(fused_attention=False)`` (``--no-fused-attention``) keeps the three ops.
BENCHMARKS.md ``gemm@amd_avx2`` has what it gained (1.06x the Llama decoder at batch
8, within noise of 1.0x at batch 1 and on the Transformer).
"""
from __future__ import annotations

import collections
import json

import numpy as np
import tensorflow as tf

from ..passmanager import Pass
from ..tfgraph import drop_nodes
from . import blas


def _node_of(name, nodes):
    """The node an input names, if it names its first output (no control input)."""
    if name.startswith("^"):
        return None
    base, _, port = name.partition(":")
    return nodes.get(base) if port in ("", "0") else None


def softmax_of(spec):
    """(scores input, scale, mask input or None) when the kernel's IR ``spec`` computes
    exactly softmax(scale * scores [+ mask]) along the last axis as its one output,
    else None (inputs as indices of the kernel's inputs)."""
    nodes, outputs = spec.get("nodes", []), spec.get("outputs", [])
    if len(outputs) != 1:
        return None

    def node(ref, op, nargs):
        """Node ``ref`` (an index; negative: an input) if it is ``op`` with ``nargs``
        arguments."""
        if not isinstance(ref, int) or not 0 <= ref < len(nodes):
            return None
        nd = nodes[ref]
        return nd if nd.get("op") == op and len(nd.get("args", ())) == nargs else None

    def last_axis_reduce(ref, op, of):
        nd = node(ref, op, 1)
        rank = len(nodes[of]["shape"]) if of >= 0 else len(spec["inputs"][-of - 1]["shape"])
        return nd is not None and nd["args"][0] == of and \
            nd["attrs"].get("axes") == [rank - 1] and nd["attrs"].get("keep_dims")

    out = node(outputs[0], "Mul", 2)
    if out is None:
        return None
    for e_ref, r_ref in (out["args"], out["args"][::-1]):
        exp, rcp = node(e_ref, "Exp", 1), node(r_ref, "Reciprocal", 1)
        if exp is None or rcp is None or not last_axis_reduce(rcp["args"][0], "Sum", e_ref):
            continue
        sub = node(exp["args"][0], "Sub", 2)
        if sub is None or not last_axis_reduce(sub["args"][1], "Max", sub["args"][0]):
            continue
        return _logits(nodes, spec["inputs"], sub["args"][0])
    return None


def _logits(nodes, inputs, ref):
    """(scores input, scale, mask input or None) for ``ref`` = scores [* c] [+ mask],
    else None."""
    def shape(r):
        return nodes[r]["shape"] if r >= 0 else inputs[-r - 1]["shape"]

    mask = None
    if ref >= 0 and nodes[ref]["op"] == "Add":
        a, b = nodes[ref]["args"]
        # the mask: an input that does not widen the scores (the Add's shape is theirs)
        for x, m in ((a, b), (b, a)):
            if m < 0 and shape(x) == nodes[ref]["shape"]:
                ref, mask = x, -m - 1
                break
        else:
            return None
    scale = 1.0
    if ref >= 0 and nodes[ref]["op"] == "Mul":
        a, b = nodes[ref]["args"]
        for x, c in ((a, b), (b, a)):
            const = nodes[c] if c >= 0 else None
            if const is not None and const["op"] == "Const" and const["shape"] == [] and \
                    shape(x) == nodes[ref]["shape"]:
                ref, scale = x, float(const["attrs"]["value"])
                break
        else:
            return None
    if ref >= 0:
        return None
    return -ref - 1, scale, mask


def _flag(node, key) -> bool:
    return key in node.attr and node.attr[key].b


def fuse(graph_def, fetched, shapes=None) -> int:
    """Turn each matched product -> softmax kernel -> product into StitchedAttention,
    in place (the module's docstring); returns how many.  ``shapes()``: the graph
    imported with TF's shapes, asked for only where a Reshape stands between the
    pattern's nodes (einsum.py's, after an Einsum's product): one that changes no
    shape is passed over, any other stops the match."""
    nodes = {nd.name: nd for nd in graph_def.node}
    readers = collections.Counter(i.lstrip("^").split(":")[0]
                                  for nd in graph_def.node for i in nd.input)
    imported = []

    def identity(nd) -> bool:
        """Whether Reshape ``nd`` keeps its input's shape: equal ranks, equal known
        dims and at most one unknown, at the same place in both."""
        if shapes is None:
            return False
        if not imported:
            imported.append(shapes())
        try:
            op = imported[0].get_operation_by_name(nd.name)
        except KeyError:
            return False
        a, b = op.inputs[0].shape, op.outputs[0].shape
        if a.rank is None or a.rank != b.rank:
            return False
        dims = list(zip(a.as_list(), b.as_list()))
        unknown = [i for i, (x, y) in enumerate(dims) if x is None or y is None]
        return len(unknown) <= 1 and all(x == y for x, y in dims if x is not None and
                                         y is not None) and \
            all(dims[i] == (None, None) for i in unknown)

    def intermediate(name, op):
        """The node ``name`` names if it is an ``op`` that can go (its only reader is
        the next node of the pattern and it is not fetched), through a Reshape that
        can go and changes no shape; (node, [the Reshape]) or (None, [])."""
        nd = _node_of(name, nodes)
        if nd is None or readers[nd.name] != 1 or nd.name in fetched:
            return None, []
        if nd.op == op:
            return nd, []
        if nd.op == "Reshape" and not any(i.startswith("^") for i in nd.input):
            inner, _ = intermediate(nd.input[0], op)
            if inner is not None and identity(nd):
                return inner, [nd]
        return None, []

    taken, count = set(), 0
    for out in list(graph_def.node):
        if out.op != "StitchedBatchMatMul" or _flag(out, "adj_x") or \
                _flag(out, "transpose_x"):
            continue
        kernel, between = intermediate(out.input[0], "StitchedKernel")
        if kernel is None or kernel.name in taken:
            continue
        try:        # a kernel node of a graph file read in: its spec is untrusted text
            match = softmax_of(json.loads(kernel.attr["spec"].s))
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            match = None
        if match is None:
            continue
        x, scale, mask = match
        data = [i for i in kernel.input if not i.startswith("^")]
        scores, before = intermediate(data[x], "StitchedBatchMatMul")
        dtype = out.attr["T"].type
        if scores is None or scores.name in taken or _flag(scores, "transpose_out") or \
                scores.attr["T"].type != dtype or \
                (dtype == tf.float64.as_datatype_enum and float(np.float32(scale)) != scale):
            continue             # (the op's scale is a float attribute)
        controls = [i for nd in (scores, kernel, out) for i in nd.input if i.startswith("^")]
        inputs = [i for i in scores.input if not i.startswith("^")] + \
            [out.input[1]] + ([data[mask]] if mask is not None else [])
        attrs = {"adj_q": _flag(scores, "adj_x"), "adj_k": _flag(scores, "adj_y"),
                 "transpose_q": _flag(scores, "transpose_x"),
                 "transpose_k": _flag(scores, "transpose_y"),
                 "adj_v": _flag(out, "adj_y"), "transpose_v": _flag(out, "transpose_y"),
                 "transpose_out": _flag(out, "transpose_out")}
        for key in ("adj_x", "adj_y", "transpose_x", "transpose_y", "transpose_out"):
            if key in out.attr:
                del out.attr[key]
        out.op = "StitchedAttention"
        for key, value in attrs.items():
            out.attr[key].b = value
        out.attr["scale"].f = scale
        out.attr["n_mask"].i = 0 if mask is None else 1
        del out.input[:]
        out.input.extend(inputs + sorted(set(controls)))
        taken.update(nd.name for nd in [scores, kernel] + before + between)
        count += 1
    drop_nodes(graph_def, taken)
    return count


def _run(ctx):
    from ...runtime import blas as blas_ops
    if not blas._eigen_machine() or blas_ops.unavailable() is not None:
        return None                       # the blas pass says why, where it matters
    fused = fuse(ctx.graph_def, ctx.fetched, lambda: ctx.shapes_of(ctx.graph_def))
    if not fused:
        return None
    return (f"{fused} attention(s) fused into StitchedAttention (product, softmax kernel "
            f"and product: the scores kept per block of query rows; "
            f"tf/passes/attention.py)")


PASS = Pass("attention", _run, option="fused_attention")


@tf.RegisterGradient("StitchedAttention")
def _attention_grad(op, grad):
    """For a tape outside the stitched function (a stitched function fuses no
    attention whose softmax its own backward reads): the forward again in TF's ops, in
    the layouts BatchMatMulV2 would see, differentiated by TF.  Slower than the fused
    forward, but exact to TF's own gradient."""
    q, k, v = op.inputs[:3]
    mask = op.inputs[3] if len(op.inputs) == 4 else None
    attr = op.get_attr
    with tf.GradientTape() as tape:
        tape.watch(list(op.inputs))
        plain = [blas._swap(t) if attr(key) else t
                 for t, key in ((q, "transpose_q"), (k, "transpose_k"), (v, "transpose_v"))]
        s = tf.linalg.matmul(plain[0], plain[1], adjoint_a=attr("adj_q"),
                             adjoint_b=attr("adj_k")) * tf.cast(attr("scale"), q.dtype)
        p = tf.nn.softmax(s + mask if mask is not None else s, -1)
        out = tf.linalg.matmul(p, plain[2], adjoint_b=attr("adj_v"))
        out = blas._swap(out) if attr("transpose_out") else out
    return tape.gradient(out, list(op.inputs), output_gradients=grad)
