"""The frontend as a pass: TF nodes -> IR (tf/frontend.py), once per graph.

The GraphDef passes before it work on TF's graph; the passes after it read the IR
too (``ctx.ir``), and the driver plans it.  ``ctx.planned`` keeps the GraphDef the IR
was lifted from: the rewrite replaces its regions, and the passes after the rewrite
look things up in it.
"""
from __future__ import annotations

from .. import frontend
from ..passmanager import Pass
from . import exclude


def _run(ctx):
    ctx.planned = ctx.graph_def
    ctx.ir = frontend.to_ir(ctx.tf_graph, list(ctx.fetches))
    if not ctx.options.depthwise:
        for node in ctx.ir:
            if node.op == "DepthwiseConv2D":
                node.attrs["unfusible"] = "Options(depthwise=False): left to TF"
    if ctx.options.exclude:
        # Matched again on the graph lifted, so the nodes the passes since the exclude
        # pass made (a strided gradient's Pad, a sparse xent's ops) are covered too.
        # The exclude pass's matches stay listed: one a pass failed to keep is then
        # missing, which Options(verify=True) reports.  The user's reason wins over
        # any other the frontend gave: it is the one they asked about.
        exclude.rematch(ctx)
        for name, why in ctx.excluded.items():
            if name in ctx.ir.nodes:
                ctx.ir[name].attrs["unfusible"] = why


PASS = Pass("lift", _run)
