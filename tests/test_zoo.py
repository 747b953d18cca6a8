"""The shared pattern/model zoo and the benchmark harness's counting helpers.

Fast: small sizes only, no keras.applications model is built, no timing asserted.
"""
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))

from stitching.testing import (MODELS, PATTERNS, all_models, all_patterns,  # noqa: E402
                               count_memory_intensive_ops, count_xla_kernels,
                               tf_op_histogram, transformer_encoder)
from stitching.testing.counting import parse_hlo  # noqa: E402

NAMES = sorted(PATTERNS)


def _run(fn, sig, inputs):
    f = tf.function(fn, input_signature=sig)
    return [np.asarray(t) for t in tf.nest.flatten(f(*[tf.constant(a) for a in inputs]))]


# ---- patterns

def test_registry_covers_the_brief():
    required = {"layernorm_manual", "layernorm_keras", "add_layernorm", "rmsnorm",
                "softmax_tf", "softmax_manual", "attention_softmax", "log_softmax",
                "logsumexp", "bias_gelu_erf", "bias_gelu_tanh", "bias_gelu_tanh_manual",
                "bias_gelu_residual", "bn_swish", "bn_relu6", "squeeze_excite",
                "l2_normalize", "center_axis0"}
    assert required <= set(PATTERNS)


@pytest.mark.parametrize("name", NAMES)
def test_pattern_small_matches_float64(name):
    p = PATTERNS[name]
    sig = p.input_signature("small")
    assert all(s.shape[0] is None for s in sig), "batch dim must be unknown"
    y32 = _run(p.fn, sig, p.inputs("small"))
    y64 = _run(p.make_fn(tf.float64), p.input_signature("small", tf.float64),
               p.inputs("small", np.float64))
    assert len(y32) == len(y64)
    for a, b in zip(y32, y64):
        assert a.dtype == np.float32
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(b).max()))


@pytest.mark.parametrize("name", NAMES)
def test_pattern_sizes_and_metadata(name):
    p = PATTERNS[name]
    assert p.expected_kernels == 1
    assert p.description
    # large is bandwidth-bound (>= 16 MB in), small latency-bound; computed from the
    # shapes so no 32 MB array is allocated here.
    assert p.input_bytes("large") >= 16e6
    assert p.input_bytes("small") <= 256 * 1024
    for size in ("large", "small"):
        assert len(p.shapes[size]) == len(p.input_kinds) == len(p.input_signature(size))
    # Non-batch dims agree between the signature and the inputs.
    for spec, a in zip(p.input_signature("small"), p.inputs("small")):
        assert tuple(spec.shape[1:]) == a.shape[1:]


@pytest.mark.parametrize("name", NAMES)
def test_mib_sizes_scale_the_large_shapes(name):
    """Issue 31's 1/4/16/64 MiB sizes: the largest input within 10% of the target (or
    of one batch step, where a batch is coarser than that), the non-batch dims of non-NHWC inputs unchanged (weights still fit), unknown sizes refused."""
    from stitching.testing.patterns import MIB_SIZES, _nbytes
    p = PATTERNS[name]
    for size in MIB_SIZES:
        shapes = p.shapes_for(size)
        biggest = max(_nbytes(s, k) for s, k in zip(shapes, p.input_kinds))
        target = int(size[:-1]) << 20
        assert abs(biggest - target) <= max(0.1 * target, biggest / shapes[0][0]), shapes
        assert [s[-1] for s in shapes] == [s[-1] for s in p.shapes["large"]]
        assert len({s[0] for s in shapes}) == 1               # one batch dim for all
    with pytest.raises(ValueError, match="unknown size '3m'"):
        p.shapes_for("3m")


def test_inputs_are_deterministic():
    p = PATTERNS["attention_softmax"]
    a, b = p.inputs("small"), p.inputs("small")
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    mask = a[1]
    assert set(np.unique(mask)) <= {0.0, 1.0} and mask.mean() > 0.4


def test_weights_are_captured_variables():
    # Keras models capture variables; patterns must look the same to the frontend.
    f = tf.function(PATTERNS["layernorm_manual"].fn,
                    input_signature=PATTERNS["layernorm_manual"].input_signature())
    ops = tf_op_histogram(f.get_concrete_function())
    assert ops["ReadVariableOp"] == 2


