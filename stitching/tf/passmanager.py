"""The pass manager: what a graph pass is (``Pass``), what it sees (``Context``), and
the loop that runs a table of them (``run``).

A pass is a name, the ``Options`` field that turns it off (None: it always runs) and
one ``run(ctx)`` that returns its report note: a sentence, a list of them, or None.
It reads and replaces ``ctx.graph_def``; it reads ``ctx.tf_graph`` for TF's inferred
shapes, which the context imports again only after a pass handed it a new graph
(``ctx.replace``); it reads ``ctx.ir`` once the frontend has lifted the graph.  The
passes live in passes/, one module each (a module may hold two passes of one subject);
the driver (pipeline.py) is two ordered tables of them around planning.

As XLA's HloPassPipeline and MLIR's PassManager do, the loop also
  - times each pass (``ctx.seconds``, the report's ``pass_seconds``; a pass's time
    includes importing the shapes it is the first to read);
  - writes the graph after each pass whose name matches ``Options(dump_passes=...)``
    (a regular expression searched in the name, like ``--xla_dump_hlo_pass_re``) into
    the call's dump directory (``Options(dump_dir=...)``; tf/dump.py);
  - checks the graph after each pass with ``Options(verify=True)`` (debug): it imports
    into a fresh tf.Graph (every input names an existing output of the right type,
    every op and attr is valid), the IR, once lifted, passes ``Graph.verify``, and
    every node ``Options(exclude=...)`` matched is still there, the same op with the
    same attributes.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Callable

from . import tfgraph


@dataclass(frozen=True)
class Pass:
    name: str                          # in the report's timings and the dump's files
    run: Callable                      # run(ctx) -> note, [notes] or None
    option: str | None = None          # the Options field that turns it off

    def enabled(self, options) -> bool:
        return self.option is None or bool(getattr(options, self.option))


class Context:
    """One graph on its way through the passes, and what each stage left for the next.

    ``original``: the GraphDef handed to the driver, never changed.  ``graph_def``:
    the graph as it stands (a pass replaces it, or edits a copy it owns in place: the
    passes after the rewrite work on the rewrite's own copy).  ``fetches`` (tensor
    names) and ``keep`` (node names that must survive); ``fetched``: the node names of
    both.  ``ir``: the IR once lifted (passes/lift.py), and ``planned``: the GraphDef
    it was lifted from.  The planning results (``plan``, ``regions``, ``kernels``) and
    the rewrite's (``kernel_names``) are set by the driver and the rewrite pass."""

    def __init__(self, graph_def, fetches, keep, options, resources=None):
        self.original = graph_def
        self.graph_def = graph_def
        self.fetches = list(fetches)
        self.keep = list(keep)
        self.fetched = {f.split(":")[0] for f in self.fetches + self.keep}
        self.options = options
        self.resources = resources
        self.ir = None
        self.planned = None
        self.shape_math: set = set()     # passes/shape_math.py: left out of the counts
        self.plan = None
        self.regions: list = []
        self.kernels: list = []
        self.failed: list = []
        self.labels = None               # dump labels of the kernel nodes (tf/dump.py)
        self.kernel_names: list = []
        self.autotune = None             # passes/autotune.py: the report's entries
        self.backward = ""               # passes/original.py: Report.backward
        # memory-intensive ops a pass after planning computes inside a product's op (a
        # bias Add moved into the MatMul: passes/gemm.py; a scores scale Mul into a
        # StitchedAttention: passes/attention.py): node name -> where, in words
        self.folded: dict = {}
        # Options(exclude): node name -> why it stays the TF op it is (passes/exclude.py,
        # again at lifting); the passes that fold, remove or rewrite nodes skip these
        self.excluded: dict = {}
        self.notes: dict = {}            # pass name -> [note]
        self.seconds: dict = {}          # pass name -> seconds
        self.dump_path = None            # this call's dump directory, when dumping
        self._tf_graph = None
        self._excluded_seen: dict = {}   # verify(): each excluded node as first matched

    @property
    def pinned(self) -> set:
        """Fetched and kept node names, and the excluded ones: the nodes a pass may
        neither remove nor take into another op.  Where a pass asks only that of a node
        (an intermediate it would absorb), an excluded node is answered as a fetched
        one; where it would rewrite a node in place (a fetched node keeps its name
        and value, not its op), it checks ``excluded`` itself."""
        return self.fetched | self.excluded.keys()

    @property
    def roots(self) -> list:
        """Fetched tensors and kept nodes: what the prunes must keep."""
        return self.fetches + self.keep

    def has_op(self, *types) -> bool:
        """Whether ``graph_def`` (its top-level nodes, what ``tf_graph`` holds) has a
        node of one of ``types``.  A pass that looks only at such nodes asks this first:
        where there is none, it reads no ``tf_graph`` (an import of the whole graph for
        its shapes, ~0.06-0.1 s CPU for a convolutional net: an inference graph has no
        gradient ops, and a pass replacing the graph after one that imported it made
        the lift pass import it again)."""
        return any(nd.op in types for nd in self.graph_def.node)

    @property
    def tf_graph(self):
        """``graph_def`` imported into a scratch tf.Graph with TF's shapes inferred
        (variable reads typed from ``resources``); imported again only after a
        pass replaced the graph."""
        if self._tf_graph is None:
            self._tf_graph = tfgraph.import_for_shapes(self.graph_def, self.resources)
        return self._tf_graph

    def shapes_of(self, graph_def):
        """Another GraphDef imported for its shapes, as ``tf_graph`` is (a pass
        checking a candidate before it takes it)."""
        return tfgraph.import_for_shapes(graph_def, self.resources)

    def replace(self, graph_def, tf_graph=None) -> None:
        """A pass's new graph: its shapes are imported when next read, unless the pass
        hands over the ``tf_graph`` it imported itself (``shapes_of``)."""
        self.graph_def = graph_def
        self._tf_graph = tf_graph


