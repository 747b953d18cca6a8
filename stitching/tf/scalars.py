"""A stitching.function's Python scalar arguments: planned as inputs, not values.

TF traces a Python number argument as a constant, so ``f(x, 1.0)``, ``f(x, 2.0)``,
... is a retrace per value, and each trace is a graph that differs from the last
only in that constant.  tf.function pays the retrace (~8 ms for a softmax); planning
and rewriting the trace again costs as much once more.  So, before the pipeline
sees a trace, each constant that *is* one of the Python scalar arguments and only
feeds element-wise arithmetic becomes a Placeholder of the same name (``abstract``):
nothing downstream -- Grappler, the planner, the kernels' specs -- can depend on its
value, and the stitched graph is a template every value shares.  ``restore`` puts
the constants back into a copy of it; ``Templates`` keeps the templates per
function, keyed by the abstracted trace, so a new value costs the retrace, a hash of
the trace and a copy of the stitched graph (tools/scalar_bench.py).

Which constants qualify: a float scalar ``Const`` whose value is one of the
arguments and whose every reader uses it as a plain operand of ``_VALUE_OPERAND_OPS``
(or as the dividend of a division).  Anything that may steer a decision stays a
constant: shape-like and integer constants (reduction axes, reshape targets), attrs
(``leaky_relu``'s alpha), a divisor (``x / c`` lowers to ``x * (1/c)``,
codegen/lower/exprs.py) and an exponent (``pow(x, 2)`` becomes ``x * x``).  The
constants of the user's own code (and of graph files) stay in the spec, as do
constants of control-flow bodies, which are abstracted within their own stitch
(a body's graph is a function's, with its own arguments).
"""
from __future__ import annotations

import collections
import threading

import numpy as np
from tensorflow.core.framework import graph_pb2, node_def_pb2, tensor_shape_pb2, types_pb2
from tensorflow.python.framework import tensor_util

_VALUE_OPERAND_OPS = frozenset({"Add", "AddV2", "Sub", "Mul", "Maximum", "Minimum",
                                "SquaredDifference", "BiasAdd"})
_DIVISIONS = frozenset({"RealDiv", "Div"})
_FLOATS = frozenset({types_pb2.DT_HALF, types_pb2.DT_BFLOAT16, types_pb2.DT_FLOAT,
                     types_pb2.DT_DOUBLE})


def abstract(graph_def, values) -> tuple:
    """(``graph_def`` with each qualifying constant a Placeholder, {name: the
    constant's NodeDef}); ``graph_def`` itself, untouched, where none qualifies."""
    if not values:
        return graph_def, {}
    uses = _uses(graph_def)
    consts = {n.name: n for n in graph_def.node
              if _is_argument(n, values) and _value_operand(uses.get(n.name))}
    if not consts:
        return graph_def, {}
    out = graph_pb2.GraphDef()
    out.CopyFrom(graph_def)
    for node in out.node:
        if node.name in consts:
            dtype = node.attr["dtype"].type
            node.op = "Placeholder"
            node.ClearField("attr")
            node.attr["dtype"].type = dtype
            node.attr["shape"].shape.CopyFrom(tensor_shape_pb2.TensorShapeProto())
    return out, {name: node_def_pb2.NodeDef.FromString(n.SerializeToString())
                 for name, n in consts.items()}


def restore(graph_def, consts: dict):
    """A copy of ``graph_def`` (a stitched template) with the Placeholders that
    ``abstract`` made the constants ``consts`` again (one the passes removed is
    simply not there)."""
    if not consts:
        return graph_def
    out = graph_pb2.GraphDef()
    out.CopyFrom(graph_def)
    for node in out.node:
        const = consts.get(node.name)
        if const is not None and node.op == "Placeholder":
            node.CopyFrom(const)
    return out


def _uses(graph_def) -> dict:
    """Node name -> [(reader NodeDef, input position)]; a control edge is position
    None (its value is not read, but a constant so ordered is not a plain operand)."""
    uses = collections.defaultdict(list)
    for node in graph_def.node:
        for i, inp in enumerate(node.input):
            if inp.startswith("^"):
                uses[inp[1:]].append((node, None))
            else:
                uses[inp.partition(":")[0]].append((node, i))
    return uses


def _is_argument(node, values) -> bool:
    """A float scalar Const, with no inputs, whose value is one of ``values`` (the
    Python numbers, as the constant's dtype holds them)."""
    if node.op != "Const" or node.input or node.attr["dtype"].type not in _FLOATS:
        return False
    tensor = node.attr["value"].tensor
    if tensor.tensor_shape.dim or tensor.tensor_shape.unknown_rank:
        return False
    value = tensor_util.MakeNdarray(tensor)
    return any(value == np.asarray(v, value.dtype) for v in values)


def _value_operand(uses) -> bool:
    return bool(uses) and all(
        i is not None and (node.op in _VALUE_OPERAND_OPS or
                           (node.op in _DIVISIONS and i == 0))
        for node, i in uses)


class Templates:
    """Stitched templates by abstracted trace, the most recent ``size`` (a function
    retraced for a new value reads one; its other signatures rarely share it)."""

    def __init__(self, size: int = 16):   # arbitrary: a template is one GraphDef
        self._size = size
        self._lock = threading.Lock()
        self._by_key: collections.OrderedDict = collections.OrderedDict()

    def get(self, key):
        with self._lock:
            hit = self._by_key.get(key)
            if hit is not None:
                self._by_key.move_to_end(key)
            return hit

    def put(self, key, template) -> None:
        with self._lock:
            self._by_key[key] = template
            self._by_key.move_to_end(key)
            while len(self._by_key) > self._size:
                self._by_key.popitem(last=False)
