"""The driver: one GraphDef in, one rewritten GraphDef and a report out.

    grappler grappler.optimize           (TF's inlining, constant folding and arithmetic
                                          optimizer, as tf.function runs them;
                                          then frontend.bypass_identity_n)
    import   frontend.import_for_shapes   (TF shape inference)
    seqsplit tf.seqsplit.find/rewrite     (token-wise blocks whose products TF runs on one
                                          thread at batch 1 -> two halves of the sequence)
    lift     frontend.to_ir               (TF nodes -> IR nodes)
    remapper remapper.mark                (conv epilogues TF's remapper fuses: priced as
                                          free by the cost model, plan/epilogue.py)
    plan     plan.get_planner(options.planner)  (regions; legality from schedule.check;
                                          large graphs: stored per graph, plan/cache.py)
    compile  compile.compile_kernels      (Numba; uncached kernels in parallel worker
                                          processes; cached in memory and on disk)
    register runtime.register             (kernel addresses for the StitchedKernel op)
    rewrite  tf.rewrite.rewrite           (one StitchedKernel node per region)
    autotune tf.autotune.mark             (Options(autotune): kernels with a small predicted
                                          margin are timed against their original ops)
    gemm     tf.gemm.rewrite              (BatchMatMul against a 2-D weight -> one MatMul)
    einsum   tf.einsum.rewrite            (two-operand Einsum -> BatchMatMulV2, its
                                          transposes as row gathers)
    padfold  tf.padfold.rewrite           (a zero Pad before a depthwise convolution ->
                                          its explicit padding)
    shapes   tf.shapes.fold_reshapes      (run-time Reshape targets known but for one dim
                                          -> constants)
    report   report.Report
    dump     tf.dump.write                (only with Options(dump_dir) / $STITCHING_DUMP_DIR)
"""
from __future__ import annotations

import gc
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from .. import report as _report
from ..options import Options
from ..plan import cache as plan_cache
from ..plan import get_planner, legality, profiles
from .. import schedule     # the planner's legality and its cost model's schedules
from . import (autotune, bcast, control_flow, dump, einsum, forward, frontend, gemm,
               grappler, opnames, original, padfold, prune, remapper, rewrite, seqsplit,
               shapes, sparse_xent)

_PROGRESS_MIN_KERNELS = 4   # arbitrary: below this compiling is quick, stay quiet
_PRESTART_MIN_NODES = 300   # arbitrary: graphs this large usually compile several kernels


_gc_lock = threading.Lock()
_gc_pauses = 0               # stitch_graph_def calls running with the collector paused
_gc_resume = False           # whether the last of them turns it back on


@contextmanager
def _gc_paused():
    """Python's cyclic collector off while a graph is lifted, planned and compiled.

    Planning allocates many short-lived small objects, so the collector runs often,
    and each full collection walks every object of the process -- with TensorFlow
    and a Keras model loaded, hundreds of thousands.  ResNet50's first plan measured
    1.08-1.18 s with it, 0.71-0.90 s without.  Nothing made here needs the collector
    (whatever cycles it leaves are collected once it is back on).  Calls in several
    threads (background compiles) nest: the last one out restores the setting."""
    global _gc_pauses, _gc_resume
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_resume = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_resume:
                gc.enable()


@dataclass
class StitchResult:
    graph_def: object
    report: _report.Report
    kernels: list = field(default_factory=list)


def legal(spec):
    """Region legality from the schedule stage: None if one kernel can do it."""
    decision = schedule.check(spec)
    return None if decision.ok else decision.reason


def early_workers():
    """A compile worker to start before a graph exists (while TF traces it), or None.

    Only where the disk cache holds no kernel at all: then every kernel of the graph
    will be compiled.  One worker's start-up (Python, Numba, its first compile: ~0.9
    s of CPU) then runs beside tracing instead of beside planning; the others start
    once the graph is known to need them.  Cold ResNet50 first call, 3 runs each:
    3.90-3.98 s with no early worker, 3.82-3.84 s with two (they slowed tracing
    down as much as they sped planning up), 3.42-3.62 s with one.  Pass it to
    ``stitch_graph_def``, which uses or closes it."""
    from ..compile import kernel as kernel_cache
    from ..compile import parallel
    if parallel.default_jobs() < 2 or not kernel_cache.cache_is_empty():
        return None
    return parallel.Workers(1)


