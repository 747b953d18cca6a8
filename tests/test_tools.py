"""The GPU harness's report path, which runs where there is no TensorFlow."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(REPO, "tools", "gpu_results", "h100_large_2026-11-22.json")


def test_gpu_section_renders_from_a_recorded_run_without_tensorflow(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\n<!-- suite:models -->\n## models\nkept\n<!-- /suite:models -->\n")
    code = textwrap.dedent(f"""
        import sys
        sys.argv = ["gpu_bench.py", "--render", {RUN!r}, "--markdown", {str(out)!r}]
        sys.path.insert(0, {os.path.join(REPO, "tools")!r})
        import gpu_bench
        rc = gpu_bench.main(sys.argv[1:])
        assert "tensorflow" not in sys.modules, "rendering imported TensorFlow"
        sys.exit(rc)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    text = out.read_text()
    assert "<!-- suite:gpu -->" in text and "<!-- /suite:gpu -->" in text
    assert "<!-- suite:models -->" in text and "kept" in text       # other sections stay
    rows = json.load(open(RUN))["rows"]
    section = text.split("<!-- suite:gpu -->")[1]
    assert all(f"| {r['pattern']} |" in section for r in rows)
    assert "geomean speedup:" in section and "bandwidth: worst" in section
    assert "ceiling: every pattern at the copy bandwidth would be" in section
    # the verdicts are computed from the rows, not copied
    assert "**FAIL** geomean >= 1.3x torch.compile: 0.70x" in section
    assert "**FAIL** none below 0.9x torch.compile:" in section


def test_a_run_on_another_machine_class_gets_its_own_section():
    """bench.py --markdown on a machine of another class than the home one writes
    ``models@<class>``, titled with the machine, and leaves the home class's table."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    from bench_lib.output import section_key, section_title
    home = {"cpu_class": "intel-avx512", "tf_onednn": True}
    zen4 = {"cpu_class": "amd-avx512", "cpu_model": "AMD EPYC (avx2, fma, avx512f)",
            "tf_onednn": True}
    assert section_key("models", home) == section_key("models", {}) == "models"
    assert section_key("models", zen4) == "models@amd_avx512"
    assert section_title("models", zen4) == \
        "models (the amd-avx512 machine: AMD EPYC, AVX-512, TF oneDNN on)"
    assert section_key("models", dict(zen4, cpu_class="amd-avx2", tf_onednn=False,
                                      planner="baseline")) == "models@amd_avx2@baseline"
    # an Intel AVX-512 CPU whose TF runs without oneDNN (a Skylake Xeon: no AVX512_VNNI)
    # is not the home class's model: its table stands beside the home one
    skylake = {"cpu_class": "intel-avx512", "cpu_model": "Intel(R) Xeon(R) Processor "
               "(avx2, fma, avx512f)", "tf_onednn": False}
    assert section_key("models", skylake) == "models@intel_avx512_onednn_off"
    assert section_title("models", skylake) == ("models (the intel-avx512 machine: "
                                                "Intel(R) Xeon(R) Processor, AVX-512, TF oneDNN off)")
    assert section_key("models", dict(zen4, tf_onednn=False)) == "models@amd_avx512_onednn_off"


def test_ablation_verdict_counts_a_row_slower_only_beyond_its_spread():
    """The ablation's "never slower" line fails on a row whose median is slower by more
    than the two rows' spread, not on one inside it; the strict lines (vs TF) are kept."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    from bench_lib import output

    def row(full, base, spread):
        t = lambda m: {"time": {"median_s": m, "q1_s": m * (1 - spread), "q3_s": m * (1 + spread)}}  # noqa: E731
        return {"modes": {"stitching": t(full), "baseline": t(base), "tf": t(base)}}
    name = lambda r: "case"  # noqa: E731
    within = [row(1.05, 1.0, 0.05)]          # 0.95x, spreads 10% wide
    beyond = [row(1.30, 1.0, 0.05)]          # 0.77x
    assert output._no_slower(within, "l", name, base="baseline", noise_ok=True).startswith("PASS")
    assert output._no_slower(beyond, "l", name, base="baseline", noise_ok=True).startswith("FAIL")
    assert output._no_slower(within, "l", name).startswith("FAIL")      # strict by default


