"""Eigen's filter gradients one at a time: a control edge from each to the next.

Where TF's oneDNN is off (the amd-avx2 machines: ``IsMklEnabled()`` False), TF's CPU
``Conv2DBackpropFilter`` is Eigen's: an im2col of the layer's input into a temp buffer
of up to ~30 MiB (conv_grad_filter_ops.cc's working set; [24, 1024, 288] floats, 27 MiB,
32 MiB from the BFC allocator, for the train suite's CNN at batch 32), then a
contraction.  A training step's filter gradients do not depend on each other, and TF's
executor runs them on its inter-op threads as soon as each is ready: the second layer's
(the first ready) was still running when the first layer's started, and the step's peak
was both buffers at once plus the live activations (the train suite's CNN, BFC
allocator's memory events: 32 + 13.6 MiB of the 57.8 MiB peak, in stock TF and in the
stitched step alike; TF's 56 MiB here against 28 MiB with oneDNN's convolutions).

Each filter gradient gets a control input on the one before it (in the order they
become ready: the longest path from the graph's sources, so an added edge never closes
a cycle); at most one im2col buffer is live: the CNN step's stitched peak 60.5 -> 53.9
MiB with schedule/inplace.py's two-pass column kernels (stock TF 57.8).  On two cores
each convolution already shares its work with the intra-op pool, so running them one
after the other should cost little: the CNN step chained against not, interleaved in
one process (oneDNN off, amd-avx2 model, 2026-11-29, load 5-9 from other work), read
-6%, +11%, -3% and -1.5% in four runs: within that machine's noise.

Only where the profile says TF's convolutions are Eigen's (``remapper.onednn``), only
in graphs with a backward, and only with two or more filter gradients.
"""
from __future__ import annotations

from ..passmanager import Pass

OPS = frozenset({"Conv2DBackpropFilter"})


def _depths(graph_def) -> dict:
    """name -> longest path (in nodes) from a node without inputs."""
    nodes = {n.name: n for n in graph_def.node}
    preds = {n.name: [i.lstrip("^").split(":")[0] for i in n.input] for n in graph_def.node}
    depth: dict = {}
    for start in nodes:
        if start in depth:
            continue
        stack = [(start, False)]
        while stack:
            name, done = stack.pop()
            if name in depth:
                continue
            ps = [p for p in preds[name] if p in nodes]
            if done:
                depth[name] = 1 + max((depth[p] for p in ps), default=-1)
                continue
            stack.append((name, True))
            stack.extend((p, False) for p in ps if p not in depth)
    return depth


def chain(graph_def, excluded=frozenset()) -> int:
    """Chain ``graph_def``'s filter gradients (in place); returns the edges added.
    Those of ``excluded`` (Options(exclude)) get no edge and order none: they stay as
    the graph has them."""
    grads = [n for n in graph_def.node if n.op in OPS and n.name not in excluded]
    if len(grads) < 2:
        return 0
    depth = _depths(graph_def)
    grads.sort(key=lambda n: (depth[n.name], n.name))
    added = 0
    for before, node in zip(grads, grads[1:]):
        ctrl = "^" + before.name
        if ctrl not in node.input:
            node.input.append(ctrl)
            added += 1
    return added


def _run(ctx):
    from . import blas, inline
    n = chain(ctx.graph_def, ctx.excluded) if blas._eigen_machine() and inline.traced_has_backward(ctx) \
        else 0
    return None if not n else (
        f"{n + 1} convolution filter gradients (Eigen's, each with an im2col buffer "
        "of up to ~30 MiB) run one after another (tf/passes/convgrad.py)")


PASS = Pass("convgrad", _run)
