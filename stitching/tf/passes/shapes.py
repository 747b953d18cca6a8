"""Reshape targets computed at run time, folded to constants where only one entry is unknown.

Keras's ``Dense`` on a [B, T, D] input (``tf.tensordot``) computes both of its Reshape
targets at run time from ``Shape(x)``:

    Shape(x) -> GatherV2(free) -> Prod --+-> Pack -> Reshape(x, [B*T, D]) -> MatMul
             -> GatherV2(axes) -> Prod --+
             -> GatherV2(free) -> ConcatV2([.., units]) -> Reshape(y, [B, T, units])

eight small TF ops per Dense that each cost a dispatch (a Transformer encoder layer at
batch 1 runs ~70 such ops; XLA runs none: its shapes are static).  With the batch
unknown, Grappler's constant folding cannot fold them.  But each target has at most one
entry that depends on the unknown dims, and ``Reshape`` infers one ``-1`` entry from the
element count, so the target is a constant with -1 in that entry.

Algorithm: for each Reshape left to TF, evaluate its shape input over a two-valued
domain per entry (a known int, or UNKNOWN), through Const, Shape (static dims from the
IR's shape inference, with the dims it lost at an earlier such Reshape filled back in:
``_refined``), GatherV2, Prod, Pack, ConcatV2, StridedSlice (1-D, constant bounds) and
Identity, a scalar Mul or ExpandDims (keras.ops.repeat's target), and the 2-D Pack,
Transpose and flattening Reshape of TF's Tile gradient; any other op, or more than one
UNKNOWN entry, leaves the Reshape
as it is.  The folded Reshape reads a new Const; the shape ops it no longer reads are
pruned by TF when it instantiates the function (they are stateless).
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from ...ir.graph import ValueRef
from ...ir.ops import Kind, kind_of
from ..passmanager import Pass
from ..dim_sources import NotEvaluable, int_attr, strided_slice
from ..tfgraph import drop_nodes

UNKNOWN = None
_MAX_DEPTH = 16            # arbitrary: shape arithmetic chains are a few ops deep


# what this evaluator cannot fold (dim_sources.strided_slice raises it too)
Unfoldable = NotEvaluable


def fold_reshapes(graph_def, original_def, ir_graph, excluded=frozenset()) -> int:
    """Replace, in ``graph_def`` (the rewritten graph, in place), the shape input of each
    Reshape whose target is known but for one entry by a constant; ``original_def`` and
    ``ir_graph``: the graph the IR was built from and the IR (static shapes of the
    tensors a ``Shape`` reads).  ``excluded`` (Options(exclude)): node names left as
    they are: such a Reshape keeps its target, and a target computed through such a
    node stays computed by it (folded, it would go unread).  Returns the number of
    Reshapes folded."""
    # an excluded node is not there for the evaluator: what reads it is Unfoldable
    nodes = {nd.name: nd for nd in graph_def.node if nd.name not in excluded}
    before = {nd.name: nd for nd in original_def.node}
    folded = 0
    memo: dict = {}            # ValueRef -> refined dims (_refined), shared by the Reshapes
    for nd in list(graph_def.node):
        if nd.op != "Reshape" or len([i for i in nd.input if not i.startswith("^")]) != 2 \
                or nd.name in excluded:
            continue
        src = nd.input[1]
        if nodes.get(src.split(":")[0]) is None or nodes[src.split(":")[0]].op == "Const":
            continue
        try:
            target = _value(src, nodes, before, ir_graph, 0, memo)
        except Unfoldable:
            continue
        if not _foldable(target):
            continue
        dtype = nd.attr["Tshape"].type if "Tshape" in nd.attr else tf.int32.as_datatype_enum
        values = np.array([-1 if v is UNKNOWN else v for v in target], np.int64)
        if dtype not in (tf.int32.as_datatype_enum, tf.int64.as_datatype_enum) or (
                dtype == tf.int32.as_datatype_enum and values.max() >= 2 ** 31):
            continue        # a graph file's odd dtype or an overflowing entry: as it was
        const = graph_def.node.add(name=f"{nd.name}/folded_shape", op="Const", device=nd.device)
        const.attr["dtype"].type = dtype
        const.attr["value"].CopyFrom(attr_value_pb2.AttrValue(tensor=tf.make_tensor_proto(
            values, tf.dtypes.as_dtype(dtype))))
        nd.input[1] = const.name
        folded += 1
    return folded


def _foldable(target) -> bool:
    """One -1 is inferred from the element count; a 0 beside it would make that
    ambiguous (TF refuses it), and a negative known entry is the graph's own -1."""
    if not isinstance(target, list) or any(isinstance(v, list) for v in target):
        return False
    unknown = sum(v is UNKNOWN for v in target)
    known = [v for v in target if v is not UNKNOWN]
    return unknown == 1 and all(v > 0 for v in known)


