"""Search planner on tiny hand-built IR graphs: expected plans, cycles, reasons (TF-free)."""
import re

import networkx as nx
import pytest

from irbuild import F, G, allow_all, encoder, layernorm, ln_chain, regions, wide
from stitching.ir import ValueRef
from stitching.plan import (ALIASES, PLANNERS, baseline, cost, get_planner, planner,
                            profiles, search)
from stitching.plan.acyclic import Contraction, CycleError, Reach, mask_of
from stitching.plan.cost import Launch

CPU = search.SearchConfig(profile=profiles.get("cpu-reference"))
V100 = search.SearchConfig(profile=profiles.get("v100"))


def plan(g, legal=allow_all, config=CPU, min_ops=2):
    return search.plan(g, legal, min_ops, config)


def quotient_is_acyclic(g, p) -> bool:
    """Independent oracle: contract every region with networkx and look for a cycle."""
    kernel = {n: f"k{i}" for i, r in enumerate(p.regions) for n in r.nodes}
    q = nx.DiGraph()
    for n in g:
        q.add_node(kernel.get(n.name, n.name))
        for pred in g.predecessors(n.name):
            a, b = kernel.get(pred, pred), kernel.get(n.name, n.name)
            if a != b:
                q.add_edge(a, b)
    return nx.is_directed_acyclic_graph(q)


# ---- expected plans ------------------------------------------------------------------

def test_layernorm_with_its_fetched_output_is_one_kernel():
    g = layernorm(G().input("x", [-1, 64])).op("out", "Identity", ["y"]).build("out")
    (r,) = plan(g).regions
    assert sorted(r.nodes) == sorted(["mean", "d", "sq", "var", "ve", "inv", "y", "out"])
    assert len(r.spec.inputs) == 1 and [n.op for n in r.spec.nodes].count("Const") == 1


def test_diamond_is_one_kernel():
    g = (G().input("x", [64, 256]).op("a", "Exp", ["x"]).op("b", "Neg", ["a"])
         .op("c", "Abs", ["a"]).op("d", "Add", ["b", "c"]).opaque("m", ["d"], [64, 256])
         .build("m"))
    assert regions(plan(g)) == [["a", "b", "c", "d"]]


def test_shared_producer_with_two_consumers_outside_is_a_multi_output_kernel():
    g = (G().input("x", [64, 256]).op("a", "Exp", ["x"]).op("b", "Neg", ["a"])
         .opaque("m1", ["a"], [64, 256]).opaque("m2", ["b"], [64, 256]).build("m1", "m2"))
    (r,) = plan(g).regions
    assert [str(o) for o in r.outputs] == ["a", "b"] and len(r.spec.outputs) == 2


def test_producers_from_different_inputs_join_their_consumer():
    # d = exp(x) + exp(y): the consumers-first DP grows from one root; the merge phase
    # stitches the other producer in.
    g = (G().input("x", [64, 256]).input("y", [64, 256]).op("b", "Exp", ["x"])
         .op("c", "Exp", ["y"]).op("d", "Add", ["b", "c"]).opaque("m", ["d"], [64, 256])
         .build("m"))
    assert regions(plan(g)) == [["b", "c", "d"]]


def test_candidate_that_would_create_a_cycle_is_refused():
    g = (G().input("x", [64, 256]).op("a", "Exp", ["x"]).op("a2", "Neg", ["a"])
         .opaque("m", ["a2"], [64, 256]).op("d", "Add", ["a2", "m"]).op("e", "Tanh", ["d"])
         .opaque("out", ["e"], [64, 256]).build("out"))
    p = plan(g)
    assert regions(p) == [["a", "a2"], ["d", "e"]]
    assert any("cycle" in why for _, why in p.boundaries)


def test_an_input_read_only_as_an_attribute_still_orders_the_graph():
    """A Reshape's target (an attribute in the IR) computed from a2: m runs after a2 in
    TF, so {a, a2, d, e} as one kernel would be a cycle (a Transformer's Tensordot
    shape arithmetic did this once).  The front end records the edge in order_inputs."""
    g = (G().input("x", [64, 256]).op("a", "Exp", ["x"]).op("a2", "Neg", ["a"])
         .opaque("m", ["x"], [64, 256]).op("d", "Add", ["a2", "m"]).op("e", "Tanh", ["d"])
         .opaque("out", ["e"], [64, 256]).build("out"))
    assert regions(plan(g)) == [["a", "a2", "d", "e"]]      # without the edge: one kernel
    g["m"].order_inputs = ["a2"]
    p = plan(g)
    assert regions(p) == [["a", "a2"], ["d", "e"]] and quotient_is_acyclic(g, p)


