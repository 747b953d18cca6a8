"""The original subgraph of each fused region, kept as a function, and the gradient of
``StitchedKernel`` that differentiates it.

    rewrite time:  region members (+ the constants and shape arithmetic they read)
                   ──▶ one FunctionDef per region in the GraphDef's library, named by a
                       hash of its body ("stitching_original_<hash>"), and the kernel
                       node's attr ``_stitching_original`` naming it
    gradient:      op ──▶ the FunctionDef from op.graph's library (or an outer graph's)
                      ──▶ its body imported inline, fed by op.inputs (recompute)
                      ──▶ tf.gradients(body outputs, inputs, grad_ys=upstream grads)

So the backward of a stitched region is TF's own gradient of the ops it replaced: every
kernel the planner emits is differentiable (multiple outputs, broadcasts, reductions,
unknown dims), integer outputs and unconnected inputs give TF's usual ``None``, and
second-order gradients work (the backward's own kernels carry their originals too).
With ``Options.stitch_backward`` (the default) that backward -- recompute + TF's
adjoint ops -- is itself a ``stitching.function`` (one per kind of region), so the
planner fuses the recompute with the adjoint where its cost model says it pays;
otherwise it runs as TF ops.  A tape *inside* ``stitching.function`` never reaches
this: its backward ops are in the traced graph and are planned with the rest.

Why a function and not the forward region rebuilt from the IR: the TF nodes are the
exact ops the user's graph had (same attrs, same numerics, TF's gradient registry
applies to them), the IR has no way back to TF ops, and the function is a plain
library entry that other mechanisms can share (a native-segment fallback that runs the
original ops where a kernel cannot be compiled would call the same function).

The attr is a ``_``-prefixed node attr, so the op's registration and graphs written
before it are unchanged; a kernel node without it (an older graph) fails its gradient
with an error that names the node.
"""
from __future__ import annotations

import hashlib
import json

import tensorflow as tf
from tensorflow.core.framework import function_pb2, graph_pb2
from tensorflow.python.framework import function_def_to_graph, op_def_registry

from ..passmanager import Pass

ATTR = "_stitching_original"
PREFIX = "stitching_original_"

# attrs that tie a node to its place in the outer graph (colocation, inferred shapes)
_DROP_ATTRS = ("_class", "_output_shapes")
# nodes a region's body may copy from outside the region: pure and cheap (constants
# and the shape arithmetic that feeds Reshape/broadcast targets)
_COPYABLE = {"Const", "Shape", "ShapeN", "Size", "Rank", "Pack", "Unpack", "Cast",
             "StridedSlice", "Slice", "ConcatV2", "Gather", "GatherV2", "Fill", "Range",
             "Identity", "Add", "AddV2", "Sub", "Mul", "Prod", "FloorDiv", "Maximum",
             "Minimum", "BroadcastArgs", "Reshape", "ExpandDims", "Squeeze"}


class NotReproducible(Exception):
    """The region reads a value that is neither a kernel input nor copyable."""


# ---------------------------------------------------------------- rewrite time

def region_function(graph_def, region, ir_graph, nodes_by_name=None):
    """FunctionDef computing ``region.outputs`` from ``region.inputs`` with the
    region's original TF nodes, or None when the region reads a value that cannot be
    reproduced from its inputs (then its gradient reports that).

    Written directly as a FunctionDef (inputs ``node:output_arg:index``) rather than
    through a scratch tf.Graph: that import cost ~2.4 ms per region, 0.12 s of a
    50-kernel ResNet50's first call."""
    nodes = nodes_by_name or {n.name: n for n in graph_def.node}
    try:
        body = _body(nodes, region, ir_graph)
        fdef = _to_function_def(body, region, ir_graph)
    except NotReproducible:
        return None
    _canonical_names(fdef)
    fdef.signature.name = PREFIX + hashlib.sha256(
        fdef.SerializeToString(deterministic=True)).hexdigest()[:24]
    return fdef


