"""Which convolution epilogues TF's runtime remapper fuses in this process.

The table and the pattern are TF-free (plan/epilogue.py, which says what was checked);
this module only asks TF which remapper runs: oneDNN's (``TF_ENABLE_ONEDNN_OPTS``, on by
default on x86) or the Eigen one.  GPU plans get no table: the remapper's GPU fusions
(cuDNN) were not checked, so there the epilogues stay priced as ordinary TF ops.
"""
from __future__ import annotations

import os

from ...plan import epilogue, legality
from ..passmanager import Pass


def onednn_enabled() -> bool:
    try:
        from tensorflow.python.util import _pywrap_util_port
        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):   # a TF without the probe: its env switch
        return os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1").lower() not in ("0", "false")


def onednn(profile) -> bool:
    """Whether TF runs oneDNN's kernels and remapper on the machine ``profile``
    describes: the profile's fact where it states one (a pinned machine model), else
    the running TF's."""
    return profile.tf_onednn if profile.tf_onednn is not None else onednn_enabled()


def table(profile) -> epilogue.Remapper:
    if profile.backend != "cpu":
        return epilogue.NONE
    return epilogue.ONEDNN if onednn(profile) else epilogue.EIGEN


def mark(ir, profile) -> int:
    """Tag the epilogues TF will fuse into their convolutions, pin the bfloat16
    biases oneDNN adds before its rounding (plan/epilogue.py), and, where TF runs
    oneDNN, tag the composites it runs as one oneDNN kernel (priced as such:
    plan/legality.py ONEDNN_PASSES)."""
    remapper = table(profile)
    epilogue.pin_rounding(ir, remapper)
    if remapper is epilogue.ONEDNN:        # the composites oneDNN runs as one kernel
        legality.mark_onednn(ir)           # (plan/legality.py, ONEDNN_PASSES)
    return epilogue.mark(ir, remapper)


def forward_identities(graph_def, ir, fused: set, excluded=frozenset()) -> int:
    """In the rewritten ``graph_def`` (in place), the Sigmoid of a swish epilogue left to
    TF reads the BiasAdd directly instead of through an Identity: Grappler anchors the
    Identity it folds ``1 * x`` into to the constant by a control edge, and with it the
    remapper runs the swish as an op of its own (_MklSwish) instead of in the
    convolution.  epilogue.py takes only Identities whose control inputs are constants,
    which order nothing.  Those of ``excluded`` (Options(exclude)) stay.  Returns how
    many were forwarded (prune drops them)."""
    ids = {n for n in epilogue.left_to_tf(ir, fused) if ir[n].op == "Identity"
           and n not in excluded}
    if not ids:
        return 0
    by_name = {n.name: n for n in graph_def.node}
    source = {}
    for n in ids:
        nd = by_name.get(n)
        if nd is not None and nd.op == "Identity" and nd.input:
            source[n] = source[f"{n}:0"] = nd.input[0]
    for nd in graph_def.node:
        if any(i in source for i in nd.input):
            ins = list(nd.input)
            for _ in range(8):                       # Identity of Identity ...
                ins = [source.get(i, i) for i in ins]
            nd.input[:] = ins
    return len(source) // 2


def _mark(ctx):
    from ...plan import profiles
    mark(ctx.ir, profiles.default())


def _forward(ctx):
    forward_identities(ctx.graph_def, ctx.ir, {m for r in ctx.regions for m in r.nodes},
                       ctx.excluded)


MARK = Pass("remapper", _mark)                         # before planning, on the IR
FORWARD = Pass("remapper_identities", _forward)       # after the rewrite
