"""The result cache (stitching/tf/results.py): a traced graph stitched before is taken
whole from the cache, with stock TF's numbers, and anything unusable there is a miss
that stitches as before."""
import json
import os

import numpy as np
import pytest
import tensorflow as tf

import stitching
from stitching.tf import pipeline, results


def _fn(x):
    return tf.nn.softmax(x * 5.0, axis=-1) * 0.5 + tf.nn.relu(x)


X = tf.constant(np.random.default_rng(11).standard_normal((7, 36)).astype(np.float32))
REUSED = "reused from the result cache"


def _stitched():
    f = stitching.function(_fn)
    return f, f(X).numpy()


@pytest.fixture(autouse=True)
def own_results(monkeypatch, tmp_path):
    """Each test its own result cache (the kernels stay the session's)."""
    monkeypatch.setattr(results, "_dir", lambda: tmp_path / "results")


def _result_files():
    d = results._dir()
    return sorted(d.glob("*.json")) if d.is_dir() else []


def test_a_graph_stitched_before_is_taken_from_the_cache(monkeypatch):
    """The second function of the same code traces the same graph: its report, kernels
    and rewritten graph come from the cache (no pipeline), and it computes stock TF's
    numbers."""
    first, ref = _stitched()
    assert first.report.kernels and REUSED not in " ".join(first.report.notes)
    assert _result_files(), "nothing stored"

    def refuse(*a, **k):
        raise AssertionError("the pipeline ran: the result cache missed")
    monkeypatch.setattr(pipeline, "stitch_graph_def", refuse)
    again, out = _stitched()
    assert REUSED in " ".join(again.report.notes)
    assert f"; {REUSED} in " in again.report.summary().splitlines()[1]
    assert [k.spec_hash for k in again.report.kernels] == \
        [k.spec_hash for k in first.report.kernels]
    np.testing.assert_allclose(out, ref, rtol=0, atol=0)
    np.testing.assert_allclose(out, tf.function(_fn)(X).numpy(), rtol=2e-6, atol=2e-6)


def test_an_unusable_stored_result_is_a_miss_that_stitches_again():
    """A result file that does not parse, or that another format wrote, is a miss:
    the trace stitches through the pipeline (same numbers) and stores a good result
    again."""
    _, ref = _stitched()
    for damage in ("garbage", "another format"):
        for path in _result_files():
            if damage == "garbage":
                path.write_bytes(b"{not json")
            else:
                doc = json.loads(path.read_text())
                path.write_text(json.dumps(dict(doc, format=results.FORMAT + 1)))
        f, out = _stitched()
        assert f.report.kernels and REUSED not in " ".join(f.report.notes), damage
        np.testing.assert_allclose(out, ref, rtol=0, atol=0)
    assert REUSED in " ".join(_stitched()[0].report.notes)


def test_the_key_reads_custom_gradient_ids_by_order_and_a_hit_renames_them():
    """tf.custom_gradient numbers its gradients over the process: the same function
    traced twice differs only there, and gets one key; the stored graph's names
    become this trace's."""
    @tf.custom_gradient
    def clip_grad(x):
        return tf.identity(x), lambda dy: tf.clip_by_value(dy, -1.0, 1.0)

    def traced():
        return tf.function(lambda x: clip_grad(x) * 2.0).get_concrete_function(
            tf.TensorSpec([4], tf.float32)).graph.as_graph_def()
    a, b = traced(), traced()
    names_a, names_b = results._gradient_names(a), results._gradient_names(b)
    assert names_a and names_a != names_b
    opts = stitching.Options()
    key = lambda g: results.key(g, ["y:0"], [], opts, {}, True, frozenset())  # noqa: E731
    assert key(a) == key(b)
    renamed = results._renamed(a, dict(zip(names_a, names_b)))
    assert results._gradient_names(renamed) == names_b


def _nested_step():
    """A step calling two tf.functions, made anew: their library names are new uids."""
    g = tf.function(lambda x: tf.nn.relu(x) * 3.0)
    h = tf.function(lambda x: tf.tanh(x) - 1.0)
    return lambda x: tf.nn.softmax(g(x * 2.0), axis=-1) + h(x)