def _canonical_names(fdef) -> None:
    """Rename the body's nodes n0, n1, ... in order and drop their debug info (in
    place), so regions that differ only in their nodes' names in the user's graph
    hash to one function: MobileNetV2's 53 regions were 53 library functions, each
    converted to a Python FuncGraph by tf.saved_model.load and optimized by Grappler
    at the first call, though most are the same BN + ReLU6."""
    new = {n.name: f"n{i}" for i, n in enumerate(fdef.node_def)}

    def ref(r):
        node, sep, rest = r.partition(":")
        return new.get(node, node) + sep + rest
    for n in fdef.node_def:
        n.name = new[n.name]
        n.ClearField("experimental_debug_info")
        inputs = [ref(i) for i in n.input]
        del n.input[:]
        n.input.extend(inputs)
    for k in list(fdef.ret):
        fdef.ret[k] = ref(fdef.ret[k])


def _to_function_def(body, region, ir_graph):
    fdef = function_pb2.FunctionDef()
    args = {}
    for nd in body.node:
        if nd.op == "Placeholder":
            fdef.signature.input_arg.add(name=nd.name, type=nd.attr["dtype"].type)
            args[nd.name] = nd.name
    names = {}
    for nd in body.node:
        if nd.op != "Placeholder":
            names[nd.name] = _output_names(nd)
    for nd in body.node:
        if nd.op == "Placeholder":
            continue
        new = fdef.node_def.add()
        new.CopyFrom(nd)
        del new.input[:]
        new.input.extend(args.get(i) or _function_ref(i, names) for i in nd.input)
    for k, o in enumerate(region.outputs):
        name = f"output_{k}"
        fdef.signature.output_arg.add(name=name, type=_tf_dtype(o, ir_graph.type_of(o)))
        fdef.ret[name] = _function_ref(f"{o.node}:{o.index}", names)
    return fdef


def _output_names(nd):
    """``node:output_arg:index`` of each output of a NodeDef, from its OpDef."""
    op_def = op_def_registry.get(nd.op)
    if op_def is None:
        raise NotReproducible(nd.name)
    out = []
    for arg in op_def.output_arg:
        if arg.number_attr:
            n = nd.attr[arg.number_attr].i
        elif arg.type_list_attr:
            n = len(nd.attr[arg.type_list_attr].list.type)
        else:
            n = 1
        out.extend(f"{nd.name}:{arg.name}:{j}" for j in range(n))
    return out


def _function_ref(tensor, names):
    node, _, idx = tensor.partition(":")
    outs = names.get(node)
    if outs is None or int(idx or 0) >= len(outs):
        raise NotReproducible(node)
    return outs[int(idx or 0)]


def _body(nodes, region, ir_graph):
    """A GraphDef: one Placeholder per kernel input, the members, and the copyable
    nodes they read from outside; control edges dropped (a pure region)."""
    arg_of = {(r.node, r.index): f"stitching_arg_{k}" for k, r in enumerate(region.inputs)}
    out = graph_pb2.GraphDef()
    for k, r in enumerate(region.inputs):
        t = ir_graph.type_of(r)
        ph = out.node.add(name=f"stitching_arg_{k}", op="Placeholder")
        ph.attr["dtype"].type = _tf_dtype(r, t)
    members = set(region.nodes)
    copied: set = set()
    todo = list(region.nodes)
    while todo:
        name = todo.pop()
        if name in copied:
            continue
        src = nodes.get(name)
        if src is None or (name not in members and src.op not in _COPYABLE):
            raise NotReproducible(name)
        copied.add(name)
        nd = out.node.add()
        nd.CopyFrom(src)
        for a in _DROP_ATTRS:
            nd.attr.pop(a, None)
        del nd.input[:]
        for j, inp in enumerate(src.input):
            if inp.startswith("^"):
                continue
            node, _, idx = inp.partition(":")
            arg = arg_of.get((node, int(idx or 0)))
            if arg is not None:
                nd.input.append(arg)
            elif j == 1 and src.op == "Reshape" and name in members:
                nd.input.append(_static_target(out, name, ir_graph))
            else:
                nd.input.append(inp)
                todo.append(node)
    return out


def _static_target(out, name, ir_graph):
    """A fused Reshape's target as a Const: the IR's shape (-1 for at most one unknown
    dim, which TF's Reshape infers).  Its shape tensor is often Shape() of a value
    outside the region (gradients reshape to Shape(x)), which the body cannot read."""
    shape = list(ir_graph[name].attrs["shape"])
    if shape.count(-1) > 1:
        raise NotReproducible(name)
    c = out.node.add(name=f"{name}/stitching_target", op="Const")
    c.attr["dtype"].type = tf.int32.as_datatype_enum
    c.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(shape, tf.int32, [len(shape)]))
    return c.name


