"""``stitching.function``: a drop-in for ``tf.function`` that stitches each trace.

How a call works:

    StitchedFunction(x) ─▶ outer tf.function (retraces per input signature, as usual)
        trace body: trace the user's function alone (inner ConcreteFunction)
                    ─▶ pipeline.stitch_graph_def (plan, compile, rewrite)
                    ─▶ import the rewritten GraphDef into the outer trace, mapping
                       arguments to the outer placeholders and captured variables to
                       the same resource handles (so variables stay variables)

The outer tf.function owns tracing, caching and signatures, so behaviour matches
tf.function; the inner graph already carries TF's automatic control dependencies
as explicit control edges, which the rewrite keeps.

Background compilation (``Options(background_compile=True)``, as XLA's
``--tf_xla_async_compilation``): the first call with a new eager signature traces the
function for stock TF and returns its result while a background thread stitches the
same signature (plan, Numba compile, rewrite); the call after that thread finished runs
the stitched graph.  ``wait()`` blocks until every pending signature is stitched.

Shapes: a retrace costs a re-plan and a kernel lookup on top of TF's trace, so by
default (``reduce_retracing=None``) a function relaxes its input shapes the way
``tf.function(reduce_retracing=True)`` does: the first signature of a family (same
dtypes and ranks) is traced exactly; the second, different one is traced once with its
differing dims unknown (the kernels serve every size with one compiled code), and every
later size that fits is served by that trace with no tracing at all.
``reduce_retracing=False`` traces every shape exactly, as ``tf.function`` does by default.

Calls: a call with only eager tensors as positional arguments goes straight to the
ConcreteFunction traced for exactly those dtypes and shapes (found once through the
tf.function, so tracing and its errors are tf.function's), skipping tf.function's
per-call argument canonicalisation: measured here, a tf.function call of a small
softmax took 230 µs against 90 µs for its concrete function.  Any other call (keyword
arguments, Python values, NumPy arrays, symbolic tensors inside another trace) goes
through the tf.function.
"""
from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
import weakref

import tensorflow as tf

from ..options import Options
from . import frontend, pipeline
from .passes import original

_EAGER_TENSOR = type(tf.constant(0))
FAST_CALL_SIGNATURES = 64      # exact (dtype, shape) signatures kept per function
HINT_SECONDS = 1.0             # arbitrary: a first call slower than this gets the hint


