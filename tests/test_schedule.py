"""Schedule stage: domain unification/collapse, kernel kinds, passes, placements,
refusals with reasons.  Pure Python: no compilation, no TensorFlow."""
import pytest

from stitching.ir import KernelSpec
from stitching.ir.builder import SpecBuilder
from stitching.ir.spec import SpecError
from stitching.schedule import (KernelKind, Placement, ScheduleError, build_schedule,
                                check)


# ---- tiny pattern builders ----------------------------------------------------------

def layernorm(d=768, rows=-1):
    b = SpecBuilder()
    x = b.input("float32", (rows, d))
    g = b.input("float32", (d,))
    be = b.input("float32", (d,))
    m = b.Mean(x, axes=[1], keep_dims=True)
    c = b.Sub(x, m)
    v = b.Mean(b.Square(c), axes=[1], keep_dims=True)
    r = b.Rsqrt(b.Add(v, b.const(1e-5)))
    y = b.Add(b.Mul(b.Mul(c, r), g), be)
    return b, y, dict(x=x, m=m, c=c, v=v, r=r)


def softmax(shape=(-1, 128)):
    b = SpecBuilder()
    x = b.input("float32", shape)
    ax = len(shape) - 1
    m = b.Max(x, axes=[ax], keep_dims=True)
    e = b.Exp(b.Sub(x, m))
    s = b.Sum(e, axes=[ax], keep_dims=True)
    return b.build([b.Div(e, s)]), e


def sched_of(b, outs, **kw):
    return build_schedule(b.build(outs, **kw))


# ---- kinds ---------------------------------------------------------------------------

def test_elementwise_bias_gelu_is_one_pass():
    b = SpecBuilder()
    x = b.input("float32", (-1, 512))
    bias = b.input("float32", (512,))
    h = b.Add(x, bias)
    y = b.Mul(h, b.Sigmoid(h))
    s = sched_of(b, [y])
    assert s.kind == KernelKind.ELEMENTWISE
    assert len(s.passes) == 1 and s.scalars == ()
    assert s.rank == 2
    assert s.carries(-2) == (1,)          # bias broadcasts along rows (stride 0)
    assert {e.placement for e in s.edges} <= {Placement.LOAD, Placement.REGISTER}


def test_layernorm_is_one_row_kernel_with_recompute():
    b, y, n = layernorm()
    s = sched_of(b, [y])
    assert s.kind == KernelKind.ROW
    assert s.reduce_axes == (1,)
    assert len(s.passes) == 3              # mean | variance | normalize
    assert s.scratch == ()                 # x - mean is cheap: recomputed
    assert s.placement(n["c"], y - 2) == Placement.RECOMPUTE
    assert n["c"] in s.passes[2].recomputed
    assert s.placement(n["m"], n["c"]) == Placement.ROW_SCALAR
    assert s.placement(n["x"], n["m"]) == Placement.LOAD
    assert [p.accumulate for p in s.passes[:2]] == [(n["m"],), (n["v"],)]


def test_softmax_keeps_exp_in_scratch():
    spec, e = softmax()
    s = build_schedule(spec)
    assert s.kind == KernelKind.ROW and len(s.passes) == 3
    assert s.scratch == (e,)
    assert s.passes[1].scratch_stores == (e,)
    assert s.passes[2].scratch_loads == (e,)
    assert s.placement(e, e + 2) == Placement.SCRATCH


def test_scratch_param_forces_recompute_and_budget():
    spec, e = softmax()
    s = build_schedule(spec.with_schedule(scratch=0))
    assert s.scratch == () and e in s.passes[2].recomputed
    # a static row too long for the scratch budget falls back to recompute, with a note
    big, e2 = softmax((-1, 1 << 20))
    s2 = build_schedule(big)
    assert s2.scratch == () and any("scratch budget" in n for n in s2.notes)


def test_rmsnorm_and_log_softmax_are_row_kernels():
    b = SpecBuilder()
    x = b.input("float32", (-1, 4096))
    g = b.input("float32", (4096,))
    ms = b.Mean(b.Square(x), axes=[1], keep_dims=True)
    y = b.Mul(b.Mul(x, b.Rsqrt(b.Add(ms, b.const(1e-6)))), g)
    assert sched_of(b, [y]).kind == KernelKind.ROW
    b = SpecBuilder()
    x = b.input("float32", (-1, 1000))
    m = b.Max(x, axes=[1], keep_dims=True)
    sh = b.Sub(x, m)
    lse = b.Log(b.Sum(b.Exp(sh), axes=[1], keep_dims=True))
    s = sched_of(b, [b.Sub(sh, lse)])
    assert s.kind == KernelKind.ROW and len(s.passes) == 3


