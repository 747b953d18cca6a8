"""Per-node legality: may this node join a fused region at all?

Region-level legality (one kernel can be generated for the region) lives in
schedule/; cycle-freedom lives in the planner.  Every "no" has a reason.
"""
from __future__ import annotations

from ..ir import OPS, Graph, Kind, Node, infer
from ..ir.composites import COMPOSITE_OPS
from ..ir.ops import INDEX_MAPS
from ..ir.spec import MAX_INPUTS, MAX_OUTPUTS


def node_reason(graph: Graph, node: Node) -> str | None:
    """None if the node may be fused; otherwise why not."""
    if "unfusible" in node.attrs:
        return node.attrs["unfusible"]
    if node.op not in OPS and node.op not in COMPOSITE_OPS:
        return (f"{node.op} is not in the op table (docs/limits.md lists the ops "
                f"stitching fuses)")
    if node.op == "Const":
        return "constants are folded into the kernels that read them"
    for r in node.inputs:
        t = graph.type_of(r)
        if t.dtype.startswith("opaque:"):
            return f"input {r} has unsupported dtype {t.dtype[7:]}"
        if t.shape is None:
            return (f"input {r} has unknown rank (an input_signature with known ranks "
                    f"lets it fuse)")
    if node.op in COMPOSITE_OPS:
        return None
    try:
        infer(node.op, {k: v for k, v in node.attrs.items()}, [graph.type_of(r) for r in node.inputs])
    except ValueError as e:
        return str(e)
    return None


def backend_reason(spec, profile) -> str | None:
    """None if the profile's backend can generate ``spec``, and ``spec`` can be shipped.
    A spec is sent to compile workers, stored in the result cache and in rewritten
    graphs as JSON, which is read back within ir/spec.py's limits (at most
    ``MAX_INPUTS`` inputs and ``MAX_OUTPUTS`` outputs): a kernel over them ran its quick
    tier-1 code for good (its worker refused the spec) and could not be stored.
    Layout ops fold into the loads of CPU kernels (schedule/layout.py); the CUDA
    emitter has no views yet (it refuses such a schedule), so a plan for a CUDA
    profile keeps them out of kernels; SmallMatMul (schedule/contract.py) and
    DepthwiseConv2D likewise."""
    if len(spec.inputs) > MAX_INPUTS or len(spec.outputs) > MAX_OUTPUTS:
        return (f"a kernel takes at most {MAX_INPUTS} inputs and makes at most "
                f"{MAX_OUTPUTS} outputs (the limits of a spec read back from a graph, "
                f"ir/spec.py); this one would take {len(spec.inputs)} and make "
                f"{len(spec.outputs)}")
    if profile.backend != "cuda":
        return None
    if any(OPS[n.op].kind == Kind.CONTRACTION for n in spec.nodes):
        return ("SmallMatMul (a 1x1 convolution over a 1x1 image) inside a CUDA kernel: "
                "its products run in the CPU emitter's per-group prologue only (the CUDA "
                "emitter has none yet), so the convolution stays TF's")
    if any(OPS[n.op].kind == Kind.WINDOW for n in spec.nodes):
        return ("a depthwise convolution inside a CUDA kernel: its taps are summed by the "
                "CPU emitter only (the CUDA emitter has no window loop yet), so the "
                "convolution stays TF's")
    ops = sorted({n.op for n in spec.nodes if n.op in INDEX_MAPS})
    if not ops:
        return None
    return (f"{'/'.join(ops)} inside a CUDA kernel: layout ops fold into the loads of "
            "CPU kernels only (the CUDA emitter reads no views yet)")


def is_candidate(graph: Graph, node: Node) -> bool:
    return node_reason(graph, node) is None


