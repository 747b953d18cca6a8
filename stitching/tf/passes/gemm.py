"""BatchMatMul against a shared 2-D weight, rewritten as one GEMM.

Keras 3 lowers every ``EinsumDense`` of a Transformer (the Q/K/V and output
projections of ``MultiHeadAttention``) to ``BatchMatMulV2(x[B, T, D], W[D, E])``.
TF's CPU kernel runs that as B separate [T, D] x [D, E] products; the same work as one
[B*T, D] x [D, E] ``MatMul`` is one large GEMM:

    BatchMatMulV2(x, W)  ->  Reshape(MatMul(Reshape(x, [-1, D]), W), shape(x)[:-1] + [E])

Measured on the 2-core CI machine, x [8, 128, 256] x W [256, 256]: 2.10 -> 1.08 ms
(results equal within float32 rounding: the dot products are the same, summed by a
different kernel).  XLA gets the same effect from its dot canonicalization.

Applied to ``BatchMatMul``/``BatchMatMulV2`` nodes outside fused regions with
``adj_x`` false, a right operand of static rank-2 shape, a left operand
of known rank >= 3 and a float dtype; ``adj_y`` becomes ``transpose_b``.  The node
keeps its name (as the output Reshape), so consumers and fetches are untouched.

Two things XLA gets from its dot emitter, done here for TF's kernels (measured on a
Keras Transformer at batch 1, where each TF op's dispatch shows):
- the output Reshape's shape is a constant when at most one leading dim is unknown
  (the batch): no Shape -> StridedSlice -> ConcatV2 per GEMM at run time;
- the projection's bias (EinsumDense: Reshape to [B, T, N, H], then Add bias[N, H],
  an op the planner leaves to TF when the Einsum after it is opaque) is added to the
  2-D product as a BiasAdd, which TF's runtime remapper fuses into the GEMM
  (_MklNativeFusedMatMul, the bias in oneDNN's epilogue, as stock TF does for a
  Dense layer); the Add becomes an Identity.

A product against a transposed 2-D weight (``MatMul(a, b, transpose_b=True)``: every
Dense layer's input gradient, dY W^T, and the projections this pass writes from
``adj_y``) runs as ``BatchMatMulV2(a, b, adj_y=True)`` where TF's oneDNN ``MatMul``
takes a slow path for a transposed B: measured on the amd-avx512 class (a Zen 5
EPYC, TF 2.21, oneDNN on; ``TRANSPOSED_B_CLASSES``), TF's ``MatMul`` runs
[M, K] x [N, K]^T 1.2-3.4x slower than ``BatchMatMulV2`` on the same operands, and than
its own ``MatMul`` on a weight transposed beforehand, wherever K >= 512 and the weight
holds at least 1 MiB (M 32-512, N 256-1024, float32); below that ``BatchMatMulV2``'s
larger fixed cost loses (0.66-0.85x at K = 256).  Both run oneDNN, the rank-2
``BatchMatMulV2`` through its matmul primitive.  Only float32 products (the
measurement's), without a BiasAdd after them (TF's remapper fuses that into a
``MatMul``, not into a ``BatchMatMulV2``), and only on the classes measured: elsewhere
the MatMul stays.  Opt-in (``Options(transposed_gemm=True)``; without it the report
says where it would apply): TF's ``BatchMatMulV2`` holds one more output-sized buffer
while it runs (256 KiB for [128, 512], measured with TF's BFC allocator's peak), and
the train suite's MLP step, 1.33x stock TF with it against 1.17-1.20x, peaked at 9.75
MiB against stock TF's 9.3-9.5 MiB and 9.3-9.4 MiB without it.
"""
from __future__ import annotations

import functools

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, types_pb2

from ..passmanager import Pass

# MatMul(transpose_b) -> BatchMatMulV2(adj_y) (the module's docstring): the CPU classes
# where it was measured to pay, and the sizes from which it did (K, the weight's bytes)
TRANSPOSED_B_CLASSES = frozenset({"amd-avx512"})
TRANSPOSED_B_MIN_K = 512
TRANSPOSED_B_MIN_BYTES = 1 << 20


BATCH_MATMULS = ("BatchMatMul", "BatchMatMulV2")
_FLOATS = {types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE, types_pb2.DT_HALF, types_pb2.DT_BFLOAT16}


