"""The XLA-like baseline: element-wise loop fusion only; a reduction ends a kernel.

For ablations (``Options(planner="baseline")``): the greedy planner (planner.py) with
one more legality rule — no op in a kernel may read a reduction's result.  That is
XLA's classic CPU/GPU fusion: element-wise producers fuse into each other and into a
reduction (input fusion), but the reduction's consumers start a new kernel, so a
LayerNorm or a softmax becomes several kernels.

    x ─▶ mean ┃ x - mean ─▶ square ─▶ var ┃ var + eps ─▶ rsqrt ─▶ (x - mean) · rsqrt
        k1    ┃             k2              ┃                 k3
"""
from __future__ import annotations

from ..ir import OPS, Kind
from . import planner

REASON = "baseline (XLA-like loop fusion): a reduction ends a kernel"


def xla_rule(spec) -> str | None:
    """None if no node of the spec reads a reduction's result, else why not."""
    for n in spec.nodes:
        for a in n.args:
            if a >= 0 and OPS[spec.nodes[a].op].kind == Kind.REDUCTION:
                return REASON
    return None


def plan(graph, legal, min_ops: int = 2) -> planner.Plan:
    return planner.plan(graph, lambda spec: xla_rule(spec) or legal(spec), min_ops)
