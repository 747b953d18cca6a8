"""Marks each kernel node's in-place pairs for the op (schedule/inplace.py says which
pairs are safe and why).

The pairs go on the node as ``_stitching_forward`` ([input, output, ...]); the op
(runtime/op.cc) writes output o over input i only if TF grants the buffer (refcount
one: the last use of a value that is not a variable's) and the run-time shapes are
equal, else it allocates as before.  The MLP train step's peak was +0.8 MiB over TF's
without this: every bias+ReLU, ReluGrad and optimizer kernel held an input and an
output of the same size at once.
"""
from __future__ import annotations

from ...schedule.inplace import pairs
from ..passmanager import Pass

ATTR = "_stitching_forward"


def attach(graph_def, kernels, kernel_names) -> int:
    """Sets the attr on each kernel node with pairs; returns how many got one."""
    nodes = {n.name: n for n in graph_def.node if n.op == "StitchedKernel"}
    n = 0
    for k, name in zip(kernels, kernel_names):
        ps = pairs(k.spec, k.schedule)
        if ps and name in nodes:
            nodes[name].attr[ATTR].list.i.extend([x for p in ps for x in p])
            n += 1
    return n


def _run(ctx):
    attach(ctx.graph_def, ctx.kernels, ctx.kernel_names)   # outputs over dead inputs


PASS = Pass("forward", _run)
