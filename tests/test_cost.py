"""Cost model against pinned device profiles (TF-free): delta and latency evaluators."""
import json
import os
import warnings

import pytest

from irbuild import F, G, layernorm
from stitching.ir.builder import SpecBuilder
from stitching.plan import cost, profiles
from stitching.plan.cost import GraphCosts, choose_launch, kernel_shape

CPU = profiles.get("cpu-reference")
V100, A100, H100 = (profiles.get(n) for n in ("v100", "a100", "h100"))


def costs(g, profile=CPU):
    return GraphCosts(g, profile, g.topo_order())


def pattern(c, *names):
    return frozenset(c.index[n] for n in names)


def ln_spec(rows, cols):
    b = SpecBuilder()
    x = b.input(F, (rows, cols))
    m = b.Mean(x, axes=[1], keep_dims=True)
    d = b.Sub(x, m)
    v = b.Mean(b.Square(d), axes=[1], keep_dims=True)
    return b.build([b.Mul(d, b.Rsqrt(b.Add(v, b.const(1e-5))))])


def ew_spec(rows, cols):
    b = SpecBuilder()
    x = b.input(F, (rows, cols))
    return b.build([b.Neg(b.Exp(x))])


# ---- profiles ------------------------------------------------------------------------

def test_pinned_gpu_profiles_carry_published_specs():
    assert (V100.bandwidth, V100.units, V100.scratch_per_unit) == (900e9, 80, 96 << 10)
    assert (A100.bandwidth, A100.units, A100.scratch_per_task) == (1555e9, 108, 163 << 10)
    assert (H100.bandwidth, H100.units, H100.scratch_per_unit) == (3350e9, 132, 228 << 10)
    for p in (V100, A100, H100):
        assert p.backend == "cuda" and p.registers_per_unit == 65536
        assert p.max_threads_per_task == 1024 and p.max_threads_per_unit == 2048


def test_bandwidth_grows_with_active_lanes_until_the_device_saturates():
    assert V100.bw_at(1) == pytest.approx(V100.bw_per_lane)
    assert V100.bw_at(V100.lanes // 2) == pytest.approx(V100.bandwidth / 2)
    assert V100.bw_at(10 * V100.lanes) == V100.bandwidth
    assert CPU.bw_at(1) == CPU.bw_per_lane < CPU.bw_at(2) == CPU.bandwidth


def test_unknown_profile_name_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="v100"):
        profiles.get("tpu")


@pytest.fixture
def fake_measure(tmp_path, monkeypatch):
    """(the profile ``measure_cpu`` returns, [one entry per measurement]): the cache
    in ``tmp_path``, no installed default, a fresh process's memo."""
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(profiles, "_DEFAULT_ROOT", str(tmp_path / "no-default"))
    calls = []
    fake = profiles.with_overrides(CPU, name="cpu", measured=True)
    monkeypatch.setattr(profiles, "measure_cpu", lambda: calls.append(1) or fake)
    monkeypatch.setattr(profiles, "_memo", {})
    return fake, calls


def test_measured_cpu_profile_is_cached_on_disk(tmp_path, monkeypatch, fake_measure):
    fake, calls = fake_measure
    assert profiles.measured_cpu() == fake and len(calls) == 1
    saved = json.loads((tmp_path / profiles.CACHE_FILE).read_text())
    assert saved["profile"]["bandwidth"] == CPU.bandwidth
    monkeypatch.setattr(profiles, "_memo", {})          # a new process: read from disk
    assert profiles.measured_cpu() == fake and len(calls) == 1
    saved["fingerprint"] = "another machine"
    (tmp_path / profiles.CACHE_FILE).write_text(json.dumps(saved))
    monkeypatch.setattr(profiles, "_memo", {})
    profiles.measured_cpu()
    assert len(calls) == 2                              # remeasured for this machine
    # an install-time profile in the default cache serves an empty kernel cache
    monkeypatch.setattr(profiles, "_DEFAULT_ROOT", str(tmp_path))
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setattr(profiles, "_memo", {})
    assert profiles.measured_cpu() == fake and len(calls) == 2


@pytest.mark.parametrize("field,value", [("bandwidth", 0), ("units", 0),
                                         ("bw_per_lane", float("nan")), ("lanes", -2)])
def test_a_damaged_measured_profile_is_measured_again_with_a_warning(
        tmp_path, monkeypatch, fake_measure, field, value):
    """The stored measurement's numbers are checked as a profile file's: a 0 or NaN
    there (a damaged or edited file) failed every plan deep in the cost model
    (ZeroDivisionError, IndexError) without naming the file."""
    fake, calls = fake_measure
    profiles.measured_cpu()
    path = tmp_path / profiles.CACHE_FILE
    saved = json.loads(path.read_text())
    saved["profile"][field] = value
    path.write_text(json.dumps(saved))
    monkeypatch.setattr(profiles, "_memo", {})
    with pytest.warns(RuntimeWarning, match=f"{path}: {field} must be a positive number"):
        assert profiles.measured_cpu() == fake
    assert len(calls) == 2
    assert json.loads(path.read_text())["profile"][field] == getattr(CPU, field)


