"""An attention's product -> softmax kernel -> product as one OpenBLAS op.

After the blas pass, an attention is three nodes:

    s = StitchedBatchMatMul(q, k)                       [.., M, N] scores
    p = StitchedKernel[s, mask](softmax(c * s [+ mask]) along the last axis)
    o = StitchedBatchMatMul(p, v)

and the [.., M, N] scores pass through memory four times (written, read and written
by the kernel, read): 4 MiB per layer of the Llama decoder at batch 8.  Where each
intermediate has no other reader and is not fetched, the three become
``StitchedAttention(q, k, v[, mask])`` (runtime/attention.cc), which keeps the scores
of one block of query rows in cache between its two products and its softmax.  The
node keeps ``o``'s name, so its readers and fetches are untouched.

Why match the generated kernel rather than TF's ops before planning: the products
exist only after the gemm, einsum and blas passes (after planning), and the planner
may fuse the scale, mask and softmax with other ops; the kernel's IR (its ``spec``)
says exactly what it computes, so the match is structural: its one output must be
``Mul(e, Reciprocal(Sum(e)))`` with ``e = Exp(Sub(t, Max(t)))`` along the last axis,
``t`` the scores, optionally times a scalar constant and plus a mask input of the
scores' shape or one broadcast to it, then optionally ``Select(cond, t, fill)`` (or
``Select(cond, fill, t)``) with ``cond`` a bool input broadcast to the scores and
``fill`` a scalar constant -- the stitched softmax's (and TF's) order of operations,
which the op follows.

Keras 3's causal MultiHeadAttention (the GPT-2-style decoder) writes
``where(ones_like(scores) & band, scores * c, large_negative)``: the Mul by
1/sqrt(key_dim) stays out of the softmax kernel because Shape nodes read the scaled
scores (for ``ones_like`` and the band's size).  The match takes such a Mul by a
scalar constant too: c goes into the op's scale (exact where the kernel's own scale
is 1, as here) and the Shape nodes read the same vector from q's and k's shapes
(``_shape_from_operands``).  ``LogicalAnd(Fill(Shape(scores), True), band)`` is only
the band broadcast to the scores, which the op does itself: it takes the [1, 1, T, T]
band, and the [B, H, T, T] Fill and LogicalAnd go with the pruned nodes.  The op
skips the keys a block of query rows all mask away, where that is exact
(runtime/attention.cc).

Training graphs are left alone by that rule: the backward reads the softmax's output
(the kernel then has another reader or output).  The registered gradient, for a tape
outside the stitched function, runs the forward again in TF's ops and differentiates
that.

It fuses what the blas pass made StitchedBatchMatMul (``blas.mode``): every product
where TF's GEMM is Eigen's.  Where it is oneDNN's, the blas pass takes none, and this
pass makes the products of the masked attentions ours itself, only those (a trial of
the rewrite on a copy chooses them: ``masked_products``), since only there can the
fused op beat oneDNN's products, by skipping the key blocks the mask removes.
``Options(fused_attention=False)`` (``--no-fused-attention``) keeps the three ops.  BENCHMARKS.md ``gemm@amd_avx2`` has
what it gained there (1.06x the Llama decoder at batch 8, within noise of 1.0x at
batch 1 and on the Transformer), ``attention@amd_avx512`` where TF runs oneDNN.

Whether it does beat them is the machine's: 1.10-1.37x the unfused graph on a Zen 4
EPYC, 0.76-0.95x on a Zen 5 whose environment holds OpenBLAS to its AVX2 kernels
(``attention@amd_avx512_zen5``), a rule from two machines being a guess.  So where TF
runs oneDNN each op the pass makes is timed on its first calls (``autotuned``): it
carries a function of the same attention unfused -- oneDNN's products around the
softmax kernel (``unfused_function``) -- and runs itself and that function in turn on
its first calls per shape class, then the faster, with op.cc's Tuner and its disk
cache (runtime/attention.cc; the decisions are in
``stitching.runtime.autotune_decisions()``).  Not where the products are OpenBLAS's:
there both ways run the same OpenBLAS kernels (``autotuned`` says why).
"""
from __future__ import annotations

import collections
import hashlib
import json
from typing import NamedTuple

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, function_pb2
from tensorflow.python.framework import op_def_registry

from ... import options as _options
from .. import dim_sources
from ..passmanager import Pass
from ..tfgraph import drop_nodes
from . import blas, original


def _node_of(name, nodes):
    """The node an input names, if it names its first output (no control input)."""
    if name.startswith("^"):
        return None
    base, _, port = name.partition(":")
    return nodes.get(base) if port in ("", "0") else None


class Softmax(NamedTuple):
    """What a kernel's softmax computes, as softmax_of matched it: softmax(t) along the
    last axis, t = scale * inputs[scores] [+ inputs[mask]], then where ``cond`` is
    given, t where inputs[cond] == keeps else ``fill`` (Keras's
    ``where(mask, scores, large_negative)``)."""
    scores: int
    scale: float = 1.0
    mask: int | None = None
    cond: int | None = None
    fill: float = 0.0
    keeps: bool = True