class StitchedFunction:
    """A callable that runs ``fn`` as a TF graph with its memory-intensive ops stitched
    into generated kernels; what ``stitching.function`` returns.

    It behaves like the ``tf.function`` of ``fn`` (tracing, signatures, variables,
    ``get_concrete_function``), with input shapes relaxed by default (see
    ``stitching.function``).  Each trace is planned, compiled and rewritten once.

    Attributes:
        report: The latest trace's ``stitching.Report`` (None before the first call).
        reports: Every trace's report, oldest first.
        options: The ``stitching.Options`` it plans with.
        background_errors: Exceptions raised by background compiles
            (``Options.background_compile``); stock TF keeps serving those calls.
    """

    def __init__(self, fn, input_signature=None, options: Options | None = None,
                 autograph: bool = True, reduce_retracing: bool | None = None,
                 jit_compile=None):
        python_fn, input_signature = _unwrap(fn, input_signature, jit_compile)
        self._python_fn = python_fn
        self.options = options or Options()
        self._autograph = autograph
        self.report = None
        self.reports = []            # one per trace, oldest first
        # None: relax shapes (module docstring); a fixed input_signature leaves nothing to
        self._relax = input_signature is None and reduce_retracing is not False
        self._reduce_retracing = reduce_retracing
        # Calls that do not take the eager fast path keep tf.function's own rule: its
        # reduce_retracing would relax a rank change to an unknown rank, which no kernel
        # can serve (only an explicit True asks for it).
        self._tf_function = tf.function(self._trace, input_signature=input_signature,
                                        autograph=False,
                                        reduce_retracing=bool(reduce_retracing))
        self._concrete = {}          # ((dtype, shape), ...) of eager args -> ConcreteFunction
        self._shapes = {}            # family ((dtype, rank), ...) -> shapes seen
        self._general = {}           # family -> [(relaxed shapes, ConcreteFunction)]
        self._pending = {}           # key -> background thread stitching it
        self._lock = threading.Lock()
        self.background_errors = []  # exceptions of background compiles (stock TF kept)
        functools.update_wrapper(self, python_fn, updated=())

    def __call__(self, *args, **kwargs):
        if not kwargs:
            key = _eager_key(args)
            if key is not None:
                cf = self._concrete.get(key)
                if cf is None and len(self._concrete) < FAST_CALL_SIGNATURES:
                    cf = self._concrete[key] = self._concrete_for(key, args)
                if cf is not None:
                    return _call_concrete(cf, args)
        return self._tf_function(*args, **kwargs)

    # -- shapes ---------------------------------------------------------------------
    def _concrete_for(self, key, args):
        """The ConcreteFunction a new exact signature runs: a relaxed trace that fits
        it, else a new trace (relaxed where an earlier shape of its family differs)."""
        family = tuple((dtype, len(shape)) for dtype, shape in key)
        shapes = [shape for _, shape in key]
        for general, cf in self._general.get(family, ()):
            if all(_fits(g, s) for g, s in zip(general, shapes)):
                return cf
        seen = self._shapes.setdefault(family, [])
        relaxed = _relaxed(seen + [shapes]) if self._relax and seen else None
        seen.append(shapes)
        if self.options.background_compile:
            return self._stock_then_stitch(key, args, family, relaxed)
        if relaxed is None:
            return self._tf_function.get_concrete_function(*args)
        cf = self._tf_function.get_concrete_function(*tensor_specs(key, relaxed))
        self._general.setdefault(family, []).append((relaxed, cf))
        return cf

    # -- background compilation ----------------------------------------------------
    def _stock_then_stitch(self, key, args, family=None, relaxed=None):
        """Stock TF's ConcreteFunction for ``args`` now; the stitched one (traced with
        ``relaxed`` shapes when given) replaces it in ``_concrete`` when a background
        thread has built it."""
        stock = tf.function(self._python_fn, autograph=self._autograph) \
            .get_concrete_function(*args)
        specs = tensor_specs(key, relaxed)
        general = (family, relaxed) if relaxed is not None else None
        t = threading.Thread(target=self._stitch_in_background, args=(key, specs, general),
                             name="stitching-compile", daemon=True)
        with self._lock:
            self._pending[key] = t
        _LIVE.add(self)
        t.start()
        return stock

    def _stitch_in_background(self, key, specs, general=None):
        try:
            cf = self._tf_function.get_concrete_function(*specs)
            self._concrete[key] = cf            # one dict store: calls see old or new
            if general is not None:
                family, relaxed = general
                self._general.setdefault(family, []).append((relaxed, cf))
        except Exception as e:  # noqa: BLE001 — the stock graph keeps serving this key
            self.background_errors.append(e)
        finally:
            with self._lock:
                self._pending.pop(key, None)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until background compiles are done (or ``timeout`` seconds passed);
        True when none is pending and none failed.  Synchronous functions return at
        once."""
        with self._lock:
            threads = list(self._pending.values())
        for t in threads:
            t.join(timeout)
        with self._lock:
            return not self._pending and not self.background_errors

    def __get__(self, instance, owner):
        """Support decorating methods: bind like a function does."""
        if instance is None:
            return self
        bound = self.__dict__.get("_bound_" + str(id(instance)))
        if bound is None:
            bound = StitchedFunction(functools.partial(self._python_fn, instance),
                                     options=self.options, autograph=self._autograph,
                                     reduce_retracing=self._reduce_retracing)
            self.__dict__["_bound_" + str(id(instance))] = bound
        return bound

    def get_concrete_function(self, *args, **kwargs):
        """The stitched ``tf.types.experimental.ConcreteFunction`` for these arguments
        (or ``tf.TensorSpec`` s), tracing it if needed, as ``tf.function``'s."""
        return self._tf_function.get_concrete_function(*args, **kwargs)

    @property
    def input_signature(self):
        """The fixed input signature given at construction, or None."""
        return self._tf_function.input_signature

    # -- tracing ------------------------------------------------------------
    def _trace(self, *args, **kwargs):
        structure = (args, kwargs)
        flat = tf.nest.flatten(structure, expand_composites=True)
        where = [i for i, v in enumerate(flat) if isinstance(v, tf.Tensor)]
        specs = [tf.TensorSpec(flat[i].shape, flat[i].dtype) for i in where]

        def inner(*tensors):
            vals = list(flat)
            for i, t in zip(where, tensors):
                vals[i] = t
            a, k = tf.nest.pack_sequence_as(structure, vals, expand_composites=True)
            return self._python_fn(*a, **k)

        inner_fn = tf.function(inner, autograph=self._autograph)
        # a compile worker warming up while TF traces; not behind a background
        # compile, where stock TF's first call is running and needs the cores
        workers = None if self.options.background_compile else pipeline.early_workers()
        try:
            cf = inner_fn.get_concrete_function(*specs)
            fetches = [t.name for t in cf.outputs]
            keep = [op.name for op in cf.graph.control_outputs]
            result = pipeline.stitch_graph_def(
                cf.graph.as_graph_def(), fetches, keep, self.options,
                name=getattr(self._python_fn, "__name__", type(self._python_fn).__name__),
                resources=frontend.resource_shapes(cf.graph), workers=workers)
        finally:
            if workers is not None:
                workers.close()
        self.report = result.report
        self.reports.append(result.report)
        if not self.options.background_compile:
            _hint_background_compile(result.report.compile_seconds)

        _define_fallbacks(result.graph_def)
        outer = tf.compat.v1.get_default_graph()
        input_map = _input_map(cf, [flat[i] for i in where], outer, result.graph_def)
        return_elements = fetches + keep
        outs = tf.graph_util.import_graph_def(
            result.graph_def, input_map=input_map, return_elements=return_elements,
            name="stitched") if return_elements else []
        tensors = outs[:len(fetches)]
        if not fetches:
            return tf.nest.pack_sequence_as(cf.structured_outputs, [],
                                            expand_composites=True) \
                if cf.structured_outputs is not None else None
        if keep:   # stateful ops with no data output: run them before returning
            with tf.control_dependencies(outs[len(fetches):]):
                tensors = [tf.identity(t) for t in tensors]
        return tf.nest.pack_sequence_as(cf.structured_outputs, tensors,
                                        expand_composites=True)