def test_two_convex_patterns_that_feed_each_other_never_both_become_kernels():
    # P1 = {a1, a2, j}, P2 = {b1, b2, k}: each convex, but a1 -> m1 -> b1 and
    # b2 -> m2 -> a2 make P1 and P2 feed each other through the opaque ops.
    g = (G().input("x", [64, 256]).input("y", [64, 256])
         .op("a1", "Exp", ["x"]).op("b2", "Exp", ["y"])
         .opaque("m1", ["a1"], [64, 256]).opaque("m2", ["b2"], [64, 256])
         .op("b1", "Neg", ["m1"]).op("a2", "Neg", ["m2"])
         .op("j", "Add", ["a1", "a2"]).op("k", "Add", ["b1", "b2"])
         .opaque("o1", ["j"], [64, 256]).opaque("o2", ["k"], [64, 256]).build("o1", "o2"))
    p = plan(g)
    assert quotient_is_acyclic(g, p)
    assert p.regions and any("cycle" in why for _, why in p.boundaries)


def test_independent_branches_reading_one_input_are_packed_into_one_kernel():
    b = G().input("x", [64, 256])
    for i in (1, 2):
        b.op(f"e{i}", "Exp", ["x"]).op(f"n{i}", "Neg", [f"e{i}"])
        b.opaque(f"m{i}", [f"n{i}"], [64, 256])
    p = plan(b.build("m1", "m2"))
    assert regions(p) == [["e1", "e2", "n1", "n2"]]
    (choice,) = p.alternatives
    assert any(k == "remote" and o == "merged" for k, _, _, o in choice.alternatives)


def test_dependent_branches_are_not_packed():
    g = (G().input("x", [64, 256]).op("e1", "Exp", ["x"]).op("n1", "Neg", ["e1"])
         .opaque("m1", ["n1"], [64, 256]).op("e2", "Exp", ["m1"]).op("n2", "Neg", ["e2"])
         .opaque("m2", ["n2"], [64, 256]).build("m2"))
    assert regions(plan(g)) == [["e1", "n1"], ["e2", "n2"]]


def test_a_view_joins_the_kernel_that_reads_it():
    # gamma's Reshape costs nothing in TF; it should not stay outside as a boundary
    g = (G().input("x", [64, 256]).input("gamma", [256])
         .op("gr", "Reshape", ["gamma"], shape=[1, 256]).op("a", "Exp", ["x"])
         .op("b", "Mul", ["a", "gr"]).opaque("m", ["b"], [64, 256]).build("m"))
    assert regions(plan(g)) == [["a", "b", "gr"]]


def test_identical_blocks_give_identical_specs(monkeypatch):
    """Identical blocks are planned alike.  With each block's Tanh -> Exp -> Sigmoid
    chain priced as independent evaluations, a block is one kernel; priced at its
    latency (cost.CHAIN_LATENCY, the default), cutting it before the Sigmoid gains
    more, which the beam, deciding the whole block's vertex first, found for only one
    of three blocks until search._split_where_it_pays looked again."""
    p = plan(ln_chain(3, shape=(256, 512)))
    assert len(p.regions) == 6 and len({r.spec.hash for r in p.regions}) == 2
    assert [sorted(r.nodes) for r in p.regions if "m0" in r.nodes or "k0" in r.nodes] \
        == [["m0", "q0", "r0", "s0", "t0", "u0", "v0", "w0", "y0", "z0"], ["k0", "l0"]]
    monkeypatch.setattr(cost, "CHAIN_LATENCY", 1.0)
    p = plan(ln_chain(3, shape=(256, 512)))
    assert len(p.regions) == 3 and len({r.spec.hash for r in p.regions}) == 1
    assert all(r.spec.schedule for r in p.regions)         # static rows: launch chosen



def test_a_split_whose_parts_would_wait_on_each_other_is_not_taken():
    """search._split_where_it_pays keeps a pattern whole where its pieces would wait on
    each other: in the chain 0 -> 1 -> 2 -> 3, pieces {0, 3} and {1, 2} would (0 feeds
    1, 2 feeds 3); {0, 1} and {2, 3} would not."""
    from types import SimpleNamespace
    ctx = SimpleNamespace(succ=[[1], [2], [3], []])
    assert not search._parts_acyclic(ctx, [frozenset({0, 3}), frozenset({1, 2})])
    assert search._parts_acyclic(ctx, [frozenset({0, 1}), frozenset({2, 3})])