def softmax_of(spec):
    """The ``Softmax`` the kernel's IR ``spec`` computes as its one output, else None
    (inputs as indices of the kernel's inputs)."""
    nodes, outputs = spec.get("nodes", []), spec.get("outputs", [])
    if len(outputs) != 1:
        return None

    def node(ref, op, nargs):
        """Node ``ref`` (an index; negative: an input) if it is ``op`` with ``nargs``
        arguments."""
        if not isinstance(ref, int) or not 0 <= ref < len(nodes):
            return None
        nd = nodes[ref]
        return nd if nd.get("op") == op and len(nd.get("args", ())) == nargs else None

    def last_axis_reduce(ref, op, of):
        nd = node(ref, op, 1)
        rank = len(nodes[of]["shape"]) if of >= 0 else len(spec["inputs"][-of - 1]["shape"])
        return nd is not None and nd["args"][0] == of and \
            nd["attrs"].get("axes") == [rank - 1] and nd["attrs"].get("keep_dims")

    out = node(outputs[0], "Mul", 2)
    if out is None:
        return None
    for e_ref, r_ref in (out["args"], out["args"][::-1]):
        exp, rcp = node(e_ref, "Exp", 1), node(r_ref, "Reciprocal", 1)
        if exp is None or rcp is None or not last_axis_reduce(rcp["args"][0], "Sum", e_ref):
            continue
        sub = node(exp["args"][0], "Sub", 2)
        if sub is None or not last_axis_reduce(sub["args"][1], "Max", sub["args"][0]):
            continue
        return _logits(nodes, spec["inputs"], sub["args"][0])
    return None


def _scalar(nodes, ref):
    """The value of node ``ref`` if it is a scalar constant, else None."""
    const = nodes[ref] if ref >= 0 else None
    if const is None or const["op"] != "Const" or const["shape"] != []:
        return None
    return float(const["attrs"]["value"])


def _logits(nodes, inputs, ref):
    """The ``Softmax`` whose logits are ``ref`` = select(cond, scores [* c] [+ mask],
    fill) (the select optional, either order), else None."""
    def shape(r):
        return nodes[r]["shape"] if r >= 0 else inputs[-r - 1]["shape"]

    found = {}
    if ref >= 0 and nodes[ref]["op"] == "Select":
        c, a, b = nodes[ref]["args"]
        if c >= 0 or inputs[-c - 1]["dtype"] != "bool":
            return None
        # the condition: an input that does not widen the scores (broadcast to them);
        # the fill: a scalar constant on either side
        for x, f, keeps in ((a, b, True), (b, a, False)):
            fill = _scalar(nodes, f)
            if fill is not None and shape(x) == nodes[ref]["shape"]:
                ref = x
                found.update(cond=-c - 1, fill=fill, keeps=keeps)
                break
        else:
            return None
    if ref >= 0 and nodes[ref]["op"] == "Add":
        a, b = nodes[ref]["args"]
        # the mask: an input that does not widen the scores (the Add's shape is theirs)
        for x, m in ((a, b), (b, a)):
            if m < 0 and shape(x) == nodes[ref]["shape"]:
                ref, found["mask"] = x, -m - 1
                break
        else:
            return None
    if ref >= 0 and nodes[ref]["op"] == "Mul":
        a, b = nodes[ref]["args"]
        for x, c in ((a, b), (b, a)):
            scale = _scalar(nodes, c)
            if scale is not None and shape(x) == nodes[ref]["shape"]:
                ref, found["scale"] = x, scale
                break
        else:
            return None
    if ref >= 0:
        return None
    return Softmax(-ref - 1, **found)


def _flag(node, key) -> bool:
    return key in node.attr and node.attr[key].b


# where the report says an attention's scale, mask and softmax went
IN_ATTENTION = "an attention's scale, mask and softmax, in its StitchedAttention op"