def _value(ref, nodes, before, ir_graph, depth, memo):
    """The value of tensor ``ref``: an int, UNKNOWN, or a list of those (1-D)."""
    name, _, idx = ref.partition(":")
    nd = nodes.get(name)
    if nd is None or depth > _MAX_DEPTH or (idx and idx != "0"):
        raise Unfoldable
    data = [i for i in nd.input if not i.startswith("^")]

    def arg(i):
        return _value(data[i], nodes, before, ir_graph, depth + 1, memo)

    if nd.op == "Const":
        v = tf.make_ndarray(nd.attr["value"].tensor)
        if v.dtype.kind != "i" or v.ndim > 1:
            raise Unfoldable
        return v.tolist()
    if nd.op == "Identity":
        return arg(0)
    if nd.op == "Shape":
        return _static_shape(name, before, ir_graph, depth, memo)
    if nd.op == "GatherV2":
        vals, idx_v, axis = arg(0), arg(1), arg(2)
        if not isinstance(vals, list) or axis != 0 or int_attr(nd, "batch_dims"):
            raise Unfoldable
        pick = idx_v if isinstance(idx_v, list) else [idx_v]
        if any(i is UNKNOWN or not -len(vals) <= i < len(vals) for i in pick):
            raise Unfoldable
        got = [vals[i] for i in pick]
        return got if isinstance(idx_v, list) else got[0]
    if nd.op == "Prod":
        vals, axis = arg(0), arg(1)
        if not isinstance(vals, list) or axis not in (0, [0]) or _flag(nd, "keep_dims"):
            raise Unfoldable
        return UNKNOWN if UNKNOWN in vals else int(np.prod(vals, dtype=np.int64))
    if nd.op == "Pack":         # scalars, or equal-length vectors (a 2-D value)
        vals = [arg(i) for i in range(len(data))]
        nested = [isinstance(v, list) for v in vals]
        if int_attr(nd, "axis") or any(nested) and not (
                all(nested) and len({len(v) for v in vals}) == 1 and
                not any(isinstance(x, list) for v in vals for x in v)):
            raise Unfoldable
        return vals
    if nd.op == "Transpose":    # TF's Tile gradient: transpose(stack([multiples, shape]))
        vals, perm = arg(0), arg(1)
        if perm != [1, 0] or not vals or not all(isinstance(v, list) for v in vals):
            raise Unfoldable
        return [list(col) for col in zip(*vals)]
    if nd.op == "Reshape":      # ... then reshaped to one dim
        vals, shape = arg(0), arg(1)
        if shape not in ([-1], -1) or not isinstance(vals, list):
            raise Unfoldable
        return [x for v in vals for x in (v if isinstance(v, list) else [v])]
    if nd.op == "ConcatV2":
        parts, axis = [arg(i) for i in range(len(data) - 1)], arg(len(data) - 1)
        if axis != 0 or not all(isinstance(p, list) for p in parts):
            raise Unfoldable
        return [v for p in parts for v in p]
    if nd.op == "StridedSlice":
        return strided_slice(nd, arg(0), arg(1), arg(2), arg(3))
    if nd.op == "Mul":           # keras.ops.repeat: the repeated dim's size * repeats
        a, b = arg(0), arg(1)
        if isinstance(a, list) or isinstance(b, list):
            raise Unfoldable
        return UNKNOWN if UNKNOWN in (a, b) else a * b
    if nd.op == "ExpandDims":    # a scalar made a 1-entry piece of a target
        v, axis = arg(0), arg(1)
        if isinstance(v, list) or axis not in (0, -1, [0], [-1]):
            raise Unfoldable
        return [v]
    raise Unfoldable


def _static_shape(name, before, ir_graph, depth, memo):
    """Dims of the tensor Shape node ``name`` reads (as traced), UNKNOWN where unknown."""
    orig = before.get(name)
    if orig is None or orig.op != "Shape":
        raise Unfoldable
    src = [i for i in orig.input if not i.startswith("^")][0]
    node, _, idx = src.partition(":")
    if node not in ir_graph:
        raise Unfoldable
    dims = _refined(ValueRef(node, int(idx or 0)), before, ir_graph, depth, memo)
    if dims is None:
        raise Unfoldable
    return dims