def test_the_key_reads_library_function_names_by_order():
    """A tf.function the step calls is named ``__inference_<name>_<uid>``, numbered over
    the process: the same step traced after other functions (another process, another
    order) differs only there, and gets one key."""
    def traced():
        return tf.function(_nested_step()).get_concrete_function(
            tf.TensorSpec([7, 36], tf.float32)).graph.as_graph_def()
    a, b = traced(), traced()
    fns_a, fns_b = results._function_names(a), results._function_names(b)
    assert len(fns_a) == 2 and not set(fns_a) & set(fns_b)
    opts = stitching.Options()
    key = lambda g: results.key(g, ["y:0"], [], opts, {}, True, frozenset())  # noqa: E731
    assert key(a) == key(b)
    other = tf.function(lambda x: tf.nn.softmax(tf.function(lambda y: y * 3.0)(x * 2.0))
                        + tf.function(lambda y: tf.tanh(y) - 1.0)(x))
    c = other.get_concrete_function(tf.TensorSpec([7, 36], tf.float32)).graph.as_graph_def()
    assert key(c) != key(a), "a function of other contents must not share the key"


def test_a_step_calling_tf_functions_is_reused_whoever_traced_first(monkeypatch):
    """The stitched result of a step that calls tf.functions is taken from the cache by
    a trace whose functions have other names (made later: new uids), with stock TF's
    numbers."""
    first = stitching.function(_nested_step())
    ref = first(X).numpy()
    first.wait()
    assert REUSED not in " ".join(first.report.notes) and _result_files()

    def refuse(*a, **k):
        raise AssertionError("the pipeline ran: the result cache missed")
    monkeypatch.setattr(pipeline, "stitch_graph_def", refuse)
    again = stitching.function(_nested_step())
    again(X)
    again.wait()
    assert REUSED in " ".join(again.report.notes)
    np.testing.assert_allclose(again(X).numpy(), ref, rtol=0, atol=0)


def test_a_hit_renames_the_functions_the_stored_graph_calls_to_this_traces():
    """A while loop's body is a library function named by a process-wide uid, and the
    stitched graph still calls it: a hit names this trace's functions, never the stored
    ones (in another process that name may be another function, or none).  The loop
    stays a loop (``unroll_loops=0``; a loop of 3 steps is unrolled by default)."""
    def step(x):
        def body(i, h):
            return i + 1, tf.tanh(h * 0.9 + 0.1) * tf.sigmoid(h)
        return tf.nn.softmax(tf.while_loop(lambda i, h: i < 3, body, (0, x))[1])
    first = stitching.function(step, options=stitching.Options(unroll_loops=0))
    first(X)
    first.wait()
    assert REUSED not in " ".join(first.report.notes)

    traced = tf.function(step).get_concrete_function(X).graph.as_graph_def()
    stored = _result_files()
    assert len(stored) == 1
    doc = json.loads(stored[0].read_text())
    fns = results._function_names(traced)
    assert len(doc["functions"]) == len(fns) and not set(doc["functions"]) & set(fns)
    hit = results.probe(stored[0].stem, traced)
    assert hit is not None
    called = {ref.name for n in results._nodes(hit.graph_def)
              for ref in results._func_refs(n.attr.values())}
    assert called & set(fns), "the stitched graph calls none of this trace's functions"
    assert not called & set(doc["functions"]), "a stored name is still called"


def test_a_result_whose_kernel_code_left_the_cache_is_a_miss(monkeypatch):
    """A new process registers a stored result's kernels from the compile cache: where
    a kernel's code is not there (evicted, another toolchain), the result is a miss."""
    import base64
    from stitching import runtime
    _stitched()
    doc = json.loads(_result_files()[0].read_text())
    graph_def = tf.compat.v1.GraphDef.FromString(base64.b64decode(doc["graph_def"]))
    monkeypatch.setattr(runtime, "is_registered", lambda spec: False)   # a new process
    assert results._register_all(graph_def, doc["kernels"])
    gone = {h: dict(e, code="k_" + "0" * 24) for h, e in doc["kernels"].items()}
    assert not results._register_all(graph_def, gone)