def test_mean_and_variance_share_one_pass_when_independent():
    b = SpecBuilder()
    x = b.input("float32", (-1, 64))
    s1 = b.Sum(x, axes=[1])
    s2 = b.Sum(b.Square(x), axes=[1])
    mx = b.Max(x, axes=[1])
    s = sched_of(b, [s1, s2, mx])
    assert s.kind == KernelKind.ROW and len(s.passes) == 1
    assert set(s.passes[0].accumulate) == {s1, s2, mx}


def test_column_reduction_with_consumer():
    b = SpecBuilder()
    x = b.input("float32", (-1, 300))
    m = b.Mean(x, axes=[0], keep_dims=True)
    y = b.Sub(x, m)
    s = sched_of(b, [y, m])
    assert s.kind == KernelKind.COLUMN
    assert s.reduce_axes == (0,)
    assert s.placement(m, y) == Placement.COLUMN_BLOCK
    assert m in s.blocks and len(s.passes) == 2


def test_nhwc_global_pool_collapses_hw():
    b = SpecBuilder()
    x = b.input("float32", (-1, 7, 7, 64))
    m = b.Mean(x, axes=[1, 2])
    s = sched_of(b, [m])
    assert s.kind == KernelKind.COLUMN
    assert [a.size for a in s.domain.axes] == [-1, 49, 64]
    assert s.reduce_axes == (1,)


def test_collapse_merges_axes_carried_together():
    b = SpecBuilder()
    x = b.input("float32", (-1, 8, 16, 32))
    y = b.input("float32", (-1, 8, 16, 32))
    s = sched_of(b, [b.Add(x, y)])
    assert s.rank == 1 and s.domain.axes[0].size == -1
    # a bias over the last dim keeps that axis apart; the rest collapse
    b = SpecBuilder()
    x = b.input("float32", (-1, 8, 16, 32))
    c = b.input("float32", (32,))
    s = sched_of(b, [b.Add(x, c)])
    assert s.rank == 2 and s.domain.axes[1].size == 32
    # a per-(batch, channel) scale: [N,1,1,C] keeps three axes (N, H*W, C)
    b = SpecBuilder()
    x = b.input("float32", (-1, 8, 16, 32))
    sc = b.input("float32", (-1, 1, 1, 32))
    s = sched_of(b, [b.Mul(x, sc)])
    assert [a.size for a in s.domain.axes] == [-1, 128, 32]
    assert s.carries(-2) == (0, 2)


def test_reshape_of_size_one_dims_and_static_pins():
    b = SpecBuilder()
    x = b.input("float32", (-1, 1, 64))
    r = b.Reshape(x, shape=[-1, 64])
    s = b.Sum(r, axes=[1], keep_dims=True)
    sch = sched_of(b, [b.Mul(r, s)])
    assert sch.kind == KernelKind.ROW and sch.rank == 2
    # unknown dim pinned to 1 by a node's claimed shape: degenerate class, checked
    b = SpecBuilder()
    x = b.input("float32", (-1, 5))
    y = b.Neg(x, out_shape=(1, 5))
    sch = sched_of(b, [y])
    cls = sch.domain.classes[sch.domain.value_dims[-1][0]]
    assert cls.size == 1 and cls.input_dims == ((0, 0),)


def test_full_reduction_to_scalar_is_a_single_row():
    b = SpecBuilder()
    x = b.input("float32", (8, 16, 32))
    s = sched_of(b, [b.Sum(x, axes=[0, 1, 2])])
    assert s.kind == KernelKind.ROW and s.rank == 1 and s.domain.axes[0].size == 4096


def test_reduction_over_size_one_axis_is_elementwise():
    b = SpecBuilder()
    x = b.input("float32", (-1, 1, 8))
    s = sched_of(b, [b.Sum(x, axes=[1])])
    assert s.kind == KernelKind.ELEMENTWISE


