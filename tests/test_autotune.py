"""Options(autotune=True): a kernel timed against its native segment, the faster kept.

The op measures (runtime/op.cc, Tuner) and runtime/autotune.py keeps the decisions on
disk per spec hash + shape class + device.  These tests pin the mechanics, never a
timing: a forced choice either way computes what TF computes, a decision made in one
process is read (not measured again) by the next, a bad cache entry is measured again,
and the report names the kernels decided by measurement with their times.
"""
import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import stitching  # noqa: E402
from stitching import runtime  # noqa: E402
from stitching.runtime import autotune  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVERY = stitching.Options(autotune=True, autotune_margin=math.inf)
CALLS_TO_DECIDE = 12      # op.cc: (kTuneWarmup 1 + kTuneSamples 5) runs of each way


@pytest.fixture(autouse=True)
def _no_stored_decisions():
    """Each test measures from scratch: decisions a run before this one stored in the
    cache directory (when STITCHING_CACHE_DIR outlives the run) are removed; each test
    also uses specs of its own (column counts) so this process's op has none either."""
    import shutil
    from stitching import cachedir
    shutil.rmtree(cachedir.root() / "autotune", ignore_errors=True)


def fn(x, w):
    return tf.nn.relu(x * w + 1.0) * 2.0 - tf.tanh(x)


def _args(cols, rows=64, dtype=np.float32):
    rng = np.random.default_rng(cols)
    return (rng.standard_normal((rows, cols)).astype(dtype),
            rng.standard_normal(cols).astype(dtype))


def _spec_and_class(x, w):
    """The kernel's spec hash (from a plain stitched trace: autotune changes no spec)
    and the op's shape class for these inputs.  Its tier-2 code is in when this
    returns: the op measures only that (tier-1 code is not what will run)."""
    from stitching.compile import parallel
    plain = stitching.function(fn)
    plain(x, w)
    assert parallel.wait_upgrades(120)
    (k,) = plain.report.kernels
    return k.spec_hash, autotune.shape_class(x.nbytes + w.nbytes)


def _delta(before):
    after = runtime.stats()
    return {k: after[k] - before[k] for k in before if k.startswith("autotune")}


@pytest.mark.parametrize("choice,cols", [("kernel", 96), ("native", 160)])
def test_a_forced_choice_computes_what_tf_computes(choice, cols):
    x, w = _args(cols)
    h, cls = _spec_and_class(x, w)
    times = (10.0, 20.0) if choice == "kernel" else (20.0, 10.0)
    autotune.write(h, cls, choice, *times)            # as if measured earlier
    f = stitching.function(fn, options=EVERY)
    before = runtime.stats()
    outs = [f(x, w).numpy() for _ in range(3)]
    d = _delta(before)
    assert d["autotune_measured"] == 0 and d["autotune_timed_calls"] == 0
    assert d["autotune_cached"] == 1
    assert d["autotune_native_calls"] == (3 if choice == "native" else 0)
    ref = fn(x, w).numpy()
    ref64 = fn(x.astype(np.float64), w.astype(np.float64)).numpy()
    for y in outs:
        np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(y, ref64, rtol=1e-5, atol=1e-5)
    text = f.report.summary()
    assert f"(measured earlier, cached) -> {choice}" in text, text