def fuse(graph_def, fetched, shapes=None, folded=None, origins=None,
         excluded=frozenset(), tune=False) -> int:
    """Turn each matched product -> softmax kernel -> product into StitchedAttention,
    in place (the module's docstring); returns how many.  ``shapes()``: the graph
    imported with TF's shapes, asked for only where a Reshape stands between the
    pattern's nodes (einsum.py's, after an Einsum's product): one that changes no
    shape is passed over, any other stops the match.  ``folded``: a dict (the
    pipeline's ``ctx.folded``) that gets the scores' scale Muls taken into the ops'
    scale, and the names of the softmax kernels taken in, with where they went.  ``origins``: a list that gets, for each attention
    fused, the ``_ORIGIN`` marks of its two products and whether it is masked
    (``([names], masked)``: ``masked_products``' trial on a copy).  ``excluded``
    (Options(exclude)): node names left as they are: none is taken into an op (the
    caller passes them in ``fetched`` too), nor rewritten (the scaled scores' Shape
    readers, their slices), nor left unread (a mask's broadcast).  ``tune``: each op
    gets the function of its unfused products around the softmax kernel
    (``unfused_function``) and is marked to time itself against it."""
    nodes = {nd.name: nd for nd in graph_def.node}
    # each node's readers, once per edge (data or control)
    consumers = collections.defaultdict(list)
    for nd in graph_def.node:
        for i in nd.input:
            consumers[i.lstrip("^").split(":")[0]].append(nd)
    imported = []

    def imported_graph():
        if not imported:
            imported.append(shapes())
        return imported[0]

    def identity(nd) -> bool:
        """Whether Reshape ``nd`` keeps its input's shape: equal ranks, equal known
        dims and at most one unknown, at the same place in both."""
        if shapes is None:
            return False
        try:
            op = imported_graph().get_operation_by_name(nd.name)
        except KeyError:
            return False
        a, b = op.inputs[0].shape, op.outputs[0].shape
        if a.rank is None or a.rank != b.rank:
            return False
        dims = list(zip(a.as_list(), b.as_list()))
        unknown = [i for i, (x, y) in enumerate(dims) if x is None or y is None]
        return len(unknown) <= 1 and all(x == y for x, y in dims if x is not None and
                                         y is not None) and \
            all(dims[i] == (None, None) for i in unknown)

    def intermediate(name, op):
        """The node ``name`` names if it is an ``op`` that can go (its only reader is
        the next node of the pattern and it is not fetched), through a Reshape that
        can go and changes no shape; (node, [the Reshape]) or (None, [])."""
        nd = _node_of(name, nodes)
        if nd is None or len(consumers[nd.name]) != 1 or nd.name in fetched:
            return None, []
        if nd.op == op:
            return nd, []
        if nd.op == "Reshape" and not any(i.startswith("^") for i in nd.input):
            inner, _ = intermediate(nd.input[0], op)
            if inner is not None and identity(nd):
                return inner, [nd]
        return None, []

    def scaled_scores(name, kernel, dtype):
        """(the Mul, its other operand, c) where ``name`` is a Mul by a scalar constant c
        that only ``kernel`` reads but for Shape nodes (Keras's masked attention reads
        the scaled scores' shape for its mask), else (None, name, 1.0)."""
        nd = _node_of(name, nodes)
        if nd is None or nd.op != "Mul" or nd.name in fetched or shapes is None or \
                any(i.startswith("^") for i in nd.input):
            return None, name, 1.0
        others = [r for r in consumers[nd.name] if r is not kernel]
        if len(others) + 1 != len(consumers[nd.name]) or \
                any(r.op != "Shape" or r.input[0] != nd.name or r.name in excluded
                    for r in others):
            return None, name, 1.0
        for x, c in (nd.input, nd.input[::-1]):
            const = _node_of(c, nodes)
            if const is not None and const.op == "Const" and const.attr["dtype"].type == dtype:
                value = tf.make_ndarray(const.attr["value"].tensor)
                if value.shape == ():
                    return nd, x, float(value)
        return None, name, 1.0

    def bare_condition(name, same_shape):
        """``name``, or ``m`` where it is LogicalAnd(Fill(Shape(s), True), m) (either
        order) with ``s`` one of ``same_shape`` (the scores): Keras's causal mask
        broadcast to the scores, which the op broadcasts itself."""
        nd = _node_of(name, nodes)
        if nd is None or nd.op != "LogicalAnd" or any(i.startswith("^") for i in nd.input) \
                or nd.name in excluded:
            return name
        for f, m in (nd.input, nd.input[::-1]):
            fill = _node_of(f, nodes)
            if fill is None or fill.op != "Fill":
                continue
            dims, value = (_node_of(i, nodes) for i in fill.input[:2])
            if fill.name in excluded or dims is not None and dims.name in excluded:
                continue         # kept, it would read the scores the op takes in
            if dims is not None and dims.op == "Shape" and dims.input[0] in same_shape and \
                    value is not None and value.op == "Const" and \
                    tf.make_ndarray(value.attr["value"].tensor).tolist() is True:
                return m
        return name

    taken, count = set(), 0
    for out in list(graph_def.node):
        if out.op != "StitchedBatchMatMul" or _flag(out, "adj_x") or \
                _flag(out, "transpose_x"):
            continue
        kernel, between = intermediate(out.input[0], "StitchedKernel")
        if kernel is None or kernel.name in taken:
            continue
        try:        # a kernel node of a graph file read in: its spec is untrusted text
            match = softmax_of(json.loads(kernel.attr["spec"].s))
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            match = None
        if match is None:
            continue
        data = [i for i in kernel.input if not i.startswith("^")]
        dtype = out.attr["T"].type
        mul, source, c = scaled_scores(data[match.scores], kernel, dtype)
        scores, before = intermediate(source, "StitchedBatchMatMul")
        # TF rounds the scaled scores, then the kernel scales them again: exact where
        # one of the two is 1 (Keras's: the kernel's is), else within a rounding
        scale = match.scale * c
        if dtype != tf.float64.as_datatype_enum:
            scale = float(np.float32(scale))
        if scores is None or scores.name in taken or _flag(scores, "transpose_out") or \
                scores.attr["T"].type != dtype or \
                any(float(np.float32(f)) != f for f in (scale, match.fill)):
            continue             # (the op's scale and fill are float attributes)
        controls = [i for nd in (scores, kernel, out) for i in nd.input if i.startswith("^")]
        inputs = [i for i in scores.input if not i.startswith("^")] + [out.input[1]]
        if match.mask is not None:
            inputs.append(data[match.mask])
        if match.cond is not None:
            inputs.append(bare_condition(data[match.cond], {data[match.scores], source}))
        unfused = None
        if tune:
            layout = _attrs_of(scores, out, match)
            swapped = any(layout[f"transpose_{key}"] for key in ("q", "k", "v", "out"))
            unfused = unfused_function(
                kernel, data, match, dtype, layout, c if mul is not None else None,
                match.cond is not None and inputs[-1] != data[match.cond],
                {key: _rank(imported_graph, inputs[i]) if swapped and shapes else None
                 for i, key in enumerate(("q", "k", "v"))})
        if mul is not None:      # its Shape readers read the scores' shape from q and k
            for reader in consumers[mul.name]:
                if reader is not kernel:
                    _shape_from_operands(graph_def, reader, scores, imported_graph(),
                                         consumers[reader.name], nodes, excluded)
            taken.add(mul.name)
            if folded is not None:
                folded[mul.name] = IN_ATTENTION
        attrs = _attrs_of(scores, out, match)
        for key in ("adj_x", "adj_y", "transpose_x", "transpose_y", "transpose_out"):
            if key in out.attr:
                del out.attr[key]
        if folded is not None:   # the softmax kernel's ops: the pipeline's report
            folded[kernel.name] = IN_ATTENTION
        out.op = "StitchedAttention"
        for key, value in attrs.items():
            out.attr[key].b = value
        out.attr["scale"].f = scale
        out.attr["fill"].f = match.fill
        out.attr["n_mask"].i = int(match.mask is not None)
        out.attr["n_cond"].i = int(match.cond is not None)
        if unfused is not None:
            fdef, tune_hash = unfused
            if not any(f.signature.name == fdef.signature.name
                       for f in graph_def.library.function):
                graph_def.library.function.add().CopyFrom(fdef)
            out.attr[UNFUSED_ATTR].s = fdef.signature.name.encode()
            out.attr[TUNE_ATTR].s = tune_hash.encode()
        del out.input[:]
        out.input.extend(inputs + sorted(set(controls)))
        taken.update(nd.name for nd in [scores, kernel] + before + between)
        if origins is not None:
            origins.append(([nd.attr[_ORIGIN].s.decode() for nd in (scores, out)
                             if _ORIGIN in nd.attr],
                            match.mask is not None or match.cond is not None))
        count += 1
    drop_nodes(graph_def, taken)
    return count


