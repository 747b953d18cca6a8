"""The driver: one GraphDef in, one rewritten GraphDef and a report out.

First the graph's loops: those with a constant trip count are unrolled
(passes/unroll.py, Options(unroll_loops)), the bodies of the others (and of every
cond) stitched as functions of their own (tf/control_flow.py).  Then two ordered
tables of graph passes (tf/passes/, the protocol in tf/passmanager.py) around
planning, each pass entered once:

  BEFORE_PLANNING  on TF's graph, then the IR
    grappler     TF's inlining, constant folding and arithmetic optimizer, as
                 tf.function runs them; IdentityN forwarded          passes/grappler.py
    tensorlist   TensorList reads and stacks at constant indices (an unrolled
                 loop's) -> StridedSlice / Pack                     tensorlist.py
    exclude      the ops Options(exclude) keeps TF's, by op type or name (the
                 passes below leave them; lift marks them unfusible)   exclude.py
    bcast        broadcast-gradient shapes known at trace time -> constants   bcast.py
    concat_grad  a ConcatV2 gradient's Slice bounds known at trace time -> constants
                                                                      concat_grad.py
    strided_grad a strided slice's gradient (zeros between) -> Reshape, Pad, Reshape
                 (the Pad fused, the regrouping Reshape a view)     strided_grad.py
    sparse_xent  SparseSoftmaxCrossEntropyWithLogits -> the dense op     sparse_xent.py
    bn_reserve   a training-mode FusedBatchNormV3's reserve_space_3 read by its CPU
                 gradient -> a scalar zero (what TF's CPU kernel writes)  bn_reserve.py
    variables    a variable's AssignAdd/Sub -> AssignVariableOp of its new value, reads
                 after a write -> the value written (Options(variable_updates))
                                                                      variables.py
    seqsplit     token-wise blocks whose products TF runs on one thread at batch 1
                 -> two halves of the sequence (Options(seq_split))     seqsplit.py
    reshape_sink a Transpose of a Reshape that groups dims -> a Reshape of a
                 Transpose (GQA's repeated heads)                   reshape_sink.py
    padfold      a zero Pad before a conv -> its padding (Options(pad_fold)),
                 before lifting, so a convolution a kernel computes reads the Pad's
                 input, not a Pad TF runs                              padfold.py
    lift         TF nodes -> IR (the frontend, tf/frontend.py)              lift.py
    shape_math   shape arithmetic marked, left out of the counts     shape_math.py
    shapes       run-time Reshape targets known but for one dim -> constants; the
                 Shape ops only they read leave the IR (not kernel outputs) shapes.py
    symdims      run-time dims the graph proves equal -> one symbol (for packing
                 independent chains over an unknown batch)                 symdims.py
    remapper     conv epilogues TF's remapper fuses, priced as free   remapper.py
  plan           plan.get_planner(options.planner); legality from schedule.check;
                 stored per graph, reused by later processes (plan/cache.py)
  compile        compile.compile_kernels (Numba; uncached kernels in parallel worker
                 processes; cached in memory and on disk), runtime.register
  AFTER_PLANNING on the rewrite's own copy of the graph
    rewrite      one StitchedKernel node per region                       rewrite.py
    original     each kernel's original ops as a library function       original.py
    forward      outputs written over dead inputs                        forward.py
    gemm         BatchMatMul against a 2-D weight -> one MatMul (Options(gemm)) gemm.py
    einsum       two-operand Einsum -> BatchMatMulV2 + row gathers (Options(einsum))
    xladot       where TF's GEMM is Eigen's, each matrix product -> a one-product XLA
                 function (opt-in: Options(xla_gemm))                     xladot.py
    conv1x1      where the blas pass runs, a large 1x1 Conv2D -> Reshape, MatMul,
                 Reshape (Options(conv1x1_gemm))                          conv1x1.py
    blas         where TF's GEMM is Eigen's, each matrix product (and the BiasAdd
                 after a MatMul) -> an OpenBLAS op (Options(blas_gemm))      blas.py
    attention    product -> softmax kernel -> product -> one StitchedAttention
                 op (Options(fused_attention))                         attention.py
    inline       in graphs without a backward, the OpenBLAS ops run on the executor's
                 thread (no inter-op hand-off between a layer's ops)     inline.py
    convgrad     where TF's convolutions are Eigen's, the filter gradients of a
                 backward one after another (one im2col buffer live)   convgrad.py
    remapper_identities  the Identity in Keras' swish forwarded         remapper.py
    prune        what the rewrite left unread, equal constants, inlining's Identities
    autotune     kernels with a small predicted margin marked to be timed against
                 their original ops (Options(autotune))                 autotune.py
  report         report.Report, with each pass's note and time
  dump           tf.dump.write (only with Options(dump_dir) / $STITCHING_DUMP_DIR)

A new pass is one module in passes/ and one line in a table.
"""
from __future__ import annotations