def candidates(graph_def, ir_graph, excluded=frozenset()) -> dict:
    """node name -> (K, N) of each BatchMatMul this pass rewrites.  ``excluded``
    (Options(exclude)): node names left as they are: such a BatchMatMul, and such a
    bias Add (the product is rewritten, the Add stays TF's Add)."""
    out = {}
    for nd in graph_def.node:
        if nd.op not in BATCH_MATMULS or nd.name not in ir_graph or nd.name in excluded:
            continue
        if _flag(nd, "adj_x") or "T" not in nd.attr or nd.attr["T"].type not in _FLOATS:
            continue
        node = ir_graph[nd.name]
        if len(node.inputs) != 2:
            continue
        x, y = (ir_graph.type_of(r) for r in node.inputs)
        if x.shape is None or len(x.shape) < 3 or y.shape is None or len(y.shape) != 2 \
                or min(y.shape) < 0:
            continue
        k, n = (y.shape[1], y.shape[0]) if _flag(nd, "adj_y") else y.shape
        if x.shape[-1] not in (-1, k):
            continue
        out[nd.name] = (k, n, _static_lead(x.shape), None)
    _find_biases(graph_def, ir_graph, out, excluded)
    return out


def _static_lead(shape) -> list | None:
    """The output's leading dims as a constant Reshape target (-1 for the one unknown
    dim), or None when more than one is unknown (then they come from Shape(x))."""
    lead = list(shape[:-1])
    return None if sum(d < 0 for d in lead) > 1 else lead


def _find_biases(graph_def, ir_graph, todo, excluded=frozenset()) -> None:
    """For each candidate whose one consumer is a Reshape whose one consumer is an
    ``Add``/``AddV2`` of a static bias over its trailing dims with n elements in all
    (Keras's EinsumDense: [B, T, N*H] -> [B, T, N, H] + bias[N, H]), record the Add:
    the rewrite adds the bias to the 2-D MatMul result as a BiasAdd instead, which
    TF's remapper fuses into the GEMM (_MklNativeFusedMatMul: the bias added in the
    GEMM's epilogue, no kernel of its own).  The same additions on the same values:
    results are bit-identical."""
    users = _users(graph_def)
    for name, (k, n, lead, _) in list(todo.items()):
        reshape = _only_user(users, name)
        if reshape is None or reshape.op != "Reshape":
            continue
        add = _only_user(users, reshape.name)
        if add is None or add.op not in ("Add", "AddV2") or add.name not in ir_graph \
                or add.name in excluded:
            continue
        node = ir_graph[add.name]
        if len(node.inputs) != 2 or node.inputs[0].node != reshape.name:
            continue
        out, bias = ir_graph.type_of(node.ref()), ir_graph.type_of(node.inputs[1])
        if not bias.static or bias.num_elements() != n or out.shape is None \
                or len(bias.shape) > len(out.shape) \
                or tuple(out.shape[len(out.shape) - len(bias.shape):]) != bias.shape \
                or ir_graph.type_of(node.inputs[0]).shape != out.shape:
            continue
        todo[name] = (k, n, lead, add.name)


def _users(graph_def) -> dict:
    """node name -> the nodes reading it (data or control edge)."""
    users: dict[str, list] = {}
    for nd in graph_def.node:
        for i in nd.input:
            users.setdefault(i.lstrip("^").split(":")[0], []).append(nd)
    return users


def _only_user(users, name):
    """The one node reading ``name`` (data or control edge), else None."""
    got = users.get(name, [])
    return got[0] if len(got) == 1 else None


