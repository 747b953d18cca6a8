"""A stitching.function's Python scalar arguments: planned as inputs, not values.

TF traces a Python number argument as a constant, so ``f(x, 1.0)``, ``f(x, 2.0)``,
... is a retrace per value, and each trace is a graph that differs from the last
only in that constant.  tf.function pays the retrace (~8 ms for a softmax); planning
and rewriting the trace again cost as much once more.  So, before the pipeline sees
a trace, each constant that holds one of the Python scalar arguments and only feeds
element-wise arithmetic becomes a Placeholder of the same name (``abstract``):
nothing downstream -- Grappler, the planner, the kernels' specs -- can depend on its
value, and the stitched graph is a template every value shares.  ``Templates`` keeps
a function's templates; a later trace finds one and gets a copy with its own
constants put back (``Abstraction.restore``), so a new value costs the retrace, a
hash of the trace and a copy of the stitched graph (tools/scalar_bench.py).

Which constants: a *candidate* is a float scalar ``Const`` whose every reader uses it
as a plain operand of ``_VALUE_OPERAND_OPS`` (or as the dividend of a division); the
candidates holding an argument's value are abstracted.  Anything that may steer a
decision stays a constant: shape-like and integer constants (reduction axes, reshape
targets), attrs (``leaky_relu``'s alpha), a divisor (``x / c`` lowers to
``x * (1/c)``, codegen/lower/exprs.py) and an exponent (``pow(x, 2)`` becomes
``x * x``).  Constants of control-flow bodies are abstracted within their own
stitch (a body's graph is a function's, with its own arguments).

A value tells an argument's constant from the function's own only by equality:
``f(x, 0.5)`` over a GELU also abstracts GELU's 0.5, ``f(x, 2.0)`` does not.  Both
are correct (an abstracted constant is an input holding its own value), and they
share a template: traces are keyed by their structure with *every* candidate's
value left out, and a template serves a trace whose constants it kept (did not
abstract) hold the same values (``Templates.get``).
"""
from __future__ import annotations

import collections
import hashlib
import threading
from dataclasses import dataclass

import numpy as np
from tensorflow.core.framework import graph_pb2, node_def_pb2, tensor_shape_pb2, types_pb2
from tensorflow.python.framework import tensor_util

_VALUE_OPERAND_OPS = frozenset({"Add", "AddV2", "Sub", "Mul", "Maximum", "Minimum",
                                "SquaredDifference", "BiasAdd"})
_DIVISIONS = frozenset({"RealDiv", "Div"})
_PER_KEY = 4     # arbitrary: templates of one structure (values that equal a constant)
_FLOATS = frozenset({types_pb2.DT_HALF, types_pb2.DT_BFLOAT16, types_pb2.DT_FLOAT,
                     types_pb2.DT_DOUBLE})


@dataclass
class Abstraction:
    """A trace with its argument constants as Placeholders."""
    graph_def: object        # what the pipeline plans
    consts: dict             # every candidate's name -> its Const NodeDef
    abstracted: frozenset    # the candidates that are Placeholders in graph_def

    def structure(self) -> bytes:
        """The trace with every candidate's value left out: what a template's key
        hashes (two values of one function give the same bytes)."""
        blank = graph_pb2.GraphDef()
        blank.CopyFrom(self.graph_def)
        _to_placeholders(blank, self.consts)
        return blank.SerializeToString(deterministic=True)

    def values(self, names) -> dict:
        """Candidates ``names`` -> their values, as bytes (NaN equals NaN, -0.0 is
        not 0.0)."""
        return {name: self.consts[name].attr["value"].tensor.SerializeToString(
            deterministic=True) for name in names}

    def restore(self, template_graph_def, abstracted: frozenset):
        """A copy of a stitched template whose Placeholders ``abstracted`` are this
        trace's constants (one the passes removed is simply not there)."""
        out = graph_pb2.GraphDef()
        out.CopyFrom(template_graph_def)
        for node in out.node:
            if node.name in abstracted and node.op == "Placeholder":
                node.CopyFrom(self.consts[node.name])
        return out


def abstract(graph_def, values) -> Abstraction | None:
    """``graph_def`` with the candidates holding one of ``values`` (the Python numbers
    among a trace's arguments) Placeholders; None where none does."""
    if not values:
        return None
    uses = _uses(graph_def)
    consts = {n.name: n for n in graph_def.node
              if _float_scalar_const(n) and _value_operand(uses.get(n.name))}
    abstracted = frozenset(name for name, n in consts.items() if _holds(n, values))
    if not abstracted:
        return None
    out = graph_pb2.GraphDef()
    out.CopyFrom(graph_def)
    _to_placeholders(out, abstracted)
    return Abstraction(out, {name: node_def_pb2.NodeDef.FromString(n.SerializeToString())
                             for name, n in consts.items()}, abstracted)


def _to_placeholders(graph_def, names) -> None:
    for node in graph_def.node:
        if node.name in names and node.op == "Const":
            dtype = node.attr["dtype"].type
            node.op = "Placeholder"
            node.ClearField("attr")
            node.attr["dtype"].type = dtype
            node.attr["shape"].shape.CopyFrom(tensor_shape_pb2.TensorShapeProto())


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


def _float_scalar_const(node) -> bool:
    if node.op != "Const" or node.input or node.attr["dtype"].type not in _FLOATS:
        return False
    shape = node.attr["value"].tensor.tensor_shape
    return not shape.dim and not shape.unknown_rank


def _holds(node, values) -> bool:
    """Whether the constant is one of ``values``, as its dtype holds them."""
    value = tensor_util.MakeNdarray(node.attr["value"].tensor)
    return any(value == np.asarray(v, value.dtype) for v in values)


def _value_operand(uses) -> bool:
    return bool(uses) and all(
        i is not None and (node.op in _VALUE_OPERAND_OPS or
                           (node.op in _DIVISIONS and i == 0))
        for node, i in uses)


class Templates:
    """A function's stitched templates, by structure (the most recent ``size``)."""

    def __init__(self, size: int = 16):   # arbitrary: a template is one GraphDef
        self._size = size
        self._lock = threading.Lock()
        self._by_key: collections.OrderedDict = collections.OrderedDict()

    @staticmethod
    def key(abstraction: Abstraction, context: str) -> str:
        """``context``: what else the stitched graph depends on (fetches, options,
        the device profile), as text."""
        h = hashlib.sha256(abstraction.structure())
        h.update(context.encode())
        return h.hexdigest()

    def get(self, key, abstraction: Abstraction):
        """(stitched result, the names it abstracted) of a template that serves
        ``abstraction``: one whose kept constants hold this trace's values; or None."""
        with self._lock:
            entries = list(self._by_key.get(key, ()))
        for kept, abstracted, result in entries:
            if abstraction.values(kept) == kept:
                with self._lock:
                    if key in self._by_key:
                        self._by_key.move_to_end(key)
                return result, abstracted
        return None

    def put(self, key, abstraction: Abstraction, result) -> None:
        kept = abstraction.values(set(abstraction.consts) - abstraction.abstracted)
        with self._lock:
            entries = self._by_key.setdefault(key, [])
            entries.append((kept, abstraction.abstracted, result))
            del entries[:-_PER_KEY]
            self._by_key.move_to_end(key)
            while len(self._by_key) > self._size:
                self._by_key.popitem(last=False)
