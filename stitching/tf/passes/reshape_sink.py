"""A Transpose of a Reshape that only groups dims becomes a Reshape of a Transpose.

Grouped-query attention repeats each K/V head (``keras.ops.repeat``, Llama's
``repeat_kv``) and then moves the heads in front of the sequence:

    k [B,T,2,32] -> ExpandDims [B,T,2,1,32] -> Tile [B,T,2,4,32]
      -> Reshape [B,T,8,32] -> Transpose(0,2,1,3) [B,8,T,32] -> BatchMatMul

The kernels fold a Transpose into their loads as an affine index map
(schedule/layout.py), but the Reshape in between regroups dims (2x4 -> 8): head h of
the transpose is element h // 4 of the Tile's input, not affine, so the Transpose
stayed a lone TF op and the Tile a kernel of its own.  A Reshape that only merges (or
splits) runs of adjacent dims commutes with a Transpose that moves whole groups:

    Transpose(Reshape(x, groups), perm) == Reshape(Transpose(x, perm'), ...)

where perm' moves x's dims group by group in the order perm moves the groups.  The
Transpose now reads the Tile directly (a broadcast along the repeat axis: a stride-0
view), so the rotary embedding, the repeat and the head transpose are one kernel, and
the Reshape after it is a view in TF (no copy).  Layout only: the same elements in the
same order, no bit changes.

Done on TF's graph before it is lifted: the IR then simply has a Transpose of a Tile.
Left as they were: dims known only at run time inside a group (the new Reshape's
target is a constant with at most one -1), and transposes whose perm or input shape is
not known at trace time.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import tensor_util

from ..passmanager import Pass
from .bcast import _const_node


def groups(x: list, y: list) -> list | None:
    """For a Reshape x -> y (dims, None where unknown): per y dim, the run of x dims it
    merges (size-1 x dims join the run before them, or the first), or None when the
    Reshape does anything but group adjacent dims.  A dim known only at run time must
    be its own group, on both sides."""
    out, i = [], 0
    for d in y:
        run = []
        if d is None:
            while i < len(x) and x[i] == 1:
                run.append(i)
                i += 1
            if i == len(x) or x[i] is not None:
                return None
            run.append(i)
            i += 1
        else:
            size = 1
            while i < len(x) and x[i] is not None and size * x[i] <= d and (
                    size < d or x[i] == 1):
                size *= x[i]
                run.append(i)
                i += 1
            if size != d:
                return None
        out.append(run)
    while i < len(x) and x[i] == 1:             # trailing size-1 dims of x
        if not out:
            return None
        out[-1].append(i)
        i += 1
    return out if i == len(x) else None


def sunk(op):
    """(x, perm', target) for a Transpose ``op`` of a grouping Reshape, else None."""
    r = op.inputs[0].op
    if r.type != "Reshape":
        return None
    x, y = r.inputs[0].shape, r.outputs[0].shape
    perm = tensor_util.constant_value(op.inputs[1])
    if x.rank is None or y.rank is None or perm is None or x.rank == y.rank:
        return None
    dims = x.as_list()
    g = groups(dims, y.as_list())
    # a Reshape that only adds or drops size-1 dims the kernels read through already
    if g is None or not any(sum(dims[i] != 1 for i in run) > 1 for run in g):
        return None
    perm = [int(p) % y.rank for p in np.asarray(perm).reshape(-1)]
    new_perm = [d for p in perm for d in g[p]]
    out = op.outputs[0].shape.as_list()
    if out.count(None) > 1:
        return None
    target = [-1 if d is None else d for d in out]
    return r.inputs[0], new_perm, target


def sink(tf_graph, graph_def, excluded=frozenset()):
    """A new GraphDef with every such Transpose rewritten, or None if there is none.
    The Transpose's node keeps its name (its consumers and fetches still resolve) and
    becomes the Reshape; the Transpose is ``<name>/sunk``.  ``excluded``
    (Options(exclude)): node names left as they are: neither such a Transpose nor one
    of such a Reshape (which the rewrite would leave unread, and drop) moves."""
    todo = {}
    for op in tf_graph.get_operations():
        if op.type == "Transpose" and len(op.inputs) == 2 and op.name not in excluded \
                and op.inputs[0].op.name not in excluded:
            found = sunk(op)
            if found is not None:
                todo[op.name] = found
    if not todo:
        return None
    # a Reshape only sunk Transposes read is dead after the rewrite: left in, it would
    # make the Tile before it a kernel output (the shape arithmetic of its target is
    # pruned with the other dead shape arithmetic, tf/passes/shapes.py)
    ordered = {i[1:] for nd in graph_def.node for i in nd.input if i.startswith("^")}
    dead = {r.name for r in {tf_graph.get_operation_by_name(n).inputs[0].op for n in todo}
            if all(c.type == "Transpose" and c.name in todo for c in r.outputs[0].consumers())
            and r.name not in ordered}
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    del out.node[:]
    for nd in graph_def.node:
        if nd.name in dead:
            continue
        if nd.name not in todo:
            out.node.extend([nd])
            continue
        x, perm, target = todo[nd.name]
        perm_c = _const_node(f"{nd.name}/sunk_perm", perm, tf.int32)
        shape_c = _const_node(f"{nd.name}/sunk_shape", target, tf.int32)
        t = tf.compat.v1.NodeDef(name=f"{nd.name}/sunk", op="Transpose", device=nd.device)
        t.input.extend([x.name if x.value_index else x.op.name, perm_c.name])
        t.input.extend(i for i in nd.input if i.startswith("^"))
        t.attr["T"].CopyFrom(nd.attr["T"])
        t.attr["Tperm"].type = tf.int32.as_datatype_enum
        r = tf.compat.v1.NodeDef(name=nd.name, op="Reshape", device=nd.device)
        r.input.extend([t.name, shape_c.name])
        r.attr["T"].CopyFrom(nd.attr["T"])
        r.attr["Tshape"].type = tf.int32.as_datatype_enum
        out.node.extend([perm_c, shape_c, t, r])
    return out


def _run(ctx):
    if not ctx.has_op("Transpose"):     # sink reads only those
        return
    new = sink(ctx.tf_graph, ctx.graph_def, ctx.excluded)
    if new is not None:
        ctx.replace(new)


PASS = Pass("reshape_sink", _run)