def test_compile_table_shows_kernels_and_the_codes_compiled_for_them():
    sys.path.insert(0, os.path.join(REPO, "tools"))
    from bench_lib import output

    def row(codes):
        cold = {"ok": True, "first_call_s": 3.0, "kernels": 50, "compile_seconds": 1.8}
        if codes is not None:
            cold["codes"] = codes
        return {"name": "m", "batch": 1, "steps": {"stitching_cold": cold}}
    head, body = output.compile_table([row(5), row(None)])
    col = head.index("st kernels (codes)")
    assert [b[col] for b in body] == ["50 (5)", "50"]     # a run from before codes: kernels


def test_modes_are_timed_with_changing_predecessors(monkeypatch):
    """time_modes shuffles the order of the modes every repeat: each mode is timed
    `repeats` times, and no mode always runs right after the same other one (with a
    rotation 'stitching' always followed 'xla' and paid for what XLA left behind)."""
    from stitching.runtime import registry
    # nothing measuring (an earlier test's autotuned op may still be, in this process)
    monkeypatch.setattr(registry, "autotune_pending", list)
    sys.path.insert(0, os.path.join(REPO, "tools"))
    from bench_lib import measure
    from bench_lib.modes import Runner
    calls = []

    def fn_for(mode):
        return lambda *a: calls.append(mode)
    modes = ["tf", "xla", "stitching", "baseline"]
    runners = [Runner(m, fn_for(m)) for m in modes]
    out = measure.time_modes(runners, (), repeats=12, warmup=0, min_time=0.0,
                             lead_time=0.0)
    assert sorted(out) == sorted(modes) and all(out[m]["n"] == 12 for m in modes)
    # after the one calibration call each, every repeat is one untimed lead-in call
    # (lead_time=0: at least one) and then the timed one, of the same mode
    assert len(calls) == len(modes) + 12 * len(modes) * 2
    runs = calls[len(modes):]
    assert runs[0::2] == runs[1::2]
    timed = runs[1::2]
    for m in modes:
        before = [p for p, c in zip(timed, timed[1:]) if c == m]
        most = max(before.count(p) for p in set(before))
        assert most <= 0.6 * len(before), (m, before)   # rotated: 75% the same one


def test_timing_starts_once_no_autotuned_op_is_still_measuring(monkeypatch):
    """time_modes calls the stitched modes until stitching.runtime.autotune_pending()
    is empty before its repeats (a fresh cache's measuring calls were timed: Llama b8
    read 0.77x once); a class that stays pending (never called again, or unable to
    measure) stops it after `stall` rounds that decided nothing, not never."""
    from stitching.runtime import registry
    sys.path.insert(0, os.path.join(REPO, "tools"))
    from bench_lib import measure, modes
    from bench_lib.modes import Runner
    state = {"calls": 0, "decide_at": 5, "stuck": []}
    measuring = []          # per stitched call: was a class still measuring?

    def pending():
        left = [] if state["calls"] >= state["decide_at"] else [("h", 3)]
        return left + state["stuck"]

    def stitched(*a):
        measuring.append(bool(pending()))
        state["calls"] += 1
    monkeypatch.setattr(registry, "autotune_pending", pending)
    monkeypatch.setattr(modes, "_STUCK", set())
    runners = [Runner("tf", lambda *a: None), Runner("stitching", stitched)]
    assert modes.settle_autotune(runners, ()) == 5 and pending() == []
    # a class no runner decides: `stall` idle rounds, then timing goes on; the next
    # row does not wait for it again
    state.update(calls=0, decide_at=3, stuck=[("other", 9)])
    assert modes.settle_autotune(runners, (), stall=4) == 3 + 4
    state.update(calls=0, decide_at=2)
    assert modes.settle_autotune(runners, (), stall=4) == 2
    state.update(calls=0, decide_at=7, stuck=[])
    measuring.clear()
    out = measure.time_modes(runners, (), repeats=3, warmup=1, min_time=0.0,
                             lead_time=0.0)
    assert sorted(out) == ["stitching", "tf"]
    assert runners[1].info["autotune_settle_rounds"] == 6      # 1 warm-up call + 6
    # warm-up and settling measured; the calibration call and 3 x (lead-in, timed) not
    assert measuring == [True] * 7 + [False] * 7, measuring


