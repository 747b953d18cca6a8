"""Graph dumps (stitching/inspect): schema, load_dump round trip, profiling,
TensorBoard read-back, and what a dump refuses to read."""
import glob
import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

import stitching
from stitching import inspect as si
from stitching import runtime
from stitching.testing.models import small_cnn, transformer_encoder

jsonschema = pytest.importorskip("jsonschema")


def _stitch(model, x, dump_dir, **opts):
    f = stitching.function(lambda v: model(v, training=False),
                           options=stitching.Options(dump_dir=str(dump_dir), **opts))
    y = f(x)
    np.testing.assert_allclose(y, model(x, training=False), rtol=2e-4, atol=2e-5)
    return f


@pytest.fixture(scope="module")
def transformer_dump(tmp_path_factory):
    root = tmp_path_factory.mktemp("dumps")
    model = transformer_encoder(num_layers=1, d_model=32, heads=2, ff=64, seq_len=8)
    x = tf.random.stateless_normal([2, 8, 32], seed=[1, 2])
    with pytest.MonkeyPatch.context() as mp:     # its tests name the intel-avx512 plan's kernels
        mp.setenv("STITCHING_DEVICE_PROFILE", "intel-avx512")
        f = _stitch(model, x, root)
    return f, root, x


def test_cnn_dump_matches_its_schema_and_report(tmp_path):
    model = small_cnn()
    f = _stitch(model, tf.random.stateless_uniform([2, 16, 16, 3], seed=[3, 4]), tmp_path)
    (path,) = si.list_dumps(tmp_path)
    si.validate_dump(path)
    d = si.load_dump(path)
    rep = f.report
    assert rep.dump_path == path
    assert [k.name for k in d.kernels] == [k.name for k in rep.kernels]
    assert len(d.kernels) >= 2            # stem BN+ReLU6 and the SE / residual glue
    assert d.summary["fused_ops"] == rep.fused_ops
    assert [(u["node"], u["reason"]) for u in d.unfused] == [(n, r) for n, _, r in rep.unfused]
    ops = {op for k in d.kernels for _, op in k.ops}
    assert {"Relu6", "Sigmoid"} & ops, ops


def test_transformer_dump_round_trip(transformer_dump):
    f, root, _ = transformer_dump
    (path,) = si.list_dumps(root)
    si.validate_dump(path)
    d = stitching.load_dump(root)          # a root holding one dump is accepted
    assert d.path == path and d.function.endswith("<lambda>")   # its qualified name
    assert d.options["planner"] == "search"
    # every kernel: its files, its spec as the graph carries it, its estimate
    after = {n.name: n for n in d.graph_after().node}
    for k, info in zip(d.kernels, f.report.kernels):
        node = after[k.name]
        assert node.op == "StitchedKernel"
        assert node.attr["label"].s.decode() == k.label
        spec = k.spec()
        assert spec.hash == k.spec_hash == info.spec_hash
        assert spec.to_json() == node.attr["spec"].s.decode()
        assert "def " in k.source and k.schedule.strip()
        assert k.nodes == [n for n, _ in info.ops]
        e = k.estimate
        assert e["fused_us"] > 0 and e["bytes_fused"] > 0
        # a vertical fusion saves traffic; a horizontal pack of independent same-shape
        # chains (schedule/domain.py) moves the same bytes in fewer launches
        assert e["bytes_unfused"] >= e["bytes_fused"]
    assert sum(k.estimate["bytes_unfused"] for k in d.kernels) > \
        2 * sum(k.estimate["bytes_fused"] for k in d.kernels)    # fusing saves traffic
    assert {n.name for n in d.graph_before().node} >= {u["node"] for u in d.unfused}
    assert "Softmax" in d.ir_text
    # the search planner's decisions with their cost-model scores
    decisions = d.plan["planner_decisions"]
    assert decisions and all("alternatives" in x and "score" in x for x in decisions)
    assert {x["kernel"] for x in decisions if x["deployed"]} == {k.name for k in d.kernels}
    by_reason = d.unfused_by_reason()
    assert sum(len(v) for v in by_reason.values()) == len(d.unfused)


