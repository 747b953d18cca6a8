"""Planner on tiny hand-built IR graphs: expected regions, cycles, reasons (TF-free)."""
import pytest

from irbuild import F, G, allow_all, layernorm, ln_chain, regions
from stitching.plan import planner


def test_layernorm_is_one_region_with_shared_producer():
    g = layernorm(G().input("x", [-1, 64])).op("out", "Identity", ["y"]).build("out")
    p = planner.plan(g, allow_all)
    # the fetched Identity joins the kernel; the rewriter keeps its name fetchable
    assert regions(p) == [sorted(["mean", "d", "sq", "var", "ve", "inv", "y", "out"])]
    (r,) = p.regions
    # x read once although three nodes read it; eps folded in as a constant
    assert len(r.spec.inputs) == 1 and len(r.spec.outputs) == 1
    assert [n.op for n in r.spec.nodes].count("Const") == 1


def test_diamond_merges_into_one_region():
    g = (G().input("x", [4, 8]).op("a", "Exp", ["x"]).op("b", "Neg", ["a"])
         .op("c", "Abs", ["a"]).op("d", "Add", ["b", "c"]).op("out", "Identity", ["d"])
         .build("out"))
    assert regions(planner.plan(g, allow_all)) == [["a", "b", "c", "d", "out"]]


def test_candidate_that_would_create_a_cycle_is_refused():
    # a -> m (opaque) -> d, and a -> d: putting a and d together would wrap around m.
    g = (G().input("x", [4, 8]).op("a", "Exp", ["x"]).op("a2", "Neg", ["a"])
         .opaque("m", ["a2"], [4, 8]).op("d", "Add", ["a2", "m"]).op("e", "Tanh", ["d"])
         .op("out", "Identity", ["e"]).build("out"))
    p = planner.plan(g, allow_all)
    assert regions(p) == [["a", "a2"], ["d", "e", "out"]]
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
    b.op("e2", "Exp", ["m"]).op("n2", "Neg", ["e2"]).opaque("out", ["n2"], [-1, 64])
    p = planner.plan(b.build("out"), allow_all)
    assert len(p.regions) == 2
    assert p.regions[0].spec.hash == p.regions[1].spec.hash


def _scale_shift(b, p, x):
    """(x - mu) * s + t with per-column mu, s, t (an inference BatchNorm)."""
    return (b.op(p + "c", "Sub", [x, "mu"]).op(p + "m", "Mul", [p + "c", "s"])
             .op(p + "o", "Add", [p + "m", "t"]))


def test_same_structure_in_interleaved_order_gives_the_same_spec():
    # two copies of one subgraph whose nodes TF listed in different topological orders
    # (the Mul's operands created the other way round): the spec numbers nodes and
    # inputs by structure, so both get one spec and one compiled kernel
    def graph(swapped):
        b = G().input("x", [-1, 64]).input("t", [64])
        if swapped:
            b.op("q", "Exp", ["x"]).op("c", "Neg", ["x"])
        else:
            b.op("c", "Neg", ["x"]).op("q", "Exp", ["x"])
        b.op("m", "Mul", ["c", "q"]).op("o", "Add", ["m", "t"])
        return b.opaque("out", ["o"], [-1, 64]).build("out")
    specs = []
    for swapped in (False, True):
        (r,) = planner.plan(graph(swapped), allow_all).regions
        assert [n.op for n in r.spec.nodes] == ["Neg", "Exp", "Mul", "Add"]
        assert r.nodes.index("c") < r.nodes.index("m")      # still topological
        specs.append(r.spec)
    assert specs[0].hash == specs[1].hash


def test_a_fused_identity_adds_no_node():
    def graph(identity):
        b = G().input("x", [-1, 64]).op("e", "Exp", ["x"]).op("n", "Neg", ["e"])
        if identity:
            b.op("i", "Identity", ["n"])
        return b.opaque("out", ["i" if identity else "n"], [-1, 64]).build("out")
    (with_id,) = planner.plan(graph(True), allow_all).regions
    (without,) = planner.plan(graph(False), allow_all).regions
    assert "i" in with_id.nodes
    assert [n.op for n in with_id.spec.nodes] == ["Exp", "Neg"]
    assert with_id.spec.hash == without.spec.hash