def test_plan_audit_names_the_decisions_the_measurements_contradict():
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import plan_audit
    j = plan_audit.judge
    assert j(1, 1, 1.0, 0.5, 0.5, 0.1) == []                       # fused and faster
    assert j(1, 1, 1.0, 1.05, 1.05, 0.1) == []                     # slower within margin
    assert j(1, 1, 1.0, 1.2, 1.2, 0.1) == ["fused, but stock TF is faster"]
    assert j(0, 1, 1.0, 1.0, 0.5, 0.1) == ["left ops to TF that fused (greedy) run faster"]
    assert j(0, 0, 1.0, 1.0, 0.5, 0.1) == []                       # nothing legal to fuse
    # same kernel count, other grouping (or launch): greedy faster is a wrong decision
    assert j(1, 1, 2.0, 1.0, 0.5, 0.1, differ=True) == [
        "greedy's other grouping of the same ops runs faster"]
    assert j(1, 1, 2.0, 1.0, 0.5, 0.1, differ=False) == []         # same plan: noise


def test_plan_audit_fuzz_graphs_are_reproducible_and_audited(tmp_path):
    """--fuzz: graph i of a seed is the same program and inputs every time (a row can
    be rerun alone with --fuzz-index) and goes through the same audit as a pattern."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import numpy as np
    import plan_audit
    a, b = plan_audit.fuzz_case(7, 2, 0.05), plan_audit.fuzz_case(7, 2, 0.05)
    assert a[0] == b[0] and a[1] == b[1]
    assert all(np.array_equal(x.numpy(), y.numpy()) for x, y in zip(a[2], b[2]))
    assert plan_audit.fuzz_case(7, 3, 0.05)[1] != a[1] or \
        plan_audit.fuzz_case(7, 4, 0.05)[1] != a[1]
    name, program, args = a
    r = plan_audit.audit_fn(name, "fuzz", plan_audit.fuzz.build(program), args,
                            repeats=2, margin=0.1, dump_root=str(tmp_path))
    assert r["unfused_ms"] > 0 and r["search_ms"] > 0 and r["greedy_ms"] > 0
    assert isinstance(r["wrong"], list) and "predicted_saving_us" in r


def test_plan_audit_measures_a_pattern_against_the_models_view(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import plan_audit
    from stitching.testing import patterns
    r = plan_audit.audit_one(patterns.get("softmax_tf"), "small", repeats=2, margin=0.1,
                             dump_root=str(tmp_path))
    assert r["kernels"] == 1 and r["greedy_kernels"] == 1
    assert r["predicted"] > 0 and r["measured"] > 0 and r["tf_ms"] > 0
    assert isinstance(r["wrong"], list)


def test_mib_size_verdicts_apply_issue_31s_bars_per_size():
    """1/4/16/64 MiB rows get their own lines: geomean vs XLA >= 1.5x below 16 MiB and
    >= 2x from 16 MiB, and no pattern slower than XLA, each computed from the rows."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    from bench_lib import output

    def row(name, size, st, xla):
        t = lambda m: {"time": {"median_s": m, "q1_s": m, "q3_s": m}}  # noqa: E731
        return {"name": name, "size": size, "modes": {"stitching": t(st), "xla": t(xla),
                                                      "tf": t(xla)}}
    rows = [row("a", "4m", 1.0, 1.8), row("b", "4m", 1.0, 1.6),      # 1.70x geomean
            row("a", "16m", 1.0, 1.8), row("b", "16m", 1.0, 0.9)]    # 1.27x, b slower
    assert output.pattern_sizes(rows) == ["4m", "16m"]
    lines = output._mib_targets(rows)
    assert lines[0].startswith("PASS") and "4m: geomean stitched vs XLA >= 1.5x: 1.697x" in lines[0]
    assert lines[1].startswith("PASS")
    assert lines[2].startswith("FAIL") and ">= 2x: 1.273x" in lines[2]
    assert lines[3].startswith("FAIL") and "0.900x (b)" in lines[3]