def test_pattern_runs_at_another_batch():
    p = PATTERNS["add_layernorm"]
    f = tf.function(p.fn, input_signature=p.input_signature("small"))
    for batch in (1, 3):
        xs = [tf.constant(a[:batch]) for a in p.inputs("small")]
        assert f(*xs).shape[0] == batch


# ---- counting

def test_memory_intensive_count_inlines_function_calls():
    p = PATTERNS["layernorm_manual"]
    inner = tf.function(p.fn)
    flat = tf.function(p.fn, input_signature=p.input_signature())
    nested = tf.function(lambda x: inner(x) * 2.0, input_signature=p.input_signature())
    n_flat = count_memory_intensive_ops(flat.get_concrete_function())
    n_nested = count_memory_intensive_ops(nested.get_concrete_function())
    assert n_flat >= 6
    assert n_nested == n_flat + 1   # + the Mul outside the call
    assert "StatefulPartitionedCall" not in tf_op_histogram(nested.get_concrete_function())


def test_xla_kernel_count_on_layernorm():
    p = PATTERNS["layernorm_manual"]
    f = tf.function(p.fn, jit_compile=True, input_signature=p.input_signature())
    x = tf.constant(p.inputs("small")[0])
    hlo = f.experimental_get_compiler_ir(x)(stage="optimized_hlo")
    c = count_xla_kernels(hlo)
    # XLA:CPU splits a LayerNorm into several kernels (reductions are not fused with
    # their consumers); the exact number depends on the XLA version and the shape.
    assert c["memory_kernels"] >= 2
    assert c["compute_fusions"] == 0 and c["unfused_compute"] == 0


HLO_SAMPLE = """HloModule m, entry_computation_layout={(f32[8,16]{1,0})->(f32[8,4]{1,0}, f32[8]{0})}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%fused_dot (p0: f32[8,16], p1: f32[16,4]) -> f32[8,4] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[16,4]{1,0} parameter(1)
  %d = f32[8,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %r = f32[8,4]{1,0} maximum(%d, %d)
}

%fused_exp (p0.1: f32[8,16]) -> f32[8,16] {
  %p0.1 = f32[8,16]{1,0} parameter(0)
  ROOT %e = f32[8,16]{1,0} exponential(%p0.1)
}

ENTRY %main (a: f32[8,16]) -> (f32[8,4], f32[8]) {
  %a = f32[8,16]{1,0} parameter(0)
  %w = f32[16,4]{1,0} constant({...})
  %f1 = f32[8,16]{1,0} fusion(%a), kind=kLoop, calls=%fused_exp
  %z = f32[] constant(0)
  %red = f32[8]{0} reduce(%f1, %z), dimensions={1}, to_apply=%add
  %f2 = f32[8,4]{1,0} fusion(%a, %w), kind=kOutput, calls=%fused_dot
  ROOT %t = (f32[8,4]{1,0}, f32[8]{0}) tuple(%f2, %red)
}
"""


def test_xla_kernel_count_sample():
    assert parse_hlo(HLO_SAMPLE)["entry"] == "main"
    c = count_xla_kernels(HLO_SAMPLE)
    assert c == {"fusions": 2, "memory_fusions": 1, "compute_fusions": 1,
                 "unfused_memory": 1, "unfused_compute": 0, "memory_kernels": 2}


# ---- models

def test_model_registry():
    cnns = [m for m in all_models() if m.kind == "cnn"]
    assert len(cnns) >= 3
    assert any(m.kind == "transformer" for m in all_models())
    for m in all_models():
        assert m.input_signature()[0].shape[0] is None
        assert m.batch_sizes


def test_transformer_encoder_tiny():
    model = transformer_encoder(num_layers=1, d_model=32, heads=2, ff=64, seq_len=8)
    assert model.input_shape == (None, 8, 32)
    f = tf.function(lambda x: model(x, training=False),
                    input_signature=[tf.TensorSpec([None, 8, 32], tf.float32)])
    for batch in (1, 3):
        x = np.random.default_rng(batch).standard_normal((batch, 8, 32)).astype(np.float32)
        y = f(tf.constant(x)).numpy()
        assert y.shape == (batch, 8, 32) and np.all(np.isfinite(y))
    ops = tf_op_histogram(f.get_concrete_function())
    assert ops["Softmax"] >= 1 and ops["Erfc"] + ops["Erf"] >= 1   # attention + gelu
    assert count_memory_intensive_ops(f.get_concrete_function()) > 10