def test_identity_outputs_of_an_input_or_of_another_output_get_a_node():
    from stitching.plan.region import extract
    b = G().input("x", [-1, 64]).op("e", "Exp", ["x"]).op("n", "Neg", ["e"])
    b.op("i", "Identity", ["n"]).op("ix", "Identity", ["x"])
    g = b.opaque("u", ["n"], [-1, 64]).opaque("v", ["i"], [-1, 64]) \
        .opaque("w", ["ix"], [-1, 64]).build("u", "v", "w")
    order = {name: k for k, name in enumerate(g.topo_order())}
    reg = extract(g, ["e", "n", "i", "ix"], g.consumers(), set(g.outputs), order)
    spec = reg.spec
    out = {o.node: spec.outputs[k] for k, o in enumerate(reg.outputs)}
    assert sorted(out) == ["i", "ix", "n"] and len(set(out.values())) == 3
    # n and i are one value read outside twice: the second output is a copy of it;
    # ix is a copy of the kernel input x
    assert sorted(n.op for n in spec.nodes) == ["Exp", "Identity", "Identity", "Neg"]
    assert spec.nodes[out["i"]].op == "Identity" and spec.nodes[out["i"]].args == (out["n"],)
    assert spec.nodes[out["ix"]].op == "Identity" and spec.nodes[out["ix"]].args == (-1,)


def test_two_thousand_node_graph_plans_into_one_region_per_block():
    # 2,000-node chain of LayerNorm-like blocks separated by opaque ops plans quickly
    g = ln_chain(150)
    assert len(g) > 1900
    p = planner.plan(g, allow_all)
    assert len(p.regions) == 150


def test_extracted_specs_are_already_canonical():
    # extract builds specs without re-running validate(): what validate returns for
    # them must be the same spec (same attrs, types and hash)
    from irbuild import encoder
    from stitching.ir.spec import validate
    p = planner.plan(encoder(3), allow_all)
    assert p.regions
    for r in p.regions:
        v = validate(r.spec)
        assert v == r.spec and v.hash == r.spec.hash


def test_extract_memo_gives_the_specs_extract_makes_without_it():
    # the search planner's memo (a node's spec attrs and inferred type, per argument
    # types) shared by every candidate region of a graph: each region's spec is the
    # one extract makes without it, whatever the regions asked before
    from irbuild import encoder
    from stitching.plan.region import extract
    g = encoder(2)
    order = {name: k for k, name in enumerate(g.topo_order())}
    cons, fetched = g.consumers(), set(g.outputs)
    fusible = [n for n in g.topo_order() if g[n].op not in ("Placeholder", "MatMul")]
    memo = {}
    for size in (1, 2, 3, 5, 8):
        for start in range(0, len(fusible) - size + 1, 2):
            names = fusible[start:start + size]
            try:
                plain = extract(g, names, cons, fetched, order)
            except ValueError:
                continue
            memoized = extract(g, names, cons, fetched, order, memo)
            assert memoized.spec == plain.spec and memoized.spec.hash == plain.spec.hash
    assert memo


def test_extract_memo_is_keyed_by_argument_types():
    # a node met again with arguments of other types (a memo kept past a change of the
    # graph's shapes) is inferred again, not given the first answer
    from stitching.plan.region import extract

    def graph(width):
        b = G().input("x", [-1, width]).op("e", "Exp", ["x"]).op("n", "Neg", ["e"])
        return b.opaque("u", ["n"], [-1, width]).build("u")
    memo = {}
    for width in (64, 32):
        g = graph(width)
        order = {name: k for k, name in enumerate(g.topo_order())}
        reg = extract(g, ["e", "n"], g.consumers(), set(g.outputs), order, memo)
        assert all(n.type.shape == (-1, width) for n in reg.spec.nodes)
        assert reg.spec == extract(g, ["e", "n"], g.consumers(), set(g.outputs), order).spec