# Passes over its data (each a read and a write of the op's size) that TF's CPU kernel of
# a composite op makes.  Softmax (Eigen, softmax_op_functor.h): max (read), x - max
# (read, write), exp (read, write), sum (read), scale (read, write): 8 traversals, 4
# passes; LogSoftmax the same shape.  Measured here at 8192x1024 float32: TF's Softmax
# 19.2 ms, LogSoftmax 23.3 ms, one read+write pass at the measured bandwidth 2.6 ms.
# (With 2, a lone Softmax was predicted 10% slower fused and left to TF, which ran it
# 3.6x slower than the fused kernel.)
# Where TF runs float32 Softmax as one oneDNN kernel (Intel CPUs) a lone Softmax is
# still fused: through stitching.function on a 2-core Xeon, oneDNN's against the fused
# kernel, 8x1024 170 vs 99 us, 64x1024 230 vs 137, 512x128 247 vs 156, 2048x128 325 vs
# 264, 49152x128 2.41 vs 1.80 ms, 8192x1024 2.9-3.0 ms both (it was left to TF while
# the fused kernel measured 3.05 against 2.87 ms there, before exp_nonpos and the
# next-row prefetch).
COMPOSITE_PASSES = {"Softmax": 4, "LogSoftmax": 4, "SoftmaxCrossEntropyWithLogits": 4,
                    "FusedBatchNormGrad": 4,   # TF (Eigen): 3 reductions + the x_backprop
                    #                            pass; oneDNN's kernel: ONEDNN_PASSES
                    # TF (fused_batch_norm_op.cc, is_training): the mean's and the
                    # variance's reads of x, then y's read and write.  oneDNN's kernel
                    # (Intel and AMD with oneDNN on) measured 2.0-2.5 times x * 1.5's
                    # time on the amd-avx512 class (Zen 5, 2026-11-30, NHWC float32,
                    # medians of 15 alternating runs): 0.89 against 0.44 ms at
                    # [32, 28, 28, 64], 1.95 / 0.81 at [8, 56, 56, 128], 1.97 / 0.89 at
                    # [64, 14, 14, 256], 0.56 / 0.29 at [32, 7, 7, 512]: 2 passes is
                    # honest there too (an earlier 1.2-1.3, 1.17 against 0.90 ms at
                    # [32, 28, 28, 64], had x * 1.5 at twice today's time).  The
                    # fused kernel alone ran 0.66 and 0.39 ms at the first and last
                    # (the plan leaves the two larger to TF); with an unknown batch
                    # (fused at all four) 0.73 / 0.97 ms TF, 1.72 / 2.00, 1.59 / 1.82,
                    # 0.40 / 0.64.
                    "FusedBatchNormTraining": 2}
# Composites TF runs as one oneDNN kernel where its oneDNN is on (tf/passes/remapper.py
# marks them: ONEDNN_ATTR): passes priced instead of COMPOSITE_PASSES'.
# FusedBatchNormGrad (is_training, channel-last, float32 / bfloat16): measured on the amd-avx512 class (Zen 5, 2 cores, oneDNN on, 2026-11-30,
# NHWC float32, medians of 15 alternating runs in one process, TF / x * 1.5 / the fused
# kernel alone): [32, 28, 28, 64] 0.92 / 0.44 / 0.90 ms, [8, 56, 56, 128] 2.00 / 0.81 /
# 2.43, [64, 14, 14, 256] 2.18 / 0.89 / 2.41, [32, 7, 7, 512] 0.62 / 0.29 / 0.48; with
# an unknown batch 0.93 / 0.43 / 0.79, 1.94 / 0.79 / 2.09, 1.96 / 0.78 / 2.07,
# 0.66 / 0.29 / 0.48.  TF's kernel takes 2.1-2.5 times x * 1.5 (its reads of dy and x
# for the reductions, then dy, x and dx: about 1.5 passes of the op's inputs and
# outputs), not Eigen's 4 passes (6 times x * 1.5, which had the planner fuse a lone
# one for a predicted 2.8x gain).  Priced at 1, not 1.5: the delta evaluator and the
# latency evaluator price our fused kernel at one pass over its inputs and outputs,
# while it also makes two (schedule: "column kernel ... 2 pass(es)", the second over
# dy and x again; measured 1.6-3.0 times x * 1.5, priced near 1.5): one pass on both
# sides compares like with like.  With it a lone one is left to TF: against TF's op in
# the stitched graph (Options(exclude); it ran faster there than in stock tf.function),
# shuffled rounds, unknown batch, the fused kernel alone lost at all four shapes above
# (1.02 against 0.81 ms, 2.32 / 2.18, 3.19 / 2.63, 0.46 / 0.34).  With the ReluGrad
# before it the model is near a tie at [32, 28, 28, 64] (fused; measured 1.37 against
# 1.48 ms both TF's) and leaves the two larger shapes to TF when the batch is known;
# with an unknown batch priced at DEFAULT_DIM alone it still fused them: a tie at batch
# 32 ([32, 56, 56, 128]: 11.2-11.8 ms fused, 11.2-11.3 both TF's, as predicted), 3-40%
# slower than both ops TF's at batch 8 and 64 across runs (the fused kernel's second
# pass re-reads dy's inputs, from L3 only while they fit).  Such a kernel is now
# priced at each batch of cost.UNKNOWN_DIM_RANGE (cost.priced_dims) and left to TF
# where one loses.
ONEDNN_PASSES = {"FusedBatchNormGrad": 1}
ONEDNN_ATTR = "tf_onednn"          # planning only: TF runs this composite with oneDNN
_ONEDNN_DTYPES = frozenset({"float32", "bfloat16"})   # TF's oneDNN kernels' types
# TF's CPU kernels transpose an NCHW input to NHWC and the result back: two passes more
# (the gradient's three: x, dy and x_backprop; two is the lower bound).  The
# [1, rows, cols, 1] form of tf_keras' LayerNormalization measured 5.5 passes' time
# (1.85 ms at [1, 1024, 768, 1], 11.4 ms at [1, 4096, 768, 1] against 0.33 and 2.0 ms
# for x * 1.5, oneDNN on): 4 is the lower bound the kernel's code makes
_NCHW_EXTRA_PASSES = 2
_NCHW_TRANSPOSED = frozenset({"FusedBatchNormTraining", "FusedBatchNormGrad"})
# TF runs each of these as one pass over its data (one Eigen expression per kernel)
COMPOSITE_PASSES.update(dict.fromkeys(
    ("ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad", "SoftplusGrad", "SigmoidGrad",
     "TanhGrad", "BiasAddGrad", "L2Loss", "Tile", "Split", "SliceGrad", "Gather",
     "SegmentSum"), 1))