import contextvars
import copy
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
from . import control_flow, dump, opnames, passmanager, results, scalars
from .passes import (attention, autotune, bcast, blas, bn_reserve, concat_grad, conv1x1,
                     convgrad,
                     einsum, exclude, forward,
                     gemm, grappler, inline, lift, original, padfold, prune, remapper,
                     reshape_sink,
                     rewrite, seqsplit, shape_math, shapes, sparse_xent, strided_grad, symdims,
                     tensorlist, unroll, variables, xladot)

BEFORE_PLANNING = (
    grappler.PASS,
    tensorlist.PASS,
    exclude.PASS,
    bcast.PASS,
    concat_grad.PASS,
    strided_grad.PASS,
    sparse_xent.PASS,
    bn_reserve.PASS,
    variables.PASS,
    seqsplit.PASS,
    reshape_sink.PASS,
    padfold.PASS,
    lift.PASS,
    shape_math.PASS,
    shapes.PASS,
    symdims.PASS,
    remapper.MARK,
)
AFTER_PLANNING = (
    rewrite.PASS,
    original.PASS,
    forward.PASS,
    gemm.PASS,
    einsum.PASS,
    xladot.PASS,
    conv1x1.PASS,
    blas.PASS,
    attention.PASS,
    inline.PASS,
    convgrad.PASS,
    remapper.FORWARD,
    prune.PASS,
    autotune.PASS,
)
# The report's notes come in this order of passes (the order they had before the
# passes ran from tables); a pass not named here adds its note after these.
NOTE_ORDER = ("original", "grappler", "gemm", "seqsplit", "einsum", "padfold", "xladot", "conv1x1", "blas",
              "attention",
              "shapes")

_PROGRESS_MIN_KERNELS = 4   # arbitrary: below this compiling is quick, stay quiet
_PRESTART_MIN_NODES = 300   # arbitrary: graphs this large usually compile several kernels

# What the progress lines add to a graph's name: the signature being stitched
# (`` (float32[?,224,224,3])``), so that several signatures compiling at once (a
# server's batch sizes, each in its background thread) tell their lines apart.
# Per thread (a ContextVar): each background compile sets its own.
_signature = contextvars.ContextVar("stitching_signature", default="")


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
    failed: int = 0          # regions left unfused because their kernel failed to build


def legal(spec):
    """Region legality from the schedule stage: None if one kernel can do it.

    Every planner asks it of each region it weighs, so a background compile stopped
    at exit stops here, mid-planning: a large model's planning runs for seconds
    between the pass manager's checks (EfficientNetB0: 593 checks over ~3 s), and
    the interpreter's exit waited them out (up to EXIT_WAIT_SECONDS)."""
    from ..compile import parallel
    parallel.check_cancelled()
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
    if _early_unused or parallel.default_jobs() < 2 or not kernel_cache.cache_is_empty():
        return None
    return parallel.Workers(1)


