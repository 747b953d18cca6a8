"""Matrix products run by OpenBLAS where TF's own GEMM is Eigen's.

Stitching generates no GEMM: the products between its kernels stay library calls.
Where TF's oneDNN is off (the AMD EPYC machines here: ``IsMklEnabled()`` False), TF's
``MatMul`` and ``BatchMatMulV2`` are Eigen's tensor contraction, and they were 92% of
a stitched Transformer's op time at batch 1.  OpenBLAS (the ``scipy-openblas32``
wheel, runtime/gemm.cc) is faster on those shapes, so each product becomes our op:

    MatMul(a, b)                    ->  StitchedMatMul(a, b)
    MatMul(a, b) -> BiasAdd(., c)   ->  StitchedMatMul(a, b, c)   (the BiasAdd's name)
    BatchMatMul[V2](x, y)           ->  StitchedBatchMatMul(x, y)
    StitchedBatchMatMul(x, y) -> Transpose(., [0, 2, 1, 3])
                                    ->  StitchedBatchMatMul(x, y, transpose_out=True)
    StitchedBatchMatMul(Transpose(x, [0, 2, 1, 3]), y)
                                    ->  StitchedBatchMatMul(x, y, transpose_x=True)

The last two are an attention's head transposes ([batch, seq, heads, dim] <-> [batch,
heads, seq, dim]; any rank, the last batch dim and the rows swapped): left between a
product and its neighbour, each was a TF Transpose (or einsum.py's row gather) of its
own, a copy of the attention's output (~80 us per layer of the Llama decoder at batch
8).  The product reads or writes each head's columns of the wider rows in place
(gemm.cc's strides), so the copy goes.  einsum.py leaves such Transposes (not
gathers) where this pass will run.

The ops take TF's attributes and shape functions, so a node keeps its name, inputs,
attributes and ``_output_shapes``; only the op type changes.  A BiasAdd that is a
MatMul's only reader (TF's remapper would have run it inside ``_FusedMatMul``) is taken
into the product (xladot.py finds the same pairs).

Why after planning: the gemm and einsum passes (after planning too) make most of a
Transformer's products -- an EinsumDense's BatchMatMul against a weight becomes a
MatMul plus the bias as a BiasAdd, an Einsum becomes a BatchMatMulV2 -- so a pass
before planning would see few of them.  The planner already fuses a MatMul's BiasAdd
into its kernels where that pays (plan/epilogue.py keeps only convolution epilogues
with TF); the ones it leaves to TF are the pairs taken here.

Only float32 and float64 products on the CPU.  Where the device profile says TF runs
oneDNN's GEMM (``remapper.onednn``), OpenBLAS's products measured no faster than its
(0.95-1.02x per product, 0.85-0.88x per feed-forward block of 128 or 1024 rows,
BENCHMARKS.md ``gemm@amd_avx512``): this pass takes none there, and only
the batch products of the masked attentions become ours, in the attention pass that
fuses them (``mode`` ATTENTION; attention.py ``masked_products``).  Without the wheel
(or if the op library does not build) the products stay TF's and the report says why.
"""
from __future__ import annotations

import collections

import tensorflow as tf

from ..passmanager import Pass
from ..tfgraph import drop_nodes
from . import xladot

OPS = {"MatMul": "StitchedMatMul", "BatchMatMulV2": "StitchedBatchMatMul",
       "BatchMatMul": "StitchedBatchMatMul"}


# attributes TF's products carry that our ops do not declare (hints for its gradients)
_HINTS = ("grad_a", "grad_b", "grad_x", "grad_y")


def rewrite(graph_def, pairs) -> int:
    """Turn each (product, BiasAdd or None) of ``pairs`` into our op, in place;
    returns how many BiasAdds were taken into their product."""
    taken = set()
    for product, bias in pairs:
        product.op = OPS[product.op]
        for key in _HINTS:                            # TF's hints, not our ops' attrs
            if key in product.attr:
                del product.attr[key]
        if product.op == "StitchedMatMul":
            product.attr["n_bias"].i = 0 if bias is None else 1
        if bias is None:
            continue
        # the BiasAdd's node becomes the product; the MatMul's node goes
        _take_place(bias, product, [i for i in product.input if not i.startswith("^")] +
                    [bias.input[1]] + [i for i in bias.input if i.startswith("^")])
        taken.add(product.name)
    drop_nodes(graph_def, taken)
    return len(taken)


def _take_place(node, product, inputs) -> None:
    """``node`` becomes ``product`` reading ``inputs``, keeping its name (so its readers
    and fetches are untouched), device and ``_output_shapes`` (else none: the
    product's may differ)."""
    name, device = node.name, node.device
    shapes = node.attr["_output_shapes"].SerializeToString() \
        if "_output_shapes" in node.attr else None
    node.CopyFrom(product)
    node.name, node.device = name, device
    del node.input[:]
    node.input.extend(inputs)
    if shapes is not None:
        node.attr["_output_shapes"].ParseFromString(shapes)
    elif "_output_shapes" in node.attr:
        del node.attr["_output_shapes"]