def _tf_dtype(ref, t):
    from ..tfgraph import TF_DTYPE
    dt = TF_DTYPE.get(t.dtype)
    if dt is None:
        raise NotReproducible(ref.node)
    return dt.as_datatype_enum


def attach(graph_def, original_def, ir_graph, regions, kernel_names,
           stitch_backward=False, fallback=False, options=None):
    """Adds one function per region (its nodes taken from ``original_def``, the graph
    before the rewrite) to ``graph_def``'s library and names it on the region's kernel
    node (in place).  Returns how many regions have none.

    ``fallback`` (``Options.fallback``, what stitching-rewrite ships): the node's
    ``fallback`` attr names the same function, which the op runs with TF's kernels
    where its own kernel cannot be built (no compiler, another CPU, a compile error;
    op.cc logs why, ``stitching.runtime.stats()`` counts it, STITCHING_STRICT=1 makes
    it an error).  Its arguments are the kernel's inputs in order, its results the
    kernel's outputs.  The op also runs it for a call whose inputs the kernel was not
    built for (op.cc Guard), found by the name in ``ATTR``: a string, not the op's
    ``guard`` func attr, which TF would instantiate with every graph that holds the
    node (+1.4-2.6 ms on each trace's first call, tools/scalar_bench.py).
    ``options``: the forward's Options, recorded for the stitched backward
    (options_attr)."""
    nodes = {n.name: n for n in original_def.node}
    have = {f.signature.name for f in graph_def.library.function}
    kernel_nodes = {n.name: n for n in graph_def.node if n.op == "StitchedKernel"}
    missing = 0
    for reg, kname in zip(regions, kernel_names):
        fdef = region_function(original_def, reg, ir_graph, nodes)
        if fdef is None:
            missing += 1
            continue
        if fdef.signature.name not in have:
            have.add(fdef.signature.name)
            graph_def.library.function.add().CopyFrom(fdef)
        kernel_nodes[kname].attr[ATTR].s = fdef.signature.name.encode()
        if fallback:
            kernel_nodes[kname].attr["fallback"].list.func.add().name = \
                fdef.signature.name
        if stitch_backward:
            kernel_nodes[kname].attr[BACKWARD_ATTR].s = b"stitch"
            if options is not None:
                kernel_nodes[kname].attr[OPTIONS_ATTR].s = options_attr(options)
    return missing


# ---------------------------------------------------------------- gradient time

def _find_function_def(graph, name):
    g = graph
    while g is not None:
        f = g._functions.get(name)  # noqa: SLF001 — TF keeps library functions here
        if f is not None:
            return getattr(f, "definition", None) or f.cached_definition
        g = getattr(g, "outer_graph", None)
    from tensorflow.python.eager import context
    if context.context().has_function(name):
        return context.context().get_function_def(name)
    return None


def _op_label(op):
    try:
        label = op.get_attr("label").decode()
    except ValueError:
        label = ""
    return f"StitchedKernel node '{op.name}'" + (f" ({label})" if label else "")


def _function_def_of(op):
    try:
        name = op.get_attr(ATTR).decode()
    except ValueError:
        name = ""
    fdef = _find_function_def(op.graph, name) if name else None
    if fdef is None:
        why = (f"its function '{name}' is not in the graph's library" if name else
               "it carries no original subgraph (a graph stitched before gradients "
               "were supported, or a region reading a value it cannot recompute)")
        raise LookupError(f"No gradient for {_op_label(op)}: {why}. Stitch the function "
                          "again, or take the gradient inside the stitched function.")
    return fdef


def import_body(fdef, xs, name):
    """The function's body imported into the current graph, fed by ``xs``; returns
    its outputs."""
    gdef, flat = function_def_to_graph.function_def_to_graph_def(fdef)
    input_map = {a.name + ":0": x for a, x in zip(fdef.signature.input_arg, xs)}
    rets = [flat[fdef.ret[a.name]] for a in fdef.signature.output_arg]
    rets = [r if ":" in r else r + ":0" for r in rets]
    return tf.graph_util.import_graph_def(gdef, input_map=input_map, return_elements=rets,
                                          name=name)


