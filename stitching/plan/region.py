"""Region extraction: a set of IR nodes -> the KernelSpec of one fused kernel.

    graph + {nodes} ──▶ kernel inputs  (external values, first-use order, deduplicated;
                                         uniform constants are folded in as Const nodes)
                     ──▶ spec nodes    (composites expanded into primitives)
                     ──▶ kernel outputs (region values read outside or fetched)

The order of inputs, nodes and outputs depends only on the region's structure
(_structural_order), so structurally identical regions (twelve LayerNorms) give the
same spec and share one compiled kernel.  A fused Identity is its argument's value:
it adds no node (one more copy statement would make another compile of the same
program).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir import Graph, KernelSpec, SpecNode, TensorType, ValueRef, infer
from ..ir.ops import OPS
from ..ir.composites import COMPOSITE_OPS, MULTI_OUTPUT, expand
from .legality import DEVICE_ATTR, PLANNER_ATTRS, devices_conflict


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


def _spec_attrs(node) -> dict:
    """A node's attributes as a KernelSpec takes them: without the planner's own
    (PLANNER_ATTRS: its marks and the node's device)."""
    return {k: v for k, v in node.attrs.items() if k not in PLANNER_ATTRS}


def extract(graph: Graph, names: list, consumers: dict, fetched: set,
            order: dict, memo: dict | None = None) -> Region:
    """The Region of ``names``.  ``memo``: a dict the caller keeps for one graph while
    that graph does not change (the search planner's, across its hundreds of candidate
    regions): each graph node's spec attrs and inferred type, per argument types,
    computed once (a pure function of the node and those types)."""
    members = set(names)
    clash = devices_conflict({graph[n].attrs.get(DEVICE_ATTR, "") for n in members})
    if clash is not None:
        # One kernel node runs on one device.  Under tf.distribute each replica's ops
        # name their own: a kernel holding one replica's gradient (before its
        # all-reduce) and another's update (after it) would wait for a collective that
        # waits for it -- a cycle no graph edge shows (a MirroredStrategy step hung).
        # Ops TF places itself (no device) go with any.
        raise ValueError(f"ops placed on different devices ({clash}) in one kernel: a "
                         f"kernel runs on one device")
    outputs = region_outputs(graph, members, consumers, fetched)
    outputs.sort(key=lambda r: (order[r.node], r.index))
    for o in outputs:
        if o.index >= MULTI_OUTPUT.get(graph[o.node].op, 1):
            raise ValueError(f"{o}: only the first output of a fused node can leave a kernel")
    names = _structural_order(graph, members, outputs, order)
    b = _SpecBuilder(memo=memo)
    env: dict[ValueRef, int] = {}
    inputs: list[ValueRef] = []

    def ref_of(r: ValueRef) -> int:
        if r in env:
            return env[r]
        src = graph[r.node]
        if src.op == "Const" and r.node not in members:
            # folded in: its value, never its placement (under tf.device or a
            # strategy every Const has a device, which no KernelSpec takes)
            env[r] = b.emit_node(src, [])
        else:
            inputs.append(r)
            b.inputs.append(graph.type_of(r))
            env[r] = -len(inputs)
        return env[r]

    for name in names:
        node = graph[name]
        args = [ref_of(r) for r in node.inputs]
        if node.op == "Identity":
            env[ValueRef(name, 0)] = args[0]    # the same value: no node, no code
        elif node.op in COMPOSITE_OPS:
            attrs = _spec_attrs(node)
            r = expand(node.op, attrs, args, [b.type_of(a) for a in args], b.emit)
            for i, ri in enumerate(r if isinstance(r, tuple) else (r,)):
                env[ValueRef(name, i)] = ri
        else:
            env[ValueRef(name, 0)] = b.emit_node(node, args)
    # An output that is a kernel input (a fused Identity of one), or a value already
    # written by an earlier output (an Identity of it), needs a node of its own.
    out_refs = []
    for o in outputs:
        r = env[o]
        out_refs.append(b.emit("Identity", [r], {}) if r < 0 or r in out_refs else r)
    # what validate() checks holds by construction here (types inferred from the
    # inputs, canonical attrs, references to earlier nodes, distinct outputs); it
    # stays where specs cross a trust boundary (from_json, compile_kernel).  The
    # planners extract hundreds of candidate regions per graph, and re-inferring each
    # was a third of extract's time.
    spec = KernelSpec(tuple(b.inputs), tuple(b.nodes), tuple(out_refs))
    same = _same_dims(graph, inputs, spec)
    held = _held(graph, inputs)
    if same or held:
        spec = KernelSpec(spec.inputs, spec.nodes, spec.outputs,
                          {"held": held} if held else {}, same)
    return Region(names, inputs, outputs, spec)


# Producers whose output buffer another holder keeps for as long as the kernel runs: a
# variable (its value), a constant (the Const kernel).  TF never forwards such an
# input to an output, so an in-place pair on it is never taken,
# and the kernel's other pairs then alias without it: its generated code stores in
# place only when every pair aliases (codegen/cpu/emitter.py _in_place), and with some
# pairs aliasing, LLVM's overlap check runs the loop scalar (an Adam moment update:
# the gradient granted, m refused).
# (A function's argument is not among them: inlined into a caller's graph, it is the
# caller's value, which TF grants at its last use.)
HELD_PRODUCERS = frozenset({"ReadVariableOp", "TFConst", "Const"})
_SAME_BUFFER = frozenset({"Identity", "StopGradient", "Snapshot"})


def _held(graph: Graph, inputs: list) -> int:
    """The spec's ``held`` bit mask (ir/spec.py): inputs whose buffer TF never hands
    to the kernel's outputs (HELD_PRODUCERS, and the variable reads the frontend marks
    ``held``: the scratch import typed them as placeholders), through ops that pass the
    same buffer."""
    mask = 0
    for j, r in enumerate(inputs[:63]):
        node = graph[r.node] if r.node in graph else None
        while node is not None and node.op in _SAME_BUFFER and node.inputs \
                and node.inputs[0].node in graph:
            node = graph[node.inputs[0].node]
        if node is not None and (node.op in HELD_PRODUCERS or node.attrs.get("held")):
            mask |= 1 << j
    return mask


def _same_dims(graph: Graph, inputs: list, spec: KernelSpec) -> tuple:
    """Groups of the spec's unknown input dims that carry one symbol of the graph
    (ir/symdims.py), for a kernel of independent chains only (what they are for:
    schedule/domain.py packs such chains over one axis).  Every other spec stays as
    it was, and so does its hash."""
    syms = graph.dim_symbols
    if not syms or not _independent_chains(spec):
        return ()
    groups: dict = {}
    for j, r in enumerate(inputs):
        for i, m in enumerate(syms.get(r, ())):
            if m is not None and spec.inputs[j].shape[i] < 0:
                groups.setdefault(m, []).append((j, i))
    return tuple(tuple(g) for g in groups.values() if len(g) > 1)


def _independent_chains(spec: KernelSpec) -> bool:
    """Whether the outputs fall into two or more parts that share no node or input."""
    parent = list(range(len(spec.inputs) + len(spec.nodes)))

    def root(v):
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    def at(ref):            # inputs first, then nodes
        return -ref - 1 if ref < 0 else len(spec.inputs) + ref
    for k, n in enumerate(spec.nodes):
        for a in n.args:
            parent[root(at(a))] = root(at(k))
    return len({root(at(o)) for o in spec.outputs}) > 1


def _structural_order(graph: Graph, members: set, outputs: list, order: dict) -> list:
    """The members in post-order of a depth-first walk from the outputs (in their
    order) through each node's inputs (in argument order): topological, and fixed by
    the region's structure rather than by where its nodes sit in the graph.  Two
    copies of one subgraph whose nodes TF listed interleaved differently (MobileNetV2's
    BN + ReLU6 blocks) then number their nodes and inputs alike and share one compiled
    kernel.  Members no output depends on come last, in graph order."""
    seen, out = set(), []
    for o in outputs:
        if o.node in seen:
            continue
        seen.add(o.node)
        stack = [(o.node, iter(graph[o.node].inputs))]
        while stack:
            name, args = stack[-1]
            for r in args:
                if r.node in members and r.node not in seen:
                    seen.add(r.node)
                    stack.append((r.node, iter(graph[r.node].inputs)))
                    break
            else:
                stack.pop()
                out.append(name)
    out.extend(sorted(members - seen, key=order.__getitem__))
    return out


class _SpecBuilder:
    """Appends primitive nodes with canonical attrs and inferred types."""

    def __init__(self, inputs=(), memo: dict | None = None):
        self.inputs: list[TensorType] = list(inputs)
        self.nodes: list[SpecNode] = []
        self.memo = memo

    def emit_node(self, node, args: list) -> int:
        """``emit`` of a graph node (its attrs less the planner's), through ``memo``
        keyed by the node's name and its arguments' types."""
        if self.memo is None:
            return self.emit(node.op, args, _spec_attrs(node))
        types = tuple(self.type_of(a) for a in args)
        key = (node.name, types)
        hit = self.memo.get(key)
        if hit is None:
            d = OPS.get(node.op)
            if d is None:
                raise ValueError(f"op {node.op!r} is not in the op table")
            attrs = d.validate_attrs(_spec_attrs(node))
            hit = self.memo[key] = (attrs, infer(node.op, attrs, list(types)))
        # a dict of its own per spec node, as emit makes (nothing may share one)
        self.nodes.append(SpecNode(node.op, tuple(args), dict(hit[0]), hit[1]))
        return len(self.nodes) - 1

    def type_of(self, ref: int) -> TensorType:
        return self.inputs[-ref - 1] if ref < 0 else self.nodes[ref].type

    def emit(self, op: str, args: list, attrs: dict) -> int:
        d = OPS.get(op)
        if d is None:
            raise ValueError(f"op {op!r} is not in the op table")
        attrs = d.validate_attrs(attrs)
        t = infer(op, attrs, [self.type_of(a) for a in args])
        self.nodes.append(SpecNode(op, tuple(args), attrs, t))
        return len(self.nodes) - 1