def _nhwc(bias):
    """The BiasAdd if it adds along the last axis (NHWC, the default), else None."""
    if bias is None or "data_format" not in bias.attr or \
            bias.attr["data_format"].s == b"NHWC":
        return bias
    return None


def _eigen_machine() -> bool:
    """Whether the device profile says TF's GEMM is Eigen's on the CPU: the products
    this pass was measured against (the module's docstring)."""
    from ...plan import profiles
    from . import remapper
    prof = profiles.default()
    return prof.backend == "cpu" and not remapper.onednn(prof)


ALL, ATTENTION = "all", "attention"      # what ``mode`` says this pass takes


def mode(options, ctx=None) -> str | None:
    """Which matrix products become OpenBLAS ops on the machine the device profile
    describes: ``ALL`` (this pass takes them all) where TF's GEMM is Eigen's;
    ``ATTENTION`` where it is oneDNN's: only the products of the masked attentions,
    which the attention pass takes and fuses (attention.py ``_take_masked_products``
    says why), and only in a graph without a backward (``ctx``: a training graph's
    attentions are never fused); None: none (``Options(blas_gemm=False)``,
    ``fused_attention=False`` where TF's GEMM is oneDNN's, or the library does not
    load).  einsum.py asks it: it leaves a head transpose for a product to fold only
    where the product will be ours."""
    from ...runtime import blas
    if not options.blas_gemm or blas.unavailable() is not None:
        return None
    if _eigen_machine():
        return ALL
    from ...plan import profiles
    from . import inline
    if profiles.default().backend != "cpu" or not options.fused_attention or \
            (ctx is not None and inline.traced_has_backward(ctx)):
        return None
    return ATTENTION


def _run(ctx):
    from ...runtime import blas
    if not _eigen_machine():
        return None         # where TF's GEMM is oneDNN's: attention.py takes its products
    pairs = [(p, _nhwc(b)) for p, b in xladot.candidates(ctx.graph_def, ctx.fetched,
                                                         ctx.excluded)
             if p.op in OPS]
    if not pairs:
        return None
    problem = blas.unavailable()
    if problem is not None:
        return (f"{len(pairs)} matrix product(s) left to TF's Eigen GEMM: {problem} "
                f"(tf/passes/blas.py)")
    kinds = collections.Counter(p.op for p, _ in pairs)
    biased = rewrite(ctx.graph_def, pairs)
    folded = fold_head_transposes(ctx.graph_def, ctx.pinned)   # excluded: not taken
    listed = ", ".join(f"{n} {op}" for op, n in sorted(kinds.items()))
    return (f"{len(pairs)} matrix product(s) run by OpenBLAS ({listed}; {biased} with "
            f"their BiasAdd; {folded} head transpose(s) read or written in place): TF's "
            f"GEMM here is Eigen's (oneDNN off), slower (tf/passes/blas.py; "
            f"Options(blas_gemm=False) leaves them to TF)")


def batch_products(graph_def, fetched, excluded=frozenset()) -> list:
    """The BatchMatMul[V2] nodes of ``graph_def`` this pass could take (float32 or
    float64, two operands; none of ``excluded``, Options(exclude)'s)."""
    return [p for p, _ in xladot.candidates(graph_def, fetched, excluded)
            if p.op in ("BatchMatMulV2", "BatchMatMul")]


def _const_ints(node):
    """A Const node's value as a list of ints, else None."""
    if node is None or node.op != "Const" or "value" not in node.attr:
        return None
    value = tf.make_ndarray(node.attr["value"].tensor)
    return [int(v) for v in value.ravel()] if value.dtype.kind in "iu" else None


def _swaps_heads_and_rows(perm) -> bool:
    """Whether ``perm`` swaps the last batch dim and the rows of a product's
    output, [.., H, M, N] -> [.., M, H, N], and moves nothing else."""
    r = len(perm or ())
    return r >= 3 and perm == list(range(r - 3)) + [r - 2, r - 3, r - 1]


def _flag(node, key) -> bool:
    """A bool attribute, False when absent (reading a protobuf map's missing key would
    add an empty, invalid AttrValue to the node)."""
    return key in node.attr and node.attr[key].b