# ---- legality and its reasons --------------------------------------------------------

def test_an_op_illegal_even_alone_is_left_with_the_legality_reason():
    def no_reductions(spec):
        return "no reductions in this test" if any(
            n.op == "Mean" for n in spec.nodes) else None
    g = layernorm(G().input("x", [-1, 64])).op("out", "Identity", ["y"]).build("out")
    p = plan(g, no_reductions)
    assert ("mean", "Mean", "no reductions in this test") in p.unfused
    assert ("var", "Mean", "no reductions in this test") in p.unfused
    assert p.regions and all("Mean" not in [n.op for n in r.spec.nodes] for r in p.regions)
    assert quotient_is_acyclic(g, p)


def test_an_op_no_legal_kernel_can_take_says_why_not_a_cost():
    """Regression: a Sum over every axis beside a softmax's row reductions was reported
    "left out by the cost model" with the predicted times of a kernel that could never
    be built (one kernel handles one reduction shape); the reason is that legality
    verdict now."""
    g = (G().input("x", [16, 128]).op("r", "Max", ["x"], axes=[1], keep_dims=True)
         .op("d", "Sub", ["x", "r"]).op("e", "Exp", ["d"])
         .op("s", "Sum", ["x"], axes=[0, 1], keep_dims=False)
         .op("o", "Add", ["e", "s"]).opaque("m", ["o"], [16, 128]).build("m"))
    from stitching.schedule import check
    p = plan(g, legal=lambda s: check(s).reason)
    ((node, op, why),) = [u for u in p.unfused if u[0] == "s"]
    assert why.startswith("cannot join its neighbours: "), why
    assert "reduce different axes" in why and "µs" not in why


def test_an_op_whose_kernel_would_do_too_little_work_says_min_ops():
    """Regression: a bias add after a product, with only an Identity beside it, was
    reported "left out by the cost model: ... overlaps kernels that save more without
    it" in a plan with no kernel at all; min_ops is the reason, and min_ops=1 fuses it."""
    g = (G().input("x", [8, 64]).opaque("mm", ["x"], [8, 64]).input("b", [64])
         .op("add", "Add", ["mm", "b"]).op("out", "Identity", ["add"]).build("out"))
    p = plan(g)
    assert not p.regions
    ((node, op, why),) = p.unfused
    assert node == "add" and why.startswith("too little work for a kernel: "), why
    assert "min_ops=2" in why and "overlaps" not in why
    assert regions(plan(g, min_ops=1)) == [["add", "out"]]


def test_ops_of_two_devices_never_share_a_kernel():
    """A kernel node runs on one device: under tf.distribute each replica's ops name
    their own (tf/frontend.py records it), and a kernel mixing two replicas' work can
    wait on a collective that waits for it (tests/test_distribute.py)."""
    from stitching.plan.legality import DEVICE_ATTR
    g = (G().input("x", [64, 256]).op("a", "Exp", ["x"], **{DEVICE_ATTR: "/cpu:0"})
         .op("b", "Neg", ["a"], **{DEVICE_ATTR: "/cpu:0"})
         .op("c", "Tanh", ["b"], **{DEVICE_ATTR: "/cpu:1"})
         .op("d", "Neg", ["c"], **{DEVICE_ATTR: "/cpu:1"})
         .opaque("m", ["d"], [64, 256]).build("m"))
    assert regions(plan(g)) == [["a", "b"], ["c", "d"]]
    assert all(DEVICE_ATTR not in str(r.spec.to_json()) for r in plan(g).regions)
    # one device however spelled, and ops TF places itself (no device), go together
    same = (G().input("x", [64, 256]).op("a", "Exp", ["x"], **{DEVICE_ATTR: "/cpu:0"})
            .op("b", "Neg", ["a"])
            .op("c", "Tanh", ["b"], **{DEVICE_ATTR: "/job:localhost/replica:0/task:0/"
                                                   "device:CPU:0"})
            .opaque("m", ["c"], [64, 256]).build("m"))
    assert regions(plan(same)) == [["a", "b", "c"]]