def test_real_cpu_measurement_is_physically_sensible(tmp_path, monkeypatch):
    """Properties of the live machine's measurement, never its numbers."""
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path))
    p = profiles.measure_cpu()
    assert p.backend == "cpu" and p.measured and p.lanes == p.units >= 1
    assert 0 < p.bw_per_lane <= p.bandwidth <= p.cache_bandwidth / 4
    assert p.transcendental_per_s > 0 and p.caches.get("l2", 0) > 0
    assert p.isa in profiles.VECTOR_BYTES and p.vector_bytes == profiles.VECTOR_BYTES[p.isa]
    assert p.measured_at and p.cpu_class.endswith(p.isa.replace("avx512f", "avx512"))
    assert {"bandwidth", "transcendental_per_s", "others_busy"} <= set(p.spread)
    assert p.provisional == bool(p.why_provisional)      # provisional says why


def _measurement(provisional, bandwidth, exp, why="other processes used 90% of the CPUs"):
    return profiles.with_overrides(
        profiles.MACHINES["amd-avx2"], name="cpu", bandwidth=bandwidth,
        bw_per_lane=bandwidth, transcendental_per_s=exp, provisional=provisional,
        why_provisional=why if provisional else "", source="cpu (measured)", spread={})


def test_a_provisional_measurement_is_measured_again_and_the_best_kept(tmp_path,
                                                                       monkeypatch):
    """Measured while busy: each later process measures again (at most MAX_ATTEMPTS in
    all), keeping each throughput's best median; the first quiet one is final."""
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(profiles, "_DEFAULT_ROOT", str(tmp_path / "no-default"))
    runs = iter([_measurement(True, 4e9, 5e8), _measurement(True, 7e9, 2e8),
                 _measurement(False, 8e9, 8e8)])
    calls = []
    monkeypatch.setattr(profiles, "measure_cpu", lambda: calls.append(1) or next(runs))

    def new_process():
        monkeypatch.setattr(profiles, "_memo", {})
        return profiles.measured_cpu()
    p = new_process()
    assert p.provisional and p.bandwidth == 4e9 and profiles.measured_cpu() is p
    p = new_process()
    assert p.provisional and (p.bandwidth, p.transcendental_per_s) == (7e9, 5e8)
    assert "best of 2 provisional" in p.source
    p = new_process()
    assert not p.provisional and p.bandwidth == 8e9
    assert new_process() == p and len(calls) == 3             # final: not measured again


def test_a_process_that_waited_for_anothers_measurement_takes_it(tmp_path, monkeypatch):
    """Cold processes starting together (a server's workers) each measured the machine,
    every measurement provisional (the others were the load): four made 20, 1-3.6 s
    each, and lost each other's attempt counts.  One measures at a time now; one that
    waited takes the measurement made meanwhile, even a provisional one.  A compile
    worker never measures a provisional profile again: it emits code with its parent's."""
    import threading
    from stitching import cachedir
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(profiles, "_DEFAULT_ROOT", str(tmp_path / "no-default"))
    monkeypatch.setattr(profiles, "_memo", {})
    calls = []
    monkeypatch.setattr(profiles, "measure_cpu",
                        lambda: calls.append(1) or _measurement(True, 9e9, 9e8))
    path = profiles.cache_path()
    other = _measurement(True, 5e9, 4e8)
    got = []
    with cachedir.locked(path + ".lock") as waited:     # the other process measures
        assert not waited
        t = threading.Thread(target=lambda: got.append(profiles.measured_cpu()))
        t.start()
        t.join(0.3)
        assert t.is_alive()                             # it waits for the measurement
        profiles._write_cache(path, profiles._fingerprint(), other)
    t.join(10)
    assert got == [other] and calls == []
    # the next process measures again (provisional, 1 attempt of MAX_ATTEMPTS)
    monkeypatch.setattr(profiles, "_memo", {})
    p = profiles.measured_cpu()
    assert len(calls) == 1 and p.bandwidth == 9e9 and profiles._attempts(p) == 2
    # a compile worker takes the stored provisional profile as it is
    monkeypatch.setattr(profiles, "_memo", {})
    monkeypatch.setattr(profiles, "remeasure_provisional", False)
    assert profiles.measured_cpu() == p and len(calls) == 1


def test_a_provisional_profile_plans_with_its_classs_model(monkeypatch):
    busy = _measurement(True, 2e9, 1.5e8)
    got = profiles.settled(busy)
    model = profiles.MACHINES["amd-avx2"]
    assert (got.bandwidth, got.transcendental_per_s) == (model.bandwidth,
                                                         model.transcendental_per_s)
    assert got.caches == busy.caches and "provisional (other processes" in got.source
    unknown = profiles.with_overrides(busy, cpu_class="arm-neon")
    assert profiles.settled(unknown) is unknown              # no model: its own numbers


