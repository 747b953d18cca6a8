"""Shape arithmetic marked before planning: nodes that compute only on shapes.

A Prod of a Shape for a Reshape target runs on a handful of host integers, not on
tensor data: not memory-intensive work (XLA constant-folds it).  The IR nodes get the
reason as ``unfusible`` and the report leaves them out of its counts
(``ctx.shape_math``).
"""
from __future__ import annotations

from ..passmanager import Pass

_SHAPE_SOURCES = frozenset({"Shape", "ShapeN", "Size", "Rank"})
SHAPE_MATH = ("shape arithmetic: a few host integers, which TF's constant folding and "
              "tf/shapes.py fold; not memory-intensive work")


def shape_arithmetic(gdef) -> set:
    """Nodes computing only on shapes (e.g. Prod of a Shape for a Reshape target).

    They run on a handful of host integers, not on tensor data, so they are not
    memory-intensive work (XLA constant-folds them) and are left out of the counts.
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
        else:
            data = [i.split(":")[0] for i in nd.input if not i.startswith("^")]
            r = bool(data) and all(is_shape(d, depth + 1) for d in data)
        memo[name] = r
        return r

    return {n.name for n in gdef.node if n.op != "Const" and is_shape(n.name)}


def _run(ctx):
    ctx.shape_math = shape_arithmetic(ctx.planned)
    for n in ctx.shape_math & ctx.ir.nodes.keys():
        ctx.ir[n].attrs.setdefault("unfusible", SHAPE_MATH)


PASS = Pass("shape_math", _run)
