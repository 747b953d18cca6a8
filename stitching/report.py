"""What stitching did to one traced function, for people and for tools.

``summary()`` is the text a user reads; ``to_dict()`` the same facts as data
(keys: memory_intensive_ops, fused_ops, kernels, coverage, unfused,
kernel_details, boundaries, compile_seconds, notes, bodies, autotune).  Counts are in TF ops of
the original graph: a Softmax is one op even though its kernel expands it.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KernelInfo:
    name: str
    ops: list            # [(tf node name, tf op type)]
    schedule: str        # one line from the schedule stage
    inputs: int
    outputs: int
    spec_hash: str


@dataclass
class Report:
    function: str = "?"
    memory_intensive_ops: int = 0
    fused_ops: int = 0
    kernels: list = field(default_factory=list)       # list[KernelInfo]
    unfused: list = field(default_factory=list)       # [(tf node, tf op, reason)]
    boundaries: list = field(default_factory=list)    # [(tf node, reason)] merges refused
    compile_seconds: float = 0.0
    unique_kernels: int = 0
    code_objects: int = 0      # distinct native codes (kernel.code_name) serving them
    notes: list = field(default_factory=list)
    # the functions control flow runs (tf.cond branches, loop bodies), each stitched on
    # its own: [(function name, its Report or None, why it was kept as traced or "")]
    bodies: list = field(default_factory=list)
    explanation: list = field(default_factory=list)   # per kernel: alternatives and scores
    profile: str = ""          # the device profile the cost model planned with (its source)
    dump_path: str | None = None   # the graph dump of this trace, when dumping is on
    # Options(autotune): the kernels timed against their native segment (tf/autotune.py)
    # with the model's prediction; what the measurements decided is read live
    autotune: list = field(default_factory=list)

    @property
    def coverage(self) -> float:
        if not self.memory_intensive_ops:
            return 1.0
        return self.fused_ops / self.memory_intensive_ops

    def to_dict(self) -> dict:
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
            "kernel_details": [{"name": k.name, "ops": [t for _, t in k.ops],
                                "nodes": [n for n, _ in k.ops], "schedule": k.schedule,
                                "inputs": k.inputs, "outputs": k.outputs,
                                "spec_hash": k.spec_hash} for k in self.kernels],
            "boundaries": [{"node": n, "reason": r} for n, r in self.boundaries],
            "compile_seconds": round(self.compile_seconds, 3),
            "notes": list(self.notes),
            "bodies": [{"function": f, "why_kept": why,
                        "report": r.to_dict() if r is not None else None}
                       for f, r, why in self.bodies],
            "explanation": list(self.explanation),
            "profile": self.profile,
            "autotune": self.autotune_decisions(),
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
        entries = self.autotune_decisions()
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
        lines = [f"stitching report for {self.function}",
                 f"  memory-intensive TF ops: {self.memory_intensive_ops}, fused: "
                 f"{self.fused_ops} ({100 * self.coverage:.0f}%) into {len(self.kernels)} "
                 f"kernel(s) ({self.unique_kernels} distinct specs served by "
                 f"{self.code_objects} compiled kernel(s); planned and compiled in "
                 f"{self.compile_seconds:.1f}s)"]
        stitched = [r for _, r, why in self.bodies if r is not None and not why]
        if self.bodies:
            ops = self.memory_intensive_ops + sum(r.memory_intensive_ops for _, r, _ in
                                                  self.bodies if r is not None)
            fused = self.fused_ops + sum(r.fused_ops for r in stitched)
            kernels = len(self.kernels) + sum(len(r.kernels) for r in stitched)
            lines.append(f"  with the {len(self.bodies)} function(s) control flow runs: "
                         f"memory-intensive TF ops: {ops}, fused: {fused} "
                         f"({100 * fused / ops if ops else 100:.0f}%) into {kernels} "
                         f"kernel(s)")
        if self.profile:
            lines.append(f"  cost model's device profile: {self.profile}")
        for k in self.kernels:
            ops = ", ".join(t for _, t in k.ops)
            lines.append(f"  {k.name}: {len(k.ops)} ops [{ops}] — {k.schedule}")
        if self.unfused:
            lines.append(f"  not fused ({len(self.unfused)}):")
            by_reason: dict[str, list] = {}
            for node, op, reason in self.unfused:
                by_reason.setdefault(reason, []).append(f"{op} ({node})")
            for reason, items in by_reason.items():
                shown = ", ".join(items[:4]) + (f", … {len(items) - 4} more" if len(items) > 4 else "")
                lines.append(f"    {reason}: {shown}")
        lines.extend(self._body_lines())
        lines.extend(self._autotune_lines())
        for n in self.notes:
            lines.append(f"  note: {n}")
        return "\n".join(lines)

    def _body_lines(self) -> list:
        lines = []
        for fname, r, why in self.bodies:
            if r is None or why:
                counts = (f"{r.memory_intensive_ops} memory-intensive op(s), "
                          if r is not None else "")
                lines.append(f"  control-flow function {fname}: {counts}kept as traced "
                             f"({why})")
                continue
            lines.append(f"  control-flow function {fname}: memory-intensive TF ops: "
                         f"{r.memory_intensive_ops}, fused: {r.fused_ops} "
                         f"({100 * r.coverage:.0f}%) into {len(r.kernels)} kernel(s)")
            for k in r.kernels:
                ops = ", ".join(t for _, t in k.ops)
                lines.append(f"    {k.name}: {len(k.ops)} ops [{ops}] — {k.schedule}")
        return lines

    def explain(self) -> str:
        """Per kernel the planner considered: decision, scores, alternatives (search planner)."""
        if not self.explanation:
            return f"no explanation for {self.function}: the planner records none"
        lines = [f"stitching plan for {self.function}"]
        for e in self.explanation:
            head = e.get("kernel") or ("fused" if e["deployed"] else "left alone")
            lines.append(f"{head}: {len(e['nodes'])} ops [{', '.join(e['nodes'][:6])}"
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