def test_new_python_scalars_take_the_template_and_store_nothing(monkeypatch):
    """A function stitched once: each new Python scalar is served by its template
    (tf/scalars.py), never hashed, probed or stored here, so one result file for the
    first trace only, and every value equals TF's."""
    def g(x, s):
        return tf.nn.softmax(x * s, axis=-1) * s + x
    f = stitching.function(g)
    f(X, 1.0)
    assert len(_result_files()) == 1
    probes = []
    monkeypatch.setattr(results, "probe", lambda *a: probes.append(a))
    for s in (1.5, 2.0, 3.0):
        np.testing.assert_allclose(f(X, s).numpy(), g(X, s).numpy(), rtol=1e-5, atol=1e-6)
    assert not probes
    assert len(_result_files()) == 1
    assert f.experimental_get_tracing_count() == 4 and f.report.kernels


@pytest.mark.parametrize("storable", [True, False])
def test_a_hint_is_left_only_for_a_stored_result(monkeypatch, tiered, storable):
    """A tiered trace marks a hint so that the next process probes the result cache;
    it marked one even where nothing was stored (a kernel that could not be built),
    and the next process paid for a probe that missed before planning all over.  Now
    the report says whether the result was stored, and why not."""
    if not storable:
        monkeypatch.setattr(results, "save", lambda *a, **k: False)
    f = stitching.function(_fn)
    f(X)
    assert f.wait(timeout=300)
    rep = f.report
    hints = results._dir() / "hints"
    marked = sorted(hints.iterdir()) if hints.is_dir() else []
    assert rep.result_stored is storable
    assert bool(marked) is storable, marked
    notes = " ".join(rep.notes)
    assert ("not stored in the result cache" in notes) is not storable, notes


def test_stored_results_are_named_by_the_sources_contents_not_their_times(tmp_path,
                                                                          monkeypatch):
    """A release that differs from the one that stored a result only inside a file of
    the same size and time (a store that gives every file one time: Nix, reproducible
    image builds) must not read that result: its kernels were generated by the other
    release's code.  The salt reads the sources' contents."""
    from stitching import cachedir
    pkg = tmp_path / "stitching"
    (pkg / "codegen").mkdir(parents=True)
    src = pkg / "codegen" / "exprs.py"

    def release(text):
        src.write_text(text)
        os.utime(src, ns=(1_000_000_000, 1_000_000_000))
        monkeypatch.setattr(cachedir, "_DIGESTS", {})
        monkeypatch.setattr(results, "_SALT", None)
        return results._salt()
    monkeypatch.setattr(cachedir, "_PACKAGE", pkg)
    old, fixed = release("y = 1 * sqrt(x)\n"), release("y = 1 / sqrt(x)\n")
    assert old != fixed
    assert release("y = 1 * sqrt(x)\n") == old          # the same sources: the same name


def test_report_state_leaves_the_report_as_it_was_and_round_trips():
    # _report_state hands the report's own values to the encoder (no deep copy): the
    # report itself must come out unchanged, and the stored state read back equal
    import copy
    from stitching.report import KernelInfo, Report
    body = Report(function="body")
    body.kernels = [KernelInfo("k0", [("a", "Exp")], "elementwise", 1, 1, "h0",
                               counted=frozenset({"a"}))]
    rep = Report(function="f")
    rep.kernels = [KernelInfo("k1", [("b", "Mul"), ("c", "Add")], "row", 2, 1, "h1",
                              counted=frozenset({"c", "b"})),
                   KernelInfo("k2", [("d", "Neg")], "elementwise", 1, 1, "h2")]
    rep.unfused = [("e", "Exp", "why")]
    rep.bodies = [("body_fn", body, ""), ("empty_fn", None, "nothing to fuse")]
    rep.tiering, rep.dump_path = "tier 1 ran", "/some/dump"
    before = copy.deepcopy(rep)
    state = results._report_state(rep)
    text = json.dumps(state)
    assert rep == before
    assert state["kernels"][0]["counted"] == ["b", "c"]
    back = results._report_from(json.loads(text))
    assert back.kernels == rep.kernels and back.unfused == rep.unfused
    assert back.bodies[0][1].kernels == body.kernels and back.bodies[1][1] is None
    assert back.tiering == "" and back.dump_path is None
