"""The gradient of a strided slice (``x[:, ::2]``, ``x[..., 1::3]``) as a Pad the kernels fuse.

TF's StridedSliceGrad places dy into zeros of x's shape.  With unit strides the
frontend fuses it as a Pad (the SliceGrad composite); with a stride s > 1 the elements
have s - 1 zeros between them, and no affine index map reads that (the element at i is
dy[(i - b) / s] where s divides i - b, else 0).  Split the strided axis instead: n
elements are Q = ceil(n / s) rows of s, and the elements b, b + s, b + 2s ... of the
slice are column b % s of the rows from b // s on, so placing dy is a Pad of dy with a
size-1 axis after the strided one:

    Reshape(dy) [.., k, 1, ..]
      -> Pad   rows [b // s, Q - b // s - k], column [b % s, s - 1 - b % s]
      -> Reshape [.., Q * s, ..]
      -> Slice [.., :n, ..]                  (only where s does not divide n)

A negative stride reads dy reversed first (ReverseV2), from the lowest index it
writes; a dim of stride 1 is padded in the same Pad.  Every node is TF's own op, so the
rewrite keeps TF's semantics wherever it runs (zeros are placed, never computed: a NaN
of dy stays where dy puts it).  The first Reshape, the Reverse and the Pad fuse with
dy's producer (schedule/layout.py); the regrouping Reshape is a view in TF (a kernel
cannot regroup dims: ir/ops.py), and the trimming Slice folds into the loads of the
kernel that reads it.  The last node keeps the StridedSliceGrad's name, so its readers
are unchanged; the Shape op that only it read goes (the rewrite needs no run-time
shape).  Left as they were, with the frontend's reason: a bool dy, an empty slice,
bounds known only at run time, and more than one dim known only at run time (TF's
Reshape takes one -1).  On a CUDA profile the pass does nothing: that emitter reads no
views, so the Pad would stay TF's and TF's one StridedSliceGrad is the cheaper op.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from ...plan import profiles
from .. import dim_sources, tfgraph
from ..passmanager import Pass


def rewrite(tf_graph, graph_def, excluded=frozenset()):
    """A copy of ``graph_def`` with each strided StridedSliceGrad expanded, or None.
    ``excluded`` (Options(exclude)): node names left as they are: such a
    StridedSliceGrad, or one whose Shape input is such a node (the rewrite drops it),
    stays TF's."""
    todo = {}
    for op in tf_graph.get_operations():
        if op.type == "StridedSliceGrad" and op.name not in excluded and \
                op.inputs[0].op.name not in excluded:
            placement = _placement(op)
            if placement is not None:
                todo[op.name] = placement
    if not todo:
        return None
    out = tfgraph.expand_nodes(graph_def, todo, _expand)
    tfgraph.drop_nodes(out, _shapes_only_they_read(tf_graph, todo))
    return out


def _shapes_only_they_read(tf_graph, todo) -> set:
    """The Shape ops (of the strided slice's input: TF's gradient reads x's shape at
    run time where a dim is unknown) that only the rewritten nodes read: left in the
    graph they would keep that input a kernel output nobody else needs."""
    out = set()
    for name in todo:
        shape = tf_graph.get_operation_by_name(name).inputs[0].op
        if shape.type == "Shape" and all(c.name in todo for c in shape.outputs[0].consumers()):
            out.add(shape.name)
    return out


def _placement(op):
    """(split shape, paddings, reversed axes, merged shape, x's shape) of the rewrite
    of StridedSliceGrad ``op``, or None where it stays as it is."""
    x = op.outputs[0].shape
    if x.rank is None or op.inputs[4].dtype == tf.bool:
        return None
    x = [-1 if d is None else int(d) for d in x.as_list()]
    try:
        begin, size, strides, _ = dim_sources.dense_slice(op, x)
    except dim_sources.NotEvaluable:
        return None
    if all(s == 1 for s in strides) or 0 in size or sum(n < 0 for n in x) > 1 or \
            any(n < 0 and k != -1 for n, k in zip(x, size)):
        return None     # (an index into a run-time dim: its padding would be an
        #                 expression of that dim; the frontend says so)
    split, pads, reverse, merged = [], [], [], []
    for n, b, k, s in zip(x, begin, size, strides):
        if s == 1:
            split.append(k)
            pads.append([0, 0] if k < 0 else [b, n - b - k])
            merged.append(n)
            continue
        if s < 0:                  # written from its lowest index: dy reversed
            reverse.append(len(split))
            b, s = b + (k - 1) * s, -s
        rows = -(-n // s)
        split += [k, 1]
        pads += [[b // s, rows - b // s - k], [b % s, s - 1 - b % s]]
        merged.append(rows * s)
    return split, pads, reverse, merged, x


def _expand(nd, placement, taken) -> list:
    split, pads, reverse, merged, x = placement
    t = nd.attr["T"]
    ctrl = [i for i in nd.input if i.startswith("^")]
    nodes = []

    def fresh(suffix):
        return tfgraph.fresh_name(f"{nd.name}/stitching_strided_grad_{suffix}", taken)

    def node(suffix, op_type, inputs, last=False, **attrs):
        n = node_def_pb2.NodeDef(name=nd.name if last else fresh(suffix), op=op_type,
                                 input=inputs, device=nd.device)
        n.attr["T"].CopyFrom(t)
        for k, v in attrs.items():
            n.attr[k].type = v.as_datatype_enum
        nodes.append(n)
        return n.name

    def const(suffix, value):
        n = node_def_pb2.NodeDef(name=fresh(suffix), op="Const", input=ctrl,
                                 device=nd.device)
        n.attr["dtype"].type = tf.int32.as_datatype_enum
        n.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.asarray(value, np.int32)))
        nodes.append(n)
        return n.name

    trim = merged != x
    y = node("split", "Reshape", [nd.input[4], const("split_shape", split)] + ctrl,
             Tshape=tf.int32)
    if reverse:
        y = node("reverse", "ReverseV2", [y, const("reverse_axes", reverse)], Tidx=tf.int32)
    y = node("pad", "Pad", [y, const("paddings", pads)], Tpaddings=tf.int32)
    y = node("merge", "Reshape", [y, const("merged_shape", merged)], last=not trim,
             Tshape=tf.int32)
    if trim:
        node("trim", "Slice", [y, const("trim_begin", [0] * len(x)), const("trim_size", x)],
             last=True, Index=tf.int32)
    return nodes


def _run(ctx):
    if profiles.default().backend != "cpu":
        return      # the CUDA emitter folds no layout op (no Pad): TF's one op is better
    if not ctx.has_op("StridedSliceGrad"):      # rewrite reads only those
        return None
    new = rewrite(ctx.tf_graph, ctx.graph_def, ctx.excluded)
    if new is not None:
        ctx.replace(new)


PASS = Pass("strided_grad", _run)