def test_a_refused_kernel_falls_back_to_smaller_legal_ones():
    def small(spec):
        return "more than 4 ops in one kernel" if len(spec.nodes) > 4 else None
    g = ln_chain(1, shape=(256, 512))
    p = plan(g, small)
    assert len(p.regions) >= 2 and all(len(r.spec.nodes) <= 4 for r in p.regions)
    assert ("m0", "more than 4 ops in one kernel") in p.boundaries
    assert quotient_is_acyclic(g, p)


def test_only_the_first_output_of_a_fused_node_may_leave_a_kernel():
    from stitching.ir import Node, TensorType
    b = G().input("x", [64, 256])
    b.g.add(Node("bn", "FusedBatchNorm", [ValueRef("x")] * 5,
                 {"epsilon": 1e-3, "data_format": "NHWC"},
                 [TensorType(F, (64, 256)), TensorType(F, (256,))]))
    b.op("r", "Relu", ["bn"]).opaque("m", ["r"], [64, 256])
    b.g.add(Node("s", "MatMul", [ValueRef("bn", 1)], {}, [TensorType(F, (256,))]))
    g = b.build("m", "s")
    p = plan(g)
    assert all("bn" not in r.nodes for r in p.regions)


# ---- cost-driven decisions -----------------------------------------------------------

def test_lost_parallelism_keeps_a_two_row_reduction_out_of_its_consumers_kernel():
    # two rows on 80 SMs: the stitched kernel would run on two blocks; on 2 cores it's fine
    g = (G().input("x", [2, 1 << 20]).op("m", "Mean", ["x"], axes=[1], keep_dims=True)
         .op("d", "Sub", ["x", "m"]).op("e", "Exp", ["d"]).opaque("o", ["e"], [2, 1 << 20])
         .build("o"))
    assert not any({"m", "d"} <= set(r.nodes) for r in plan(g, config=V100).regions)
    assert any({"m", "d"} <= set(r.nodes) for r in plan(g, config=CPU).regions)


def test_a_kernel_the_latency_evaluator_finds_slower_is_left_alone(monkeypatch):
    def slow(spec, profile, keep=5, factor=1.0):
        return Launch({"rows_per_task": 1, "col_block": 8}, 1, 1.0, 1,
                      (({"rows_per_task": 1, "col_block": 8}, 1, 1.0),))
    monkeypatch.setattr(search, "choose_launch", slow)
    g = (G().input("x", [4, 8]).op("a", "Exp", ["x"]).op("b", "Neg", ["a"])
         .opaque("m", ["b"], [4, 8]).build("m"))
    p = plan(g)
    assert p.regions == [] and p.skipped == [(["a", "b"], p.unfused[0][2])]
    assert p.unfused[0][2].startswith("cost model predicts no gain: fused 1000000.0 µs")
    assert p.notes == ["function left alone: the cost model predicts no kernel pays"]
    assert p.alternatives[0].deployed is False


def test_an_op_the_cost_model_keeps_out_says_so_with_its_predicted_times():
    """Regression: an op the cost model kept out of its neighbours' kernel was reported
    as "a lone op: fusing it alone saves nothing"; the reason now names the cost model
    and the predicted times of the best pattern with it.  An op with no fusible
    neighbour keeps the lone-op reason."""
    g = (G().input("x", [2, 1 << 20]).op("m", "Mean", ["x"], axes=[1], keep_dims=True)
         .op("d", "Sub", ["x", "m"]).op("e", "Exp", ["d"]).opaque("o", ["e"], [2, 1 << 20])
         .build("o"))
    p = plan(g, config=V100)           # two rows on 80 SMs: fusing the Mean loses lanes
    assert regions(p) == [["d", "e"]]
    ((node, op, why),) = p.unfused
    assert (node, op) == ("m", "Mean")
    assert why.startswith("cost model predicts no gain fusing it with its neighbours: "
                          "best {m, d, e} predicted ")
    fused, unfused = (float(t) for t in re.findall(r"([0-9.]+) µs", why))
    assert fused > unfused > 0
    lone = (G().input("x", [2, 1 << 20]).op("m", "Mean", ["x"], axes=[1], keep_dims=True)
            .opaque("o", ["m"], [2, 1]).build("o"))
    assert plan(lone, config=V100).unfused == [("m", "Mean", search.LONE_OP)]


def test_min_ops_one_keeps_lone_ops_the_model_cannot_justify():
    g = G().input("x", [4, 8]).op("a", "Exp", ["x"]).opaque("m", ["a"], [4, 8]).build("m")
    assert plan(g).regions == []
    assert regions(plan(g, min_ops=1)) == [["a"]]


