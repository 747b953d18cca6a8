"""Two-operand Einsum as one BatchMatMulV2, its transposes done as row gathers.

TF's Einsum kernel brings each operand into [batch..., free..., contracted...] order
with a Transpose, runs one batched GEMM, and transposes the result into the output's
label order.  Multi-head attention runs four such transposes per layer (Keras's
``MultiHeadAttention``: "BTNH,BSNH->BNTS" transposes the query and the key,
"BNTS,BSNH->BTNH" the value and the result), and TF's generic Transpose is slow for
them: [1, 128, 4, 64] float32 (128 KiB) takes ~43 us, where a copy of the same bytes
takes a few.  XLA folds the same permutations into cheap copy fusions.

Each of these permutations keeps the trailing axis (the head dim, 64 contiguous
floats) in place: it only reorders *rows*.  Such a permutation is a ``GatherV2``:

    x [P..., X..., S...] -> Reshape [prod P, prod X, prod S]
      -> GatherV2(axis=1, indices = the permutation of the X block, a constant)
      -> Reshape to the target order

which TF runs as one memcpy per row.  The rewrite:

    Einsum(a, b) -> Reshape(BatchMatMulV2(A, B, adj_x, adj_y), out)

where A is ``a`` in [batch, lfree, contract] or [batch, contract, lfree] order (adj_x)
merged to [batch..., M, K], B likewise, and each operand (and the result) is reordered
by nothing (a view) or by one row gather.  Of the two orders an operand may take, one
that needs no move wins, else one a row gather can make.  Where the result cannot be
reordered by a row gather, the operands are swapped (the product computed transposed:
Einsum(a, b) is Einsum(b, a) with the labels swapped), so that the contiguous tail
of its rows is the other operand's free dim: the attention's value gradient
"BTNH,BNTS->BSNH" would leave [B, N, H, S] rows of S to reorder into BSNH (one
element at a time); swapped, [B, N, S, H] reaches BSNH by a gather of rows of H.

Measured on the 2-core machine (shared, load 2-3), the models suite's Keras encoder
(4 layers, d_model 256, 4 heads, seq 128), stitched with and without this pass, calls
interleaved (median of per-round ratios): 1.03-1.045x faster at batch 1, 1.04x at
batch 8 (1.015x at 2 and 8 layers).  In isolation a row gather of [1, 128, 4, 64]
takes ~13 us per op against ~43 us for TF's Transpose ([8, ...]: 94 vs 123 us).

Applied only where it helps and is cheap: two operands, single-letter labels, no
ellipsis, no label repeated in one operand or summed over one operand only, a float
dtype; every dim static but at most one, which must be a batch label (present in
both operands and the output: the unknown batch of a Keras model); at least one
operand or the result needs a move, every move is a row gather whose rows hold at
least ``_MIN_ROW`` elements and whose index has at most ``_MAX_INDEX`` entries.
Anything else keeps TF's Einsum.

Where tf/passes/blas.py will run the product on OpenBLAS, a move that only swaps the
last batch label and the rows of an operand or the result (the attention's query, key
and value [B, T, N, H] taken as [B, N, T, H]; "BNTS,BSNH->BTNH"'s result [B, N, T, H]
given as [B, T, N, H]) is a Transpose instead of a gather, which blas.py folds into
the product (``transpose_x``, ``transpose_y``, ``transpose_out``: it reads or writes
the swapped layout in place, no copy).  The Einsum node keeps its name (it becomes the
output Reshape), so consumers and fetches are untouched; GatherV2, BatchMatMulV2 and
Reshape all have gradients.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, types_pb2

from ..passmanager import Pass
from . import attention, blas

_FLOATS = {types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE, types_pb2.DT_HALF, types_pb2.DT_BFLOAT16}
_EQUATION = re.compile(r"^([A-Za-z]+),([A-Za-z]+)->([A-Za-z]*)$")
_MIN_ROW = 16            # a gathered row of fewer elements is an element-wise gather: slow
_MAX_INDEX = 1 << 20     # arbitrary: a larger constant index is more graph than it saves


@dataclass(frozen=True)
class _Move:
    """Reorder labels ``src`` -> ``dst`` by a row gather: the first ``p`` and last ``s``
    labels stay, the middle block is permuted."""
    src: str
    dst: str
    p: int
    s: int


@dataclass(frozen=True)
class Plan:
    lhs: str                 # each operand's label order as it arrives
    rhs: str
    out: str
    a_order: str             # the order each operand takes for the BatchMatMul
    b_order: str
    adj_x: bool
    adj_y: bool
    batch: str
    lfree: str
    rfree: str
    contract: str
    dims: dict               # label -> size, -1 for the (one) unknown
    swap: bool = False       # lhs and rhs are the Einsum's second and first operand

    def moves(self) -> list:
        """The row gathers this plan runs (None where an order is already right)."""
        return [_move(self.lhs, self.a_order, self.dims),
                _move(self.rhs, self.b_order, self.dims),
                _move(self.batch + self.lfree + self.rfree, self.out, self.dims)]


def candidates(graph_def, ir_graph) -> dict:
    """node name -> Plan of each Einsum this pass rewrites."""
    out = {}
    for nd in graph_def.node:
        if nd.op != "Einsum" or nd.name not in ir_graph or "equation" not in nd.attr:
            continue
        if "T" not in nd.attr or nd.attr["T"].type not in _FLOATS:
            continue
        node = ir_graph[nd.name]
        if len(node.inputs) != 2:
            continue
        shapes = [ir_graph.type_of(r).shape for r in node.inputs]
        if any(s is None for s in shapes):
            continue
        plan = plan_for(nd.attr["equation"].s.decode("utf-8", "replace"), *shapes)
        if plan is not None:
            out[nd.name] = plan
    return out


def plan_for(equation: str, lhs_shape, rhs_shape) -> Plan | None:
    """The rewrite of one Einsum, or None where TF's Einsum stays (module docstring):
    with its operands as they come, else swapped."""
    m = _EQUATION.match(equation.replace(" ", ""))
    if m is None:
        return None
    lhs, rhs, out = m.groups()
    return _plan(lhs, rhs, out, lhs_shape, rhs_shape, False) or \
        _plan(rhs, lhs, out, rhs_shape, lhs_shape, True)


def _plan(lhs, rhs, out, lhs_shape, rhs_shape, swap: bool) -> Plan | None:
    if len(lhs) != len(lhs_shape) or len(rhs) != len(rhs_shape):
        return None
    if any(len(set(t)) != len(t) for t in (lhs, rhs, out)) or \
            not set(out) <= set(lhs) | set(rhs) or \
            any(c not in rhs and c not in out for c in lhs) or \
            any(c not in lhs and c not in out for c in rhs):
        return None
    dims = _dims(lhs, lhs_shape, rhs, rhs_shape)
    if dims is None:
        return None
    if 0 in dims.values():
        return None          # empty: a -1 beside a 0 in a Reshape target is ambiguous
    batch = "".join(c for c in out if c in lhs and c in rhs)
    unknown = [c for c, d in dims.items() if d < 0]
    if len(unknown) > 1 or (unknown and unknown[0] not in batch):
        return None
    lfree = "".join(c for c in out if c in lhs and c not in rhs)
    rfree = "".join(c for c in out if c in rhs and c not in lhs)
    contract = "".join(c for c in lhs if c in rhs and c not in out)
    a = _pick(lhs, [(batch + lfree + contract, False), (batch + contract + lfree, True)], dims)
    b = _pick(rhs, [(batch + contract + rfree, False), (batch + rfree + contract, True)], dims)
    if a is None or b is None:
        return None
    plan = Plan(lhs, rhs, out, a[0], b[0], a[1], b[1], batch, lfree, rfree, contract, dims,
                swap)
    moves = plan.moves()
    if moves[2] is False or all(mv is None for mv in moves):
        return None          # the result cannot be reordered cheaply / Einsum moves nothing
    if max(_prod(d for d in dims.values() if d > 0), 1) >= 2 ** 31:
        return None          # the int32 shape constants could not hold a merged size
    return plan


def _dims(lhs, lhs_shape, rhs, rhs_shape) -> dict | None:
    """label -> size (-1 unknown); None where the operands disagree on a size."""
    dims: dict = {}
    for labels, shape in ((lhs, lhs_shape), (rhs, rhs_shape)):
        for c, d in zip(labels, shape):
            d = -1 if d is None or d < 0 else int(d)
            if c in dims and dims[c] != d:
                return None         # a size-1 broadcast or a mismatch: TF's Einsum says
            dims[c] = d
    return dims


def _pick(src: str, options, dims):
    """The first option (order, adjoint) reachable without a move, else the first a row
    gather reaches; None if neither."""
    moves = [(_move(src, order, dims), order, adj) for order, adj in options]
    for mv, order, adj in moves:
        if mv is None:
            return order, adj
    for mv, order, adj in moves:
        if mv is not False:
            return order, adj
    return None


def _move(src: str, dst: str, dims):
    """None: ``src`` is already ``dst``; a _Move: a row gather makes it; False: neither."""
    if src == dst:
        return None
    n = len(src)
    p = next((i for i in range(n) if src[i] != dst[i]), n)
    s = next((i for i in range(n) if src[n - 1 - i] != dst[n - 1 - i]), n)
    middle, tail = src[p:n - s], src[n - s:]
    if any(dims[c] < 0 for c in middle + tail):
        return False
    if _prod(dims[c] for c in tail) < _MIN_ROW or _prod(dims[c] for c in middle) > _MAX_INDEX:
        return False
    return _Move(src, dst, p, s)


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _gather_index(mv: _Move, dims) -> np.ndarray:
    """Row r of the reordered middle block reads row index[r] of the original one."""
    n = len(mv.src)
    mid_src, mid_dst = mv.src[mv.p:n - mv.s], mv.dst[mv.p:n - mv.s]
    rows = np.arange(_prod(dims[c] for c in mid_src), dtype=np.int64)
    rows = rows.reshape([dims[c] for c in mid_src])
    return rows.transpose([mid_src.index(c) for c in mid_dst]).reshape(-1)


_PRODUCT = "batch_matmul"       # the suffix of the product node an Einsum becomes


def product_name(einsum: str) -> str:
    """The name of the BatchMatMulV2 that ``rewrite`` makes of Einsum node ``einsum``."""
    return f"{einsum}/einsum/{_PRODUCT}"


def rewrite(graph_def, todo: dict, head_transposes: bool = False) -> None:
    """Turn each Einsum in ``todo`` (from ``candidates``) into a BatchMatMulV2, in place:
    the node itself becomes the output Reshape; its helper nodes are appended.
    ``head_transposes``: a result move the product can write (module docstring) is a
    Transpose for blas.py to fold."""
    for nd in [nd for nd in graph_def.node if nd.name in todo]:
        _Builder(graph_def, nd, head_transposes).lower(todo[nd.name])


def _swaps_head_and_rows(batch: str, rows: str, cols: str, labels: str) -> bool:
    """Whether ``labels`` is the order ``batch + rows + cols`` with the last batch label
    after the rows: a swap a product reads or writes in place."""
    return len(batch) >= 1 and labels == batch[:-1] + rows + batch[-1] + cols


class _Builder:
    def __init__(self, graph_def, nd, head_transposes: bool = False):
        self.graph_def, self.nd, self.name, self.dev = graph_def, nd, nd.name, nd.device
        self.t = attr_value_pb2.AttrValue(type=nd.attr["T"].type)
        self.head_transposes = head_transposes and \
            nd.attr["T"].type in (types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE)

    def lower(self, plan: Plan) -> None:
        nd = self.nd
        a, b = [i for i in nd.input if not i.startswith("^")]
        if plan.swap:
            a, b = b, a
        control = [i for i in nd.input if i.startswith("^")]
        if control:          # blas.py leaves a product with control inputs in place
            self.head_transposes = False
        d = plan.dims
        m, k, n = (_prod(d[c] for c in g) for g in (plan.lfree, plan.contract, plan.rfree))
        batch = [d[c] for c in plan.batch]
        a_shape = batch + ([k, m] if plan.adj_x else [m, k])
        b_shape = batch + ([n, k] if plan.adj_y else [k, n])
        a = self.operand("a", a, plan.lhs, plan.a_order, d, a_shape,
                         plan.contract if plan.adj_x else plan.lfree)
        b = self.operand("b", b, plan.rhs, plan.b_order, d, b_shape,
                         plan.rfree if plan.adj_y else plan.contract)
        mm = self.add(_PRODUCT, "BatchMatMulV2", [a, b] + control, T=self.t,
                      adj_x=attr_value_pb2.AttrValue(b=plan.adj_x),
                      adj_y=attr_value_pb2.AttrValue(b=plan.adj_y))
        order = plan.batch + plan.lfree + plan.rfree
        mv = _move(order, plan.out, d)
        if mv is not None and self.head_transposes and \
                _swaps_head_and_rows(plan.batch, plan.lfree, plan.rfree, plan.out):
            mm = self.head_transpose("out", mm, len(plan.batch) + 2)
        elif mv is not None:
            mm = self.gather("out", mm, mv, d)
        nd.op = "Reshape"
        del nd.input[:]
        nd.input.extend([mm, self.const("out_shape", [d[c] for c in plan.out])])
        nd.attr.clear()
        nd.attr["T"].CopyFrom(self.t)
        nd.attr["Tshape"].type = types_pb2.DT_INT32

    def operand(self, tag, x, src, dst, dims, shape, rows) -> str:
        """``x`` (labels ``src``) in order ``dst`` (the batch labels, then ``rows``,
        then the rest), merged to ``shape``."""
        batch = dst[:len(shape) - 2]
        cols = dst[len(batch) + len(rows):]
        if self.head_transposes and _swaps_head_and_rows(batch, rows, cols, src):
            swapped = shape[:-3] + [shape[-2], shape[-3], shape[-1]]
            x = self.add(tag, "Reshape", [x, self.const(f"{tag}_shape", swapped)],
                         T=self.t, Tshape=attr_value_pb2.AttrValue(type=types_pb2.DT_INT32))
            return self.head_transpose(tag, x, len(shape))
        mv = _move(src, dst, dims)
        if mv is not None:
            x = self.gather(tag, x, mv, dims)
        return self.add(tag, "Reshape",
                        [x, self.const(f"{tag}_shape", shape)],
                        T=self.t, Tshape=attr_value_pb2.AttrValue(type=types_pb2.DT_INT32))

    def gather(self, tag, x, mv: _Move, dims) -> str:
        n = len(mv.src)
        prefix = [dims[c] for c in mv.src[:mv.p]]
        rows = [(-1 if any(v < 0 for v in prefix) else _prod(prefix)),
                _prod(dims[c] for c in mv.src[mv.p:n - mv.s]),
                _prod(dims[c] for c in mv.src[n - mv.s:])]
        i32 = attr_value_pb2.AttrValue(type=types_pb2.DT_INT32)
        x3 = self.add(f"{tag}_rows", "Reshape", [x, self.const(f"{tag}_rows_shape", rows)],
                      T=self.t, Tshape=i32)
        return self.add(f"{tag}_gather", "GatherV2",
                        [x3, self.const(f"{tag}_index", _gather_index(mv, dims)),
                         self.const(f"{tag}_axis", 1)],
                        Tparams=self.t, Tindices=i32, Taxis=i32,
                        batch_dims=attr_value_pb2.AttrValue(i=0))

    def head_transpose(self, tag, x, rank) -> str:
        """``x`` with its last batch dim and its rows swapped (blas.py folds it)."""
        perm = list(range(rank - 3)) + [rank - 2, rank - 3, rank - 1]
        return self.add(f"{tag}_transpose", "Transpose", [x, self.const(f"{tag}_perm", perm)],
                        T=self.t, Tperm=attr_value_pb2.AttrValue(type=types_pb2.DT_INT32))

    def add(self, suffix, op, inputs, **attrs) -> str:
        new = self.graph_def.node.add(name=f"{self.name}/einsum/{suffix}", op=op,
                                      device=self.dev)
        new.input.extend(inputs)
        for key, value in attrs.items():
            new.attr[key].CopyFrom(value)
        return new.name

    def const(self, suffix, value) -> str:
        value = np.asarray(value, np.int64)     # plan_for: every entry fits int32
        return self.add(suffix, "Const", [],
                        dtype=attr_value_pb2.AttrValue(type=types_pb2.DT_INT32),
                        value=attr_value_pb2.AttrValue(tensor=tf.make_tensor_proto(
                            value.astype(np.int32), tf.int32)))


def _run(ctx):
    # Options(exclude): an excluded Einsum stays TF's
    todo = {n: p for n, p in candidates(ctx.graph_def, ctx.ir).items()
            if n not in ctx.excluded}
    if not todo:
        return None
    which = blas.mode(ctx.options, ctx)
    heads = set(todo) if which == blas.ALL else set()
    if which == blas.ATTENTION:
        # only the products that will be ours (those of masked attentions, which the
        # attention pass takes) get Transposes it folds; the others' stay row gathers
        trial = type(ctx.graph_def)()
        trial.CopyFrom(ctx.graph_def)
        rewrite(trial, todo, True)
        chosen, _, _ = attention.masked_products(trial, ctx, scratch=True)
        heads = {n for n in todo if product_name(n) in chosen}
    rewrite(ctx.graph_def, {n: p for n, p in todo.items() if n in heads}, True)
    rewrite(ctx.graph_def, {n: p for n, p in todo.items() if n not in heads}, False)
    return (f"{len(todo)} Einsum node(s) run as one BatchMatMulV2 each, their "
            "operand and result transposes as row gathers (tf/passes/einsum.py; "
            "Options(einsum=False) keeps them)")


PASS = Pass("einsum", _run, option="einsum")
