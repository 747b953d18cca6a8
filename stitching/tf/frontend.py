"""Frontend: a traced TF function -> inlined GraphDef -> IR graph.

  python fn ──trace──▶ ConcreteFunction ──Grappler (tf/passes/grappler.py)──▶ GraphDef
       ──import into a scratch tf.Graph (TF shape inference)──▶ IR Graph (one node per TF node)

Grappler (tf/passes/grappler.py) inlines ``PartitionedCall``/``StatefulPartitionedCall``
bodies (as TF-TRT does) and runs the optimizers of stock ``tf.function`` that change
values (constant folding, the arithmetic optimizer: ``exp(x) - 1`` -> Expm1 ...), so
the graph we rewrite is the graph TF would have run.  Static shapes come from TF's
own shape inference; unknown dims become -1.

Each IR node keeps the TF node's name.  Ops we understand get their canonical
op-table name (or a composite name from ir/composites.py) and their attributes
resolved from constant inputs (reduction axes, reshape targets); every other
node is opaque (``op`` = TF type) and never fused.  Nodes that are almost
fusible carry ``attrs["unfusible"]``: the reason the report will show.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import tensor_util

from ..ir import Graph, Node, TensorType, ValueRef
from ..ir.composites import COMPOSITE_OPS, MULTI_OUTPUT
from ..ir.ops import RUN_TIME_COUNT, SMALL_MATMUL_MAX_WEIGHTS, rest_drop
from ..plan.legality import DEVICE_ATTR
from . import dim_sources, opnames
from .tfgraph import DTYPE_NAMES, VARIABLE_READ
# kept here for their callers (stitching.function, tools): they live in tfgraph.py
from .tfgraph import TF_DTYPE, import_for_shapes, resource_shapes  # noqa: F401

# Marks the EnsureShape nodes control_flow._shape_list_reads adds after a TensorList
# read: a shape TF's runtime already guaranteed, so the check is an Identity here (a
# user's tf.ensure_shape stays a TF op, and checks)
LIST_READ_ATTR = "_stitching_list_read"

# A constant whose elements all equal one value becomes an IR Const (folded into
# kernels); a non-uniform constant stays a TF node and becomes a kernel input.
_MAX_SPLAT_ELEMENTS = 1 << 24


def dtype_name(dt: tf.DType) -> str:
    return DTYPE_NAMES.get(dt, f"opaque:{dt.name}")


def tensor_type(t: tf.Tensor) -> TensorType:
    shape = None if t.shape.rank is None else tuple(
        -1 if d is None else int(d) for d in t.shape.as_list())
    return TensorType(dtype_name(t.dtype), shape)


# ---------------------------------------------------------------- TF graph -> IR

def to_ir(g: tf.Graph, fetches: list[str]) -> Graph:
    nodes = []
    for op in g.get_operations():
        node = _convert(op)
        if op.device:     # a replica's ops under tf.distribute (plan/region.py: one device)
            node.attrs[DEVICE_ATTR] = op.device
        node.control_inputs = [c.name for c in op.control_inputs]
        read = {r.node for r in node.inputs}
        node.order_inputs = sorted({t.op.name for t in op.inputs if t.op.name not in read
                                    and t.op.type != "Const"})
        nodes.append(node)
    _lift_const_controls(nodes)
    graph = Graph(nodes, [_ref(f) for f in fetches])
    graph.verify()
    return graph


def _lift_const_controls(nodes: list) -> None:
    """Move each IR Const's control inputs onto the nodes that read it (in place).

    A Const is folded into every kernel that reads it (plan/region.py), so no edge runs
    from the Const to a fused reader: what its control inputs order is its readers.
    TF's gradients make such Consts (SquaredDifference's: ``with
    control_dependencies([grad]): scalar = constant(2.0)``); left on the Const, the
    edge ``grad -> Const -> reader`` made every kernel holding both ``grad`` and the
    reader look like a cycle through an unfused op (a BatchNorm's backward: its
    variance gradient's Tile in one kernel, the 4 MiB it wrote read by a second).
    On the readers the ordering is the same (the rewrite gives a kernel the control
    inputs of its members) and a kernel holding both ends has none to keep.  The
    GraphDef's Const is copied as it is (tf/passes/rewrite.py)."""
    readers: dict = {}
    for n in nodes:
        for src in {r.node for r in n.inputs} | set(n.control_inputs):
            readers.setdefault(src, []).append(n)
    for n in nodes:                       # topological: a chain of Consts lifts through
        if n.op != "Const" or not n.control_inputs:
            continue
        for r in readers.get(n.name, ()):
            # not where the reader reads it anyway (Grappler anchors a constant it
            # makes to the input it replaces: x + x -> Mul(Const(2) ^x, x))
            have = set(r.control_inputs) | {i.node for i in r.inputs} | {r.name}
            r.control_inputs.extend(c for c in n.control_inputs if c not in have)
        n.control_inputs = []


def _ref(name: str) -> ValueRef:
    node, _, idx = name.partition(":")
    return ValueRef(node, int(idx or 0))


def _inputs(op, which=None) -> list[ValueRef]:
    ins = list(op.inputs) if which is None else [op.inputs[i] for i in which]
    return [ValueRef(t.op.name, t.value_index) for t in ins]


def _opaque(op, reason: str | None = None) -> Node:
    attrs = {} if reason is None else {"unfusible": reason}
    if op.type == "Placeholder" and _is_variable_read(op):
        attrs["held"] = True        # a variable's value: plan/region.py _held
    return Node(op.name, op.type, _inputs(op), attrs,
                [tensor_type(t) for t in op.outputs], origin=op.name)


def _is_variable_read(op) -> bool:
    """A ReadVariableOp that the scratch import typed as a placeholder
    (tfgraph.import_for_shapes)."""
    try:
        return op.get_attr(VARIABLE_READ)
    except ValueError:
        return False


def _convert(op) -> Node:
    try:
        node = _convert_known(op)
    except _Unfusible as e:
        return _opaque(op, str(e))
    if node is None:
        reason = None
        perm = _identity_perm(op)
        if perm is not None:
            # Keras' Tensordot (Dense on a 3-D input) emits these; TF's Grappler drops
            # them (ArithmeticOptimizer, RemoveIdentityTranspose), so they cost nothing
            reason = f"a Transpose with the identity permutation {perm}: a no-op, which " \
                     "TF's Grappler removes"
        elif op.type in opnames.LEFT_TO_TF:
            reason = opnames.LEFT_TO_TF[op.type]
        elif opnames.is_memory_intensive(op.type):
            reason = (f"{op.type} is not supported by the fuser yet (it runs as TF's op; "
                      f"docs/limits.md lists the ops that fuse)")
        return _opaque(op, reason)
    # Re-derive the output type with the op table: a node we cannot type is not fusible.
    out_types = [tensor_type(t) for t in op.outputs]
    # A composite's extra outputs (inference FusedBatchNorm's statistics and reserve
    # space, of unknown rank) are never read when it is fused: check only those that
    # can leave a kernel (MULTI_OUTPUT: training FusedBatchNorm's five).
    checked = out_types[:MULTI_OUTPUT.get(node.op, 1)] if node.op in COMPOSITE_OPS \
        else out_types
    # inputs the node reads (a composite reads a prefix: FusedBatchNormGradV3's
    # reserve_space_3, of unknown rank, is not one of them)
    for t in checked + [tensor_type(t) for t in op.inputs[:len(node.inputs)]]:
        if t.dtype.startswith("opaque:"):
            return _opaque(op, f"dtype {t.dtype[7:]} is not supported")
        if t.shape is None:
            return _opaque(op, _unknown_rank_reason(op))
    node.outputs = out_types
    node.origin = op.name
    return node


UNKNOWN_RANK = ("a tensor of unknown rank (an input_signature, or inputs, with known ranks "
                "let it fuse)")


def _unknown_rank_reason(op) -> str:
    """UNKNOWN_RANK where the unknown rank comes from the graph's inputs; else the op
    whose output TF's shape inference left without a rank while its own inputs have
    one (``tf.numpy_function``, a custom op): an input_signature would not help there,
    and the reason names that op instead."""
    t = next((t for t in list(op.outputs) + list(op.inputs) if t.shape.rank is None), None)
    for _ in range(1000):
        if t is None or t.op.type in ("Placeholder", "_Arg"):
            return UNKNOWN_RANK
        src = t.op
        t = next((i for i in src.inputs if i.dtype != tf.resource and i.shape.rank is None),
                 None)
        if t is None:
            return (f"a tensor of unknown rank, from {src.type} ({src.name}): TF's shape "
                    "inference gives its output no rank though its inputs have one "
                    "(a tf.ensure_shape after it lets it fuse)")
    return UNKNOWN_RANK


class _Unfusible(Exception):
    pass


# arbitrary: a gather is fused as a concatenation of one strided slice per run of
# its indices (constant steps), and every piece is evaluated at every output index
_MAX_GATHER_RUNS = 8


def _convert_gather(op) -> Node:
    """GatherV2 by constant indices on a constant axis: the composite Gather, the
    slices of ``params`` along ``axis`` that the indices' arithmetic runs take,
    concatenated (``[5, 6, 7, 0, 2, 4]``: x[5:8] and x[0:5:2]); a scalar index is one
    slice without the axis.  Every other form stays TF's, with its reason."""
    params = tensor_util.constant_value(op.inputs[0])
    if params is not None and not np.any(params):
        raise _Unfusible("a bounds check of run-time indices (a gather of zeros: TF's "
                         "kernel fails with InvalidArgument on an index out of range), "
                         "kept on purpose")
    if tensor_util.constant_value(op.inputs[2]) is None:
        raise _Unfusible("GatherV2 on an axis known only at run time: not fused")
    if op.get_attr("batch_dims"):
        raise _Unfusible("GatherV2 with batch_dims: not fused yet")
    index = tensor_util.constant_value(op.inputs[1])
    if index is None:
        raise _Unfusible(
            "GatherV2 by run-time indices (an embedding or position lookup): each output "
            "element reads params at an index known only when the kernel runs, a "
            "data-dependent load the kernels do not make yet; fused, it would also have "
            "to fail on an out-of-range index as TF's CPU kernel does (InvalidArgument) "
            "rather than read outside params")
    x = _static_shape(op.inputs[0])
    axis = int(_const_value(op.inputs[2]).reshape(())) % max(len(x), 1)
    index = np.asarray(index)
    if x[axis] < 0:
        raise _Unfusible("GatherV2 along a dim known only at run time: not fused")
    if index.ndim > 1 or index.size == 0:
        raise _Unfusible(f"GatherV2 by a constant index array of shape {list(index.shape)}"
                         ": not fused yet (only scalars and non-empty vectors)")
    flat = [int(i) for i in index.reshape(-1)]
    if any(not 0 <= i < x[axis] for i in flat):
        raise _Unfusible(f"GatherV2 by a constant index outside [0, {x[axis]}): TF's "
                         "InvalidArgument error, left to TF")
    runs = _runs(flat)
    if len(runs) > _MAX_GATHER_RUNS:
        raise _Unfusible(f"GatherV2 by constant indices in {len(runs)} arithmetic runs "
                         f"(each a piece the kernel selects from; limit {_MAX_GATHER_RUNS})")
    return Node(op.name, "Gather", _inputs(op, [0]),
                {"axis": axis, "runs": runs, "squeeze": index.ndim == 0})


def _runs(indices) -> list:
    """[begin, count, step] per maximal run of ``indices`` with one non-zero step."""
    runs, i = [], 0
    while i < len(indices):
        step = indices[i + 1] - indices[i] if i + 1 < len(indices) else 1
        j = i + 1
        if step:
            while j < len(indices) and indices[j] - indices[j - 1] == step:
                j += 1
        runs.append([indices[i], j - i, step if j - i > 1 else 1])
        i = j
    return runs


# arbitrary, as _MAX_GATHER_RUNS: each piece of a segment sum (a strided slice of its
# rows, padded) is evaluated at every output index
_MAX_SEGMENT_PIECES = 8


def _convert_segment_sum(op) -> Node:
    """UnsortedSegmentSum by constant segment ids (TF's dense gradient of a GatherV2 by
    constant indices, on axis 0 of its rows): the composite SegmentSum, a sum of strided
    slices of the rows, each padded with zeros to every segment (ir/composites.py).  A
    negative id drops its row, as in TF; an id past the segments is TF's error."""
    ids = tensor_util.constant_value(op.inputs[1])
    if ids is None:
        raise _Unfusible("UnsortedSegmentSum by run-time segment ids (the gradient of an "
                         "embedding lookup): a data-dependent scatter, not fused")
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise _Unfusible(f"UnsortedSegmentSum by constant ids of shape {list(ids.shape)}: "
                         "only a vector of ids is fused")
    n = _out_shape(op)[0]
    if n < 0:
        raise _Unfusible("UnsortedSegmentSum into a number of segments known only at run "
                         "time")
    flat = [int(i) for i in ids]
    if any(i >= n for i in flat):
        raise _Unfusible(f"UnsortedSegmentSum by a constant segment id outside [0, {n}): "
                         "TF's InvalidArgument error, left to TF")
    if _static_shape(op.inputs[0])[0] != ids.size:
        raise _Unfusible(f"UnsortedSegmentSum by {ids.size} constant ids of rows whose "
                         "count is known only at run time (or another: TF's error)")
    if all(i < 0 for i in flat):
        raise _Unfusible("UnsortedSegmentSum whose constant ids are all negative (a "
                         "tensor of zeros): left to TF")
    pieces = _segment_pieces(flat)
    if len(pieces) > _MAX_SEGMENT_PIECES:
        raise _Unfusible(f"UnsortedSegmentSum by constant ids in {len(pieces)} pieces "
                         "(runs of segments reading rows in one step, per repeat of an "
                         f"id; each a piece the kernel adds; limit {_MAX_SEGMENT_PIECES})")
    return Node(op.name, "SegmentSum", _inputs(op, [0]),
                {"num_segments": n, "pieces": pieces})


def _segment_pieces(ids) -> list:
    """[segment, row, count, step] per piece of a sum by segment ``ids``: layer k maps
    each segment to the k-th row (in increasing order) whose id it is, and a piece is a
    maximal run of consecutive segments of one layer whose rows step evenly."""
    rows = {}
    for i, j in enumerate(ids):
        if j >= 0:
            rows.setdefault(j, []).append(i)
    pieces = []
    for k in range(max(len(r) for r in rows.values())):
        layer = sorted((j, r[k]) for j, r in rows.items() if len(r) > k)
        start = 0
        while start < len(layer):
            (j0, i0), end, step = layer[start], start + 1, None
            while end < len(layer) and layer[end][0] == j0 + end - start:
                d = layer[end][1] - layer[end - 1][1]
                if step is not None and d != step:
                    break
                step, end = d, end + 1
            pieces.append([j0, i0, end - start, step or 1])
            start = end
    return pieces


def _identity_perm(op) -> list | None:
    """The permutation of a Transpose that keeps every axis in place, else None."""
    if op.type != "Transpose" or len(op.inputs) != 2:
        return None
    try:
        perm = _const_value(op.inputs[1]).reshape(-1).tolist()
    except _Unfusible:
        return None
    return perm if perm == list(range(len(perm))) else None


def _const_value(t: tf.Tensor):
    v = tensor_util.constant_value(t)
    if v is None:
        raise _Unfusible(f"{t.op.type} input {t.name} is not a constant")
    return np.asarray(v)


def _axes(op, rank):
    axes = _const_value(op.inputs[1]).reshape(-1).tolist()
    return sorted({a % rank for a in axes}) if rank else []


def _convert_known(op) -> Node | None:
    t = op.type
    if t in _LAYOUT:
        return _LAYOUT[t](op)
    if t in COMPOSITE_OPS or t in opnames.COMPOSITES:
        return _convert_composite(op)
    if t == "Conv2D":
        return _convert_small_conv(op)
    if t == "DepthwiseConv2dNative":
        return _convert_depthwise(op)
    canon = opnames.canonical(t)
    if t == "EnsureShape" and LIST_READ_ATTR in op.node_def.attr:
        canon = "Identity"      # a shape the list guarantees (control_flow._shape_list_reads)
    if canon is None:
        return None
    attrs = {}
    ins = _inputs(op)
    if canon in ("Sum", "Mean", "Max", "Min", "Prod", "All", "Any"):
        rank = op.inputs[0].shape.rank
        if rank is None:
            raise _Unfusible("reduction over a tensor of unknown rank")
        attrs = {"axes": _axes(op, rank), "keep_dims": bool(op.get_attr("keep_dims"))}
        ins = ins[:1]
        if not attrs["axes"]:   # over no axes: a copy (gradients of equal shapes)
            return Node(op.name, "Identity", ins, {})
    elif canon == "Reshape":
        if op.inputs[0].shape.rank is None or op.outputs[0].shape.rank is None:
            raise _Unfusible("reshape with unknown rank")
        attrs = {"shape": [(-1 if d is None else d) for d in op.outputs[0].shape.as_list()]}
        ins = ins[:1]
    elif canon == "Cast":
        attrs = {"to": dtype_name(op.get_attr("DstT"))}
    elif canon == "LeakyRelu":
        attrs = {"alpha": float(op.get_attr("alpha"))}
    elif canon == "Const":
        return _convert_const(op)
    elif canon == "FillLike":
        dt = dtype_name(op.outputs[0].dtype)
        one = 1 if t == "OnesLike" else 0
        attrs = {"value": _py_scalar(np.asarray(one).astype(
            TF_DTYPE[dt].as_numpy_dtype if dt in TF_DTYPE else np.float32)), "dtype": dt}
    elif canon == "Select" and t == "Select":
        if op.inputs[0].shape.rank != op.inputs[1].shape.rank:
            raise _Unfusible("Select with a vector condition (v1 row-select semantics)")
    elif canon == "Identity" and op.outputs[0].dtype not in DTYPE_NAMES:
        return None
    return Node(op.name, canon, ins, attrs)


def _convert_small_conv(op) -> Node | None:
    """A 1x1 convolution over a 1x1 image (squeeze-excite's two products on the pooled
    [N, 1, 1, C] vector) is a small matrix product: SmallMatMul (ir/ops.py), which a
    kernel computes once per image.  Any other convolution stays TF's (None)."""
    x, f = op.inputs
    if x.shape.rank != 4 or f.shape.rank != 4:
        return None
    xs, fs = _static_shape(x), _static_shape(f)
    if op.get_attr("data_format") != b"NHWC" or xs[1:3] != [1, 1] or fs[:2] != [1, 1] or xs[3] != fs[2] \
            or any(d < 2 for d in fs[2:]) or x.dtype not in (tf.float32, tf.float64):
        return None
    if op.get_attr("padding") == b"EXPLICIT" and any(op.get_attr("explicit_paddings")):
        return None
    if fs[2] * fs[3] > SMALL_MATMUL_MAX_WEIGHTS:
        return None
    # strides and dilations move a 1x1 window over a 1x1 image nowhere: any value reads
    # the one pixel, and the output is 1x1 (TF's shape inference says so too)
    if _static_shape(op.outputs[0])[1:] != [1, 1, fs[3]]:
        return None
    return Node(op.name, "SmallMatMul", _inputs(op), {})


def _convert_depthwise(op) -> Node:
    """A depthwise convolution (NHWC, depth multiplier 1, no dilation, float32/64,
    static H, W, C) as DepthwiseConv2D (ir/ops.py), its SAME/VALID/EXPLICIT padding
    made explicit; any other form stays TF's, with the reason (_Unfusible)."""
    x, f = op.inputs
    xs, fs = _static_shape(x), _static_shape(f)
    why = None
    if op.get_attr("data_format") != b"NHWC":
        why = "in NCHW (the kernels read NHWC)"
    elif list(op.get_attr("dilations")) != [1, 1, 1, 1]:
        why = "dilated"
    elif x.dtype not in (tf.float32, tf.float64):
        why = f"of {x.dtype.name}"
    elif len(xs) != 4 or len(fs) != 4 or any(d < 1 for d in xs[1:] + fs):
        why = "over an input whose H, W or C is known only at run time"
    elif fs[3] != 1:
        why = f"with depth multiplier {fs[3]} (1 is fused)"
    if why is not None:
        raise _Unfusible(f"a depthwise convolution {why}: stays TF's")
    strides = list(op.get_attr("strides"))
    if strides[0] != 1 or strides[3] != 1:
        raise _Unfusible("a depthwise convolution striding the batch or channels: "
                         "stays TF's")
    sh, sw = strides[1:3]
    padding = op.get_attr("padding")
    if padding == b"EXPLICIT":
        e = list(op.get_attr("explicit_paddings"))
        if e[:2] != [0, 0] or e[6:] != [0, 0]:
            raise _Unfusible("a depthwise convolution padding the batch or channels: "
                             "stays TF's")
        pads = e[2:6]
    elif padding == b"SAME":       # TF's rule: the output is ceil(in / stride)
        pads = []
        for n, k, st in ((xs[1], fs[0], sh), (xs[2], fs[1], sw)):
            total = max((-(-n // st) - 1) * st + k - n, 0)
            pads += [total // 2, total - total // 2]
    else:
        pads = [0, 0, 0, 0]
    return Node(op.name, "DepthwiseConv2D", _inputs(op),
                {"strides": [int(sh), int(sw)], "pads": [int(p) for p in pads]})


def _convert_const(op) -> Node | None:
    dt = dtype_name(op.outputs[0].dtype)
    if dt.startswith("opaque:"):
        return None
    if op.type == "Fill":
        dims = _const_value(op.inputs[0]).reshape(-1).tolist()
        value = _const_value(op.inputs[1])
        shape = [int(d) for d in dims]
    else:
        value = tensor_util.MakeNdarray(op.get_attr("value"))
        shape = list(value.shape)
    flat = np.asarray(value).reshape(-1)
    if flat.size == 0 or flat.size > _MAX_SPLAT_ELEMENTS or not np.all(flat == flat[0]) \
            and not (np.issubdtype(flat.dtype, np.floating) and np.all(np.isnan(flat))):
        return Node(op.name, "TFConst", [], {})          # stays a TF constant
    v = _py_scalar(flat[0])
    return Node(op.name, "Const", [], {"value": v, "dtype": dt, "shape": shape})


def _py_scalar(v):
    v = np.asarray(v).reshape(())
    if v.dtype == np.bool_:
        return bool(v)
    if np.issubdtype(v.dtype, np.integer):
        return int(v)
    return float(v.astype(np.float64))


def _convert_composite(op) -> Node | None:
    t = op.type
    if t in ("Softmax", "LogSoftmax"):
        return Node(op.name, t, _inputs(op), {})
    if t in ("BiasAdd", "BiasAddV1"):
        fmt = op.get_attr("data_format").decode() if t == "BiasAdd" else "NHWC"
        return Node(op.name, "BiasAdd", _inputs(op), {"data_format": fmt})
    if t in _TRAINING_COMPOSITES:
        return _convert_training(op)
    if t == "AddN":
        # tf/passes/grappler.py expands every AddN of numbers into TF's order of Adds;
        # one left is a sum of one tensor, or of variants (the TensorLists of a loop's
        # gradient), which are not data a kernel computes on
        if op.outputs[0].dtype not in DTYPE_NAMES:
            raise _Unfusible(f"dtype {op.outputs[0].dtype.name} is not supported")
        return Node(op.name, "Identity", _inputs(op, [0]), {})
    if t.startswith("FusedBatchNormGrad"):
        return _convert_batch_norm_grad(op)
    # FusedBatchNorm / V2 / V3
    if op.get_attr("is_training"):
        return _convert_batch_norm_training(op)
    if any(len(o.consumers()) for o in op.outputs[1:]):
        raise _Unfusible("FusedBatchNorm statistics outputs are used")
    fmt = op.get_attr("data_format").decode()
    return Node(op.name, "FusedBatchNorm", _inputs(op, range(5)),
                {"epsilon": float(op.get_attr("epsilon")), "data_format": fmt})


_TRAINING_COMPOSITES = frozenset({"ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad",
                                  "SoftplusGrad", "SigmoidGrad", "TanhGrad", "BiasAddGrad",
                                  "L2Loss", "Tile", "BroadcastTo",
                                  "SoftmaxCrossEntropyWithLogits"})


def _convert_training(op) -> Node:
    """Gradient ops and L2Loss (ir/composites.py expands them).  AddN never gets here:
    tf/passes/grappler.py expands it into TF's own order of Adds first."""
    t = op.type
    if t in ("Tile", "BroadcastTo"):
        return _convert_tile(op)
    if t == "SoftmaxCrossEntropyWithLogits" and op.inputs[0].shape.rank != 2:
        raise _Unfusible("SoftmaxCrossEntropyWithLogits of unknown rank")
    if t == "BiasAddGrad":
        return Node(op.name, t, _inputs(op), {"data_format": op.get_attr("data_format").decode()})
    return Node(op.name, t, _inputs(op), {})


def _convert_batch_norm_training(op) -> Node:
    """FusedBatchNorm / V2 / V3 with is_training: batch statistics, y and the four
    statistics outputs (ir/composites.py).  The old mean and var are read only when
    exponential_avg_factor is not 1 (else they may be empty, as tf.compat.v1's
    fused_batch_norm passes them)."""
    fmt, n = _batch_norm_form(op, op.inputs[0].shape, f"training-mode {op.type}")
    if len(op.outputs) > 5 and op.outputs[5].consumers():
        # the CPU gradient's read is rewired to a zero (tf/passes/bn_reserve.py)
        raise _Unfusible(f"training-mode {op.type} whose reserve_space_3 is read (by a "
                         "GPU gradient, or an op other than its gradient)")
    f = float(op.get_attr("exponential_avg_factor")) if op.type == "FusedBatchNormV3" else 1.0
    return Node(op.name, "FusedBatchNormTraining", _inputs(op, range(3 if f == 1.0 else 5)),
                {"epsilon": float(op.get_attr("epsilon")), "data_format": fmt, "n": n,
                 "exponential_avg_factor": f})


def _batch_norm_form(op, x, what: str) -> tuple:
    """(data_format, n) of a batch norm over ``x`` that fuses: channel-last, or NCHW
    where the axes on one side of the channel axis are all size 1 (tf_keras'
    LayerNormalization reshapes x to [1, rows, cols, 1] NCHW and normalizes each row
    this way), so that the statistics are one contiguous reduction; n is the count of
    each statistic's elements, -1 where known only at run time (the kernel counts it).
    Raises _Unfusible otherwise."""
    fmt = op.get_attr("data_format").decode()
    if x.rank not in (4, 5):
        raise _Unfusible(f"{what} of unknown rank")
    dims = x.as_list()
    channel = 1 if fmt.startswith("NC") else len(dims) - 1
    if channel == 1 and dims[0] != 1 and any(d != 1 for d in dims[2:]):
        raise _Unfusible(
            f"{what} in {fmt} over a batch of {dims[0] or 'unknown size'} and a spatial "
            "size other than 1: its statistics reduce the axes on both sides of the "
            "channel axis, which no fused reduction does yet (channel-last fuses, and "
            "so does tf_keras LayerNormalization's [1, rows, cols, 1] NCHW form)")
    reduced = [d for i, d in enumerate(dims) if i != channel]
    n = -1 if None in reduced else int(np.prod(reduced))
    if n == 0:
        raise _Unfusible(f"{what} of an empty tensor (TF's statistics are NaN there)")
    return fmt, n


def _convert_batch_norm_grad(op) -> Node:
    """FusedBatchNormGrad / V2 / V3: x, scale and offset gradients (ir/composites.py),
    in the forms _batch_norm_form takes (tf_keras LayerNormalization's backward is the
    NCHW one)."""
    if any(len(o.consumers()) for o in op.outputs[3:]):
        raise _Unfusible("FusedBatchNormGrad reserve-space outputs are used")
    fmt, n = _batch_norm_form(op, op.inputs[1].shape, op.type)
    return Node(op.name, "FusedBatchNormGrad", _inputs(op, range(5)),
                {"epsilon": float(op.get_attr("epsilon")), "data_format": fmt,
                 "is_training": bool(op.get_attr("is_training")), "n": n})


def _convert_tile(op) -> Node:
    """A Tile that only repeats size-1 axes, and a BroadcastTo, is a broadcast
    (gradients of reductions and of normalization moments emit these): the composite
    Tile (x * ones(shape)).  Where the output has dims known only at run time that x
    does not carry (a class token broadcast to the batch), the Tile also reads the
    tensor the shape arithmetic took them from (tf/dim_sources.py), for its dims only."""
    x, y = op.inputs[0].shape, op.outputs[0].shape
    if x.rank is None or y.rank is None:
        raise _Unfusible(f"{op.type} of unknown rank")
    if op.inputs[0].dtype == tf.bool:
        raise _Unfusible(f"{op.type} of a bool tensor")
    shape = [-1 if d is None else d for d in y.as_list()]
    # per output dim: None where it is x's own dim (or static: TF's shape inference
    # has it), else where its run-time size comes from: (tensor, dim)
    if op.type == "Tile":
        multiples = dim_sources.entries(op.inputs[1])
        if multiples is None or len(multiples) != x.rank:
            raise _Unfusible("Tile multiples computed by ops other than shape arithmetic")
        # a dim known only at run time that is not tiled (multiple 1: the batch of
        # keras.ops.repeat's Tile) is the input's own: ones of size 1 there broadcast
        if any(m != 1 and x[i] != 1 for i, m in enumerate(multiples)):
            raise _Unfusible("Tile repeating an axis whose size is not 1 (not a broadcast)")
        wanted = [None if m == 1 else m for m in multiples]
    else:
        target = dim_sources.entries(op.inputs[1])
        if target is None or len(target) != y.rank:
            if not y.is_fully_defined():
                raise _Unfusible("BroadcastTo with an output shape known only at run time, "
                                 "computed by ops other than shape arithmetic")
            target = shape
        lead = y.rank - x.rank
        pad = [1] * lead + x.as_list()
        wanted = []
        for i, (t, d) in enumerate(zip(target, pad)):
            if y[i] is not None or d == t or \
                    (isinstance(t, tuple) and t[0].name == op.inputs[0].name and t[1] == i - lead):
                wanted.append(None)             # static, or x's own dim
            elif d is None and isinstance(t, tuple) and \
                    _same_dim(dim_sources.dim_of(op.inputs[0], i - lead), t):
                # x's dim is t's (keras_hub's PositionEmbedding: a table sliced to
                # shape(x)[-2], broadcast to shape(x)): read it from t's tensor too
                wanted.append(t)
            elif d != 1:
                raise _Unfusible("BroadcastTo of a dim of size other than 1 to a run-time "
                                 "size (x's dim may be 1 and broadcast when the op runs, "
                                 "or differ: TF's error)")
            else:
                wanted.append(t)
    like = [-1] * y.rank
    source = None
    for i, t in enumerate(wanted):
        if y[i] is not None or t is None:
            continue
        if not isinstance(t, tuple):        # TF's shape inference keeps constants
            raise _Unfusible(f"{op.type} to a size TF's shape inference did not keep")
        if source is not None and t[0].name != source.name:
            raise _Unfusible(f"{op.type} whose run-time dims come from two tensors")
        source, like[i] = t[0], t[1]
    if source is None:
        return Node(op.name, "Tile", _inputs(op, [0]),
                    {"shape": [1 if d < 0 else d for d in shape]})
    return _broadcast_like(op, source, like, shape)


def _same_dim(a: tuple, b: tuple) -> bool:
    return a[0].name == b[0].name and a[1] == b[1]


def _broadcast_like(op, source, like, shape) -> Node:
    """The Tile node of a broadcast to run-time dims of ``source`` (``like``: per output
    dim, the source dim it takes, or -1): the kernel reads source's shape, not its data.
    Its dims the broadcast does not take are sliced to their first element (so they
    must be static and non-empty), and the ones it takes keep their order."""
    if source.shape.rank is None:
        raise _Unfusible(f"{op.type} to the dims of a tensor of unknown rank")
    src = source.shape.as_list()
    used = [k for k in like if k >= 0]
    if used != sorted(set(used)):
        raise _Unfusible(f"{op.type} to run-time dims in another order than its source's "
                         "(or one dim twice): not fused yet")
    if any(k not in used and (n is None or n < 1) for k, n in enumerate(src)):
        raise _Unfusible(f"{op.type} to run-time dims of a tensor whose other dims are "
                         "known only at run time or empty")
    return Node(op.name, "Tile", [ValueRef(op.inputs[0].op.name, op.inputs[0].value_index),
                                  ValueRef(source.op.name, source.value_index)],
                {"shape": [1 if (d < 0 and like[i] < 0) else d for i, d in enumerate(shape)],
                 "like": like})


# ---------------------------------------------------------------- layout ops
# Index maps with constant parameters (schedule/layout.py folds them into loads).  Each
# is checked here against TF's own static shapes: a node whose parameters are not
# constants, or whose input rank is unknown, stays a TF op with the reason.

def _static_shape(t) -> list:
    if t.shape.rank is None:
        raise _Unfusible(f"{t.op.type} of a tensor of unknown rank")
    return [-1 if d is None else int(d) for d in t.shape.as_list()]


def _out_shape(op, i=0) -> list:
    return _static_shape(op.outputs[i])


def _convert_transpose(op) -> Node | None:
    if _identity_perm(op) is not None:
        return None                 # a no-op TF's Grappler removes (_convert says so)
    rank = len(_static_shape(op.inputs[0]))
    perm = [int(p) % max(rank, 1) for p in _const_value(op.inputs[1]).reshape(-1)]
    return Node(op.name, "Transpose", _inputs(op, [0]), {"perm": perm})


def _convert_slice(op) -> Node:
    """Slice with a constant begin; its size constant, or entries of shape arithmetic
    (tf/dim_sources.py: keras_hub's PositionEmbedding cuts its table to
    ``ops.shape(x)[-2]``), which become a SliceTo reading their tensor's dims."""
    x = _static_shape(op.inputs[0])
    begin = [int(b) for b in _const_value(op.inputs[1]).reshape(-1)]
    counts = dim_sources.entries(op.inputs[2])
    if counts is None or len(counts) != len(x):
        _const_value(op.inputs[2])          # raises: not a constant
        raise _Unfusible("a Slice size that does not match its input's rank")
    size, like = [], []
    for i, (b, k, n) in enumerate(zip(begin, counts, x)):
        if isinstance(k, tuple):
            size.append(_run_time_count(op, i, b, k, n))
            like.append(k if size[-1] == RUN_TIME_COUNT else None)
        else:
            size.append(_whole_or(k, n - b if k == -1 else k, b, n))
            like.append(None)
    return _slice_to(op, {"begin": begin, "size": size, "strides": [1] * len(x),
                          "shape": _out_shape(op)}, like)


def _run_time_count(op, i, b, k, n) -> int:
    """The Slice size entry of input dim i (of size n, taken from b) whose count is
    dim ``k`` = (tensor, dim) at run time: -1 where that is x's own whole dim, else
    RUN_TIME_COUNT (the kernel checks it fits, as TF's Slice does)."""
    x = op.inputs[0]
    if k[0].name == x.name and k[1] == i and b == 0:
        return -1
    if n < 0:
        raise _Unfusible(f"{op.type} of a dim known only at run time to a count known "
                         "only at run time")
    if n < 2:
        raise _Unfusible(f"{op.type} of a dim of size {n} to a count known only at run "
                         "time: not fused")
    if not 0 <= b < n:
        raise _Unfusible(f"{op.type} begin {b} outside a dim of size {n}")
    return RUN_TIME_COUNT


def _slice_to(op, attrs, like) -> Node:
    """The Slice node with ``attrs``; where ``like`` (per output dim: None, or the
    (tensor, dim) that gives its count at run time) names dims, a SliceTo that also
    reads that tensor, for its dims only (ir/composites.py)."""
    sources = {t.name: t for t, _ in filter(None, like)}
    if not sources:
        return Node(op.name, "Slice", _inputs(op, [0]), attrs)
    if len(sources) > 1:
        raise _Unfusible(f"{op.type} whose run-time counts come from two tensors")
    (source,) = sources.values()
    if source.shape.rank is None:
        raise _Unfusible(f"{op.type} to the dims of a tensor of unknown rank")
    if op.inputs[0].dtype == tf.bool:
        raise _Unfusible(f"{op.type} of a bool tensor to a count known only at run time")
    return Node(op.name, "SliceTo", _inputs(op, [0]) + [_ref(source.name)],
                {**attrs, "like": [-1 if k is None else k[1] for k in like]})


def _whole_or(k, size, b, n) -> int:
    """-1 (the whole dim) where the slice takes all of a dim, else its size; a dim of
    unknown size taken only in part stays a TF op."""
    if b == 0 and (k == -1 or k == n) and (n < 0 or k == -1 or k == n):
        return -1 if n < 0 else n
    if n < 0 and k == -1:
        raise _Unfusible(f"a Slice from {b} to the end of a dim known only at run time "
                         "(TF's Slice fails where the dim is shorter than its begin, "
                         "which no kernel checks; x[:, b:], a StridedSlice, fuses)")
    if n < 0:
        raise _Unfusible("a slice of a dim known only at run time")
    return size


def _convert_strided_slice(op) -> Node:
    """StridedSlice with constant bounds, or ends from shape arithmetic
    (``table[:tf.shape(x)[1]]``, tf/dim_sources.py): a SliceTo marked ``clamps``, TF's
    clamping of such an end, which tf/passes/symdims.py keeps out of kernels unless it
    proves that a clamp would fail in TF too."""
    x = _static_shape(op.inputs[0])
    ends = dim_sources.entries(op.inputs[2])
    if ends is None:
        _const_value(op.inputs[2])          # raises: not a constant
    b_out, k_out, s_out, like = _dense_strided_slice(op, x, ends)
    node = _slice_to(op, {"begin": b_out, "size": k_out, "strides": s_out,
                          "shape": _out_shape(op)}, like)
    if node.op == "SliceTo":
        node.attrs["clamps"] = True
    return node


def _convert_strided_slice_grad(op) -> Node:
    """StridedSliceGrad (the gradient of ``x[..., 2:9]``): dy placed back into zeros of
    x's shape, a Pad of dy (the SliceGrad composite) where every stride is 1."""
    x = _out_shape(op)
    b_out, k_out, s_out, _ = _dense_strided_slice(op, x)
    if any(n < 0 and rest_drop(k) is not None for k, n in zip(k_out, x)):
        raise _Unfusible("a StridedSliceGrad of x[:, c:] or x[:, :-c] at a length known "
                         "only at run time: a Pad of dy by constants, but where the "
                         "length is below c TF gives zeros of its length, which a Pad "
                         "does not: not fused")
    if any(n < 0 and k != -1 for k, n in zip(k_out, x)):
        raise _Unfusible("a StridedSliceGrad of part of a dim known only at run time (its "
                         "padding would be an expression of that dim): not fused")
    if any(st != 1 for st in s_out):
        raise _Unfusible("a StridedSliceGrad with a stride other than 1 (zeros between "
                         "its elements) that tf/passes/strided_grad.py left: an empty "
                         "slice, or x with more than one dim known only at run time "
                         "(its regrouping Reshape takes one)")
    if op.inputs[4].dtype == tf.bool:
        raise _Unfusible("StridedSliceGrad of a bool tensor")
    pads = []
    for b, k, n in zip(b_out, k_out, x):
        pads += [0, 0] if k == -1 else [b, n - b - k]
    return Node(op.name, "SliceGrad", _inputs(op, [4]),
                {"shape": k_out, "paddings": pads})


def _dense_strided_slice(op, x, ends=None) -> tuple:
    """(begin, size, strides, like) per dim of ``x`` for a StridedSlice or
    StridedSliceGrad (dim_sources.dense_slice), or the node stays TF's with the reason.
    ``ends``: the ends from tf/dim_sources.py, where some are run-time dims (tensor,
    dim); their sizes become Slice counts (_run_time_count), and ``like`` has the
    (tensor, dim) per output dim whose count is RUN_TIME_COUNT, None elsewhere."""
    try:
        b_out, k_out, s_out, out_dims = dim_sources.dense_slice(op, x, ends)
    except dim_sources.NotEvaluable as e:
        raise _Unfusible(str(e)) from None
    stops = {}
    for i, k in enumerate(k_out):
        if isinstance(k, tuple):
            k_out[i] = _run_time_count(op, i, 0, k, x[i])
            if k_out[i] == RUN_TIME_COUNT:
                stops[i] = k
    return b_out, k_out, s_out, [None if d is None else stops.get(d) for d in out_dims]


def _convert_concat(op) -> Node:
    n = int(op.get_attr("N"))
    rank = len(_static_shape(op.inputs[0]))
    axis = int(_const_value(op.inputs[n]).reshape(())) % max(rank, 1)
    return Node(op.name, "ConcatV2", _inputs(op, range(n)), {"axis": axis})


def _convert_pack(op) -> Node:
    rank = len(_static_shape(op.inputs[0]))
    axis = int(op.get_attr("axis")) % (rank + 1)
    return Node(op.name, "Pack", _inputs(op), {"axis": axis})


def _convert_split(op) -> Node:
    """Split (axis, x), SplitV (x, sizes, axis) and Unpack (x): the Split composite."""
    if op.type == "Split":
        x_in, axis_in = 1, op.inputs[0]
    elif op.type == "SplitV":
        x_in, axis_in = 0, op.inputs[2]
    else:
        x_in, axis_in = 0, None
    x = _static_shape(op.inputs[x_in])
    axis = int(op.get_attr("axis")) if axis_in is None else \
        int(_const_value(axis_in).reshape(()))
    axis %= max(len(x), 1)
    sizes = [_static_shape(o)[axis] if op.type != "Unpack" else 1 for o in op.outputs]
    if x[axis] < 0 or any(k < 0 for k in sizes):
        raise _Unfusible(f"{op.type} of a dim known only at run time")
    return Node(op.name, "Split", _inputs(op, [x_in]),
                {"axis": axis, "sizes": sizes, "squeeze": op.type == "Unpack"})


def _convert_pad(op) -> Node:
    """Pad / PadV2 with constant paddings (and value): the gradient of a Slice."""
    x = _static_shape(op.inputs[0])
    pads = _const_value(op.inputs[1]).reshape(-1, 2).tolist()
    if len(pads) != len(x):
        raise _Unfusible(f"{op.type} paddings do not match the input's rank")
    if any(n < 0 and (lo or hi) for (lo, hi), n in zip(pads, x)):
        raise _Unfusible(f"{op.type} of a dim known only at run time")
    dtype = op.inputs[0].dtype
    if dtype == tf.bool:
        raise _Unfusible(f"{op.type} of a bool tensor")
    value = _const_value(op.inputs[2]).reshape(()) if op.type == "PadV2" else 0
    value = float(value) if dtype.is_floating else int(value)
    return Node(op.name, "Pad", _inputs(op, [0]),
                {"paddings": [int(v) for pair in pads for v in pair], "value": value})


def _convert_reverse(op) -> Node:
    x = _static_shape(op.inputs[0])
    axes = sorted({int(a) % max(len(x), 1) for a in _const_value(op.inputs[1]).reshape(-1)})
    if any(x[a] < 0 for a in axes):
        raise _Unfusible("ReverseV2 of a dim known only at run time")
    return Node(op.name, "Reverse", _inputs(op, [0]), {"axes": axes})


_LAYOUT = {"Transpose": _convert_transpose, "Slice": _convert_slice,
           "GatherV2": _convert_gather, "UnsortedSegmentSum": _convert_segment_sum,
           "Pad": _convert_pad, "PadV2": _convert_pad, "ReverseV2": _convert_reverse,
           "StridedSliceGrad": _convert_strided_slice_grad,
           "StridedSlice": _convert_strided_slice, "ConcatV2": _convert_concat,
           "Pack": _convert_pack, "Split": _convert_split, "SplitV": _convert_split,
           "Unpack": _convert_split}