# ---- explain -------------------------------------------------------------------------

def test_every_kernel_explains_its_alternatives_and_scores():
    from stitching.report import Report
    g = layernorm(G().input("x", [256, 512])).op("out", "Identity", ["y"]).build("out")
    p = plan(g)
    (choice,) = p.alternatives
    d = choice.to_dict()
    assert d["deployed"] and d["fused_us"] < d["unfused_us"]
    kinds = {a["kind"] for a in d["alternatives"]}
    assert {"pattern", "launch"} <= kinds
    assert any(a["outcome"] == "chosen by the beam search" for a in d["alternatives"])
    text = Report(function="f", explanation=[dict(d, kernel="k0")]).explain()
    assert "k0: 8 nodes" in text and "launch" in text and "gain" in text


# ---- planners side by side -----------------------------------------------------------

def test_planner_names_and_options():
    import stitching.options as opts
    assert PLANNERS == ("baseline", "greedy", "search") and ALIASES["full"] == "search"
    assert get_planner("greedy") is planner.plan and get_planner("full") is search.plan
    assert opts.Options().planner == "search"
    with pytest.raises(ValueError, match="baseline"):
        opts.Options(planner="xla")


def test_baseline_ends_every_kernel_at_a_reduction():
    g = layernorm(G().input("x", [256, 512])).op("out", "Identity", ["y"]).build("out")
    p = baseline.plan(g, allow_all)
    for r in p.regions:
        assert baseline.xla_rule(r.spec) is None
    assert len(p.regions) > len(plan(g).regions) == 1


@pytest.mark.parametrize("make", [lambda: ln_chain(20), lambda: encoder(4),
                                  lambda: wide(40)])
def test_search_is_never_worse_than_greedy(make):
    g = make()
    s, gr = plan(g), planner.plan(g, allow_all)
    fused = lambda p: sum(len(r.nodes) for r in p.regions)  # noqa: E731
    assert len(s.regions) <= len(gr.regions) and fused(s) >= fused(gr)
    assert quotient_is_acyclic(g, s)


def test_plans_are_deterministic():
    g = encoder(2)
    assert [r.nodes for r in plan(g).regions] == [r.nodes for r in plan(g).regions]


def test_two_thousand_node_graph_plans_one_kernel_per_block():
    g = ln_chain(154)
    assert len(g) > 2000
    assert len(plan(g).regions) == 154


# ---- cycle-freedom by reachability bitsets --------------------------------------------

def test_reach_and_contraction_agree_with_paths():
    # 0 -> 1 -> 3, 0 -> 2 -> 3, 4 -> 5
    succ = [(1, 2), (3,), (3,), (), (5,), ()]
    r = Reach(succ)
    assert r.convex({0, 1, 2, 3}, mask_of({0, 1, 2, 3}))
    assert not r.convex({0, 3}, mask_of({0, 3}))            # 0 -> 1 -> 3 leaves and returns
    c = Contraction(succ, [frozenset({1})])
    g1 = c.group_of[1]
    assert c.would_cycle((0, 3)) and not c.would_cycle((0, g1))
    assert not c.related(0, 4)
    m = c.merge((0, 4))
    assert c.related(m, 3) and c.would_cycle((m, 3)) is True
    assert c.related(m, 5)


def test_contracting_groups_that_feed_each_other_raises():
    succ = [(2,), (3,), (), ()]          # 0 -> 2 and 1 -> 3; groups {0, 3} and {1, 2}
    with pytest.raises(CycleError):
        Contraction(succ, [frozenset({0, 3}), frozenset({1, 2})])
    Contraction(succ, [frozenset({0, 1}), frozenset({2, 3})])      # fine


# ---- through the pipeline (TensorFlow) -------------------------------------------------