def _attrs_of(scores, out, match) -> dict:
    """The op's layout attrs, from its two products (and the match's cond_keeps)."""
    return {"adj_q": _flag(scores, "adj_x"), "adj_k": _flag(scores, "adj_y"),
            "transpose_q": _flag(scores, "transpose_x"),
            "transpose_k": _flag(scores, "transpose_y"),
            "adj_v": _flag(out, "adj_y"), "transpose_v": _flag(out, "transpose_y"),
            "transpose_out": _flag(out, "transpose_out"), "cond_keeps": match.keeps}


def _rank(graph, name):
    """The rank TF infers for tensor ``name`` of ``graph()``, or None."""
    try:
        t = graph().get_tensor_by_name(name if ":" in name else name + ":0")
    except (KeyError, ValueError):
        return None
    return t.shape.rank


# ---- autotune: the op against its unfused products ------------------------------------
#
# Whether the op beats TF's products around the softmax kernel depends on the machine
# (the module's docstring), so where ``_run`` says so each op carries a function that
# computes the same with TF's ops -- BatchMatMulV2 (oneDNN's, where TF runs it), the
# planner's softmax kernel, BatchMatMulV2 -- named by the string attr UNFUSED_ATTR, and
# TUNE_ATTR, a hash of what it computes.  The op (runtime/attention.cc) times both on
# its first calls per shape class and keeps the faster (op.cc's Tuner and its disk
# cache, runtime/autotune.py: a second process reads the decision).  The function is
# named like the regions' originals (original.PREFIX) so that it travels as they do:
# defined in the process by tf/function.py _define_fallbacks (TF prunes a graph's
# library to what its nodes reach, and a string attr reaches nothing), kept in a
# SavedModel's library and found there under the loader's name (op.cc LoadedName).
# Where it is missing anyway, the op runs fused.
UNFUSED_ATTR = "_stitching_unfused"
TUNE_ATTR = "_stitching_autotune"       # as a StitchedKernel's (passes/autotune.py)
# Attrs of the softmax kernel that name its place in the graph, not what it computes:
# left out of the hash, so every layer's attention of one shape shares one decision.
_PLACE_ATTRS = (original.ATTR, original.BACKWARD_ATTR, original.OPTIONS_ATTR)
# STITCHING_ATTENTION_AUTOTUNE=0: no timing, every op the pass makes runs fused (the
# rule before timing; tools/attention_probe.py's 'forced' column).
AUTOTUNE_ENV = _options.ATTENTION_AUTOTUNE_ENV