def test_pool_line_table_compares_the_two_allocators_per_size():
    """tools/pool_line.py: per size, the geomean over patterns of the stitched/TF ratio
    under TF's allocator over the one under the pool (medians over rounds)."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import pool_line
    runs = {"tf": [{("a", "1m"): 1.0, ("b", "1m"): 0.5, ("a", "64m"): 0.9}],
            "pool": [{("a", "1m"): 1.0, ("b", "1m"): 0.5, ("a", "64m"): 0.6}]}
    lines = pool_line.table(runs, ["1m", "16m", "64m"])
    assert "1.000x  2 (worst 1.00x" in lines[1]
    assert "no rows measured" in lines[2]
    assert "1.500x  1 (worst 1.50x" in lines[3]                # the pool 1.5x faster


def test_op_breakdown_groups_executor_ops_and_xla_thunks_per_call():
    """tools/op_breakdown.py: executor events by op type, XLA thunks (an hlo_op stat)
    by name without their .N; runtime frames and thunk end markers left out."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import op_breakdown
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/host:CPU")
    plane.stat_metadata[1].name = "hlo_op"
    events = [("layer0/MatMul:_MklMatMul", 300, False), ("layer1/MatMul:_MklMatMul", 100, False),
              ("a/gather:GatherV2", 40, False), ("ExecutorState::Process", 999, False),
              ("__inference_f_12:__inference_f_12", 999, False), ("dot.3", 80, True),
              ("dot", 20, True), ("end: dot.3", 5, True), (" MatMul.58", 60, True),
              ("stitching/kernel_0:StitchedKernel", 999, False),      # the counters'
              ("layer0/attention:StitchedAttention", 70, False)]
    line = plane.lines.add(name="t")
    for i, (name, us, thunk) in enumerate(events):
        plane.event_metadata[i + 1].name = name
        ev = line.events.add(metadata_id=i + 1, duration_ps=us * 10**6)
        if thunk:
            ev.stats.add(metadata_id=1)
    events = op_breakdown.node_events(space)
    rows = op_breakdown.group_events(events, calls=2)
    assert rows == {"_MklMatMul": 200.0, "GatherV2": 20.0, "dot": 50.0, "MatMul": 30.0,
                    "StitchedAttention": 35.0}
    assert events[("_MklMatMul", "layer0/MatMul:_MklMatMul")] == [300.0]
    assert op_breakdown.split(rows) == {"contraction": 315.0, "memory": 20.0,
                                        "kernels": 0.0, "other": 0.0}


def test_op_breakdown_min_takes_each_nodes_fastest_call():
    """tools/op_breakdown.py --stat min: a call that lost its core to another process
    counts in the mean, not in the minimum; a node's events per call still count."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import op_breakdown
    events = {("MatMul", "a:MatMul"): [100.0, 900.0], ("MatMul", "b:MatMul"): [50.0, 70.0],
              ("AddV2", "c:AddV2"): [5.0, 6.0, 7.0, 8.0]}     # c: twice per call
    assert op_breakdown.group_events(events, calls=2) == {"MatMul": 560.0, "AddV2": 13.0}
    assert op_breakdown.group_events(events, calls=2, stat="min") == {"MatMul": 150.0,
                                                                      "AddV2": 10.0}
    with pytest.raises(ValueError, match="stat"):
        op_breakdown.group_events(events, calls=2, stat="median")


def test_op_breakdown_interleaved_trace_gives_each_event_to_the_call_around_it():
    """tools/op_breakdown.py --interleave: one profiler session, each call under a
    marker named for its mode; an op event belongs to the mode whose marker spans its
    start, on any thread's line; an event outside every call is dropped."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import op_breakdown
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/host:CPU")
    plane.stat_metadata[1].name = "hlo_op"
    names = ["op_breakdown call tf", "op_breakdown call xla", "a/MatMul:MatMul", "dot.2",
             "b/Mul:Mul"]
    for i, name in enumerate(names):
        plane.event_metadata[i + 1].name = name
    caller = plane.lines.add(name="python", timestamp_ns=1000)
    worker = plane.lines.add(name="worker", timestamp_ns=1000)
    us = 10**6                                  # picoseconds per microsecond
    caller.events.add(metadata_id=1, offset_ps=0, duration_ps=100 * us)        # tf call
    caller.events.add(metadata_id=2, offset_ps=200 * us, duration_ps=100 * us)  # xla call
    worker.events.add(metadata_id=3, offset_ps=10 * us, duration_ps=40 * us)    # in tf's
    worker.events.add(metadata_id=4, offset_ps=250 * us, duration_ps=30 * us,   # in xla's
                      stats=[xplane_pb2.XStat(metadata_id=1)])
    worker.events.add(metadata_id=5, offset_ps=150 * us, duration_ps=5 * us)    # between
    marks = {"op_breakdown call tf": "tf", "op_breakdown call xla": "xla"}
    per_mode = op_breakdown.node_events(space, marks)
    assert {m: dict(v) for m, v in per_mode.items()} == {
        "tf": {("MatMul", "a/MatMul:MatMul"): [40.0]}, "xla": {("dot", "dot.2"): [30.0]}}


