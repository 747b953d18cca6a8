"""A zero Pad in front of a convolution, folded into the convolution's padding.

Keras writes a strided depthwise convolution with asymmetric "same" padding as
``ZeroPadding2D`` + ``DepthwiseConv2D(padding="valid")`` (MobileNetV2, EfficientNet:
``correct_pad``).  TF runs the Pad as an op of its own, a full read and write of the
activation, and its oneDNN rewrite fuses a Pad into ``Conv2D`` (``_MklNativePadWithConv2D``)
but not into ``DepthwiseConv2dNative``.  The Pad is the consumer of a stitched kernel
(the BatchNorm + swish before it) and cannot join it: the kernels keep their input's
iteration domain.  ``DepthwiseConv2dNative`` takes ``padding="EXPLICIT"`` with
per-side ``explicit_paddings`` (oneDNN's kernel and Eigen's), which is the same
arithmetic on the unpadded input: the padded cells are zeros either way.  XLA folds
such pads into its convolutions the same way.

Measured on this 2-core machine, Relu + Pad + stride-2 depthwise convolution against
Relu + the convolution with explicit padding (tf.functions timed interleaved; results
bit-identical): [8, 112, 112, 96] 3x3, 6.95 -> 4.68 ms; [8, 56, 56, 144] 5x5,
3.04 -> 2.12 ms; [1, 112, 112, 96] 3x3, 1.45 -> 1.20 ms.  The convolution itself is no
slower with the padding inside it (1.75 -> 1.56 ms in the first case).

Keras pads an image the same way before a strided ``Conv2D(padding="valid")``
(EfficientNet's stem after its Rescaling and Normalization, ResNet50's 7x7 stem).
oneDNN's rewrite fuses that Pad into the convolution when nothing else touches it, but
the Pad is the consumer of the normalization's element-wise ops, so the planner took it
into their kernel, whose rows are then the image's 3 channels: EfficientNetB0's input
kernel over [8, 225, 225, 3] ran 1.1-2.7 ms (a 9.7 MB pass).  ``Conv2D`` takes the
same explicit padding (oneDNN's and Eigen's kernels, their fused forms with a bias and
an activation too, dilated ones, float16/bfloat16/float32/float64: checked here,
bit-identical to Pad + VALID, as fast, with oneDNN on and off), so it is folded the
same way; the normalization is then a flat
element-wise kernel.

Folded: a ``Pad`` (or ``PadV2`` whose constant is 0) with constant paddings that are
zero on the batch and channel axes and non-negative, whose only reader is the input of
a ``DepthwiseConv2dNative`` or ``Conv2D`` with ``padding="VALID"`` in NHWC.  A Pad read
by anything else (a training graph's filter gradient reads the padded input) or
fetched is kept.

Not folded, where TF runs oneDNN's remapper (the device profile says so:
tf/passes/remapper.py), when a depthwise convolution's output is read by an add (BiasAdd,
Add, AddV2): that remapper fuses such a bias into the convolution
(``_FusedDepthwiseConv2dNative``), and that fused kernel aborts the process on explicit
padding (TF 2.21: ``tensor_format.h`` "Check failed: ... Invalid index from the
dimension: 1, 0, H", checked here).  The pass runs before planning, so it cannot know
whether a kernel will take the bias; the Keras models this is for have no bias there (a
BatchNorm follows).  Eigen's remapper fuses nothing into a depthwise convolution.
"""
from __future__ import annotations

import copy

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from ...plan import profiles
from ..passmanager import Pass
from ..tfgraph import drop_nodes
from . import remapper

DEPTHWISE = "DepthwiseConv2dNative"
CONVS = (DEPTHWISE, "Conv2D")
PADS = ("Pad", "PadV2")
_BIAS_ADDS = ("BiasAdd", "BiasAddV1", "Add", "AddV2")


def _node_name(inp: str) -> str:
    return inp.lstrip("^").split(":")[0]


def _const(by_name, inp: str):
    """The value of the Const node ``inp`` names (output 0), or None."""
    if inp.startswith("^") or inp.split(":")[-1] not in (inp, "0"):
        return None
    nd = by_name.get(_node_name(inp))
    if nd is None or nd.op != "Const" or "value" not in nd.attr:
        return None
    try:
        return tf.make_ndarray(nd.attr["value"].tensor)
    except (TypeError, ValueError):
        return None


