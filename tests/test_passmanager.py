"""The driver as a pass manager (tf/passmanager.py, tf/pipeline.py): each pass entered
once, in table order, the frontend once; per-pass timing, dumps and verification."""
import dataclasses
import functools
import inspect
import os

import numpy as np
import pytest
import tensorflow as tf

from stitching import Options
from stitching.tf import frontend, passmanager, pipeline


def _graph():
    """A small graph: one fusible chain, a 2-D weight BatchMatMul (the gemm pass)."""
    w = tf.constant(np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4))

    def fn(x):
        y = tf.nn.relu(x * 2.0) + 1.0
        return tf.linalg.matmul(y, w) * 0.5
    cf = tf.function(fn).get_concrete_function(tf.TensorSpec([None, 3, 8], tf.float32))
    return cf.graph.as_graph_def(), [t.name for t in cf.outputs]


def _stitch(options=Options(), name="walk"):
    gdef, fetches = _graph()
    return pipeline.stitch_graph_def(gdef, fetches, (), options, name=name)


def _spied(table, events):
    def wrap(p):
        @functools.wraps(p.run)
        def run(ctx):
            events.append(p.name)
            return p.run(ctx)
        return dataclasses.replace(p, run=run)
    return tuple(wrap(p) for p in table)


def test_a_graph_enters_each_pass_once_in_table_order_and_the_frontend_once(monkeypatch):
    events = []
    monkeypatch.setattr(pipeline, "BEFORE_PLANNING", _spied(pipeline.BEFORE_PLANNING, events))
    monkeypatch.setattr(pipeline, "AFTER_PLANNING", _spied(pipeline.AFTER_PLANNING, events))
    depth = [0]
    for name, fn in list(vars(frontend).items()):
        if inspect.isfunction(fn) and fn.__module__ == frontend.__name__:
            def spy(*a, _fn=fn, _name=name, **k):
                if depth[0] == 0:                  # entries, not the frontend's own calls
                    events.append(f"frontend.{_name}")
                depth[0] += 1
                try:
                    return _fn(*a, **k)
                finally:
                    depth[0] -= 1
            monkeypatch.setattr(frontend, name, spy)
    rep = _stitch(Options(autotune=True, xla_gemm=True, variable_updates=True,  # every pass
                          exclude="no-such-node")).report       # enters
    names = [p.name for p in pipeline.BEFORE_PLANNING + pipeline.AFTER_PLANNING]
    assert [e for e in events if not e.startswith("frontend.")] == names
    assert [e for e in events if e.startswith("frontend.")] == ["frontend.to_ir"]
    assert events.index("frontend.to_ir") == events.index("lift") + 1
    assert list(rep.pass_seconds) == names
    assert all(s >= 0 for s in rep.pass_seconds.values())


def test_a_pass_turned_off_by_its_option_is_not_run_nor_timed(intel_plan):
    rep = _stitch(Options(gemm=False, seq_split=False, fused_attention=False)).report
    assert "gemm" not in rep.pass_seconds and "seqsplit" not in rep.pass_seconds
    assert "autotune" not in rep.pass_seconds          # off by default
    assert "attention" not in rep.pass_seconds          # turned off
    assert {"grappler", "lift", "rewrite", "prune"} <= rep.pass_seconds.keys()
    assert "pass_seconds" in rep.to_dict()
    on = _stitch().report
    assert "gemm" in on.pass_seconds
    assert any("BatchMatMul" in n for n in on.notes)
    assert not any("BatchMatMul" in n for n in rep.notes)


def test_a_new_pass_is_one_table_line_and_its_note_reaches_the_report(monkeypatch):
    seen = []

    def run(ctx):
        seen.append((len(ctx.graph_def.node), ctx.ir is not None))
        return "the counting pass counted"
    extra = passmanager.Pass("count", run)
    monkeypatch.setattr(pipeline, "AFTER_PLANNING", pipeline.AFTER_PLANNING + (extra,))
    rep = _stitch().report
    assert seen and seen[0][1]
    assert rep.notes[-1] == "the counting pass counted"
    assert list(rep.pass_seconds)[-1] == "count"


def test_dump_passes_writes_the_graph_after_the_passes_it_names(tmp_path):
    rep = _stitch(Options(dump_dir=str(tmp_path), dump_passes="^(grappler|rewrite)$")).report
    files = sorted(os.listdir(os.path.join(rep.dump_path, "passes")))
    order = list(rep.pass_seconds)
    want = [f"{order.index(n) + 1:02d}_{n}.{ext}" for n in ("grappler", "rewrite")
            for ext in ("pb", "pbtxt")]
    assert files == sorted(want)
    rewritten = open(os.path.join(rep.dump_path, "passes", want[3])).read()   # .pbtxt
    assert "StitchedKernel" in rewritten
    plain = _stitch(Options(dump_dir=str(tmp_path / "plain"))).report
    assert not os.path.exists(os.path.join(plain.dump_path, "passes"))


def test_dump_passes_must_be_a_regular_expression():
    with pytest.raises(ValueError, match="dump_passes"):
        Options(dump_passes="seqsplit|(")
    with pytest.raises(TypeError, match="dump_passes"):
        Options(dump_passes=3)


def test_verify_names_the_pass_that_broke_the_graph(monkeypatch):
    def breaks(ctx):
        ctx.graph_def.node.add(name="dangling", op="Identity", input=["no_such_node"])
    bad = passmanager.Pass("breaks", breaks)
    monkeypatch.setattr(pipeline, "AFTER_PLANNING",
                        pipeline.AFTER_PLANNING[:2] + (bad,) + pipeline.AFTER_PLANNING[2:])
    with pytest.raises(ValueError, match="not valid after the 'breaks' pass"):
        _stitch(Options(verify=True))
    monkeypatch.undo()
    assert _stitch(Options(verify=True)).report.kernels     # the real passes verify clean


def test_the_front_doors_import_at_the_top_and_old_names_still_import():
    import stitching
    import stitching.keras
    from stitching.cli import main
    from stitching.keras import stitch
    from stitching.saved_model import load_saved_model, rewrite_saved_model
    assert callable(stitch) and callable(main) and callable(rewrite_saved_model)
    assert stitching.keras.stitch is stitch and callable(load_saved_model)
    import stitching.tf.keras as old_keras
    from stitching.tf import cli as old_cli
    from stitching.tf import seqsplit as old_seqsplit
    from stitching.tf.passes import seqsplit
    assert old_keras is stitching.keras and old_cli is stitching.cli
    assert old_seqsplit is seqsplit and seqsplit.__spec__.name == "stitching.tf.passes.seqsplit"
    assert callable(stitching.function) and stitching.rewrite_graph_def is stitching.cli.rewrite_graph_def
