"""Symbolic run-time dims for the planner (ir/symdims.py), from the graph TF will run.

The sweep itself is TF-free; this pass hands it the two facts the IR does not keep:
a Reshape's target where it is a constant in the graph (tf/passes/shapes.py has just
folded Keras's run-time targets to constants with one -1 entry, which the IR's
inferred shape may still show as several unknown dims) and a matrix product's
transpose / adjoint flags.  The result is ``ir.dim_symbols``: plan/region.py writes
the proven equalities into a spec's ``same_dims``.
"""
from __future__ import annotations

import tensorflow as tf

from ...ir import symdims
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


PASS = Pass("symdims", _run)