def _seq_split(gdef, tf_graph, fetched, options, resources):
    """(graph, its shapes, report note): token-wise blocks split along the sequence
    (tf/seqsplit.py) where TF would run their products on one thread at batch 1.
    ``fetched``: the node names fetched or kept."""
    if not options.seq_split:
        return gdef, tf_graph, None
    l2 = profiles._cache_sizes().get("l2", 0)
    blocks = seqsplit.find(tf_graph, fetched, l2)
    if not blocks:
        return gdef, tf_graph, None
    new = seqsplit.rewrite(gdef, blocks)
    new_graph = frontend.import_for_shapes(new, resources)
    bad = seqsplit.halves_match(blocks, new_graph)
    if bad is not None:
        return gdef, tf_graph, f"token-wise blocks left whole: {bad} (tf/seqsplit.py)"
    ops = sum(len(b.ops) for b, _ in blocks)
    return new, new_graph, (
        f"{len(blocks)} token-wise block(s) ({ops} TF ops) run as two halves of the "
        f"sequence: at batch 1 TF runs their products on one thread (operands under "
        f"L2, {l2 >> 10} KiB), the halves use both cores (tf/seqsplit.py; "
        f"Options(seq_split=False) keeps them whole)")


def stitch_graph_def(graph_def, fetches, keep=(), options: Options = Options(),
                     name: str = "?", resources: dict | None = None,
                     workers=None, bodies: bool = True,
                     scalar_values=frozenset()) -> StitchResult:
    """``resources``: variable shapes from the live graph (frontend.resource_shapes);
    ``workers``: pre-started compile workers (``early_workers``), used or closed;
    ``bodies``: stitch the functions control flow runs (tf/control_flow.py) first;
    ``scalar_values``: a traced function's Python scalar arguments, kernel inputs
    rather than constants of the spec (frontend.to_ir)."""
    with _gc_paused():
        stitched = []
        if bodies and grappler.has_control_flow(graph_def):
            graph_def = type(graph_def).FromString(graph_def.SerializeToString())
            stitched = control_flow.stitch_bodies(
                graph_def, lambda g, f, k, label: _stitch(g, f, k, options, label, None,
                                                         None, scalar_values), name)
        result = _stitch(graph_def, fetches, keep, options, name, resources, workers,
                         scalar_values)
        result.report.bodies = stitched
        return result


