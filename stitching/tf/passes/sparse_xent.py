"""SparseSoftmaxCrossEntropyWithLogits as ops the planner fuses, with TF's label check.

Keras' SparseCategoricalCrossentropy(from_logits=True) is this op, so every classifier's
train step has one, between the logits' BiasAdd and the loss gradient's Mul: left to
TF, it cut both of them off the kernels around it.  For logits [..., C] with C known at
trace time, the node is rewritten (before the IR is built) into the ops of TF's sparse
kernel (sparse_xent_op.h), s = logits - max(logits):

    check = GatherV2(zeros[C], labels)                  (TF op: the range check)
    loss  = Sum(Select(labels == iota[C], log(sum(exp(s))) - s, 0)) + check
    backprop = exp(s) / sum(exp(s)) - (Cast(labels == iota[C]) + check)   (if read)
    N     = IdentityN(loss, backprop)                   (same name: consumers unchanged)

The loss picks its label's term with a select, not a one-hot product: a -inf logit
off the label makes log(sum(exp(s))) - s infinite there, and a product with its zero
would be NaN where TF's loss is finite (the dense op with a one-hot label,
SoftmaxCrossEntropyWithLogits, sums that product: this rewrite used it until that NaN
was found).  The ops fuse with the logits' producer and the loss's readers.

A sequence's loss (logits [B, S, C], labels [B, S]: a language model's) reaches the
op reshaped to rows, ``Reshape(logits, [-1, C])`` and ``Reshape(labels, [-1])``; that
Reshape merges dims no view can read (``logits[:, :-1]``'s rows skip one), so there
the loss is computed at the sequence's own rank, and reshaped to rows after: the
slice, the softmax and the loss are one kernel.

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

from .. import dim_sources, tfgraph
from ..passmanager import Pass
from . import grappler

OP = "SparseSoftmaxCrossEntropyWithLogits"
MAX_CLASSES = 1 << 20      # arbitrary: the iota constant stays small


def expand(tf_graph, graph_def, excluded=frozenset()):
    """A copy of ``graph_def`` with each rewritable sparse xent expanded, or None.
    ``excluded`` (Options(exclude)): node names left as they are: such an op stays
    TF's, and a sequence's loss whose row Reshapes are such nodes (the loss at the
    sequence's rank would leave them unread) is computed on the rows they make."""
    todo = {}
    for op in tf_graph.get_operations():
        if op.type != OP or op.name in excluded:
            continue
        rows = _rows_of(op)
        if rows is not None and any(op.inputs[k].op.name in excluded for k in (0, 1)):
            rows = None
        if _rewritable(op) or rows is not None:
            todo[op.name] = (op, rows)
    if not todo:
        return None
    return tfgraph.expand_nodes(graph_def, todo, _expand)


def _rows_of(op):
    """(logits, labels) of rank r and r - 1 (r >= 3) where ``op`` reads them reshaped
    to rows (tf.nn.sparse_softmax_cross_entropy_with_logits of a sequence's logits:
    ``Reshape(logits, [-1, C])``, ``Reshape(labels, [-1])``), else None."""
    if not _rewritable(op):
        return None
    got = []
    for t, want in zip(op.inputs[:2], ([-1, int(op.inputs[0].shape[1])], [-1])):
        if t.op.type != "Reshape":
            return None
        if dim_sources.entries(t.op.inputs[1]) != want:     # a Pack of shape entries
            return None
        got.append(t.op.inputs[0])
    logits, labels = got
    r = logits.shape.rank
    if r is None or r < 3 or labels.shape.rank != r - 1 or \
            logits.shape[-1] != op.inputs[0].shape[1]:
        return None
    return logits, labels


def _rewritable(op) -> bool:
    logits, labels = op.inputs[0], op.inputs[1]
    if logits.shape.rank != 2 or labels.shape.rank != 1:
        return False
    c = logits.shape[1]
    return (c is not None and 0 < c <= MAX_CLASSES and logits.dtype.is_floating
            and labels.dtype in (tf.int32, tf.int64))


def _labels(node, const, labels, rank, c, t, tl):
    """(nodes, (last, check, eq)): the label nodes both rewrites build: the range check
    (a Gather of zeros by the labels, TF's bounds-checked op) and labels == iota, the
    one-hot's bools, at logits' ``rank``; ``last`` the constant axis -1."""
    iota = const("iota", np.arange(c).reshape([1] * (rank - 1) + [c]), tl)
    zeros = const("zeros", np.zeros([c]), t)
    axis = const("axis", np.int32(0), tf.int32)
    last = const("last", np.int32(-1), tf.int32)
    check = node("check", "GatherV2", [zeros.name, labels, axis.name], Tparams=t,
                 Tindices=tl, Taxis=tf.int32, batch_dims=0)
    col = node("labels", "ExpandDims", [labels, last.name], T=tl, Tdim=tf.int32)
    eq = node("equal", "Equal", [col.name, iota.name], T=tl,
              incompatible_shape_error=True)
    return [iota, zeros, axis, last, check, col, eq], (last, check, eq)


def _one_hot(node, out, last, check, eq, t):
    """The one-hot labels in logits' dtype, the range check's zeros added (x + 0 == x:
    every output then depends on the check); its nodes appended to ``out``."""
    hot0 = node("cast", "Cast", [eq.name], SrcT=tf.bool, DstT=t, Truncate=False)
    chk = node("check_col", "ExpandDims", [check.name, last.name], T=t, Tdim=tf.int32)
    hot = node("onehot", "AddV2", [hot0.name, chk.name], T=t)
    out += [hot0, chk, hot]
    return hot


def _builders(nd, taken):
    """(node, const): NodeDef makers for the nodes replacing ``nd`` (fresh names under
    it, its device; constants under its control inputs)."""
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

    return node, const


def _expand(nd, entry, taken) -> list:
    """The loss of logits [..., C] against labels [...] at their own rank, in the ops of
    TF's sparse kernel (sparse_xent_op.h: loss = log(sum(exp(s))) - s[label] as a sum
    of that one term and zeros, backprop = exp(s) / sum(exp(s)) - onehot); a
    sequence's rows (_rows_of) are reshaped to rows afterwards: what reads the rows of
    a slice (``logits[:, :-1]``) then fuses with it, where TF's Reshape to rows merges
    dims no view can.  The range check: a Gather of zeros by the labels, added to the
    loss and the one-hot.  The backprop is computed only where something reads it.
    ``entry``: (the op, its sequence's (logits, labels) or None: ``expand``)."""
    op, got = entry
    if got is None:                       # logits [B, C] as the op reads them
        got = op.inputs[0], op.inputs[1]
    logits, labels = (_name(x) for x in got)
    rank, c = got[0].shape.rank, int(op.inputs[0].shape[1])
    t, tl = op.inputs[0].dtype, op.inputs[1].dtype
    node, const = _builders(nd, taken)
    out, (last, check, eq) = _labels(node, const, labels, rank, c, t, tl)
    zero = const("zero", np.zeros([]), t)
    red = {"T": t, "Tidx": tf.int32}
    m = node("max", "Max", [logits, last.name], keep_dims=True, **red)
    sh = node("shifted", "Sub", [logits, m.name], T=t)
    e = node("exp", "Exp", [sh.name], T=t)
    z = node("sum_exp", "Sum", [e.name, last.name], keep_dims=True, **red)
    lz = node("log", "Log", [z.name], T=t)
    d = node("minus", "Sub", [lz.name, sh.name], T=t)
    pick = node("pick", "SelectV2", [eq.name, d.name, zero.name], T=t)
    loss0 = node("loss_rows", "Sum", [pick.name, last.name], keep_dims=False, **red)
    loss = node("loss_checked", "AddV2", [loss0.name, check.name], T=t)
    out += [zero, m, sh, e, z, lz, d, pick, loss0, loss]

    def as_rows(suffix, x, shape):        # a sequence's values back to TF's rows
        if rank == 2:
            return x
        to = const(f"{suffix}_shape", np.array(shape, np.int32), tf.int32)
        out.extend([to, node(suffix, "Reshape", [x.name, to.name], T=t, Tshape=tf.int32)])
        return out[-1]
    flat = [as_rows("loss", loss, [-1])]
    if op.outputs[1].consumers():
        hot = _one_hot(node, out, last, check, eq, t)
        p = node("softmax", "RealDiv", [e.name, z.name], T=t)
        back = node("backprop_rows", "Sub", [p.name, hot.name], T=t)
        out += [p, back]
        flat.append(as_rows("backprop", back, [-1, c]))
    ident = node_def_pb2.NodeDef(name=nd.name, op="IdentityN", input=[f.name for f in flat],
                                 device=nd.device)
    ident.attr["T"].list.type.extend([t.as_datatype_enum] * len(flat))
    return out + [ident]


def _name(t) -> str:
    """A tensor's input string in a GraphDef."""
    return t.op.name if t.value_index == 0 else f"{t.op.name}:{t.value_index}"


def _run(ctx):
    if not ctx.has_op(OP):              # expand reads only those
        return None
    expanded = expand(ctx.tf_graph, ctx.graph_def, ctx.excluded)
    if expanded is not None:     # readers read the loss and backprop, not the IdentityN
        #                          (a no-op node between the xent and its readers' kernel);
        #                          an excluded IdentityN is kept as a fetched one is
        ctx.replace(grappler.bypass_identity_n(expanded, ctx.pinned))


PASS = Pass("sparse_xent", _run)
