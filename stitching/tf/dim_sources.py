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
Pack (axis 0) and ConcatV2 (axis 0) of vectors, ExpandDims of a scalar, and
StridedSlice (constant bounds, or a shrink to a scalar) or GatherV2 (a constant
index) of a vector; any other op gives None (unknown), and the caller leaves its
node to TF.  Slices to such sizes (a position table cut to ``shape(x)[1]``) read the
tensor for its dims the same way (frontend's SliceTo).
"""
from __future__ import annotations

import numpy as np
from tensorflow.python.framework import tensor_util

from ..ir.ops import MAX_SHIFT, rest_size

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
    if op.type == "StridedSlice":
        got = _slice_of(op, depth)
        return got if isinstance(got, list) else None
    if op.type == "ExpandDims" and op.inputs[0].shape.rank == 0:
        # a scalar made a vector: Grappler's form of a one-entry Pack
        # (``table[:tf.shape(x)[1]]``'s end)
        e = scalar(op.inputs[0], depth + 1)
        return None if e is None else [e]
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
    if op.type == "StridedSlice":
        got = _slice_of(op, depth)
        return None if isinstance(got, list) else got
    if op.type == "GatherV2":
        vec = entries(op.inputs[0], depth + 1)
        index = tensor_util.constant_value(op.inputs[1])
        axis = tensor_util.constant_value(op.inputs[2])
        if vec is None or index is None or axis is None or int(axis) != 0 or \
                np.asarray(index).ndim != 0:
            return None
        return _at(vec, int(index))
    return None


def dim_of(t, i: int):
    """(tensor, dim) whose run-time size dim i of ``t`` is: that of a Slice's size
    entry where shape arithmetic gives it (TF's Slice fails unless it takes exactly
    that many; a StridedSlice clamps, so it is not followed), else (t, i) itself."""
    if t.op.type == "Slice":
        size = entries(t.op.inputs[2])
        if size is not None and 0 <= i < len(size) and isinstance(size[i], tuple):
            return size[i]
    return (t, i)


def _at(vec: list, i: int):
    if -len(vec) <= i < len(vec):
        return vec[i]
    return None


class NotEvaluable(Exception):
    pass


def _constant(t):
    v = tensor_util.constant_value(t)
    if v is None:
        raise NotEvaluable(f"{t.op.type} input {t.name} is not a constant")
    return v


def dense_slice(op, x, ends=None) -> tuple:
    """(begin, size, strides, out_dims) per dim of ``x`` (size -1: a whole dim known
    only at run time) for a StridedSlice or StridedSliceGrad op (begin, end, strides:
    inputs 1 to 3): the sparse spec (masks, ellipsis) made dense, as NumPy indexing
    reads it (TF's ValidateStridedSliceOp has the same semantics).  ``out_dims``: per
    output dim, the dim of ``x`` it slices, or None for a new axis (shrunk dims have
    none).  Raises NotEvaluable with the reason the form is not handled.

    ``ends``: the end entries as ``entries`` gives them (constants, or (tensor, dim)
    known only at run time), else the constant input 2.  A run-time end's size is that
    (tensor, dim) (begin 0, stride 1): what count it is, the caller decides.  An index
    into a dim known only at run time is begin ``v`` (from the end where v < 0), size 1:
    the kernel checks it exists (schedule/layout.py, View.picks), as TF does; a slice
    of such a dim from b to -e (``x[:, 1:]``, ``x[:, :-1]``) is begin b, size
    ops.rest_size(e) (View.less); other slices of it raise NotEvaluable."""
    begin, strides = (np.asarray(_constant(op.inputs[i])).reshape(-1).tolist()
                      for i in (1, 3))
    end = ends if ends is not None else np.asarray(_constant(op.inputs[2])).reshape(-1).tolist()
    masks = {m: int(op.get_attr(m)) for m in ("begin_mask", "end_mask", "ellipsis_mask",
                                              "new_axis_mask", "shrink_axis_mask")}
    index = []
    for i, (b, e, s) in enumerate(zip(begin, end, strides)):
        bit = 1 << i
        if masks["ellipsis_mask"] & bit:
            index.append(Ellipsis)
        elif masks["new_axis_mask"] & bit:
            index.append(None)
        elif masks["shrink_axis_mask"] & bit:
            index.append(int(b))
        else:
            index.append(slice(None if masks["begin_mask"] & bit else int(b),
                               None if masks["end_mask"] & bit else
                               e if isinstance(e, tuple) else int(e), int(s)))
    if Ellipsis not in index:
        index.append(Ellipsis)
    at = index.index(Ellipsis)
    n_real = sum(1 for v in index if v is not None and v is not Ellipsis)
    index[at:at + 1] = [slice(None)] * (len(x) - n_real)
    dims = [v for v in index if v is not None]
    if len(dims) != len(x):
        raise NotEvaluable("StridedSlice with more indices than dims")
    b_out, k_out, s_out = [], [], []
    for v, n in zip(dims, x):
        if isinstance(v, slice) and isinstance(v.stop, tuple):
            if v.start not in (None, 0) or v.step != 1:
                raise NotEvaluable("a StridedSlice to an end known only at run time with "
                                   "a begin or stride other than 0 and 1: not fused")
            b_out.append(0), k_out.append(v.stop), s_out.append(1)
            continue
        if isinstance(v, int):
            if n >= 0:
                v = v + n if v < 0 else v
                if not 0 <= v < n:
                    raise NotEvaluable(f"StridedSlice index {v} out of range")
            b_out.append(v), k_out.append(1), s_out.append(1)
            continue
        if n < 0:
            b_out.append(0 if v.start is None else v.start), s_out.append(1)
            k_out.append(_rest_of_run_time_dim(v))
            continue
        start, stop, step = v.indices(n)
        count = len(range(start, stop, step))
        b_out.append(start if count else 0), k_out.append(count), s_out.append(step)
    out_dims, d = [], 0
    for v in index:
        if v is None:
            out_dims.append(None)
            continue
        if not isinstance(v, int):
            out_dims.append(d)
        d += 1
    return b_out, k_out, s_out, out_dims


def _rest_of_run_time_dim(v: slice) -> int:
    """The Slice size entry of slice ``v`` of a dim known only at run time: -1 (the
    whole dim), or ops.rest_size(e) for ``x[b:-e]`` (b >= 0, e > 0 or no end: the rest
    less e, clamped at 0 as TF's StridedSlice clamps); NotEvaluable for the forms whose
    count is not n - c (a negative begin, a non-negative end, a stride)."""
    start = 0 if v.start is None else v.start
    if v.step not in (None, 1) or start < 0 or (v.stop is not None and v.stop >= 0):
        raise NotEvaluable("a slice of a dim known only at run time other than from a "
                           "begin to an end counted from its end (x[:, 1:], x[:, :-1]): "
                           "its count is not the dim less a constant")
    e = 0 if v.stop is None else -v.stop
    if start > MAX_SHIFT or e > MAX_SHIFT:
        raise NotEvaluable(f"a slice of a dim known only at run time that drops more "
                           f"than {MAX_SHIFT} elements at one end")
    return -1 if (start, e) == (0, 0) else rest_size(e)


def strided_slice(nd, vals, begin, end, strides):
    """The value of StridedSlice NodeDef ``nd`` of the 1-D ``vals`` (a list of any
    entries) with constant bounds (one-entry lists; begin/end masks and shrink
    honoured); raises NotEvaluable.  tf/passes/shapes.py evaluates its GraphDefs'
    slices with it too."""
    if not isinstance(vals, list) or any(
            not isinstance(b, list) or len(b) != 1 or None in b
            for b in (begin, end, strides)) \
            or int_attr(nd, "ellipsis_mask") or int_attr(nd, "new_axis_mask"):
        raise NotEvaluable
    if strides[0] == 0:
        raise NotEvaluable
    b = None if int_attr(nd, "begin_mask") & 1 else begin[0]
    e = None if int_attr(nd, "end_mask") & 1 else end[0]
    if int_attr(nd, "shrink_axis_mask") & 1:
        if b is None or not -len(vals) <= b < len(vals):
            raise NotEvaluable
        return vals[b]
    return vals[slice(b, e, strides[0])]


def int_attr(nd, name) -> int:
    """An int attr of NodeDef ``nd``, 0 where it is absent (TF's default for these)."""
    return nd.attr[name].i if name in nd.attr else 0


def _slice_of(op, depth: int):
    """The value of StridedSlice ``op`` of a vector: a list, or one entry where it
    shrinks to a scalar; None if unknown."""
    vec = entries(op.inputs[0], depth + 1)
    bounds = [tensor_util.constant_value(i) for i in op.inputs[1:4]]
    if vec is None or any(b is None for b in bounds):
        return None
    try:
        return strided_slice(op.node_def, vec,
                             *(np.asarray(b).reshape(-1).tolist() for b in bounds))
    except NotEvaluable:
        return None