def _stitch(graph_def, fetches, keep, options, name, resources, workers,
            scalar_values=frozenset()) -> StitchResult:
    t0 = time.perf_counter()
    from . import ensure_runtime
    from ..compile import kernel as kernel_cache
    from ..compile import parallel
    try:
        ensure_runtime()
        gdef = grappler.optimize(graph_def, list(fetches) + list(keep))
        fetched = {f.split(":")[0] for f in list(fetches) + list(keep)}   # node names
        gdef = frontend.bypass_identity_n(gdef, fetched)
        tf_graph = frontend.import_for_shapes(gdef, resources)
        folded = bcast.fold(tf_graph, gdef)     # gradient axes known at trace time
        expanded = sparse_xent.expand(tf_graph, folded if folded is not None else gdef)
        if folded is not None or expanded is not None:
            gdef = expanded if expanded is not None else folded
            tf_graph = frontend.import_for_shapes(gdef, resources)
        gdef, tf_graph, seq_note = _seq_split(gdef, tf_graph, fetched, options, resources)
        ir = frontend.to_ir(tf_graph, list(fetches), scalar_values)
        shape_math = _shape_arithmetic(gdef)
        for n in shape_math & ir.nodes.keys():
            ir[n].attrs.setdefault("unfusible", SHAPE_MATH)
        remapper.mark(ir, profiles.default())   # conv epilogues TF fuses (plan/epilogue.py)
        # A large graph not compiled before will likely need Numba: start the compile
        # workers now (all of them, or the rest beside an early one), so their
        # start-up overlaps planning (warm_cache closes them if nothing needs
        # compiling).  Small graphs compile few kernels, often in-process (or in the
        # early worker), and are not keyed at all.
        key = (_graph_key(graph_def, fetches, keep, options, resources)
               if len(ir) >= _PRESTART_MIN_NODES else None)
        if key is not None and not kernel_cache.graph_seen(key):
            workers = parallel.prestart(workers=workers)
        if options.verify:
            ir.verify()
        # a graph planned before (another process, same planner code and machine):
        # its stored plan, rebuilt and re-checked against this IR (plan/cache.py)
        the_plan = plan_cache.load(key, ir, legal) if key is not None else None
        if the_plan is None:
            the_plan = get_planner(options.planner)(ir, legal=legal,
                                                    min_ops=options.min_ops)
            if key is not None:
                plan_cache.save(key, the_plan)
        regions, kernels, failed = _compile(the_plan.regions, options, workers)
    finally:
        if workers is not None:
            workers.close()
    if key is not None and not failed:
        kernel_cache.remember_graph(key)
    dump_path = _dump_dir(options, name, graph_def)
    labels = dump.labels_for(dump_path, len(regions)) if dump_path else None
    new_gdef, kernel_names = rewrite.rewrite(gdef, ir, regions, labels)
    no_original = original.attach(new_gdef, gdef, ir, regions, kernel_names,
                                  stitch_backward=options.stitch_backward,
                                  fallback=options.fallback, options=options)
    forward.attach(new_gdef, kernels, kernel_names)    # outputs over dead inputs
    gemms = gemm.candidates(new_gdef, ir) if options.gemm else {}
    if gemms:
        gemm.rewrite(new_gdef, gemms)          # new_gdef is this call's own copy
    einsums = einsum.candidates(new_gdef, ir) if options.einsum else {}
    if einsums:
        einsum.rewrite(new_gdef, einsums)
    pads = padfold.candidates(new_gdef, fetched) if options.pad_fold else {}
    if pads:
        padfold.rewrite(new_gdef, pads)
    folded = shapes.fold_reshapes(new_gdef, gdef, ir)
    remapper.forward_identities(new_gdef, ir, {m for r in regions for m in r.nodes})
    # after the folds: the shape ops they left unread go too
    prune.bypass_inlined_identities(new_gdef, list(fetches) + list(keep))
    prune.merge_constants(new_gdef, list(fetches) + list(keep))
    prune.dead_nodes(new_gdef, list(fetches) + list(keep))   # what only regions read
    rep = _make_report(name, gdef, ir, the_plan, regions, kernels, kernel_names, failed,
                       shape_math)
    if options.autotune:
        rep.autotune = autotune.mark(new_gdef, the_plan, regions, kernel_names,
                                     options.autotune_margin)
    if len(regions) > no_original:
        how = ("stitched as a function of its own per kind of kernel (the kernel's "
               "original ops recomputed and TF's gradient of them, planned like any "
               "function)" if options.stitch_backward else
               "TF's gradient of its original ops, recomputed, as TF ops "
               "(Options.stitch_backward=False)")
        rep.notes.append(f"backward: a tape outside this function differentiates "
                         f"{len(regions) - no_original} kernel(s), each {how}; a tape "
                         "inside it gets its backward stitched with the rest")
    if no_original:
        rep.notes.append(f"{no_original} kernel(s) read a value they cannot recompute from "
                         "their inputs: no original subgraph, so no gradient through them")
    if grappler.has_control_flow(graph_def):
        rep.notes.append("the graph has functional control flow (tf.cond / tf.while_loop): "
                         "Grappler's inlining, constant folding and arithmetic rewrites "
                         "were not applied to it (tf/grappler.py says why)")
    if gemms:
        biases = sum(1 for v in gemms.values() if v[3] is not None)
        rep.notes.append(f"{len(gemms)} BatchMatMul node(s) against a 2-D weight run as one "
                         f"MatMul each, {biases} with the bias Add after it as the MatMul's "
                         f"BiasAdd (tf/gemm.py; Options(gemm=False) keeps them)")
    if seq_note:
        rep.notes.append(seq_note)
    if einsums:
        rep.notes.append(f"{len(einsums)} Einsum node(s) run as one BatchMatMulV2 each, their "
                         "operand and result transposes as row gathers (tf/einsum.py; "
                         "Options(einsum=False) keeps them)")
    if pads:
        rep.notes.append(f"{len(pads)} zero Pad(s) before a depthwise convolution folded "
                         "into its explicit padding (tf/padfold.py; Options(pad_fold=False) "
                         "keeps them)")
    if folded:
        rep.notes.append(f"{folded} Reshape target(s) computed at run time (Shape, Gather, "
                         "Prod, Concat...) are constants but for one -1 entry (tf/shapes.py)")
    rep.compile_seconds = time.perf_counter() - t0
    prof = profiles.default()
    rep.profile = prof.source or prof.name
    if dump_path:
        dump.write(dump_path, name=name, options=options, graph_before=graph_def,
                   graph_after=new_gdef, ir=ir, the_plan=the_plan, regions=regions,
                   kernels=kernels, kernel_names=kernel_names, labels=labels,
                   failed=failed, report=rep)
        rep.dump_path = dump_path
    return StitchResult(new_gdef, rep, kernels)