def run(passes, ctx: Context, dump=None) -> None:
    """Run the enabled passes of ``passes`` over ``ctx`` in order, each once.
    ``dump(index, name, ctx)``: called after each pass ``Options(dump_passes)``
    names."""
    options = ctx.options
    pattern = getattr(options, "dump_passes", None)
    wanted = re.compile(pattern) if pattern and dump is not None else None
    from ..compile.parallel import check_cancelled
    for p in passes:
        if not p.enabled(options):
            continue
        check_cancelled()         # a background compile stops here at exit
        t0 = time.perf_counter()
        note = p.run(ctx)
        ctx.seconds[p.name] = time.perf_counter() - t0
        if note:
            ctx.notes[p.name] = [note] if isinstance(note, str) else list(note)
        if wanted is not None and wanted.search(p.name):
            dump(len(ctx.seconds), p.name, ctx)
        if options.verify:
            verify(ctx, p.name)


def verify(ctx: Context, after: str) -> None:
    """The graph as it stands, checked (``Options(verify=True)``): a clear error
    naming the pass that broke it."""
    import tensorflow as tf
    graph_def = type(ctx.graph_def)()
    graph_def.CopyFrom(ctx.graph_def)     # the import adds default attrs to what it reads
    try:
        with tf.Graph().as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
        if ctx.ir is not None:
            ctx.ir.verify()
        _verify_excluded(ctx)
    except Exception as e:  # noqa: BLE001 -- re-raised, naming the pass
        raise ValueError(f"the graph is not valid after the {after!r} pass: "
                         f"{type(e).__name__}: {e}") from e


def _verify_excluded(ctx) -> None:
    """Each node ``Options(exclude)`` matched (``ctx.excluded``) is in the graph, the op
    and the attributes it had when first matched, as many data inputs.  Attributes
    named with ``_`` are left out (the rewrite drops a colocation with a fused node),
    and so are the inputs' names (a kernel's output replaces its producer's)."""
    by_name = {nd.name: nd for nd in ctx.graph_def.node}
    for name in ctx.excluded:
        nd = by_name.get(name)
        if nd is None:
            raise ValueError(f"{name}, excluded by Options(exclude), is gone")
        got = (nd.op, sum(not i.startswith("^") for i in nd.input),
               sorted((k, v.SerializeToString(deterministic=True))
                      for k, v in nd.attr.items() if not k.startswith("_")))
        want = ctx._excluded_seen.setdefault(name, got)
        if got != want:
            raise ValueError(f"{name}, excluded by Options(exclude), was changed: "
                             f"{want[0]} with {want[1]} input(s) -> {got[0]} with "
                             f"{got[1]} (or its attributes)")