def autotuned(which) -> bool:
    """Whether the ops the pass makes are timed against their unfused products: where
    TF's GEMM is oneDNN's (``which`` is ``blas.ATTENTION``), unless AUTOTUNE_ENV is 0.
    Not where the products are OpenBLAS's (``blas.ALL``): there the unfused way runs
    the same OpenBLAS kernels as the op, which only saves the scores' trips through
    memory and the masked key blocks (1.06x the Llama decoder at batch 8 on the AMD
    EPYC with AVX2, within noise of 1.0x elsewhere: BENCHMARKS.md ``gemm@amd_avx2``),
    so a loss there would be noise, and timing would cost every attention's first
    calls for nothing."""
    return which == blas.ATTENTION and _options.attention_autotune_on()


# oneDNN's batch product as TF's graph rewrite (MklLayoutRewritePass) names it, which the
# op's FunctionLibraryRuntime does not run over the function (a function it
# instantiates gets each op's default kernel): with BatchMatMulV2 the function ran
# Eigen's product, 1.6x the unfused graph's time at [8, 4, 128, 64] on the Zen 5 EPYC,
# which is not the alternative the op competes with.  The node attr _kernel selects
# oneDNN's kernel registered under this name (TF's label for a renamed op).
_MKL_PRODUCT = "_MklBatchMatMulV2"


def _product_op() -> str:
    """The batch product op of the unfused function: oneDNN's where this TF runs it."""
    from . import remapper
    return _MKL_PRODUCT if op_def_registry.get(_MKL_PRODUCT) is not None and \
        remapper.onednn_enabled() else "BatchMatMulV2"


def unfused_function(kernel, data, match, dtype, attrs, c, broadcast_cond, ranks):
    """(FunctionDef, tune hash) of the attention the op computes, the unfused way:
    arguments the op's inputs (q, k, v[, mask][, cond]), body TF's BatchMatMulV2 around
    a copy of ``kernel`` (the softmax: ``match`` of its inputs ``data``), with the
    op's head layouts (``attrs``) as Transposes, the scores' Mul by ``c`` where one
    was taken into the op's scale, and the op's bare condition broadcast to the scores
    where ``broadcast_cond`` (bare_condition took its broadcast).  None where a layout
    needs a rank TF does not know (``ranks``: q's, k's and v's, or None) or the kernel
    reads anything else."""
    args = ["q", "k", "v"] + ["mask"] * (match.mask is not None) + \
        ["cond"] * (match.cond is not None)
    fdef = function_pb2.FunctionDef()
    for a in args:
        fdef.signature.input_arg.add(
            name=a, type=tf.bool.as_datatype_enum if a == "cond" else dtype)
    fdef.signature.output_arg.add(name="output", type=dtype)
    t_attr = attr_value_pb2.AttrValue(type=dtype)

    def add(name, op, inputs, **attrs):
        nd = fdef.node_def.add(name=name, op=op)
        nd.input.extend(inputs)
        if op == _MKL_PRODUCT:
            nd.attr["_kernel"].s = b"MklNameChangeOp"
        for key, value in attrs.items():
            nd.attr[key].CopyFrom(value)
        for a in op_def_registry.get(op).attr:        # an op's defaults, as TF's own
            if a.name not in nd.attr and a.HasField("default_value"):
                nd.attr[a.name].CopyFrom(a.default_value)
        return nd

    def const(name, value, dt):
        tensor = tf.make_tensor_proto(value, dt)
        add(name, "Const", [], value=attr_value_pb2.AttrValue(tensor=tensor),
            dtype=attr_value_pb2.AttrValue(type=tensor.dtype))
        return f"{name}:output:0"

    def unswapped(name, value, r):
        """``value`` with its heads and rows swapped back (blas._swap)."""
        if r is None:
            return None
        perm = const(f"{name}/perm", list(range(r - 3)) + [r - 2, r - 3, r - 1], tf.int32)
        add(name, "Transpose", [value, perm], T=t_attr,
            Tperm=attr_value_pb2.AttrValue(type=tf.int32.as_datatype_enum))
        return f"{name}:y:0"

    plain = {}                      # q, k, v in the layouts BatchMatMulV2 reads
    for key in ("q", "k", "v"):
        plain[key] = unswapped(f"{key}/unswapped", key, ranks[key]) \
            if attrs[f"transpose_{key}"] else key
        if plain[key] is None:
            return None
    bool_attr = attr_value_pb2.AttrValue
    product = _product_op()
    add("scores", product, [plain["q"], plain["k"]], T=t_attr,
        adj_x=bool_attr(b=attrs["adj_q"]), adj_y=bool_attr(b=attrs["adj_k"]))
    scores = "scores:output:0"
    if c is not None:
        add("scaled", "Mul", [scores, const("scale", c, dtype)], T=t_attr)
        scores = "scaled:z:0"
    feeds = {match.scores: scores}
    if match.mask is not None:
        feeds[match.mask] = "mask"
    if match.cond is not None:
        feeds[match.cond] = "cond"
        if broadcast_cond:      # the op broadcasts it; the kernel reads it broadcast
            add("scores_shape", "Shape", [scores], T=t_attr,
                out_type=attr_value_pb2.AttrValue(type=tf.int32.as_datatype_enum))
            add("cond_broadcast", "BroadcastTo", ["cond", "scores_shape:output:0"],
                T=attr_value_pb2.AttrValue(type=tf.bool.as_datatype_enum),
                Tidx=attr_value_pb2.AttrValue(type=tf.int32.as_datatype_enum))
            feeds[match.cond] = "cond_broadcast:output:0"
    if sorted(feeds) != list(range(len(data))):
        return None                 # the kernel reads something the op does not have
    softmax = fdef.node_def.add()
    softmax.CopyFrom(kernel)
    softmax.name = "softmax"
    del softmax.input[:]
    softmax.input.extend(feeds[i] for i in range(len(data)))
    for key in ("_output_shapes", "_class", "label"):   # (label: each layer's own)
        softmax.attr.pop(key, None)
    add("output", product, [original._output_names(softmax)[0], plain["v"]],
        T=t_attr, adj_y=bool_attr(b=attrs["adj_v"]))
    result = "output:output:0"
    if attrs["transpose_out"]:
        if None in ranks.values():
            return None
        result = unswapped("output/swapped", result, max(ranks.values()))
    fdef.ret["output"] = result
    placeless = function_pb2.FunctionDef()
    placeless.CopyFrom(fdef)
    for key in _PLACE_ATTRS:
        placeless.node_def[[n.name for n in fdef.node_def].index("softmax")].attr.pop(key, None)
    tune_hash = hashlib.sha256(b"StitchedAttention\0" + placeless.SerializeToString(
        deterministic=True)).hexdigest()[:24]
    fdef.signature.name = original.PREFIX + hashlib.sha256(
        fdef.SerializeToString(deterministic=True)).hexdigest()[:24]
    return fdef, tune_hash