def _dump_dir(options, name, graph_def):
    """A fresh dump directory for this call when dumping is on (tf/dump.py)."""
    root = dump.dump_root(options)
    if not root:
        return None
    return dump.make_dir(os.fspath(root), name,
                         graph_def.SerializeToString(deterministic=True))


def _graph_key(graph_def, fetches, keep, options, resources=None) -> str:
    import hashlib
    h = hashlib.sha256(graph_def.SerializeToString(deterministic=True))
    # keep: a set's order; where dumps go does not change the plan
    h.update(repr((list(fetches), sorted(keep), replace(options, dump_dir=None))).encode())
    h.update(repr(sorted((resources or {}).items())).encode())
    h.update(remapper.table(profiles.default()).name.encode())  # TF_ENABLE_ONEDNN_OPTS
    return h.hexdigest()[:32]


def _compile(regions, options, workers=None):
    """Compile each distinct spec once (in parallel worker processes when many are
    not cached yet); a region whose kernel fails stays unfused, with the reason."""
    from .. import runtime
    from ..compile import compile_kernels
    # a region nothing reads (fetching a missing output 'y:7' made one) is no kernel:
    # the spec check refuses it; it stays unfused, with the reason
    dead = [(r, "no kernel: nothing reads the region's values (no outputs)")
            for r in regions if not r.spec.outputs]
    regions = [r for r in regions if r.spec.outputs]
    n_distinct = len({reg.spec.hash for reg in regions})
    show = options.progress if options.progress is not None else \
        n_distinct >= _PROGRESS_MIN_KERNELS
    errors = {}

    tty = sys.stderr.isatty()

    def progress(i, n, spec):
        # parallel phase: (done, n, None) as workers finish; then (i, n, spec) per load
        what = "compiled in workers" if spec is None else "kernel"
        count = i if spec is None else i + 1
        if tty:
            print(f"\rstitching: {what} {count}/{n}", end="", file=sys.stderr, flush=True)
        elif count == n or count % max(1, n // 4) == 0:    # a log: a few lines, not n
            print(f"stitching: {what} {count}/{n}", file=sys.stderr, flush=True)

    def failed_compile(spec, e):
        errors[spec.hash] = f"kernel failed to compile: {type(e).__name__}: {str(e)[:200]}"

    kernels = compile_kernels([reg.spec for reg in regions], workers=workers,
                              progress=progress if show else None, on_error=failed_compile)
    if show and regions and tty:
        print(file=sys.stderr)
    by_hash = {}
    for k in kernels:
        if k is None or k.spec.hash in by_hash:
            continue
        try:
            runtime.register(k)
            by_hash[k.spec.hash] = k
        except Exception as e:  # noqa: BLE001 — a kernel TF cannot take stays unfused
            errors[k.spec.hash] = f"kernel failed to register: {type(e).__name__}: {e}"
    ok = [r for r in regions if r.spec.hash in by_hash]
    failed = dead + [(r, errors[r.spec.hash]) for r in regions if r.spec.hash in errors]
    return ok, [by_hash[r.spec.hash] for r in ok], failed


def _make_report(name, gdef, ir, the_plan, regions, kernels, kernel_names, failed,
                 shape_math):
    tf_op = {n.name: n.op for n in gdef.node}
    mem = {n for n, op in tf_op.items()
           if opnames.is_memory_intensive(op) and n not in shape_math}
    fused = {m for r in regions for m in r.nodes}
    rep = _report.Report(function=name)
    rep.memory_intensive_ops = len(mem)
    rep.fused_ops = len(mem & fused)
    rep.unique_kernels = len({r.spec.hash for r in regions})
    rep.code_objects = len({k.code_name for k in kernels})
    for reg, kname, k in zip(regions, kernel_names, kernels):
        sched = getattr(k, "schedule", None)
        desc = sched.describe() if hasattr(sched, "describe") else ""
        rep.kernels.append(_report.KernelInfo(
            kname, [(m, tf_op.get(m, "?")) for m in reg.nodes], desc.splitlines()[0] if desc else "",
            len(reg.inputs), len(reg.outputs), reg.spec.hash))
    reasons = {n: r for n, _, r in the_plan.unfused}
    for reg, why in failed:
        for m in reg.nodes:
            reasons[m] = why
    fetches = {r.node for r in ir.outputs}
    for n in sorted(mem - fused, key=list(tf_op).index):
        why = reasons.get(n) or legality.node_reason(ir, ir[n]) or \
            ("a function output" if n in fetches else "left to TF by the planner")
        rep.unfused.append((n, tf_op[n], why))
    rep.boundaries = list(the_plan.boundaries)
    rep.notes.extend(the_plan.notes)
    rep.explanation = _explanation(the_plan, regions, kernel_names, failed)
    return rep


def _explanation(the_plan, regions, kernel_names, failed) -> list:
    """The search planner's per-kernel alternatives, named as the rewrite named them."""
    names = {tuple(r.nodes): k for r, k in zip(regions, kernel_names)}
    broken = {tuple(r.nodes): why for r, why in failed}
    out = []
    for choice in the_plan.alternatives:
        d = choice.to_dict()
        key = tuple(choice.region.nodes) if choice.region is not None else None
        d["kernel"] = names.get(key, "")
        if key in broken:
            d["deployed"], d["reason"] = False, broken[key]
        out.append(d)
    return out


_SHAPE_SOURCES = frozenset({"Shape", "ShapeN", "Size", "Rank"})
SHAPE_MATH = ("shape arithmetic: a few host integers, which TF's constant folding and "
              "tf/shapes.py fold; not memory-intensive work")


def _shape_arithmetic(gdef) -> set:
    """Nodes computing only on shapes (e.g. Prod of a Shape for a Reshape target).

    They run on a handful of host integers, not on tensor data, so they are not
    memory-intensive work (XLA constant-folds them) and are left out of the counts.
    """
    by_name = {n.name: n for n in gdef.node}
    memo: dict[str, bool] = {}

    def is_shape(name, depth=0):
        if name in memo:
            return memo[name]
        nd = by_name.get(name)
        if nd is None or depth > 200:
            return False
        if nd.op in _SHAPE_SOURCES:
            r = True
        elif nd.op == "Const":
            r = True
        elif nd.op == "Placeholder" or not nd.input:
            r = False
        else:
            data = [i.split(":")[0] for i in nd.input if not i.startswith("^")]
            r = bool(data) and all(is_shape(d, depth + 1) for d in data)
        memo[name] = r
        return r

    return {n.name for n in gdef.node if n.op != "Const" and is_shape(n.name)}
