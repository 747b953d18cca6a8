"""Fold BroadcastGradientArgs whose answer is known at trace time into constants.

TF's gradient of a broadcasting binary op (``x[?,768] * gamma[768]``) sums the
upstream gradient over the axes ``BroadcastGradientArgs(Shape(x), Shape(gamma))``
returns at run time.  With an unknown batch dim those axes are not constants, so the
Sum -- a reduction the planner would fuse into LayerNorm's or BatchNorm's backward --
stays a TF op ("... is not a constant").  Keras's ``fit`` traces with unknown batch
dims (``reduce_retracing``), so every such reduction of a Keras training step was
left out.

BroadcastGradientArgs(s0, s1) (TF's BCast): equal shapes give no axes; otherwise, with
both shapes left-padded with 1s to one rank, input k reduces every axis where its
(padded) dim is 1.  With partially known shapes:

    dim of k   other dim        reduced?
    1 / pad    anything         yes
    n > 1      anything         no
    unknown    static 1         no  (if it is 1 at run time, summing a size-1 axis
                                     changes nothing: the gradient is reshaped to
                                     the input's shape right after)
    unknown    unknown          no: assumed equal, the policy the kernels follow for
                                     unknown-vs-unknown broadcasts (docs/limits.md)
    unknown    n > 1            unknown at trace time: left to TF

A fold replaces the node's output with a Const, and only where every reader is a Sum
that only Reshapes read (TF's gradient code: ``reshape(reduce_sum(g, rx), sx)``): if
an unknown-vs-unknown assumption is wrong at run time, the Sum keeps more elements
than the input has and that Reshape fails -- an error, never a wrong gradient.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import tensor_util

from ..passmanager import Pass


def reduce_axes(s0, s1):
    """(r0, r1) for static-or-None dim lists, or None when unknown at trace time."""
    if s0 is None or s1 is None:
        return None
    if len(s0) == len(s1) and all(a is not None and a == b for a, b in zip(s0, s1)):
        return [], []
    rank = max(len(s0), len(s1))
    p0 = [1] * (rank - len(s0)) + list(s0)
    p1 = [1] * (rank - len(s1)) + list(s1)
    out = []
    for mine, other in ((p0, p1), (p1, p0)):
        axes = []
        for i, (d, o) in enumerate(zip(mine, other)):
            if d == 1:
                axes.append(i)
            elif d is None and o is not None and o != 1:
                return None
        out.append(axes)
    return tuple(out)


def _sum_then_reshape(t) -> bool:
    return all(c.type == "Sum" and c.inputs[1] is t and c.outputs[0].consumers() and
               all(r.type == "Reshape" for r in c.outputs[0].consumers())
               for c in t.consumers())


def _static_shape(t):
    s = tensor_util.constant_value_as_shape(t)
    return None if s.rank is None else s.as_list()


def fold(tf_graph, graph_def, excluded=frozenset()):
    """A copy of ``graph_def`` with foldable BroadcastGradientArgs outputs read from
    Const nodes, or None when none was foldable (or none had non-constant output).
    ``excluded`` (Options(exclude)): node names left as they are: such a
    BroadcastGradientArgs is not folded (its readers would read Consts instead, and
    it would run for nothing), nor one a Sum of those reads (its axes would change
    from a node's to a Const)."""
    consts = {}
    for op in tf_graph.get_operations():
        if op.type != "BroadcastGradientArgs" or op.name in excluded or any(
                c.name in excluded for o in op.outputs for c in o.consumers()):
            continue
        if all(tensor_util.constant_value(o) is not None for o in op.outputs):
            continue
        if not all(_sum_then_reshape(o) for o in op.outputs):
            continue
        axes = reduce_axes(_static_shape(op.inputs[0]), _static_shape(op.inputs[1]))
        if axes is not None:
            consts[op.name] = (axes, op.outputs[0].dtype)
    if not consts:
        return None
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    taken = {n.name for n in out.node}
    names = {}
    for name, (axes, dtype) in consts.items():
        for k in (0, 1):
            c = f"{name}/stitching_static_{k}"
            while c in taken:
                c += "_"
            taken.add(c)
            out.node.append(_const_node(c, axes[k], dtype))
            names[(name, k)] = c
    for nd in out.node:
        for i, inp in enumerate(nd.input):
            if inp.startswith("^"):
                continue
            node, _, idx = inp.partition(":")
            c = names.get((node, int(idx or 0)))
            if c is not None:
                nd.input[i] = c
    return out


def _const_node(name, values, dtype):
    nd = tf.compat.v1.NodeDef(name=name, op="Const")
    nd.attr["dtype"].type = dtype.as_datatype_enum
    nd.attr["value"].tensor.CopyFrom(
        tensor_util.make_tensor_proto(np.asarray(values, dtype.as_numpy_dtype),
                                      shape=[len(values)]))
    return nd


def _run(ctx):
    if not ctx.has_op("BroadcastGradientArgs"):     # fold reads only those
        return
    folded = fold(ctx.tf_graph, ctx.graph_def, ctx.excluded)
    if folded is not None:
        ctx.replace(folded)


PASS = Pass("bcast", _run)