def test_a_class_model_lends_its_throughputs_never_its_machine_facts():
    """A Skylake Xeon (family 6 model 85: AVX-512 without AVX512_VNNI, 1 MiB L2) is of
    the intel-avx512 class, whose model is an Emerald Rapids with TF's oneDNN on; TF
    runs without oneDNN there.  It plans with the class's throughputs and its own
    caches and oneDNN fact, so the remapper table (and with it the OpenBLAS products,
    tf/passes/blas.py) is an Eigen machine's and seqsplit's L2 rule reads 1 MiB."""
    from stitching.plan import epilogue
    from stitching.tf.passes import remapper
    model = profiles.MACHINES["intel-avx512"]
    skylake = profiles.with_overrides(
        model, name="cpu", bandwidth=12e9, bw_per_lane=12e9, transcendental_per_s=1e9,
        provisional=True, why_provisional="wide spread in transcendental_per_s",
        source="cpu (measured)", spread={}, tf_onednn=False,
        caches={"l1": 32 << 10, "l2": 1 << 20, "l3": 36 << 20})
    got = profiles.settled(skylake)
    assert (got.bandwidth, got.transcendental_per_s) == (model.bandwidth,
                                                         model.transcendental_per_s)
    assert got.tf_onednn is False and got.caches["l2"] == 1 << 20
    assert remapper.table(got) is epilogue.EIGEN and not remapper.onednn(got)


def test_a_final_profile_of_a_known_class_plans_with_its_classs_model(tmp_path,
                                                                     monkeypatch):
    """A final measurement of a known class planned with its own numbers, where the
    class's shipped calibration was fitted against the class model's: a Zen 5 of the
    amd-avx512 class planned EfficientNetB0 in 63 kernels (slower) from its final
    measurements and in 67 from its provisional ones.  Both plan with the class's
    throughputs now; a machine calibrated on itself keeps its own numbers."""
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path))
    quiet, busy = _measurement(False, 8e9, 8e8), _measurement(True, 2e9, 1.5e8)
    model = profiles.MACHINES["amd-avx2"]
    got = profiles.settled(quiet)
    assert (got.bandwidth, got.transcendental_per_s) == (model.bandwidth,
                                                         model.transcendental_per_s)
    assert got.caches == quiet.caches and "a machine of a known class" in got.source
    for k in ("bandwidth", "bw_per_lane", "cache_bandwidth", "transcendental_per_s"):
        assert getattr(got, k) == getattr(profiles.settled(busy), k)
    monkeypatch.setattr(profiles, "_local_scale", lambda: ({}, "calibration-cpu.json"))
    assert profiles.settled(quiet) is quiet                  # calibrated on itself


def test_named_machine_models_state_the_facts_decisions_read():
    intel, amd, zen4 = (profiles.get(m) for m in ("intel-avx512", "amd-avx2", "amd-avx512"))
    assert (intel.isa, intel.vector_bytes, intel.caches["l2"], intel.tf_onednn) == \
        ("avx512f", 64, 2 << 20, True)
    assert (amd.isa, amd.vector_bytes, amd.caches["l2"], amd.tf_onednn) == \
        ("avx2", 32, 512 << 10, False)
    assert (zen4.isa, zen4.vector_bytes, zen4.caches["l2"], zen4.tf_onednn) == \
        ("avx512f", 64, 1 << 20, True)
    for p in (intel, amd, zen4):            # each with its class's shipped calibration
        assert p.measured_at and p.tf_time_scale and p.kernel_op_cost
        assert f"shipped {p.cpu_class} calibration" in p.source, p.source
    # a measured AMD AVX-512 CPU takes its own class's numbers, not Intel's
    assert profiles.shipped_class(profiles.with_overrides(CPU, cpu_class="amd-avx512",
                                                          isa="avx512f")) == "amd-avx512"


def test_cpu_facts_classify_the_running_cpu():
    f = profiles.cpu_facts()
    assert f["isa"] in profiles.VECTOR_BYTES and f["cpu_class"]
    assert profiles.shipped_class(profiles.with_overrides(CPU, cpu_class="", isa="avx512f")) \
        == "intel-avx512"
    assert profiles.shipped_class(profiles.with_overrides(CPU, cpu_class="", isa="neon")) \
        is None


def test_environment_pins_the_default_profile(monkeypatch):
    monkeypatch.delenv("STITCHING_PROFILE", raising=False)
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", "h100")
    assert profiles.default() is H100


def test_device_named_in_stitching_profile_is_deprecated(monkeypatch):
    """STITCHING_PROFILE is the timing switch; a device name there still pins the
    profile (older spelling) but says to use STITCHING_DEVICE_PROFILE."""
    monkeypatch.delenv("STITCHING_DEVICE_PROFILE", raising=False)
    monkeypatch.setenv("STITCHING_PROFILE", "h100")
    monkeypatch.setattr(profiles, "_warned_device_name", False)
    with pytest.warns(FutureWarning, match="STITCHING_DEVICE_PROFILE=h100"):
        assert profiles.default() is H100
    monkeypatch.setenv("STITCHING_PROFILE", "1")     # timing: names no device, no warning
    monkeypatch.setattr(profiles, "_warned_device_name", False)
    mine = _measurement(False, 8e9, 8e8)              # never the live machine's numbers
    monkeypatch.setattr(profiles, "measured_cpu", lambda remeasure=False: mine)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert profiles.default() == profiles.calibrated(profiles.settled(mine))


