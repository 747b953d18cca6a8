"""Frontend: a traced TF function -> inlined GraphDef -> IR graph.

  python fn ──trace──▶ ConcreteFunction ──Grappler (tf/grappler.py)──▶ GraphDef
       ──import into a scratch tf.Graph (TF shape inference)──▶ IR Graph (one node per TF node)

Grappler (tf/grappler.py) inlines ``PartitionedCall``/``StatefulPartitionedCall``
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
from . import opnames

_DTYPES = {tf.float16: "float16", tf.bfloat16: "bfloat16", tf.float32: "float32",
           tf.float64: "float64", tf.int32: "int32", tf.int64: "int64", tf.bool: "bool"}
TF_DTYPE = {v: k for k, v in _DTYPES.items()}

# A constant whose elements all equal one value becomes an IR Const (folded into
# kernels); a non-uniform constant stays a TF node and becomes a kernel input.
_MAX_SPLAT_ELEMENTS = 1 << 24


def dtype_name(dt: tf.DType) -> str:
    return _DTYPES.get(dt, f"opaque:{dt.name}")


def tensor_type(t: tf.Tensor) -> TensorType:
    shape = None if t.shape.rank is None else tuple(
        -1 if d is None else int(d) for d in t.shape.as_list())
    return TensorType(dtype_name(t.dtype), shape)


# ---------------------------------------------------------------- IdentityN

def bypass_identity_n(graph_def, keep):
    """Consumers of an ``IdentityN`` output read the IdentityN's input directly.

    ``tf.custom_gradient`` (``tf.nn.silu``, ``tf.nn.swish``, Keras activations built on
    it) routes its forward values through an IdentityN that matters only to the
    gradient; in the forward graph it is a no-op node that would cut a fusion region in
    two (SwiGLU's ``silu(gate) * up`` became a kernel plus a lone TF Mul).  An IdentityN
    with control inputs, or named in ``keep`` (fetches, nodes that must survive), is
    left alone; one nothing refers to afterwards is dropped.  Returns ``graph_def``
    itself when there is nothing to do, else a new GraphDef.
    """
    bypass = {n.name: n for n in graph_def.node if n.op == "IdentityN" and n.name not in keep
              and not any(i.startswith("^") for i in n.input)}
    if not bypass:
        return graph_def

    def resolve(ref):
        if ref.startswith("^"):
            return ref
        name, _, idx = ref.partition(":")
        for _ in range(64):                        # IdentityN of IdentityN ...
            if name not in bypass:
                break
            ins = bypass[name].input
            k = int(idx or 0)
            if k >= len(ins):
                return ref                          # malformed: leave it to TF's import
            name, _, idx = ins[k].partition(":")
        return name if idx in ("", "0") else f"{name}:{idx}"

    out = type(graph_def)()
    out.CopyFrom(graph_def)
    for nd in out.node:
        if nd.name not in bypass:
            nd.input[:] = [resolve(i) for i in nd.input]
    used = {i.lstrip("^").partition(":")[0] for nd in out.node if nd.name not in bypass
            for i in nd.input}
    dead = [i for i, nd in enumerate(out.node) if nd.name in bypass and nd.name not in used]
    for i in reversed(dead):
        del out.node[i]
    return out


def resource_shapes(func_graph) -> dict:
    """Resource placeholder name -> (dtype, shape) of the variable it holds.

    A GraphDef does not carry a resource handle's shape, so after serialization
    every ``ReadVariableOp`` would read a tensor of unknown rank (and so would
    everything downstream).  The live FuncGraph still knows it.
    """
    from tensorflow.python.ops import handle_data_util
    out = {}
    for t in func_graph.inputs:
        if t.dtype != tf.resource:
            continue
        data = handle_data_util.get_resource_handle_data(t)
        if data is None or not data.is_set or len(data.shape_and_type) != 1:
            continue
        st = data.shape_and_type[0]
        if st.shape.unknown_rank:
            continue
        out[t.op.name] = (tf.as_dtype(st.dtype), [d.size if d.size >= 0 else None
                                                 for d in st.shape.dim])
    return out


def import_for_shapes(graph_def, resources: dict | None = None) -> tf.Graph:
    """Import into a scratch graph so TF's shape inference types every tensor.

    Reads of variables whose shapes we know (``resources``) are imported as typed
    placeholders: the scratch graph is only for shapes, never run.  Colocations with
    nodes the graph no longer has are dropped from ``graph_def`` first.
    """
    drop_dangling_colocations(graph_def)
    if resources:
        graph_def = _typed_variable_reads(graph_def, resources)
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    return g


def drop_dangling_colocations(graph_def) -> None:
    """Grappler's function inlining leaves colocation constraints (``_class:
    loc:@Func/PartitionedCall_1/input/_4``, from TF's gradient of a function call)
    naming Identity nodes that its later passes, or bypass_identity_n, remove; an import
    refuses them ("expects to be colocated with unknown node").  They only placed a
    node beside one that no longer exists: drop those, in place."""
    present = {n.name for n in graph_def.node}
    for nd in graph_def.node:
        if "_class" not in nd.attr:
            continue
        locs = nd.attr["_class"].list.s
        keep = [c for c in locs if not c.startswith(b"loc:@") or c[5:].decode() in present]
        if len(keep) == len(locs):
            continue
        if keep:
            del locs[:]
            locs.extend(keep)
        else:
            del nd.attr["_class"]


def _typed_variable_reads(graph_def, resources):
    by_name = {n.name: n for n in graph_def.node}

    def source(name):   # follow Identity chains (inlined function arguments)
        seen = 0
        while name in by_name and by_name[name].op == "Identity" and seen < 64:
            name = by_name[name].input[0].split(":")[0].lstrip("^")
            seen += 1
        return name

    out = type(graph_def)()
    out.CopyFrom(graph_def)
    for nd in out.node:
        if nd.op != "ReadVariableOp":
            continue
        src = source(nd.input[0].split(":")[0])
        if src not in resources:
            continue
        dtype, shape = resources[src]
        ctrl = [i for i in nd.input if i.startswith("^")]
        nd.op = "Placeholder"
        del nd.input[:]
        nd.input.extend(ctrl)
        nd.attr.clear()
        nd.attr["dtype"].type = dtype.as_datatype_enum
        nd.attr["shape"].shape.CopyFrom(tf.TensorShape(shape).as_proto())
    return out


# ---------------------------------------------------------------- TF graph -> IR

def to_ir(g: tf.Graph, fetches: list[str], scalar_values=frozenset()) -> Graph:
    """``scalar_values``: the Python scalar arguments of the traced function, whose
    constants become kernel inputs (``_scalar_input``)."""
    nodes = []
    for op in g.get_operations():
        node = _convert(op, scalar_values)
        node.control_inputs = [c.name for c in op.control_inputs]
        read = {r.node for r in node.inputs}
        node.order_inputs = sorted({t.op.name for t in op.inputs if t.op.name not in read
                                    and t.op.type != "Const"})
        nodes.append(node)
    graph = Graph(nodes, [_ref(f) for f in fetches])
    graph.verify()
    return graph


def _ref(name: str) -> ValueRef:
    node, _, idx = name.partition(":")
    return ValueRef(node, int(idx or 0))


def _inputs(op, which=None) -> list[ValueRef]:
    ins = list(op.inputs) if which is None else [op.inputs[i] for i in which]
    return [ValueRef(t.op.name, t.value_index) for t in ins]


def _opaque(op, reason: str | None = None) -> Node:
    attrs = {} if reason is None else {"unfusible": reason}
    return Node(op.name, op.type, _inputs(op), attrs,
                [tensor_type(t) for t in op.outputs], origin=op.name)


def _convert(op, scalar_values=frozenset()) -> Node:
    try:
        node = (scalar_values and _scalar_input(op, scalar_values)) or _convert_known(op)
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
            reason = f"{op.type} is not supported by the fuser yet"
        return _opaque(op, reason)
    # Re-derive the output type with the op table: a node we cannot type is not fusible.
    out_types = [tensor_type(t) for t in op.outputs]
    # A composite's extra outputs (FusedBatchNorm's statistics and reserve space,
    # of unknown rank) are never read when it is fused: check only output 0.
    checked = out_types[:MULTI_OUTPUT.get(node.op, 1)] if node.op in COMPOSITE_OPS \
        else out_types
    # inputs the node reads (a composite reads a prefix: FusedBatchNormGradV3's
    # reserve_space_3, of unknown rank, is not one of them)
    for t in checked + [tensor_type(t) for t in op.inputs[:len(node.inputs)]]:
        if t.dtype.startswith("opaque:"):
            return _opaque(op, f"dtype {t.dtype[7:]} is not supported")
        if t.shape is None:
            return _opaque(op, "a tensor of unknown rank")
    node.outputs = out_types
    node.origin = op.name
    return node


class _Unfusible(Exception):
    pass


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
    if t in COMPOSITE_OPS or t in opnames.COMPOSITES:
        return _convert_composite(op)
    canon = opnames.canonical(t)
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
    elif canon == "Identity" and op.outputs[0].dtype not in _DTYPES:
        return None
    return Node(op.name, canon, ins, attrs)


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


# A Python scalar argument of a stitching.function (``f(x, 1.0)``, ``f(x, 2.0)``, ...:
# TF traces each value as a constant) that only feeds these as a plain operand is a
# kernel *input*, not a value in the kernel's spec: every value gives the same spec,
# one compiled kernel, instead of a compile (~0.5 s) per value.  Reading a scalar
# input costs a load per kernel; where the value itself makes better code it stays in
# the spec: a divisor (x / c lowers to x * (1/c), codegen/lower/exprs.py) and an
# exponent (pow(x, 2) lowers to x * x), which is why those ops are not listed.  The
# constants of the user's own code (and of graph files) stay in the spec.
_VALUE_OPERAND_OPS = frozenset({"Add", "AddV2", "Sub", "Mul", "Maximum", "Minimum",
                                "SquaredDifference", "BiasAdd"})


def _scalar_input(op, scalar_values) -> Node | None:
    """A TF constant kept as a kernel input where ``op`` is a float scalar Const with
    one of ``scalar_values`` (the trace's Python scalar arguments) feeding arithmetic."""
    if op.type != "Const" or not op.outputs[0].dtype.is_floating \
            or op.outputs[0].shape.rank != 0 or not _value_operand(op):
        return None
    value = float(tensor_util.MakeNdarray(op.get_attr("value")))
    return Node(op.name, "TFConst", [], {}) if value in scalar_values else None


def _value_operand(op) -> bool:
    out = op.outputs[0]
    consumers = out.consumers()
    return out.dtype.is_floating and bool(consumers) and all(
        c.type in _VALUE_OPERAND_OPS or (c.type in ("RealDiv", "Div") and
                                         c.inputs[0] is out and c.inputs[1] is not out)
        for c in consumers)


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
    if t.startswith("FusedBatchNormGrad"):
        return _convert_batch_norm_grad(op)
    # FusedBatchNorm / V2 / V3
    if op.get_attr("is_training"):
        raise _Unfusible("training-mode FusedBatchNorm (computes batch statistics)")
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
    tf/grappler.py expands it into TF's own order of Adds first."""
    t = op.type
    if t in ("Tile", "BroadcastTo"):
        return _convert_tile(op)
    if t == "SoftmaxCrossEntropyWithLogits" and op.inputs[0].shape.rank != 2:
        raise _Unfusible("SoftmaxCrossEntropyWithLogits of unknown rank")
    if t == "BiasAddGrad":
        return Node(op.name, t, _inputs(op), {"data_format": op.get_attr("data_format").decode()})
    return Node(op.name, t, _inputs(op), {})


def _convert_batch_norm_grad(op) -> Node:
    """FusedBatchNormGrad / V2 / V3: x, scale and offset gradients (ir/composites.py).
    Channel-last only (NCHW's reductions skip the channel axis in the middle), every
    reduced dim known at trace time (1/n is a constant, as in TF's kernel)."""
    fmt = op.get_attr("data_format").decode()
    x = op.inputs[1].shape
    if fmt not in ("NHWC", "NDHWC") or x.rank not in (4, 5):
        raise _Unfusible(f"FusedBatchNormGrad in {fmt} (only channel-last is fused)")
    if any(len(o.consumers()) for o in op.outputs[3:]):
        raise _Unfusible("FusedBatchNormGrad reserve-space outputs are used")
    if not x[:-1].is_fully_defined():
        raise _Unfusible("FusedBatchNormGrad over dims known only at run time")
    n = int(np.prod(x[:-1].as_list()))
    if n < 1:
        raise _Unfusible("FusedBatchNormGrad of an empty tensor")
    return Node(op.name, "FusedBatchNormGrad", _inputs(op, range(5)),
                {"epsilon": float(op.get_attr("epsilon")),
                 "is_training": bool(op.get_attr("is_training")), "n": n})


def _convert_tile(op) -> Node:
    """A Tile that only repeats size-1 axes, and a BroadcastTo, to a static shape is
    a broadcast (gradients of reductions and of normalization moments emit these):
    the composite Tile (x * ones(shape))."""
    x, y = op.inputs[0].shape, op.outputs[0].shape
    if not y.is_fully_defined() or x.rank is None:
        raise _Unfusible(f"{op.type} with an output shape known only at run time")
    if op.type == "Tile":
        multiples = _const_value(op.inputs[1]).reshape(-1).tolist()
        if any(m != 1 and x[i] != 1 for i, m in enumerate(multiples)):
            raise _Unfusible("Tile repeating an axis of size > 1 (not a broadcast)")
    if op.inputs[0].dtype == tf.bool:
        raise _Unfusible(f"{op.type} of a bool tensor")
    return Node(op.name, "Tile", _inputs(op, [0]), {"shape": y.as_list()})