def _refined(ref, before, ir_graph, depth, memo):
    """Dims of IR tensor ``ref`` (None: unknown rank), UNKNOWN where unknown after
    filling what its producer fixes.  TF's shape inference loses a dim at a Reshape
    whose target is computed from a GatherV2 of a Shape (Keras's Dense on [B, T, D]
    infers [?, ?, units]), and every element-wise op after it inherits the loss -- so
    the next Dense's Reshape target had two unknowns and stayed a run-time computation.
    Filled here: a Reshape's dims from its target, evaluated as above; an element-wise
    op's (and a BiasAdd's, from its value) from its operands (right-aligned, NumPy broadcasting: an operand's known dim
    other than 1 is the output's).  Both are what TF computes at run time, so a filled
    dim is the true one whenever the graph runs at all."""
    if ref in memo:
        return memo[ref]
    shape = ir_graph.type_of(ref).shape
    dims = None if shape is None else [UNKNOWN if d < 0 else d for d in shape]
    if dims is not None and UNKNOWN in dims and depth <= _MAX_DEPTH:
        orig = before.get(ref.node)
        if orig is not None and orig.op == "Reshape" and ref.index == 0:
            dims = _from_target(dims, orig, before, ir_graph, depth, memo)
        else:
            node = ir_graph[ref.node]
            # BiasAdd: its value's shape (its bias may run along dim 1, NCHW)
            srcs = node.inputs[:1] if node.op == "BiasAdd" else \
                node.inputs if kind_of(node.op) == Kind.ELEMENTWISE else []
            for src in srcs:
                dims = _broadcast_known(dims, _refined(src, before, ir_graph, depth + 1, memo))
    memo[ref] = dims
    return dims


def _from_target(dims, reshape, before, ir_graph, depth, memo):
    data = [i for i in reshape.input if not i.startswith("^")]
    try:
        target = _value(data[1], before, before, ir_graph, depth + 1, memo)
    except Unfoldable:
        return dims
    if not isinstance(target, list) or len(target) != len(dims):
        return dims
    return [t if d is UNKNOWN and isinstance(t, int) and t >= 0 else d
            for d, t in zip(dims, target)]


def _broadcast_known(dims, operand):
    if operand is None or len(operand) > len(dims):
        return dims
    lead = len(dims) - len(operand)
    return [d if d is not UNKNOWN or i < lead or operand[i - lead] in (UNKNOWN, 1)
            else operand[i - lead] for i, d in enumerate(dims)]


def _flag(nd, name) -> bool:
    return name in nd.attr and nd.attr[name].b


def _run(ctx):
    """Before planning: the IR's shape consumers are planning facts.  A ``Shape`` of a
    value the plan could keep inside a kernel (a rotary embedding's output, read by
    ``keras.ops.repeat``'s run-time Reshape target) made that value a kernel output
    no data consumer reads; once the target is a constant, the Shape and the shape
    arithmetic after it are dead, and they leave the IR and the graph here (with
    any other shape arithmetic nothing reads: reshape_sink.py drops Reshapes)."""
    graph_def = type(ctx.graph_def)()
    graph_def.CopyFrom(ctx.graph_def)
    folded = fold_reshapes(graph_def, ctx.planned, ctx.ir, ctx.excluded)
    dead = _dead_shape_math(graph_def, ctx.shape_math, ctx.pinned)   # excluded: kept
    if not folded and not dead:
        return None
    drop_nodes(graph_def, dead)
    for name in dead:
        ctx.ir.nodes.pop(name, None)
    for node in ctx.ir:           # a folded Reshape no longer waits for its target
        node.order_inputs = [n for n in node.order_inputs if n not in dead]
    ctx.shape_math = ctx.shape_math - dead
    ctx.replace(graph_def)
    ctx.planned = graph_def
    if not folded:
        return None
    return (f"{folded} Reshape target(s) computed at run time (Shape, Gather, "
            "Prod, Concat...) are constants but for one -1 entry (tf/passes/shapes.py)")


def _dead_shape_math(graph_def, shape_math: set, fetched: set) -> set:
    """The shape-arithmetic nodes nothing reads any more (data or control edges),
    found from the consumers inward, and the constants only they read (Grappler's
    constant folding anchors the constants it makes to such a node by a control
    edge)."""
    shape_math = shape_math | {nd.name for nd in graph_def.node if nd.op == "Const"}
    users: dict = {}
    for nd in graph_def.node:
        for i in nd.input:
            src = i.lstrip("^").split(":")[0]
            users[src] = users.get(src, 0) + 1
    inputs = {nd.name: nd.input for nd in graph_def.node}
    todo = [n for n in shape_math if n in inputs and not users.get(n) and n not in fetched]
    dead = set()
    while todo:
        name = todo.pop()
        if name in dead:
            continue
        dead.add(name)
        for i in inputs[name]:
            src = i.lstrip("^").split(":")[0]
            users[src] -= 1
            if src in shape_math and not users[src] and src not in fetched:
                todo.append(src)
    return dead


PASS = Pass("shapes", _run)