def test_dead_nodes_are_ignored():
    b = SpecBuilder()
    x = b.input("float32", (4, 8))
    b.Sum(x, axes=[0])                       # dead: would be a column reduction
    y = b.Exp(x)
    s = sched_of(b, [y])
    assert s.kind == KernelKind.ELEMENTWISE and s.live == (1,)


# ---- refusals ------------------------------------------------------------------------

def refusal(b, outs):
    d = check(b.build(outs))
    assert d, "expected a refusal"
    assert not d.ok and isinstance(d.reason, str)
    with pytest.raises(ScheduleError) as e:
        build_schedule(b.build(outs))
    assert str(e.value) == d.reason
    return d.reason


def test_refuse_neither_row_nor_column():
    b = SpecBuilder()
    x = b.input("float32", (4, 5, 6))
    r = refusal(b, [b.Sum(x, axes=[0, 2])])
    assert "axes (0, 2)" in r and "neither a row" in r


def test_refuse_mixed_reductions():
    b = SpecBuilder()
    x = b.input("float32", (4, 5))
    r = refusal(b, [b.Sum(x, axes=[0]), b.Sum(x, axes=[1])])
    assert "reduce different axes" in r


def test_refuse_transpose_like_layouts():
    b = SpecBuilder()
    x = b.input("float32", (-1, -1))
    s = b.Sum(x, axes=[1])                   # [A]
    t = b.Sum(x, axes=[0])                   # [B]
    u = b.Add(b.Reshape(t, shape=[-1, 1]), s)   # [B, A]: order disagrees with x[A, B]
    d = check(b.build([u, s]))
    assert d and "transpose" in d.reason


def test_refuse_output_not_spanning_parallel_axes():
    b = SpecBuilder()
    x = b.input("float32", (4, 5))
    y = b.input("float32", (5,))
    r = refusal(b, [b.Add(x, y), b.Neg(y)])
    assert "output 1" in r and "parallel axes" in r


def test_refuse_reduction_of_broadcast_value():
    b = SpecBuilder()
    x = b.input("float32", (4, 5))
    y = b.input("float32", (5,))
    r = refusal(b, [b.Add(x, b.Sum(y, axes=[0]))])
    assert "recomputed" in r


def test_refuse_too_many_dependent_reductions():
    b = SpecBuilder()
    v = b.input("float32", (-1, 16))
    for _ in range(9):
        m = b.Mean(v, axes=[1], keep_dims=True)
        v = b.Sub(v, m)
    r = refusal(b, [v])
    assert "dependent reductions" in r


def test_decision_is_falsy_when_legal():
    b, y, _ = layernorm()
    d = check(b.build([y]))
    assert not d and d.ok and d.reason is None and str(d) == "ok"


# ---- describe, determinism, builder -------------------------------------------------------

def test_describe_mentions_kind_passes_and_placements():
    spec, e = softmax()
    text = build_schedule(spec).describe()
    first = text.splitlines()[0]
    assert first.startswith("row kernel over [?x128]") and "3 pass(es)" in first
    assert f"Exp#{e} -> Div#{e + 2}: scratch" in text


def test_schedule_is_deterministic_and_json_stable():
    b, y, _ = layernorm()
    spec = b.build([y], rows_per_task=4)
    again = KernelSpec.from_json(spec.to_json())
    s1, s2 = build_schedule(spec), build_schedule(again)
    assert s1.describe() == s2.describe() and s1.edges == s2.edges
    assert s1.rows_per_task == 4


def test_builder_reports_bad_ops_early():
    b = SpecBuilder()
    x = b.input("float32", (4, 5))
    with pytest.raises(SpecError, match="Sum"):
        b.Sum(x, axes=[3])
    with pytest.raises(SpecError, match="not in the op table"):
        b.op("Conv2D", x)
    y = b.Sum(x, axes=[1])                    # keep_dims defaults to False
    assert b.type_of(y).shape == (4,)


def test_unused_input_adds_no_axis():
    """Regression: an input no live node reads made its dims domain axes, and the
    kernel was refused ("does not span the kernel's parallel axes")."""
    b = SpecBuilder()
    x = b.input("float32", (64, 1024))
    y = b.input("float32", (64, 1024))
    b.input("float32", (64, 1024))                       # unused
    s = sched_of(b, [b.Mul(x, y)])
    assert s.kind == KernelKind.ELEMENTWISE and s.rank == 1
    assert s.carries(-3) == () and s.domain.value_dims[-3] != (None, None)
