"""A compute-bound kernel priced per op (plan/cost.py: op_cost, kernel_compute_s).

Six chained transcendentals (no layout op) are priced from the profile's per-op tables
(``kernel_op_cost`` for the generated kernel, ``tf_op_cost`` for TF's ops), and the
kernel's compute is scaled by the profile's compute factor (``kernel_compute_scale``),
not by the memory-fitted kernel factors: before, every transcendental cost one of the
profile's Exps and the whole kernel time took the memory fit (0.05-0.35 on amd-avx2), so
the chain was fused where it ran slower than TF's six ops (0.77x on the AMD machine)."""
import re

import pytest

from irbuild import G
from stitching.ir.builder import SpecBuilder
from stitching.plan import cost, profiles, search
from stitching.schedule import check as legal_check

SIX = ("Tanh", "Exp", "Sigmoid", "Erf", "Tanh", "Sigmoid")
TRIG = ("Sin", "Cos", "Sin", "Cos", "Sin", "Cos")   # ours: priced chained, ~18 Exps each
SHAPE = (64, 32, 4, 64)


def _chain(shape=SHAPE, ops=SIX):
    g = G().input("x", list(shape))
    prev = "x"
    for i, op in enumerate(ops):
        g = g.op(f"c{i}", op, [prev])
        prev = f"c{i}"
    return g.build(prev)


def _legal(spec):
    d = legal_check(spec)
    return None if d.ok else d.reason


def test_both_machine_models_carry_per_op_compute_costs(machine):
    for table in (machine.kernel_op_cost, machine.tf_op_cost):
        assert table["Exp"] == 1.0 and set(SIX) <= set(table)
        assert set(table) <= set(profiles.OP_COST_OPS)
    assert 0.05 < machine.kernel_compute_scale < 2     # a correction, not a new price


def test_a_compute_bound_chain_is_priced_from_the_per_op_tables(machine):
    g = _chain()
    c = cost.GraphCosts(g, machine, g.topo_order())
    P = frozenset(c.index[f"c{i}"] for i in range(len(SIX)))
    n = 64 * 32 * 4 * 64
    fixed = machine.launch_s + machine.task_s
    each = sum(machine.kernel_op_cost[op] for op in SIX)    # Exps per element, > the window
    assert each > cost.CHAIN_WINDOW
    # one chain fills the loop body: latency-bound, CHAIN_LATENCY x the independent price
    compute = machine.kernel_compute_scale * n * each * cost.CHAIN_LATENCY \
        / machine.transcendental_per_s
    kf = c.kernel_factor(P)
    mem = kf * 2 * n * 4 / machine.bandwidth
    assert compute > mem                                   # compute-bound
    d = c.delta(P)
    assert d.fused_s == pytest.approx(fixed + compute)
    # the memory-fitted kernel factors do not scale it
    flat = profiles.with_overrides(machine, kernel_time_scale={"transcendental": 0.05})
    assert cost.GraphCosts(g, flat, g.topo_order()).delta(P).fused_s == pytest.approx(d.fused_s)
    # TF's side: each op at TF's own cost for it
    for i, op in enumerate(SIX):
        v = c.index[f"c{i}"]
        t = max(2 * n * 4 / machine.bandwidth, n * machine.tf_op_cost[op] /
                machine.transcendental_per_s)
        assert c.unfused[v] == pytest.approx(fixed + c.scale[v] * t)
    # the latency evaluator prices the kernel alike
    b = SpecBuilder()
    v = b.input("float32", list(SHAPE))
    for op in SIX:
        v = getattr(b, op)(v)
    fused, _ = cost.spec_times(b.build([v]), machine)
    assert fused == pytest.approx(d.fused_s, rel=0.05)


def test_only_chained_transcendentals_pay_the_latency(machine):
    """Six independent ops (each reads the input: the calibration's layout) are priced
    at the sum of their per-op costs, one op alone at its own: the chain penalty is for
    evaluations that wait on each other in a long loop body."""
    n = 64 * 32 * 4 * 64
    g = G().input("x", list(SHAPE))
    for i, op in enumerate(SIX):
        g = g.op(f"c{i}", op, ["x"])
    prev = "c0"
    for i in range(1, 6):
        g = g.op(f"s{i}", "Add", [prev, f"c{i}"])
        prev = f"s{i}"
    g = g.build(prev)
    c = cost.GraphCosts(g, machine, g.topo_order())
    P = frozenset(range(len(c.chain)))
    each = sum(machine.kernel_op_cost[op] for op in SIX)
    assert c._chain(P) == pytest.approx(max(machine.kernel_op_cost[op] for op in SIX))
    assert cost.chained_evaluations(n * each, n * c._chain(P), n) == n * each
    chain = _chain()
    cc = cost.GraphCosts(chain, machine, chain.topo_order())
    assert cc._chain(frozenset(range(len(cc.chain)))) == pytest.approx(each)
    assert cost.chained_evaluations(n * 1.0, n * 1.0, n) == n           # one Exp alone
    # the latency evaluator reads the same chains from a spec
    b = SpecBuilder()
    x = b.input("float32", list(SHAPE))
    outs = [getattr(b, op)(x) for op in SIX]
    indep = cost.kernel_shape(b.build(outs))
    assert indep.transcendental_parents == ((),) * 6
    b = SpecBuilder()
    v = b.input("float32", list(SHAPE))
    for op in SIX:
        v = b.Neg(getattr(b, op)(v))          # a simple op between them keeps the chain
    assert cost.kernel_shape(b.build([v])).transcendental_parents == \
        ((), (0,), (1,), (2,), (3,), (4,))