_early_unused = False    # a trace raised while its early worker warmed up


def early_worker_unused() -> None:
    """A trace raised while its early worker warmed up (the worker is closed unused):
    later traces in this process start none.  A trace that fails again (a notebook's
    cell re-run, TF's tf.function tests) would otherwise spawn a compile worker
    process at every attempt, for nothing; the planner's own prestart (``_stitch``)
    still starts workers for a large graph."""
    global _early_unused
    _early_unused = True


def stitch_graph_def(graph_def, fetches, keep=(), options: Options = Options(),
                     name: str = "?", resources: dict | None = None,
                     workers=None, bodies: bool = True,
                     scalar_values=frozenset(), templates=None,
                     result_key: str | None = None, signature: str = "") -> StitchResult:
    """``resources``: variable shapes from the live graph (frontend.resource_shapes);
    ``workers``: pre-started compile workers (``early_workers``), used or closed;
    ``bodies``: stitch the functions control flow runs (tf/control_flow.py) first;
    ``scalar_values``: a traced function's Python scalar arguments, whose constants
    are planned as kernel inputs (tf/scalars.py); ``templates``: a
    ``scalars.Templates`` where a trace that differs from an earlier one only in
    those constants finds its stitched graph; ``result_key``: where the result
    cache keeps this call's result (``results.key``; the caller probed it first):
    stored there when every kernel was built; ``signature``: the arguments' text
    that progress lines add to ``name``."""
    token = _signature.set(f" {signature}" if signature else "")
    try:
        result = _stitch_graph_def(graph_def, fetches, keep, options, name, resources,
                                   workers, bodies, scalar_values, templates)
    finally:
        _signature.reset(token)
    if result_key is not None:
        stored = not result.failed and results.save(result_key, graph_def,
                                                    result.graph_def, result.report)
        result.report.result_stored = bool(stored)
        if not stored:
            result.report.notes.append(
                "not stored in the result cache, so the next process plans this graph "
                "again: " + (f"{result.failed} kernel(s) could not be built (above)"
                             if result.failed else "a kernel was registered from a "
                             "shipped model or not from Python"))
    return result


def _stitch_graph_def(graph_def, fetches, keep, options, name, resources, workers,
                      bodies, scalar_values, templates) -> StitchResult:
    t0 = time.perf_counter()
    with _gc_paused():
        abstraction = scalars.abstract(graph_def, scalar_values)
        if abstraction is None:
            return _stitch_all(graph_def, fetches, keep, options, name, resources, workers,
                               bodies, scalar_values)
        key = (scalars.Templates.key(abstraction, _template_context(
            fetches, keep, options, resources, bodies))
            if templates is not None and not dump.dump_root(options) else None)
        hit = templates.get(key, abstraction) if key is not None else None
        if hit is None:
            result = _stitch_all(abstraction.graph_def, fetches, keep, options, name,
                                 resources, workers, bodies, scalar_values)
            if key is not None:
                templates.put(key, abstraction, result)
            return _restored(result, abstraction, abstraction.abstracted)
        if workers is not None:
            workers.close()
        template, abstracted, functions = hit
        report = copy.copy(template.report)
        report.compile_seconds = time.perf_counter() - t0
        report.reused_kernels = report.unique_kernels     # the template's, all built
        return replace(template, report=report, graph_def=abstraction.restore(
            template.graph_def, abstracted, functions))


