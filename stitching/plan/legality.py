"""Per-node legality: may this node join a fused region at all?

Region-level legality (one kernel can be generated for the region) lives in
schedule/; cycle-freedom lives in the planner.  Every "no" has a reason.
"""
from __future__ import annotations

from ..ir import OPS, Graph, Kind, Node, infer
from ..ir.composites import COMPOSITE_OPS
from ..ir.ops import INDEX_MAPS


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
    """None if the profile's backend can generate ``spec``.  Layout ops fold into the
    loads of CPU kernels (schedule/layout.py); the CUDA emitter has no views yet (it
    refuses such a schedule), so a plan for a CUDA profile keeps them out of kernels;
    SmallMatMul (schedule/contract.py) and DepthwiseConv2D likewise."""
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
                    "FusedBatchNormGrad": 4,   # TF: 3 reductions + the x_backprop pass
                    # TF (fused_batch_norm_op.cc, is_training): the mean's and the
                    # variance's reads of x, then y's read and write.  oneDNN's kernel
                    # (Intel and AMD with oneDNN on) measured 1.2-1.3 passes' time here
                    # at [32, 28, 28, 64] (1.17 ms against 0.90 ms for x * 1.5): a lone
                    # channel-last one is then left to TF, fused with its neighbours.
                    "FusedBatchNormTraining": 2}
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


PLANNER_ATTRS = ("unfusible", "tf_epilogue", DEVICE_ATTR)   # planning only, never in a KernelSpec


def work(node: Node) -> int:
    """How many primitive ops that read or write data this node stands for.

    Views and constants cost nothing in TF; a composite (Softmax, FusedBatchNorm)
    is one TF op but several passes of work, so fusing it alone still pays.  Of the
    layout ops only Reshape is a view in TF: an index map (Transpose, Slice, ConcatV2,
    Pack, Pad, Reverse) is a copy there (a pass over its data), which a kernel reading
    through it saves.
    """
    if node.op in COMPOSITE_OPS:
        extra = _NCHW_EXTRA_PASSES if node.op in _NCHW_TRANSPOSED and \
            node.attrs.get("data_format", "").startswith("NC") else 0
        return COMPOSITE_PASSES.get(node.op, 2) + extra
    d = OPS.get(node.op)
    return int(d is not None and d.kind not in (Kind.LAYOUT, Kind.SOURCE)
               and node.op != "Identity" or node.op in INDEX_MAPS)

