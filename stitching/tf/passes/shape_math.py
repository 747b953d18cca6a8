"""Shape arithmetic marked before planning: nodes that compute only on shapes.

A Prod of a Shape for a Reshape target runs on a handful of host integers, not on
tensor data: not memory-intensive work (XLA constant-folds it).  So are integers whose
every reader takes them as a shape, size or axis (``concat([[d1], [d2], [d3]])`` as
the dims of a Fill): fused into a kernel they would also hide their values from TF's
shape inference, which propagates constants through them (a call ``f(1, 2, 3)``
inside another function gets the static shape [1, 2, 3]).  The IR nodes get the
reason as ``unfusible`` and the report leaves them out of its counts
(``ctx.shape_math``).
"""
from __future__ import annotations

from tensorflow.core.framework import types_pb2

from .. import opnames
from ..passmanager import Pass

_SHAPE_SOURCES = frozenset({"Shape", "ShapeN", "Size", "Rank"})
# Operands read on the host as a shape, size, count or axis: op -> input positions
# (ConcatV2's axis, its last input, is handled apart).
_SHAPE_OPERANDS = {
    "Fill": {0}, "Reshape": {1}, "BroadcastTo": {1}, "Tile": {1}, "ExpandDims": {1},
    "Transpose": {1}, "Slice": {1, 2}, "StridedSlice": {1, 2, 3}, "Pad": {1},
    "PadV2": {1}, "MirrorPad": {1}, "Range": {0, 1, 2}, "OneHot": {1},
    "Sum": {1}, "Mean": {1}, "Max": {1}, "Min": {1}, "Prod": {1}, "All": {1},
    "Any": {1}, "Split": {0}, "SplitV": {1, 2}, "RandomUniform": {0},
    "RandomStandardNormal": {0}, "TruncatedNormal": {0}, "Empty": {0}}
_INTEGERS = frozenset({types_pb2.DT_INT32, types_pb2.DT_INT64})
# Random numbers from constant or shape operands (a dropout mask's) are data, new at
# every call, and so is everything computed from them: never shape arithmetic.  What
# constants and shapes alone make (a Fill, a Range, a causal mask) is the same at
# every call: TF's constant folding folds it where the shapes are static.
_RANDOM = opnames.STATEFUL_RANDOM | opnames.KEYED_RANDOM
SHAPE_MATH = ("shape arithmetic: a few host integers, which TF's constant folding and "
              "tf/passes/shapes.py fold; not memory-intensive work")


def shape_arithmetic(gdef) -> set:
    """Nodes computing only on shapes (e.g. Prod of a Shape for a Reshape target).

    They run on a handful of host integers, not on tensor data, so they are not
    memory-intensive work (XLA constant-folds them) and are left out of the counts.
    Random numbers (``_RANDOM``) are data whatever their operands.
    """
    by_name = {n.name: n for n in gdef.node}
    memo: dict[str, bool] = {}

    def is_shape(name, depth=0):
        if name in memo:
            return memo[name]
        nd = by_name.get(name)
        if nd is None or depth > 200:
            return False
        if nd.op in _SHAPE_SOURCES:
            r = True
        elif nd.op == "Const":
            r = True
        elif nd.op == "Placeholder" or not nd.input:
            r = False
        elif nd.op in _RANDOM:
            r = False
        else:
            data = [i.split(":")[0] for i in nd.input if not i.startswith("^")]
            r = bool(data) and all(is_shape(d, depth + 1) for d in data)
        memo[name] = r
        return r

    return {n.name for n in gdef.node if n.op != "Const" and is_shape(n.name)}


def shape_operands(gdef, fetches) -> set:
    """Integer nodes whose every reader takes their value as a shape, size or axis
    (``_SHAPE_OPERANDS``), directly or through other such nodes; never a node whose
    value the graph returns (``fetches``: tensor names)."""
    by_name = {n.name: n for n in gdef.node}
    readers: dict[str, list] = {}
    for nd in gdef.node:
        data = [i for i in nd.input if not i.startswith("^")]
        for pos, i in enumerate(data):
            readers.setdefault(i.split(":")[0], []).append((nd, pos, len(data)))
    fetched = {f.split(":")[0] for f in fetches}
    memo: dict[str, bool] = {}

    def feeds_shapes(name, depth=0):
        if name in memo:
            return memo[name]
        memo[name] = False                       # a cycle (or too deep) is not
        nd = by_name.get(name)
        if nd is None or depth > 200 or name in fetched or not nd.input \
                or nd.op in ("Placeholder", "Const") or not _integer(nd) \
                or not readers.get(name):
            return False
        memo[name] = all(
            pos in _SHAPE_OPERANDS.get(r.op, ()) or
            (r.op == "ConcatV2" and pos == n_data - 1) or feeds_shapes(r.name, depth + 1)
            for r, pos, n_data in readers[name])
        return memo[name]

    return {n.name for n in gdef.node if feeds_shapes(n.name)}


def _integer(nd) -> bool:
    return any(nd.attr[a].type in _INTEGERS for a in ("T", "DstT", "dtype")
               if a in nd.attr)


def _run(ctx):
    ctx.shape_math = shape_arithmetic(ctx.planned) | shape_operands(ctx.planned,
                                                                    ctx.fetches)
    for n in ctx.shape_math & ctx.ir.nodes.keys():
        ctx.ir[n].attrs.setdefault("unfusible", SHAPE_MATH)


PASS = Pass("shape_math", _run)