# ---- delta evaluator -----------------------------------------------------------------

def test_fusing_a_chain_saves_the_intermediate_traffic_and_a_launch():
    g = (G().input("x", [1024, 256]).op("a", "Exp", ["x"]).op("b", "Neg", ["a"])
         .opaque("m", ["b"], [1024, 256]).build("m"))
    for p in (CPU, V100, A100, H100):
        d = costs(g, p).delta(pattern(costs(g, p), "a", "b"))
        assert d.bytes_saved == 2 * 1024 * 256 * 4       # a written once, read once: gone
        assert d.launches_saved == 1
        assert d.gain_s > p.launch_s                      # a launch plus the bytes
        assert d.gain_s == pytest.approx(d.unfused_s - d.fused_s)


def test_a_shared_input_is_read_once_by_the_kernel():
    g = layernorm(G().input("x", [512, 1024])).op("out", "Identity", ["y"]).build("out")
    c = costs(g)
    ln = pattern(c, "mean", "d", "sq", "var", "ve", "inv", "y")
    # unfused: x read by mean and d, d by sq and y, ...; fused: x in, y out
    assert c.delta(ln).bytes_saved > 5 * 512 * 1024 * 4
    assert c.delta(ln).launches_saved == 6


def test_too_few_rows_for_the_device_is_a_parallelism_penalty():
    few = layernorm(G().input("x", [4, 65536])).op("out", "Identity", ["y"]).build("out")
    many = layernorm(G().input("x", [4096, 64])).op("out", "Identity", ["y"]).build("out")
    names = ("mean", "d", "sq", "var", "ve", "inv", "y")
    cf, cm = costs(few, V100), costs(many, V100)
    assert cf.delta(pattern(cf, *names)).parallel_penalty_s > 0
    assert cm.delta(pattern(cm, *names)).parallel_penalty_s == 0
    # element-wise work keeps every lane busy whatever the shape
    assert cf.delta(pattern(cf, "ve", "inv")).parallel_penalty_s == 0


def test_a_row_too_long_for_scratch_costs_a_second_pass():
    names = ("mean", "d", "sq", "var", "ve", "inv", "y")
    fits = layernorm(G().input("x", [64, 4096])).op("out", "Identity", ["y"]).build("out")
    spills = layernorm(G().input("x", [1, 262144])).op("out", "Identity", ["y"]).build("out")
    cf, cs = costs(fits), costs(spills)       # same bytes; 16 KiB vs 1 MiB rows, 512 KiB L2
    pf = cf.delta(pattern(cf, *names)).pressure_penalty_s
    ps = cs.delta(pattern(cs, *names)).pressure_penalty_s
    assert 0 < pf < ps
    # the one long row is split across both lanes (cost.row_lanes), each re-reading its
    # piece from memory
    assert ps == pytest.approx(pf * CPU.cache_bandwidth / CPU.bw_at(2), rel=0.05)


def test_a_lone_softmax_pays_as_tf_walks_its_data_four_times():
    """legality.COMPOSITE_PASSES: TF's CPU Softmax is 4 read+write passes (measured 3.6x
    the fused kernel at 8192x1024), the fused kernel one."""
    g = G().input("x", [256, 1024]).composite("s", "Softmax", ["x"]) \
        .op("out", "Identity", ["s"]).build("out")
    fast_exp = profiles.with_overrides(CPU, transcendental_per_s=1e12)
    c = costs(g, fast_exp)
    d = c.delta(pattern(c, "s"))
    assert d.launches_saved == 0 and d.bytes_saved == 3 * 2 * 256 * 1024 * 4  # 3 passes less
    assert d.gain_s > 0
    c = costs(g, CPU)          # exp at 1.2e9/s: still TF's four passes cost more than exp
    d = c.delta(pattern(c, "s"))
    assert 0 < d.gain_s < c.unfused_s(pattern(c, "s"))


def test_a_lone_elementwise_op_saves_nothing():
    g = G().input("x", [256, 1024]).op("a", "Exp", ["x"]).op("out", "Identity", ["a"]) \
        .build("out")
    c = costs(g)
    assert c.delta(pattern(c, "a")).gain_s == pytest.approx(0.0, abs=1e-12)


# ---- latency evaluator ---------------------------------------------------------------

def test_many_short_rows_are_packed_into_few_tasks():
    lau = choose_launch(ln_spec(4096, 64), CPU)
    assert lau.params["col_block"] == 64
    assert lau.params["rows_per_task"] >= 64 and lau.tasks >= CPU.lanes
    assert lau.alternatives[0][2] == lau.time_s
    assert all(t >= lau.time_s for _, _, t in lau.alternatives)


