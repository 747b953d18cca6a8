"""BatchMatMul against a shared 2-D weight, rewritten as one GEMM.

Keras 3 lowers every ``EinsumDense`` of a Transformer (the Q/K/V and output
projections of ``MultiHeadAttention``) to ``BatchMatMulV2(x[B, T, D], W[D, E])``.
TF's CPU kernel runs that as B separate [T, D] x [D, E] products; the same work as one
[B*T, D] x [D, E] ``MatMul`` is one large GEMM:

    BatchMatMulV2(x, W)  ->  Reshape(MatMul(Reshape(x, [-1, D]), W), shape(x)[:-1] + [E])

Measured on the 2-core CI machine, x [8, 128, 256] x W [256, 256]: 2.10 -> 1.08 ms
(results equal within float32 rounding: the dot products are the same, summed by a
different kernel).  XLA gets the same effect from its dot canonicalization.

Applied to ``BatchMatMul``/``BatchMatMulV2`` nodes outside fused regions with
``adj_x`` false, a right operand of static rank-2 shape, a left operand
of known rank >= 3 and a float dtype; ``adj_y`` becomes ``transpose_b``.  The node
keeps its name (as the output Reshape), so consumers and fetches are untouched.
"""
from __future__ import annotations

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, types_pb2


BATCH_MATMULS = ("BatchMatMul", "BatchMatMulV2")
_FLOATS = {types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE, types_pb2.DT_HALF, types_pb2.DT_BFLOAT16}


def candidates(graph_def, ir_graph) -> dict:
    """node name -> (K, N) of each BatchMatMul this pass rewrites."""
    out = {}
    for nd in graph_def.node:
        if nd.op not in BATCH_MATMULS or nd.name not in ir_graph:
            continue
        if _flag(nd, "adj_x") or "T" not in nd.attr or nd.attr["T"].type not in _FLOATS:
            continue
        node = ir_graph[nd.name]
        if len(node.inputs) != 2:
            continue
        x, y = (ir_graph.type_of(r) for r in node.inputs)
        if x.shape is None or len(x.shape) < 3 or y.shape is None or len(y.shape) != 2 \
                or min(y.shape) < 0:
            continue
        k, n = (y.shape[1], y.shape[0]) if _flag(nd, "adj_y") else y.shape
        if x.shape[-1] not in (-1, k):
            continue
        out[nd.name] = (k, n)
    return out


def rewrite(graph_def, todo: dict) -> None:
    """Turn each node in ``todo`` (from ``candidates``) into a GEMM, in place: the node
    itself becomes the output Reshape; its helper nodes are appended."""
    i32 = _type(types_pb2.DT_INT32)
    for nd in [nd for nd in graph_def.node if nd.name in todo]:
        k, n = todo[nd.name]
        x, y = [i for i in nd.input if not i.startswith("^")]
        control = [i for i in nd.input if i.startswith("^")]
        name, dev, t, adj_y = nd.name, nd.device, _type(nd.attr["T"].type), _flag(nd, "adj_y")

        def add(suffix, op, inputs, **attrs):
            new = graph_def.node.add(name=f"{name}/gemm/{suffix}", op=op, device=dev)
            new.input.extend(inputs)
            for key, value in attrs.items():
                new.attr[key].CopyFrom(value)
            return new.name

        def const(suffix, value):
            return add(suffix, "Const", [], dtype=i32, value=attr_value_pb2.AttrValue(
                tensor=tf.make_tensor_proto(value, tf.int32)))

        x2 = add("x2d", "Reshape", [x, const("x2d_shape", [-1, k])], T=t, Tshape=i32)
        mm = add("matmul", "MatMul", [x2, y] + control, T=t,
                 transpose_a=attr_value_pb2.AttrValue(b=False),
                 transpose_b=attr_value_pb2.AttrValue(b=adj_y))
        lead = add("lead", "StridedSlice",
                   [add("x_shape", "Shape", [x], T=t, out_type=i32),
                    const("begin", [0]), const("end", [-1]), const("stride", [1])],
                   T=i32, Index=i32, **{m: attr_value_pb2.AttrValue(i=0) for m in (
                       "begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask",
                       "shrink_axis_mask")})
        oshape = add("out_shape", "ConcatV2", [lead, const("n", [n]), const("axis", 0)],
                     N=attr_value_pb2.AttrValue(i=2), T=i32, Tidx=i32)
        nd.op = "Reshape"
        del nd.input[:]
        nd.input.extend([mm, oshape])
        nd.attr.clear()
        nd.attr["T"].CopyFrom(t)
        nd.attr["Tshape"].CopyFrom(i32)


def _flag(nd, name) -> bool:
    """A bool attr, False when absent (GraphDefs may strip default-valued attrs; indexing
    the map would insert an empty AttrValue into the node)."""
    return name in nd.attr and nd.attr[name].b


def _type(t):
    return attr_value_pb2.AttrValue(type=t)