def test_model_case_inputs():
    m = MODELS["transformer"]
    (x,) = m.inputs(2)
    assert x.shape == (2,) + tuple(m.input_shape) and x.dtype == np.float32


# ---- harness smoke test: runs with whatever state stitching is in

def test_bench_harness_smoke(tmp_path):
    from bench_lib import output, suites
    rows = suites.run_patterns(only=["softmax_manual"], sizes=["small"], repeats=2,
                               warmup=1, min_time=0.0)
    assert len(rows) == 1
    r = rows[0]
    assert r["modes"]["tf"]["ok"] and r["modes"]["xla"]["ok"]
    assert r["modes"]["xla"]["check"]["ok"] is True
    st = r["modes"]["stitching"]
    assert st["ok"] or st["error"]     # a failure is reported, never raised
    results = {"patterns": rows}
    meta = {"date": "d", "cpu": "c", "cores": 2, "python": "p", "tensorflow": "t",
            "numba": "n", "stitching_rev": "r", "tf_intra_op_threads": 2,
            "copy_bandwidth": {"gbs": 10.0, "method": "m"}}
    lines = output.targets(results, 10.0)
    assert any(l.startswith(("PASS", "FAIL")) and "small" in l for l in lines)
    md = tmp_path / "B.md"
    output.write_markdown(str(md), results, meta)
    output.write_markdown(str(md), {"models": []}, meta)   # keeps the patterns section
    assert "softmax_manual" in md.read_text()
    output.write_png(str(tmp_path / "b.png"), results)
    assert (tmp_path / "b.png").stat().st_size > 0


class _FakeReport:
    def to_dict(self):
        return {"memory_intensive_ops": 5, "fused_ops": 5, "kernels": 1, "unfused": []}


def _fake_stitching(transform):
    """A stand-in for stitching.function: tf.function plus a report, with its output
    passed through ``transform`` (identity, or a bug to be caught)."""
    class Fake:
        def __init__(self, fn, input_signature=None, options=None):
            self._f = tf.function(lambda *a: transform(fn(*a)), input_signature=input_signature)
            self.report = None

        def __call__(self, *args):
            out = self._f(*args)
            self.report = _FakeReport()
            return out
    return Fake


@pytest.mark.parametrize("bug", [False, True])
def test_bench_stitched_column_and_mismatch_flag(monkeypatch, bug):
    import stitching
    from bench_lib import output, suites
    monkeypatch.setattr(stitching, "function",
                        _fake_stitching((lambda y: y * 1.01) if bug else (lambda y: y)),
                        raising=False)
    rows = suites.run_patterns(only=["softmax_manual"], sizes=["small"], repeats=2,
                               warmup=0, min_time=0.0)
    st = rows[0]["modes"]["stitching"]
    assert st["ok"] and st["kernels"] == 1 and st["report"]["fused_ops"] == 5
    assert output.speedup(rows[0], "stitching", "tf") > 0
    assert st["check"]["ok"] is (not bug)
    mism = output.mismatch_lines(rows)
    assert bool(mism) is bug
    verdict = [l for l in output.targets({"patterns": rows}, 10.0) if "outputs equal" in l][0]
    assert verdict.startswith("FAIL" if bug else "PASS")


def test_bench_worker_crash_is_a_failed_row(monkeypatch):
    # A segfault in native code must not end the run: the row is re-run without
    # stitching and stitching shows as FAILED with the signal.
    from bench_lib import isolate
    monkeypatch.setenv("STITCHING_BENCH_TEST_CRASH_ON", "softmax_manual/small")
    rows = isolate.run_isolated("patterns", ["softmax_manual/small", "rmsnorm/small"],
                                mode_list=("tf", "stitching"), repeats=1, warmup=0,
                                min_time=0.0, row_timeout=300)
    assert [r["name"] for r in rows] == ["softmax_manual", "rmsnorm"]
    crashed = rows[0]["modes"]
    assert crashed["tf"]["ok"] and crashed["tf"]["time"]
    assert not crashed["stitching"]["ok"]
    assert "SIGSEGV" in crashed["stitching"]["error"]
    assert rows[1]["modes"]["tf"]["ok"]