def test_long_rows_split_across_tasks_when_there_are_too_few_rows():
    lau = choose_launch(ew_spec(1, 1 << 20), CPU)     # element-wise: a split is free
    assert lau.params["rows_per_task"] == 1 and lau.params["col_block"] < 1 << 20
    assert lau.tasks >= CPU.lanes


def test_a_tie_goes_to_a_launch_that_keeps_every_lane_busy():
    """A measured profile where one core already saturates memory makes one task and
    two tie for a memory-bound kernel; the one-task launch ran swiglu at 64 MiB 1.9x
    slower (its exp chain is compute-bound per core), so a tie splits."""
    flat = profiles.with_overrides(CPU, bw_per_lane=CPU.bandwidth,
                                   transcendental_per_s=1e12)
    lau = choose_launch(ew_spec(1, 1 << 24), flat)
    assert lau.tasks >= flat.lanes, lau.describe()


def test_a_row_reduction_is_split_only_where_the_schedule_can_combine(monkeypatch):
    spec = ln_spec(2, 1 << 22)
    assert kernel_shape(spec).source == "schedule"       # the CUDA rows do not split
    assert choose_launch(spec, V100).params["col_block"] == 1 << 22
    # the CPU splits a row (in phases, split_rows=1) only when rows leave lanes idle
    one = choose_launch(ln_spec(1, 1 << 22), CPU).params
    assert one["col_block"] < 1 << 22 and one["split_rows"] == 1
    assert "split_rows" not in choose_launch(ln_spec(CPU.lanes, 1 << 22), CPU).params
    monkeypatch.setattr(cost, "_schedule_of", lambda spec: None)
    ks = kernel_shape(spec)
    assert ks.source == "estimate" and ks.split == "combine"
    assert choose_launch(spec, V100).params["col_block"] < 1 << 22   # 2 rows, 80 SMs


def test_rows_unknown_until_run_time_leave_the_unit_to_the_kernel():
    lau = choose_launch(ln_spec(-1, 768), CPU)
    assert lau.params == {} and lau.time_s > 0
    assert "run time" in lau.describe()


def test_an_unknown_row_length_leaves_the_column_block_to_the_kernel():
    """A flat [?] element-wise kernel has one (known) row of unknown length: a column
    block sized for the DEFAULT_DIM guess (32 elements) must not be fixed."""
    b = SpecBuilder()
    x = b.input(F, (-1,))
    lau = choose_launch(b.build([b.Neg(b.Exp(x))]), CPU)
    assert lau.params == {} and "run time" in lau.describe()


def test_gpu_launch_picks_a_block_that_fits_the_row():
    short = choose_launch(ln_spec(65536, 8), A100)
    long = choose_launch(ln_spec(1024, 8192), A100)
    assert short.threads in cost.GPU_THREADS and long.threads in cost.GPU_THREADS
    assert short.params["rows_per_task"] * 8 >= 32           # rows packed to fill a warp
    assert long.params["rows_per_task"] == 1 and long.threads >= 256
    assert choose_launch(ln_spec(1024, 8192), A100) == long  # deterministic


def test_faster_memory_gives_a_faster_kernel():
    times = [choose_launch(ln_spec(8192, 1024), p).time_s for p in (V100, A100, H100)]
    assert times[0] > times[1] > times[2]


def test_schedule_placements_feed_the_reuse_estimate():
    b = SpecBuilder()
    x = b.input(F, (256, 1024))
    e = b.Exp(b.Sub(x, b.Max(x, axes=[1], keep_dims=True)))
    spec = b.build([b.Div(e, b.Sum(e, axes=[1], keep_dims=True))])
    ks = kernel_shape(spec)
    assert ks.source == "schedule" and ks.kind == "row"
    assert ks.reuse_bytes > 0 and ks.footprint_row > 0      # exp(x - max) kept per row


def test_a_broken_schedule_stage_falls_back_to_the_estimate(monkeypatch):
    from stitching.plan import cost

    def boom(spec):
        raise RuntimeError("under construction")
    monkeypatch.setattr(cost, "_scheduler", boom)      # what use_scheduler sets
    ks = kernel_shape(ln_spec(64, 1024))
    assert ks.source == "estimate" and ks.kind == "row" and ks.rows == 64


def test_the_schedule_stage_gives_the_cost_model_its_schedules(monkeypatch):
    # plan never imports schedule (tests/test_layering.py): the schedule package
    # registers build_schedule on import; without it the model estimates.
    from stitching.plan import cost
    from stitching.schedule import build_schedule
    assert cost._scheduler is build_schedule
    monkeypatch.setattr(cost, "_scheduler", None)
    assert kernel_shape(ln_spec(64, 1024)).source == "estimate"


# ---- calibration (tools/calibrate.py writes these profiles) ---------------------------

def _center_cols():
    """x - mean(x, axis 0) over [4096, 64]: a column reduction and its broadcast consumer."""
    return (G().input("x", [4096, 64]).op("m", "Mean", ["x"], axes=[0], keep_dims=True)
            .op("d", "Sub", ["x", "m"]).op("e", "Exp", ["x"]).op("s", "Sum", ["x"], axes=[1], keep_dims=False)
            .build("d", "e", "s"))


