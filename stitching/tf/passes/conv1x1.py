"""1x1 convolutions as one matrix product, run by OpenBLAS where TF's are Eigen's.

A 1x1 convolution of stride 1 over NHWC is a matrix product: every pixel's Cin channels
times the filter's [Cin, Cout].  This pass writes it as one:

    Conv2D(x[N, H, W, Cin], w[1, 1, Cin, Cout])
        ->  Reshape(MatMul(Reshape(x, [-1, Cin]), Reshape(w, [Cin, Cout])), [-1, H, W, Cout])

(the output Reshape keeps the Conv2D's name, so its readers and fetches are untouched;
both Reshapes are views, no copy), and the blas pass after it runs the MatMul as
StitchedMatMul (runtime/gemm.cc).

Why: where TF's oneDNN is off (the AMD EPYC machines here: ``IsMklEnabled()`` False),
TF's Conv2D is Eigen's spatial convolution, and its output comes from TF's allocator.
An output over glibc's mmap threshold (at most 32 MiB) is then a fresh mmap on every
call, and the convolution pays one page fault per 4 KiB page on first write: for
MobileNetV2's block_1_expand at batch 8 ([8, 112, 112, 16] -> 96 channels, 38.5 MB out,
a [100352, 16] x [16, 96] product) most of its 12 ms.  StitchedMatMul's large outputs
come from op.cc's output pool (blas_util.h AllocateOutput), pages already touched.
s6's StitchedConv2D (not merged) had no pooled output and lost on these shapes.

Which convolutions (``decide``, from measurements in the models' context): see the
rule's comment.  The batch is not known when the graph is rewritten, so a shape class
is taken only where it did not lose at batch 1 nor 8, but for one: the big-output
expansion, which loses ~0.1 ms at batch 1 in most runs and gains 8-16 ms at batch 8.
A convolution whose input spatial size or channels, or whose filter, are not known
then stays TF's.

Only float32 and float64 (StitchedMatMul's types), NHWC, strides and dilations 1,
SAME or VALID (the same for a 1x1 filter), and only where the blas pass will run the
product (``blas.mode`` ALL: the device profile says TF runs Eigen's kernels, the
library loads, ``Options(blas_gemm)``); elsewhere a MatMul of TF's would gain nothing.

Why after planning: a convolution is opaque to the planner (its BatchNorm and
activation are fused into the kernel that reads it), so the kernels are the same
either way; only the TF op that computes the product changes.  A Conv2D followed by a
BiasAdd stays TF's: Eigen's remapper runs the pair (and an activation after it) as one
_FusedConv2D, which the planner priced as free (plan/epilogue.py).

Gradients: Reshape and MatMul have TF's gradients, StitchedMatMul ours (blas.py), so
a tape outside the stitched function differentiates the rewritten graph.
"""
from __future__ import annotations

import collections

from tensorflow.core.framework import attr_value_pb2, types_pb2

from ..passmanager import Pass
from . import blas, gemm

_DTYPES = (types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE)


# The rule, from tools/conv1x1_probe.py on the 2-core AMD EPYC (TF 2.21, oneDNN off),
# 2026-11-28, load 2.4-3.6 (another session's work on the machine): every 1x1
# convolution of MobileNetV2 and EfficientNetB0 in the model's own graph, TF's Conv2D
# node against the StitchedMatMul (and its two Reshapes) that replaced it, the fastest
# of 20-30 interleaved calls, two runs.  Ratios are TF's time / ours, "b1 / b8":
#   >= 112x112 pixels, Cin <= 16 (block_1_expand, block2a_expand: 16->96): 0.71-1.17 /
#     2.6-3.2.  At batch 8 the 38.5 MB output is pooled (Eigen's pays ~9400 page
#     faults per call: 12-24 ms against 4-8 ms); at batch 1 (4.8 MB, not pooled) ours
#     is 0.1-0.15 ms slower in two runs of three, faster in one.  Taken: the batch-8
#     gain is 50-100 times the batch-1 loss.
#   <= 7x7 pixels, Cin >= 160 (the last stage: 160->960, 320->1280, 960->160, 960->320,
#     576->160, 192->1152, 1152->192, 1152->320, 672->192): 1.15-1.67 / 0.95-1.09
#     (OpenBLAS's sgemm over 49 * N rows against Eigen's spatial contraction).
#   Left to TF, as they lose at batch 8 or do not win at both: 56x56 24->144 (0.94-1.12
#     / 0.67-0.73: OpenBLAS's beta pass and small-K kernel against Eigen's), 28x28
#     32->192 and 40->240 (1.07-1.33 / 0.78-0.90), 112x112 32->16 (0.88-0.97 / 0.80-0.86),
#     56x56 144->24 (0.84-1.15 / 0.84-1.05), and the 14x14 and 28x28 projections and
#     expansions (0.85-1.8 / 0.88-1.08: wins at batch 1 only, or nowhere).
_MIN_PIXELS_BIG = 112 * 112  # tuned (above)
_MAX_CIN_BIG = 16            # tuned
_MAX_PIXELS_SMALL = 7 * 7    # tuned
_MIN_CIN_SMALL = 160         # tuned: the smallest Cin measured there