def _shape_from_operands(graph_def, shape, product, graph, readers, nodes,
                         excluded=frozenset()) -> None:
    """Turn Shape node ``shape`` (of the scores ``product`` computes, which goes) into
    the same vector from the product's operands: BatchMatMulV2's batch broadcast of
    q's and k's batch dims (BroadcastArgs), then M and N, in their layouts
    (StitchedBatchMatMul's adj_ and transpose_ flags); dims TF knows are constants.
    The node keeps its name and output type.  ``readers``: the nodes that read it;
    ``nodes``: the graph's nodes by name; ``excluded``: readers left as they are."""
    out_type = shape.attr["out_type"].type if "out_type" in shape.attr else \
        tf.int32.as_datatype_enum
    np_type = tf.dtypes.as_dtype(out_type).as_numpy_dtype
    known = graph.get_operation_by_name(product.name).outputs[0].shape.as_list()
    base = shape.name + "/from_operands"

    def add(suffix, op, inputs=(), **attrs):
        nd = graph_def.node.add(name=f"{base}/{suffix}", op=op)
        nd.input.extend(inputs)
        nd.device = shape.device
        for key, value in attrs.items():
            nd.attr[key].CopyFrom(value)
        return nd.name

    def const(suffix, value):
        tensor = tf.make_tensor_proto(value)
        return add(suffix, "Const", value=attr_value_pb2.AttrValue(tensor=tensor),
                   dtype=attr_value_pb2.AttrValue(type=tensor.dtype))

    def t(enum):
        return attr_value_pb2.AttrValue(type=enum)

    i32 = tf.int32.as_datatype_enum
    controls = [i for i in shape.input if i.startswith("^")]
    del shape.input[:]
    shape.input.extend(controls)
    shape.attr.clear()
    if None not in known:
        _to_const(shape, np.asarray(known, np_type))
        return
    parts = []
    for tag, operand, adj, swapped in (
            ("q", product.input[0], _flag(product, "adj_x"), _flag(product, "transpose_x")),
            ("k", product.input[1], _flag(product, "adj_y"), _flag(product, "transpose_y"))):
        rank = graph.get_tensor_by_name(operand if ":" in operand else operand + ":0").shape.rank
        perm = list(range(rank))
        if swapped:          # [.., M, H, D] stored: the matrix dims of [.., H, M, D]
            perm[-3], perm[-2] = perm[-2], perm[-3]
        # M: q's second-to-last dim (its last under adj_x); N: k's last (second-to-last
        # under adj_y)
        pick = perm[-1] if adj == (tag == "q") else perm[-2]
        dims = add(f"{tag}/shape", "Shape", [operand], T=product.attr["T"], out_type=t(out_type))
        axis = const(f"{tag}/axis", np.int32(0))
        parts.append((add(f"{tag}/batch", "GatherV2", [dims, const(f"{tag}/batch_index",
                      np.asarray(perm[:-2], np.int32)), axis], Tparams=t(out_type),
                      Tindices=t(i32), Taxis=t(i32), batch_dims=attr_value_pb2.AttrValue(i=0)),
                      add(f"{tag}/dim", "GatherV2", [dims, const(f"{tag}/dim_index",
                          np.asarray([pick], np.int32)), axis], Tparams=t(out_type),
                          Tindices=t(i32), Taxis=t(i32), batch_dims=attr_value_pb2.AttrValue(i=0))
                      if known[len(parts) - 2] is None else
                      const(f"{tag}/dim", np.asarray([known[len(parts) - 2]], np_type))))
    (bq, m), (bk, n) = parts
    batch = add("batch", "BroadcastArgs", [bq, bk], T=t(out_type))
    shape.op = "ConcatV2"
    shape.input[:0] = [batch, m, n, const("axis", np.int32(0))]
    shape.attr["N"].i = 3
    shape.attr["T"].type = out_type
    shape.attr["Tidx"].type = i32
    _fold_static_entries(shape.name, [r for r in readers if r.name not in excluded],
                         nodes, known, np_type)