def _define_fallbacks(graph_def):
    """The functions kernel nodes run as their native segment (``fallback``: autotune's
    other side, or where a kernel cannot be built), defined in the eager context: the
    op instantiates them through the runtime's function library, which the rewritten
    graph's library does not reach once it is imported into the caller's trace ("Function
    stitching_original_... is not defined")."""
    wanted = {f.name for n in graph_def.node if n.op == "StitchedKernel"
              for f in n.attr["fallback"].list.func} if any(
        "fallback" in n.attr for n in graph_def.node) else set()
    if not wanted:
        return
    from tensorflow.python.eager import context
    ctx = context.context()
    for fdef in graph_def.library.function:
        if fdef.signature.name in wanted and not ctx.has_function(fdef.signature.name):
            ctx.add_function_def(fdef)


def _input_map(cf, args, outer, graph_def):
    """Every placeholder of the inner trace that ``graph_def`` (the rewritten graph)
    still holds -> the outer trace's tensor that feeds it.

    A ConcreteFunction's inputs are its arguments followed by *all* its captures: the
    by-value ones (``graph.captures``: eager tensors, variable handles) and the
    by-reference ones, which ``capture_call_time_value`` feeds from a closure at each
    call (MirroredStrategy's collective instance keys and ordering).  Mapping only
    ``graph.captures`` left the by-reference placeholders unfed in the imported graph
    ("You must feed a value for placeholder tensor ..." at run time).
    ``cf.captured_inputs`` evaluates the closures now, inside the outer trace, so they
    become the outer function's own call-time captures, as a nested tf.function call
    would make them.

    A placeholder the rewritten graph no longer holds needs no feed: Grappler's
    constant folding replaces a captured constant that only feeds foldable arithmetic
    (EfficientNet's Normalization layer: Sqrt(variance), x - mean) by its result,
    and import_graph_def refuses a map entry for a node that is not there."""
    captured = cf.captured_inputs
    if len(cf.inputs) != len(args) + len(captured):
        raise RuntimeError(
            f"stitching.function: the traced function has {len(cf.inputs)} inputs but "
            f"{len(args)} arguments and {len(captured)} captures; refusing to import a "
            "graph with an unfed placeholder")
    present = {n.name for n in graph_def.node}
    return {ph.name: (v if i < len(args) else outer.capture(v))
            for i, (ph, v) in enumerate(zip(cf.inputs, list(args) + list(captured)))
            if ph.op.name in present}


_BACKWARDS: dict = {}            # (region function, outputs differentiated) -> function


def _backward_function(key, make, options=None):
    """The stitched backward of one kind of region (tf/original.py asks, on a gradient
    request through a StitchedKernel), planned with the forward's ``options``; one
    StitchedFunction per key (which includes the options), so identical regions share
    traces and kernels."""
    fn = _BACKWARDS.get(key)
    if fn is None:
        fn = _BACKWARDS[key] = StitchedFunction(make(), options=options, autograph=False)
    return fn


def backward_reports() -> list:
    """Reports of every stitched backward built in this process (latest trace each)."""
    return [f.report for f in _BACKWARDS.values() if f.report is not None]


original.use_backward_stitcher(_backward_function)

_LIVE = weakref.WeakSet()        # functions that started background compiles


@atexit.register
def _join_background_compiles():
    """Let background compiles finish before the interpreter tears TF down under them."""
    for f in list(_LIVE):
        f.wait()


_hinted = False