def _paddings(by_name, pad) -> list | None:
    """[top, bottom, left, right] of a zero Pad on H and W only, or None."""
    if len(pad.input) != (3 if pad.op == "PadV2" else 2):
        return None
    p = _const(by_name, pad.input[1])
    if p is None or p.shape != (4, 2) or not np.issubdtype(p.dtype, np.integer):
        return None
    if p[0].any() or p[3].any() or (p < 0).any():
        return None
    if pad.op == "PadV2":
        c = _const(by_name, pad.input[2])
        if c is None or c.size != 1 or c.reshape(()) != 0:
            return None
    return [int(v) for v in p[1:3].reshape(-1)]


def _attr_s(nd, key: str, default: bytes) -> bytes:
    """A string attribute, without inserting it (indexing a NodeDef's attr map adds an
    empty value, which an import then rejects)."""
    return nd.attr[key].s if key in nd.attr else default


def candidates(graph_def, keep: set, bias_fused: bool = True,
               excluded=frozenset()) -> dict:
    """conv node name -> (Pad node name, [top, bottom, left, right]).  ``keep``: node
    names fetched or kept (their Pad is never folded); ``bias_fused``: whether TF's
    remapper fuses a bias into a depthwise convolution (oneDNN's: such a one keeps its
    Pad; a Conv2D's fused kernels take explicit padding); ``excluded``
    (Options(exclude)): node names left as they are, so neither such a Pad (it would
    go) nor such a convolution (its padding would change) takes part."""
    by_name = {nd.name: nd for nd in graph_def.node}
    readers: dict = {}
    for nd in graph_def.node:
        for i in nd.input:
            readers.setdefault(_node_name(i), []).append(nd.name)
    out = {}
    for nd in graph_def.node:
        if nd.op not in CONVS or not nd.input or nd.name in excluded:
            continue
        if bias_fused and nd.op == DEPTHWISE and any(by_name[r].op in _BIAS_ADDS
                              for r in readers.get(nd.name, ())):
            continue                        # the remapper's fused kernel: see above
        if _attr_s(nd, "padding", b"") != b"VALID" or \
                _attr_s(nd, "data_format", b"NHWC") != b"NHWC":
            continue
        src = nd.input[0]
        pad = by_name.get(_node_name(src))
        if pad is None or pad.op not in PADS or src.startswith("^") \
                or src.split(":")[-1] not in (src, "0") or pad.name in keep \
                or pad.name in excluded \
                or readers.get(pad.name) != [nd.name]:
            continue
        p = _paddings(by_name, pad)
        if p is not None:
            out[nd.name] = (pad.name, p)
    return out


def rewrite(graph_def, found: dict) -> None:
    """In place: each convolution reads its Pad's input with the padding as its own,
    and the Pad, now unread, is removed (planned, it would be a kernel's output that
    nothing reads)."""
    by_name = {nd.name: nd for nd in graph_def.node}
    for conv_name, (pad_name, (t, b, l, r)) in found.items():
        conv, pad = by_name[conv_name], by_name[pad_name]
        conv.input[0] = pad.input[0]
        conv.attr["padding"].s = b"EXPLICIT"
        conv.attr["explicit_paddings"].CopyFrom(attr_value_pb2.AttrValue(
            list=attr_value_pb2.AttrValue.ListValue(i=[0, 0, t, b, l, r, 0, 0])))
    drop_nodes(graph_def, {pad for pad, _ in found.values()})


def _run(ctx):
    """Before lifting (tf/pipeline.py): a convolution that a kernel computes
    (DepthwiseConv2D, ir/ops.py) then reads the Pad's input through its window, and one
    left to TF runs with the padding inside it; either way no Pad is left to run."""
    bias_fused = "DepthwiseConv2dNative" in remapper.table(profiles.default()).convs
    found = candidates(ctx.graph_def, ctx.fetched, bias_fused, ctx.excluded)
    if not found:
        return None
    graph_def = copy.deepcopy(ctx.graph_def)
    rewrite(graph_def, found)
    ctx.replace(graph_def)
    kinds = sorted({"depthwise convolution" if n.op == DEPTHWISE else "convolution"
                    for n in ctx.graph_def.node if n.name in found})
    return (f"{len(found)} zero Pad(s) before a {' or '.join(kinds)} folded "
            "into its explicit padding (tf/passes/padfold.py; Options(pad_fold=False) "
            "keeps them)")


PASS = Pass("padfold", _run, option="pad_fold")
