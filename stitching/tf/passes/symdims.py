"""Symbolic run-time dims for the planner (ir/symdims.py), from the graph TF will run.

The sweep itself is TF-free; this pass hands it the two facts the IR does not keep:
a Reshape's target where it is a constant in the graph (tf/passes/shapes.py has just
folded Keras's run-time targets to constants with one -1 entry, which the IR's
inferred shape may still show as several unknown dims) and a matrix product's
transpose / adjoint flags.  The result is ``ir.dim_symbols``: plan/region.py writes
the proven equalities into a spec's ``same_dims``, and this pass keeps out of kernels
the StridedSlices to run-time ends whose clamping it cannot show TF fails on too.
"""
from __future__ import annotations

import tensorflow as tf

from ...ir import symdims
from ...ir.graph import ValueRef
from ..passmanager import Pass

_FLAGS = ("transpose_a", "transpose_b", "adj_x", "adj_y")


def facts(graph_def, ir) -> dict:
    nodes = {nd.name: nd for nd in graph_def.node}
    out = {}
    for node in ir:
        nd = nodes.get(node.name)
        if nd is None:
            continue
        if node.op == "Reshape" and nd.op == "Reshape":
            src = nodes.get(nd.input[1].split(":")[0]) if len(nd.input) > 1 else None
            if src is not None and src.op == "Const":
                value = tf.make_ndarray(src.attr["value"].tensor)
                if value.dtype.kind == "i" and value.ndim == 1:
                    out[node.name] = {"target": [int(v) for v in value]}
        elif nd.op in ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"):
            out[node.name] = {f: nd.attr[f].b for f in _FLAGS if f in nd.attr}
    return out


def _run(ctx):
    ctx.ir.dim_symbols = symdims.analyze(ctx.ir, facts(ctx.graph_def, ctx.ir))
    _check_clamps(ctx.ir)


# element-wise IR ops of two operands whose TF ops broadcast with TF's BCast: shapes
# that do not broadcast fail with InvalidArgument
_CHECKED_BINARY = frozenset({"Add", "Sub", "Mul", "Div", "Maximum", "Minimum",
                             "SquaredDifference"})


def _check_clamps(ir) -> None:
    """A StridedSlice to an end known only at run time (a SliceTo marked ``clamps``,
    ``table[:tf.shape(x)[1]]``): TF clamps an end past the dim (s > n rows gives the
    n-row table), where the fused slice takes s rows and its kernel fails its check.
    That is TF's outcome too where every reader combines the slice element-wise with
    a tensor whose dim there is proven to be s (its symbol, ir/symdims.py): the
    clamped n rows (n >= 2, so not broadcast) then fail TF's broadcast.  Elsewhere the
    node stays TF's, with the reason."""
    readers = ir.consumers()
    for node in ir:
        if node.op == "SliceTo" and node.attrs.get("clamps"):
            why = _clamp_reason(ir, node, readers[node.name])
            if why:     # (a reason it has already, Options(exclude)'s, stays)
                node.attrs.setdefault("unfusible", why)


def _clamp_reason(ir, node, readers) -> str | None:
    syms, out = ir.dim_symbols, ValueRef(node.name, 0)
    rank = len(node.outputs[0].shape)
    src = syms.get(node.inputs[1], ())
    why = ("a StridedSlice whose end is a dim known only at run time (TF clamps an end "
           "past the dim, so the fused slice is exact only where every reader combines "
           "it element-wise with a tensor proven to have that dim there)")
    if not readers:
        return why
    for name in readers:
        r = ir[name]
        others = [i for i in r.inputs if i != out]
        if r.op not in _CHECKED_BINARY or len(r.inputs) != 2 or len(others) != 1:
            return f"{why}: {r.op} {name} reads it"
        dims = syms.get(others[0], ())
        lead = len(ir.type_of(others[0]).shape) - rank
        for d, k in enumerate(node.attrs["like"]):
            if k < 0:
                continue
            if not 0 <= d + lead < len(dims) or k >= len(src) or src[k] is None or \
                    dims[d + lead] != src[k]:
                return f"{why}: {r.op} {name} combines it with a tensor not proven to"
    return None


PASS = Pass("symdims", _run)