def original_outputs(op):
    """Imports the op's original subgraph into the current graph, fed by op.inputs;
    returns (inputs as used there, outputs)."""
    fdef = _function_def_of(op)
    xs = [tf.identity(t) for t in op.inputs]    # captured into this (backward) graph
    return xs, import_body(fdef, xs, op.name.replace("/", "_") + "_original")


def _differentiable(t):
    return t.dtype.is_floating or t.dtype.is_complex


# ---------------------------------------------------------------- stitched backward
#
# With the kernel's attr BACKWARD_ATTR = "stitch" (Options.stitch_backward, the
# default), the backward is one function of (region inputs, upstream gradients):
# the original ops recomputed and TF's gradient of them, which the pipeline plans,
# compiles and rewrites like any other function, so the recompute and the adjoint
# ops fuse into kernels.  stitching.function owns that pipeline and plugs it in here
# (use_backward_stitcher), as plan/cost.py's use_scheduler does one stage down.

BACKWARD_ATTR = "_stitching_backward"
_backward_stitcher = None        # (key, python_fn, Options) -> callable, by tf/function.py


def use_backward_stitcher(make):
    global _backward_stitcher
    _backward_stitcher = make


# The stitched backward plans with the forward's Options (planner, min_ops, gemm,
# verify, fallback, progress, dump_dir...), carried as JSON in OPTIONS_ATTR.  Not
# background_compile: the backward is traced inside the gradient's own trace, which
# has no stock-TF-first call path to serve it.  A graph is data from outside: only the
# Options fields with plain values are read, Options validates them, and dump_dir (a
# place to write files) is honoured only for JSON this process wrote.
OPTIONS_ATTR = "_stitching_options"
_NOT_INHERITED = ("background_compile",)
# Fields added after graphs carrying this attr were written: left out at their default,
# so a graph stitched with default Options is the same bytes as before they existed.
# exclude (a list in JSON) is inherited: the ops a user keeps TF's stay TF's in the
# stitched backward too (its gradient ops of that type, names under that pattern).
_OMITTED_AT_DEFAULT = {"dump_passes": None, "exclude": ()}
_WRITTEN: set = set()           # option strings recorded by this process


def options_attr(options) -> bytes:
    import dataclasses
    d = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
         if f.name not in _NOT_INHERITED}
    if d.get("dump_dir") is not None:
        d["dump_dir"] = str(d["dump_dir"])
    for name, default in _OMITTED_AT_DEFAULT.items():
        if d.get(name) == default:
            del d[name]
    s = json.dumps(d, sort_keys=True).encode()
    _WRITTEN.add(s)
    return s


def backward_options(op):
    """The forward's Options from the kernel node, or None (default Options)."""
    try:
        raw = op.get_attr(OPTIONS_ATTR)
    except (ValueError, tf.errors.InvalidArgumentError):
        return None
    import dataclasses

    from ...options import Options
    try:
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise ValueError("not an object")
        names = {f.name for f in dataclasses.fields(Options)} - set(_NOT_INHERITED)
        kw = {k: v for k, v in d.items() if k in names
              and (v is None or isinstance(v, (str, int, bool))
                   or k == "exclude" and isinstance(v, list))}   # Options checks each entry
        if raw not in _WRITTEN:
            kw.pop("dump_dir", None)
            kw.pop("dump_passes", None)
        return Options(**kw)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{_op_label(op)}: its {OPTIONS_ATTR} attr is not valid "
                         f"Options ({e})") from None


def _wants_stitched_backward(op):
    try:
        return op.get_attr(BACKWARD_ATTR) == b"stitch" and _backward_stitcher is not None
    except (ValueError, tf.errors.InvalidArgumentError):
        return False


def _backward_fn(fdef, n_in, wanted, float_in):
    """Python function (xs..., grads of the wanted outputs...) -> grads of the float
    inputs, for stitching."""
    def backward(*args):
        xs, gs = list(args[:n_in]), list(args[n_in:])
        ys = import_body(fdef, xs, "original")
        dxs = tf.gradients([ys[k] for k in wanted], [xs[i] for i in float_in], grad_ys=gs)
        # an input the outputs do not depend on: zeros, as a function output
        return [d if d is not None else tf.zeros_like(xs[i]) for d, i in zip(dxs, float_in)]
    backward.__name__ = f"backward_of_{fdef.signature.name}"
    return backward