def test_a_costlier_op_costs_more_in_the_kernel_only(machine):
    g = _chain(ops=("Exp",) * 6)
    base = cost.GraphCosts(g, machine, g.topo_order())
    P = frozenset(base.index[f"c{i}"] for i in range(6))
    dear = profiles.with_overrides(machine, kernel_op_cost=dict(machine.kernel_op_cost,
                                                                Exp=2.0))
    c = cost.GraphCosts(g, dear, g.topo_order())
    fixed = machine.launch_s + machine.task_s
    assert c.delta(P).fused_s - fixed == pytest.approx(2 * (base.delta(P).fused_s - fixed))
    assert c.unfused == base.unfused


def _plan(g, machine):
    return search.plan(g, _legal, config=search.SearchConfig(profile=machine))


def test_a_long_chain_is_cut_where_latency_would_bound_it(machine):
    """Six chained transcendentals in one kernel wait on each other (CHAIN_LATENCY): each
    model cuts the chain into kernels of two or three.  Measured on the amd-avx512 machine at
    SHAPE: three kernels of two 0.78 ms, two of three 1.03 ms, one of six 1.0-1.1 ms,
    stock TF's six ops 1.15-1.3 ms.  amd-avx2 leaves two of the six to TF, and prices
    the whole chain in one kernel slower than TF's ops (it ran 0.77x there, BENCHMARKS.md
    layout@amd_avx2, when the model priced it as independent ops)."""
    g = _chain()
    p = _plan(g, machine)
    assert len(p.regions) >= 2 and all(2 <= len(r.nodes) < 6 for r in p.regions)
    c = cost.GraphCosts(g, machine, g.topo_order())
    whole = c.delta(frozenset(range(1, 7)))
    parts = [c.delta(frozenset(c.index[n] for n in r.nodes)) for r in p.regions]
    assert sum(d.fused_s for d in parts) < whole.fused_s


def test_a_chain_our_kernels_compute_slowly_is_left_to_tf_with_the_reason(machine):
    """Sin and Cos cost ~18 Exps each in a chain in a generated kernel (latency-bound:
    their float64 reduction and polynomial), ~2-3 in TF's: the chain stays TF's (fused,
    it ran 0.44x TF's six ops on the amd-avx512 machine), and the report says the cost
    model found no gain, with the times."""
    p = _plan(_chain(ops=TRIG), machine)
    assert p.regions == [] and [n for n, _, _ in p.unfused] == [f"c{i}" for i in range(6)]
    for _, _, why in p.unfused:
        assert why.startswith("cost model predicts no gain fusing it with its "
                              "neighbours: best {"), why
        fused, unfused = (float(t) for t in re.findall(r"([0-9.]+) µs", why))
        assert fused >= unfused > 0


def test_a_profile_file_keeps_per_op_costs_and_refuses_bad_ones(tmp_path):
    cpu = profiles.get("cpu-reference")
    path = str(tmp_path / "p.json")
    prof = profiles.with_overrides(cpu, kernel_op_cost={"Exp": 1.0, "Log": 2.5},
                                   tf_op_cost={"Tanh": 0.7}, kernel_compute_scale=0.4)
    profiles.save_file(prof, path)
    got = profiles.load_file(path)
    assert (got.kernel_op_cost, got.tf_op_cost, got.kernel_compute_scale) == \
        ({"Exp": 1.0, "Log": 2.5}, {"Tanh": 0.7}, 0.4)
    for field, bad in (("kernel_op_cost", {"MatMul": 2.0}), ("tf_op_cost", {"Exp": -1}),
                       ("kernel_compute_scale", 500.0)):
        with pytest.raises(profiles.ProfileFileError, match=field):
            profiles.save_file(profiles.with_overrides(cpu, **{field: bad}), path)


def test_a_gpu_prices_a_chain_at_its_throughput(monkeypatch):
    """A GPU hides an element's latency behind other warps: no chain price there, in
    either evaluator; a CPU pays it."""
    gpu = profiles.with_overrides(profiles.get("v100"),    # compute-bound, as the CPU
                                  transcendental_per_s=1e9)
    as_cpu = profiles.get("amd-avx512")
    g = _chain()
    b = SpecBuilder()
    v = b.input("float32", list(SHAPE))
    for op in SIX:
        v = getattr(b, op)(v)
    spec = b.build([v])

    def prices():
        out = []
        for prof in (gpu, as_cpu):
            c = cost.GraphCosts(g, prof, g.topo_order())
            P = frozenset(c.index[f"c{i}"] for i in range(len(SIX)))
            out.append((c.delta(P).fused_s, cost.choose_launch(spec, prof).time_s))
        return out
    gpu_chained, cpu_chained = prices()
    monkeypatch.setattr(cost, "CHAIN_LATENCY", 1.0)
    gpu_free, cpu_free = prices()
    assert gpu_chained == pytest.approx(gpu_free)
    assert cpu_chained[0] > cpu_free[0] and cpu_chained[1] > cpu_free[1]