def _stitch_all(graph_def, fetches, keep, options, name, resources, workers, bodies,
                scalar_values) -> StitchResult:
    """Loops with a constant trip count unrolled (passes/unroll.py), the functions
    ``graph_def``'s other control flow runs (``bodies``), then the graph."""
    stitched, unrolled, owned = [], [], False      # owned: graph_def is our copy
    if options.unroll_loops and any(n.op in unroll.WHILE_OPS for n in graph_def.node):
        graph_def, owned = type(graph_def).FromString(graph_def.SerializeToString()), True
        unrolled = unroll.unroll_loops(graph_def, options.unroll_loops)
    if bodies and grappler.has_control_flow(graph_def):
        if not owned:
            graph_def = type(graph_def).FromString(graph_def.SerializeToString())
        stitched = control_flow.stitch_bodies(
            graph_def, lambda g, f, k, label, res: _stitch_body(g, f, k, options, label,
                                                               scalar_values, res),
            name, resources)
    result = _stitch(graph_def, fetches, keep, options, name, resources, workers)
    result.report.bodies = stitched
    result.report.notes[:0] = unrolled
    return result


def _stitch_body(graph_def, fetches, keep, options, name, scalar_values, resources):
    """A control-flow body, its own Python-scalar constants planned as inputs;
    ``resources``: the shapes of the variables among its arguments."""
    abstraction = scalars.abstract(graph_def, scalar_values, functions=False)
    if abstraction is None:
        return _stitch(graph_def, fetches, keep, options, name, resources, None)
    result = _stitch(abstraction.graph_def, fetches, keep, options, name, resources, None)
    return _restored(result, abstraction, abstraction.abstracted)


def _restored(result, abstraction, names) -> StitchResult:
    """``result`` (stitched from ``abstraction``) with the Placeholders ``names``
    ``abstraction``'s constants again."""
    return replace(result, graph_def=abstraction.restore(result.graph_def, names))


_CONTEXTS: dict = {}     # _template_context's arguments and profile variables -> text
_CONTEXTS_MAX = 256      # arbitrary: one entry per (function signature, options) in use


def _template_context(fetches, keep, options, resources, bodies) -> str:
    """What a stitched template depends on besides its graph: the plan's context,
    whether bodies were stitched, and the device profile planned with.

    Read on every new Python scalar's trace, and the same text for each: remembered
    by its arguments and the variables that choose the device profile (reading the
    profile and its planning key cost 0.3 ms a trace; a calibration installed into a
    running process is seen by the next process)."""
    memo = (tuple(fetches), tuple(sorted(keep)), options,
            repr(sorted((resources or {}).items())), bodies,
            os.environ.get("STITCHING_DEVICE_PROFILE"), os.environ.get("STITCHING_PROFILE"))
    text = _CONTEXTS.get(memo)
    if text is None:
        prof = profiles.default()
        text = (results.context(fetches, keep, options, resources, prof) + repr(bodies)
                + prof.planning_key())
        if len(_CONTEXTS) >= _CONTEXTS_MAX:
            _CONTEXTS.clear()
        _CONTEXTS[memo] = text
    return text