def rewrite(graph_def, todo: dict, as_batch=frozenset()) -> None:
    """Turn each node in ``todo`` (from ``candidates``) into a GEMM, in place: the node
    itself becomes the output Reshape; its helper nodes are appended.  Those named in
    ``as_batch`` (``adj_y`` products, ``transposed_b_slow``) become a rank-2
    ``BatchMatMulV2`` with ``adj_y`` instead of a ``MatMul`` with ``transpose_b``."""
    i32 = _type(types_pb2.DT_INT32)
    adds = {v[3] for v in todo.values() if v[3] is not None}
    bias_of = {nd.name: [i for i in nd.input if not i.startswith("^")][1]
               for nd in graph_def.node if nd.name in adds}
    for nd in [nd for nd in graph_def.node if nd.name in todo or nd.name in adds]:
        if nd.name in adds:        # its bias now goes into the MatMul: pass through
            _to_identity(nd)
            continue
        k, n, lead, add = todo[nd.name]
        x, y = [i for i in nd.input if not i.startswith("^")]
        control = [i for i in nd.input if i.startswith("^")]
        name, dev, t, adj_y = nd.name, nd.device, _type(nd.attr["T"].type), _flag(nd, "adj_y")

        add_node = functools.partial(append_node, graph_def, f"{name}/gemm", dev)
        const = functools.partial(append_int32, graph_def, f"{name}/gemm", dev)

        x2 = add_node("x2d", "Reshape", [x, const("x2d_shape", [-1, k])], T=t, Tshape=i32)
        if name in as_batch:
            mm = add_node("matmul", "BatchMatMulV2", [x2, y] + control, T=t,
                          **_adj_y_attrs())
        else:
            mm = add_node("matmul", "MatMul", [x2, y] + control, T=t,
                          transpose_a=attr_value_pb2.AttrValue(b=False),
                          transpose_b=attr_value_pb2.AttrValue(b=adj_y))
        if add is not None:
            b1 = add_node("bias1d", "Reshape", [bias_of[add], const("n1d", [n])],
                          T=t, Tshape=i32)
            mm = add_node("bias_add", "BiasAdd", [mm, b1], T=t)
        if lead is not None:       # at most one unknown dim: a constant, no shape ops
            oshape = const("out_shape", lead + [n])
        else:
            shape = add_node("x_shape", "Shape", [x], T=t, out_type=i32)
            lead_t = add_node(
                "lead", "StridedSlice",
                [shape, const("begin", [0]), const("end", [-1]), const("stride", [1])],
                T=i32, Index=i32, **{m: attr_value_pb2.AttrValue(i=0) for m in (
                    "begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask",
                    "shrink_axis_mask")})
            oshape = add_node("out_shape", "ConcatV2",
                              [lead_t, const("n", [n]), const("axis", 0)],
                              N=attr_value_pb2.AttrValue(i=2), T=i32, Tidx=i32)
        become_reshape(nd, mm, oshape, t)


def append_node(graph_def, prefix, device, suffix, op, inputs, **attrs) -> str:
    """Append node ``<prefix>/<suffix>`` (``op`` reading ``inputs``, with ``attrs``) to
    ``graph_def``; returns its name (conv1x1.py writes its products so too)."""
    new = graph_def.node.add(name=f"{prefix}/{suffix}", op=op, device=device)
    new.input.extend(inputs)
    for key, value in attrs.items():
        new.attr[key].CopyFrom(value)
    return new.name


def append_int32(graph_def, prefix, device, suffix, value) -> str:
    """Append an int32 Const of ``value`` (``append_node``); returns its name."""
    return append_node(graph_def, prefix, device, suffix, "Const", [],
                       dtype=_type(types_pb2.DT_INT32),
                       value=attr_value_pb2.AttrValue(
                           tensor=tf.make_tensor_proto(value, tf.int32)))


def become_reshape(nd, value, shape, t) -> None:
    """``nd``, keeping its name and device, becomes Reshape(``value``, ``shape``) of
    type ``t`` (an AttrValue), so its readers read the reshaped value."""
    nd.op = "Reshape"
    del nd.input[:]
    nd.input.extend([value, shape])
    nd.attr.clear()
    nd.attr["T"].CopyFrom(t)
    nd.attr["Tshape"].CopyFrom(_type(types_pb2.DT_INT32))


def _to_identity(nd) -> None:
    """An Add whose bias moved into the MatMul: Identity of its first operand (its
    name, so its consumers are untouched; control inputs kept)."""
    data = [i for i in nd.input if not i.startswith("^")]
    control = [i for i in nd.input if i.startswith("^")]
    t = attr_value_pb2.AttrValue()
    t.CopyFrom(nd.attr["T"])
    nd.op = "Identity"
    del nd.input[:]
    nd.input.extend(data[:1] + control)
    nd.attr.clear()
    nd.attr["T"].CopyFrom(t)


def _flag(nd, name) -> bool:
    """A bool attr, False when absent (GraphDefs may strip default-valued attrs; indexing
    the map would insert an empty AttrValue into the node)."""
    return name in nd.attr and nd.attr[name].b


def _type(t):
    return attr_value_pb2.AttrValue(type=t)


def transposed_b_slow(profile) -> bool:
    """Whether products against a transposed weight run as ``BatchMatMulV2`` on the
    machine ``profile`` describes: a CPU class where that was measured to pay, with
    TF on oneDNN (the module's docstring)."""
    from . import remapper
    return (profile.backend == "cpu" and profile.cpu_class in TRANSPOSED_B_CLASSES
            and remapper.onednn(profile))


def _slow_transposed(k: int, n: int, dtype) -> bool:
    """A float32 product against a transposed [n, k] weight large enough to pay."""
    return (dtype == types_pb2.DT_FLOAT and k >= TRANSPOSED_B_MIN_K
            and k * n * 4 >= TRANSPOSED_B_MIN_BYTES)


