"""The reuse choice for a layout op (schedule/layout.py Recompute, plan/cost.py
reuse_reason): fold it into the indexing and evaluate what it reads again in its index
space, or compute that value once, end a kernel there and reload it through the view.

A cheap producer (an add) is folded: one kernel.  An expensive one (six transcendental
ops) read directly and through a rotate-half (a concatenation of its halves, whose
pieces are each evaluated over the whole axis) would be evaluated three times per
element; under a pinned machine model it is computed once, and the rotate-half reads
it from memory: two kernels, and the report says why."""
import sys
from dataclasses import replace

import numpy as np
import pytest

from stitching.ir.builder import SpecBuilder
from stitching.plan import cost, search
from stitching.schedule import check as legal_check
from stitching.schedule import layout

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from irbuild import G  # noqa: E402

T, H, D = 32, 4, 64


@pytest.fixture(autouse=True)
def _independent_pricing(monkeypatch):
    """The expensive value here is a chain of six transcendentals, which the cost model
    prices at its latency (cost.CHAIN_LATENCY; tests/test_cost_compute.py) and would cut
    or leave to TF on its own.  What these tests check is the reuse choice around it, so
    its evaluations are priced as independent ones."""
    monkeypatch.setattr(cost, "CHAIN_LATENCY", 1.0)
EXPENSIVE = ("Tanh", "Exp", "Sigmoid", "Erf", "Tanh", "Sigmoid")
RELOADED = "computed once and reloaded: recomputing it through the ConcatV2 costs"


def _legal(spec):
    d = legal_check(spec)
    return None if d.ok else d.reason


def _rotary_graph(chain, shape=(-1, T, H, D)):
    """v = chain(x) (or x + x for "Add"); y = v + concat([-v[..., h:], v[..., :h]])."""
    g = G().input("x", list(shape))
    prev = "x"
    for i, op in enumerate(chain):
        g = g.op(f"c{i}", op, [prev] * (2 if op == "Add" else 1))
        prev = f"c{i}"
    h = shape[-1] // 2
    half = dict(size=[-1, -1, -1, h], strides=[1] * 4, shape=list(shape[:-1]) + [h])
    return (g.op("v1", "Slice", [prev], begin=[0, 0, 0, 0], **half)
             .op("v2", "Slice", [prev], begin=[0, 0, 0, h], **half)
             .op("n", "Neg", ["v2"]).op("r", "ConcatV2", ["n", "v1"], axis=3)
             .op("y", "Add", [prev, "r"]).build("y"))


def _plan(g, profile):
    return search.plan(g, _legal, config=search.SearchConfig(profile=profile))


def test_expensive_value_read_through_a_rotate_half_is_computed_once(machine):
    p = _plan(_rotary_graph(EXPENSIVE), machine)
    chain = [f"c{i}" for i in range(len(EXPENSIVE))]
    assert sorted(sorted(r.nodes) for r in p.regions) == [chain, ["n", "r", "v1", "v2", "y"]]
    (note,) = p.notes          # the report's one line where the plan cut
    assert RELOADED in note and "cut in 2" in note
    assert not any("reloaded" in why for _, why in p.boundaries), p.boundaries


def test_a_refused_chain_is_one_note(machine):
    """The search refuses the chain from each of its ops on through the rotate-half: the
    report says so once, for the largest, not once per nested pattern, and lists no
    refused merge for it."""
    p = _plan(_rotary_graph(EXPENSIVE), replace(machine, transcendental_per_s=2e7))
    (note,) = p.notes
    assert RELOADED in note and " cut in " in note, p.notes
    assert not any("reloaded" in why for _, why in p.boundaries), p.boundaries


def test_cheap_value_read_through_a_rotate_half_is_folded(machine):
    p = _plan(_rotary_graph(("Add",)), machine)
    assert [sorted(r.nodes) for r in p.regions] == [["c0", "n", "r", "v1", "v2", "y"]]
    assert not any("reloaded" in why for _, why in p.boundaries) and not p.notes


