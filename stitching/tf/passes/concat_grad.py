"""The gradient of a ConcatV2: Slices whose begin and size are known at trace time.

TF's gradient of ``concat([a, b], axis)`` slices the upstream gradient back into its
pieces with bounds computed at run time:

    ShapeN(a, b) -> s_a, s_b;  ConcatOffset(axis, s_a, s_b) -> offsets o_a, o_b
    Slice(grad, o_a, s_a),  Slice(grad, o_b, s_b)

With the batch dim unknown these are not constants, so the Slices (the backward of a
rotary embedding's rotate-half) stayed TF ops, and the shape reads of ``a`` made ``a``
(``-x2``) an output of the forward kernel that no data consumer needs.  But
ConcatOffset's answer is 0 on every dim but ``axis`` (TF checks the pieces agree
there) and the running sum of the pieces' sizes along ``axis``, known whenever those
sizes are; and the gradient has the concatenation's shape, so on a dim known only at
run time the Slice takes the whole dim (size -1 from 0).  Such a Slice gets constant
begin and size here, and the shape ops only it read are pruned before planning
(tf/passes/shapes.py).  A ConcatOffset whose pieces have unknown sizes along ``axis``,
or a Slice whose input does not have the concatenation's shape, is left as it was.
"""
from __future__ import annotations

import tensorflow as tf
from tensorflow.python.framework import tensor_util

from ..passmanager import Pass
from .bcast import _const_node


def _dims(t):
    return None if t.shape.rank is None else t.shape.as_list()


def _shape_of(t):
    """The tensor whose run-time shape ``t`` is (a Shape, or one output of a ShapeN,
    which TF's gradient code uses), else None."""
    if t.op.type == "Shape":
        return t.op.inputs[0]
    if t.op.type == "ShapeN":
        return t.op.inputs[t.value_index]
    return None


def constant_bounds(op):
    """(begin, size) for a Slice ``op`` of a ConcatV2's gradient, else None."""
    begin, size = op.inputs[1], op.inputs[2]
    co = begin.op
    if co.type != "ConcatOffset":
        return None
    i = begin.value_index
    sources = [_shape_of(s) for s in co.inputs[1:]]
    mine = _shape_of(size)
    if None in sources or mine is None or mine.name != sources[i].name:
        return None
    axis = tensor_util.constant_value(co.inputs[0])
    pieces = [_dims(s) for s in sources]
    grad = _dims(op.inputs[0])
    if axis is None or grad is None or any(p is None or len(p) != len(grad) for p in pieces):
        return None
    axis = int(axis) % len(grad)
    along = [p[axis] for p in pieces]
    if None in along or grad[axis] != sum(along):
        return None
    for d, (g, m) in enumerate(zip(grad, pieces[i])):
        if d != axis and g != m:         # the gradient has the concatenation's shape
            return None
    b = [0] * len(grad)
    b[axis] = sum(along[:i])
    return b, [-1 if d is None else d for d in pieces[i]]


def fold(tf_graph, graph_def, excluded=frozenset()):
    """A new GraphDef with such Slices' bounds constant, or None if there is none.
    ``excluded`` (Options(exclude)): node names left as they are, so neither such a
    Slice nor one whose bounds such a node computes (it would go unread)."""
    todo = {}
    for op in tf_graph.get_operations():
        if op.type == "Slice" and op.name not in excluded and \
                not any(t.op.name in excluded for t in op.inputs[1:]):
            found = constant_bounds(op)
            if found is not None:
                todo[op.name] = found
    if not todo:
        return None
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    extra = []
    for nd in out.node:
        if nd.name in todo:
            begin, size = todo[nd.name]
            index = tf.as_dtype(nd.attr["Index"].type) if "Index" in nd.attr else tf.int32
            b = _const_node(f"{nd.name}/const_begin", begin, index)
            s = _const_node(f"{nd.name}/const_size", size, index)
            nd.input[1], nd.input[2] = b.name, s.name
            extra += [b, s]
    out.node.extend(extra)
    return out


def _run(ctx):
    if not ctx.has_op("Slice"):         # fold reads only those
        return
    new = fold(ctx.tf_graph, ctx.graph_def, ctx.excluded)
    if new is not None:
        ctx.replace(new)


PASS = Pass("concat_grad", _run)