def test_op_breakdown_splits_op_time_and_bounds_a_fuser_that_leaves_contractions():
    """tools/op_breakdown.py's ceiling: convolutions and GEMMs (fused or not) are TF's,
    memory-intensive ops (stitched kernels among them) are what fusing can remove, the
    rest neither; the bound is op time over op time without the memory-intensive ops."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import op_breakdown
    rows = {"Conv2D": 50.0, "_FusedConv2D": 10.0, "DepthwiseConv2dNative": 10.0,
            "_MklNativeFusedMatMul": 5.0, "Sigmoid": 12.0, "Pad": 3.0, "AddV2": 5.0,
            "StitchedKernel[Mul,Sigmoid]": 2.0, "ReadVariableOp": 3.0}
    parts = op_breakdown.split(rows)
    assert parts == {"contraction": 75.0, "memory": 20.0, "kernels": 2.0, "other": 3.0}
    assert op_breakdown.ceiling(parts) == pytest.approx(100.0 / 78.0)
    assert op_breakdown.ceiling({"contraction": 0.0, "memory": 1.0, "kernels": 0.0,
                                 "other": 0.0}) == float("inf")


def test_ceiling_table_names_the_rows_whose_bound_is_under_the_bar():
    """tools/ceiling.py: per row the shares of stock TF's op time, the bound, how much
    memory-intensive time stitching removed, the stitched op time's shares in kernels
    and in TF memory ops left, and TF's contractions stitched vs stock;
    the verdicts name every row whose ceiling is under issue 37's 1.4x."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import ceiling
    rows = [{"case": "resnet50", "batch": 1, "wall": {"tf": 60.0, "stitched": 55.0},
             "tf": {"contraction": 90.0, "memory": 10.0, "kernels": 0.0, "other": 0.0},
             "st": {"contraction": 90.0, "memory": 1.0, "kernels": 3.0, "other": 6.0},
             "ceiling": 100 / 90},
            {"case": "efficientnet_b0", "batch": 8, "wall": {"tf": 160.0, "stitched": 128.0},
             "tf": {"contraction": 50.0, "memory": 50.0, "kernels": 0.0, "other": 0.0},
             "st": {"contraction": 55.0, "memory": 5.0, "kernels": 15.0, "other": 5.0},
             "ceiling": 2.0}]
    head, body = ceiling.table(rows)
    assert body[0][4:] == ["1.09x", "90%", "10%", "1.11x", "60%", "3%", "1%", "1.00"]
    assert body[1][4:] == ["1.25x", "50%", "50%", "2.00x", "60%", "19%", "6%", "1.10"]
    lines = ceiling.verdicts(rows)
    assert lines[0].startswith("- ceiling geomean 1.49x over 2 rows")
    assert lines[1].endswith("resnet50/b1 1.11x")


