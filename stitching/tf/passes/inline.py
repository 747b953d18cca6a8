"""Matrix products and attentions run on the executor's thread in graphs without a backward.

TF's executor runs an op it deems inexpensive on the thread that made its inputs ready
and hands an expensive one to an inter-op thread (a wake-up, ~10-20 us on the 2-core
machines here).  StitchedKernel is always inexpensive (runtime/op.cc); the OpenBLAS
ops (StitchedMatMul, StitchedBatchMatMul, StitchedAttention) are inexpensive where
their ``inline`` attr says so, which this pass sets in inference graphs only:

  - a Transformer's forward is a chain (product, kernel, product ...): every hand-off
    is pure cost, and each product shares its work with the intra-op pool anyway.
    Models suite, medians of three runs each (the amd-avx2 machine, 2026-11-29):
    batch 1 against XLA, Transformer 1.21x inline against 0.97x handed off, Llama
    decoder 1.16x against 0.98x, GPT-2-style 1.34x against 1.17x (ViT-style 1.07x
    against 1.14x, its single runs 0.92-1.24x); geomean over the seven models against
    TF 1.58x against 1.48x;
  - a training step has independent products (a layer's weight and input gradients)
    that TF runs side by side when they are handed off: the Transformer step measured
    1.44x TF handed off in three runs against 1.21-1.33x inline.

A graph has a backward when TF's gradient code is in it: a gradient op (``ReluGrad``,
``FusedBatchNormGradV3``, ``BroadcastGradientArgs``; not ``StopGradient``), a node under
``gradients/`` or ``gradient_tape/`` (tf.gradients, GradientTape), or an optimizer's
variable update (``Assign*VariableOp``, ``ResourceApply*``).
"""
from __future__ import annotations

from ..passmanager import Pass

PRODUCT_OPS = ("StitchedMatMul", "StitchedBatchMatMul", "StitchedAttention")
# forward ops with "Grad" in their name (LayerNorm's moments stop gradients)
_FORWARD_GRAD_OPS = frozenset({"StopGradient", "PreventGradient"})


def has_backward(graph_def) -> bool:
    for nd in graph_def.node:
        op = nd.op
        if "Grad" in op and op not in _FORWARD_GRAD_OPS or op.startswith("ResourceApply") or \
                op.startswith("Assign") and op.endswith("VariableOp") or \
                "gradients/" in nd.name or "gradient_tape/" in nd.name:
            return True
    return False


def mark(graph_def) -> int:
    """Set ``inline`` on every product op of ``graph_def``; returns how many."""
    n = 0
    for nd in graph_def.node:
        if nd.op in PRODUCT_OPS:
            nd.attr["inline"].b = True
            n += 1
    return n


def traced_has_backward(ctx) -> bool:
    """has_backward of the graph as planned (before the rewrite renamed its ops)."""
    return has_backward(ctx.planned if ctx.planned is not None else ctx.original)


def _run(ctx):
    if traced_has_backward(ctx):
        return None
    n = mark(ctx.graph_def)
    if not n:
        return None
    return (f"{n} OpenBLAS op(s) run on the thread that made their inputs ready (a graph "
            "without a backward: no inter-op hand-off; tf/passes/inline.py)")


PASS = Pass("inline", _run)
