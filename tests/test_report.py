"""The report a user reads once: counts that add up, "0 of 0" where there is nothing,
reasons written as sentences, notes only where they apply."""
import tensorflow as tf

import stitching
from stitching.report import KernelInfo, Report


def _counted(report):
    return sum(len(k.split_ops()[0]) for k in report.kernels)


def test_counts_add_up_and_uncounted_ops_are_listed_apart():
    @stitching.function
    def layer_norm(x):
        mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)   # StopGradient inside
        return (x - mean) * tf.math.rsqrt(var + 1e-5)
    layer_norm(tf.random.normal([8, 64]))
    rep = layer_norm.report
    assert rep.memory_intensive_ops == rep.fused_ops + len(rep.unfused)
    assert _counted(rep) == rep.fused_ops == 7
    text = rep.summary()
    assert f"fused 7 of 7 memory-intensive TF ops (100%) into 1 kernel;" in text
    assert "7 ops [Mean, Sub, SquaredDifference, Mean, AddV2, Rsqrt, Mul]" in text
    assert "StopGradient" in text and "not counted" in text


def test_the_headline_says_when_a_trace_found_its_kernels_built():
    """A second trace whose kernels an earlier one built (another batch size, served by
    the same shape-generic code, as a Keras step's relaxed trace after its exact one)
    planned only: its headline says so, not "compiled in 0.0 s"."""
    @stitching.function
    def f(x):
        return tf.nn.relu(x * 3.217 + 0.5113) * tf.math.exp(-x)
    f(tf.random.normal([8, 40]))
    first = f.report
    assert first.reused_kernels == 0, first.summary()
    assert "; planned and compiled in " in first.summary().splitlines()[1]
    f(tf.random.normal([16, 40]))
    second = f.report
    assert second is not first and second.unique_kernels == 1
    assert second.reused_kernels == 1, second.summary()
    head = second.summary().splitlines()[1]
    assert "; planned in " in head and head.endswith(", its kernel built for an earlier trace")
    assert second.to_dict()["reused_kernels"] == 1


def test_the_headline_counts_kernels_built_before():
    rep = Report(function="f", memory_intensive_ops=4, fused_ops=4, unique_kernels=3,
                 compile_seconds=0.04)
    rep.kernels = [KernelInfo(f"k{i}", [("a", "Exp")], "", 1, 1, str(i)) for i in range(3)]
    assert rep.summary().splitlines()[1].endswith("; planned and compiled in 0.0 s")
    rep.reused_kernels = 2
    assert rep.summary().splitlines()[1].endswith(
        "; planned and compiled in 0.0 s (2 of 3 distinct kernels built for an earlier "
        "trace)")
    rep.reused_kernels = 3
    assert rep.summary().splitlines()[1].endswith(
        "; planned in 0.0 s, all 3 kernels built for an earlier trace")
    rep.from_result_cache = True
    assert rep.summary().splitlines()[1].endswith("; reused from the result cache in 0.0 s")


def test_nothing_to_fuse_reads_0_of_0():
    f = stitching.function(lambda a, b: tf.matmul(a, b))
    f(tf.ones([4, 4]), tf.ones([4, 4]))
    assert f.report.memory_intensive_ops == 0
    assert "fused 0 of 0 memory-intensive TF ops: nothing to fuse" in f.report.summary()
    assert "100%" not in f.report.summary()
    assert "fused 0 of 0" in Report(function="empty").summary()


def test_an_input_of_unknown_rank_says_what_lets_it_fuse():
    f = stitching.function(lambda x: tf.exp(x) * 2.0 + 1.0,
                           input_signature=[tf.TensorSpec(None)])
    f(tf.ones([4, 4]))
    rep = f.report
    assert rep.fused_ops == 0 and len(rep.unfused) == 3
    assert all(why.startswith("a tensor of unknown rank (an input_signature")
               for _, _, why in rep.unfused), rep.summary()
    # one line for the three ops: a reason is shared, not one per tensor
    assert rep.summary().count("unknown rank") == 1


def test_backward_is_not_a_note_of_an_inference_report():
    """The "a tape outside this function..." sentence said what *would* happen under a
    tape; it was a note on every inference report and CLI run."""
    f = stitching.function(lambda x: tf.nn.softmax(x * 2.0))
    f(tf.ones([4, 8]))
    assert f.report.kernels
    assert "tape" not in f.report.summary() and not any("tape" in n for n in f.report.notes)
    assert "a tape outside this function differentiates 1 kernel(s)" in f.report.backward
    assert f.report.to_dict()["backward"] == f.report.backward