def _stitch(graph_def, fetches, keep, options, name, resources, workers) -> StitchResult:
    t0 = time.perf_counter()
    from . import ensure_runtime
    from ..compile import kernel as kernel_cache
    from ..compile import parallel
    ctx = passmanager.Context(graph_def, fetches, keep, options, resources)
    ctx.dump_path = _dump_dir(options, name, graph_def)
    dump_pass = _dump_pass if ctx.dump_path else None
    try:
        ensure_runtime()
        passmanager.run(BEFORE_PLANNING, ctx, dump=dump_pass)
        parallel.check_cancelled()      # a background compile at exit stops here
        ir = ctx.ir
        key = _graph_key(graph_def, fetches, keep, options, resources)
        # A large graph not compiled before will likely need Numba: start the compile
        # workers now (all of them, or the rest beside an early one), so their
        # start-up overlaps planning (warm_cache closes them if nothing needs
        # compiling).  Small graphs compile few kernels, often in-process (or in the
        # early worker).
        if len(ir) >= _PRESTART_MIN_NODES and not kernel_cache.graph_seen(key):
            workers = parallel.prestart(workers=workers)
        # A graph planned before (another process, same planner code and machine):
        # its stored plan, rebuilt and re-checked against this IR (plan/cache.py).
        # Every size: the warm short job's train step (494 nodes) stitched in 0.93 s
        # with its stored plan against 1.58 s planning, its test step (94 nodes)
        # 0.37 against 0.40 s (medians of 7, one process, a loaded machine).
        the_plan = plan_cache.load(key, ir, legal)
        if the_plan is None:
            if options.progress or (options.progress is None
                                    and len(ir) >= _PRESTART_MIN_NODES):
                # a large model's planning takes seconds before any kernel compiles
                print(f"stitching: {name}{_signature.get()}: planning {len(ir)} nodes",
                      file=sys.stderr, flush=True)
            the_plan = get_planner(options.planner)(ir, legal=legal,
                                                    min_ops=options.min_ops)
            plan_cache.save(key, the_plan)
        ctx.plan = the_plan
        built = kernel_cache.in_memory([r.spec for r in the_plan.regions])
        ctx.regions, ctx.kernels, ctx.failed = _compile(the_plan.regions, options, workers,
                                                        name)
    finally:
        if workers is not None:
            workers.close()
    if not ctx.failed:
        kernel_cache.remember_graph(key)
    if ctx.dump_path:
        ctx.labels = dump.labels_for(ctx.dump_path, len(ctx.regions))
    passmanager.run(AFTER_PLANNING, ctx, dump=dump_pass)
    kept = _kept(ctx)       # the kernels of the final graph, for the report and the dump
    rep = _make_report(name, ctx, kept)
    rep.compile_seconds = time.perf_counter() - t0
    rep.reused_kernels = len(built & {k.spec_hash for k in rep.kernels})
    prof = profiles.default()
    rep.profile = prof.source or prof.name
    if ctx.dump_path:
        dump.write(ctx.dump_path, name=name, options=options, graph_before=graph_def,
                   graph_after=ctx.graph_def, ir=ir, the_plan=the_plan,
                   regions=[ctx.regions[i] for i in kept],
                   kernels=[ctx.kernels[i] for i in kept],
                   kernel_names=[ctx.kernel_names[i] for i in kept],
                   labels=[ctx.labels[i] for i in kept], failed=ctx.failed, report=rep)
        rep.dump_path = ctx.dump_path
    broken = [r for r, why in ctx.failed if r.spec.outputs]    # not the dead regions
    return StitchResult(ctx.graph_def, rep, ctx.kernels, failed=len(broken))


def _dump_pass(index, name, ctx):
    """The graph after one pass, into this call's dump (Options(dump_passes))."""
    dump.write_pass_graph(ctx.dump_path, index, name, ctx.graph_def)


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
    h.update(results.context(fetches, keep, options, resources).encode())
    return h.hexdigest()[:32]


