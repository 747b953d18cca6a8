"""What stitching did to one traced function, for people and for tools.

``summary()`` is the text a user reads; ``to_dict()`` the same facts as data
(keys: memory_intensive_ops, fused_ops, kernels, coverage, unfused,
kernel_details, boundaries, compile_seconds, notes, backward, bodies, autotune,
pass_seconds).
Counts are in TF ops of the original graph: a Softmax is one op even though its kernel
expands it.

The counts add up: memory-intensive ops = fused + not fused, and the ops counted per
kernel sum to the fused count (a kernel's views and shape arithmetic -- Identity,
StopGradient, a Reshape's target -- are listed apart, uncounted; an op recomputed in
two kernels is said so).  docs/inspecting.md explains each line.
"""
from __future__ import annotations

import re

from dataclasses import dataclass, field


@dataclass
class KernelInfo:
    """One generated kernel of a report.

    Attributes:
        name: The StitchedKernel node's name in the rewritten graph.
        ops: ``[(TF node name, TF op type)]`` of the original graph it computes.
        schedule: One line from the schedule stage (kind, domain, passes, unit).
        inputs: How many tensors the kernel reads.
        outputs: How many tensors it writes.
        spec_hash: Its spec's hash (kernels with the same hash share one compile).
        counted: Names of the memory-intensive ops among ``ops`` (the others are
            views or shape arithmetic, free in TF too); ``None``: all of them.
    """
    name: str
    ops: list            # [(tf node name, tf op type)]
    schedule: str        # one line from the schedule stage
    inputs: int
    outputs: int
    spec_hash: str
    counted: frozenset | None = None

    def split_ops(self) -> tuple[list, list]:
        """(memory-intensive ops, other ops), each ``[(node, op type)]``."""
        if self.counted is None:
            return list(self.ops), []
        return ([o for o in self.ops if o[0] in self.counted],
                [o for o in self.ops if o[0] not in self.counted])