def _fold_static_entries(shape, readers, nodes, known, np_type) -> None:
    """Each StridedSlice (of ``readers``) of Shape node ``shape`` that takes only dims
    TF knows (Keras's causal mask reads the sequence lengths, [-2] and [-1] of the
    scores' shape) becomes their Const, so the mask after it (Fill, MatrixBandPart) is
    constant and TF's Grappler folds it when it instantiates the function, instead of
    four to nine small ops per layer and call."""
    vals = list(known)             # None: a dim known only at run time
    for nd in readers:
        data = [i for i in nd.input if not i.startswith("^")]
        if nd.op != "StridedSlice" or not data or data[0] not in (shape, shape + ":0"):
            continue
        bounds = [nodes.get(i.split(":")[0]) for i in data[1:4]]
        if any(b is None or b.op != "Const" for b in bounds):
            continue
        try:
            value = dim_sources.strided_slice(nd, vals, *(
                tf.make_ndarray(b.attr["value"].tensor).reshape(-1).tolist() for b in bounds))
        except dim_sources.NotEvaluable:
            continue
        if value is None or isinstance(value, list) and None in value:
            continue
        _to_const(nd, np.asarray(value, np_type))


def _to_const(nd, value) -> None:
    """Node ``nd`` made a Const of ``value`` in place: its name and control inputs stay."""
    tensor = tf.make_tensor_proto(value)
    controls = [i for i in nd.input if i.startswith("^")]
    nd.op = "Const"
    del nd.input[:]
    nd.input.extend(controls)
    nd.attr.clear()
    nd.attr["value"].tensor.CopyFrom(tensor)
    nd.attr["dtype"].type = tensor.dtype


_ORIGIN = "_stitching_product"      # a trial's mark: the batch product a node was


def masked_products(graph_def, ctx, scratch: bool = False) -> tuple[set, int, int]:
    """(names of the batch products of ``graph_def`` that are the products of a
    masked attention ``fuse`` would fuse once the blas pass made them ours, how many
    batch products it has, how many unmasked attentions it would fuse): the rewrite
    (products, head transposes, attentions) tried on a copy, each product marked
    with its name (``_ORIGIN``).  ``ctx``: the pipeline's (fetches, shapes).
    ``scratch``: ``graph_def`` is a copy the caller gives up (einsum.py's trial), so
    the rewrite is tried on it in place."""
    if scratch:
        trial = graph_def
    else:
        trial = type(graph_def)()
        trial.CopyFrom(graph_def)
    products = blas.batch_products(trial, ctx.fetched, ctx.excluded)
    if not products:
        return set(), 0, 0
    for p in products:
        p.attr[_ORIGIN].s = p.name.encode()
    blas.rewrite(trial, [(p, None) for p in products])
    blas.fold_head_transposes(trial, ctx.pinned)
    fused: list = []
    fuse(trial, ctx.pinned, lambda: ctx.shapes_of(trial), origins=fused,
         excluded=ctx.excluded.keys())
    chosen = {name for names, masked in fused if masked for name in names}
    return chosen, len(products), sum(1 for _, masked in fused if not masked)