def _compile(regions, options, workers=None, name="?"):
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
    name = name + _signature.get()

    def progress(i, n, spec):
        # parallel phase: (done, n, None) as workers finish; then (i, n, spec) per load
        what = "compiled in workers" if spec is None else "kernel"
        count = i if spec is None else i + 1
        if tty:
            # \x1b[K clears the rest of the line: "kernel 31/31" over "compiled in
            # workers 10/10" left "workers 10/10" behind
            print(f"\rstitching: {name}: {what} {count}/{n}\x1b[K", end="",
                  file=sys.stderr, flush=True)
        elif count == n or count % max(1, n // 4) == 0:    # a log: a few lines, not n
            print(f"stitching: {name}: {what} {count}/{n}", file=sys.stderr, flush=True)

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


def _kept(ctx) -> list:
    """Indices of the planned kernels that are nodes of the final graph.  A kernel a
    later pass took into an op of its own (tf/passes/attention.py: the softmax between
    an attention's products) no longer runs."""
    final = {n.name for n in ctx.graph_def.node}
    return [i for i, kname in enumerate(ctx.kernel_names) if kname in final]


def _make_report(name, ctx, kept):
    gdef, ir, the_plan, regions, kernels, kernel_names, failed, shape_math = (
        ctx.planned, ctx.ir, ctx.plan, ctx.regions, ctx.kernels, ctx.kernel_names,
        ctx.failed, ctx.shape_math)
    tf_op = {n.name: n.op for n in gdef.node}
    mem = {n for n, op in tf_op.items()
           if opnames.is_memory_intensive(op) and n not in shape_math}
    # a memory-intensive op the frontend lifted as a view (a Sum over no axes: the
    # gradient of an Add whose operands have one shape, its BroadcastGradientArgs axes
    # folded; a Cast to its own type): TF's kernel forwards its input, so it does no
    # data work on either side.  Not counted, as an Identity is not; counted, one left
    # out of a kernel had no reason to give ("left to TF by the planner")
    mem -= {n for n in mem if n in ir and ir[n].op != tf_op[n] and not legality.work(ir[n])}
    # ops a later pass took into a product's op cost no pass over memory of their own:
    # fused, listed apart from the kernels' ops.  The planner left some to TF (an
    # EinsumDense bias Add as the MatMul's BiasAdd: passes/gemm.py; the scores' scale
    # Mul as a StitchedAttention's scale: passes/attention.py); the others were a
    # kernel's that the pass took whole (the softmax kernel between an attention's
    # products), which the pass recorded under the kernel's name
    taken = {}
    for i in sorted(set(range(len(kernel_names))) - set(kept)):
        where = ctx.folded.get(kernel_names[i], "in an op a later pass made of its kernel")
        taken.update((m, where) for m in regions[i].nodes if m in mem)
    regions = [regions[i] for i in kept]
    kernels = [kernels[i] for i in kept]
    kernel_names = [kernel_names[i] for i in kept]
    fused = {m for r in regions for m in r.nodes}
    folded = {n: where for n, where in ctx.folded.items() if n in mem and n not in fused}
    folded.update(taken)
    rep = _report.Report(function=name)
    rep.memory_intensive_ops = len(mem)
    rep.fused_ops = len(mem & fused) + len(folded)
    rep.folded = [(n, tf_op[n], where) for n, where in folded.items()]
    rep.unique_kernels = len({r.spec.hash for r in regions})
    rep.code_objects = len({k.code_name for k in kernels})
    rep.code_tiers = [(kname, k) for kname, k in zip(kernel_names, kernels)
                      if getattr(k, "tiering", None) is not None]
    for reg, kname, k in zip(regions, kernel_names, kernels):
        sched = getattr(k, "schedule", None)
        desc = sched.describe() if hasattr(sched, "describe") else ""
        rep.kernels.append(_report.KernelInfo(
            kname, [(m, tf_op.get(m, "?")) for m in reg.nodes], desc.splitlines()[0] if desc else "",
            len(reg.inputs), len(reg.outputs), reg.spec.hash,
            counted=frozenset(m for m in reg.nodes if m in mem)))
    reasons = {n: r for n, _, r in the_plan.unfused}
    for reg, why in failed:
        for m in reg.nodes:
            reasons[m] = why
    fetches = {r.node for r in ir.outputs}
    for n in sorted(mem - fused - set(folded), key=list(tf_op).index):
        why = reasons.get(n) or legality.node_reason(ir, ir[n]) or \
            ("a function output the plan leaves to TF" if n in fetches else
             "left to TF by the planner")
        rep.unfused.append((n, tf_op[n], why))
    rep.boundaries = list(the_plan.boundaries)
    rep.notes.extend(the_plan.notes)
    order = [p for p in NOTE_ORDER if p in ctx.notes]
    for p in order + [p for p in ctx.notes if p not in order]:
        rep.notes.extend(ctx.notes[p])
    rep.explanation = _explanation(the_plan, regions, kernel_names, failed)
    if ctx.autotune is not None:
        rep.autotune = ctx.autotune
    rep.pass_seconds = dict(ctx.seconds)
    rep.backward = ctx.backward
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