def test_small_tensors_fold_even_expensive_values(machine):
    """A launch costs more than recomputing a few hundred elements."""
    p = _plan(_rotary_graph(EXPENSIVE, (1, 8, 2, 16)), machine)
    assert len(p.regions) == 1 and len(p.regions[0].nodes) == len(EXPENSIVE) + 5


# ---- what a fold evaluates again (schedule/layout.py, Recompute) --------------------------

def _halves(b, v, batch=-1):
    h = D // 2
    kw = dict(size=[-1, -1, -1, h], strides=[1] * 4, shape=[batch, T, H, h])
    return (b.Slice(v, begin=[0, 0, 0, 0], **kw), b.Slice(v, begin=[0, 0, 0, h], **kw))


def test_disjoint_slices_evaluate_each_element_once():
    """GLU-style halves of one value: two copies of it, half the elements each."""
    b = SpecBuilder()
    v = b.Exp(b.input("float32", [-1, T, H, D]))
    v1, v2 = _halves(b, v)
    spec = b.build([b.Mul(v1, v2)])
    assert layout.lower(spec).recomputed == ()


def test_rotate_half_evaluates_its_value_once_more_per_piece():
    b = SpecBuilder()
    v = b.Exp(b.input("float32", [-1, T, H, D]))
    v1, v2 = _halves(b, v)
    spec = b.build([b.Add(v, b.ConcatV2(b.Neg(v2), v1, axis=3))])
    (r,) = layout.lower(spec).recomputed
    assert r.layout == "ConcatV2" and r.shape == (-1, T, H, D)
    # the direct read evaluates Exp once; each piece again over the whole axis; the
    # Neg of a half is evaluated over the whole axis too (the table selects)
    assert sorted((op, share) for op, _, share in r.ops) == \
        [("Exp", 1.0), ("Exp", 1.0), ("Neg", 0.5)]
    # what a cut would write instead: Exp's value, and the negated half
    assert sorted(t.shape for t in r.values) == [(-1, T, H, D // 2), (-1, T, H, D)]


def test_a_value_read_only_through_the_layout_op_is_not_recomputed():
    """The head transpose of a bias add: evaluated once, in the transposed space."""
    b = SpecBuilder()
    x = b.input("float32", [-1, T, H, D])
    v = b.Tanh(b.Add(x, b.input("float32", [D])))
    spec = b.build([b.Transpose(v, perm=[0, 2, 1, 3])])
    assert layout.lower(spec).recomputed == ()


# ---- through TF: the same choice, numerics equal TF's ------------------------------------

def _tf_rotary(expensive: bool):
    tf = pytest.importorskip("tensorflow")

    def f(x):
        v = x
        if expensive:
            for op in (tf.tanh, tf.exp, tf.sigmoid, tf.math.erf, tf.tanh, tf.sigmoid):
                v = op(v)
        else:
            v = x + x
        v1, v2 = tf.split(v, 2, axis=-1)
        return v + tf.concat([-v2, v1], axis=-1)
    return tf, f


@pytest.mark.parametrize("expensive, kernels", [(True, 2), (False, 1)])
def test_tf_reuse_choice_kernels_and_numerics(machine, expensive, kernels):
    import stitching
    tf, f = _tf_rotary(expensive)
    g = stitching.function(f, input_signature=[tf.TensorSpec([None, T, H, D], tf.float32)])
    x = np.random.default_rng(9).standard_normal((4, T, H, D)).astype(np.float32)
    x[0, 0, 0, 0], x[1, 2, 3, D - 1] = np.nan, np.inf
    got, want = g(tf.constant(x)).numpy(), tf.function(f)(tf.constant(x)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    rep = g.report
    assert len(rep.kernels) == kernels, rep.summary()
    assert rep.coverage == 1.0, rep.summary()
    assert any(RELOADED in n for n in rep.notes) == expensive, rep.summary()