def test_a_measured_decision_is_reported_cached_and_read_by_the_next_process():
    x, w = _args(224)
    h, _ = _spec_and_class(x, w)
    autotune.path(h).unlink(missing_ok=True)    # a cache kept from an earlier session
    f = stitching.function(fn, options=EVERY)
    before = runtime.stats()
    ref = fn(x, w).numpy()
    for _ in range(CALLS_TO_DECIDE + 2):        # every call, either way, is right
        np.testing.assert_allclose(f(x, w).numpy(), ref, rtol=1e-6, atol=1e-6)
    d = _delta(before)
    assert d["autotune_measured"] == 1 and d["autotune_timed_calls"] == CALLS_TO_DECIDE
    (entry,) = f.report.to_dict()["autotune"]
    (dec,) = entry["decisions"]
    assert dec["source"] == "measured" and dec["choice"] in ("kernel", "native")
    assert dec["kernel_us"] > 0 and dec["native_us"] > 0
    faster = "kernel" if dec["kernel_us"] <= dec["native_us"] else "native"
    assert dec["choice"] == faster
    assert f"µs (measured) -> {dec['choice']}" in f.report.summary()
    on_disk = autotune.read(entry["spec_hash"])
    assert on_disk[dec["class"]]["choice"] == dec["choice"]

    # a second process: same cache, same function: the decision is read, not measured
    script = textwrap.dedent(f"""
        import json, numpy as np, tensorflow as tf, stitching
        from stitching import runtime
        import test_autotune as t
        x, w = t._args(224)
        f = stitching.function(t.fn, options=t.EVERY)
        for _ in range(3):
            f(x, w)
        print("STATS", json.dumps(runtime.stats()))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]),
               TF_CPP_MIN_LOG_LEVEL="3", STITCHING_NO_HINTS="1")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    stats = json.loads(out.stdout.split("STATS", 1)[1])
    assert stats["autotune_measured"] == 0 and stats["autotune_timed_calls"] == 0, stats
    assert stats["autotune_cached"] == 1, stats


def test_a_kernel_running_tier1_code_is_not_timed_until_its_tier2_is_in(tmp_path,
                                                                         monkeypatch):
    """Regression: the op timed a tiered compile's quick tier-1 code (~3x slower than
    the tier 2 that replaces it) and stored the choice for good.  While the kernel runs
    tier 1, a tuned node runs it untimed and decides nothing; after the upgrade it
    measures."""
    from stitching.compile import kernel, parallel
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path))   # a cold kernel: tiered
    monkeypatch.setenv("STITCHING_CPU_BACKEND", "llvm")
    monkeypatch.setenv("STITCHING_TIERED_COMPILE", "1")
    monkeypatch.setattr(kernel, "_TIER1_DIR", tmp_path / "tier1")   # not the process's
    (tmp_path / "tier1").mkdir()
    pending = []
    monkeypatch.setattr(parallel, "_upgrade_later",
                        lambda ks, jobs, batch: pending.extend(ks))
    kernel.clear_memory_cache()
    try:
        x, w = _args(416)
        f = stitching.function(fn, options=stitching.Options(
            autotune=True, autotune_margin=math.inf, background_compile=False))
        ref = fn(x, w).numpy()
        before = runtime.stats()
        for _ in range(CALLS_TO_DECIDE + 2):
            np.testing.assert_allclose(f(x, w).numpy(), ref, rtol=1e-5, atol=1e-5)
        assert [k.tier for k in pending] == [1]
        d = _delta(before)
        assert d["autotune_timed_calls"] == 0 and d["autotune_measured"] == 0, d
        (k,) = pending
        assert kernel.compile_kernel(k.spec) is k and k.tier == 2     # the upgrade
        for _ in range(CALLS_TO_DECIDE + 2):
            np.testing.assert_allclose(f(x, w).numpy(), ref, rtol=1e-5, atol=1e-5)
        d = _delta(before)
        assert d["autotune_timed_calls"] == CALLS_TO_DECIDE, d
        assert d["autotune_measured"] == 1, d
    finally:
        parallel.wait_upgrades(120)
        kernel.clear_memory_cache()


def test_a_bad_cache_entry_is_treated_as_missing():
    x, w = _args(288)
    h, cls = _spec_and_class(x, w)
    p = autotune.path(h)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("{not json")
    f = stitching.function(fn, options=EVERY)
    before = runtime.stats()
    for _ in range(CALLS_TO_DECIDE):
        f(x, w)
    d = _delta(before)
    assert d["autotune_cached"] == 0 and d["autotune_measured"] == 1
    assert cls in autotune.read(h)                      # measured again, file rewritten


def _doc(**classes):
    return {"version": autotune.VERSION, "spec_hash": "ab" * 12, "device": autotune.device(),
            "classes": classes}


GOOD = {"choice": "native", "kernel_us": 2.0, "native_us": 1.0}


@pytest.mark.parametrize("doc", [
    "not json", json.dumps([1, 2]), json.dumps(dict(_doc(**{"12": GOOD}), version=1)),   # may have timed tier-1 code
    json.dumps(dict(_doc(**{"12": GOOD}), device="another machine")),
    json.dumps(dict(_doc(**{"12": GOOD}), spec_hash="cd" * 12)),
    json.dumps(_doc(**{"12": dict(GOOD, choice="both")})),
    json.dumps(_doc(**{"12": dict(GOOD, kernel_us=-1.0)})),
    json.dumps(_doc(**{"12": dict(GOOD, native_us="fast")})),
    json.dumps(_doc(**{"12": dict(GOOD, native_us=True)})),
    json.dumps(_doc(**{"64": GOOD})), json.dumps(_doc(**{"-1": GOOD})),
    json.dumps(_doc(**{"12": GOOD})).replace("2.0", "NaN"),
])
def test_bad_cache_files_and_entries_read_as_missing(doc, tmp_path, monkeypatch):
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path))
    p = autotune.path("ab" * 12)
    p.parent.mkdir(parents=True)
    p.write_text(doc)
    assert autotune.read("ab" * 12) == {}


def test_a_good_entry_survives_a_bad_neighbour(tmp_path, monkeypatch):
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path))
    p = autotune.path("ab" * 12)
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps(_doc(**{"12": GOOD, "13": dict(GOOD, choice="?")})))
    assert autotune.read("ab" * 12) == {12: GOOD}
    autotune.write("ab" * 12, 14, "kernel", 1.0, 3.0)
    assert sorted(autotune.read("ab" * 12)) == [12, 14]


def test_processes_writing_one_specs_decisions_at_once_keep_them_all(tmp_path):
    """Two processes writing decisions for one spec's shape classes at once each read,
    merged and replaced the file: 29 of 64 classes were lost (and measured again by
    the next process).  The read and the write are one step between processes now."""
    script = textwrap.dedent("""
        import os, sys, time
        from stitching.runtime import autotune
        first = int(sys.argv[1])
        open(sys.argv[2] + f"-ready-{first}", "w").close()
        while not os.path.exists(sys.argv[2]):
            time.sleep(0.001)
        for cls in range(first, first + 32):
            autotune.write("cd" * 12, cls, "kernel", 1.0, 2.0)
    """)
    go = tmp_path / "go"
    env = dict(os.environ, PYTHONPATH=REPO, STITCHING_CACHE_DIR=str(tmp_path / "cache"))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(first), str(go)], env=env)
             for first in (0, 32)]
    import time
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("go-ready-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)    # both imported, waiting for go
    go.touch()
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    env_cache = tmp_path / "cache"
    doc = json.loads(next(env_cache.glob("autotune/*/" + "cd" * 12 + ".json")).read_text())
    assert sorted(map(int, doc["classes"])) == list(range(64))


def test_only_kernels_below_the_margin_are_measured():
    x, w = _args(96)
    f = stitching.function(fn, options=stitching.Options(autotune=True,
                                                         autotune_margin=1.0))
    f(x, w)
    assert f.report.autotune == [] and "autotune" not in f.report.summary()
    g = f.get_concrete_function(x, w).graph.as_graph_def()
    assert not any("_stitching_autotune" in n.attr for n in g.node)


@pytest.mark.parametrize("bad, error", [(0.5, ValueError), ("1.3", TypeError),
                                        (True, TypeError), (float("nan"), ValueError)])
def test_autotune_margin_must_be_a_speed_up(bad, error):
    with pytest.raises(error, match="autotune_margin"):
        stitching.Options(autotune=True, autotune_margin=bad)


def test_stitching_rewrite_autotune_marks_a_graph_that_measures_where_it_runs(tmp_path):
    """`stitching-rewrite --autotune MARGIN`: the shipped graph's kernel nodes carry the
    mark and their native segment, and the process that runs the graph measures."""
    from stitching import cli
    x_np, w_np = _args(352)
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 352], name="x")
        tf.identity(fn(x, tf.constant(w_np)), name="y")
    (tmp_path / "g.pb").write_bytes(g.as_graph_def().SerializeToString())
    out = str(tmp_path / "out.pb")
    assert cli.main([str(tmp_path / "g.pb"), out, "--outputs", "y", "--autotune", "inf",
                     "--no-kernels"]) == 0
    gd = tf.compat.v1.GraphDef()
    gd.ParseFromString((tmp_path / "out.pb").read_bytes())
    marked = [n for n in gd.node if n.op == "StitchedKernel"]
    assert marked and all("_stitching_autotune" in n.attr and n.attr["fallback"].list.func
                          for n in marked)
    run = tf.compat.v1.wrap_function(
        lambda a: tf.compat.v1.import_graph_def(gd, {"x:0": a}, ["y:0"], name=""),
        [tf.TensorSpec([None, 352], tf.float32)])
    before = runtime.stats()
    ref = fn(x_np, w_np).numpy()
    for _ in range(CALLS_TO_DECIDE):
        np.testing.assert_allclose(run(tf.constant(x_np))[0].numpy(), ref,
                                   rtol=1e-6, atol=1e-6)
    assert _delta(before)["autotune_measured"] == 1
    with pytest.raises(SystemExit) as refused:           # a margin below 1: a usage error
        cli.main([str(tmp_path / "g.pb"), out, "--outputs", "y", "--autotune", "0.5"])
    assert refused.value.code == 2