@dataclass
class Report:
    """What stitching did to one traced function (or one rewritten graph).

    Read it as ``f.report`` (``stitching.function``), ``model.stitching_report``
    (``stitching.keras.stitch``) or from ``stitching.rewrite_graph_def`` /
    ``rewrite_saved_model``.  ``print(report)`` shows ``summary()``.

    Attributes:
        function: The traced function's (or graph's) name.
        memory_intensive_ops: Memory-intensive TF ops in the original graph
            (element-wise, broadcasts, reductions, layout ops...; matrix products,
            convolutions and shape arithmetic are not counted).
        fused_ops: How many of those a kernel computes, or a product's op (``folded``).
        folded: ``[(TF node, op type, where)]`` for each memory-intensive op a pass
            after planning moved into a matrix product's op (a bias Add as the
            MatMul's BiasAdd, an attention's scale Mul into its StitchedAttention):
            no kernel of its own and no pass over memory; counted in
            ``fused_ops``, so ``memory_intensive_ops == fused_ops + len(unfused)``.
        kernels: One ``KernelInfo`` per generated kernel.
        unfused: ``[(TF node, op type, reason)]`` for each memory-intensive op left
            to TF; ``memory_intensive_ops == fused_ops + len(unfused)``.
        boundaries: ``[(TF node, reason)]``: merges of two kernels the planner refused.
        compile_seconds: Time spent planning and compiling this trace.
        reused_kernels: Of ``unique_kernels``, those this process had built for an
            earlier trace (another batch size's, a Python scalar's): this trace's
            ``compile_seconds`` did not build them, so the headline says so.
        from_result_cache: The stitched graph came whole from the result cache
            (tf/results.py): nothing was planned or compiled.
        unique_kernels: Distinct kernel specs (identical regions share one).
        code_objects: Distinct native codes serving them (specs that differ only in
            static sizes share one).
        notes: Sentences about rewrites and decisions that apply to this function.
        backward: What a ``GradientTape`` *outside* the function would differentiate
            through (empty when no kernel can be differentiated); not part of
            ``summary()``, which describes the forward.
        explanation: Per kernel, the planner's alternatives and scores (``explain()``).
        profile: The device profile the cost model planned with.
        dump_path: This trace's graph dump, when dumping is on.
        autotune: The kernels timed against their original ops
            (``Options.autotune``), and the ``StitchedAttention`` ops timed against
            their unfused products (entries with ``"attention": True``; where TF's
            GEMM is oneDNN's, tf/passes/attention.py); ``autotune_decisions()`` adds
            what was measured.
        tiering: Under tiered execution (``stitching.keras.stitch``'s steps, a
            ``stitching.function``'s eager calls), the steps or calls stock TF ran
            while the kernels compiled and the one that switched to them.
        result_stored: Whether the stitched graph went into the result cache, so a
            later process finds it without planning (None: not a cached trace; False:
            a note says why not).
        bodies: The functions control flow runs (``tf.cond`` branches, loop bodies),
            each stitched on its own: ``[(function name, Report or None, why it was
            kept as traced)]``.
        pass_seconds: Seconds each graph pass took.
        code_tiers: The kernels compiled in tiers, read live: which code each runs.
    """

    function: str = "?"
    memory_intensive_ops: int = 0
    fused_ops: int = 0
    kernels: list = field(default_factory=list)       # list[KernelInfo]
    unfused: list = field(default_factory=list)       # [(tf node, tf op, reason)]
    folded: list = field(default_factory=list)        # [(tf node, tf op, where)]
    boundaries: list = field(default_factory=list)    # [(tf node, reason)] merges refused
    compile_seconds: float = 0.0
    reused_kernels: int = 0    # of unique_kernels: built for an earlier trace here
    from_result_cache: bool = False
    unique_kernels: int = 0
    code_objects: int = 0      # distinct native codes (kernel.code_name) serving them
    notes: list = field(default_factory=list)
    # the functions control flow runs (tf.cond branches, loop bodies), each stitched on
    # its own: [(function name, its Report or None, why it was kept as traced or "")]
    bodies: list = field(default_factory=list)
    explanation: list = field(default_factory=list)   # per kernel: alternatives and scores
    profile: str = ""          # the device profile the cost model planned with (its source)
    dump_path: str | None = None   # the graph dump of this trace, when dumping is on
    # Options(autotune): the kernels timed against their native segment (tf/passes/autotune.py)
    # with the model's prediction; what the measurements decided is read live
    autotune: list = field(default_factory=list)
    backward: str = ""
    pass_seconds: dict = field(default_factory=dict)   # graph pass -> seconds (tf/passmanager.py)
    # tiered execution (keras.py): when stock TF handed this step over to the kernels
    tiering: str = ""
    # the tiered compile (compile/parallel.py, Tiers): [(kernel name, kernel)] whose
    # ``tiering()`` says, read live, which code it runs and ran, and when tier 2 came
    code_tiers: list = field(default_factory=list)
    result_stored: bool | None = None

    @property
    def coverage(self) -> float:
        """``fused_ops / memory_intensive_ops``; 1.0 when there is nothing to fuse."""
        if not self.memory_intensive_ops:
            return 1.0
        return self.fused_ops / self.memory_intensive_ops

    def to_dict(self) -> dict:
        """The report as JSON-ready data (what ``stitching-rewrite --report`` writes)."""
        return {
            "function": self.function,
            "memory_intensive_ops": self.memory_intensive_ops,
            "fused_ops": self.fused_ops,
            "kernels": len(self.kernels),
            "unique_kernels": self.unique_kernels,
            "code_objects": self.code_objects,
            "coverage": round(self.coverage, 4),
            "unfused": [(op, reason) for _, op, reason in self.unfused],
            "unfused_nodes": [{"node": n, "op": op, "reason": r} for n, op, r in self.unfused],
            "folded_nodes": [{"node": n, "op": op, "where": w} for n, op, w in self.folded],
            "kernel_details": [{"name": k.name, "ops": [t for _, t in k.ops],
                                "nodes": [n for n, _ in k.ops], "schedule": k.schedule,
                                "inputs": k.inputs, "outputs": k.outputs,
                                "spec_hash": k.spec_hash} for k in self.kernels],
            "tiering": self.tiering,
            "compile_tiers": {name: t for name, t in ((n, k.tiering())
                                                      for n, k in self.code_tiers) if t},
            "boundaries": [{"node": n, "reason": r} for n, r in self.boundaries],
            "compile_seconds": round(self.compile_seconds, 3),
            "reused_kernels": self.reused_kernels,
            "from_result_cache": self.from_result_cache,
            "dump_path": self.dump_path,
            "notes": list(self.notes),
            "backward": self.backward,
            "bodies": [{"function": f, "why_kept": why,
                        "report": r.to_dict() if r is not None else None}
                       for f, r, why in self.bodies],
            "explanation": list(self.explanation),
            "profile": self.profile,
            "autotune": self.autotune_decisions(),
            "pass_seconds": {k: round(v, 4) for k, v in self.pass_seconds.items()},
        }

    def autotune_decisions(self) -> list:
        """Per kernel timed against its native segment: the model's prediction and,
        per shape class measured so far (``class``: log2 of the input bytes), the
        measured median times, the choice and whether it was measured in this process
        or read from the cache."""
        if not self.autotune:
            return []
        try:
            from .runtime import autotune_decisions
            live = autotune_decisions()
        except Exception:  # noqa: BLE001 - no op library here: the static part only
            live = {}
        out = []
        for e in self.autotune:
            d = dict(e)
            d["decisions"] = [dict(v, **{"class": cls})
                              for (h, cls), v in sorted(live.items())
                              if h == e["spec_hash"]]
            out.append(d)
        return out

    def _autotune_lines(self) -> list:
        every = self.autotune_decisions()
        entries = [e for e in every if not e.get("attention")]
        return self._kernel_autotune_lines(entries) + self._attention_autotune_lines(
            [e for e in every if e.get("attention")])

    @staticmethod
    def _attention_autotune_lines(entries) -> list:
        if not entries:
            return []
        lines = ["  attentions (StitchedAttention timed against its unfused products, "
                 "TF's around the softmax kernel, on the first calls of each input size "
                 "class; the faster serves):"]
        for e in entries:
            done = [d for d in e["decisions"] if d["choice"]]
            if not done:
                lines.append(f"    {e['kernel']}: not measured yet")
            for d in done:
                how = "measured" if d["source"] == "measured" else "measured earlier, cached"
                way = "fused" if d["choice"] == "kernel" else "unfused"
                lines.append(f"    {e['kernel']}: inputs ~2^{d['class']} B: fused "
                             f"{d['kernel_us']:.1f} µs vs unfused {d['native_us']:.1f} µs "
                             f"({how}) -> {way}")
        return lines

    @staticmethod
    def _kernel_autotune_lines(entries) -> list:
        if not entries:
            return []
        margin = entries[0]["margin"]
        which = (f"kernels predicted < {margin:.2f}x faster than their ops in TF"
                 if margin != float("inf") else "every kernel")
        lines = [f"  autotune ({which}, timed against those ops on the first calls of "
                 f"each input size class; the faster serves):"]
        for e in entries:
            pred = ("no prediction" if e["predicted"] is None else
                    f"predicted {e['predicted']:.2f}x ({e['fused_us']:.1f} µs fused vs "
                    f"{e['unfused_us']:.1f} µs unfused)")
            head = f"    {e['kernel']}: {pred}"
            if e.get("why_not"):
                lines.append(f"{head}; not measured: {e['why_not']}")
                continue
            done = [d for d in e["decisions"] if d["choice"]]
            if not done:
                lines.append(f"{head}; not measured yet")
            for d in done:
                how = "measured" if d["source"] == "measured" else "measured earlier, cached"
                lines.append(f"{head}; inputs ~2^{d['class']} B: kernel "
                             f"{d['kernel_us']:.1f} µs vs native segment "
                             f"{d['native_us']:.1f} µs ({how}) -> {d['choice']}")
        return lines

    def summary(self) -> str:
        """The report as text: counts, kernels, what was not fused and why, notes."""
        lines = [f"stitching report for {self.function}", "  " + self._headline()]
        stitched = [r for _, r, why in self.bodies if r is not None and not why]
        if self.bodies:
            ops = self.memory_intensive_ops + sum(r.memory_intensive_ops for _, r, _ in
                                                  self.bodies if r is not None)
            fused = self.fused_ops + sum(r.fused_ops for r in stitched)
            kernels = len(self.kernels) + sum(len(r.kernels) for r in stitched)
            lines.append(f"  with the {_plural(len(self.bodies), 'function')} control flow "
                         f"runs: fused {fused} of {ops} memory-intensive TF ops "
                         f"({100 * fused / ops if ops else 100:.0f}%) into "
                         f"{_plural(kernels, 'kernel')}")
        if self.profile:
            lines.append(f"  cost model's device profile: {self.profile}")
        if self.tiering:
            lines.append(f"  tiered: {self.tiering}")
        counted = sum(len(k.split_ops()[0]) for k in self.kernels)
        lines.extend(_kernel_line(k, "  ") for k in self.kernels)
        lines.extend(self._tier_lines())
        if counted > self.fused_ops - len(self.folded):
            lines.append(f"  ({counted - self.fused_ops + len(self.folded)} op(s) computed "
                         f"in more than one kernel are counted once in the total)")
        if self.folded:
            lines.append(f"  in a matrix product's op ({len(self.folded)}):")
            lines.extend(_grouped(self.folded))
        if self.unfused:
            lines.append(f"  not fused ({len(self.unfused)} of {self.memory_intensive_ops}):")
            lines.extend(_grouped(self.unfused))
        lines.extend(self._body_lines())
        lines.extend(self._autotune_lines())
        lines.extend(_note_lines(self.notes))
        return "\n".join(lines)

    def _tier_lines(self) -> list:
        told = [(name, k.tiering()) for name, k in self.code_tiers]
        told = [(name, t) for name, t in told if t]
        if not told:
            return []
        head = "  tiered compile (quick tier-1 code first, optimized tier 2 behind it):"
        if len(told) <= _TIER_LINES:
            return [head] + [f"    {name}: {t}" for name, t in told]
        # a line per kernel would double a large model's summary: the counts, with
        # to_dict()["compile_tiers"] holding each kernel's line
        states = [s for s in (k.tier_state() for _, k in self.code_tiers) if s]
        held = sum(h for h, _ in states)
        done = sum(d for _, d in states)
        return [f"{head} {len(told)} kernels: {held} held on their TF ops at tier 1 "
                f"(slower than TF there), {len(told) - held} ran tier 1; tier 2 in for "
                f"{done}, not yet for {len(told) - done} (to_dict()['compile_tiers'] has "
                f"each kernel's)"]

    def _took(self) -> str:
        """What this trace's ``compile_seconds`` were spent on: a trace that found its
        kernels built (a Keras step's relaxed batch, after the exact one) says so
        rather than "compiled in 0.0 s"."""
        s = f"{self.compile_seconds:.1f} s"
        if self.from_result_cache:
            return f"reused from the result cache in {s}"
        n, old = self.unique_kernels, self.reused_kernels
        if n and old >= n:
            return (f"planned in {s}, {'its kernel' if n == 1 else f'all {n} kernels'} "
                    f"built for an earlier trace")
        if old:
            return (f"planned and compiled in {s} ({old} of {n} distinct kernels built "
                    f"for an earlier trace)")
        return f"planned and compiled in {s}"

    def _headline(self) -> str:
        n, fused = self.memory_intensive_ops, self.fused_ops
        took = self._took()
        if not n:
            return (f"fused 0 of 0 memory-intensive TF ops: nothing to fuse (matrix "
                    f"products and convolutions stay TF's); {took}")
        k = len(self.kernels)
        shared = ""
        if self.unique_kernels < k or (k and self.code_objects < self.unique_kernels):
            shared = (f" ({self.unique_kernels} distinct, served by "
                      f"{_plural(self.code_objects, 'compiled code')})")
        head = f"fused {fused} of {n} memory-intensive TF ops ({100 * fused / n:.0f}%)"
        if self.folded:
            return (f"{head}: {fused - len(self.folded)} into {_plural(k, 'kernel')}{shared}, "
                    f"{len(self.folded)} into matrix products' ops; {took}")
        return f"{head} into {_plural(k, 'kernel')}{shared}; {took}"

    def _body_lines(self) -> list:
        lines = []
        for fname, r, why in self.bodies:
            if r is None or why:
                counts = (f"{r.memory_intensive_ops} memory-intensive op(s), "
                          if r is not None else "")
                lines.append(f"  control-flow function {fname}: {counts}kept as traced "
                             f"({why})")
                continue
            lines.append(f"  control-flow function {fname}: {r._headline()}")
            lines.extend(_kernel_line(k, "    ") for k in r.kernels)
            if r.unfused:
                lines.append(f"    not fused ({len(r.unfused)} of "
                             f"{r.memory_intensive_ops}):")
                lines.extend("  " + line for line in _grouped(r.unfused))
        return lines

    def explain(self) -> str:
        """Per kernel the planner considered: decision, scores, alternatives (search planner)."""
        if not self.explanation:
            why = ("summary() says why each op was left to TF" if self.unfused else
                   "it has no memory-intensive ops" if not self.memory_intensive_ops
                   else "the plan came from a planner that records none")
            return f"no kernel was scored for {self.function}: {why}"
        lines = [f"stitching plan for {self.function}"]
        for e in self.explanation:
            head = e.get("kernel") or ("fused" if e["deployed"] else "left alone")
            # the planner's nodes, Identity and the other no-work ops included (the
            # summary's counts leave those out)
            lines.append(f"{head}: {len(e['nodes'])} nodes [{', '.join(e['nodes'][:6])}"
                         f"{', …' if len(e['nodes']) > 6 else ''}]")
            lines.append(f"    predicted {e['fused_us']} µs fused vs {e['unfused_us']} µs "
                         f"unfused; {e['score']}")
            if e["launch"]:
                lines.append(f"    launch: {e['launch']}")
            if e["reason"]:
                lines.append(f"    left alone: {e['reason']}")
            for a in e["alternatives"]:
                what = "time" if a["kind"] == "launch" else "gain"
                lines.append(f"    {a['kind']:8} {what} {a['score_us']:+9.1f} µs  "
                             f"{a['what']}  ({a['outcome']})")
        return "\n".join(lines)

    def __str__(self):
        return self.summary()


