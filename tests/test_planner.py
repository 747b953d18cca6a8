"""Planner on tiny hand-built IR graphs: expected regions, cycles, reasons (TF-free)."""
import pytest

from stitching.ir import Graph, Node, TensorType, ValueRef, infer
from stitching.plan import planner

F = "float32"


class G:
    """Tiny builder: G().input('x', [-1, 8]).op('m', 'Mean', ['x'], axes=[1], keep_dims=True)"""

    def __init__(self):
        self.g = Graph()

    def input(self, name, shape, dtype=F):
        self.g.add(Node(name, "Placeholder", [], {}, [TensorType(dtype, tuple(shape))]))
        return self

    def opaque(self, name, inputs, shape, dtype=F):
        self.g.add(Node(name, "MatMul", [ValueRef(i) for i in inputs], {},
                        [TensorType(dtype, tuple(shape))]))
        return self

    def op(self, name, op, inputs, **attrs):
        refs = [ValueRef(i) for i in inputs]
        t = infer(op, attrs, [self.g.type_of(r) for r in refs])
        self.g.add(Node(name, op, refs, attrs, [t]))
        return self

    def build(self, *outputs):
        self.g.outputs = [ValueRef(o) for o in outputs]
        self.g.verify()
        return self.g


def regions(p):
    return [sorted(r.nodes) for r in p.regions]


def allow_all(spec):
    return None


def layernorm(b, x="x"):
    return (b.op("mean", "Mean", [x], axes=[1], keep_dims=True)
             .op("d", "Sub", [x, "mean"]).op("sq", "Square", ["d"])
             .op("var", "Mean", ["sq"], axes=[1], keep_dims=True)
             .op("eps", "Const", [], value=1e-5, dtype=F, shape=[])
             .op("ve", "Add", ["var", "eps"]).op("inv", "Rsqrt", ["ve"])
             .op("y", "Mul", ["d", "inv"]))


def test_layernorm_is_one_region_with_shared_producer():
    g = layernorm(G().input("x", [-1, 64])).op("out", "Identity", ["y"]).build("out")
    p = planner.plan(g, allow_all)
    assert regions(p) == [sorted(["mean", "d", "sq", "var", "ve", "inv", "y"])]
    (r,) = p.regions
    # x read once although three nodes read it; eps folded in as a constant
    assert len(r.spec.inputs) == 1 and len(r.spec.outputs) == 1
    assert [n.op for n in r.spec.nodes].count("Const") == 1


def test_diamond_merges_into_one_region():
    g = (G().input("x", [4, 8]).op("a", "Exp", ["x"]).op("b", "Neg", ["a"])
         .op("c", "Abs", ["a"]).op("d", "Add", ["b", "c"]).op("out", "Identity", ["d"])
         .build("out"))
    assert regions(planner.plan(g, allow_all)) == [["a", "b", "c", "d"]]


def test_candidate_that_would_create_a_cycle_is_refused():
    # a -> m (opaque) -> d, and a -> d: putting a and d together would wrap around m.
    g = (G().input("x", [4, 8]).op("a", "Exp", ["x"]).op("a2", "Neg", ["a"])
         .opaque("m", ["a2"], [4, 8]).op("d", "Add", ["a2", "m"]).op("e", "Tanh", ["d"])
         .op("out", "Identity", ["e"]).build("out"))
    p = planner.plan(g, allow_all)
    assert regions(p) == [["a", "a2"], ["d", "e"]]
    assert any("cycle" in why for _, why in p.boundaries)


def test_multi_output_region():
    g = (G().input("x", [4, 8]).op("a", "Exp", ["x"]).op("b", "Neg", ["a"])
         .opaque("m1", ["a"], [4, 8]).opaque("m2", ["b"], [4, 8]).build("m1", "m2"))
    (r,) = planner.plan(g, allow_all).regions
    assert [str(o) for o in r.outputs] == ["a", "b"] and len(r.spec.outputs) == 2


def test_legality_refusal_reason_is_recorded_and_lone_ops_are_left():
    def no_reductions(spec):
        if any(n.op == "Mean" for n in spec.nodes):
            return "no reductions in this test"
        return None
    g = layernorm(G().input("x", [-1, 64])).op("out", "Identity", ["y"]).build("out")
    p = planner.plan(g, no_reductions)
    assert ("mean", "Mean", "no reductions in this test") in p.unfused
    assert all("Mean" not in [n.op for n in r.spec.nodes] for r in p.regions)


def test_identical_regions_share_one_spec_hash():
    b = G().input("x", [-1, 64])
    b.op("e1", "Exp", ["x"]).op("n1", "Neg", ["e1"]).opaque("m", ["n1"], [-1, 64])
    b.op("e2", "Exp", ["m"]).op("n2", "Neg", ["e2"]).op("out", "Identity", ["n2"])
    p = planner.plan(b.build("out"), allow_all)
    assert len(p.regions) == 2
    assert p.regions[0].spec.hash == p.regions[1].spec.hash


def test_two_thousand_node_graph_plans_into_one_region_per_block():
    # 2,000-node chain of LayerNorm-like blocks separated by opaque ops plans quickly
    b = G().input("x", [-1, 64])
    prev = "x"
    for i in range(150):
        b.op(f"m{i}", "Mean", [prev], axes=[1], keep_dims=True)
        b.op(f"s{i}", "Sub", [prev, f"m{i}"]).op(f"q{i}", "Square", [f"s{i}"])
        b.op(f"v{i}", "Mean", [f"q{i}"], axes=[1], keep_dims=True)
        b.op(f"r{i}", "Rsqrt", [f"v{i}"]).op(f"y{i}", "Mul", [f"s{i}", f"r{i}"])
        b.op(f"t{i}", "Tanh", [f"y{i}"]).op(f"u{i}", "Exp", [f"t{i}"])
        b.op(f"w{i}", "Add", [f"u{i}", f"y{i}"]).op(f"z{i}", "Relu", [f"w{i}"])
        b.op(f"k{i}", "Sigmoid", [f"z{i}"]).op(f"l{i}", "Mul", [f"k{i}", f"z{i}"])
        b.opaque(f"mm{i}", [f"l{i}"], [-1, 64])
        prev = f"mm{i}"
    g = b.op("out", "Identity", [prev]).build("out")
    assert len(g) > 1900
    p = planner.plan(g, allow_all)
    assert len(p.regions) == 150