def _take_masked_products(ctx) -> str | None:
    """Where TF's GEMM is oneDNN's (``blas.mode`` ATTENTION, so the blas pass took no
    product): the batch products of the masked attentions this pass will fuse, and
    only those, become StitchedBatchMatMul (their head transposes folded), so that
    ``fuse`` finds them; every other product stays oneDNN's.  Returns the note.

    Why masked only (the AMD EPYC with AVX-512 and oneDNN, medians of four fresh
    processes, ``tools/attention_probe.py``, BENCHMARKS.md ``attention@amd_avx512``):
    with a causal mask, whose key blocks the op skips, the fused attention ran
    0.98-1.34x the unfused one (TF's products around the stitched softmax kernel) at
    [1-32, 4-8, 128, 32-64]; unmasked, fused the same way (every product OpenBLAS's),
    it ran 0.55-2.1x, 0.87x in median at the Transformer's [8, 4, 128, 64].  On a Zen 5
    of the same class the masked ones lost too (``attention@amd_avx512_zen5``): the
    ops are timed against their unfused products where they run (``autotuned``), so a
    masked attention this takes runs as fast as the faster of the two ways."""
    chosen, products, unmasked = masked_products(ctx.graph_def, ctx)
    left = (f"; {unmasked} unmasked attention(s) left to oneDNN's products (the fused "
            f"op gains over them only where a mask removes key blocks)" if unmasked else "")
    if not chosen:
        return (f"no product run by OpenBLAS: TF's GEMM here is oneDNN's{left} "
                f"(tf/passes/attention.py)") if unmasked else None
    blas.rewrite(ctx.graph_def, [(p, None) for p in blas.batch_products(
        ctx.graph_def, ctx.fetched, ctx.excluded) if p.name in chosen])
    folded = blas.fold_head_transposes(ctx.graph_def, ctx.pinned)
    return (f"{len(chosen)} of {products} batch matrix product(s) run by OpenBLAS, "
            f"those of the masked attentions fused below ({folded} head transpose(s) "
            f"read or written in place); the other products stay oneDNN's{left} "
            f"(tf/passes/attention.py; Options(fused_attention=False) leaves them all "
            f"to TF)")


def _run(ctx):
    which = blas.mode(ctx.options, ctx)
    if which is None:
        return None                       # the blas pass says why, where it matters
    notes = [_take_masked_products(ctx)] if which == blas.ATTENTION else []
    # Options(exclude): an excluded node is an intermediate the op must not take, as a
    # fetched one (an excluded softmax is no kernel, so it never matches)
    tune = autotuned(which)
    fused = fuse(ctx.graph_def, ctx.pinned, lambda: ctx.shapes_of(ctx.graph_def),
                 ctx.folded, excluded=ctx.excluded.keys(), tune=tune)
    if fused:
        timed = [nd for nd in ctx.graph_def.node
                 if nd.op == "StitchedAttention" and UNFUSED_ATTR in nd.attr]
        if timed:       # the report's autotune entries (Report.autotune_decisions)
            ctx.autotune = (ctx.autotune or []) + [
                {"kernel": nd.name, "spec_hash": nd.attr[TUNE_ATTR].s.decode(),
                 "fused_us": None, "unfused_us": None, "predicted": None,
                 "margin": float("inf"), "attention": True} for nd in timed]
        notes.append(f"{fused} attention(s) fused into StitchedAttention (product, "
                     f"softmax kernel and product: the scores kept per block of query "
                     f"rows; tf/passes/attention.py)" + (
                         f"; {len(timed)} of them timed against their unfused products (TF's "
                         f"around the softmax kernel) on their first calls per shape "
                         f"class, the faster kept (stitching.runtime.autotune_decisions())"
                         if tune else ""))
    return [n for n in notes if n] or None


PASS = Pass("attention", _run, option="fused_attention")


@tf.RegisterGradient("StitchedAttention")
def _attention_grad(op, grad):
    """For a tape outside the stitched function (a stitched function fuses no
    attention whose softmax its own backward reads): the forward again in TF's ops, in
    the layouts BatchMatMulV2 would see, differentiated by TF.  Slower than the fused
    forward, but exact to TF's own gradient."""
    q, k, v = op.inputs[:3]
    attr = op.get_attr
    mask = op.inputs[3] if attr("n_mask") else None
    cond = op.inputs[3 + attr("n_mask")] if attr("n_cond") else None
    with tf.GradientTape() as tape:
        tape.watch(list(op.inputs))
        plain = [blas._swap(t) if attr(key) else t
                 for t, key in ((q, "transpose_q"), (k, "transpose_k"), (v, "transpose_v"))]
        s = tf.linalg.matmul(plain[0], plain[1], adjoint_a=attr("adj_q"),
                             adjoint_b=attr("adj_k")) * tf.cast(attr("scale"), q.dtype)
        s = s + mask if mask is not None else s
        if cond is not None:
            keep = cond if attr("cond_keeps") else tf.logical_not(cond)
            s = tf.where(keep, s, tf.cast(attr("fill"), s.dtype))
        p = tf.nn.softmax(s, -1)
        out = tf.linalg.matmul(p, plain[2], adjoint_b=attr("adj_v"))
        out = blas._swap(out) if attr("transpose_out") else out
    grads = tape.gradient(out, list(op.inputs), output_gradients=grad)
    return grads[:3 + attr("n_mask")] + [None] * attr("n_cond")
