"""SparseSoftmaxCrossEntropyWithLogits as ops the planner fuses, with TF's label check.

Keras' SparseCategoricalCrossentropy(from_logits=True) is this op, so every classifier's
train step has one, between the logits' BiasAdd and the loss gradient's Mul: left to
TF, it cut both of them off the kernels around it.  For logits [B, C] with C known at
trace time, the node is rewritten (before the IR is built) into

    hot  = Cast(Equal(ExpandDims(labels, -1), iota[1, C])) + ExpandDims(check, -1)
    check = GatherV2(zeros[C], labels)                  (TF op: the range check)
    N    = SoftmaxCrossEntropyWithLogits(logits, hot)   (same name: consumers unchanged)

The dense op with a one-hot label is the sparse op's formula (xent_op.h and
sparse_xent_op.h both compute loss = log(sum(exp(s))) - s[label], s = logits -
max(logits), and backprop = exp(s) / sum(exp(s)) - onehot); ir/composites.py expands it,
and Equal, Cast, Add and the broadcasts fuse with it.

Out-of-range labels: TF's CPU kernel fails with InvalidArgument ("Received a label
value of ... outside the valid range").  A one-hot row of zeros would instead give a
finite, wrong loss, so the rewrite keeps a check on the data path: the Gather of a
zero vector by the labels is TF's own bounds-checked op (InvalidArgument "indices[i] =
v is not in [0, C)"), and adding its zeros to the one-hot (exact: x + 0 == x) makes
every output depend on it, so no pruning or reordering can skip it.  Costs B reads of
a C-vector.  Negative labels fail the same check.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from .. import tfgraph
from ..passmanager import Pass

OP = "SparseSoftmaxCrossEntropyWithLogits"
MAX_CLASSES = 1 << 20      # arbitrary: the iota constant stays small


def expand(tf_graph, graph_def):
    """A copy of ``graph_def`` with each rewritable sparse xent expanded, or None."""
    todo = {op.name: op for op in tf_graph.get_operations() if op.type == OP
            and _rewritable(op)}
    if not todo:
        return None
    return tfgraph.expand_nodes(graph_def, todo, _expand)


def _rewritable(op) -> bool:
    logits, labels = op.inputs[0], op.inputs[1]
    if logits.shape.rank != 2 or labels.shape.rank != 1:
        return False
    c = logits.shape[1]
    return (c is not None and 0 < c <= MAX_CLASSES and logits.dtype.is_floating
            and labels.dtype in (tf.int32, tf.int64))


def _expand(nd, op, taken) -> list:
    c = int(op.inputs[0].shape[1])
    t, tl = op.inputs[0].dtype, op.inputs[1].dtype
    logits, labels = nd.input[0], nd.input[1]
    ctrl = [i for i in nd.input if i.startswith("^")]

    def name(suffix):
        return tfgraph.fresh_name(f"{nd.name}/stitching_xent_{suffix}", taken)

    def node(suffix, op_type, inputs, **attrs):
        n = node_def_pb2.NodeDef(name=name(suffix), op=op_type, input=inputs,
                                 device=nd.device)
        for k, v in attrs.items():
            if isinstance(v, tf.DType):
                n.attr[k].type = v.as_datatype_enum
            elif isinstance(v, bool):
                n.attr[k].b = v
            elif isinstance(v, int):
                n.attr[k].i = v
            else:
                n.attr[k].tensor.CopyFrom(v)
        return n

    def const(suffix, value, dtype):
        return node(suffix, "Const", ctrl, dtype=dtype,
                    value=tf.make_tensor_proto(value, dtype=dtype))

    iota = const("iota", np.arange(c).reshape(1, c), tl)
    zeros = const("zeros", np.zeros([c]), t)
    axis = const("axis", np.int32(0), tf.int32)
    last = const("last", np.int32(-1), tf.int32)
    check = node("check", "GatherV2", [zeros.name, labels, axis.name], Tparams=t,
                 Tindices=tl, Taxis=tf.int32, batch_dims=0)
    col = node("labels", "ExpandDims", [labels, last.name], T=tl, Tdim=tf.int32)
    eq = node("equal", "Equal", [col.name, iota.name], T=tl,
              incompatible_shape_error=True)
    hot0 = node("cast", "Cast", [eq.name], SrcT=tf.bool, DstT=t, Truncate=False)
    chk = node("check_col", "ExpandDims", [check.name, last.name], T=t, Tdim=tf.int32)
    hot = node("onehot", "AddV2", [hot0.name, chk.name], T=t)
    dense = node_def_pb2.NodeDef(name=nd.name, op="SoftmaxCrossEntropyWithLogits",
                                 input=[logits, hot.name] + ctrl, device=nd.device)
    dense.attr["T"].type = t.as_datatype_enum
    return [iota, zeros, axis, last, check, col, eq, hot0, chk, hot, dense]


def _run(ctx):
    expanded = expand(ctx.tf_graph, ctx.graph_def)
    if expanded is not None:
        ctx.replace(expanded)


PASS = Pass("sparse_xent", _run)
