"""Plan search: FusionStitching's candidate DP, a beam over plans, remote fusion, and
selective deployment, scored by cost.py.

  ┌──────────────────────┐  ┌──────────────────────┐  ┌──────────────────────┐  ┌─────────────┐
  │1 candidates          │  │2 beam                │  │3 merge               │  │4 deploy     │
  │consumers first: grow │─▶│best gain first: pick │─▶│stitch neighbours;    │─▶│latency      │
  │{v} ∪ top-k patterns  │  │disjoint pattern per  │  │pack independent      │  │evaluator;   │
  │of each consumer; keep│  │vertex, keep B        │  │kernels (remote       │  │keep kernels │
  │top-k by delta gain   │  │plans by Σ gain       │  │fusion) while it pays │  │that pay     │
  └──────────────────────┘  └──────────────────────┘  └──────────────────────┘  └─────────────┘

1. Candidate patterns (approximate dynamic program).  Visit fusible vertices consumers
   first.  A pattern of v is {v} plus, for each fusible consumer c, nothing, c alone, or
   one of c's kept patterns.  Consumers are added one at a time; after each, the `width`
   best partial unions by delta gain survive.  The best `top_k` convex ones are v's
   candidates (a few more are held in reserve for when legality refuses one).

       v ──▶ c1     C(c1) = {c1,e} {c1}        C(v) ⊆ {v} ∪ ({} | {c1} | {c1,e})
       └───▶ c2     C(c2) = {c2,e} {c2}                    ∪ ({} | {c2} | {c2,e})

2. Beam search over plans.  Walk fusible vertices best candidate first; a state is the
   set of decided nodes plus the chosen patterns and their summed gain.  At an undecided
   vertex each state branches into "leave it" and each disjoint candidate of positive
   gain (up to top_k); the `beam` best states survive (one per decided set).  A winning
   pattern is then split where a smaller candidate of one of its vertices plus the best
   candidates covering its rest gain more (_split_where_it_pays: the beam meets a whole
   block's pattern before the pieces that beat it).  The winning plan's
   patterns are then checked for legality (region extraction + the schedule's `legal`,
   memoized; with it the reuse choice for layout ops, cost.reuse_reason: a kernel that
   would recompute an expensive value through a folded layout op is cut there, the
   value reloaded through the view; the report's notes say where): a refused pattern
   is banned, an op that is illegal even alone is taken out of the search, and the
   search reruns (at most `rounds` times).

3. Merge.  With the chosen patterns contracted (acyclic.Contraction), repeatedly take the
   best merge of two kernels: *stitch* a kernel with a neighbour (catches producers that
   the consumers-only DP cannot reach: d = b + c with b, c from different inputs), or
   *remote* fusion — kernel packing of independent kernels (no path between them) that
   share an input or sit close in topological order.  Taken when the union's delta gain
   beats the two apart, no cycle results and the union is legal.

4. Deploy (selective).  The latency evaluator picks each kernel's launch parameters; a
   kernel whose estimated time is no better than its ops left to TF is left alone, and
   the numbers go into the reason.  `Plan.alternatives` keeps, per kernel, the patterns,
   merges and launch parameters considered with their scores, for `Report.explain()`.
"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field, replace

from ..ir import SpecError
from ..ir.composites import COMPOSITE_OPS, MULTI_OUTPUT
from ..ir.graph import kahn_order
from ..ir.ops import Kind, kind_of
from ..ir.spec import SCHEDULE_PARAMS
from . import epilogue as _epi
from . import legality as _fus
from .acyclic import Contraction, CycleError, Reach, indexed, mask_of
from . import cost as _cost
from .cost import Delta, GraphCosts, Launch, choose_launch, reuse_reason
from .planner import Plan
from .profiles import DeviceProfile
from .profiles import default as _default_profile
from .region import extract


_FREE_SLACK_S = 1e-9   # arbitrary: a view joins a neighbour's kernel when that costs < 1 ns
_FLAT_KINDS = (Kind.ELEMENTWISE, Kind.SOURCE, Kind.LAYOUT)   # not composites (BiasAddGrad)
SIMPLE_SCAN = 64       # arbitrary: kernels looked past for element-wise packing partners
MIN_PACK_ELEMS = 256   # arbitrary: smaller lone ops (shape arithmetic, scalars) are not
                       # packed: TF folds or places them itself


@dataclass(frozen=True)
class SearchConfig:
    top_k: int = 3            # candidates kept per vertex (FusionStitching keeps 3)
    width: int = 6            # arbitrary: partial unions kept while consumers are added
    beam: int = 4             # arbitrary: plans kept by the beam search
    max_pattern: int = 64     # arbitrary: DP pattern size cap (merges may grow kernels)
    max_kernel: int = 1024    # arbitrary: merge phase kernel size cap
    max_packed: int = 64      # arbitrary: kernels built by packing (remote fusion) stay
                              # this small: compile time, and identical small kernels
                              # share one compiled spec.  Not for packs of element-wise
                              # ops over static shapes (an optimizer's updates: Keras's
                              # Adam spends ~15 scalar nodes per variable), capped by
                              # max_kernel and the spec's input/output limits
    remote_window: int = 3    # arbitrary: kernels either side considered for packing
    rounds: int = 4           # arbitrary: legality repair rounds
    launch_tries: int = 3     # arbitrary: launch candidates offered to legality
    profile: DeviceProfile | None = None   # None: profiles.default()


@dataclass
class KernelChoice:
    """Why one kernel looks the way it does (for Report.explain)."""
    nodes: list
    deployed: bool
    reason: str = ""
    delta: Delta | None = None
    unfused_s: float = 0.0
    launch: Launch | None = None
    alternatives: list = field(default_factory=list)   # [(kind, description, score_s, outcome)]
    region: object = None                               # the Region when deployed

    def to_dict(self) -> dict:
        return {"nodes": list(self.nodes), "deployed": self.deployed, "reason": self.reason,
                "score": self.delta.describe() if self.delta else "",
                "fused_us": round(self.launch.time_s * 1e6, 2) if self.launch else None,
                "unfused_us": round(self.unfused_s * 1e6, 2),
                "launch": self.launch.describe() if self.launch else "",
                "alternatives": [{"kind": k, "what": w, "score_us": round(s * 1e6, 2),
                                  "outcome": o} for k, w, s, o in self.alternatives]}


def plan(graph, legal, min_ops: int = 2, config: SearchConfig | None = None) -> Plan:
    """Same contract as planner.plan; see the module note for the four steps."""
    ctx = _Context(graph, legal, config or SearchConfig())
    chosen = _choose(ctx)
    groups = _merge(ctx, chosen)
    return _deploy(ctx, groups, min_ops)


class _Context:
    """The graph in index form plus the memo tables every step shares."""

    def __init__(self, graph, legal, cfg: SearchConfig):
        self.graph, self.legal, self.cfg = graph, legal, cfg
        self.profile = cfg.profile or _default_profile()
        self.names, self.order, self.succ = indexed(graph)
        self.consumers = graph.consumers()
        self.fetched = set(graph.outputs)
        self.costs = GraphCosts(graph, self.profile, self.names)
        self.reach = Reach(self.succ)
        self.excluded: set = set()          # fusible ops found illegal even alone
        self.fusible = [i for i, n in enumerate(self.names)
                        if _fus.is_candidate(graph, graph[n])]
        self.side_users = self._side_users()
        self._side_keys = frozenset(self.side_users)
        # SmallMatMul runs in element-wise kernels only (schedule/contract.py): a pattern
        # with a product and a reduction is refused without building its spec, and the
        # DP does not spend its width on such patterns (a squeeze-excite's products
        # grown together with its pooling mean would crowd out the gate's own pattern)
        kinds = [_kind(graph[n].op) for n in self.names]
        self.products = mask_of(i for i, k in enumerate(kinds) if k == Kind.CONTRACTION)
        self.reductions = mask_of(i for i, k in enumerate(kinds) if k == Kind.REDUCTION)
        # likewise a depthwise convolution with the producer of its input: the window
        # reads that input at other pixels, so it must be a kernel input
        # (schedule/domain.py, step 5); on intel-avx512 such patterns had crowded the
        # expand BatchNorms' own out of MobileNetV2's DP (53 -> 54 kernels)
        self.windows = [mask_of([i, self.order[graph[n].inputs[0].node]])
                        for i, (n, k) in enumerate(zip(self.names, kinds))
                        if k == Kind.WINDOW]
        self.any_window = 0                # clash: most patterns touch no window
        for w in self.windows:
            self.any_window |= w
        self.boundaries: dict = {}         # (node, reason) -> None, insertion ordered
        self.reuse_cuts: dict = {}         # pattern -> why reloading beat folding
        self.reuse_why: set = set()        # those reasons (no boundaries: notes say them)
        self.log: dict = {}                # node -> [(kind, pattern, score_s, outcome)]
        self.C: dict = {}                  # vertex -> candidate patterns (last DP run)
        self.final_groups: list = []       # the merged kernels deploy considered
        self._legal: dict = {}
        self._emits: dict = {}             # region.extract's memo for this graph
        self._with = None                  # (C, node -> its patterns): patterns_with
        self._masks: dict = {}
        self._launch: dict = {}
        self._sized: dict = {}             # n -> GraphCosts at unknown dims n
        self._readers: dict = {}
        self._refresh_fusible()

    def _refresh_fusible(self):
        fs = set(self.fusible) - self.excluded
        self.is_fusible = fs
        self.fcons = {v: sorted(c for c in self.costs.cons[v] if c in fs) for v in fs}
        self.fprod = {v: sorted({u for _, _, u in self.costs.ins[v] if u in fs}) for v in fs}

    def _side_users(self) -> dict:
        """node -> readers of its outputs other than the first (they cannot leave a
        kernel; a multi-output composite's outputs can: ir/composites.MULTI_OUTPUT)."""
        out = {}

        def side(r):
            return r.index >= MULTI_OUTPUT.get(self.graph[r.node].op, 1)

        for n in self.graph:
            for r in n.inputs:
                if side(r):
                    out.setdefault(self.order[r.node], set()).add(self.order[n.name])
        for r in self.graph.outputs:
            if side(r):
                out.setdefault(self.order[r.node], set()).add(-1)
        return out

    def readers(self, u: int) -> list:
        """Consumers of node u, sorted (memoized)."""
        r = self._readers.get(u)
        if r is None:
            r = self._readers[u] = sorted(self.costs.cons[u])
        return r

    def mask(self, P) -> int:
        m = self._masks.get(P)
        if m is None:
            m = self._masks[P] = mask_of(P)
        return m

    def sized_costs(self, n: int) -> GraphCosts:
        """This graph's GraphCosts with its unknown dims at ``n`` (cost.assume_dim)."""
        got = self._sized.get(n)
        if got is None:
            with _cost.assume_dim(n):
                got = self._sized[n] = GraphCosts(self.graph, self.profile, self.names)
        return got

    def gain(self, P) -> float:
        return self.costs.gain(P)

    def side_reason(self, P) -> str | None:
        users = self.side_users
        for v in self._side_keys.intersection(P):       # one answer, whatever v
            if any(u not in P for u in users[v]):
                return "only the first output of a fused node can leave a kernel"
        return None

    def clash(self, P) -> str | None:
        """A SmallMatMul and a reduction in one pattern, or a depthwise convolution and
        its input's producer (see __init__): why, or None."""
        m = self.mask(P)
        if m & self.products and m & self.reductions:
            return ("a SmallMatMul and a reduction in one kernel: products run in "
                    "element-wise kernels only")
        if m & self.any_window and any(m & w == w for w in self.windows):
            return ("a depthwise convolution and the producer of its input in one "
                    "kernel: the window reads that input at other pixels")
        return None

    def shape_reason(self, P) -> str | None:
        """Cheap structural refusals (before any spec is built): None when fine."""
        why = self.clash(P)
        if why is not None:
            return why
        why = self.side_reason(P)
        if why is None and len(P) > 1 and not self.reach.convex(P, self.mask(P)):
            why = "merging would create a cycle through an unfused op"
        return why

    def check(self, P) -> str | None:
        """Legality of one kernel: region extraction + the schedule's verdict (memoized)."""
        hit = self._legal.get(P)
        if hit is None:
            try:
                reg = extract(self.graph, [self.names[v] for v in P], self.consumers,
                              self.fetched, self.order, self._emits)
                why = self.legal(reg.spec) or _fus.backend_reason(reg.spec, self.profile)
                if why is None:
                    why = reuse_reason(reg.spec, self.profile)
                    if why is not None:
                        self.reuse_cuts[P] = why
                        self.reuse_why.add(why)
            except ValueError as e:
                reg, why = None, str(e)
            hit = self._legal[P] = (reg if why is None else None, why)
        return hit[1]

    def patterns_with(self, v: int) -> list:
        """The DP's candidate patterns (the last run's, ``C``) of more than one node
        that hold v, in the order a walk of ``C`` meets them (so a set built from them
        iterates as one built from that walk).  Indexed once per ``C``: asked for each
        op left out of the kernels (_cost_reason), the walk over every candidate of
        the graph was 9% of a Transformer training step's planning."""
        if self._with is None or self._with[0] is not self.C:
            index: dict = {}
            for C in self.C.values():
                for P in C:
                    if len(P) > 1:
                        for u in P:
                            index.setdefault(u, []).append(P)
            self._with = (self.C, index)
        return self._with[1].get(v, [])

    def region(self, P):
        self.check(P)
        return self._legal[P][0]

    def refuse(self, v: int, reason: str):
        if reason in self.reuse_why:
            return      # a reuse cut is the report's note, once per split (_reuse_notes)
        self.boundaries.setdefault((self.names[v], reason), None)

    def note(self, kind: str, P, score: float, outcome: str):
        """Remember a decision for Report.explain (indexed by the pattern's first node)."""
        self.log.setdefault(min(P), []).append((kind, P, score, outcome))

    def describe(self, P) -> str:
        names = [self.names[v] for v in sorted(P)]
        shown = ", ".join(names[:4])
        return "{" + shown + (f", … +{len(names) - 4}" if len(names) > 4 else "") + "}"


# ---- 1. candidate patterns ------------------------------------------------------------------

def _candidates(ctx: _Context) -> dict:
    """vertex -> its candidate patterns, best delta gain first (top_k + reserve)."""
    cfg, gain = ctx.cfg, ctx.gain
    C = {}
    for v in sorted(ctx.is_fusible, reverse=True):
        partial = [frozenset((v,))]
        for c in ctx.fcons[v]:
            opts = C[c][:cfg.top_k] + [frozenset((c,))]
            grown = set(partial)
            for p in partial:
                for q in opts:
                    u = p | q
                    if len(u) <= cfg.max_pattern and not ctx.clash(u):
                        grown.add(u)
            partial = sorted(grown, key=lambda P: (-gain(P), -len(P)))[:cfg.width]
        C[v] = _keep(ctx, v, partial)
    return C


def _kind(op: str) -> Kind:
    """An op's kind; a composite's (Softmax: a reduction) from its table."""
    if op in COMPOSITE_OPS:
        return COMPOSITE_OPS[op][0]
    return kind_of(op)


def _keep(ctx: _Context, v: int, partial: list) -> list:
    """The structurally valid partials, best first; refusals become boundaries."""
    kept, refused = [], []
    for P in partial:
        why = ctx.shape_reason(P)
        if why is None:
            kept.append(P)
        elif ctx.gain(P) > 0:
            refused.append((P, why))
    for P, why in refused:       # a refusal that a kept superset works around is no boundary
        if not any(P <= K for K in kept):
            ctx.refuse(v, why)
    return kept


# ---- 2. beam search over plans --------------------------------------------------------------

def _beam(ctx: _Context, C: dict, banned: set) -> list:
    """Disjoint patterns maximizing Σ gain (approximately: `beam` states kept).

    Vertices are decided best candidate first, not in graph order: a state that took a
    small pattern early must not crowd out, by its head start, the state that keeps
    room for a larger one overlapping it (a LayerNorm's gamma Reshape, say, whose own
    pattern would steal half the LayerNorm).
    """
    k, gain = ctx.cfg.top_k, ctx.gain
    opts = {v: [(P, ctx.mask(P), gain(P)) for P in C.get(v, ())
                if P not in banned and gain(P) > 0] for v in ctx.is_fusible}
    order = sorted((v for v in opts if opts[v]), key=lambda v: (-opts[v][0][2], v))
    states = {0: (0.0, None)}          # decided-nodes bitset -> (Σ gain, chosen list)
    for v in order:
        bit, nxt = 1 << v, {}
        for mask, (score, chosen) in states.items():
            if mask & bit:
                _put(nxt, mask, score, chosen)
                continue
            _put(nxt, mask | bit, score, chosen)
            taken = 0
            for P, pm, g in opts[v]:
                if taken < k and not pm & mask:
                    _put(nxt, mask | pm, score + g, (P, chosen))
                    taken += 1
        states = dict(heapq.nlargest(ctx.cfg.beam, nxt.items(), key=lambda kv: kv[1][0]))
    _, chosen = max(states.values(), key=lambda s: s[0])
    out = []
    while chosen is not None:
        out.append(chosen[0])
        chosen = chosen[1]
    return sorted(_split_where_it_pays(ctx, opts, out), key=min)


def _split_where_it_pays(ctx: _Context, opts: dict, chosen: list) -> list:
    """Replace a chosen pattern by a smaller candidate of one of its vertices plus the
    best candidates covering the rest, wherever that gains more.  The beam decides the
    vertices with the best single candidate first, so a whole block (one pattern) is
    ranked before the smaller pattern plus the one its remainder forms, which come
    later; with `beam` states kept, only some of a graph's identical blocks kept the
    split: identical blocks were planned differently (a LayerNorm whose chain of
    transcendentals pays to cut: cost.chained_evaluations)."""
    gain = ctx.gain
    out = []
    for P in chosen:
        best, best_gain = [P], gain(P)
        for u in sorted(P):
            for Q, _, g in opts.get(u, ()):
                if not Q < P:
                    continue
                rest, parts, total = set(P - Q), [Q], g
                for w in sorted(rest):          # the rest: its vertices' best candidates
                    if w not in rest:
                        continue
                    R, _, h = next((c for c in opts.get(w, ()) if c[0] <= rest),
                                   (None, None, 0.0))
                    if R is not None:
                        parts.append(R)
                        rest -= R
                        total += h
                if total > best_gain * (1 + 1e-9) and _parts_acyclic(ctx, parts):
                    best, best_gain = parts, total
        out.extend(best)
    return out


def _parts_acyclic(ctx: _Context, parts: list) -> bool:
    """Whether kernels made of ``parts`` (disjoint, together a convex pattern, so every
    path between them stays inside it) would not wait on each other in a cycle."""
    part = {v: i for i, R in enumerate(parts) for v in R}
    succ = {i: set() for i in range(len(parts))}
    pred = {i: set() for i in range(len(parts))}
    for v, i in part.items():
        for c in ctx.succ[v]:
            j = part.get(c, i)
            if j != i:
                succ[i].add(j)
                pred[j].add(i)
    return len(kahn_order(succ, pred)) == len(parts)


def _put(states: dict, mask: int, score: float, chosen):
    old = states.get(mask)
    if old is None or score > old[0]:
        states[mask] = (score, chosen)


def _choose(ctx: _Context) -> list:
    """DP + beam, rerun while legality refuses the winners."""
    banned: set = set()
    C = ctx.C = _candidates(ctx)
    for _ in range(ctx.cfg.rounds):
        chosen = _beam(ctx, C, banned)
        bad = [P for P in chosen if ctx.check(P) is not None]
        if not bad:
            break
        if _learn(ctx, bad, banned):
            C = ctx.C = _candidates(ctx)
    else:
        chosen = [P for P in _beam(ctx, C, banned) if ctx.check(P) is None]
    for P in chosen:
        ctx.note("pattern", P, ctx.gain(P), "chosen by the beam search")
    return chosen


def _learn(ctx: _Context, bad: list, banned: set) -> bool:
    """Ban refused patterns; exclude ops refused even alone.  True if the DP must rerun."""
    rerun = False
    for P in bad:
        why = ctx.check(P)
        banned.add(P)
        ctx.refuse(min(P), why)
        ctx.note("pattern", P, ctx.gain(P), f"refused: {why}")
        for v in P:
            if v not in ctx.excluded and ctx.check(frozenset((v,))):
                ctx.excluded.add(v)
                rerun = True
    if rerun:
        ctx._refresh_fusible()
    return rerun


# ---- 3. merge: stitch neighbours, pack independent kernels ---------------------------------

class _Merger:
    """Best-first pairwise merging over the contracted graph.

    Stitch merges are checked for legality when taken.  Packing merges of element-wise
    ops over static shapes are checked once, on the final kernel (they are legal: one
    domain, or the schedule's packed kind; a check builds a spec): a refused pack is
    split back along the merges that built it until its parts are legal.  A packing
    merge that holds a reduction or an unknown dim is checked when taken: such packs
    are legal only over one domain, and taken unchecked they captured the optimizer's
    update chains (a CNN's SGD updates packed with backward column kernels, refused at
    the end and split back apart: no update chains packed).

    Packing saves a dispatch but makes each part wait for the other's inputs.  Where
    the parts hang below different opaque ops (one variable's gradient matmul and
    another's), the part ready first loses its overlap with the opaque work still
    running: a pack pays only if the dispatch it saves exceeds the larger part's own
    work (``overlap_penalty``).  So an optimizer's small updates (biases, norms' gamma
    and beta) pack together, large ones keep their own kernels.  Parts below products
    of one value (attention's K and V projections) become ready together and pack
    whatever their size (``_siblings``).  Measured before this
    rule (tools/train_bench.py models, one process, modes interleaved, 25-30 rounds,
    a shared 2-core machine at load 4-6): packing every update chain made the MLP step
    (Adam, 0.8M parameters) 8-16% slower than no packing (median, 25th percentile and
    minimum, two runs), its Adam pack over 0.8M elements taking 1.4 ms in the step
    against 0.4 ms alone; the Transformer block's was within the noise (-7% to +10%).
    """

    def __init__(self, ctx: _Context, chosen: list):
        self.ctx = ctx
        self.con, kept = _contract(ctx, chosen)
        n = len(ctx.names)
        self.cur = {n + j: ctx.gain(P) for j, P in enumerate(kept)}
        covered = set().union(*kept) if kept else set()
        for v in sorted(ctx.is_fusible - covered):       # lone ops may be packed too
            if ctx.costs.work[v] and ctx.costs.count[v] >= MIN_PACK_ELEMS:
                self.cur[v] = 0.0
        self.kernels = sorted((min(self.con.members[g]), g) for g in self.cur)
        self.heap, self.seq = [], 0
        self.packed: dict = {}          # group -> (members of part a, of part b), unchecked
        graph = ctx.graph
        self.simple = {v for v in ctx.is_fusible           # element-wise, static shapes
                       if kind_of(graph[ctx.names[v]].op) in _FLAT_KINDS and all(
                           t.shape is not None and all(d >= 0 for d in t.shape)
                           for t in graph[ctx.names[v]].outputs)}
        # 0-d values: shared scalars inside a pack are fine, but a kernel of nothing
        # else is no packed segment (legality refuses its 0-d output); packed lazily, it
        # would split the whole pack apart at the end (unpack), losing the packing of
        # everything merged after it, so such a merge is checked at once
        self.scalar = {v for v in self.simple
                       if all(not t.shape for t in graph[ctx.names[v]].outputs)}
        self.opaque_above = _opaque_ancestors(ctx)
        # opaque ops that take no time in TF (constants it holds, views): no part
        # waits for them (_siblings)
        self._source_memo: dict = {}
        self.free_opaque = sum(1 << v for v, name in enumerate(ctx.names)
                               if graph[name].op in _FREE_OPAQUE)
        self._above: dict = {}

    def overlap_penalty(self, A, B) -> float:
        """Seconds a pack of A and B may lose (class note): 0 when both hang below the
        same opaque ops, else the larger part's work without its dispatch."""
        above = []
        for X in (A, B):
            m = self._above.get(X)
            if m is None:
                m = 0
                for v in X:
                    m |= self.opaque_above[v]
                self._above[X] = m
            above.append(m)
        # a lone op is no kernel the search chose: left alone, TF may run it for free
        # (tf/passes/gemm.py adds a projection's bias inside its GEMM), so it keeps the penalty
        if above[0] == above[1] or min(len(A), len(B)) > 1 and self._siblings(*above):
            return 0.0
        p, costs = self.ctx.profile, self.ctx.costs
        return max(max(0.0, costs.delta(X).fused_s - p.launch_s - p.task_s) for X in (A, B))

    def _siblings(self, a: int, b: int) -> bool:
        """Whether the opaque ops only one part waits for (bitsets ``a``, ``b``) read
        one value and have no opaque ancestor outside those both wait for: products
        side by side, such as attention's K and V projections of one input, which TF's
        executor starts together, so neither part is ready long before the other
        (an optimizer's updates wait for gradients of different values: not these).  Packing their
        parts (grouped-query attention's K and V head transposes: one kernel, not two)
        was measured neutral: the Llama decoder at batch 1 7.8 ms packed against 8.2 ms
        not, at batch 8 103.6 against 102.3 ms (one process, interleaved, load 4)."""
        free = self.free_opaque
        common, only = a & b, (a ^ b) & ~free
        shared = None
        while only:
            low = only & -only
            u = low.bit_length() - 1
            if self.opaque_above[u] & ~common & ~free:
                return False
            shared = self._sources(u) if shared is None else shared & self._sources(u)
            only ^= low
        return bool(shared)

    def _sources(self, u: int) -> frozenset:
        """The values node u reads, seen through views (a Dense's Reshape of its input)."""
        got = self._source_memo.get(u)
        if got is None:
            graph, out = self.ctx.graph, set()
            for r in graph[self.ctx.names[u]].inputs:
                while graph[r.node].op in _FREE_OPAQUE and graph[r.node].inputs:
                    r = graph[r.node].inputs[0]
                out.add(r)
            got = self._source_memo[u] = frozenset(out)
        return got

    def run(self) -> list:
        for g in list(self.cur):
            self.push_pairs(g)
        while self.heap:
            _, _, a, b, kind = heapq.heappop(self.heap)
            if a in self.con.members and b in self.con.members:
                self.try_merge(a, b, kind)
        out = []
        for g in self.cur:
            out.extend(self.unpack(self.members(g)))
        return out

    def unpack(self, P) -> list:
        parts = self.packed.get(P)
        if parts is None or self.ctx.check(P) is None:
            return [P]
        self.ctx.note("remote", P, self.ctx.gain(P), f"split again: {self.ctx.check(P)}")
        return self.unpack(parts[0]) + self.unpack(parts[1])

    def members(self, g) -> frozenset:
        return frozenset(self.con.members[g])

    def lone(self, g) -> bool:
        """A group of one op (alone, a kernel of it is not worth a dispatch: _deploy)."""
        return len(self.con.members[g]) == 1

    def free(self, g, h) -> bool:
        """One side is a lone op that moves no data (its TF op costs nothing)."""
        return any(len(self.con.members[x]) == 1
                   and not self.ctx.costs.work[self.con.members[x][0]] for x in (g, h))

    def push_pairs(self, g):
        cfg = self.ctx.cfg
        for h, kind in self.partners(g):
            U = self.members(g) | self.members(h)
            cap = cfg.max_kernel if kind == "stitch" or U <= self.simple else cfg.max_packed
            if len(U) > cap:
                continue
            better = self.ctx.gain(U) - self.cur.get(g, 0.0) - self.cur.get(h, 0.0)
            if kind == "remote":
                better -= self.overlap_penalty(self.members(g), self.members(h))
            if kind == "stitch" and better > -_FREE_SLACK_S and self.free(g, h):
                better = max(better, _FREE_SLACK_S)      # absorb a view (Reshape, Identity)
            if better > 0:
                self.seq += 1
                heapq.heappush(self.heap, (-better, self.seq, g, h, kind))

    def partners(self, g):
        """(group, "stitch" | "remote") pairs worth scoring for group g: neighbours by an
        edge; independent kernels reading one of g's inputs or close in topological
        order (the `remote_window` nearest each side, of each kind); for an element-wise
        group over static shapes also the nearest such groups (an optimizer's update
        chains, which Keras interleaves with the backward pass's column kernels and
        which share no input: each reads its own cast of the learning rate)."""
        ctx, con, out = self.ctx, self.con, {}
        w, first = ctx.cfg.remote_window, min(con.members[g])
        inputs = set()
        for v in con.members[g]:
            for u in ctx.fcons.get(v, ()) + ctx.fprod.get(v, []):
                if con.group_of[u] != g:
                    out[con.group_of[u]] = "stitch"
            inputs.update(u for _, _, u in ctx.costs.ins[v])
        near = []
        for u in sorted(inputs):
            readers = ctx.readers(u)
            i = bisect.bisect_left(readers, first)
            near += [con.group_of[s] for s in readers[max(0, i - w): i + w + 1]]
        i = bisect.bisect_left(self.kernels, (first, g))
        near += [h for _, h in self.kernels[max(0, i - w): i + w + 1]]
        if self.members(g) <= self.simple:
            near += self._simple_near(i, w)
        for h in near:
            if h != g and h in self.cur and h not in out and not con.related(g, h):
                out[h] = "remote"
        return sorted(out.items())

    def _simple_near(self, i: int, w: int) -> list:
        """Up to w groups of element-wise ops over static shapes on each side of
        position i of self.kernels (looking at most SIMPLE_SCAN kernels each way)."""
        out = []
        for step in (-1, 1):
            found, j = 0, i + step
            while found < w and 0 <= j < len(self.kernels) and abs(j - i) <= SIMPLE_SCAN:
                h = self.kernels[j][1]
                if self.members(h) <= self.simple:
                    out.append(h)
                    found += 1
                j += step
        return out

    def try_merge(self, a, b, kind):
        ctx, con = self.ctx, self.con
        A, B = self.members(a), self.members(b)
        U = A | B
        if con.would_cycle((a, b)):
            why = "merging would create a cycle through another kernel or an unfused op"
        else:
            lazy = kind == "remote" and U <= self.simple and not (
                A <= self.scalar or B <= self.scalar)
            why = ctx.side_reason(U) or (None if lazy else ctx.check(U))
            if why is None and not lazy and kind == "remote" and \
                    (self.lone(a) or self.lone(b)) and ctx.region(U).spec.same_dims:
                why = ("a lone op packs over a run-time dim only where its own kernel "
                       "pays: left alone, TF may run it inside the product before it "
                       "(tf/passes/gemm.py adds a projection's bias in its GEMM)")
        better = ctx.gain(U) - self.cur.get(a, 0.0) - self.cur.get(b, 0.0)
        if why is not None:
            ctx.note(kind, U, better, f"refused: {why}")
            if kind == "stitch":
                ctx.refuse(min(U), why)
            return
        ctx.note(kind, U, better, "merged")
        if lazy:
            self.packed[U] = (A, B)
        for g in (a, b):
            if g in self.cur:
                del self.cur[g]
                self.kernels.remove((min(con.members[g]), g))
        new = con.merge((a, b))
        self.cur[new] = ctx.gain(U)
        bisect.insort(self.kernels, (min(U), new))
        self.push_pairs(new)


def _opaque_ancestors(ctx: _Context) -> list:
    """Per node, the bitset of the opaque ops above it (not fusible, not a graph input
    or constant): one sweep in topological order, as acyclic.Reach sweeps the other
    way."""
    n = len(ctx.names)
    preds = [[] for _ in range(n)]
    for v, ss in enumerate(ctx.succ):
        for s in ss:
            preds[s].append(v)
    fusible = set(ctx.fusible)
    out = [0] * n
    for v in range(n):
        m = 0
        for u in preds[v]:
            m |= out[u]
            if u not in fusible and ctx.graph[ctx.names[u]].op not in _SOURCES:
                m |= 1 << u
        out[v] = m
    return out


_SOURCES = frozenset({"Placeholder", "Const", "NoOp", "VarHandleOp"})
_FREE_OPAQUE = frozenset({"TFConst", "Reshape", "Identity"})


def _contract(ctx: _Context, chosen: list) -> Contraction:
    """Contract the chosen patterns; drop the least valuable one while a cycle remains."""
    chosen = list(chosen)
    while True:
        try:
            return Contraction(ctx.succ, chosen), chosen
        except CycleError as e:
            n = len(ctx.names)
            on_cycle = [chosen[g - n] for g in e.groups if g >= n]
            worst = min(on_cycle, key=ctx.gain)
            ctx.note("pattern", worst, ctx.gain(worst),
                     "dropped: with the other kernels it closes a cycle")
            ctx.refuse(min(worst), "kernels would form a cycle through each other")
            chosen.remove(worst)


def _merge(ctx: _Context, chosen: list) -> list:
    return _Merger(ctx, chosen).run()


# ---- 4. deploy: launch parameters, selective deployment ------------------------------------

def _deploy(ctx: _Context, groups: list, min_ops: int) -> Plan:
    """Kernels that pay (or lone ops, when min_ops < 2 asks for them) become regions."""
    result = Plan()
    placed: dict = {}                       # node -> why it is not in a kernel
    ctx.final_groups = [frozenset(P) for P in groups if len(P) > 1]
    if min_ops < 2:
        covered = set().union(*groups) if groups else set()
        groups = list(groups) + [frozenset((v,)) for v in sorted(ctx.is_fusible - covered)]
    for P in sorted(groups, key=min):
        names = [ctx.names[v] for v in sorted(P)]
        work = _data_work(ctx, P)
        if work < min_ops:
            # a lone op: _unfused_reason says what the cost model did with its
            # neighbours; a kernel the search formed (the op with views beside it)
            # that does too little data work: min_ops says why
            why = LONE_OP if len(P) == 1 else _too_little(ctx.describe(P), work, min_ops)
            placed.update((n, why) for n in names)
            continue
        why = ctx.check(P)
        if why is not None:                 # only lone ops added above get here
            placed.update((n, why) for n in names)
            continue
        choice = _schedule(ctx, P, forced=work < 2)
        result.alternatives.append(choice)
        if choice.deployed:
            result.regions.append(choice.region)
        else:
            result.skipped.append((names, choice.reason))
            for n in names:
                placed[n] = choice.reason
    result.notes.extend(_reuse_notes(ctx, [frozenset(ctx.order[n] for n in r.nodes)
                                           for r in result.regions]))
    if groups and not result.regions and result.skipped:
        result.notes.append("function left alone: the cost model predicts no kernel pays")
    fused = {n for r in result.regions for n in r.nodes}
    epilogues = _epi.left_to_tf(ctx.graph, fused)     # what TF fuses into convolutions
    for v in sorted(ctx.fusible):
        n = ctx.names[v]
        if n not in fused and _fus.work(ctx.graph[n]):
            result.unfused.append((n, ctx.graph[n].op, epilogues.get(n)
                                   or _unfused_reason(ctx, v, placed, min_ops)))
    if epilogues:
        convs = len({ctx.graph[n].attrs[_epi.ATTR] for n in epilogues})
        result.notes.append(f"{convs} convolution epilogue(s) (a BiasAdd, and the "
                            "activation after it where the remapper takes one) left to TF, "
                            "whose remapper fuses them into the convolution "
                            "(plan/epilogue.py)")
    result.boundaries = list(ctx.boundaries)
    return result


LONE_OP = "a lone op: no fusible neighbour, and fusing it alone saves nothing"
ONEDNN_NOTE = ("TF runs it as one oneDNN kernel, about as fast as ours alone "
               "(plan/legality.py ONEDNN_PASSES)")
_TOO_LITTLE = "too little work for a kernel"


def _data_work(ctx: _Context, P) -> int:
    """How many primitive ops of data work pattern P does (legality.work)."""
    return sum(_fus.work(ctx.graph[ctx.names[v]]) for v in P)


def _too_little(what: str, work: int, min_ops: int) -> str:
    return (f"{_TOO_LITTLE}: {what} does {work} op(s) of data work, "
            f"fewer than min_ops={min_ops} (Options(min_ops=1) fuses it)")


def _reuse_notes(ctx: _Context, kernels: list) -> list:
    """Where the plan cut a kernel for the reuse choice of a layout op (reuse_cuts): each
    largest refused pattern that the final kernels split (an op left to TF counts as a
    part alone), with the reason (the two costs).  The search refuses a chain's nested
    patterns one by one (the chain from each of its ops on); one line says it."""
    where = {v: i for i, K in enumerate(kernels) for v in K}
    split = {P: len({where.get(v, -1 - v) for v in P}) for P in ctx.reuse_cuts}
    split = {P: n for P, n in split.items() if n > 1}
    return [f"{ctx.describe(P)} cut in {n}: {ctx.reuse_cuts[P]}"
            for P, n in split.items() if not any(P < Q for Q in split)]


def _unfused_reason(ctx: _Context, v: int, placed: dict, min_ops: int) -> str:
    """What actually left op v to TF: legality, the latency evaluator (placed), or --
    for an op in no kernel -- the cost model's verdict on joining its neighbours, with
    its predicted times; "a lone op" only when it has no fusible neighbour."""
    alone = ctx.check(frozenset((v,)))
    if alone is not None:
        return alone
    why = placed.get(ctx.names[v])
    if why is None or why == LONE_OP:
        why = _cost_reason(ctx, v, placed, min_ops) or LONE_OP
    if ctx.graph[ctx.names[v]].attrs.get(_fus.ONEDNN_ATTR) and (
            why == LONE_OP or why.startswith(_TOO_LITTLE)):
        why = f"{why}; {ONEDNN_NOTE}"
    return why


def _cost_reason(ctx: _Context, v: int, placed: dict, min_ops: int) -> str | None:
    """The best pattern with v and a neighbour the search scored (its DP candidates,
    and v joined to each neighbour's final kernel), as the reason v stayed out; None
    when v has no fusible neighbour.  A pattern with less data work than min_ops
    would not be a kernel whatever it saves: min_ops is the reason then."""
    if not (ctx.fcons.get(v) or ctx.fprod.get(v)):
        return None
    pats = set(ctx.patterns_with(v))
    for r in ctx.final_groups:
        if not r.isdisjoint(set(ctx.fcons.get(v, ())) | set(ctx.fprod.get(v, ()))):
            U = r | {v}
            if ctx.shape_reason(U) is None:
                pats.add(U)
    if not pats:
        return None
    big = {P for P in pats if _data_work(ctx, P) >= min_ops}
    if not big:
        P = max(pats, key=len)
        return _too_little(ctx.describe(P), _data_work(ctx, P), min_ops)
    pats = big
    # only kernels that could be built: an illegal one's times would be no reason
    legal = {P for P in pats if ctx.check(P) is None}
    if not legal:
        P = max(pats, key=lambda P: (ctx.gain(P), -len(P)))
        return f"cannot join its neighbours: {ctx.describe(P)}: {ctx.check(P)}"
    best = max(legal, key=lambda P: (ctx.gain(P), -len(P)))
    d = ctx.costs.delta(best)
    times = (f"{ctx.describe(best)} predicted {d.fused_s * 1e6:.1f} µs fused vs "
             f"{d.unfused_s * 1e6:.1f} µs unfused")
    if d.gain_s <= 0:
        return f"cost model predicts no gain fusing it with its neighbours: best {times}"
    return (f"left out by the cost model: the best kernel with it ({times}, saving "
            f"{d.gain_s * 1e6:.1f} µs) overlaps kernels that save more without it")


def _schedule(ctx: _Context, P, forced: bool = False) -> "KernelChoice":
    """Launch parameters from the latency evaluator, offered to legality best first;
    deployed if predicted faster than its ops left to TF (or ``forced``: a lone op that
    min_ops < 2 asks for — the model cannot say it pays)."""
    region, delta = ctx.region(P), ctx.costs.delta(P)
    unfused = ctx.costs.unfused_s(P)
    choice = KernelChoice([ctx.names[v] for v in sorted(P)], False, delta=delta,
                          unfused_s=unfused, alternatives=_alternatives(ctx, P))
    # the latency evaluator's time in the units of the TF side (kernel calibration)
    launch, spec = _launch_for(ctx, region.spec, ctx.costs.kernel_factor(P))
    choice.launch = launch
    for params, threads, t in launch.alternatives:
        choice.alternatives.append(("launch", _params(params, threads), t,
                                    "chosen" if spec.schedule == _schedule_params(params)
                                    else "slower"))
    if launch.time_s >= unfused and not forced:
        choice.reason = (f"cost model predicts no gain: fused {launch.time_s * 1e6:.1f} µs "
                         f">= unfused {unfused * 1e6:.1f} µs")
        return choice
    # a gain at DEFAULT_DIM and a loss at another size of an unknown dim: when in
    # doubt, TF's.  (Not timed at run time instead, Options(autotune)'s way: there the
    # region's ops run as a function, where TF's oneDNN rewrite does not reach them,
    # so the op times our kernel against Eigen's 4-pass gradient, not oneDNN's.)
    loses = None if forced else _loses_at_some_size(ctx, P, region.spec, launch)
    if loses is not None:
        choice.reason = loses
        return choice
    choice.deployed = True
    choice.region = replace(region, spec=spec)
    return choice


def _loses_at_some_size(ctx: _Context, P, spec, launch) -> str | None:
    """Where a dim unknown until run time sizes what the kernel re-reads
    (cost.priced_dims), the kernel priced with that dim at each of the sizes it may
    take: the first at which it is predicted no faster than its ops left to TF, as the
    reason to leave it to TF; None where it gains at all of them."""
    if launch.shape is None:
        return None
    onednn = any(ctx.graph[ctx.names[v]].attrs.get(_fus.ONEDNN_ATTR) for v in P)
    for n in _cost.priced_dims(launch.shape, onednn):
        if n == _cost.DEFAULT_DIM:
            continue
        costs = ctx.sized_costs(n)
        with _cost.assume_dim(n):
            fused = choose_launch(spec, ctx.profile, keep=1,
                                  factor=costs.kernel_factor(P)).time_s
        unfused = costs.unfused_s(P)
        if fused >= unfused:
            return (f"cost model predicts a gain with a dim unknown until run time at "
                    f"{_cost.DEFAULT_DIM} but none at {n}: fused {fused * 1e6:.1f} µs >= "
                    f"unfused {unfused * 1e6:.1f} µs (a later pass re-reads inputs whose "
                    f"size that dim sets: plan/cost.py priced_dims); left to TF")
    return None


def _launch_for(ctx: _Context, spec, factor: float):
    """(Launch, scheduled spec), calibrated by ``factor``; memoized per spec so
    identical kernels agree."""
    hit = ctx._launch.get((spec.hash, factor))
    if hit is not None:
        return hit
    launch = choose_launch(spec, ctx.profile, keep=max(5, ctx.cfg.launch_tries), factor=factor)
    chosen = spec
    for params, threads, t in launch.alternatives[:ctx.cfg.launch_tries]:
        try:
            cand = spec.with_schedule(**_schedule_params(params))
        except SpecError:
            continue
        if ctx.legal(cand) is None:
            chosen = cand
            launch = replace(launch, params=params, threads=threads, time_s=t)
            break
    ctx._launch[(spec.hash, factor)] = (launch, chosen)
    return launch, chosen


def _schedule_params(params: dict) -> dict:
    return {k: v for k, v in params.items() if k in SCHEDULE_PARAMS}


def _params(params: dict, threads: int) -> str:
    s = ", ".join(f"{k}={v}" for k, v in sorted(params.items()))
    return s + (f", threads={threads}" if threads > 1 else "")


def _alternatives(ctx: _Context, P) -> list:
    """Patterns and merges considered that start at P's nodes, best score first."""
    seen, out = set(), []
    for v in sorted(P):
        for kind, Q, score, outcome in ctx.log.get(v, ()):
            seen.add(Q)
            out.append((kind, ctx.describe(Q), score, outcome))
        for Q in ctx.C.get(v, ())[:ctx.cfg.top_k]:
            if Q not in seen:
                seen.add(Q)
                out.append(("pattern", ctx.describe(Q), ctx.gain(Q),
                            "kept in the kernel" if Q == P else "candidate, not chosen"))
    out.sort(key=lambda a: -a[2])
    return out[:10]