def decide(h: int, w: int, cin: int, cout: int) -> str | None:
    """None when this 1x1 convolution (input [N, h, w, cin], cout channels out) runs
    faster as StitchedMatMul than as TF's Eigen Conv2D (the measurements above), else
    why it stays TF's (a phrase for the report); ``cout`` is not part of the rule."""
    pixels = h * w
    if pixels >= _MIN_PIXELS_BIG:
        if cin <= _MAX_CIN_BIG:
            return None
        return f"over 112x112 pixels with more than {_MAX_CIN_BIG} input channels " \
               f"(Eigen's as fast)"
    if pixels <= _MAX_PIXELS_SMALL:
        if cin >= _MIN_CIN_SMALL:
            return None
        return f"over 7x7 pixels with fewer than {_MIN_CIN_SMALL} input channels " \
               f"(not measured)"
    return "over 8x8 to 111x111 pixels (Eigen's as fast or faster at batch 8)"


def _form(conv) -> str | None:
    """Why ``conv`` is not a 1x1 product this pass can write, or None (the filter's
    size is checked with the shapes)."""
    if "T" not in conv.attr or conv.attr["T"].type not in _DTYPES:
        return "not float32/float64"
    if "data_format" in conv.attr and conv.attr["data_format"].s != b"NHWC":
        return "not NHWC"
    if conv.attr["padding"].s not in (b"SAME", b"VALID"):
        return "explicit padding"
    if any(s != 1 for s in conv.attr["strides"].list.i):
        return "strided"
    if "dilations" in conv.attr and any(d != 1 for d in conv.attr["dilations"].list.i):
        return "dilated"
    return None


def _dims(ir_graph, conv) -> tuple | str:
    """(H, W, Cin, Cout) of a 1x1 convolution, else why not."""
    if conv.name not in ir_graph or len(ir_graph[conv.name].inputs) != 2:
        return "shapes unknown"
    x, f = (ir_graph.type_of(r).shape for r in ir_graph[conv.name].inputs)
    if f is None or len(f) != 4 or min(f) < 0:
        return "filter shape unknown"
    if tuple(f[:2]) != (1, 1):
        return "not 1x1"
    if x is None or len(x) != 4 or min(x[1:]) < 0:
        return "spatial size or channels unknown"
    return x[1], x[2], x[3], f[3]


def choose(graph_def, ir_graph, excluded=frozenset()) -> tuple:
    """([(Conv2D node, (H, W, Cin, Cout))] to rewrite, Counter of the reasons the
    other Conv2Ds stay TF's); those of ``excluded`` (Options(exclude)) stay too."""
    readers = collections.Counter(i.lstrip("^").split(":")[0]
                                  for nd in graph_def.node for i in nd.input)
    bias_read = {nd.input[0].split(":")[0] for nd in graph_def.node
                 if nd.op == "BiasAdd" and nd.input}
    taken, left = [], collections.Counter()
    for nd in graph_def.node:
        if nd.op != "Conv2D" or len([i for i in nd.input if not i.startswith("^")]) != 2:
            continue
        why = "excluded by Options(exclude)" if nd.name in excluded else _form(nd)
        dims = _dims(ir_graph, nd) if why is None else why
        why = dims if isinstance(dims, str) else decide(*dims)
        if why is None and nd.name in bias_read and readers[nd.name] == 1:
            why = "a BiasAdd follows (TF's _FusedConv2D)"
        if why is not None:
            left[why] += 1
            continue
        taken.append((nd, dims))
    return taken, left


def rewrite(graph_def, chosen) -> None:
    """Turn each (Conv2D, (H, W, Cin, Cout)) of ``chosen`` into Reshape -> MatMul ->
    Reshape, in place: the Conv2D's node becomes the output Reshape; the others are
    appended (named ``<conv>/conv1x1/...``)."""
    i32 = attr_value_pb2.AttrValue(type=types_pb2.DT_INT32)
    false = attr_value_pb2.AttrValue(b=False)
    for nd, (h, w, cin, cout) in chosen:
        x, f = [i for i in nd.input if not i.startswith("^")]
        control = [i for i in nd.input if i.startswith("^")]
        prefix = f"{nd.name}/conv1x1"
        t = attr_value_pb2.AttrValue(type=nd.attr["T"].type)

        def reshape(suffix, value, shape):
            target = gemm.append_int32(graph_def, prefix, nd.device, f"{suffix}_shape", shape)
            return gemm.append_node(graph_def, prefix, nd.device, suffix, "Reshape",
                                    [value, target], T=t, Tshape=i32)

        product = gemm.append_node(
            graph_def, prefix, nd.device, "matmul", "MatMul",
            [reshape("pixels", x, [-1, cin]), reshape("filter", f, [cin, cout])] + control,
            T=t, transpose_a=false, transpose_b=false)
        out_shape = gemm.append_int32(graph_def, prefix, nd.device, "out_shape",
                                      [-1, h, w, cout])
        gemm.become_reshape(nd, product, out_shape, t)


def _run(ctx):
    if not any(nd.op == "Conv2D" for nd in ctx.graph_def.node):
        return None
    if blas.mode(ctx.options, ctx) != blas.ALL:
        return None            # a MatMul of TF's Eigen or oneDNN: nothing to gain
    chosen, left = choose(ctx.graph_def, ctx.ir, ctx.excluded)
    rewrite(ctx.graph_def, chosen)
    kept = "; ".join(f"{n} {why}" for why, n in sorted(left.items()))
    return (f"{len(chosen)} 1x1 Conv2D(s) run as one matrix product each by OpenBLAS "
            f"(large outputs from the output pool); {sum(left.values())} left to TF's "
            f"Eigen kernel"
            f"{': ' + kept if kept else ''} (tf/passes/conv1x1.py; "
            f"Options(conv1x1_gemm=False) leaves them all)")


PASS = Pass("conv1x1", _run, option="conv1x1_gemm")
