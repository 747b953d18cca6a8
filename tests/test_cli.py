"""stitching-rewrite as users expect a command-line tool to behave: it does not overwrite
its input unasked, refuses flags that do not apply to the input's kind, prints a report
shared by several signatures once, has --version, flags for the Options, plain help."""
import os

import numpy as np
import pytest
import tensorflow as tf

from stitching.testing.models import frozen_softmax_graph_def
from stitching.tf import cli


@pytest.fixture
def graph(tmp_path):
    src = tmp_path / "g.pb"
    src.write_bytes(frozen_softmax_graph_def().SerializeToString())
    return src


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """Two signature keys over one function, as Keras' export writes serve and
    serving_default."""
    class M(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 16], tf.float32, name="x")])
        def f(self, x):
            return {"y": tf.nn.softmax(x * 3.0)}
    m = M()
    d = tmp_path_factory.mktemp("cli") / "sm"
    tf.saved_model.save(m, str(d), signatures={"serve": m.f, "serving_default": m.f})
    return d


def _usage_error(capsys, argv, match):
    with pytest.raises(SystemExit) as e:
        cli.main([str(a) for a in argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert match in err, err


def test_refuses_to_overwrite_its_source(graph, saved_model, capsys):
    before = graph.read_bytes()
    _usage_error(capsys, [graph, graph, "--outputs", "y"], "--overwrite")
    assert graph.read_bytes() == before
    _usage_error(capsys, [saved_model, saved_model], "would overwrite the input")
    _usage_error(capsys, [saved_model, saved_model / "inner"], "would overwrite the input")


def test_overwrite_replaces_a_graph_def_in_place(graph):
    assert cli.main([str(graph), str(graph), "--outputs", "y", "--overwrite"]) == 0
    gd = tf.compat.v1.GraphDef.FromString(graph.read_bytes())
    assert sum(n.op == "StitchedKernel" for n in gd.node) == 1
    assert os.path.isdir(str(graph) + ".kernels")
    assert not [p for p in os.listdir(graph.parent) if p.startswith(".stitching-rewrite-")]


def test_flags_that_do_not_apply_to_the_input_kind(graph, saved_model, tmp_path, capsys):
    _usage_error(capsys, [saved_model, tmp_path / "o", "--outputs", "y"],
                 "--outputs applies to a GraphDef")
    _usage_error(capsys, [graph, tmp_path / "o.pb", "--signature", "serve"],
                 "--signature applies to a SavedModel")


def test_a_report_shared_by_two_signatures_prints_once(saved_model, tmp_path, capsys):
    assert cli.main([str(saved_model), str(tmp_path / "out"), "--no-kernels"]) == 0
    out = capsys.readouterr().out
    assert out.count("stitching report for") == 1, out
    assert "[serve, serving_default]" in out
    loaded = tf.saved_model.load(str(tmp_path / "out"))
    x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    np.testing.assert_allclose(loaded.signatures["serve"](x=x)["y"], tf.nn.softmax(x * 3.0),
                               rtol=1e-5, atol=1e-6)


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("stitching 0.")


def test_option_flags_reach_options():
    ap = cli._parser()
    o = cli._options(ap, ap.parse_args(["a.pb", "b.pb", "--planner", "greedy", "--min-ops",
                                        "1", "--no-seq-split", "--no-gemm",
                                        "--autotune=1.3", "--xla-gemm"]))
    assert (o.planner, o.min_ops, o.seq_split, o.gemm, o.einsum) == ("greedy", 1, False,
                                                                    False, True)
    assert o.xla_gemm
    assert o.autotune and o.autotune_margin == 1.3 and o.fallback
    # --autotune before the paths takes its default margin, not the path as one
    for argv in (["--autotune", "a.pb", "b.pb"], ["a.pb", "b.pb", "--autotune"],
                 ["--autotune", "1.5", "a.pb", "b.pb"], ["--autotune=1.5", "a.pb", "b.pb"]):
        args = ap.parse_args(cli._flag_margins(argv))
        assert (args.src, args.dst) == ("a.pb", "b.pb"), argv
        o = cli._options(ap, args)
        assert o.autotune and o.autotune_margin == (1.5 if "1.5" in str(argv) else 1.3)
    o = cli._options(ap, ap.parse_args(["a.pb", "b.pb", "--no-fallback"]))
    assert not o.fallback and not o.autotune
    # every flag's dest is an Options field
    import dataclasses
    from stitching.options import Options
    fields = {f.name for f in dataclasses.fields(Options)}
    assert {field for _, field, _ in cli._OPTION_FLAGS} <= fields


@pytest.mark.parametrize("flag,value", [("--min-ops", "0"), ("--autotune", "0.5")])
def test_a_bad_option_value_is_a_usage_error_naming_the_flag(graph, tmp_path, capsys,
                                                               flag, value):
    _usage_error(capsys, [graph, tmp_path / "o.pb", flag, value], f"{flag} must be")
    assert not (tmp_path / "o.pb").exists()


def test_a_report_path_that_cannot_be_written_is_refused_before_the_rewrite(
        graph, tmp_path, capsys):
    for bad in (tmp_path, tmp_path / "missing" / "r.json"):
        _usage_error(capsys, [graph, tmp_path / "o.pb", "--report", bad], "--report")
    assert not (tmp_path / "o.pb").exists()


def test_outputs_may_be_listed_with_spaces(graph, tmp_path):
    out = tmp_path / "o.pb"
    name = frozen_softmax_graph_def().node[-1].name
    assert cli.main([str(graph), str(out), "--outputs", f" {name} , "]) == 0 and out.exists()


def test_a_graph_file_cut_at_a_node_boundary_is_refused(graph, tmp_path, capsys):
    """A binary GraphDef cut after a whole node still parses, less its last nodes (the
    output among them); TF writes ``versions`` last, so its absence names the cut."""
    data = graph.read_bytes()
    gd = tf.compat.v1.GraphDef.FromString(data)
    cut = tf.compat.v1.GraphDef()
    cut.node.extend(gd.node[:-1])
    cut_file = tmp_path / "cut.pb"
    cut_file.write_bytes(data[:len(cut.SerializeToString())])
    assert cli.main([str(cut_file), str(tmp_path / "o.pb")]) == 1
    err = capsys.readouterr().err
    assert "truncated" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o.pb").exists()


def test_help_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    assert "``" not in text and "examples:" in text and "--planner" in text


def test_a_tf1_while_loop_is_refused_naming_its_node(tmp_path, capsys):
    """freeze_graph's form of a tf.compat.v1.while_loop (Enter/Merge/NextIteration/Exit)
    is a cycle; the error names the file and the back-edge node, not a bare 'graph has
    a cycle'."""
    tf.compat.v1.disable_control_flow_v2()
    try:
        g = tf.Graph()
        with g.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [None, 16], name="x")
            _, y = tf.compat.v1.while_loop(lambda i, v: i < 3,
                                           lambda i, v: (i + 1, tf.sigmoid(v * 1.5)), [0, x])
            tf.identity(tf.nn.softmax(y), name="out")
    finally:
        tf.compat.v1.enable_control_flow_v2()
    src = tmp_path / "v1_while.pb"
    src.write_bytes(g.as_graph_def().SerializeToString())
    assert cli.main([str(src), str(tmp_path / "o.pb"), "--outputs", "out"]) == 1
    err = capsys.readouterr().err
    assert "v1_while.pb" in err and "NextIteration" in err and "TF1 while loop" in err


def test_no_stale_kernels_beside_or_inside_an_output(graph, saved_model, tmp_path, capsys):
    """A GraphDef written to a directory fails before anything is written; --no-kernels
    removes an earlier run's sidecar; an existing SavedModel directory is replaced only
    with --overwrite, and then whole (no old model's kernel assets left in it)."""
    (tmp_path / "d").mkdir()
    assert cli.main([str(graph), str(tmp_path / "d")]) == 1
    assert "is a directory" in capsys.readouterr().err
    assert not (tmp_path / "d.kernels").exists() and not os.listdir(tmp_path / "d")
    out = tmp_path / "o.pb"
    assert cli.main([str(graph), str(out)]) == 0 and (tmp_path / "o.pb.kernels").is_dir()
    assert cli.main([str(graph), str(out), "--no-kernels"]) == 0
    assert not (tmp_path / "o.pb.kernels").exists()
    old = tmp_path / "old_model"
    old.mkdir()
    (old / "stale.so").write_bytes(b"x")
    _usage_error(capsys, [saved_model, old], "not empty")
    assert cli.main([str(saved_model), str(old), "--overwrite"]) == 0
    assert not (old / "stale.so").exists() and (old / "saved_model.pb").exists()
    assert os.path.isdir(saved_model) and (saved_model / "saved_model.pb").exists()
