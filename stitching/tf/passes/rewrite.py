"""Rewrite: replace each planned region of a GraphDef by one StitchedKernel node.

    for each region:  NodeDef(op="StitchedKernel", inputs = region inputs
                              + ^control inputs of its members, attrs: spec, Tin, Tout,
                              output_shapes, label)
    every other node: copied; inputs that named a region value now name the kernel's
                      output; ``^member`` control edges become ``^kernel``.

Plan first, rewrite once: this module makes no decisions.
"""
from __future__ import annotations

from tensorflow.core.framework import graph_pb2, node_def_pb2, tensor_shape_pb2

from ...plan.legality import DEVICE_ATTR
from ..passmanager import Pass
from ..tfgraph import TF_DTYPE


def _tensor_name(ref) -> str:
    return ref.node if ref.index == 0 else f"{ref.node}:{ref.index}"


def _shape_proto(shape):
    p = tensor_shape_pb2.TensorShapeProto()
    for d in shape:
        p.dim.add(size=d)
    return p


def rewrite(graph_def, ir_graph, regions, labels=None):
    """Returns (new GraphDef, kernel node names) — one kernel node per region.  Each
    region's original nodes are kept as a library function by original.attach."""
    taken = {n.name for n in graph_def.node}
    member_of: dict[str, str] = {}
    value_map: dict[tuple, str] = {}
    kernels = []
    for i, reg in enumerate(regions):
        name = _unique(f"stitching/kernel_{i}", taken)
        kernels.append(name)
        for m in reg.nodes:
            member_of[m] = name
        for k, out in enumerate(reg.outputs):
            value_map[(out.node, out.index)] = name if k == 0 else f"{name}:{k}"

    def remap(inp: str) -> str:
        if inp.startswith("^"):
            return "^" + member_of.get(inp[1:], inp[1:])
        node, _, idx = inp.partition(":")
        return value_map.get((node, int(idx or 0)), inp)

    out = graph_pb2.GraphDef()
    out.versions.CopyFrom(graph_def.versions)
    out.library.CopyFrom(graph_def.library)
    for nd in graph_def.node:
        if nd.name in member_of:
            continue
        new = out.node.add()
        new.CopyFrom(nd)
        del new.input[:]
        ins = [remap(x) for x in nd.input]
        # data inputs keep their positions (Add(x, x) has two); only ^control edges,
        # which several fused members may map onto one kernel, are deduplicated
        new.input.extend([x for x in ins if not x.startswith("^")]
                         + _dedupe(x for x in ins if x.startswith("^")))
        new.attr.pop("_output_shapes", None)
        _drop_colocation_with(new, member_of)
    for i, (reg, name) in enumerate(zip(regions, kernels)):
        out.node.append(_kernel_node(name, reg, ir_graph, remap,
                                     labels[i] if labels else name))
    _keep_fetched_names(out, ir_graph, member_of, value_map)
    return out, kernels


def _drop_colocation_with(nd, removed):
    """A node colocated with a fused-away node (``_class: loc:@name``, as tf.gradients
    colocates a gradient with its forward op) would name a node that no longer exists,
    which import_graph_def refuses: keep only colocations with surviving nodes."""
    if "_class" not in nd.attr:
        return
    keep = [c for c in nd.attr["_class"].list.s
            if not (c.startswith(b"loc:@") and c[5:].decode() in removed)]
    if keep:
        del nd.attr["_class"].list.s[:]
        nd.attr["_class"].list.s.extend(keep)
    else:
        del nd.attr["_class"]


def _keep_fetched_names(out, ir_graph, member_of, value_map):
    """A fetched node that was fused away stays fetchable by name: it becomes an
    Identity of the kernel output that now holds its value."""
    for ref in ir_graph.outputs:
        if ref.node not in member_of or ref.index != 0:
            continue
        if any(n.name == ref.node for n in out.node):
            continue
        nd = out.node.add(name=ref.node, op="Identity")
        nd.input.append(value_map[(ref.node, 0)])
        nd.attr["T"].type = TF_DTYPE[ir_graph.type_of(ref).dtype].as_datatype_enum


def _kernel_node(name, reg, ir_graph, remap, label):
    nd = node_def_pb2.NodeDef(name=name, op="StitchedKernel")
    # its ops' device (one: plan/region.py), where they named one: a replica's kernel
    # runs on that replica's device under tf.distribute
    nd.device = max((ir_graph[m].attrs.get(DEVICE_ATTR, "") for m in reg.nodes), key=len)
    nd.input.extend(remap(_tensor_name(r)) for r in reg.inputs)
    members = set(reg.nodes)
    ctrl = []
    for m in reg.nodes:
        for c in ir_graph[m].control_inputs:
            if c not in members:
                ctrl.append(remap("^" + c))
    nd.input.extend(_dedupe(c for c in ctrl if c != "^" + name))
    nd.attr["spec"].s = reg.spec.to_json().encode()
    nd.attr["spec_hash"].s = reg.spec.hash.encode()   # checked by the op (op.cc)
    nd.attr["label"].s = label.encode()
    nd.attr["Tin"].list.type.extend(
        TF_DTYPE[t.dtype].as_datatype_enum for t in reg.spec.inputs)
    nd.attr["Tout"].list.type.extend(
        TF_DTYPE[t.dtype].as_datatype_enum for t in reg.spec.output_types)
    nd.attr["output_shapes"].list.shape.extend(
        _shape_proto(ir_graph.type_of(o).shape) for o in reg.outputs)
    return nd


def _dedupe(items):
    seen, out = set(), []
    for x in items:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


def _unique(name, taken):
    base, k = name, 1
    while name in taken:
        name = f"{base}_{k}"
        k += 1
    taken.add(name)
    return name


def _run(ctx):
    new, ctx.kernel_names = rewrite(ctx.planned, ctx.ir, ctx.regions, ctx.labels)
    ctx.replace(new)


PASS = Pass("rewrite", _run)