def test_retraces_and_functions_get_their_own_dumps(tmp_path, monkeypatch):
    monkeypatch.setenv("STITCHING_DUMP_DIR", str(tmp_path))      # the environment's root
    f = stitching.function(lambda x: tf.nn.softmax(x * 2.0))
    g = stitching.function(lambda x: tf.nn.softmax(x * 2.0))     # same graph, other fn
    f(tf.ones([2, 8]))
    f(tf.ones([2, 8], tf.float64))                                # a retrace
    g(tf.ones([2, 8]))
    paths = si.list_dumps(tmp_path)
    assert len(paths) == 3 and len(set(paths)) == 3
    assert [r.dump_path for r in f.reports + g.reports] == paths
    with pytest.raises(si.DumpError, match="holds 3 dumps"):
        si.load_dump(tmp_path)
    labels = [k.label for p in paths for k in si.load_dump(p).kernels]
    assert len(labels) == len(set(labels)) == 3     # profile counters cannot mix


def test_no_dump_unless_asked(tmp_path, monkeypatch):
    monkeypatch.delenv("STITCHING_DUMP_DIR", raising=False)
    f = stitching.function(lambda x: tf.exp(x) * 2.0)
    f(tf.ones([4]))
    assert f.report.dump_path is None
    with pytest.raises(TypeError, match="Options.dump_dir must be a directory path"):
        stitching.Options(dump_dir=3)


def test_rewrite_tool_dump_dir(tmp_path):
    from stitching import cli
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 16], name="x")
        tf.nn.softmax(x * 3.0, name="y")
    src = tmp_path / "g.pb"
    src.write_bytes(g.as_graph_def().SerializeToString())
    dumps = tmp_path / "dumps"
    assert cli.main([str(src), str(tmp_path / "out.pb"), "--outputs", "y",
                     "--dump-dir", str(dumps)]) == 0
    d = si.load_dump(dumps)
    si.validate_dump(d.path)
    assert d.function == "g.pb" and len(d.kernels) == 1
    assert [op for _, op in d.kernels[0].ops] == ["Mul", "Softmax"]


def test_profile_counts_calls_and_time(transformer_dump):
    f, root, x = transformer_dump
    (path,) = si.list_dumps(root)
    runtime.profile_reset()
    with pytest.warns(RuntimeWarning, match=r"ran while profiling was on .*f\.wait\(\)"):
        si.write_profile(f)                # nothing ran profiled: says so
    runtime.set_profiling(True)
    try:
        for _ in range(3):
            f(x)
    finally:
        runtime.set_profiling(False)
    f(x)                                   # off: not counted
    written = si.write_profile(f)
    assert written == [os.path.join(path, "profile.json")]
    si.validate_dump(path)
    d = si.load_dump(path)
    for k in d.kernels:
        assert k.measured["calls"] == 3, k
        assert k.measured_us > 0
        # the fastest call: one of the three, so at most their mean
        assert 0 < k.measured["min_seconds"] <= k.measured["seconds"] / 3
        assert k.fastest_us == pytest.approx(k.measured["min_seconds"] * 1e6)
        assert k.fastest_us <= k.measured_us
        # bytes: the kernel's inputs and outputs, every call (the dump's shapes say -1
        # for the batch, so compare with what the static part and batch 2 give)
        per_call = k.measured["bytes"] / 3
        assert per_call == sum(4 * np.prod([2 if s < 0 else s for s in v["shape"]])
                               for v in k.inputs + k.outputs)
    rows = d.kernel_rows()
    assert all(r["measured_us"] and r["calls"] == 3 for r in rows)
    assert all(0 < r["fastest_us"] <= r["measured_us"] for r in rows)
    # the roofline's measured rate is the fastest call's (the mean moves with load)
    from stitching.inspect.draw import roofline_points
    fastest = {k.name: k.measured["min_seconds"] for k in d.kernels}
    for name, intensity, rate, how in roofline_points(d):
        m = d.kernel(name).measured
        assert how == "measured"
        assert rate == pytest.approx(intensity * m["bytes"] / 3 / fastest[name])
    # each kernel's op count is the report's (views and Identity named apart)
    assert {r["kernel"]: r["ops"] for r in rows} == \
        {k.name: len(k.split_ops()[0]) for k in f.report.kernels}
    runtime.profile_reset()                # the fastest call is forgotten too
    assert all(c["calls"] == 0 and c["min_seconds"] == 0
               for c in runtime.profile().values())


