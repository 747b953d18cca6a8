"""Region extraction: a set of IR nodes -> the KernelSpec of one fused kernel.

    graph + {nodes} ──▶ kernel inputs  (external values, first-use order, deduplicated;
                                         uniform constants are folded in as Const nodes)
                     ──▶ spec nodes    (composites expanded into primitives)
                     ──▶ kernel outputs (region values read outside or fetched)

The order of inputs, nodes and outputs depends only on the region's structure,
so structurally identical regions (twelve LayerNorms) give the same spec and
share one compiled kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir import Graph, KernelSpec, SpecNode, TensorType, ValueRef, infer, validate
from ..ir.composites import COMPOSITE_OPS, expand
from .legality import PLANNER_ATTRS


@dataclass
class Region:
    nodes: list            # IR node names, topological
    inputs: list           # ValueRef per kernel input
    outputs: list          # ValueRef per kernel output
    spec: KernelSpec


def region_outputs(graph: Graph, members: set, consumers: dict, fetched: set) -> list:
    outs = []
    for name in members:
        for c in consumers[name]:
            if c in members:
                continue
            for r in graph[c].inputs:
                if r.node == name and r not in outs:
                    outs.append(r)
        for i in range(len(graph[name].outputs)):
            if ValueRef(name, i) in fetched and ValueRef(name, i) not in outs:
                outs.append(ValueRef(name, i))
    return outs


def extract(graph: Graph, names: list, consumers: dict, fetched: set,
            order: dict) -> Region:
    members = set(names)
    names = sorted(names, key=order.__getitem__)
    b = _SpecBuilder()
    env: dict[ValueRef, int] = {}
    inputs: list[ValueRef] = []

    def ref_of(r: ValueRef) -> int:
        if r in env:
            return env[r]
        src = graph[r.node]
        if src.op == "Const" and r.node not in members:
            env[r] = b.emit("Const", [], dict(src.attrs))
        else:
            inputs.append(r)
            b.inputs.append(graph.type_of(r))
            env[r] = -len(inputs)
        return env[r]

    for name in names:
        node = graph[name]
        args = [ref_of(r) for r in node.inputs]
        attrs = {k: v for k, v in node.attrs.items() if k not in PLANNER_ATTRS}
        if node.op in COMPOSITE_OPS:
            env[ValueRef(name, 0)] = expand(node.op, attrs, args,
                                            [b.type_of(a) for a in args], b.emit)
        else:
            env[ValueRef(name, 0)] = b.emit(node.op, args, attrs)
    outputs = [o for o in region_outputs(graph, members, consumers, fetched)]
    outputs.sort(key=lambda r: (order[r.node], r.index))
    for o in outputs:
        if o.index != 0:
            raise ValueError(f"{o}: only the first output of a fused node can leave a kernel")
    out_refs = [env[o] for o in outputs]
    # An output that is just a kernel input (a fused Identity) needs a node to write it.
    out_refs = [r if r >= 0 else b.emit("Identity", [r], {}) for r in out_refs]
    spec = validate(KernelSpec(tuple(b.inputs), tuple(b.nodes), tuple(out_refs)))
    return Region(names, inputs, outputs, _dedupe_outputs(spec))


def _dedupe_outputs(spec: KernelSpec) -> KernelSpec:
    if len(set(spec.outputs)) == len(spec.outputs):
        return spec
    raise ValueError("two kernel outputs are the same value")


class _SpecBuilder:
    """Appends primitive nodes with inferred types (also used by tests and tools)."""

    def __init__(self, inputs=()):
        self.inputs: list[TensorType] = list(inputs)
        self.nodes: list[SpecNode] = []

    def type_of(self, ref: int) -> TensorType:
        return self.inputs[-ref - 1] if ref < 0 else self.nodes[ref].type

    def emit(self, op: str, args: list, attrs: dict) -> int:
        t = infer(op, attrs, [self.type_of(a) for a in args])
        self.nodes.append(SpecNode(op, tuple(args), attrs, t))
        return len(self.nodes) - 1
