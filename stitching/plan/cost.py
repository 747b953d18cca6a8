"""The cost model: how long a kernel takes and what fusing saves.  No correctness here.

Legality (may we fuse?) lives in legality.py, the schedule stage and the planner's cycle
check; this module only answers "should we?", in seconds, from a DeviceProfile.  Two
levels, as in FusionStitching:

  delta evaluator  GraphCosts.delta(pattern)        during search, O(|pattern|), memoized
  ─────────────────────────────────────────────────────────────────────────────────────
    gain(P)      = Σ unfused(op ∈ P) − fused(P)                       (> 0: fusing pays)
    unfused(op)  = scale(class(op)) · (launch + task + max(passes · bytes in+out / bw(lanes(op)),
                                                          transc. · cost_TF(op) / rate))
                   scale: the profile's measured TF time over this estimate for the op's
                   class (tf_class; profiles.py "Calibration"), 1 where not calibrated
                   passes = legality.work(op): 1, or more for a composite TF op (Softmax
                   4, FusedBatchNorm 2: legality.COMPOSITE_PASSES) whose TF kernel walks
                   its data more than once
                   An op TF's remapper fuses into a convolution (epilogue.py: the
                   conv's BiasAdd and some activations) costs its compute only
    fused(P)     = launch + task + max(io(P) / bw(active(P)), Σ transc. · cost(op) / rate)
                   + scratch(P) + register spills(P)
    cost(op)     a transcendental op's cost per element relative to Exp's, in our kernels
                 (cost) or TF's (cost_TF): the profile's per-op tables (kernel_op_cost,
                 tf_op_cost; tools/calibrate.py --ops), 1 where absent ("rate" is the
                 profile's measured Exp throughput)
    io(P)        distinct values read from outside P + values leaving P, each once
    active(P)    lanes P keeps busy: all for element-wise work; the row count when a
                 reduction's result is consumed inside P            ("lost parallelism")
    scratch(P)   values that must survive a reduction barrier (LayerNorm's x - mean):
                 made in P: stored and loaded (2·bytes), inputs of P: loaded again (bytes);
                 at cache bandwidth while a row fits the per-task scratch budget, else at
                 bw — a second pass through memory ("resource pressure")
    registers    values live at once beyond the register file: CPU spills to L1, GPU
                 loses occupancy (fewer active lanes)                ("resource pressure")
    calibrated   both sides' size-dependent parts (all but one launch and task) times the
                 profile's measured factors (tools/calibrate.py): unfused(op) by its
                 class's TF factor at its size, fused(P) by the kernel factors of P's
                 members weighted by their work (calibrated_s, kernel_factor) — those
                 are fitted where memory dominates: a kernel's compute takes the
                 profile's own compute factor instead (kernel_compute_scale,
                 kernel_compute_s), so a compute-bound kernel is not priced at a
                 memory fit

  latency evaluator  choose_launch(spec)            once per final kernel, from its spec
  ─────────────────────────────────────────────────────────────────────────────────────
      R rows ─▶ ┌─────────────── L ───────────────┐
                │ r = rows_per_task  │ c = col_block ≤ L
                └──────────────────────────────────┘
      tasks = ⌈R/r⌉·⌈L/c⌉        waves = ⌈tasks / resident tasks⌉
      t = launch + waves·(task overhead + max(task bytes / lane bw, compute))
          + scratch or spill + (c < L ? combine pass : 0)
    The fastest candidate wins (a near-tie: the one keeping every lane busy), many short rows packed per task, a long row split across
    tasks when too few rows would leave lanes idle (AStitch's adaptive thread mapping) —
    where the schedule can split a row (element-wise and column kernels freely; a row
    reduction in phases: partial reductions per piece, combined before the consumers
    read the row again — the spec then asks for code that can, ``split_rows=1``).
    Where values live (which are re-loaded in later passes, which sit in per-row scratch)
    comes from the schedule stage (stitching.schedule.build_schedule) when it builds one,
    else from this module's own estimate.  Rows unknown until run time: the time is
    estimated at DEFAULT_DIM, but no parameters are fixed (the kernel picks at run time).

  reuse choice  reuse_reason(spec)                 per kernel the search keeps
  ─────────────────────────────────────────────────────────────────────────────────────
    a folded layout op recomputes what it reads (schedule/layout.py, Recompute): the
    kernel's time with those evaluations against writing and reading the value once
    and a launch; reloading wins -> the search cuts the kernel there, with the numbers

Unknown dims (-1) are assumed DEFAULT_DIM; every other constant is labelled below.

  unknown dims  priced_dims(spec) / assume_dim(n)  per kernel the search deploys
  ─────────────────────────────────────────────────────────────────────────────────────
    a kernel whose later pass re-reads a working set that an unknown dim sizes (a
    column kernel over an unknown batch: its second pass reads its inputs again, from
    cache while they fit, else from memory) wins at some batches and loses at others,
    so DEFAULT_DIM alone cannot say it pays: the search deploys it only where it is
    predicted to gain with that dim at each of UNKNOWN_DIM_RANGE (search.py _schedule)
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass
from typing import NamedTuple

from ..ir import OPS, Graph, Kind, Node, TensorType, ValueRef
from ..ir.dtypes import ITEMSIZE
from . import epilogue as _epi
from . import legality as _leg
from .profiles import DeviceProfile, tf_factor

DEFAULT_DIM = 32              # arbitrary: size assumed for a dim unknown until run time
UNKNOWN_DIM_RANGE = (8, DEFAULT_DIM, 128)   # arbitrary: batches a training step runs (a
                              # quarter to four times DEFAULT_DIM), at each of which a
                              # kernel whose cost depends on the unknown dim's size beyond
                              # proportion (priced_dims) must be predicted to gain
_assumed = contextvars.ContextVar("stitching_assumed_dim", default=DEFAULT_DIM)
CPU_GRAIN = 16384             # arbitrary (the schedule's EW_BLOCK): elements per shard;
                              # smaller ops stay on one core, unfused or fused alike
GPU_ROW_VALUES_PER_THREAD = 8  # arbitrary: row values one thread keeps in registers
GPU_BASE_REGS = 16            # arbitrary: registers a thread needs besides live values
MIN_COL_BLOCK = 1024          # arbitrary: a row is never split into pieces shorter
EPILOGUE_TIE_S = 1e-9         # arbitrary: a conv epilogue TF's remapper would fuse
                              # (epilogue.py) costs a kernel this much more: on a tie (a
                              # compute-bound kernel, where its Relu is free either way) it
                              # stays in the convolution, as stock TF runs it
TAPS_PER_TRANSCENDENTAL = 8   # rough: a window's tap is a multiply-add and two loads,
                              # a vectorized exp ~8 simple ops (schedule/passes.py)
GPU_THREADS = (32, 64, 128, 256, 512, 1024)
_SOFTMAX = ("Softmax", "LogSoftmax")


# ---- shapes -----------------------------------------------------------------------------

def unknown_dim() -> int:
    """The size a dim unknown until run time is priced at: DEFAULT_DIM, or the one
    ``assume_dim`` sets for this thread."""
    return _assumed.get()


@contextlib.contextmanager
def assume_dim(n: int):
    """Price unknown dims at ``n`` inside (this thread and context only); a GraphCosts
    or KernelShape made inside keeps the sizes it was made with."""
    token = _assumed.set(n)
    try:
        yield
    finally:
        _assumed.reset(token)


def elems(t: TensorType) -> int:
    u = _assumed.get()
    if t.shape is None:
        return u
    n = 1
    for d in t.shape:
        n *= d if d >= 0 else u
    return n


def nbytes(t: TensorType) -> int:
    return elems(t) * ITEMSIZE.get(t.dtype, 4)


def _known(t: TensorType) -> bool:
    return t.shape is not None and all(d >= 0 for d in t.shape)


class Geometry(NamedTuple):
    rows: int        # independent rows (kept elements)
    row_len: int     # elements reduced per row
    internal: bool   # the op itself consumes its reduction (Softmax)


def geometry(op: str, attrs: dict, x: TensorType) -> Geometry | None:
    """Rows x row length of a reduction (or Softmax), None for anything else."""
    n = elems(x)
    if op in _SOFTMAX:
        last = x.shape[-1] if x.shape else 1
        last = last if last >= 0 else unknown_dim()
        return Geometry(max(1, n // max(1, last)), last, True)
    d = OPS.get(op)
    if d is None or d.kind != Kind.REDUCTION or x.shape is None:
        return None
    row = 1
    for a in attrs.get("axes", ()):
        if 0 <= a < len(x.shape):
            row *= x.shape[a] if x.shape[a] >= 0 else unknown_dim()
    return Geometry(max(1, n // max(1, row)), row, False)


def tf_class(op: str, attrs: dict, x: TensorType | None, transcendental: bool) -> str:
    """The calibration class of one op left to TF (profiles.TF_CLASSES)."""
    if op in _SOFTMAX:
        return "softmax"
    d = OPS.get(op)
    if d is not None and d.kind == Kind.REDUCTION and x is not None and x.shape is not None:
        rank = len(x.shape)
        axes = sorted({a % rank for a in attrs.get("axes", ()) if -rank <= a < rank}) \
            if rank else []
        trailing = axes == list(range(rank - len(axes), rank))
        return "row_reduction" if trailing else "column_reduction"
    return "transcendental" if transcendental else "elementwise"


def elementwise_lanes(p: DeviceProfile, n: int) -> int:
    """Lanes an element-wise loop over n elements keeps busy."""
    if p.backend == "cpu":
        return max(1, min(p.lanes, -(-n // CPU_GRAIN)))
    return max(1, min(p.lanes, n))


def row_lanes(p: DeviceProfile, rows: int, row_len: int) -> int:
    """Lanes a kernel parallel over rows keeps busy.  On the CPU fewer rows than lanes
    are split into pieces of at least MIN_COL_BLOCK (cpu.py's split rows, in phases)."""
    if p.backend == "cpu":
        pieces = rows if rows >= p.lanes else rows * max(1, row_len // MIN_COL_BLOCK)
        return max(1, min(p.lanes, pieces))
    return max(1, min(p.lanes, rows * min(row_len, p.max_threads_per_task)))


def calibrated_s(p: DeviceProfile, t: float, factor: float) -> float:
    """A modelled time ``t`` with a calibration factor applied to its size-dependent
    part: the fixed cost of one launch and one task is the profile's own (calibration
    measures at 1 MiB and up, where it is noise; scaling it would misprice tiny ops)."""
    fixed = min(t, p.launch_s + p.task_s)
    return fixed + factor * (t - fixed)


def _compute_s(p: DeviceProfile, transcendentals: float, active: float) -> float:
    return transcendentals / (p.transcendental_per_s * min(1.0, active / p.lanes))


# Chained transcendentals.  The per-op costs (profile.kernel_op_cost) are measured on
# independent evaluations (tools/calibrate.py --ops: six of one op on shifted inputs),
# which a vectorized loop runs at the units' throughput.  Where one transcendental
# consumes another's result the evaluations of an element wait on each other; the
# out-of-order window overlaps the next elements' only while a loop body is short.
# Measured on the amd-avx512 machine, six chained ops of one kind in one kernel against
# six independent ones at 4 MiB (float32; three runs, tools/chain_bench.py and the
# script it came from): Exp 1.84-2.66x, Tanh 2.04-2.45x, Sigmoid 2.00-2.38x, Erf
# 1.72-2.23x, Sin 1.86-2.17x, Cos 1.97-2.14x the time.  Modelled: an
# element's evaluations take max(S, CHAIN_LATENCY * C * min(1, S / CHAIN_WINDOW)), with
# S the sum of its transcendentals' costs and C the costliest chain of them (both in
# Exps); a body shorter than the window overlaps others and runs at S.  CPU only: a GPU
# hides an element's latency behind other warps'.
CHAIN_LATENCY = 2.4      # tuned: above the ratios' median (2.1), erring toward cutting a
#                          chain, which costs less than modelled where its intermediates
#                          stay in cache: the chain_bench chain of six at [64, 32, 4, 64]
#                          ran 0.90 ms as the two kernels 2.4 plans, 1.02 as the one 2.1 does
CHAIN_WINDOW = 6.0       # tuned: Exps of independent work per element the window holds
#                          (six chained Exps ran 2.6x; one Exp, or six independent, 1x)


def chained_evaluations(total: float, chain: float, elements: float) -> float:
    """Transcendentals' worth (Exps) of a kernel evaluating ``total`` of them over
    ``elements`` elements whose costliest dependent chain is ``chain`` (both in Exps,
    summed over the elements): ``total`` where the chains are short, up to
    CHAIN_LATENCY x ``chain`` where one chain fills the loop body."""
    if total <= 0 or chain <= 0 or elements <= 0:
        return total
    per_element = total / elements
    return max(total, CHAIN_LATENCY * chain * min(1.0, per_element / CHAIN_WINDOW))


def op_cost(table: dict, op: str | None) -> float:
    """Cost per element of transcendental ``op`` relative to Exp's, from a profile's
    per-op table (kernel_op_cost or tf_op_cost); 1 where the table has none."""
    return float(table.get(op, 1.0)) if op else 1.0


def kernel_compute_s(p: DeviceProfile, compute_s: float, factor: float) -> float:
    """A generated kernel's modelled compute time in the units ``calibrated_s(t,
    factor)`` then scales: it comes out at the profile's compute factor
    (kernel_compute_scale, fitted on a compute-bound kernel; 1 when not calibrated),
    not at the memory-fitted kernel ``factor``."""
    return compute_s * (p.kernel_compute_scale or 1.0) / max(factor, 1e-9)


# ---- delta evaluator --------------------------------------------------------------------

class Delta(NamedTuple):
    gain_s: float              # unfused_s - fused_s
    fused_s: float
    unfused_s: float
    bytes_saved: int           # memory traffic the kernel avoids
    launches_saved: int
    parallel_penalty_s: float  # time lost to lanes left idle
    pressure_penalty_s: float  # scratch, spills and occupancy

    def describe(self) -> str:
        return (f"gain {self.gain_s * 1e6:+.1f} µs (saves {self.bytes_saved / 1024:.1f} KiB, "
                f"{self.launches_saved} launch(es); penalties: parallelism "
                f"{self.parallel_penalty_s * 1e6:.1f} µs, pressure "
                f"{self.pressure_penalty_s * 1e6:.1f} µs)")


class GraphCosts:
    """Per-node facts of one graph, precomputed once; ``delta(P)`` for node-index sets.

    Nodes are addressed by their index in ``order`` (a topological order); a pattern is a
    frozenset of indices.  Constants read by a pattern are folded into it (no traffic).
    """

    def __init__(self, graph, profile: DeviceProfile, order: list):
        self.profile = profile
        self.index = {n: i for i, n in enumerate(order)}
        self.names = list(order)
        fetched = {(r.node, r.index) for r in graph.outputs}
        cons = graph.consumers()
        size, ins, outs, pinned, unf, work, red, tr, tr_tf, item, scale, kscale, chain = \
            ([] for _ in range(13))
        factors, kfactors = profile.tf_time_scale, profile.kernel_time_scale
        for name in order:
            node = graph[name]
            ins.append(self._inputs(graph, node))
            size.append(nbytes(node.outputs[0]) if node.outputs else 0)
            item.append(ITEMSIZE.get(node.outputs[0].dtype, 4) if node.outputs else 4)
            pinned.append((name, 0) in fetched)
            work.append(_leg.work(node))
            red.append(geometry(node.op, node.attrs, graph.type_of(node.inputs[0]))
                       if node.inputs else None)
            count, op = self._transcendentals(graph, node)
            tr.append(count * op_cost(profile.kernel_op_cost, op))
            chain.append(op_cost(profile.kernel_op_cost, op) if op and count else 0.0)
            tr_tf.append(count * op_cost(profile.tf_op_cost, op))
            outs.append(sum(nbytes(t) for t in node.outputs))
            cls = tf_class(node.op, node.attrs,
                           graph.type_of(node.inputs[0]) if node.inputs else None, count > 0)
            largest = max([outs[-1]] + [b for _, b, _ in ins[-1]])
            scale.append(tf_factor(factors, cls, largest) if factors else 1.0)
            kscale.append(tf_factor(kfactors, cls, largest) if kfactors else 1.0)
        self.size, self.ins, self.pinned, self.work = size, ins, pinned, work
        self.scale, self.kscale = scale, kscale
        self.red, self.tr, self.tr_tf, self.item = red, tr, tr_tf, item
        self.chain = chain      # a transcendental op's cost per element (Exps), else 0
        self.cons = [frozenset(self.index[c] for c in cons[n]) for n in order]
        # elements of the largest value an op touches (a reduction's is its input)
        self.count = [max([max(1, size[i] // item[i])] + [b // item[i] for _, b, _ in ins[i]])
                      for i in range(len(order))]
        self.epilogue = [_epi.ATTR in graph[n].attrs for n in order]
        self.io_bytes = [(sum(b for _, b, _ in ins[i]) + outs[i]) * work[i]
                         for i in range(len(order))]   # traffic of the op left to TF
        self.unfused = [self._unfused(i) for i in range(len(order))]
        self._free_values = (profile.registers_per_unit if profile.backend == "cpu" else
                             profile.registers_per_unit // profile.max_threads_per_unit
                             - GPU_BASE_REGS)   # live values that cost nothing
        self._memo: dict = {}
        self._weights = None     # kernel_factor's per-node terms
        self._producers = [tuple(u for _, _, u in i) for i in ins]    # _chain's edges

    def _inputs(self, graph, node) -> tuple:
        """((value id, bytes, producer index), ...): distinct non-constant inputs."""
        seen, out = set(), []
        for r in node.inputs:
            if r in seen or graph[r.node].op == "Const":
                continue
            seen.add(r)
            out.append(((self.index[r.node] << 4) | min(r.index, 15),
                        nbytes(graph.type_of(r)), self.index[r.node]))
        return tuple(out)

    @staticmethod
    def _transcendentals(graph, node) -> tuple:
        """(compute in transcendentals' worth, the op whose per-op cost applies or
        None): a transcendental op's elements (a Softmax's are its Exps), a depthwise
        convolution's taps (TF's kernel or the fused one alike,
        TAPS_PER_TRANSCENDENTAL to one)."""
        d = OPS.get(node.op)
        if node.op in _SOFTMAX:
            return elems(node.outputs[0]), "Exp"
        if d is not None and d.transcendental:
            return elems(node.outputs[0]), node.op
        if d is not None and d.kind == Kind.WINDOW:
            taps = math.prod(graph.type_of(node.inputs[1]).shape[:2])
            return elems(node.outputs[0]) * taps // TAPS_PER_TRANSCENDENTAL, None
        return 0, None

    def _unfused(self, i: int) -> float:
        """One TF op on its own: a launch plus its traffic (all its passes) at its own
        parallelism."""
        if not self.work[i]:
            return 0.0
        p = self.profile
        lanes = elementwise_lanes(p, self.count[i])
        compute = _compute_s(p, self.tr_tf[i], lanes)
        if self.epilogue[i]:     # TF's remapper runs it inside the convolution: no launch,
            return compute       # no pass over memory (epilogue.py)
        mem = self.io_bytes[i] / p.bw_at(lanes)
        return calibrated_s(p, p.launch_s + p.task_s + max(mem, compute), self.scale[i])

    def unfused_s(self, members) -> float:
        return sum(self.unfused[v] for v in members)

    def kernel_factor(self, P) -> float:
        """The calibration factor of a kernel of ``P``: its members' kernel factors
        (profile.kernel_time_scale, by class and size) weighted by each one's share of
        the work (its uncalibrated time as an op of its own); 1 without factors."""
        if not self.profile.kernel_time_scale:
            return 1.0
        if self._weights is None:
            # each node's weight and weighted factor, computed once (the planner asks
            # for thousands of patterns); summed in P's order as before: the same floats
            fixed = self.profile.launch_s + self.profile.task_s
            w = [max(0.0, u - fixed) / s for u, s in zip(self.unfused, self.scale)]
            self._weights = (w, [x * k for x, k in zip(w, self.kscale)])
        w, wk = self._weights
        total = sum(map(w.__getitem__, P))
        return sum(map(wk.__getitem__, P)) / total if total > 0 else 1.0

    def delta(self, P: frozenset) -> Delta:
        d = self._memo.get(P)
        if d is None:
            d = self._memo[P] = self._delta(P)
        return d

    def gain(self, P: frozenset) -> float:
        return self.delta(P).gain_s

    def _delta(self, P: frozenset) -> Delta:
        p, red, cons, size, pinned = self.profile, self.red, self.cons, self.size, self.pinned
        seen, io, stitched = set(), 0, []
        for v in P:
            for val, b, u in self.ins[v]:
                if u not in P and val not in seen:
                    seen.add(val)
                    io += b
            if pinned[v] or not P.issuperset(cons[v]):
                io += size[v]
            if red[v] is not None and (red[v].internal or not P.isdisjoint(cons[v])):
                stitched.append(v)
        work = sum(map(bool, map(self.work.__getitem__, P)))
        unf_bytes = sum(map(self.io_bytes.__getitem__, P))    # 0 for ops that move nothing
        unfused = sum(map(self.unfused.__getitem__, P))
        tr = sum(map(self.tr.__getitem__, P))
        big = max(map(self.count.__getitem__, P))
        if tr > 0 and p.backend == "cpu":     # a GPU hides latency with other warps
            tr = chained_evaluations(tr, self._chain(P) * big, big)
        active = (min(row_lanes(p, red[v].rows, red[v].row_len) for v in stitched)
                  if stitched else elementwise_lanes(p, big))
        scratch_s = self._scratch_s(P, stitched, active) if stitched else 0.0
        spill_s, active_p = self._register_pressure(P, big, active)
        mem = io / p.bw_at(active_p)
        factor = self.kernel_factor(P)
        compute = kernel_compute_s(p, _compute_s(p, tr, active_p), factor)
        fused = calibrated_s(p, p.launch_s + p.task_s + max(mem, compute) + scratch_s + spill_s,
                             factor)
        fused += EPILOGUE_TIE_S * sum(map(self.epilogue.__getitem__, P))
        full = io / p.bw_at(elementwise_lanes(p, big))
        return Delta(unfused - fused, fused, unfused, unf_bytes - io, max(0, work - 1),
                     max(0.0, io / p.bw_at(active) - full),
                     scratch_s + spill_s + mem - io / p.bw_at(active))

    def _chain(self, P) -> float:
        """The costliest chain of dependent transcendental ops in P, per element (Exps);
        indices follow the planning order, which is topological."""
        preds, chain = self._producers, self.chain
        path: dict = {}
        for v in sorted(P):
            # the largest path into v (its producers in P), else 0.0: max() with its
            # default, unrolled (paths are sums of costs >= 0: the same floats)
            up = 0.0
            for u in preds[v]:
                x = path.get(u)
                if x is not None and x > up:
                    up = x
            path[v] = up + chain[v]
        return max(path.values(), default=0.0)

    def _scratch_s(self, P, stitched, active) -> float:
        """Values that cross a reduction barrier: kept on chip per row, or a second pass
        (a value made in P is stored and loaded again, an input of P loaded again)."""
        p = self.profile
        traffic, per_row = 0, 0.0
        for r in stitched:
            g = self.red[r]
            before = self._ancestors(P, r)
            after = P - before - {r}
            read_after = {val for c in after for val, _, _ in self.ins[c]}
            kept = {(val, u): b for v in before | {r} for val, b, u in self.ins[v]
                    if (v == r and g.internal) or val in read_after}
            traffic += sum(b * (2 if u in P else 1) for (_, u), b in kept.items())
            per_row += sum(kept.values()) / g.rows
        if not traffic:
            return 0.0
        if p.backend == "cuda" and all(
                self.red[r].row_len <= p.max_threads_per_task * GPU_ROW_VALUES_PER_THREAD
                for r in stitched):
            return 0.0                       # the row stays in registers
        if per_row <= p.scratch_per_task:
            return traffic / p.cache_bandwidth
        return traffic / p.bw_at(active)     # a second pass through memory

    def _ancestors(self, P, r) -> frozenset:
        """Members of P that r depends on (through members only)."""
        out, stack = set(), [u for _, _, u in self.ins[r] if u in P]
        while stack:
            v = stack.pop()
            if v not in out:
                out.add(v)
                stack.extend(u for _, _, u in self.ins[v] if u in P)
        return frozenset(out)

    def _register_pressure(self, P, big, active):
        """(spill seconds, active lanes after occupancy) from values live at once."""
        p = self.profile
        if len(P) <= self._free_values:
            return 0.0, active          # too few values to press on the register file
        cons = self.cons
        live = _max_live(sorted(P), lambda v: cons[v] & P)
        if p.backend == "cpu":
            extra = max(0, live - p.registers_per_unit)
            return 2 * extra * big * 4 / p.cache_bandwidth, active
        regs = GPU_BASE_REGS + live
        per_unit = min(p.max_threads_per_unit, p.registers_per_unit // regs)
        return 0.0, min(active, p.units * per_unit)


def _max_live(order: list, users) -> int:
    """Most values alive at once when ``order`` runs front to back."""
    import heapq
    pos = {v: i for i, v in enumerate(order)}
    best, alive = 0, []
    for i, v in enumerate(order):
        while alive and alive[0] < i:
            heapq.heappop(alive)
        heapq.heappush(alive, max(map(pos.__getitem__, users(v)), default=i))
        if len(alive) > best:
            best = len(alive)
    return best


def spec_times(spec, profile: DeviceProfile) -> tuple:
    """(fused_s, unfused_s) of one kernel spec on its own, for callers that hold the
    spec but not the graph it came from (compile/tiers.py): the latency evaluator's
    time for the kernel, calibrated as the search planner calibrates it
    (search._schedule), and its ops' times left to TF (GraphCosts.unfused_s).  The
    spec's composite ops are expanded already, so TF's time for a Softmax is that of
    its pieces (more launches and passes than TF's one kernel: the unfused side errs
    high for those)."""
    def name(ref: int) -> str:
        return f"in{-ref - 1}" if ref < 0 else f"n{ref}"
    g = Graph([Node(name(-j - 1), "Placeholder", outputs=[t])
               for j, t in enumerate(spec.inputs)] +
              [Node(name(i), n.op, [ValueRef(name(a), 0) for a in n.args], dict(n.attrs),
                    [n.type]) for i, n in enumerate(spec.nodes)],
              [ValueRef(name(o), 0) for o in spec.outputs])
    costs = GraphCosts(g, profile, list(g.nodes))
    P = frozenset(costs.index[name(i)] for i in range(len(spec.nodes)))
    fused = choose_launch(spec, profile, factor=costs.kernel_factor(P)).time_s
    return fused, costs.unfused_s(P)


# ---- the reuse choice for a layout op -----------------------------------------------------
#
# A kernel folds every layout op into the indexing of what it reads (schedule/layout.py),
# evaluating the element-wise values it reads again in its own index space.  Where the
# kernel evaluates those values anyway (read directly and through a transpose, or
# through two maps: both halves of a rotate-half), that is a second evaluation per
# element.  The other choice is to end a kernel at the value (one write) and let the
# next one read it through the view (one read, one more launch): "reloaded".  The
# third, "computed" (the layout op run by TF or written by a kernel of its own), is
# what the planner does anyway where nothing fuses with it.

SIMPLE_PER_TRANSCENDENTAL = 8   # rough: a vectorized exp/tanh/erf costs about 8 simple
                                # element-wise ops (an add, a multiply, a select), as
                                # TAPS_PER_TRANSCENDENTAL


def _evaluations_s(ops, profile: DeviceProfile) -> float:
    """Seconds a generated kernel spends on the evaluations ``ops`` = ((op, type,
    share), ...): a transcendental at its op's cost (kernel_op_cost), at the profile's
    compute factor (kernel_compute_s)."""
    n = sum(elems(t) * share *
            (op_cost(profile.kernel_op_cost, op) if OPS[op].transcendental
             else 1 / SIMPLE_PER_TRANSCENDENTAL)
            for op, t, share in ops)
    return kernel_compute_s(profile, n / profile.transcendental_per_s, 1.0)


def _traffic_s(profile: DeviceProfile, nbytes: int) -> float:
    """A generated kernel moving ``nbytes`` through memory: at the device's bandwidth
    and the element-wise kernel factor of that size (calibrated as its compute is)."""
    f = tf_factor(profile.kernel_time_scale, "elementwise", nbytes) \
        if profile.kernel_time_scale else 1.0
    return f * nbytes / profile.bandwidth


def reuse_reason(spec, profile: DeviceProfile) -> str | None:
    """None when folding each of the spec's layout ops (recomputing what it reads) is
    the cheaper choice; else why the value it reads is computed once and reloaded
    instead, with both costs -- the planner then cuts the kernel there (search.py
    treats the reason as a refusal).

    Recompute: what the extra evaluations add to the kernel's time, which is the
    larger of its memory traffic and its compute (a memory-bound kernel recomputes a
    few simple ops for free; each op at its per-op cost and the profile's compute
    factor, the traffic at the memory-fitted factor, as GraphCosts prices a kernel).
    Reload: writing and reading the recomputed value once
    (each of its values, if several) at the device's bandwidth, plus a launch."""
    sched = _schedule_of(spec)
    recomputed = getattr(getattr(sched, "spec", None), "recomputed", ())
    if not recomputed:
        return None
    mem = _traffic_s(profile, sum(nbytes(t) for t in spec.inputs) +
                     sum(nbytes(t) for t in spec.output_types))
    total = _evaluations_s(((n.op, n.type, 1) for n in sched.spec.nodes), profile)
    for r in recomputed:
        extra = _evaluations_s(r.ops, profile)
        again = max(mem, total) - max(mem, total - extra)
        size = sum(nbytes(t) for t in r.values)
        reload = profile.launch_s + profile.task_s + _traffic_s(profile, 2 * size)
        if again > reload:
            what = ", ".join(sorted({op for op, _, _ in r.ops}))
            return (f"the value a {r.where} reads is computed once and reloaded: "
                    f"recomputing it through the {r.layout} costs "
                    f"{again * 1e6:.1f} µs ({len(r.ops)} element-wise op(s) evaluated "
                    f"again: {what}) > {reload * 1e6:.1f} µs to write and read "
                    f"{size / 1024:.0f} KiB and launch a kernel")
    return None


# ---- latency evaluator ------------------------------------------------------------------

@dataclass(frozen=True)
class KernelShape:
    """What the latency evaluator needs to know about one kernel spec.

    rows x row_len is the work-unit grid: a unit is ``rows_per_task`` rows, or one
    ``col_block`` piece of a row.  kind follows the schedule stage: "row" (reductions over
    the last axis), "column" (reductions over outer axes; rows = kept outer index, row_len
    = kept inner columns), "elementwise".
    """
    kind: str
    rows: int
    row_len: int
    rows_known: bool
    in_bytes: int
    out_bytes: int
    transcendentals: int
    reuse_bytes: int        # traffic re-read in later passes (scratch, re-loaded inputs)
    footprint_row: float    # bytes per row that must stay resident for that reuse
    live: int               # values alive at once
    split: str              # splitting a row across units: "free" | "combine" | "no"
    source: str             # "schedule" (stitching.schedule's placements) | "estimate"
    # SmallMatMul's products (schedule/contract.py): rows of one prologue group and the
    # seconds one lane spends on a group's products, in a phase before the element loop
    # (groups spread over the lanes)
    group_rows: int = 1
    prologue_s: float = 0.0
    prologue_phase: bool = False   # else recomputed by every task that starts a group
    transcendental_ops: tuple = ()  # ((op, elements), ...): what ``transcendentals``
    #                                 counts, op by op (priced per op: op_cost)
    transcendental_parents: tuple = ()  # per transcendental_ops entry, the entries whose
    #                                 results it depends on (nearest ones): its chains

    @property
    def io_bytes(self) -> int:
        return self.in_bytes + self.out_bytes


def kernel_shape(spec) -> KernelShape:
    sched = _schedule_of(spec)
    users = _spec_users(spec)
    # what the kernel evaluates: the schedule's spec counts again what folded layout
    # ops recompute (schedule/layout.py)
    run = sched.spec if sched is not None else spec
    base = dict(in_bytes=sum(nbytes(t) for t in spec.inputs),
                out_bytes=sum(nbytes(t) for t in spec.output_types),
                transcendentals=sum(elems(n.type) for n in run.nodes
                                    if OPS[n.op].transcendental),
                transcendental_ops=tuple((n.op, elems(n.type)) for n in run.nodes
                                         if OPS[n.op].transcendental),
                transcendental_parents=_transcendental_parents(run.nodes),
                live=_max_live(list(range(len(spec.nodes))), users.__getitem__))
    if sched is not None:
        try:
            # the schedule's own spec: its node and input numbering (layout ops folded
            # into views, schedule/layout.py, renumber both)
            return KernelShape(**base, **_from_schedule(sched.spec, sched),
                               source="schedule")
        except Exception:   # noqa: BLE001 — a stage under construction must not break us
            pass
    return KernelShape(**base, **_estimate(spec), source="estimate")


def _transcendental_parents(nodes) -> tuple:
    """For each transcendental node of ``nodes`` (a spec's, in order), the positions
    among them of the nearest transcendental nodes it depends on."""
    frontier, parents, pos = [], [], {}
    for i, n in enumerate(nodes):
        below = frozenset().union(*(frontier[a] for a in n.args
                                    if isinstance(a, int) and 0 <= a < i))
        if OPS[n.op].transcendental:
            pos[i] = len(parents)
            parents.append(tuple(sorted(pos[j] for j in below)))
            below = frozenset((i,))
        frontier.append(below)
    return tuple(parents)


def _chain_evaluations(ks, table, chained: bool = True) -> float:
    """A kernel's transcendentals' worth from its KernelShape: their per-op costs'
    sum, priced at its chains (chained_evaluations) where ``chained`` (a CPU)."""
    total = sum(e * op_cost(table, op) for op, e in ks.transcendental_ops)
    if not chained or not ks.transcendental_ops or \
            len(ks.transcendental_parents) != len(ks.transcendental_ops):
        return total
    path = []
    for (op, _), up in zip(ks.transcendental_ops, ks.transcendental_parents):
        path.append(op_cost(table, op) + max((path[j] for j in up), default=0.0))
    elements = max(e for _, e in ks.transcendental_ops)
    return chained_evaluations(total, max(path) * elements, elements)


# The schedule stage comes after planning, but the cost model wants what it would decide
# for a candidate kernel (its kind, passes, what stays in scratch).  Planning owns this
# hook and never imports the schedule stage: ``stitching.schedule`` registers its
# ``build_schedule`` here when it is imported (and every driver imports it: the
# legality check the planner is given is the schedule's).  Unset, the model estimates.
_scheduler = None


def use_scheduler(build) -> None:
    """Give the cost model the schedule stage (``build(spec) -> Schedule``, raising
    when the spec is not one kernel)."""
    global _scheduler
    _scheduler = build


def _schedule_of(spec):
    """The schedule stage's Schedule for spec, or None (missing, refused, or broken)."""
    if _scheduler is None:
        return None
    try:
        return _scheduler(spec)
    except Exception:   # noqa: BLE001
        return None


def _from_schedule(spec, sched) -> dict:
    axes = [a.size for a in sched.domain.axes] or [1]
    u = unknown_dim()
    size = [a if a >= 0 else u for a in axes]
    kind = str(getattr(sched.kind, "value", sched.kind))
    S = sorted(sched.reduce_axes)
    if kind == "column":
        row_axes, L = range(S[0]), math.prod(size[S[-1] + 1:])
    else:
        row_axes, L = range(len(size) - 1), size[-1]
    R = math.prod(size[a] for a in row_axes)
    reuse = foot = 0
    for p in sched.passes:
        later = p.index > 0
        for j in (p.loads if later else ()):
            reuse += nbytes(spec.inputs[j])
            foot += nbytes(spec.inputs[j])
        for k in p.scratch_stores + p.scratch_loads:
            reuse += nbytes(spec.nodes[k].type)
    foot += sum(nbytes(spec.nodes[k].type) for k in sched.scratch)
    # launch parameters are fixed only when every axis is known: an unknown row length
    # (a flat [?] element-wise kernel) would otherwise fix a column block sized for the
    # DEFAULT_DIM guess (it chose 32-element blocks for 8M-element SwiGLU)
    return dict(kind=kind, rows=max(1, R), row_len=max(1, L),
                rows_known=all(a >= 0 for a in axes), reuse_bytes=reuse,
                footprint_row=foot / max(1, R),
                split="combine" if kind == "row" else "free", **_prologue(spec, sched, axes))


PRODUCT_MACS_PER_S = 8e9      # tuned: one lane's float64 multiply-adds per second in a
                              # product's vector loop (~9 G measured on the AMD EPYC, AVX2)


def _prologue(spec, sched, axes) -> dict:
    """group_rows and prologue_s of a kernel with SmallMatMuls (KernelShape)."""
    products = sched.products() if hasattr(sched, "products") else ()
    if not products:
        return {}
    macs = sum(math.prod(spec.type_of(spec.nodes[k].args[1]).shape) for k in products)
    group = 1 if sched.products_per_row() or len(axes) < 2 else axes[-2]
    return dict(group_rows=group if group > 0 else unknown_dim(),
                prologue_s=macs / PRODUCT_MACS_PER_S, prologue_phase=sched.prologue_phase())


def _estimate(spec) -> dict:
    """Without a schedule: rows from the reductions, reuse from barrier-crossing values."""
    users = _spec_users(spec)
    reds = [(i, geometry(n.op, n.attrs, spec.type_of(n.args[0])), spec.type_of(n.args[0]))
            for i, n in enumerate(spec.nodes)
            if n.args and OPS[n.op].kind == Kind.REDUCTION]
    stitched = [r for r in reds if users[r[0]]]
    if stitched or reds:
        _, g, dom = (min(stitched, key=lambda r: r[1].rows) if stitched
                     else max(reds, key=lambda r: elems(r[2])))
        R, L = g.rows, g.row_len
    else:
        dom = max((n.type for n in spec.nodes), key=elems)
        L = elems(TensorType(dom.dtype, dom.shape[-1:])) if dom.shape else 1
        R = max(1, elems(dom) // max(1, L))
    kept = _barrier_values(spec, users, stitched)
    reuse = sum(nbytes(spec.type_of(a)) * (1 if a < 0 else 2) for a in kept)
    return dict(kind="row" if reds else "elementwise", rows=R, row_len=max(1, L),
                rows_known=_known(dom), reuse_bytes=reuse,
                footprint_row=sum(nbytes(spec.type_of(a)) for a in kept) / max(1, R),
                split="combine" if stitched else "free")


def _spec_users(spec) -> dict:
    """ref (node index, or negative input ref) -> indices of the nodes reading it."""
    users = {i: [] for i in range(len(spec.nodes))}
    users.update({-(j + 1): [] for j in range(len(spec.inputs))})
    for i, n in enumerate(spec.nodes):
        for a in set(n.args):
            users[a].append(i)
    return users


def _barrier_values(spec, users, stitched) -> set:
    """Refs read both before and after some reduction barrier."""
    kept = set()
    for r, _, _ in stitched:
        before, stack = set(), [a for a in spec.nodes[r].args if a >= 0]
        while stack:
            v = stack.pop()
            if v not in before:
                before.add(v)
                stack.extend(a for a in spec.nodes[v].args if a >= 0)
        for a in {a for v in before | {r} for a in spec.nodes[v].args}:
            if any(u not in before and u != r for u in users[a]):
                kept.add(a)
    return kept


def priced_dims(ks: KernelShape, onednn: bool) -> tuple:
    """The sizes an unknown dim is priced at for a kernel of shape ``ks``: all of
    UNKNOWN_DIM_RANGE where the comparison with TF turns on that dim's size, else just
    DEFAULT_DIM.  It turns there when both sides re-read data whose size the dim sets:
    a column kernel's reduced rows are its whole unknown extent, and a pass after the
    first re-reads its inputs (reuse_bytes), from cache while they fit, else from
    memory; and ``onednn``, a member TF runs as one oneDNN kernel
    (legality.ONEDNN_PASSES), whose re-read of fewer values stays in cache longer than
    ours, while its price is one flat pass count.  ReluGrad + FusedBatchNormGradV3 at
    [n, 56, 56, 128] on the amd-avx512 model: a near-tie at n = 32 (measured too), a
    loss at 8 (measured 3-40% slower than TF's ops at 8 and 64).  Elsewhere (Eigen's
    kernels, a forward batch norm) one size prices as before."""
    if ks.kind == "column" and ks.reuse_bytes and not ks.rows_known and onednn:
        return UNKNOWN_DIM_RANGE
    return (DEFAULT_DIM,)


@dataclass(frozen=True)
class Launch:
    """The latency evaluator's choice for one kernel."""
    params: dict             # schedule parameters (SCHEDULE_PARAMS keys); {} = run time
    threads: int             # GPU threads per block (CPU: 1)
    time_s: float
    tasks: int
    alternatives: tuple = ()  # ((params, threads, time_s), ...) fastest first
    shape: KernelShape | None = None

    def describe(self) -> str:
        if self.params:
            unit = ", ".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        else:
            unit = "unit chosen at run time (rows unknown until then)"
        t = f", {self.threads} threads" if self.threads > 1 else ""
        return f"{unit}{t}: {self.tasks} task(s), {self.time_s * 1e6:.1f} µs"


def choose_launch(spec, profile: DeviceProfile, keep: int = 5, factor: float = 1.0) -> Launch:
    """Time every launch candidate; the fastest wins.  Times are calibrated: ``factor``
    (the kernel's memory-fitted factor, GraphCosts.kernel_factor) scales all but the
    fixed cost and the compute, which takes the profile's compute factor
    (kernel_compute_s); each transcendental is priced at its op's cost (op_cost).

    With rows unknown until run time the time is estimated at DEFAULT_DIM but no
    parameters are fixed: the kernel's shape function picks the unit when it knows them.
    """
    ks = kernel_shape(spec)
    timer = _time_cpu if profile.backend == "cpu" else _time_gpu
    evals = kernel_compute_s(profile, _chain_evaluations(
        ks, profile.kernel_op_cost, chained=profile.backend == "cpu"), factor)
    scored = []
    for r, c, threads in _candidates(ks, profile):
        t, tasks = timer(ks, profile, r, c, threads, evals)
        t = calibrated_s(profile, t, factor)
        if math.isfinite(t):
            params = {"rows_per_task": r, "col_block": c}
            if ks.kind == "row" and c < ks.row_len:   # code that splits rows
                params["split_rows"] = 1
            scored.append((t, tasks, params, threads))
    # Near-ties (equal to 3 significant digits) go to a launch that keeps every lane busy, then to larger
    # blocks: where the profile says one lane nearly saturates memory, a one-task launch
    # ties with a parallel one in the model, yet runs up to 2x slower (a transcendental
    # chain is compute-bound per lane; swiglu at 64 MiB: 17.5 vs 9.2 ms)
    scored.sort(key=lambda s: (float(f"{s[0]:.3g}"), s[1] < profile.lanes,
                               -s[2]["col_block"], s[2]["rows_per_task"], s[3]))
    t, tasks, params, threads = scored[0]
    alts = tuple((p, th, tt) for tt, _, p, th in scored[:keep])
    if not ks.rows_known:
        return Launch({}, threads, t, tasks, (), ks)
    return Launch(params, threads, t, tasks, alts, ks)


def _candidates(ks: KernelShape, p: DeviceProfile):
    """(rows_per_task, col_block, threads): whole rows packed r at a time, or one row cut
    into col_block pieces (where the schedule can split rows)."""
    R, L = ks.rows, ks.row_len
    splits = []
    combine = ks.split == "combine" and ks.rows_known and R < 2 * p.units
    if ks.kind == "row" and ks.source == "schedule":   # cpu.py splits rows in phases,
        # only to fill idle lanes; the CUDA emitter maps rows its own way (cuda_launch)
        combine = combine and R < p.lanes and p.backend == "cpu"
    if ks.split == "free" or combine:
        c = L // 2
        while c >= MIN_COL_BLOCK:
            splits.append(c)
            c //= 2
    threads = (1,) if p.backend == "cpu" else GPU_THREADS
    for th in threads:
        for c in splits:
            yield 1, c, th
        r = 1
        while r <= R:
            if p.backend == "cpu" or r * min(L, th) <= 4 * th:
                yield r, L, th
            r *= 2


def _time_cpu(ks: KernelShape, p: DeviceProfile, r: int, c: int, _th: int, evals: float):
    R, L = ks.rows, ks.row_len
    tasks = -(-R // r) * -(-L // c)
    active = min(tasks, p.lanes)
    frac = min(r, R) * min(c, L) / (R * L)
    lane_bw = p.bw_at(active) / active
    on_chip = ks.footprint_row * min(r, R) * c / L <= p.scratch_per_task
    reuse = ks.reuse_bytes * frac / ((p.cache_bandwidth / p.lanes) if on_chip else lane_bw)
    compute = evals * frac / (p.transcendental_per_s / p.lanes)
    task = p.task_s + max(ks.io_bytes * frac / lane_bw, compute) + reuse
    if ks.prologue_s and not ks.prologue_phase:  # each task: the groups it starts
        task += ks.prologue_s * (-(-min(r, R) // ks.group_rows) + (r % ks.group_rows != 0))
    return (p.launch_s + -(-tasks // active) * task + _split_s(ks, p, c, active)
            + _prologue_s(ks, p), tasks)


def _prologue_s(ks: KernelShape, p: DeviceProfile) -> float:
    """SmallMatMul's prologue phase (large products): each row group's products
    once, the groups spread over the lanes, one more pass of the op over its units."""
    if not ks.prologue_phase:
        return 0.0
    groups = max(1, ks.rows // ks.group_rows)
    return p.task_s + -(-groups // min(groups, p.lanes)) * ks.prologue_s


def _time_gpu(ks: KernelShape, p: DeviceProfile, r: int, c: int, th: int, evals: float):
    R, L = ks.rows, ks.row_len
    blocks = -(-R // r) * -(-L // c)
    useful = min(th, min(r, R) * min(c, L))
    in_regs = c <= th * GPU_ROW_VALUES_PER_THREAD
    smem = 0 if in_regs else ks.footprint_row * min(r, R) * c / L
    spill = smem > p.scratch_per_task
    regs = GPU_BASE_REGS + ks.live + (GPU_ROW_VALUES_PER_THREAD if ks.reuse_bytes else 0)
    per_unit = min(p.max_threads_per_unit // th, 32, p.registers_per_unit // (regs * th),
                   p.scratch_per_unit // smem if smem and not spill else 32)
    if per_unit < 1:
        return math.inf, blocks
    resident = p.units * per_unit
    active_blocks = min(blocks, resident)
    waves = -(-blocks // resident)
    active = active_blocks * useful
    bw = p.bw_at(active)
    mem = ks.io_bytes / bw * (waves * active_blocks / blocks)
    reuse = 0.0 if in_regs else ks.reuse_bytes / (bw if spill else p.cache_bandwidth)
    compute = _compute_s(p, evals, active)
    return (p.launch_s + waves * p.task_s + max(mem, compute) + reuse
            + _split_s(ks, p, c, active), blocks)


def _split_s(ks: KernelShape, p: DeviceProfile, c: int, active) -> float:
    """A reduction row split across units needs a combine step, and its consumers in the
    kernel then read the row again; element-wise and column splits are free."""
    if c >= ks.row_len or ks.split != "combine":
        return 0.0
    return p.launch_s + ks.in_bytes / p.bw_at(active)