def transposed_products(graph_def, ir_graph, excluded=frozenset()) -> list:
    """Names of the ``MatMul(a, b, transpose_b=True)`` nodes to run as
    ``BatchMatMulV2(adj_y)``: float32, ``transpose_a`` false, both operands of rank 2
    with the weight's shape static and large enough (``_slow_transposed``), and no
    ``BiasAdd`` reading the product (TF's remapper fuses that into the MatMul)."""
    users = _users(graph_def)
    out = []
    for nd in graph_def.node:
        if nd.op != "MatMul" or nd.name not in ir_graph or nd.name in excluded \
                or not _flag(nd, "transpose_b") or _flag(nd, "transpose_a") \
                or "T" not in nd.attr:
            continue
        node = ir_graph[nd.name]
        if len(node.inputs) != 2:
            continue
        a, b = (ir_graph.type_of(r) for r in node.inputs)
        if a.shape is None or len(a.shape) != 2 or b.shape is None or len(b.shape) != 2 \
                or min(b.shape) < 0:
            continue
        if not _slow_transposed(b.shape[1], b.shape[0], nd.attr["T"].type):
            continue
        if any(u.op == "BiasAdd" for u in users.get(nd.name, [])):
            continue
        out.append(nd.name)
    return out


def _adj_y_attrs() -> dict:
    """The attributes of ``BatchMatMulV2(a, b, adj_y=True)`` but its ``T``."""
    return {"adj_x": attr_value_pb2.AttrValue(b=False),
            "adj_y": attr_value_pb2.AttrValue(b=True)}


def _as_batch_matmul(nd) -> None:
    """``MatMul(a, b, transpose_b=True)`` in place as ``BatchMatMulV2(a, b, adj_y=True)``
    (same inputs, name and device; rank-2 operands give the same [M, N] product)."""
    t = attr_value_pb2.AttrValue()
    t.CopyFrom(nd.attr["T"])
    nd.op = "BatchMatMulV2"
    nd.attr.clear()
    nd.attr["T"].CopyFrom(t)
    for key, value in _adj_y_attrs().items():
        nd.attr[key].CopyFrom(value)


def _run(ctx):
    from ...plan import profiles
    todo = candidates(ctx.graph_def, ctx.ir, ctx.excluded)
    slow = transposed_b_slow(profiles.default())
    as_batch, plain = frozenset(), set()
    if slow:       # the adj_y candidates without a bias, and the MatMuls (transpose_b)
        as_batch = frozenset(
            nd.name for nd in ctx.graph_def.node
            if nd.name in todo and todo[nd.name][3] is None and _flag(nd, "adj_y")
            and _slow_transposed(*todo[nd.name][:2], nd.attr["T"].type))
        plain = set(transposed_products(ctx.graph_def, ctx.ir, ctx.excluded))
    notes = []
    if (plain or as_batch) and not ctx.options.transposed_gemm:
        notes.append(f"{len(plain) + len(as_batch)} product(s) against a transposed "
                     f"weight would run 1.2-3.4x faster as BatchMatMulV2 (adj_y) on this "
                     f"CPU class, with one more output-sized buffer while each runs: "
                     f"Options(transposed_gemm=True)")
        plain, as_batch = set(), frozenset()
    if not todo and not plain:
        return ("; ".join(notes) + " (tf/passes/gemm.py)") if notes else None
    if todo:
        rewrite(ctx.graph_def, todo, as_batch)          # the rewrite's own copy
        adds = [v[3] for v in todo.values() if v[3] is not None]
        ctx.folded.update((a, "added by its product as the MatMul's BiasAdd "
                              "(tf/passes/gemm.py)") for a in adds)
        notes.append(f"{len(todo)} BatchMatMul node(s) against a 2-D weight run as one "
                     f"MatMul each, {len(adds)} with the bias Add after it as the "
                     f"MatMul's BiasAdd")
    if plain or as_batch:
        for nd in ctx.graph_def.node:
            if nd.name in plain:
                _as_batch_matmul(nd)
        notes.append(f"{len(plain) + len(as_batch)} product(s) against a transposed "
                     f"weight run as BatchMatMulV2 (adj_y): TF's oneDNN MatMul takes a "
                     f"slow path for a transposed B on this CPU class")
    return "; ".join(notes) + " (tf/passes/gemm.py; Options(gemm=False) keeps them)"


PASS = Pass("gemm", _run, option="gemm")