def fold_head_transposes(graph_def, fetched) -> int:
    """Take each Transpose that only swaps the heads and rows of a StitchedBatchMatMul's
    operand or output, where the product is its only reader or it the product's, into
    the product (``transpose_x``, ``transpose_y``, ``transpose_out``), in place; returns
    how many.  A Transpose of the output becomes the product, as ``rewrite``'s BiasAdd
    does."""
    nodes = {nd.name: nd for nd in graph_def.node}
    readers = collections.Counter(i.lstrip("^").split(":")[0]
                                  for nd in graph_def.node for i in nd.input)

    def head_swap(nd):
        """Whether ``nd`` is a Transpose swapping heads and rows, taking no control
        inputs and not fetched."""
        return nd is not None and nd.op == "Transpose" and len(nd.input) == 2 and \
            nd.name not in fetched and not nd.input[1].startswith("^") and \
            _swaps_heads_and_rows(_const_ints(nodes.get(nd.input[1].split(":")[0])))

    def sole_reader(producer_input, producer):
        return producer is not None and readers[producer.name] == 1 and \
            producer_input in (producer.name, producer.name + ":0")

    taken = set()
    for nd in list(graph_def.node):
        if nd.op != "StitchedBatchMatMul":
            continue
        for slot, key in ((0, "transpose_x"), (1, "transpose_y")):
            t = nodes.get(nd.input[slot].split(":")[0])
            if head_swap(t) and sole_reader(nd.input[slot], t) and not _flag(nd, key):
                nd.input[slot] = t.input[0]
                nd.attr[key].b = True
                taken.add(t.name)
    for nd in graph_def.node:
        if nd.name in taken:                  # already read by a product
            continue
        product = nodes.get(nd.input[0].split(":")[0]) if head_swap(nd) else None
        if product is None or product.op != "StitchedBatchMatMul" or \
                not sole_reader(nd.input[0], product) or product.name in fetched or \
                _flag(product, "transpose_out") or \
                any(i.startswith("^") for i in product.input):
            continue
        _take_place(nd, product, list(product.input))   # head_swap: no controls of its own
        nd.attr["transpose_out"].b = True
        taken.add(product.name)
    drop_nodes(graph_def, taken)
    return len(taken)


PASS = Pass("blas", _run, option="blas_gemm")


# Gradients, for a tape outside the stitched function (or a SavedModel's function
# differentiated after loading; importing stitching registers them): TF's own
# formulas for MatMul and BatchMatMulV2 (math_grad.py), each product again by our ops.
# A tape inside a stitched function never needs them: the backward there is TF's
# products, which this pass turns into ours with the rest of the graph.

def _pair(ta: bool, tb: bool, a, b, grad, mul):
    """(dA, dB) of op(A) op(B) = C given dC, ``mul(x, y, tx, ty)`` computing
    op(x) op(y): TF's _MatMulGrad table."""
    if not ta and not tb:
        return mul(grad, b, False, True), mul(a, grad, True, False)
    if not ta and tb:
        return mul(grad, b, False, False), mul(grad, a, True, False)
    if ta and not tb:
        return mul(b, grad, False, True), mul(a, grad, False, False)
    return mul(b, grad, True, True), mul(grad, a, True, True)


@tf.RegisterGradient("StitchedMatMul")
def _matmul_grad(op, grad):
    from ...runtime import blas
    ops = blas.load()
    a, b = op.inputs[0], op.inputs[1]
    grads = list(_pair(op.get_attr("transpose_a"), op.get_attr("transpose_b"), a, b, grad,
                       lambda x, y, tx, ty: ops.stitched_mat_mul(
                           a=x, b=y, bias=[], transpose_a=tx, transpose_b=ty)))
    if len(op.inputs) == 3:
        grads.append(tf.raw_ops.BiasAddGrad(out_backprop=grad))
    return grads


@tf.RegisterGradient("StitchedBatchMatMul")
def _batch_matmul_grad(op, grad):
    from ...runtime import blas
    ops = blas.load()
    x, y = op.inputs
    # in the layouts BatchMatMulV2 would see (each swap is its own inverse)
    tx, ty = op.get_attr("transpose_x"), op.get_attr("transpose_y")
    x, y = _swap(x) if tx else x, _swap(y) if ty else y
    if op.get_attr("transpose_out"):
        grad = _swap(grad)
    gx, gy = _pair(op.get_attr("adj_x"), op.get_attr("adj_y"), x, y, grad,
                   lambda u, v, tu, tv: ops.stitched_batch_mat_mul(
                       x=u, y=v, adj_x=tu, adj_y=tv))
    lead_x, lead_y = x.shape[:-2], y.shape[:-2]
    if not (lead_x.is_fully_defined() and lead_y.is_fully_defined() and lead_x == lead_y):
        # sum each gradient over the batch dims its operand was broadcast along
        sx, sy = tf.shape(x), tf.shape(y)
        rx, ry = tf.raw_ops.BroadcastGradientArgs(s0=sx[:-2], s1=sy[:-2])
        gx, gy = tf.reshape(tf.reduce_sum(gx, rx), sx), tf.reshape(tf.reduce_sum(gy, ry), sy)
    return _swap(gx) if tx else gx, _swap(gy) if ty else gy


def _swap(t):
    """``t`` with its last batch dim and its rows swapped ([.., H, M, K] <-> [.., M, H,
    K]), the layout of transpose_x, transpose_y and transpose_out."""
    r = t.shape.rank
    if r is not None:
        return tf.transpose(t, list(range(r - 3)) + [r - 2, r - 3, r - 1])
    r = tf.rank(t)
    return tf.transpose(t, tf.concat([tf.range(r - 3), tf.stack([r - 2, r - 3, r - 1])], 0))