def test_tensorboard_groups_each_kernel_with_its_fused_ops(transformer_dump, tmp_path):
    f, root, _ = transformer_dump
    d = si.load_dump(root)
    (run,) = stitching.write_tensorboard(d, tmp_path)
    from tensorflow.core.framework import graph_pb2
    from tensorflow.core.util import event_pb2
    graphs, tags = [], set()
    for ev in glob.glob(os.path.join(run, "events*")):
        for rec in tf.data.TFRecordDataset(ev):
            e = event_pb2.Event.FromString(rec.numpy())
            if e.graph_def:
                graphs.append(graph_pb2.GraphDef.FromString(e.graph_def))
            tags |= {v.tag for v in e.summary.value}
    (g,) = graphs
    nodes = {n.name: n for n in g.node}
    for k in d.kernels:
        group = {n for n in nodes if n.startswith(k.name + "/")}
        assert f"{k.name}/StitchedKernel" in group
        assert nodes[f"{k.name}/StitchedKernel"].op == "StitchedKernel"
        fused = {f"{k.name}/{m.replace('/', '.')}" for m in k.nodes}
        assert group == fused | {f"{k.name}/StitchedKernel"}
        assert [nodes[n].op for n in sorted(fused)] == \
            [op for _, op in sorted((f"{k.name}/{m.replace('/', '.')}", op) for m, op in k.ops)]
    assert not any(n.op == "StitchedKernel" and not n.name.endswith("/StitchedKernel")
                   for n in g.node)
    if any(k.measured for k in d.kernels):
        assert {f"stitching/{k.name.split('/')[-1]}/{s}" for k in d.kernels
                for s in ("mean_us", "fastest_us")} <= tags


def test_tensorboard_covers_control_flow_branches(tmp_path):
    """Each tf.cond branch is planned and dumped apart: write_tensorboard writes a run
    for the function and one per branch (it wrote the function's alone)."""
    def fn(x, p):
        y = x * 2.0 + 1.0
        return tf.nn.softmax(tf.cond(p, lambda: tf.nn.relu(y) * 3.0 - 1.0,
                                     lambda: tf.exp(y) + y * y) + 1.0)

    f = stitching.function(fn, options=stitching.Options(dump_dir=str(tmp_path / "d")))
    f(tf.ones([4, 32]), tf.constant(True))
    branches = [r for _, r, _ in f.report.bodies if r is not None]
    assert len(branches) == 2 and all(r.dump_path for r in branches)
    runs = stitching.write_tensorboard(f, tmp_path / "logs")
    assert len(runs) == 3 and all(glob.glob(os.path.join(r, "events*")) for r in runs)
    dumps = [f.report.dump_path] + [r.dump_path for r in branches]
    assert sorted(map(os.path.basename, runs)) == sorted(map(os.path.basename, dumps))


def test_tensorboard_from_a_function_without_dump(tmp_path, monkeypatch):
    monkeypatch.delenv("STITCHING_DUMP_DIR", raising=False)
    f = stitching.function(lambda x: tf.nn.softmax(x * 2.0))
    with pytest.raises(si.DumpError, match="not been traced"):
        stitching.write_tensorboard(f, tmp_path)
    f(tf.ones([2, 8]))
    (run,) = stitching.write_tensorboard(f, tmp_path)
    assert glob.glob(os.path.join(run, "events*"))
    assert len(si.list_dumps(tmp_path / "dumps")) == 1


