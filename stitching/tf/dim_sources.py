"""Where the entries of a run-time shape vector come from: constants, or dims of tensors.

A BroadcastTo to a batch known only at run time (a ViT's class token broadcast to
``[ops.shape(x)[0], 1, d]``, keras.ops.broadcast_to) gets its target from shape
arithmetic over ``Shape`` ops:

    Shape(x) -> StridedSlice [0] (shrink) --+
    Const 1 --------------------------------+-> Pack -> BroadcastTo(cls, .)
    Const 192 ------------------------------+

Each entry is then either a constant or "dim d of tensor x".  The frontend
(_convert_tile) turns such a broadcast into a Tile that reads x for its dims only:
the fused kernel takes the run-time size from x's shape, exactly what TF reads.

``entries(t)`` evaluates a 1-D int32/int64 tensor through Const, Shape, Identity,
Pack (axis 0) and ConcatV2 (axis 0) of vectors, and StridedSlice (constant bounds,
stride 1 or a shrink to a scalar) or GatherV2 (a constant index) of a vector; any
other op gives None (unknown), and the caller leaves its node to TF.
"""
from __future__ import annotations

import numpy as np
from tensorflow.python.framework import tensor_util

_MAX_DEPTH = 16        # arbitrary: shape arithmetic chains are a few ops deep


def entries(t, depth: int = 0) -> list | None:
    """Per entry of the 1-D int tensor ``t``: an int, or (tensor, dim); None if unknown."""
    if depth > _MAX_DEPTH or t.dtype.name not in ("int32", "int64"):
        return None
    v = tensor_util.constant_value(t)
    if v is not None:
        v = np.asarray(v)
        return [int(e) for e in v.reshape(-1)] if v.ndim == 1 else None
    op = t.op
    if op.type == "Shape":
        x = op.inputs[0]
        if x.shape.rank is None:
            return None
        return [d if d is not None else (x, i) for i, d in enumerate(x.shape.as_list())]
    if op.type == "Identity":
        return entries(op.inputs[0], depth + 1)
    if op.type == "Pack" and int(op.get_attr("axis")) == 0:
        out = [scalar(i, depth + 1) for i in op.inputs]
        return None if any(e is None for e in out) else out
    if op.type == "ConcatV2":
        axis = tensor_util.constant_value(op.inputs[-1])
        if axis is None or int(axis) not in (0, -1):
            return None
        out = []
        for piece in op.inputs[:-1]:
            e = entries(piece, depth + 1)
            if e is None:
                return None
            out += e
        return out
    if op.type == "StridedSlice" and not _shrinks(op):
        return _sliced(op, depth)
    return None


def scalar(t, depth: int = 0):
    """An int, or (tensor, dim), for a scalar int tensor; None if unknown."""
    if depth > _MAX_DEPTH:
        return None
    v = tensor_util.constant_value(t)
    if v is not None:
        v = np.asarray(v)
        return int(v.reshape(())) if v.size == 1 and v.dtype.kind == "i" else None
    op = t.op
    if op.type == "Identity":
        return scalar(op.inputs[0], depth + 1)
    if op.type == "StridedSlice" and _shrinks(op):
        vec = entries(op.inputs[0], depth + 1)
        begin = tensor_util.constant_value(op.inputs[1])
        if vec is None or begin is None or np.asarray(begin).size != 1:
            return None
        return _at(vec, int(np.asarray(begin).reshape(())))
    if op.type == "GatherV2":
        vec = entries(op.inputs[0], depth + 1)
        index = tensor_util.constant_value(op.inputs[1])
        axis = tensor_util.constant_value(op.inputs[2])
        if vec is None or index is None or axis is None or int(axis) != 0 or \
                np.asarray(index).ndim != 0:
            return None
        return _at(vec, int(index))
    return None


def _shrinks(op) -> bool:
    """A StridedSlice of a vector that takes one entry as a scalar (``shape[0]``)."""
    return int(op.get_attr("shrink_axis_mask")) == 1 and \
        int(op.get_attr("ellipsis_mask")) == 0 and int(op.get_attr("new_axis_mask")) == 0


def _at(vec: list, i: int):
    if -len(vec) <= i < len(vec):
        return vec[i]
    return None


def _sliced(op, depth: int) -> list | None:
    """``vec[b:e]`` (stride 1, constant bounds, begin/end masks) of a vector."""
    if any(int(op.get_attr(m)) for m in ("ellipsis_mask", "new_axis_mask",
                                         "shrink_axis_mask")):
        return None
    vec = entries(op.inputs[0], depth + 1)
    bounds = [tensor_util.constant_value(i) for i in op.inputs[1:4]]
    if vec is None or any(b is None or np.asarray(b).size != 1 for b in bounds):
        return None
    b, e, s = (int(np.asarray(v).reshape(())) for v in bounds)
    if s != 1:
        return None
    b = None if int(op.get_attr("begin_mask")) & 1 else b
    e = None if int(op.get_attr("end_mask")) & 1 else e
    return vec[b:e]