def test_gemm_probe_states_tfs_single_thread_line_and_keeps_other_sections(tmp_path):
    """tools/gemm_probe.py: TF's oneDNN MatMul runs a product on one thread when
    4 (MN + K(M+N)) < L2; on a 2 MiB L2 that is the Transformer's feed-forward product
    at M = 128 but not at 256 (1 MiB L2: neither). Its section joins BENCHMARKS.md and
    leaves the others as they are."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import gemm_probe
    assert gemm_probe.single_threaded(128, 256, 1024, 2 << 20)
    assert gemm_probe.single_threaded(204, 256, 1024, 2 << 20)
    assert not gemm_probe.single_threaded(205, 256, 1024, 2 << 20)
    assert not gemm_probe.single_threaded(128, 256, 1024, 1 << 20)
    rows = [dict(m=128, single=True, matmul=455.0, bmm=377.0, cond=430.0, xla=330.0),
            dict(m=256, single=False, matmul=557.0, bmm=600.0, cond=607.0, xla=555.0)]
    head, body = gemm_probe.table(rows)
    assert body[0][1].startswith("1 ") and body[1][1] == "all"
    assert body[0][-1] == "0.73x" and body[1][-1] == "1.00x"
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\n<!-- suite:models -->\n## models\nkept\n<!-- /suite:models -->\n")
    from bench_lib.output import replace_sections
    blocks = [dict(m=128, matmul=1076.0, bmm=927.0, split=791.0, xla=834.0)]
    assert gemm_probe.block_table(blocks)[1][0][-1] == "1.36x"
    replace_sections(str(out), {"gemm": gemm_probe._markdown(rows, blocks, "measured here")})
    text = out.read_text()
    assert "kept" in text and "<!-- suite:gemm -->" in text and "| 128 | 1 (operands < L2) |" in text
    assert "| 128 | 1076 | 927 | 791 | 834 | 1.36x |" in text
    # an Eigen machine's section (its own key) with the OpenBLAS op's column, beside it
    for r, b in zip(rows, (400.0, 500.0)):
        r["blas"] = b
    blocks[0]["blas"] = 800.0
    replace_sections(str(out), {"gemm@amd_avx2": gemm_probe._markdown(
        rows, blocks, "measured there", "gemm@amd_avx2", onednn=False)})
    text = out.read_text()
    assert "<!-- suite:gemm -->" in text and "<!-- suite:gemm@amd_avx2 -->" in text
    assert "| 128 | 455 | 377 | 430 | 330 | 0.73x | 400 | 1.14x |" in text
    assert "| 128 | 1076 | 927 | 791 | 834 | 1.36x | 800 | 1.34x |" in text


def test_benchmarks_md_opens_with_a_summary_made_from_its_sections(tmp_path):
    """BENCHMARKS.md's summary: one line per section, with when and on what it ran, its
    headline geomean and its verdict count, rebuilt whenever a section is."""
    tools = os.path.join(REPO, "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    from bench_lib.output import replace_sections
    out = tmp_path / "BENCHMARKS.md"
    section = ("<!-- suite:models -->\n## models\n\nMeasured 2026-11-28 05:00:00 UTC on AMD "
               "EPYC (avx2, fma), class amd-avx2, widest vector ISA avx2, TF oneDNN off "
               "(2 cores, 23.5 GiB); Python 3.11.\n\n- models: stitched vs TF geomean 1.41x "
               "over 8/8 rows\n- **PASS** a\n- **FAIL** b\n- **PASS** c\n<!-- /suite:models -->")
    replace_sections(str(out), {"models": section})
    text = out.read_text()
    head = text[:text.index("<!-- suite:models -->")]
    assert "## Summary" in head
    line = next(ln for ln in head.splitlines() if ln.startswith("- **models**"))
    assert "2026-11-28 05:00:00 UTC" in line and "TF oneDNN off" in line
    assert "stitched vs TF geomean 1.41x" in line and "2 PASS, 1 FAIL" in line


def test_short_suite_table_and_bars_from_recorded_rounds(tmp_path):
    """The short suite's cells are the median round of whole-process times; its bars
    are the issue's (warm <= 1.1x stock TF, cold <= XLA), and a failed mode fails its
    job's bars instead of being left out."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    from bench_lib import output, short, suites

    def mode(*walls, loss=1.0):
        runs = [{"ok": True, "process_wall_s": w, "job_s": w - 5,
                 "result": {"fit_loss": loss}} for w in walls]
        return suites.median_run(runs, "process_wall_s", 2)
    ok = {"suite": "short", "name": "mlp_fit", "rounds": 3, "steps": {
        "tf": mode(7.0, 8.0, 7.5), "xla": mode(9.0, 8.5, 12.0),
        "stitching_cold": mode(8.0, 8.4, 8.2, loss=1.0001),
        "stitching_warm": mode(8.0, 8.1, 8.2)}}
    ok["steps"]["stitching_cold"]["tiers"] = {"train": {"stock": 16, "stitched": 0,
                                                        "from": 0}}
    ok["steps"]["stitching_warm"]["tiers"] = {
        "train": {"stock": 0, "stitched": 16, "from": 1},
        "test": {"stock": 0, "stitched": 8, "from": 1}}
    failed = {"suite": "short", "name": "cnn_fit", "rounds": 1, "steps": {
        "tf": mode(8.0), "xla": mode(12.0), "stitching_warm": mode(9.0),
        "stitching_cold": {"ok": False, "error": "child exited 1: boom"}}}
    head, body = short.short_table([ok, failed])
    mlp = dict(zip(head, body[0]))
    assert mlp["TF process s"] == "7.50" and mlp["st cold process s"] == "8.20"
    assert mlp["cold / XLA"] == "0.91x" and mlp["warm / TF"] == "1.08x"
    assert mlp["result vs TF, XLA/cold/warm (rel)"] == "0.0e+00 / 1.0e-04 / 0.0e+00"
    assert mlp["steps stock/stitched, cold | warm"] == "train 16/0 | train 0/16, test 0/8"
    assert dict(zip(head, body[1]))["st cold process s"] == "FAILED"
    assert short.target_lines([ok, failed]) == [
        "PASS  short mlp_fit: warm process <= 1.1x stock TF's: 1.08x",
        "PASS  short mlp_fit: cold process <= XLA's: 0.91x",
        "FAIL  short cnn_fit: a mode failed"]
    md = tmp_path / "BENCHMARKS.md"
    meta = {"date": "d", "cpu": "c", "cores": 2, "python": "3", "tensorflow": "t",
            "numba": "n", "stitching_rev": "r", "tf_intra_op_threads": 2}
    output.write_markdown(str(md), {"short": [ok, failed]}, meta)
    text = md.read_text()
    assert "<!-- suite:short -->" in text and "mlp_fit rounds (process s): tf 7.0/8.0/7.5" in text
    assert "- **FAIL** short cnn_fit: a mode failed" in text


