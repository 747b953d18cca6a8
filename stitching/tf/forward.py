"""Which inputs of a kernel may give their buffer to one of its outputs.

Stock TF's element-wise kernels write their result over an input whose buffer nobody
else holds (``forward_input_or_allocate_output``): a ReluGrad reuses the incoming
gradient, a Mul the Sub before it.  A StitchedKernel that always allocated its outputs
kept both alive, and a stitched train step peaked higher than TF's (the MLP +0.8 MiB:
every bias+ReLU, ReluGrad and optimizer kernel held an input and an output of the same
size at once).

Safe pairs, by construction of the CPU code: in an ELEMENTWISE kernel every element
of the domain is one iteration that loads all its inputs before it stores any output
(codegen/cpu/emitter.py: _ew_body), and an input with the output's shape is read at
that element only (broadcast inputs have fewer elements, LAYOUT ops only add or drop
size-1 dims).  So output o may overwrite input i when their dtypes and static shapes
are equal.  Rows and column kernels read inputs over several passes: never.

The pairs go on the kernel node as ``_stitching_forward`` ([input, output, ...]); the
op (runtime/op.cc) forwards only if TF grants the buffer (refcount one: the last use
of a value that is not a variable's) and the run-time shapes are equal, else allocates.
"""
from __future__ import annotations

from ..schedule.passes import KernelKind

ATTR = "_stitching_forward"


def pairs(spec, kind) -> list:
    """[(input index, output index)] the kernel may forward (each index at most once)."""
    if kind != KernelKind.ELEMENTWISE:
        return []
    out, used = [], set()
    for o, node in enumerate(spec.outputs):
        t = spec.type_of(node)
        for i, ti in enumerate(spec.inputs):
            if i not in used and ti.dtype == t.dtype and tuple(ti.shape) == tuple(t.shape):
                used.add(i)
                out.append((i, o))
                break
    return out


def attach(graph_def, kernels, kernel_names) -> int:
    """Sets the attr on each kernel node with pairs; returns how many got one."""
    nodes = {n.name: n for n in graph_def.node if n.op == "StitchedKernel"}
    n = 0
    for k, name in zip(kernels, kernel_names):
        ps = pairs(k.spec, k.schedule.kind)
        if ps and name in nodes:
            nodes[name].attr[ATTR].list.i.extend([x for p in ps for x in p])
            n += 1
    return n