def test_load_dump_refuses_what_is_not_a_dump(tmp_path, transformer_dump):
    with pytest.raises(si.DumpError, match="no stitching dump"):
        si.load_dump(tmp_path)
    _, root, _ = transformer_dump
    (path,) = si.list_dumps(root)
    doc = json.load(open(os.path.join(path, "dump.json")))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "dump.json").write_text(json.dumps(dict(doc, version=99)))
    with pytest.raises(si.DumpError, match="version 99"):
        si.load_dump(bad)
    k = dict(doc["kernels"][0], files={"spec": "../../etc/passwd"})
    (bad / "dump.json").write_text(json.dumps(dict(doc, kernels=[k])))
    with pytest.raises(si.DumpError, match="leaves the dump directory"):
        si.load_dump(bad).kernels[0].spec()
    with pytest.raises(jsonschema.ValidationError):
        si.validate_dump(bad)


def test_drawings(transformer_dump):
    import matplotlib
    matplotlib.use("Agg")
    _, root, _ = transformer_dump
    d = si.load_dump(root)
    g = si.to_networkx(d)
    assert {n for n, a in g.nodes(data=True) if a["kernel"]} == \
        {m for k in d.kernels for m in k.nodes}
    ax = si.draw_graph(d, layout="layers")
    assert ax.texts and {t.get_text() for t in ax.texts} >= \
        {k.name.split("/")[-1] for k in d.kernels}
    peaks = {"bandwidth": 1e10, "flops": 1e11}
    ax = si.roofline(d, peaks)
    assert len(ax.lines) >= 1 + len(d.kernels)
    if shutil.which("dot"):                    # Graphviz's layout, when installed
        ax = si.draw_graph(d, layout="dot")
        assert {t.get_text() for t in ax.texts} >= {k.name.split("/")[-1] for k in d.kernels}
    else:                                      # asked for by name: says what is missing
        with pytest.raises(ValueError, match="Graphviz"):
            si.draw_graph(d, layout="dot")
    with pytest.raises(ValueError, match="layout must be one of"):
        si.draw_graph(d, layout="circle")


def test_a_part_of_the_graph_is_drawn_by_kernel_or_scope(transformer_dump):
    """A large model's whole graph is unreadable (~900 nodes for EfficientNetB0): a
    kernel or a name scope is drawn with what is within ``around`` edges of it, in
    the whole dump's colours; a name that matches nothing says what there is."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.collections import PathCollection
    _, root, _ = transformer_dump
    d = si.load_dump(root)
    g = si.to_networkx(d)

    def drawn(ax):
        (nodes,) = [c for c in ax.collections if isinstance(c, PathCollection)]
        return len(nodes.get_offsets())
    k = max(d.kernels, key=lambda k: len(k.nodes))
    mine = {v for v in k.nodes if v in g}
    ax = si.draw_graph(d, layout="layers", kernels=k.name.split("/")[-1], around=0)
    assert drawn(ax) == len(mine) and k.name.split("/")[-1] in {t.get_text() for t in ax.texts}
    near = mine | {u for v in mine for u in (*g.predecessors(v), *g.successors(v))}
    ax = si.draw_graph(d, layout="layers", kernels=[k.name], around=1)
    assert drawn(ax) == len(near) > len(mine)
    assert "the part drawn" in ax.get_title()
    scoped = sorted(v for v in mine if "/" in v)
    scope = scoped[0].rsplit("/", 1)[0] + "/" if scoped else sorted(mine)[0]
    ax = si.draw_graph(d, layout="layers", scope=scope, around=0)
    assert drawn(ax) == sum(v.startswith(scope) for v in g) >= 1
    from stitching.inspect.draw import kernel_colors
    colors = kernel_colors(d)
    assert len(set(colors.values())) == len(d.kernels)
    with pytest.raises(ValueError, match="no kernel named 'kernel_999'.*its kernels: kernel_"):
        si.draw_graph(d, kernels="kernel_999")
    with pytest.raises(ValueError, match="no node's name starts with 'nowhere/'"):
        si.draw_graph(d, scope="nowhere/")
    with pytest.raises(ValueError, match="around must be"):
        si.draw_graph(d, kernels=k.name, around=-1)


def test_kernel_colours_stay_distinct_past_twenty_kernels():
    """tab20 cycled gave kernel_3 and kernel_23 one colour; past 20 kernels the hues
    are spread so that no two of a model's kernels share one."""
    from types import SimpleNamespace
    dump = SimpleNamespace(kernels=[SimpleNamespace(name=f"stitching/kernel_{i}")
                                    for i in range(68)])
    from stitching.inspect.draw import kernel_colors
    colors = kernel_colors(dump)
    assert len(colors) == 68 and len(set(colors.values())) == 68