def _hint_background_compile(seconds: float) -> None:
    """Once per process: a slow first call says that background compile exists."""
    global _hinted
    if _hinted or seconds < HINT_SECONDS or os.environ.get("STITCHING_NO_HINTS"):
        return
    _hinted = True
    print(f"stitching: this call waited {seconds:.1f} s to plan and compile its kernels. "
          "stitching.Options(background_compile=True) serves first calls with stock TF "
          "while they compile (STITCHING_NO_HINTS=1 hides this line).",
          file=sys.stderr, flush=True)


def _relaxed(shapes_seen) -> list:
    """Per argument, its shape with every dim that differed between calls unknown."""
    return [tuple(d[0] if len(set(d)) == 1 else None for d in zip(*arg))
            for arg in zip(*shapes_seen)]


def _fits(general, shape) -> bool:
    return all(g is None or g == d for g, d in zip(general, shape))


def tensor_specs(key, shapes=None) -> list:
    """TensorSpecs for an exact-signature key (``_eager_key``'s ((dtype, shape), ...)),
    with ``shapes`` (relaxed ones) instead of the key's own where given;
    stitching.inspect traces a function again from the keys it was called with."""
    shapes = [shape for _, shape in key] if shapes is None else shapes
    return [tf.TensorSpec(shape, dtype) for (dtype, _), shape in zip(key, shapes)]


def _eager_key(args):
    """((dtype, shape), ...) when every argument is an eager tensor, else None."""
    if not tf.executing_eagerly():
        return None
    key = []
    for a in args:
        if type(a) is not _EAGER_TENSOR:
            return None
        key.append((a.dtype, tuple(a.shape)))
    return tuple(key)


def _call_concrete(cf, args):
    """``cf(*args)`` without re-checking the arguments (the exact-signature key did):
    TF 2.21's ConcreteFunction._call_flat, else the public call."""
    call_flat = getattr(cf, "_call_flat", None)
    if call_flat is None:
        return cf(*args)
    return call_flat(list(args), cf.captured_inputs)


def _unwrap(fn, input_signature, jit_compile):
    if jit_compile:
        raise ValueError(_JIT_MESSAGE)
    if isinstance(fn, StitchedFunction):
        return fn._python_fn, input_signature or fn.input_signature
    python_fn = getattr(fn, "python_function", None)
    if python_fn is not None:        # an existing tf.function
        if getattr(fn, "_jit_compile", None):
            raise ValueError(_JIT_MESSAGE)
        return python_fn, input_signature or getattr(fn, "input_signature", None)
    if not callable(fn):
        raise TypeError(f"stitching.function expects a callable, got {type(fn).__name__}")
    return fn, input_signature


_JIT_MESSAGE = ("stitching.function cannot stitch a function compiled with "
                "jit_compile=True: XLA compiles the whole function itself and has no "
                "kernel for the StitchedKernel op. Use either XLA or stitching for it.")


def function(fn=None, *, input_signature=None, options: Options | None = None,
             autograph: bool = True, reduce_retracing: bool | None = None, jit_compile=None):
    """Compile ``fn`` like ``tf.function``, with its memory-intensive ops stitched into
    generated kernels.  Use as ``@stitching.function`` or
    ``@stitching.function(options=...)``.

    The first call with a new input signature traces ``fn``, plans the kernels,
    compiles those not in the disk cache and rewrites the graph; later calls run it.
    ``f.report`` says what was fused and what was not, and why.

    Args:
        fn: The Python function to compile (any TF code: Keras layers, ``tf.nn``,
            raw ops, a whole training step with its ``GradientTape``).
        input_signature: A list of ``tf.TensorSpec``, as ``tf.function``'s.
        options: A ``stitching.Options``; default ``Options()``.
        autograph: As ``tf.function``'s.
        reduce_retracing: None (default) relaxes input shapes after the second
            distinct shape of the same dtypes and ranks, so a new batch size costs
            no trace; True as ``tf.function``'s; False traces every shape exactly.
        jit_compile: Must be falsy: XLA has no kernel for the stitched op.

    Returns:
        A ``StitchedFunction`` (or, without ``fn``, a decorator making one).

    Raises:
        ValueError: ``jit_compile=True``, or ``fn`` is a ``tf.function`` compiled
            with XLA.
        TypeError: ``fn`` is not callable.
    """
    if fn is None:
        return functools.partial(function, input_signature=input_signature, options=options,
                                 autograph=autograph, reduce_retracing=reduce_retracing,
                                 jit_compile=jit_compile)
    return StitchedFunction(fn, input_signature=input_signature, options=options,
                            autograph=autograph, reduce_retracing=reduce_retracing,
                            jit_compile=jit_compile)