def test_tf_classes_follow_the_reduced_axes():
    t = lambda *s: cost.TensorType(F, s)     # noqa: E731
    assert cost.tf_class("Sum", {"axes": [1]}, t(8, 64), False) == "row_reduction"
    assert cost.tf_class("Mean", {"axes": [-2, -1]}, t(2, 8, 64), False) == "row_reduction"
    assert cost.tf_class("Sum", {"axes": [0]}, t(8, 64), False) == "column_reduction"
    assert cost.tf_class("Max", {"axes": [0, 1]}, t(2, 8, 64), False) == "column_reduction"
    assert cost.tf_class("Softmax", {}, t(8, 64), True) == "softmax"
    assert cost.tf_class("Exp", {}, t(8, 64), True) == "transcendental"
    assert cost.tf_class("Add", {}, t(8, 64), False) == "elementwise"


def test_a_class_factor_scales_only_that_class_of_unfused_ops():
    g = _center_cols()
    plain = costs(g)
    scaled = costs(g, profiles.with_overrides(CPU, tf_time_scale={"column_reduction": 3.5}))
    i = {n: plain.index[n] for n in ("m", "d", "e", "s")}
    fixed = CPU.launch_s + CPU.task_s          # one launch and task: never scaled
    m = plain.unfused[i["m"]] - fixed
    assert scaled.unfused[i["m"]] == pytest.approx(fixed + 3.5 * m)
    for n in ("d", "e", "s"):
        assert scaled.unfused[i[n]] == plain.unfused[i[n]]
    # what fusing the column reduction with its consumer gains grows by what TF loses
    P = pattern(plain, "m", "d")
    assert scaled.gain(P) == pytest.approx(plain.gain(P) + 2.5 * m)


def test_a_factor_table_is_interpolated_in_log_size_and_flat_beyond_its_ends():
    table = {"softmax": [[1, 1.0], [4, 0.5], [64, 0.25]], "elementwise": 2.0}
    mib = 1 << 20
    assert profiles.tf_factor(table, "softmax", mib // 16) == 1.0     # below: first point
    assert profiles.tf_factor(table, "softmax", mib) == 1.0
    assert profiles.tf_factor(table, "softmax", 2 * mib) == pytest.approx(0.75)
    assert profiles.tf_factor(table, "softmax", 16 * mib) == pytest.approx(0.375)
    assert profiles.tf_factor(table, "softmax", 1 << 40) == 0.25     # above: last point
    assert profiles.tf_factor(table, "elementwise", 7) == 2.0        # a flat factor
    assert profiles.tf_factor(table, "column_reduction", mib) == 1.0  # none: 1


def test_a_factor_table_prices_each_op_at_its_own_size():
    """The model's TF softmax at 1 MiB and at 16 MiB gets the factor of its size."""
    g1, g16 = (_softmax_graph(rows) for rows in (256, 4096))
    prof = profiles.with_overrides(CPU, tf_time_scale={"softmax": [[1, 1.0], [16, 0.25]]})
    fixed = CPU.launch_s + CPU.task_s
    for g, f in ((g1, 1.0), (g16, 0.25)):
        plain, scaled = costs(g), costs(g, prof)
        i = plain.index["y"]
        assert scaled.unfused[i] == pytest.approx(fixed + f * (plain.unfused[i] - fixed))


def _softmax_graph(rows):
    from stitching.ir.graph import Graph, Node, TensorType, ValueRef
    x = TensorType(F, (rows, 1024))
    return Graph([Node("x", "Placeholder", outputs=[x]),
                  Node("y", "Softmax", [ValueRef("x")], {}, [x])], [ValueRef("y")])


def test_a_kernel_factor_scales_the_fused_estimate_by_its_members_share_of_the_work():
    g = _center_cols()
    plain = costs(g)
    ks = {"column_reduction": 0.5, "elementwise": 2.0}
    scaled = costs(g, profiles.with_overrides(CPU, kernel_time_scale=ks))
    P = pattern(plain, "m", "d")
    assert scaled.unfused == plain.unfused                 # the TF side is untouched
    fixed = CPU.launch_s + CPU.task_s
    wm, wd = (plain.unfused[plain.index[n]] - fixed for n in ("m", "d"))
    f = (0.5 * wm + 2.0 * wd) / (wm + wd)
    assert scaled.kernel_factor(P) == pytest.approx(f)
    assert scaled.delta(P).fused_s == pytest.approx(
        fixed + f * (plain.delta(P).fused_s - fixed))
    assert plain.kernel_factor(P) == 1.0


def test_a_profile_file_keeps_kernel_factors_and_refuses_bad_ones(tmp_path):
    path = str(tmp_path / "p.json")
    ks = {"softmax": [[1, 0.5], [16, 0.4]]}
    profiles.save_file(profiles.with_overrides(CPU, kernel_time_scale=ks), path)
    assert profiles.load_file(path).kernel_time_scale == ks
    doc = json.load(open(path))
    doc["profile"]["kernel_time_scale"] = {"softmax": [[1, 0.0]]}
    with open(path, "w") as f:
        json.dump(doc, f)
    with pytest.raises(profiles.ProfileFileError, match=r"kernel_time_scale\['softmax'\]"):
        profiles.load_file(path)


def test_calibrate_tables_take_the_median_per_size():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "calibrate", os.path.join(os.path.dirname(__file__), "..", "tools", "calibrate.py"))
    cal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cal)
    got = cal.factor_tables({"softmax": {4: [0.5, 0.7, 0.6], 1: [1.0]},
                             "elementwise": {1: [2.0, 4.0]}, "transcendental": {},
                             "row_reduction": {1: [1e9]}})
    assert got == {"softmax": [[1, 1.0], [4, 0.6]], "elementwise": 3.0,
                   "row_reduction": profiles.SCALE_RANGE[1]}