def test_options_planner_ablation_end_to_end():
    tf = pytest.importorskip("tensorflow")
    import numpy as np

    import stitching

    def fn(x, g):
        m = tf.reduce_mean(x, axis=-1, keepdims=True)
        v = tf.reduce_mean(tf.square(x - m), axis=-1, keepdims=True)
        return tf.nn.softmax((x - m) * tf.math.rsqrt(v + 1e-5) * g)

    sig = [tf.TensorSpec([64, 256], tf.float32), tf.TensorSpec([256], tf.float32)]
    rng = np.random.default_rng(0)
    x, g = rng.standard_normal((64, 256), np.float32), rng.standard_normal(256, np.float32)
    ref = tf.function(fn, input_signature=sig)(x, g).numpy()
    kernels = {}
    for name in ("baseline", "greedy", "search"):
        f = stitching.function(fn, input_signature=sig,
                               options=stitching.Options(planner=name))
        np.testing.assert_allclose(f(x, g).numpy(), ref, rtol=1e-5, atol=1e-6)
        kernels[name] = len(f.report.kernels)
        if name == "search":
            text = f.report.explain()
            assert f.report.kernels[0].name in text and "launch:" in text
            assert f.report.to_dict()["explanation"][0]["deployed"]
    assert kernels["search"] == kernels["greedy"] == 1 < kernels["baseline"]


def _update_chains(shapes):
    """Per variable: its gradient (an opaque op), lr * g, m - lr * g, then an assign
    (opaque): an optimizer's updates, each below a different matmul."""
    b = G().input("lr", [])
    for i, s in enumerate(shapes):
        b.input(f"x{i}", list(s)).input(f"m{i}", list(s)).opaque(f"g{i}", [f"x{i}"], list(s))
        b.op(f"a{i}", "Mul", [f"g{i}", "lr"]).op(f"u{i}", "Sub", [f"m{i}", f"a{i}"])
        b.opaque(f"w{i}", [f"u{i}"], list(s))
    return b.build(*[f"w{i}" for i in range(len(shapes))])


def test_small_update_chains_of_different_shapes_pack_and_large_ones_stay_apart():
    """Packing saves a dispatch but makes each chain wait for the other's gradient
    (search._Merger.overlap_penalty): small chains of different shapes become one packed
    kernel (schedule/packed.py), chains whose work exceeds a dispatch keep their own;
    the plan stays acyclic either way."""
    from stitching.schedule import KernelKind, build_schedule, check
    g = _update_chains([(32,), (64,), (3, 40), (10,)])
    p = plan(g, legal=lambda s: check(s).reason)
    assert regions(p) == [sorted(f"{op}{i}" for i in range(4) for op in "au")]
    assert build_schedule(p.regions[0].spec).kind == KernelKind.PACKED
    assert quotient_is_acyclic(g, p)
    g = _update_chains([(512, 512), (256, 512)])
    p = plan(g, legal=lambda s: check(s).reason)
    assert regions(p) == [["a0", "u0"], ["a1", "u1"]]


def test_a_stored_plan_is_not_trusted_where_nodes_no_longer_fuse_or_kernels_would_cycle(
        tmp_path, monkeypatch):
    """plan/cache.py rebuilds a stored plan against the current IR: a member the front
    end now marks unfusible, or kernels that would feed each other, make it plan
    afresh (load returns None) instead of rewriting a wrong graph."""
    from stitching.plan import cache
    monkeypatch.setattr(cache, "_path", lambda key: tmp_path / f"{key}.json")

    def graph():
        return (G().input("x", [64, 256]).op("a", "Exp", ["x"]).op("a2", "Neg", ["a"])
                .opaque("m", ["x"], [64, 256]).op("d", "Add", ["a2", "m"])
                .op("e", "Tanh", ["d"]).opaque("out", ["e"], [64, 256]).build("out"))
    g = graph()
    p = plan(g)
    cache.save("k", p)
    assert regions(cache.load("k", graph(), allow_all)) == regions(p)
    g2 = graph()
    g2["a2"].attrs["unfusible"] = "shape arithmetic"
    assert cache.load("k", g2, allow_all) is None
    g3 = graph()
    g3["m"].order_inputs = ["a2"]            # {a, a2, d, e} would now be a cycle
    assert cache.load("k", g3, allow_all) is None


def _sibling_chains(ops, shape=(512, 512)):
    """Two products of one input x (attention's K and V projections) and one of
    another input y, each followed by a chain of ``ops`` and another product."""
    b = G().input("x", list(shape)).input("y", list(shape))
    for p, src in (("k", "x"), ("v", "x"), ("g", "y")):
        b.opaque(f"{p}m", [src], list(shape))
        prev = f"{p}m"
        for i, op in enumerate(ops):
            b.op(f"{p}{i}", op, [prev])
            prev = f"{p}{i}"
        b.opaque(f"{p}out", [prev], list(shape))
    return b.build("kout", "vout", "gout")


