"""TF op types -> canonical IR ops, and which TF ops are memory-intensive.

This module imports no TensorFlow; the frontend (frontend.py) uses it to build
the IR, and the report and the benchmark use it to count memory-intensive ops.

"Memory-intensive" (the papers' term) means: an op whose cost is moving bytes,
not arithmetic: element-wise math, broadcasts, reductions, casts, selects and
data-movement layout ops.  Pure *view* ops (Reshape, ExpandDims, Squeeze,
Identity, StopGradient) cost nothing in TF (they alias their input), so they are
fused when they sit inside a region but are not counted as memory-intensive.
"""
from __future__ import annotations

# TF op type -> canonical IR op for one-to-one mappings.
ALIASES = {
    "AddV2": "Add", "Add": "Add", "Sub": "Sub", "Mul": "Mul",
    "RealDiv": "Div", "Div": "Div", "DivNoNan": "DivNoNan",
    "Maximum": "Maximum", "Minimum": "Minimum",
    "SquaredDifference": "SquaredDifference", "Pow": "Pow",
    "FloorDiv": "FloorDiv", "FloorMod": "FloorMod",
    "Neg": "Neg", "Abs": "Abs", "Square": "Square", "Sqrt": "Sqrt", "Rsqrt": "Rsqrt",
    "Reciprocal": "Reciprocal", "Inv": "Reciprocal",
    "Exp": "Exp", "Expm1": "Expm1", "Log": "Log", "Log1p": "Log1p",
    "Tanh": "Tanh", "Sigmoid": "Sigmoid", "Relu": "Relu", "Relu6": "Relu6",
    "LeakyRelu": "LeakyRelu", "Elu": "Elu", "Selu": "Selu", "Softplus": "Softplus",
    "Softsign": "Softsign", "Erf": "Erf", "Erfc": "Erfc", "Sign": "Sign",
    "Floor": "Floor", "Ceil": "Ceil", "Round": "Round", "Rint": "Round",
    "Sin": "Sin", "Cos": "Cos",
    "IsNan": "IsNan", "IsInf": "IsInf", "IsFinite": "IsFinite",
    "Equal": "Equal", "NotEqual": "NotEqual", "Less": "Less", "LessEqual": "LessEqual",
    "Greater": "Greater", "GreaterEqual": "GreaterEqual",
    "LogicalAnd": "LogicalAnd", "LogicalOr": "LogicalOr", "LogicalNot": "LogicalNot",
    "Select": "Select", "SelectV2": "Select", "ClipByValue": "ClipByValue",
    "Cast": "Cast",
    "Sum": "Sum", "Mean": "Mean", "Max": "Max", "Min": "Min", "Prod": "Prod",
    "All": "All", "Any": "Any",
    "Identity": "Identity", "StopGradient": "Identity", "PreventGradient": "Identity",
    "Snapshot": "Identity",
    "Reshape": "Reshape", "ExpandDims": "Reshape", "Squeeze": "Reshape",
    "ZerosLike": "FillLike", "OnesLike": "FillLike", "Fill": "Const", "Const": "Const",
}

# TF ops expanded into several IR ops by the frontend.
COMPOSITES = frozenset({"Softmax", "LogSoftmax", "FusedBatchNorm", "FusedBatchNormV2",
                        "FusedBatchNormV3", "BiasAdd", "BiasAddV1",
                        "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad", "SoftplusGrad",
                        "SigmoidGrad", "TanhGrad", "BiasAddGrad", "L2Loss", "AddN",
                        "Tile", "BroadcastTo", "SoftmaxCrossEntropyWithLogits",
                        "FusedBatchNormGrad", "FusedBatchNormGradV2",
                        "FusedBatchNormGradV3"})

VIEW_OPS = frozenset({"Reshape", "ExpandDims", "Squeeze", "Identity", "StopGradient",
                      "PreventGradient", "Snapshot"})

# TF's random-number ops.  A stateful one draws from a generator of its own, which
# starts at its seed (its ``seed`` and ``seed2`` attrs; both 0: seeded at random); a
# keyed one from the key and counter it is given, which the last four make.
STATEFUL_RANDOM = frozenset({
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal",
    "ParameterizedTruncatedNormal", "RandomGamma", "RandomPoisson", "RandomPoissonV2",
    "Multinomial", "RandomShuffle", "RandomCrop"})
KEYED_RANDOM = frozenset({
    "StatelessRandomUniform", "StatelessRandomNormal", "StatelessTruncatedNormal",
    "StatelessRandomUniformInt", "StatelessRandomUniformV2", "StatelessRandomNormalV2",
    "StatelessTruncatedNormalV2", "StatelessRandomUniformIntV2",
    "StatelessRandomUniformFullIntV2", "StatelessRandomGetKeyCounter",
    "StatelessRandomGetKeyCounterAlg", "RngReadAndSkip"})

# Ops left to TF on purpose, with the reason the report shows.
LEFT_TO_TF = {
    op: "random numbers (dropout masks): a kernel would not reproduce TF's Philox "
        "stream, so the op stays TF's and the mask equals TF's for the same seed; the "
        "element-wise math around it is fused"
    for op in ("StatelessRandomUniformV2", "StatelessRandomNormalV2",
               "StatelessRandomUniform", "StatelessRandomNormal", "RandomUniform",
               "RandomStandardNormal", "StatelessTruncatedNormalV2")
}


# Layout ops fused as index maps (the frontend's converters, schedule/layout.py), in the
# forms docs/limits.md names: copies in TF, so counted as memory-intensive.
LAYOUT_MAPS = frozenset({
    "Transpose", "Slice", "StridedSlice", "ConcatV2", "Pack", "Split", "SplitV", "Unpack",
    "Pad", "PadV2", "ReverseV2", "StridedSliceGrad", "GatherV2",
    "UnsortedSegmentSum"})

# Memory-intensive TF ops we do not fuse (yet): counted in the denominator, so the
# report's coverage figure stays honest.
UNSUPPORTED_MEMORY_INTENSIVE = frozenset({
    "Concat", "MirrorPad", "OneHot", "ArgMax", "ArgMin", "Cumsum", "Atan2", "Tan", "Asin",
    "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "Lgamma", "Digamma",
    "Mod", "TruncateDiv", "TruncateMod", "BitwiseAnd", "BitwiseOr", "ResizeBilinear",
    "ResizeNearestNeighbor", "MaxPool", "AvgPool", "Gelu", "Mish", "LRN",
    "Softmax_unsupported_axis", "Einsum_elementwise",
}) | frozenset(LEFT_TO_TF)


def canonical(tf_op: str) -> str | None:
    """The IR op a TF op maps to one-to-one, or None (composite or opaque)."""
    return ALIASES.get(tf_op)


def is_memory_intensive(tf_op: str) -> bool:
    """Counted in the report's memory-intensive totals (see module docstring)."""
    if tf_op in VIEW_OPS or tf_op == "Const":
        return False
    return tf_op in ALIASES or tf_op in COMPOSITES or tf_op in LAYOUT_MAPS or \
        tf_op in UNSUPPORTED_MEMORY_INTENSIVE