def test_not_fused_lines_count_against_the_total_and_name_the_op_first():
    rep = Report(function="f", memory_intensive_ops=3, fused_ops=1,
                 unfused=[("a", "Exp", "why a"), ("b", "Exp", "why a")],
                 kernels=[KernelInfo("k0", [("c", "Mul"), ("i", "Identity"), ("j", "Identity"),
                                            ("s", "StopGradient")], "", 1, 1, "h",
                                     counted=frozenset({"c"}))],
                 unique_kernels=1, code_objects=1)
    text = rep.summary()
    assert "fused 1 of 3 memory-intensive TF ops (33%) into 1 kernel;" in text
    assert "k0: 1 op [Mul] (also 2 Identity, StopGradient: no data work, not counted)" in text
    assert "not fused (2 of 3):\n    Exp (a), Exp (b): why a" in text


def test_an_op_recomputed_in_two_kernels_is_said_so():
    k = [KernelInfo(f"k{i}", [("m", "Mul"), (f"e{i}", "Exp")], "", 1, 1, str(i))
         for i in range(2)]
    rep = Report(function="f", memory_intensive_ops=3, fused_ops=3, kernels=k,
                 unique_kernels=2, code_objects=1)
    text = rep.summary()
    assert "into 2 kernels (2 distinct, served by 1 compiled code)" in text
    assert "1 op(s) computed in more than one kernel are counted once" in text


def test_notes_that_differ_only_in_their_region_are_one_line_and_a_count():
    """InceptionV3's eleven blocks each cut a region at a ConcatV2: eleven near-equal
    notes were eleven lines.  The summary shows the first and a count; ``notes`` (and
    ``to_dict``) keep each."""
    cut = "{{a{0}/Reshape, a{0}/Mul, … +20}} cut in 2: the value a ConcatV2 of " \
          "[?,{0},{0},2048] reads is computed once and reloaded"
    notes = [cut.format(i) for i in (3, 5, 7)] + ["4 zero Pad(s) folded"]
    rep = Report(function="f", notes=notes)
    lines = [ln for ln in rep.summary().splitlines() if ln.startswith("  note:")]
    assert lines == [f"  note: {notes[0]}",
                     "  note: … and 2 more region(s) the same way (cut in 2; "
                     "report.notes lists each)",
                     "  note: 4 zero Pad(s) folded"]
    assert rep.to_dict()["notes"] == notes


def test_a_kernel_line_says_where_in_the_model_its_ops_are():
    """A large model's summary named only op types: kernel_37 of 68 could be any
    block.  Each kernel line now names the scope its nodes share and, where they span
    several layers under it, the first and last of those."""
    ops = [("m/block2a_bn/FusedBatchNormV3", "FusedBatchNormV3"),
           ("m/block2a_act/Sigmoid", "Sigmoid"), ("m/block2a_act/mul", "Mul"),
           ("m/block2b_add/add", "AddV2")]
    rep = Report(function="f", memory_intensive_ops=4, fused_ops=4,
                 kernels=[KernelInfo("stitching/kernel_0", ops, "", 1, 1, "h0"),
                          KernelInfo("stitching/kernel_1", [("m/ln/a", "Mul"),
                                                            ("m/ln/b", "AddV2")],
                                     "", 1, 1, "h1"),
                          KernelInfo("stitching/kernel_2", [("mean", "Mean"),
                                                            ("moments/sub", "Sub")],
                                     "", 1, 1, "h2")])
    lines = rep.summary().splitlines()
    assert "  stitching/kernel_0 (m/{block2a_bn … block2b_add}): 4 ops [" in "\n".join(lines)
    assert any(ln.startswith("  stitching/kernel_1 (m/ln): 2 ops") for ln in lines)
    assert any(ln.startswith("  stitching/kernel_2: 2 ops") for ln in lines)  # no scope


def test_many_tiered_kernels_are_one_count_line():
    """Read live, the tiered-compile block was a line per kernel: 68 lines of 'tier 1
    held ...; tier 2 not in yet' for EfficientNetB0, as long as the rest of the
    summary.  Above a few kernels it is one line of counts."""
    class _Tiered:          # the counts read the kernel's state, never its words
        def __init__(self, held, done):
            self.state = held, done

        def tier_state(self):
            return self.state

        def tiering(self):
            return "tier 1 held: ..." if self.state[0] else "tier 1 ran: ..."
    states = [(True, False)] * 3 + [(False, True)] * 7
    rep = Report(function="f", memory_intensive_ops=1, fused_ops=1)
    rep.code_tiers = [(f"stitching/kernel_{i}", _Tiered(*s)) for i, s in enumerate(states)]
    (line,) = [ln for ln in rep.summary().splitlines() if "tiered compile" in ln]
    assert "10 kernels: 3 held on their TF ops at tier 1" in line
    assert "tier 2 in for 7, not yet for 3" in line
    rep.code_tiers = rep.code_tiers[:2]
    tier = [ln for ln in rep.summary().splitlines() if "tier 1" in ln]
    assert len(tier) == 2 and tier[0].startswith("    stitching/kernel_0: tier 1 held")