def _note_lines(notes) -> list:
    """``  note: ...`` lines; notes that differ only in their region's nodes and
    shapes (a ConcatV2 cut in each of InceptionV3's eleven blocks, NASNet's 27) are
    one line and a count (``notes`` lists each)."""
    groups: dict = {}
    for n in notes:
        key = re.sub(r"\[[^\]]*\]", "[…]", re.sub(r"^\{[^}]*\}\s*", "", n)) \
            if n.startswith("{") else n
        groups.setdefault(key, []).append(n)
    lines = []
    for key, same in groups.items():
        lines.append(f"  note: {same[0]}")
        if len(same) > 1:
            lines.append(f"  note: … and {len(same) - 1} more region(s) the same way "
                         f"({key.split(':')[0]}; report.notes lists each)")
    return lines


_TIER_LINES = 8       # more tiered kernels than this: one count line, not one each


def _kernel_line(k, indent: str) -> str:
    """A kernel's summary line: the memory-intensive ops it computes (counted), the
    other ops inside it (named, not counted), its schedule."""
    mem, other = k.split_ops()
    scope = _scope([n for n, _ in k.ops])
    where = f" ({scope})" if scope else ""
    line = (f"{indent}{k.name}{where}: {_plural(len(mem), 'op')} "
            f"[{', '.join(t for _, t in mem)}]")
    if other:
        kinds = {t: sum(1 for _, o in other if o == t) for _, t in other}
        also = ", ".join(t if n == 1 else f"{n} {t}" for t, n in kinds.items())
        # the 1x1 convolutions of a squeeze-excite gate (SmallMatMul) and depthwise
        # convolutions are contractions: real work, but not memory-intensive ops
        convs = ("Conv2D", "DepthwiseConv2dNative")
        what = "contractions and views" if any(c in kinds for c in convs) \
            else "no data work"
        line += f" (also {also}: {what}, not counted)"
    return f"{line} — {k.schedule}" if k.schedule else line


def _scope(nodes) -> str:
    """Where in the model a kernel's nodes are: their common name scope and, where
    they span several scopes under it, the first and last of those (a Keras layer's
    name): ``model/{block2a_expand_bn … block2a_se_excite}``; "" where the nodes
    share no scope."""
    parts = [n.split("/")[:-1] for n in nodes]
    if not parts or not all(parts):
        return ""
    common = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    below = []
    for p in parts:
        if len(p) > len(common) and p[len(common)] not in below:
            below.append(p[len(common)])
    head = "/".join(common)
    if len(below) <= 1:
        return "/".join(common + below)
    span = f"{{{below[0]} … {below[-1]}}}"
    return f"{head}/{span}" if head else span


def _grouped(entries) -> list:
    """Report lines for ``[(TF node, op type, why)]``: one line per reason, its first
    four ops named."""
    by_why: dict[str, list] = {}
    for node, op, why in entries:
        by_why.setdefault(why, []).append(f"{op} ({node})")
    return [f"    {', '.join(items[:4])}"
            f"{f', … {len(items) - 4} more' if len(items) > 4 else ''}: {why}"
            for why, items in by_why.items()]


def _plural(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"