def test_profile_file_round_trip_and_env_override(tmp_path, monkeypatch):
    path = str(tmp_path / "p.json")
    prof = profiles.with_overrides(CPU, name="mine", tf_time_scale={"softmax": 0.5})
    profiles.save_file(prof, path, note="test")
    got = profiles.load_file(path)
    assert got.tf_time_scale == {"softmax": 0.5} and got.bandwidth == CPU.bandwidth
    assert got.source == f"mine from {path}"
    monkeypatch.delenv("STITCHING_PROFILE", raising=False)
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", path)
    assert profiles.default() == got


@pytest.mark.parametrize("change,message", [
    (lambda d: "not json", "not JSON"),
    (lambda d: {**d, "version": 99}, "expected version"),
    (lambda d: {**d, "profile": {**d["profile"], "bogus": 1}}, "unknown fields"),
    (lambda d: {**d, "profile": {**d["profile"], "bandwidth": -1}}, "bandwidth must be"),
    (lambda d: {**d, "profile": {**d["profile"], "launch_s": float("nan")}}, "launch_s must"),
    (lambda d: {**d, "profile": {k: v for k, v in d["profile"].items() if k != "lanes"}},
     "missing fields"),
    (lambda d: {**d, "profile": {**d["profile"], "tf_time_scale": {"matmul": 2}}},
     "unknown class"),
    (lambda d: {**d, "profile": {**d["profile"], "tf_time_scale": {"softmax": 1e6}}},
     "expected a factor"),
    (lambda d: {**d, "profile": {**d["profile"], "tf_time_scale": {"softmax": "2"}}},
     "expected a factor"),
    (lambda d: {**d, "profile": {**d["profile"],
                                 "tf_time_scale": {"softmax": [[4, 1.0], [1, 2.0]]}}},
     "MiB increasing"),
    (lambda d: {**d, "profile": {**d["profile"],
                                 "tf_time_scale": {"softmax": [[1, 1.0, 3]]}}},
     "expected a factor"),
    (lambda d: {**d, "profile": {**d["profile"], "tf_time_scale": {"softmax": []}}},
     "1 to 32"),
    (lambda d: {**d, "profile": {**d["profile"],
                                 "tf_time_scale": {"softmax": [[1, 1.0], [2, 1e6]]}}},
     "expected a factor"),
    (lambda d: {**d, "profile": {**d["profile"], "backend": "tpu"}}, "backend must be"),
])
def test_a_bad_profile_file_is_refused_naming_the_problem(tmp_path, change, message):
    good = str(tmp_path / "good.json")
    profiles.save_file(CPU, good)
    doc = change(json.load(open(good)))
    bad = tmp_path / "bad.json"
    bad.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(profiles.ProfileFileError, match=message) as e:
        profiles.load_file(str(bad))
    assert str(bad) in str(e.value)


def test_the_shipped_calibration_applies_to_the_measured_cpu_only(monkeypatch):
    monkeypatch.setattr(profiles, "_SHIPPED",
                        {"amd-avx2": {"tf_time_scale": {"column_reduction": 3.0}}})
    got = profiles.calibrated(profiles.with_overrides(CPU, name="cpu", source="measured",
                                                      cpu_class="amd-avx2"))
    assert got.tf_time_scale == {"column_reduction": 3.0}
    assert got.source == "measured + shipped amd-avx2 calibration"
    assert profiles.calibrated(V100) is V100                 # GPU profiles: as pinned
    mine = profiles.with_overrides(CPU, tf_time_scale={"softmax": 2.0})
    assert profiles.calibrated(mine) is mine                 # its own factors win