def _stitched_backward(op, grads, wanted):
    fdef = _function_def_of(op)
    float_in = [i for i, x in enumerate(op.inputs) if _differentiable(x)]
    options = backward_options(op)
    key = (fdef.signature.name, tuple(wanted), options)
    fn = _backward_stitcher(key, lambda: _backward_fn(fdef, len(op.inputs), wanted,
                                                      float_in), options)
    dxs = fn(*op.inputs, *[grads[k] for k in wanted])
    unconnected = _unconnected(fdef, op.inputs, wanted, float_in, key)
    out = [None] * len(op.inputs)
    for i, d in zip(float_in, dxs):
        out[i] = None if i in unconnected else d
    return out


_UNCONNECTED: dict = {}          # backward key -> inputs the wanted outputs ignore


def _unconnected(fdef, inputs, wanted, float_in, key) -> set:
    """The float inputs TF's gradient of the region gives as None (the wanted outputs
    do not depend on them, or only through ops without a gradient, as Round).  The
    stitched backward returns zeros there (a function output cannot be None); the
    gradient gives None, as tf.gradients over the original ops does, so that a
    caller's ``grad is None`` means what it means with TF.  Found once per kind of
    region, in a graph of its own."""
    if key not in _UNCONNECTED:
        with tf.Graph().as_default():
            xs = [tf.compat.v1.placeholder(x.dtype, x.shape) for x in inputs]
            ys = import_body(fdef, xs, "original")
            dxs = tf.gradients([ys[k] for k in wanted], [xs[i] for i in float_in])
        _UNCONNECTED[key] = {i for d, i in zip(dxs, float_in) if d is None}
    return _UNCONNECTED[key]


def _check_not_eager(op):
    """An op run on its own (eagerly, outside any function) was never rewritten from
    TF ops: there is no original subgraph to differentiate.  TF hands the gradient an
    op record without a graph then."""
    if getattr(op, "graph", None) is None:
        try:
            label = op.get_attr("label")
            label = f" '{label.decode()}'" if label else ""
        except (ValueError, tf.errors.InvalidArgumentError):
            label = ""
        raise LookupError(
            f"No gradient for StitchedKernel{label} executed eagerly: a kernel op called "
            "outside tf.function/stitching.function carries no original TF ops to "
            "differentiate. Wrap the computation in stitching.function (its kernels "
            "differentiate the ops they replaced), or take the gradient of the "
            "unstitched TF ops.")


@tf.RegisterGradient("StitchedKernel")
def _stitched_kernel_grad(op, *grads):
    _check_not_eager(op)
    wanted = [k for k, (g, o) in enumerate(zip(grads, op.outputs))
              if g is not None and _differentiable(o)]
    if not wanted or not any(_differentiable(x) for x in op.inputs):
        return [None] * len(op.inputs)
    if _wants_stitched_backward(op):
        return _stitched_backward(op, grads, wanted)
    xs, ys = original_outputs(op)
    dxs = tf.gradients([ys[k] for k in wanted], xs, grad_ys=[grads[k] for k in wanted])
    return [d if _differentiable(x) else None for d, x in zip(dxs, op.inputs)]


def _run(ctx):
    o = ctx.options
    no_original = attach(ctx.graph_def, ctx.planned, ctx.ir, ctx.regions, ctx.kernel_names,
                         stitch_backward=o.stitch_backward, fallback=o.fallback, options=o)
    # Report.backward, not a note: it says what *would* happen under a tape outside,
    # which inference and stitching-rewrite never have.
    parts = []
    if len(ctx.regions) > no_original:
        how = ("stitched as a function of its own per kind of kernel (the kernel's "
               "original ops recomputed and TF's gradient of them, planned like any "
               "function)" if o.stitch_backward else
               "TF's gradient of its original ops, recomputed, as TF ops "
               "(Options.stitch_backward=False)")
        parts.append(f"a tape outside this function differentiates "
                     f"{len(ctx.regions) - no_original} kernel(s), each {how}; a tape "
                     "inside it gets its backward stitched with the rest")
    if no_original:
        parts.append(f"{no_original} kernel(s) read a value they cannot recompute from "
                     "their inputs: no original subgraph, so no gradient through them")
    ctx.backward = " ".join(parts)
    return None


PASS = Pass("original", _run)
