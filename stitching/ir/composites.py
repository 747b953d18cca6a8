"""Composite TF ops, expanded into op-table primitives when a spec is built.

The planner sees one node per TF node (so a region never holds half a Softmax);
``expand`` turns a composite node into primitive spec nodes.  Each expansion is
the textbook formula TF's own kernel computes:

  Softmax(x)      = e * (1 / sum(e)),      e = exp(x - max(x))     (last axis;
                    TF's kernel multiplies by the inverse, it does not divide)
  LogSoftmax(x)   = s - log(sum(exp(s))),  s = x - max(x)
  BiasAdd(x, b)   = x + b                  (b broadcast on the channel axis)
  FusedBatchNorm  = x * k + (offset - mean * k),  k = scale * rsqrt(var + eps)
                    (inference only; channel axis by data_format)
"""
from __future__ import annotations

from .ops import Kind

# composite op -> (kind, number of data inputs)
COMPOSITE_OPS = {
    "Softmax": (Kind.REDUCTION, 1),
    "LogSoftmax": (Kind.REDUCTION, 1),
    "BiasAdd": (Kind.ELEMENTWISE, 2),
    "FusedBatchNorm": (Kind.ELEMENTWISE, 5),
}


def expand(op: str, attrs: dict, args: list, types: list, emit) -> int:
    """Emit primitives for one composite node.

    ``args`` are spec refs of the inputs, ``types`` their TensorTypes and
    ``emit(op, args, attrs) -> ref`` appends one primitive node (its type is
    inferred by the caller).  Returns the ref of the composite's (first) output.
    """
    x = types[0]
    rank = len(x.shape)
    if op in ("Softmax", "LogSoftmax"):
        last = {"axes": [rank - 1], "keep_dims": True}
        m = emit("Max", [args[0]], last)
        s = emit("Sub", [args[0], m], {})
        e = emit("Exp", [s], {})
        z = emit("Sum", [e], last)
        if op == "Softmax":
            return emit("Mul", [e, emit("Reciprocal", [z], {})], {})
        return emit("Sub", [s, emit("Log", [z], {})], {})
    if op == "BiasAdd":
        b = _to_channel(args[1], types[1], rank, attrs["data_format"], emit)
        return emit("Add", [args[0], b], {})
    if op == "FusedBatchNorm":
        scale, offset, mean, var = (
            _to_channel(a, t, rank, attrs["data_format"], emit)
            for a, t in zip(args[1:], types[1:]))
        eps = emit("Const", [], {"value": float(attrs["epsilon"]), "dtype": types[1].dtype,
                                 "shape": []})
        k = emit("Mul", [scale, emit("Rsqrt", [emit("Add", [var, eps], {})], {})], {})
        shift = emit("Sub", [offset, emit("Mul", [mean, k], {})], {})
        xin = args[0]
        if x.dtype != types[1].dtype:   # half-precision activations, float32 statistics
            xin = emit("Cast", [xin], {"to": types[1].dtype})
        y = emit("Add", [emit("Mul", [xin, k], {}), shift], {})
        if x.dtype != types[1].dtype:
            y = emit("Cast", [y], {"to": x.dtype})
        return y
    raise ValueError(f"not a composite op: {op}")


def _to_channel(ref, t, rank, data_format, emit):
    """A per-channel vector reshaped so it broadcasts on the channel axis."""
    if data_format.startswith("NC") and rank > 2:
        shape = [t.shape[0]] + [1] * (rank - 2)
        return emit("Reshape", [ref], {"shape": shape})
    return ref