DEVICE_ATTR = "_device"     # the TF op's device, where it names one (tf/frontend.py)


def device_fields(device: str) -> dict:
    """The fields a TF device string names (job, replica, task, type, index): the
    full ``/job:localhost/replica:0/task:0/device:CPU:1`` or a partial one (``/cpu:1``,
    ``/device:CPU:1``); a field it leaves out is not in the dict."""
    out = {}
    for part in device.strip("/").split("/"):
        key, _, value = part.partition(":")
        key = key.lower()
        if key in ("job", "replica", "task"):
            out[key] = value
        elif key == "device":
            kind, _, index = value.partition(":")
            out["type"] = kind.upper()
            if index:
                out["index"] = index
        elif key in ("cpu", "gpu", "tpu"):
            out["type"], out["index"] = key.upper(), value
    return out


def devices_conflict(devices) -> str | None:
    """Two of ``devices`` (TF device strings; empty: placed by TF) that name different
    devices, as text, or None where one device can run them all (a field that only
    some of them name, or that they name alike)."""
    seen = {}
    for d in devices:
        for key, value in device_fields(d).items() if d else ():
            if seen.setdefault(key, (value, d))[0] != value:
                return f"{seen[key][1]} and {d}"
    return None


PLANNER_ATTRS = ("unfusible", "tf_epilogue", DEVICE_ATTR,   # planning only, never in a
                 ONEDNN_ATTR)                                # KernelSpec


def onednn_composite(graph: Graph, node: Node) -> bool:
    """Whether TF with oneDNN on runs ``node`` as one oneDNN kernel (ONEDNN_PASSES):
    a training-mode FusedBatchNormGrad, channel-last, over float32 or bfloat16 (half
    runs Eigen's kernel; NCHW was not measured under oneDNN)."""
    if node.op not in ONEDNN_PASSES or not node.inputs:
        return False
    x = graph.type_of(node.inputs[min(1, len(node.inputs) - 1)])
    return (node.attrs.get("is_training", True)
            and not node.attrs.get("data_format", "NHWC").startswith("NC")
            and x.dtype in _ONEDNN_DTYPES)


def mark_onednn(graph: Graph) -> int:
    """Tag the composites TF runs with oneDNN's kernels (the caller knows TF runs
    oneDNN: tf/passes/remapper.py); returns how many."""
    found = [n for n in graph if onednn_composite(graph, n)]
    for n in found:
        n.attrs[ONEDNN_ATTR] = True
    return len(found)


def work(node: Node) -> int:
    """How many primitive ops that read or write data this node stands for.

    Views and constants cost nothing in TF; a composite (Softmax, FusedBatchNorm)
    is one TF op but several passes of work, so fusing it alone still pays.  Of the
    layout ops only Reshape is a view in TF: an index map (Transpose, Slice, ConcatV2,
    Pack, Pad, Reverse) is a copy there (a pass over its data), which a kernel reading
    through it saves.
    """
    if node.op in COMPOSITE_OPS:
        if node.attrs.get(ONEDNN_ATTR):
            return ONEDNN_PASSES[node.op]
        extra = _NCHW_EXTRA_PASSES if node.op in _NCHW_TRANSPOSED and \
            node.attrs.get("data_format", "").startswith("NC") else 0
        return COMPOSITE_PASSES.get(node.op, 2) + extra
    d = OPS.get(node.op)
    return int(d is not None and d.kind not in (Kind.LAYOUT, Kind.SOURCE)
               and node.op != "Identity" or node.op in INDEX_MAPS)