def test_this_machines_calibration_comes_before_the_shipped_one(tmp_path, monkeypatch):
    """calibrate.py --install: factors bound to this CPU in the cache directory win over
    the shipped default; one measured on another CPU, or a bad file, is not used."""
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(profiles, "_SHIPPED",
                        {"amd-avx2": {"tf_time_scale": {"column_reduction": 3.0}}})
    cpu = profiles.with_overrides(CPU, name="cpu", source="measured", cpu_class="amd-avx2")
    path = profiles.local_calibration_path()
    mine = profiles.with_overrides(CPU, tf_time_scale={"softmax": 0.7})
    profiles.save_file(mine, path, this_machine=True)
    got = profiles.calibrated(cpu)
    assert got.tf_time_scale == {"softmax": 0.7}
    assert got.source == f"measured + this machine's calibration ({path})"
    doc = json.load(open(path))
    doc["fingerprint"] = "another CPU|64|[]"
    with open(path, "w") as f:
        json.dump(doc, f)
    os.utime(path, ns=(1, 1))                      # a new mtime: read again
    assert profiles.calibrated(cpu).tf_time_scale == {"column_reduction": 3.0}
    with open(path, "w") as f:
        f.write("{broken")
    os.utime(path, ns=(2, 2))
    with pytest.warns(RuntimeWarning, match="ignoring this machine's calibration"):
        assert profiles.calibrated(cpu).tf_time_scale == {"column_reduction": 3.0}


def test_python_m_stitching_profile_shows_the_profile_in_use_and_its_origins(capsys,
                                                                             monkeypatch):
    from stitching import profile
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", "amd-avx2")
    assert profile.main(["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["profile"] == "amd-avx2" and d["pinned_by"] == "amd-avx2"
    assert (d["tf_onednn"], d["tf_onednn_from"]) == (False, "the profile")
    assert d["isa"] == "avx2" and d["calibration"] == "yes"
    assert {r["number"] for r in d["numbers"]} == {
        "bandwidth", "bw_per_lane", "cache_bandwidth", "transcendental_per_s"}
    assert all(r["origin"] == "pinned" for r in d["numbers"])
    # the measured profile: each number's origin says measured, or the model it took
    monkeypatch.delenv("STITCHING_DEVICE_PROFILE")
    busy = _measurement(True, 2e9, 1.5e8)
    monkeypatch.setattr(profiles, "measured_cpu", lambda remeasure=False: busy)
    assert profile.main([]) == 0
    out = capsys.readouterr().out
    assert "PROVISIONAL" in out and "amd-avx2 machine model" in out
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", "no-such-profile")
    assert profile.main([]) == 2


def test_kernel_factor_sums_the_same_terms_in_the_same_order():
    # kernel_factor's per-node terms are computed once per GraphCosts: the factor of
    # every pattern is the float the per-pattern formula gives, bit for bit
    import itertools
    prof = profiles.get("amd-avx2")
    assert prof.kernel_time_scale
    g = layernorm(G().input("x", [512, 768])).opaque("o", ["y"], [512, 768]).build("o")
    c = costs(g, prof)
    fixed = prof.launch_s + prof.task_s
    nodes = [c.index[n] for n in ("mean", "d", "sq", "var", "ve", "inv", "y")]
    for r in (1, 2, 3, 7):
        for P in map(frozenset, itertools.combinations(nodes, r)):
            weights = [(max(0.0, c.unfused[v] - fixed) / c.scale[v], c.kscale[v]) for v in P]
            total = sum(w for w, _ in weights)
            want = sum(w * k for w, k in weights) / total if total > 0 else 1.0
            assert c.kernel_factor(P) == want


def test_unknown_dims_priced_at_each_size_only_where_the_comparison_turns_on_it():
    """assume_dim prices unknown dims at another size, in its block only; priced_dims
    asks for all of UNKNOWN_DIM_RANGE only for a column kernel that
    re-reads its inputs over an unknown extent against a oneDNN composite (the
    batch-norm gradient's case), one size (DEFAULT_DIM) anywhere else."""
    from stitching.ir import TensorType
    t = TensorType("float32", [-1, 4])
    assert cost.elems(t) == cost.DEFAULT_DIM * 4
    with cost.assume_dim(128):
        assert cost.elems(t) == 512 and cost.unknown_dim() == 128
    assert cost.elems(t) == cost.DEFAULT_DIM * 4
    assert cost.DEFAULT_DIM in cost.UNKNOWN_DIM_RANGE
    assert min(cost.UNKNOWN_DIM_RANGE) < cost.DEFAULT_DIM < max(cost.UNKNOWN_DIM_RANGE)
    ks = cost.KernelShape(kind="column", rows=1, row_len=512, rows_known=False,
                          in_bytes=1 << 20, out_bytes=1 << 18, transcendentals=0,
                          reuse_bytes=1 << 20, footprint_row=float(1 << 20), live=4,
                          split="free", source="schedule")
    assert cost.priced_dims(ks, onednn=True) == cost.UNKNOWN_DIM_RANGE
    for other in (dict(onednn=False), dict(onednn=True, kind="row"),
                  dict(onednn=True, rows_known=True), dict(onednn=True, reuse_bytes=0)):
        onednn = other.pop("onednn")
        shape = cost.KernelShape(**{**ks.__dict__, **other})
        assert cost.priced_dims(shape, onednn) == (cost.DEFAULT_DIM,), other
