"""Which kernels are timed against their native segment (``Options(autotune=True)``).

The cost model predicts, per kernel, its time fused and the time of its ops left to
TF.  Where the predicted margin (unfused / fused) is below ``Options.autotune_margin``
(default 1.3x: inside the model's error on this machine, tools/plan_audit.py), the
kernel node is marked (attr ``_stitching_autotune``) and given its region's original
ops as its ``fallback`` function; the op (runtime/op.cc, ``Tuner``) then times both
on the first calls of each shape class with the real inputs, keeps the faster, and
the choice is kept on disk with the kernels (runtime/autotune.py).  A kernel with no
prediction (the greedy planner has no cost model) is measured too; one whose region
has no original subgraph (it reads a value it cannot recompute) cannot be.
"""
from __future__ import annotations

from . import original
from ..passmanager import Pass

ATTR = "_stitching_autotune"


def mark(graph_def, the_plan, regions, kernel_names, margin: float) -> list:
    """Marks the kernel nodes to measure (in place); returns one report entry each."""
    predicted = {}
    for c in the_plan.alternatives:
        if getattr(c, "region", None) is not None:
            d = c.to_dict()
            predicted[tuple(c.region.nodes)] = (d.get("fused_us"), d.get("unfused_us"))
    nodes = {n.name: n for n in graph_def.node if n.op == "StitchedKernel"}
    out = []
    for reg, kname in zip(regions, kernel_names):
        if kname not in nodes:        # taken into another op (passes/attention.py)
            continue
        fused, unfused = predicted.get(tuple(reg.nodes), (None, None))
        ratio = unfused / fused if fused and unfused else None
        if ratio is not None and ratio >= margin:
            continue
        entry = {"kernel": kname, "spec_hash": reg.spec.hash, "fused_us": fused,
                 "unfused_us": unfused, "predicted": ratio, "margin": margin}
        nd = nodes[kname]
        fn = nd.attr[original.ATTR].s.decode() if original.ATTR in nd.attr else ""
        if not fn:
            entry["why_not"] = "no original subgraph to compare with"
        else:
            nd.attr[ATTR].s = b"1"
            if not nd.attr["fallback"].list.func:
                nd.attr["fallback"].list.func.add().name = fn
        out.append(entry)
    return out


def _run(ctx):
    # (after the attention pass's entries, where it timed its ops: attention.py)
    ctx.autotune = (ctx.autotune or []) + mark(ctx.graph_def, ctx.plan, ctx.regions,
                                               ctx.kernel_names, ctx.options.autotune_margin)


PASS = Pass("autotune", _run, option="autotune")