def test_chains_below_sibling_products_pack_despite_the_overlap_penalty():
    """Kernels below products of one input start together (search._Merger._siblings):
    they pack however large (grouped-query attention's K and V head transposes); the
    chain below a product of another input waits for other work and keeps its kernel.
    Lone ops keep the penalty: left alone, TF may run them inside the product."""
    from stitching.schedule import check
    p = plan(_sibling_chains(["Exp", "Neg"]), legal=lambda s: check(s).reason)
    assert sorted(regions(p)) == [["g0", "g1"], ["k0", "k1", "v0", "v1"]]
    p = plan(_sibling_chains(["Exp"]), legal=lambda s: check(s).reason)
    assert all(len(r) == 1 for r in regions(p)), regions(p)


def test_patterns_with_is_the_walk_over_the_candidates_and_follows_a_new_dp():
    # _cost_reason's index of the DP's candidates by node: the same patterns, in the
    # order a walk of C meets them (a set built from them iterates alike), rebuilt when
    # the DP reruns (a new C)
    from stitching.plan.search import SearchConfig, _candidates, _Context
    ctx = _Context(encoder(2), allow_all, SearchConfig())
    ctx.C = _candidates(ctx)
    for v in range(len(ctx.names)):
        walk = [P for C in ctx.C.values() for P in C if v in P and len(P) > 1]
        assert ctx.patterns_with(v) == walk
        assert list(set(ctx.patterns_with(v))) == list(set(walk))
    v = max(ctx.C, key=lambda u: len(ctx.C[u]))
    ctx.C = {v: [frozenset((v, v + 1))]}
    assert ctx.patterns_with(v) == [frozenset((v, v + 1))]
    assert ctx.patterns_with(v + 2) == []


def test_structural_refusals_and_chains_match_their_plain_definitions():
    # clash (with its quick reject of patterns that touch no window), side_reason (over
    # the nodes with side readers only) and GraphCosts._chain (its max unrolled) give
    # what their plain definitions give, for every small pattern of a graph with a
    # depthwise window, a node read past its first output, a reduction and
    # transcendentals in chains
    import itertools
    from stitching.ir import Node, TensorType
    from stitching.plan.search import SearchConfig, _Context
    t = TensorType(F, (1, 8, 8, 4))
    b = (G().input("x", [1, 8, 8, 4]).input("f", [3, 3, 4, 1])
         .op("e", "Exp", ["x"]).op("dw", "DepthwiseConv2D", ["e", "f"], strides=[1, 1],
                                           pads=[1, 1, 1, 1])
         .op("t", "Tanh", ["dw"]).op("m", "Mean", ["t"], axes=[3], keep_dims=True)
         .op("s", "Sigmoid", ["m"]).op("y", "Mul", ["t", "s"]))
    b.g.add(Node("two", "Exp", [ValueRef("y")], {}, [t, t]))       # a second output
    b.g.add(Node("side", "Neg", [ValueRef("two", 1)], {}, [t]))
    b.op("u", "Tanh", ["two"]).op("v", "Add", ["u", "side"])
    g = b.opaque("o", ["v"], [1, 8, 8, 4]).build("o")
    ctx = _Context(g, allow_all, SearchConfig())
    assert ctx.windows and ctx.side_users

    def clash(P):
        m = ctx.mask(P)
        if m & ctx.products and m & ctx.reductions:
            return "product"
        return "window" if any(m & w == w for w in ctx.windows) else None

    def side(P):
        return any(u not in P for v in P for u in ctx.side_users.get(v, ()))

    def chain(P):
        path = {}
        for v in sorted(P):
            up = max((path[u] for _, _, u in ctx.costs.ins[v] if u in path), default=0.0)
            path[v] = up + ctx.costs.chain[v]
        return max(path.values(), default=0.0)
    nodes = [ctx.order[n] for n in g.topo_order() if g[n].op not in ("Placeholder", "MatMul")]
    seen = {"window": 0, "side": 0, "chain": 0}
    for r in (1, 2, 3, 4):
        for P in map(frozenset, itertools.combinations(nodes, r)):
            want = clash(P)
            assert (ctx.clash(P) is None) == (want is None)
            seen["window"] += want == "window"
            assert (ctx.side_reason(P) is not None) == side(P)
            seen["side"] += side(P)
            assert ctx.costs._chain(P) == chain(P)
            seen["chain"] += chain(P) > max(ctx.costs.chain[v] for v in P)
    assert all(seen.values()), seen