def test_layered_drawing_puts_a_weight_side_op_just_above_its_reader():
    """A node reading only weights goes to the layer above its first reader (a
    BatchNorm's rsqrt(var) * gamma beside the convolution output it scales), not to
    the top rows by its longest path from the inputs."""
    import networkx as nx
    from stitching.inspect.draw import _layers
    g = nx.DiGraph([("x", "a"), ("a", "b"), ("b", "c"), ("c", "mul"),
                    ("var", "rsqrt"), ("rsqrt", "mul")])
    depth = _layers(g)
    assert (depth["x"], depth["mul"]) == (0, 4)
    assert depth["rsqrt"] == 3 and depth["var"] == 2


def test_stitching_profile_1_names_no_device(monkeypatch):
    """STITCHING_PROFILE=1 turns the op's timing on; it must not be read as a device."""
    from stitching.plan import profiles
    monkeypatch.delenv("STITCHING_DEVICE_PROFILE")        # conftest pins a machine model
    monkeypatch.setattr(profiles, "measured_cpu", lambda: profiles.MACHINES["amd-avx2"])
    monkeypatch.setenv("STITCHING_PROFILE", "1")
    assert profiles.default() == profiles.calibrated(profiles.MACHINES["amd-avx2"])


_ENV_PROCESS = """
import tensorflow as tf, stitching
f = stitching.function(lambda x: tf.nn.softmax(x * 2.0))
for _ in range(4):
    f(tf.ones([2, 8]))
"""


def test_environment_dumps_and_profiles_a_process(tmp_path):
    """STITCHING_DUMP_DIR + STITCHING_PROFILE=1, nothing in the code: the dump gets
    its profile.json when the process ends."""
    import subprocess
    import sys
    env = dict(os.environ, STITCHING_DUMP_DIR=str(tmp_path), STITCHING_PROFILE="1",
               TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", _ENV_PROCESS], env=env, timeout=240,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = si.load_dump(tmp_path)
    si.validate_dump(d.path)
    (k,) = d.kernels
    assert k.measured["calls"] == 4 and k.measured["bytes"] == 4 * 2 * (2 * 8 * 4)


def test_baseline_planner_dump_records_refused_merges(tmp_path):
    """Planners without a cost model still explain themselves: the merges they refused."""
    f = stitching.function(lambda x: tf.nn.softmax(x * 2.0) + 1.0,
                           options=stitching.Options(dump_dir=str(tmp_path),
                                                     planner="baseline"))
    f(tf.ones([4, 16]))
    d = si.load_dump(tmp_path)
    si.validate_dump(d.path)
    assert d.plan["planner_decisions"] == []
    reasons = {m["reason"] for m in d.plan["refused_merges"]}
    assert "baseline (XLA-like loop fusion): a reduction ends a kernel" in reasons


def test_tfs_profiler_shows_each_stitched_kernel():
    """TensorBoard's profile: TF's executor traces an op that is not IsExpensive (a
    StitchedKernel runs inline) only at a verbose level profiles leave off; the op
    traces itself, one event per kernel per call, as TF names an op's event."""
    from stitching.testing.counting import profiled_ops
    f = stitching.function(lambda x: tf.nn.softmax(x * 2.0) + tf.nn.relu(x),
                           options=stitching.Options(background_compile=False))
    x = tf.random.normal([32, 64])
    f(x)
    seen = profiled_ops(lambda: [f(x) for _ in range(3)])
    assert len(f.report.kernels) == 1
    assert seen["StitchedKernel"] == 3, seen
