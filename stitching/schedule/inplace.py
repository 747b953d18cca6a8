"""Which outputs of a kernel may be written over one of its inputs (in place).

Stock TF's element-wise kernels write their result over an input whose buffer nobody
else holds (``forward_input_or_allocate_output``): a ReluGrad reuses the incoming
gradient, a Mul the Sub before it.  A kernel that always allocated its outputs kept
input and output alive together, and a stitched train step peaked higher than TF's.

Safe pairs, by the structure of ELEMENTWISE code: every element of the domain is one
iteration that loads all its inputs before it stores any output (codegen/cpu/emitter.py:
_ew_body), and an input with the output's shape is read at that element only
(broadcast inputs have fewer elements, LAYOUT ops only add or drop size-1 dims).  So
output o may overwrite input i when their dtypes and static shapes are equal (the op
also checks the run-time shapes).  Row and column kernels read inputs over several
passes: never.

The CPU backend compiles a second loop nest for the aliased case that stores through
the input's own pointer: LLVM then sees one base and the same index (a dependence of
distance 0) and vectorizes; through two unrelated pointers that alias, its run-time
overlap check sends the loop to the scalar remainder (an erf kernel: 4.0 -> 6.5 ms).
"""
from __future__ import annotations

from .passes import KernelKind


def pairs(spec, kind) -> list:
    """[(input index, output index)] the kernel may write in place, each at most once."""
    if kind != KernelKind.ELEMENTWISE:
        return []
    out, used = [], set()
    for o, node in enumerate(spec.outputs):
        t = spec.type_of(node)
        if node in spec.outputs[:o]:          # the same value twice: one buffer each
            continue
        for i, ti in enumerate(spec.inputs):
            if i not in used and ti.dtype == t.dtype and tuple(ti.shape) == tuple(t.shape):
                used.add(i)
                out.append((i, o))
                break
    return out