def test_scalar_bench_section_judges_cpu_time_over_tf_functions_retrace(tmp_path):
    """tools/scalar_bench.py --markdown: its section from recorded rows, the verdict
    from the worst row's CPU time over tf.function's, the summary line from it."""
    import argparse
    tools = os.path.join(REPO, "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    import scalar_bench
    from bench_lib.output import replace_sections

    def row(tf_cpu, st_cpu):
        mode = {"first_ms": 10.0, "new_value_ms": 9.0, "max_abs_diff": 1e-6}
        return {"tf": dict(mode, new_value_cpu_ms=tf_cpu),
                "stitching": dict(mode, new_value_cpu_ms=st_cpu),
                "over_tf_ms": 0.0, "over_tf_cpu_ms": st_cpu - tf_cpu}
    args = argparse.Namespace(values=16, repeats=3)
    for rows, verdict in (({"a": row(8.0, 11.0), "b": row(20.0, 24.5)}, "PASS"),
                          ({"a": row(8.0, 11.0), "b": row(20.0, 26.0)}, "FAIL")):
        text = scalar_bench.section(rows, args, (1.0, 1.2))
        assert f"- **{verdict}** a new value costs at most" in text
        assert "| b | 10.0 / 10.0 |" in text
        out = tmp_path / "BENCHMARKS.md"
        replace_sections(str(out), {"python_scalars": text})
        assert "- **python_scalars" in out.read_text()


def test_a_section_without_its_end_marker_stops_the_rewrite_instead_of_vanishing(tmp_path):
    """replace_sections rewrites the whole file from the sections it finds: one whose
    end marker is missing (hand-edited) would not be found and would be dropped
    silently (BENCHMARKS.md lost its models@amd_avx512 table that way). It refuses,
    naming the section, and leaves the file as it was; so it does for text outside
    every section."""
    tools = os.path.join(REPO, "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    from bench_lib.output import replace_sections
    out = tmp_path / "BENCHMARKS.md"
    good = "<!-- suite:models -->\n## models\nkept\n<!-- /suite:models -->"
    broken = "<!-- suite:models@amd_avx512 -->\n## models (amd)\ntable, no end marker\n"
    before = f"# Benchmarks\n\n{good}\n\n{broken}\n"
    out.write_text(before)
    new = {"chains@amd_avx512": "<!-- suite:chains@amd_avx512 -->\n## chains\n"
                                "<!-- /suite:chains@amd_avx512 -->"}
    with pytest.raises(ValueError, match=r"models@amd_avx512"):
        replace_sections(str(out), new)
    assert out.read_text() == before
    with pytest.raises(ValueError, match=r"gemm \(the new text\)"):
        replace_sections(str(tmp_path / "other.md"), {"gemm": "<!-- suite:gemm -->\n## gemm\n"})
    out.write_text(f"# Benchmarks\n\n{good}\n\n{broken}<!-- /suite:models@amd_avx512 -->\n")
    replace_sections(str(out), new)
    text = out.read_text()
    assert all(f"<!-- /suite:{k} -->" in text
               for k in ("models", "models@amd_avx512", "chains@amd_avx512"))
    out.write_text(text + "\na note written after the last section\n")   # would vanish
    with pytest.raises(ValueError, match="a note written after"):
        replace_sections(str(out), new)
