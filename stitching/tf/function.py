"""``stitching.function``: a drop-in for ``tf.function`` that stitches each trace.

A StitchedFunction *is* a tf.function: a subclass of TF's ``Function``, made with the
same parameters, so TF binds arguments (the user's parameter names, defaults,
keywords, varargs), traces, caches, retraces (and warns about it, naming the user's
function), lifts variables, differentiates and saves it.  Only what TF traces differs:

    TF's trace of the user's function (TracingOptions.python_function, autograph and
    variable scope applied by TF) ─▶ _StitchingTracer, inside TF's FuncGraph:
        trace the user's function alone (an inner graph; TF's own input-mutation
        check, autograph status and captures as TF's trace would have them)
        ─▶ pipeline.stitch_graph_def (control-flow bodies, plan, compile, rewrite)
        ─▶ import the rewritten GraphDef into TF's trace, its arguments mapped to TF's
           placeholders and every capture made a capture of TF's trace (by value,
           or by reference under its key), so variables stay variables

The inner graph already carries TF's automatic control dependencies as explicit
control edges, which the rewrite keeps.  What remains different from tf.function is
listed in docs/differences-from-tf-function.md (TF's own tests of tf.function are the
judge: tools/tf_function_suite.py).

Saving: ``tf.saved_model.save`` saves a StitchedFunction's ConcreteFunctions as it
saves a tf.function's (StitchedKernel nodes, their original ops as functions) and
ships the kernels' shared objects in ``assets/`` (kernel_assets.py).

Tiered execution, the default (``Options.background_compile`` None or True, as XLA's
``--tf_xla_async_compilation``): the first eager call with a new signature traces the
function for stock TF and returns its result while a background thread stitches the
same signature (plan, compile, rewrite); the first call after that thread finished
switches to the stitched graph (``_StockTier``: the report's ``tiering`` and a progress
line say at which call).  Where the result cache holds the signature's stitched graph
(tf/results.py: an earlier process built it), the first call runs it instead, through
a ``cached_only`` twin that traces the signature as the background would.
``wait()`` blocks until every pending signature is stitched; so do ``report``,
``get_concrete_function`` (TF's trace lock: the background trace holds it) and saving
(a SavedModel holds the stitched graphs).  A process that exits first does not wait:
its background compiles stop at their next step (compile/parallel.py: ``cancel``),
their kernels finished so far cached on disk.  ``stitching.keras.stitch`` runs Keras's
steps this way (keras.py).

Only an eager call whose arguments are all tensors (or dicts, lists and tuples of
them), by position or as named parameters, is tiered (``_tiers``): that call path
keeps one ConcreteFunction per exact signature, so the stock one can be swapped for
the stitched one between two calls.  Synchronous, the
call waiting for its kernels:
- a call inside another ``tf.function`` or graph trace (Keras's ``fit``, a caller's
  own tf.function): it is being traced, not run; the graph it goes into is built now
  and cannot switch later (keras.py tiers Keras's steps at the step function instead);
- under a ``tf.distribute`` strategy (its scope, ``strategy.run``): the strategy's
  replica context and per-replica values belong to the caller's thread, and a
  background thread would trace outside them;
- a call with Python arguments, or keywords of a function with ``*args``,
  ``**kwargs`` or keyword-only parameters: TF's own call path, whose cache TF owns (a
  Python value is also a constant of the trace: its own signature); keyword tensors of
  plain parameters are the positional call (``_keywords_as_positional``);
- ``get_concrete_function``, ``stitching-rewrite``, a stitched backward (traced inside
  the gradient's trace): each asks for the stitched graph itself.
The background compile of a signature stitches the trace stock TF made for its first
call (``_stock_trace``, ``_reused_trace``): the user's Python function is traced once
for it, as under ``tf.function``.  Only a relaxed signature (other shapes of the family
called while the first call ran, ``_start_background``) is traced there, running the
Python function once more, in that thread: Python state read at trace time is read
then, as any retrace of a ``tf.function`` reads it when it happens
(docs/differences-from-tf-function.md).  ``Options(background_compile=False)``
or ``STITCHING_BACKGROUND_COMPILE=0`` makes every call synchronous.

Shapes: a retrace costs a re-plan and a kernel lookup on top of TF's trace, so by
default (``reduce_retracing=None``) a function relaxes its input shapes the way
``tf.function(reduce_retracing=True)`` does: the first signature of a family (same
dtypes and ranks) is traced exactly; the second, different one is traced once with its
differing dims unknown (the kernels serve every size with one compiled code), and every
later size that fits is served by that trace with no tracing at all.
``reduce_retracing=False`` traces every shape exactly, as ``tf.function`` does by default.

Calls: after the first call (TF's: it creates and lifts variables), a call with only
eager tensors as positional arguments (or dicts, lists and tuples of them: ``_Key``)
goes straight to the ConcreteFunction traced for
exactly those dtypes and shapes (found once through TF's get_concrete_function, so
tracing and its errors are tf.function's), skipping tf.function's per-call argument
canonicalisation: measured here, a tf.function call of a small softmax took 230 µs
against 90 µs for its concrete function.  Any other call (Python values, keywords TF
must bind, symbolic tensors inside another trace) is TF's call.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import inspect
import os
import shutil
import sys
import tempfile
import threading
import time
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.autograph.impl.api import autograph_artifact
from tensorflow.python.eager.polymorphic_function import function_type_utils
from tensorflow.python.eager.polymorphic_function import polymorphic_function as tf_pf
from tensorflow.python.eager.polymorphic_function import tracing_compilation
from tensorflow.python.framework import func_graph as func_graph_module
from tensorflow.python.framework.ops import EagerTensor
from tensorflow.python.ops import control_flow_util
from tensorflow.python.util import tf_decorator

from ..options import DISABLED_NOTE, Options, background_compile_on, disabled
from . import control_flow, scalars
from .tfgraph import seeded_random_ops
from .passes import original

# The driver (pipeline.py: the passes, planner, schedules, compile layer: ~90 ms of
# imports) is imported at the first trace, not with the front door: under tiered
# execution that trace runs in a background thread, beside the user's stock steps.

FAST_CALL_SIGNATURES = 64      # exact (dtype, shape) signatures kept per function
HINT_SECONDS = 1.0             # arbitrary: a first call slower than this gets the hint


class StitchedFunction(tf_pf.Function):
    """What ``stitching.function`` returns: a ``tf.function`` (TF's own ``Function``
    class, so its argument binding, tracing, signatures, variables, gradients and
    saving are TF's) whose every trace is stitched.  Call it, save it and get its
    ConcreteFunctions as a ``tf.function``'s; ``python_function`` is the function
    given, so ``tf.function(f.python_function)`` is the same function under stock TF.

    Attributes:
        report: The latest trace's ``stitching.Report`` (None before the first call);
            waits for a pending background compile first.
        reports: Every trace's report, oldest first.
        options: The ``stitching.Options`` it plans with.
        background_errors: Exceptions raised by background compiles (tiered
            execution, ``Options.background_compile``); stock TF keeps serving
            those calls.
        cache_hits, cache_misses: Traces the result cache (a warm process's stitched
            graphs) served, or did not.
    """
    # How: TF traces the user's function through ``TracingOptions.python_function``;
    # here that callable is ``_StitchingTracer``, which traces the function alone into an
    # inner graph, stitches that graph and imports the result into TF's trace (module
    # docstring), so a trace has the user's parameter names, defaults and structured
    # signature.  ``cached_only`` (tiered execution's probe): stitch traces only from
    # the result cache; a trace it does not hold is imported as traced.

    def __init__(self, python_function, name=None, input_signature=None, autograph=True,
                 jit_compile=None, reduce_retracing=None, experimental_implements=None,
                 experimental_autograph_options=None, experimental_attributes=None, *,
                 options: Options | None = None):
        python_function, input_signature = _unwrap(python_function, input_signature,
                                                   jit_compile)
        # Calls that do not take the eager fast path keep tf.function's own rule (None
        # is false there): its reduce_retracing would relax a rank change to an unknown
        # rank, which no kernel can serve (only an explicit True asks for it).
        super().__init__(python_function, name or _short_name(python_function),
                         input_signature=input_signature, autograph=autograph,
                         jit_compile=jit_compile, reduce_retracing=reduce_retracing,
                         experimental_implements=experimental_implements,
                         experimental_autograph_options=experimental_autograph_options,
                         experimental_attributes=experimental_attributes)
        self._configure(options or Options(), reduce_retracing)
        tf_decorator.make_decorator(python_function, self, "stitching.function")
        # AutoGraph (converting a caller) must call this as it calls TF's Function, not
        # convert the call machinery below (TF's own is allowlisted by module)
        autograph_artifact(self)

    def _configure(self, options, reduce_retracing):
        """Stitching's own state (also for the bound copies ``__get__`` makes)."""
        self.options = options
        self._reports = []            # one per trace, oldest first
        self._reduce_retracing_setting = reduce_retracing
        # None: relax shapes (module docstring); a fixed input_signature leaves nothing to
        self._relax = self.input_signature is None and reduce_retracing is not False
        self._concrete = {}          # ((dtype, shape), ...) of eager args -> ConcreteFunction
        self._shapes = {}            # family ((dtype, rank), ...) -> shapes seen
        self._general = {}           # family -> [(relaxed shapes, ConcreteFunction)]
        self._pending = {}           # key -> background thread stitching it
        self._pending_lock = threading.Lock()
        self._first_calls = threading.RLock()  # a new signature's entry is made once
        self._templates = scalars.Templates()  # stitched traces by abstracted graph
        self.background_errors = []  # exceptions of background compiles (stock TF kept)
        self._eager_call = None      # (args, kwds) of the eager call tracing (the hint's)
        # a probe (tiered execution): traces stitch only from the result cache, and
        # are stock TF's graph where it holds nothing (keras.py, _stock_then_stitch)
        self.cached_only = False
        self.cache_hits = self.cache_misses = 0    # traces served / not by that cache
        self._probe = None           # the cached_only twin background compile probes
        self._stock = None           # the stock tf.function tiered signatures start on
        self._seeded_random = ()     # seeded random ops a tiered trace held (_stay_stock)
        self._plain = False          # its parameters' names if all plain, else None;
        #                              False: not read yet (_keywords_as_positional)

    # -- what TF traces ----------------------------------------------------------
    def _generate_tracing_options(self, fn, scope_type):
        options = super()._generate_tracing_options(fn, scope_type)
        return dataclasses.replace(
            options, python_function=_StitchingTracer(weakref.ref(self),
                                                      options.python_function, scope_type))

    def _clone(self, python_function):
        f = StitchedFunction(
            self._python_function if python_function is None else python_function,
            name=self._name, input_signature=self.input_signature,
            autograph=self._autograph, jit_compile=self._jit_compile,
            reduce_retracing=self._reduce_retracing_setting,
            experimental_attributes=self._attributes,
            experimental_autograph_options=self._experimental_autograph_options,
            options=self.options)
        if self._shared_rendezvous:
            f._shared_rendezvous = self._shared_rendezvous
        # tf.distribute's strategy.run calls a clone in place of this function
        # (mirrored_run): what the clone traces is this function's work, so its reports
        # are this one's too (Keras's test step under MirroredStrategy)
        f._reports = self._reports
        return f

    @property
    def report(self):
        """The latest trace's ``stitching.Report``; None before the first trace.
        Waits for pending background compiles first (tiered execution: the first
        call returned stock TF's result, and the report is the stitched graph's)."""
        self._settle()
        return self._reports[-1] if self._reports else None

    @property
    def reports(self) -> list:
        """Every trace's report, oldest first; waits for pending background compiles
        first, as ``report`` does (each of them traces once)."""
        self._settle()
        return self._reports

    def experimental_get_tracing_count(self):
        """TF's count of this function's traces, once pending background compiles
        (one trace each) are done, plus the traces the result cache served through
        the probe (``_probe_now``): a tiered call counts as tf.function's would.
        TF's own ``__call__`` reads it around each call (to warn of frequent
        retracing): there it does not wait, or every keyword call would wait for
        every pending compile (1.6 s where stock TF takes 1 ms)."""
        if not getattr(_calling, "on", False):
            self._settle()
        served = self._probe.cache_hits if self._probe is not None else 0
        return super().experimental_get_tracing_count() + served

    def _call(self, *args, **kwds):
        """TF's ``_call``, the arguments checked first.  TF's takes ``self._lock``
        and then binds the arguments; where that raises (a missing argument, a
        mistyped keyword: TF's TypeError) the lock is never released.  Stock TF has
        one thread and a reentrant lock, so nothing shows; here the next background
        compile of this function waits on that lock for ever (and ``wait()`` with
        it).  The same check, made before the lock, raises the same error."""
        function_type_utils.canonicalize_function_inputs(
            args, kwds, self._function_type, self._default_values, self._is_pure)
        return super()._call(*args, **kwds)

    def _list_all_concrete_functions(self):
        """TF's list of traces (saving, signatures), the pending ones done first."""
        self._settle()
        return super()._list_all_concrete_functions()

    def _settle(self) -> None:
        """Wait for pending background compiles, from any thread but theirs."""
        if self._pending and not _in_background():
            self.wait()

    def __get__(self, instance, owner):
        """Methods bind as tf.function's do (one Function per instance); the bound one
        stitches with this one's options."""
        try:
            fresh = instance is not None and instance not in self._descriptor_cache
        except TypeError:           # an unhashable composite tensor: TF binds it anew
            fresh = False
        bound = super().__get__(instance, owner)
        if fresh and isinstance(bound, StitchedFunction) and bound is not self:
            bound._configure(self.options, self._reduce_retracing_setting)
        return bound

    # -- saving -------------------------------------------------------------------
    def _trackable_children(self, save_type="checkpoint", **kwargs):
        """What ``tf.saved_model.save`` saves of this function: TF's (each traced
        ConcreteFunction, its StitchedKernel nodes and their original functions, which
        the op runs where its kernel cannot serve) and, as ``stitching_kernels``, the
        shared objects of those kernels for this machine, shipped in ``assets/`` as
        ``stitching-rewrite`` ships them (kernel_assets.py): a load on this CPU and
        toolchain compiles nothing."""
        if save_type == "savedmodel":
            self._settle()   # tiered signatures: save their stitched graphs, not none
        children = super()._trackable_children(save_type, **kwargs)
        if save_type == "savedmodel":
            cfs = list(children.values())
            assets = self._kernel_assets(cfs)
            if assets is not None:
                for cf in cfs:
                    _ship_with(cf, assets)
        return children

    def _kernel_assets(self, concrete_functions):
        """The KernelAssets resource for these functions' kernels (one per distinct
        set of specs, its files in a directory that lives as long as this function),
        or None where there is nothing to ship."""
        from .kernel_assets import export, kernel_assets_resource, specs_in
        specs = []
        for cf in concrete_functions:
            specs += [s for s in specs_in(cf.graph.as_graph_def()) if s not in specs]
        if not specs:
            return None
        cached = getattr(self, "_shipped", None)
        if cached is not None and cached[0] == specs:
            return cached[1]
        staging = tempfile.mkdtemp(prefix="stitching-kernels-")
        weakref.finalize(self, shutil.rmtree, staging, True)
        manifest, paths, sha = export(specs, staging)
        resource = None if manifest is None else kernel_assets_resource(manifest, paths, sha)
        self._shipped = (specs, resource)
        return resource

    def __getstate__(self):
        state = super().__getstate__()
        for transient in ("_pending_lock", "_first_calls", "_concrete", "_general",
                          "_pending", "_shapes", "_shipped", "_templates", "_probe",
                          "_stock"):
            state.pop(transient, None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._pending_lock, self._first_calls = threading.Lock(), threading.RLock()
        self._concrete, self._general, self._pending, self._shapes = {}, {}, {}, {}
        self._templates = scalars.Templates()
        self._probe = self._stock = None

    # -- calls ----------------------------------------------------------------------
    def __call__(self, *args, **kwds):
        if not tf.executing_eagerly() and _under_xla():
            # a caller XLA compiles (tf.function(jit_compile=True)): XLA has no kernel
            # for StitchedKernel and fuses the ops itself; a stitched trace cached for
            # this signature by an eager call must not be reused here
            return self._stock_function()(*args, **kwds)
        if kwds and tf.executing_eagerly():
            bound = self._keywords_as_positional(args, kwds)
            if bound is not None:
                args, kwds = bound, {}
        if not kwds:
            args = _arrays_as_tensors(args)
        if not kwds and self._fast_path_ready():
            key = _eager_key(args)
            if key is not None:
                cf = self._concrete.get(key)
                if cf is None and len(self._concrete) < FAST_CALL_SIGNATURES:
                    cf = self._first_call_of(key, args)
                if type(cf) is _StockTier:
                    return cf(args)
                if cf:
                    return _call_concrete(cf, _flat(args, key))
        first = self._variable_creation_config is None
        self._eager_call = (args, kwds) if tf.executing_eagerly() else None
        was, _calling.on = getattr(_calling, "on", False), True
        try:
            result = super().__call__(*args, **kwds)
        finally:
            self._eager_call = None
            _calling.on = was
        if first and not kwds:       # the first shape of its family, for relaxing later
            key = _eager_key(args)
            if key is not None:
                self._shapes.setdefault(_family(key), []).append([s for _, s in key])
        return result

    def _keywords_as_positional(self, args, kwds):
        """``args`` and then the keyword arguments in the parameters' order (``f(x,
        mask=m)`` as ``f(x, m)``: the fast path's call), where the Python function's
        parameters are all plain ones (no ``*args``, ``**kwargs``, keyword-only or
        positional-only) and each is given exactly once; else None, and TF's call path
        binds them (with its own errors for a missing or unknown argument)."""
        names = self._plain
        if names is False:           # the parameters, read once
            try:
                params = inspect.signature(self._python_function).parameters.values()
                plain = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
                names = tuple(p.name for p in params) if plain else None
            except (TypeError, ValueError):
                names = None
            self._plain = names
        if names is None or len(args) + len(kwds) != len(names):
            return None
        rest = names[len(args):]
        if set(rest) != set(kwds):
            return None
        return tuple(args) + tuple(kwds[n] for n in rest)

    def _first_call_of(self, key, args):
        """The fast path's entry for a new signature, made once: threads making its
        first calls at once each made one (a stock tier and a background compile
        apiece, the last one stored), and each told TF's retracing warning of a trace
        another thread made.  Only a trace this thread made is told."""
        with self._first_calls:
            cf = self._concrete.get(key)
            if cf is not None:
                return cf
            traced = getattr(_traces, "n", 0)
            self._eager_call = (args, {})
            try:
                cf = _flat_in(self._concrete_for(key, args), _flat(args, key))
            finally:
                self._eager_call = None
            self._concrete[key] = cf
        if getattr(_traces, "n", 0) != traced:
            tf_pf._frequent_tracing_detector_manager.called_with_tracing(
                self._key_for_call_stats, self._python_function,
                self._omit_frequent_tracing_warning)
        return cf

    def _fast_path_ready(self) -> bool:
        """The first call goes through TF (it creates and lifts variables); later ones
        may skip TF's argument canonicalisation when the function created no variables
        (else TF may have to run their initializers under a cond: its call does that).
        Tiered, the first call too: stock TF's tf.function serves it (a function
        creating variables makes them there, at that tf.function's first call, as
        tf.function does; the stitched trace later finds them made)."""
        if self._run_functions_eagerly:
            return False
        if self._tiers():
            return True
        return self._variable_creation_config is not None and not self._created_variables

    # -- shapes ---------------------------------------------------------------------
    def _concrete_for(self, key, args):
        """The ConcreteFunction a new exact signature runs: a relaxed trace that fits
        it, else a new trace (relaxed where an earlier shape of its family differs)."""
        family = _family(key)
        shapes = [shape for _, shape in key]
        for general, cf in self._general.get(family, ()):
            if all(_fits(g, s) for g, s in zip(general, shapes)):
                return cf
        seen = self._shapes.setdefault(family, [])
        relaxed = _relaxed(seen + [shapes]) if self._relax and seen else None
        seen.append(shapes)
        if self._tiers():
            return self._stock_then_stitch(key, args, family, relaxed)
        if relaxed is None:
            return self.get_concrete_function(*args)
        cf = self.get_concrete_function(*tensor_specs(key, relaxed))
        self._general.setdefault(family, []).append((relaxed, cf))
        return cf

    # -- tiered execution ------------------------------------------------------------
    def _tiers(self) -> bool:
        """Whether an eager call of a new signature (the fast path's: tensors only,
        positional) runs stock TF while the signature compiles in the background:
        asked for (``Options.background_compile``, ``$STITCHING_BACKGROUND_COMPILE``)
        and not under a ``tf.distribute`` strategy, whose replica context a
        background thread would trace outside of (module docstring), nor once a
        trace held seeded random ops (``_stay_stock``)."""
        return background_compile_on(self.options) and not tf.distribute.has_strategy() \
            and not self._seeded_random and not disabled()

    def _stock_then_stitch(self, key, args, family=None, relaxed=None):
        """What a new tiered signature runs now: stock TF (``_stock_function``) behind
        a ``_StockTier``, which starts a background thread stitching the signature
        (traced with ``relaxed`` shapes when given) once its first call returned, and
        switches to the stitched graph at the first call after that thread built it
        -- or the stitched one at once, where the result cache holds it (a warm
        process: ``_probe_now``) and the function ran before.  Its first call never
        probes: a trace there (the probe's, through ``get_concrete_function``) would
        make the function's variables, and one whose initializer reads an argument
        cannot be made that way (TF's call runs it under a cond; so does the stock
        tf.function's first call).  The background trace after it finds the result
        cache's graph as quickly: a warm first signature switches at its second call."""
        specs = tensor_specs(key, relaxed)
        general = (family, relaxed) if relaxed is not None else None
        ran = self._stock is not None and self._stock._variable_creation_config is not None
        # under an input_signature every call shares one trace, which the first
        # signature's background compile makes (or has made): the probe would trace a
        # twin of it (a trace TF never makes, counted by experimental_get_tracing_count),
        # and this signature's background trace gets that one trace from TF
        shared = self.input_signature is not None
        cf, warm = self._probe_now(specs) if ran and not shared else (None, False)
        if warm:
            if general is not None:
                self._general.setdefault(family, []).append((relaxed, cf))
            if self._reports:
                self._reports[-1].tiering = ("stitched from call 1 (graph, plan and "
                                            "kernels from the cache; nothing to compile)")
            return cf
        tier = _StockTier(self, key, self._stock_function())
        tier.start = functools.partial(self._start_background, tier, specs, general)
        return tier

    def _stock_function(self):
        """The stock ``tf.function`` of the same Python function and parameters, made
        once: tiered signatures run their stock calls through TF's own call path,
        which makes the function's variables at its first call (lifting their
        initializers, or running them under a cond where an initializer depends on
        the arguments), checks arguments against an ``input_signature`` and relaxes
        shapes under ``reduce_retracing=True``, as ``tf.function`` does."""
        if self._stock is None:
            self._stock = tf.function(
                self._python_function, input_signature=self.input_signature,
                autograph=self._autograph,
                reduce_retracing=bool(self._reduce_retracing_setting),
                experimental_attributes=self._attributes,
                experimental_autograph_options=self._experimental_autograph_options)
        return self._stock

    def _start_background(self, tier, specs, general):
        if general is None and self._relax:
            # other shapes of its family were called while its first stock call ran
            # (concurrent requests of several batch sizes): the relaxed trace they
            # compile serves this one too.  Its own exact trace would take TF's lock
            # first, and theirs would wait for it: the serving audit's batch sizes 1-3
            # ran stock for 56 s against 26 s for the first one.
            family = _family(tier.key)
            with self._first_calls:
                seen = list(self._shapes.get(family, ()))
            if len(seen) > 1:
                relaxed = _relaxed(seen)
                specs, general = tensor_specs(tier.key, relaxed), (family, relaxed)
        with self._pending_lock:
            self._pending[tier.key] = run_in_background(self._stitch_in_background, tier,
                                                        specs, general)

    def _probe_now(self, specs):
        """(ConcreteFunction, stitched?) of a ``cached_only`` twin traced for ``specs``
        as the background compile traces them (so with the graph its result is kept
        under): stitched where the result cache holds that graph, else stock TF's
        graph; (None, False) where no result was stored for this signature (the probe
        would miss)."""
        from . import results
        hint = self._hint(specs)
        if not results.probed(hint):
            return None, False
        if self._probe is None:
            self._probe = self._clone(None)
            self._probe.cached_only = True
        hits, misses = self._probe.cache_hits, self._probe.cache_misses
        cf = self._probe.get_concrete_function(*specs)
        # the probe, a clone, shares this function's reports: a hit's is there already
        warm = self._probe.cache_hits > hits and self._probe.cache_misses == misses
        return cf, warm

    def _hint(self, specs) -> str:
        """This signature's ``results.hint``: the function's name, the specs, the
        options (a probe is worth tracing only where one was marked)."""
        from . import results
        return results.hint(display_name(self), repr(specs), repr(self.options))

    def _stitch_in_background(self, tier, specs, general=None):
        from . import results
        try:
            # the trace stock TF made for the first call is the user's function traced
            # once for these shapes: the stitched trace reuses it (_stitched_trace)
            # rather than run the Python function a second time; a relaxed trace
            # (``general``) is of other shapes and traces
            _REUSE.trace = None if general is not None else (self, self._stock_trace(tier))
            try:
                cf = self.get_concrete_function(*specs)
            finally:
                _REUSE.trace = None
            # its trace's report, and whether the result cache served it (nothing
            # planned or compiled); a trace another signature's compile made is
            # found as TF cached it
            tier.report, tier.from_cache = getattr(cf.graph, "_stitching_made",
                                                   (None, False))
            seeded = seeded_random_ops(cf.graph.as_graph_def())
            if seeded:
                self._stay_stock(tier, seeded)
                return
            if general is not None:
                # before the hint and the warm-up: a new batch size of the family
                # called meanwhile runs this trace, where it would probe the result
                # cache (the hint says it holds this graph) and trace a twin
                family, relaxed = general
                self._general.setdefault(family, []).append((relaxed, cf))
            results.mark_if_held(self._hint(specs), tier.from_cache, tier.report)
            _warm_up(cf, tier)
            tier.stitched = cf                  # the next call through it switches
        except Exception as e:  # noqa: BLE001 — the stock graph keeps serving this key
            self.background_errors.append(e)
        finally:
            with self._pending_lock:
                self._pending.pop(tier.key, None)

    def _stock_trace(self, tier):
        """The ConcreteFunction stock TF ran ``tier``'s first call with, from its
        function cache (None where that call's arguments are gone).  TF looks it up
        for the same arguments; where it would not find it (a function whose
        variables' initializers could not be lifted traced it inside a cond), this
        traces it as a second trace would have."""
        if tier.args is None:
            return None
        try:
            return self._stock.get_concrete_function(*tier.args)
        except Exception:  # noqa: BLE001 — the stitched trace traces the function itself
            return None

    def _stay_stock(self, tier, seeded) -> None:
        """A signature whose graph holds seeded stateful random ops keeps its stock
        graph: each such op draws its sequence from its own state, which starts at
        the seed, so the stitched graph's would repeat the numbers the stock calls
        drew (a dropout mask, call after call).  The function's later signatures
        wait for their kernels at their first call instead (not tiered)."""
        self._seeded_random = seeded
        text = (f"stock TF serves this signature: its graph {seeded_reason(seeded, 'graph')}"
                f"; its later signatures compile at their first call "
                f"(Options(background_compile=False) stitches from call 1)")
        if tier.report is not None:
            tier.report.tiering = text
        if self.options.progress is not False:
            print(f"stitching: {display_name(self)} {_signature_text(tier.key)}: {text}",
                  file=sys.stderr, flush=True)

    def _switched(self, tier) -> None:
        """The first call of ``tier``'s signature on its stitched graph: from now on
        the fast path calls that graph directly; the report and a progress line say
        where the switch was."""
        seconds = time.perf_counter() - tier.started
        calls = span_text("call", tier.calls)
        doing = ("the stitched graph was traced and loaded from the cache"
                 if tier.from_cache else "the kernels compiled")
        text = (f"stock TF ran {calls} while {doing} ({seconds:.1f} s); stitched from "
                f"call {tier.calls + 1}")
        self._concrete[tier.key] = tier.stitched      # one dict store: calls see either
        if tier.report is not None:
            tier.report.tiering = text
        if self.options.progress is not False:
            print(f"stitching: {display_name(self)} {_signature_text(tier.key)}: {text}",
                  file=sys.stderr, flush=True)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until background compiles are done and the kernels run their
        optimized code (or ``timeout`` seconds passed); True when nothing is pending
        and none failed.  A synchronous first call's kernels start on quick tier-1
        code whose tier 2 compiles behind it (docs/tuning.md): this waits for those
        upgrades too, so the calls after it run the steady state's code."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._pending_lock:
            threads = list(self._pending.values())
        for t in threads:
            t.join(seconds_left(deadline))
        for tier in list(self._concrete.values()):
            if isinstance(tier, _StockTier) and tier.stitched is not None \
                    and tier.report is not None and not tier.report.tiering:
                # ready, not yet called: the report says so until the switch says where
                calls = span_text("call", tier.calls)
                tier.report.tiering = (f"stock TF ran {calls}; the stitched graph is "
                                       f"ready and runs from the next call")
        upgraded = wait_tier2(seconds_left(deadline))
        with self._pending_lock:
            return not self._pending and not self.background_errors and upgraded

    # -- tracing ------------------------------------------------------------
    def _throwaway(self, scope_type) -> bool:
        """Whether the trace just made is TF's variable-creating first trace of a
        function that did create variables.  TF never calls that trace in the usual
        way: it lifts the new variables' initializers out and calls the trace it makes
        next, without variable creation (polymorphic_function.Function._call; where
        lifting fails, the first trace runs once, to initialize, as stock TF).  Keras's
        train step is such a function (its first trace builds the optimizer's and the
        metrics' state): stitching that trace planned, compiled and loaded kernels no
        call ever ran (a warm MLP fit, measured: 0.21 s of its 0.64 s of stitching,
        before the control-flow bodies of that trace's variable initializers)."""
        return (scope_type is tracing_compilation.ScopeType.VARIABLE_CREATION
                and bool(self._created_variables))

    def _stitch(self, graph_def, fetches, keep, graph, flat, workers):
        """One inner trace's stitched result (``.graph_def``, ``.report``): the result
        cache's where it holds one (results.py), else the pipeline's, stored for the
        next process; None for a ``cached_only`` function that missed (its trace
        then imports the graph as traced: stock TF).  Closes ``workers``."""
        from . import results
        from .tfgraph import annotate_live_shapes, resource_shapes
        resources = resource_shapes(graph)
        annotate_live_shapes(graph_def, graph)
        scalar_values = _python_scalars(flat)
        key = None
        # A new Python scalar of a function stitched before: its template serves it in
        # ~1 ms (tf/scalars.py); the result cache is skipped, never probed or written
        # per value (hashing, probing and storing the graph cost 1-3 ms on each).
        if self.cached_only or not (scalar_values and len(self._templates)):
            key = results.key(graph_def, fetches, keep, self.options, resources, True,
                              scalar_values)
            hit = results.probe(key, graph_def)
            if hit is not None or self.cached_only:
                if workers is not None:
                    workers.close()
                self.cache_hits += hit is not None
                self.cache_misses += hit is None
                return hit
        from . import pipeline
        return pipeline.stitch_graph_def(
            graph_def, fetches, keep, self.options, name=display_name(self),
            resources=resources, workers=workers, scalar_values=scalar_values,
            templates=self._templates, result_key=key,
            signature=_traced_signature_text(flat))

    def _stitched_trace(self, fn, args, kwargs, scope_type=None):
        """Inside TF's trace (the outer graph): trace ``fn`` (the user's function, as TF
        would call it: autograph-converted, under its variable scope) alone, stitch that
        graph, import the result here; returns ``fn``'s structured outputs.

        A first trace that creates variables is not stitched (``_throwaway``): it is a
        call of the inner trace.  Inside a function XLA compiles (a caller's
        ``tf.function(jit_compile=True)``) nothing is stitched either: XLA cannot run a
        StitchedKernel and fuses the ops itself, so they are traced here as they are."""
        _traces.n = getattr(_traces, "n", 0) + 1
        if _under_xla():             # get_concrete_function inside such a caller
            return fn(*args, **kwargs)
        if disabled():               # $STITCHING_DISABLE: a trace as tf.function's
            from ..report import Report
            self._reports.append(Report(function=display_name(self), notes=[DISABLED_NOTE]))
            return fn(*args, **kwargs)
        structure = (args, kwargs)
        flat = tf.nest.flatten(structure, expand_composites=True)
        where = [i for i, v in enumerate(flat) if isinstance(v, tf.Tensor)]
        # named as TF named the outer trace's placeholders: the user's parameter names
        # in the inner graph too (dumps, TF's errors)
        specs = [tf.TensorSpec(flat[i].shape, flat[i].dtype,
                               name=flat[i].op.name if flat[i].op.type == "Placeholder"
                               else None) for i in where]

        def inner(*tensors):
            vals = list(flat)
            for i, t in zip(where, tensors):
                vals[i] = t
            a, k = tf.nest.pack_sequence_as(structure, vals, expand_composites=True)
            before = tf.nest.pack_sequence_as(structure, tf.nest.flatten(
                (a, k), expand_composites=True), expand_composites=True)
            out = fn(*a, **k)
            # TF's own check, on the arguments the user's function saw (the outer
            # trace's check sees only the ones TF passed here, never modified)
            func_graph_module.check_func_mutation(*before, a, k, fn)
            return out
        # TF's trace-time errors name the function they trace ("in compilation of
        # <function f ...>"): the user's, not this closure (no __wrapped__: TF would
        # read the user's parameters off it, where this takes flat tensors)
        for attr in ("__name__", "__qualname__", "__module__"):
            if isinstance(getattr(fn, attr, None), str):
                setattr(inner, attr, getattr(fn, attr))

        # a compile worker warming up while TF traces; not behind a background
        # compile, where stock TF's first call is running and needs the cores, nor
        # once this function has compiled kernels (the cache is not empty: a retrace,
        # a new Python scalar, does not pay for looking), nor for a probe
        from ..compile import kernel as kernel_cache
        _check_cancelled()     # a background compile stopped at exit traces nothing more
        last = self._reports[-1] if self._reports else None    # not .report: it waits
        compiled = last is not None and (last.kernels or any(
            r is not None and r.kernels for _, r, _ in last.bodies))
        workers = None
        if not (_in_background() or compiled or self.cached_only) \
                and kernel_cache.cache_is_empty():
            from . import pipeline
            workers = pipeline.early_workers()
        try:
            cf = _reused_trace(self, specs)
            if cf is None:
                with _arguments_unwatched(flat):
                    cf = tracing_compilation.trace_function(
                        specs, {}, tracing_compilation.TracingOptions(
                            inner, self._name, autograph=self._autograph,
                            autograph_options=self._experimental_autograph_options))
            fetches = [t.name for t in cf.outputs]
            keep = [op.name for op in cf.graph.control_outputs]
            throwaway = self._throwaway(scope_type)
            if throwaway and not cf.graph.function_captures.by_ref_internal:
                # TF runs this trace only where lifting its variables' initializers
                # fails (then once, to initialize them): a call of the inner trace
                # serves that as well as a copy of its ops, without the GraphDef out
                # and back in and the outer trace's control dependencies over every
                # op again (a warm MLP fit's first train trace: ~85 ms of CPU).  A
                # by-reference capture keeps the import below: a call would read its
                # value here, at trace time, not at each call.
                return _call_concrete(cf, [flat[i] for i in where])
            graph_def = cf.graph.as_graph_def()
            _captures_as_placeholders(graph_def, cf)
            calls_functions = bool(graph_def.library.function)
            stitch = bool(fetches or keep) and not throwaway
            result = None
            if stitch:
                workers, used = None, workers       # _stitch uses or closes them
                result = self._stitch(graph_def, fetches, keep, cf.graph, flat, used)
        except BaseException:
            if workers is not None:         # the trace raised: none for later traces
                from . import pipeline
                pipeline.early_worker_unused()
            raise
        finally:
            if workers is not None:
                workers.close()
        if result is not None:
            self._reports.append(result.report)
            # the report of this trace, found with it (_stitch_in_background): the
            # newest report may be another signature's, traced meanwhile
            from .results import Stored
            tf.compat.v1.get_default_graph()._stitching_made = (
                result.report, isinstance(result, Stored))
            # only where tiering would apply but did not: an eager call through TF's
            # call path (keyword, Python or NumPy arguments), not inside Keras's fit
            # or another tf.function, not get_concrete_function or stitching-rewrite,
            # nor a call of tf.distribute's values (PerReplica: a call a strategy
            # shards), which no call of this function could tier
            if self._eager_call is not None and not _in_background() and self._tiers() \
                    and not _distributed_values(*self._eager_call):
                _hint_background_compile(result.report.compile_seconds)
            graph_def = result.graph_def
            _define_fallbacks(graph_def)
        outer = tf.compat.v1.get_default_graph()
        # The inner trace's ConcreteFunction keeps the functions its graph calls (tf.cond
        # branches, loop bodies) registered with the runtime, where the imported copy
        # finds them when TF's trace is called inside another function: it lives as
        # long as TF's trace does.  A graph calling none is dropped after the import:
        # its FuncGraph is the whole step over again (EfficientNetB0's train step at
        # 96x96: +291 MiB of RSS while traced, held for the model's life).
        if calls_functions:
            outer._stitching_inner_traces = \
                getattr(outer, "_stitching_inner_traces", []) + [cf]
        input_map = _input_map(cf, [flat[i] for i in where], outer, graph_def)
        return_elements = fetches + keep
        outs = tf.graph_util.import_graph_def(
            graph_def, input_map=input_map, return_elements=return_elements,
            name="stitched") if return_elements else []
        tensors = outs[:len(fetches)]
        if keep and tensors:   # stateful ops with no data output: run them first
            with tf.control_dependencies(outs[len(fetches):]):
                tensors = [tf.identity(t) for t in tensors]
        return _pack_outputs(cf.structured_outputs, tensors)


_REUSE = threading.local()   # .trace: (function, ConcreteFunction) a background trace reuses


def _reused_trace(owner, specs):
    """The stock trace ``owner``'s background compile handed this thread
    (``_stitch_in_background``), once, where its inputs are exactly ``specs``; else
    None (the user's function is traced)."""
    held = getattr(_REUSE, "trace", None)
    if held is None or held[0] is not owner or held[1] is None:
        return None
    _REUSE.trace = None
    cf = held[1]
    inputs = cf.inputs[:_n_arguments(cf)]
    specs = tf.nest.flatten(specs)
    if len(inputs) != len(specs) or any(
            t.dtype != s.dtype or t.shape.rank != s.shape.rank or (
                t.shape.rank is not None and t.shape.as_list() != s.shape.as_list())
            for t, s in zip(inputs, specs)):
        return None
    # the variables the user's function read, as its trace here would have marked
    # them (FuncGraph.watch_variable): a GradientTape around a call watches them
    outer = tf.compat.v1.get_default_graph()
    for v in cf.graph.variables:
        outer.watch_variable(v)
    return cf


@contextlib.contextmanager
def _arguments_unwatched(flat):
    """The inner trace reads a tf.Variable argument of the outer trace as a variable,
    and FuncGraph.watch_variable marks it in every enclosing graph: TF's own trace
    marks none of its variable arguments (watch_variable skips its resource inputs).
    A marked one lands, weakly, in the outer ConcreteFunction's ``variables``, which a
    GradientTape asks for at every call: once the first call's variable was deleted,
    every later call under a tape failed ("referencing variables which have been
    deleted").  This unmarks the variable arguments the inner trace marked."""
    variables = [v for v in flat if isinstance(v, tf.Variable)]
    graphs = []
    g = tf.compat.v1.get_default_graph()
    while variables and isinstance(g, func_graph_module.FuncGraph):
        graphs.append((g, [v for v in variables if v not in g._watched_variables]))
        g = g.outer_graph
    try:
        yield
    finally:
        for g, unwatched in graphs:
            for v in unwatched:
                g._watched_variables.discard(v)


def _ship_with(cf, assets) -> None:
    """Makes ``assets`` a child of the ConcreteFunction ``cf`` in a SavedModel's object
    graph (a tf.function's own children can only be its ConcreteFunctions; a
    ConcreteFunction's are its captures, by name, and any other object)."""
    if getattr(cf, "_stitching_assets", None) is assets:
        return
    cf._stitching_assets = assets
    tf_children = type(cf)._trackable_children.__get__(cf)

    def children(save_type="checkpoint", **kwargs):
        out = tf_children(save_type, **kwargs)
        if save_type == "savedmodel":
            out["stitching_kernels"] = assets
        return out
    cf._trackable_children = children


class _StitchingTracer:
    """What TF's trace calls in place of the user's function (see StitchedFunction).
    It holds its StitchedFunction weakly, as TF's own wrappers do, so a deleted
    function is freed without the garbage collector."""

    def __init__(self, owner_ref, fn, scope_type=None):
        self._owner = owner_ref
        self._fn = fn
        self._scope_type = scope_type
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args, **kwargs):
        owner = self._owner()
        if owner is None:
            raise RuntimeError("stitching.function: traced after its function was deleted")
        return owner._stitched_trace(self._fn, args, kwargs, self._scope_type)


def _python_scalars(values) -> frozenset:
    """The Python numbers among a trace's arguments (TF traces each as a constant;
    the pipeline plans those constants as inputs: one stitched graph and one compiled
    kernel for every value, tf/scalars.py)."""
    return frozenset(float(v) for v in values
                     if isinstance(v, (int, float)) and not isinstance(v, bool))


def _pack_outputs(structured, tensors):
    """``structured`` (an inner trace's structured outputs: tensors, composites, None)
    with its tensor leaves, in flattening order, replaced by ``tensors``."""
    flat = tf.nest.flatten(structured, expand_composites=True)
    it = iter(tensors)
    flat = [next(it) if isinstance(v, tf.Tensor) else v for v in flat]
    return tf.nest.pack_sequence_as(structured, flat, expand_composites=True)


def _short_name(fn) -> str:
    """TF's name for a function (its ConcreteFunctions are ``__inference_<name>_N``)."""
    inner = _innermost(fn)
    return getattr(inner, "__name__", None) or type(inner).__name__


def _innermost(fn):
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__func__", fn)


def display_name(fn) -> str:
    """The user's name for a function in reports, hints and dumps: its qualified name
    (``Model.call``, ``train_step``), through partials and bound methods, from the
    innermost enclosing function on (Keras's replicated step is ``one_step_on_data``,
    not ``_ReplicatedStep.__init__.<locals>.one_step_on_data``, a dump directory
    name with angle brackets); ``<lambda>`` only where nothing better exists."""
    if isinstance(fn, tf_pf.Function):
        fn = fn.python_function
    while True:
        inner = getattr(fn, "__wrapped__", None)
        if inner is None or inner is fn:
            break
        fn = inner
    fn = _innermost(fn)
    qualname, name = getattr(fn, "__qualname__", None), getattr(fn, "__name__", None)
    if qualname and name and qualname.rsplit(".", 1)[-1] != name:
        return name                   # renamed on purpose (a generated function)
    return (qualname or _short_name(fn)).rsplit(".<locals>.", 1)[-1]


def _under_xla() -> bool:
    """Whether the graph being built is compiled by XLA (it or a graph it is built
    in: a caller's tf.function(jit_compile=True))."""
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def _distributed_values(args, kwds) -> bool:
    """Whether an argument is a tf.distribute value (PerReplica, Mirrored...)."""
    from tensorflow.python.distribute import values as dist_values
    return any(isinstance(a, dist_values.DistributedValues)
               for a in tf.nest.flatten((args, kwds), expand_composites=False))


def _define_fallbacks(graph_def):
    """The regions' original functions (``stitching_original_<hash>``), defined in the
    eager context for the rest of the process, and ``graph_def``'s copies made those.

    Kernel nodes run them (``guard``: a call the kernel was not built for;
    ``fallback``: where a kernel cannot be built) through the runtime's function
    library, which the rewritten graph's library does not reach once it is imported
    into the caller's trace ("Function stitching_original_... is not defined").  A
    gradient through a kernel node of a nested function (a stitched function called by
    another, inlined there by Grappler) looks its original up in the eager context
    (original.py).  A function rebuilt from a saved FunctionDef finds them there too.

    Names are hashes of the original bodies, but Grappler, optimizing a graph that
    calls a stitched function, rewrites the bodies of the library functions it keeps
    (an Identity bypassed) under the same name; two definitions of one name cannot
    meet in one graph.  So the first definition of a name is the one: the context's.
    Stitched control-flow functions (tf/control_flow.py) are defined the same way: the
    runtime resolves a lowered loop's body by name."""
    from tensorflow.python.eager import context
    ctx = context.context()
    for fdef in graph_def.library.function:
        name = fdef.signature.name
        if not name.startswith(original.PREFIX) and not control_flow.is_stitched(name):
            continue
        defined = _DEFINED.get(name)
        if defined is not None and ctx.has_function(name):
            # ours, still there: no copy out of the runtime and back (a loop's
            # original region, each new Python scalar: 0.1 ms)
            fdef.CopyFrom(defined)
            continue
        if ctx.has_function(name):
            fdef.CopyFrom(ctx.get_function_def(name))
        ctx.add_function_def(fdef)      # a reference of our own: never removed
        _DEFINED[name] = type(fdef)()
        _DEFINED[name].CopyFrom(fdef)


_DEFINED: dict = {}     # name -> the FunctionDef _define_fallbacks defined under it


def _input_map(cf, args, outer, graph_def):
    """Every placeholder of the inner trace that ``graph_def`` (the rewritten graph)
    still holds -> the outer trace's tensor that feeds it.

    A ConcreteFunction's inputs are its arguments followed by its captures: by value
    (eager tensors, variable handles, tensors of enclosing graphs) and by reference
    (``capture_call_time_value``: a closure evaluated at each call, e.g.
    MirroredStrategy's collective keys).  Each becomes the same kind of capture of the
    outer trace, as the user's function traced there directly would have made it:
    every one, also where the rewritten graph no longer reads it (Grappler folded a
    captured constant into its consumers), so the outer ConcreteFunction's captures
    are tf.function's (``replace_capture``, ``captured_inputs``).  A by-reference
    capture keeps its key and closure, so it stays a call-time value.

    An entry for a placeholder the rewritten graph no longer holds is left out:
    import_graph_def refuses a map entry for a node that is not there."""
    captures = cf.graph.function_captures
    n_args = _n_arguments(cf)
    if n_args != len(args):
        raise RuntimeError(
            f"stitching.function: the traced function has {len(cf.inputs)} inputs but "
            f"{len(args)} arguments and {len(cf.inputs) - n_args} captures; refusing to "
            "import a graph with an unfed placeholder")
    pairs = list(zip(cf.inputs[:n_args], args))
    pairs += [(internal, outer.capture(external))
              for external, internal in captures.by_val_capture_tuples]
    outer_captures = outer.function_captures
    for key, internal in captures.by_ref_internal.items():
        if key not in outer_captures.by_ref_internal:
            from tensorflow.core.function.trace_type import InternalPlaceholderContext
            tracetype = captures.by_ref_tracetype[key]
            outer_captures.add_or_replace(
                key=key, external=captures.by_ref_external[key],
                internal=tracetype.placeholder_value(InternalPlaceholderContext(outer)),
                tracetype=tracetype, is_by_ref=True)
        pairs += zip(tf.nest.flatten(internal, expand_composites=True),
                     tf.nest.flatten(outer_captures.by_ref_internal[key],
                                     expand_composites=True))
    present = {n.name for n in graph_def.node}
    return {ph.name: v for ph, v in pairs if ph.op.name in present}


def _captures_as_placeholders(graph_def, cf) -> None:
    """Turn the inner trace's by-value captures that TF wrote as ``Const`` nodes back
    into Placeholders, in place.

    TF's FuncGraph captures a small eager tensor (at most 128 elements) as a Const op
    holding its value, and still lists it among the ConcreteFunction's inputs: in the
    FunctionDef TF runs it becomes an argument, fed the captured tensor at each call, so
    stock TF's Grappler never folds it.  Left a Const in the GraphDef we plan, our
    Grappler pass would fold it into its consumers (``x + y + z`` of three captured
    scalars becomes one constant), and ``replace_capture`` or
    ``replace_capture_with_deferred_capture`` on the traced function would no longer
    change what it computes.  As Placeholders they are fed like every capture
    (``_input_map``), and a stitched result no longer depends on the captured values."""
    consts = {internal.op.name for _, internal in
              cf.graph.function_captures.by_val_capture_tuples
              if internal.op.type == "Const"}
    if not consts:
        return
    for node in graph_def.node:
        if node.name in consts and node.op == "Const":
            shape = node.attr["value"].tensor.tensor_shape
            node.op = "Placeholder"
            del node.attr["value"]
            node.attr["shape"].shape.CopyFrom(shape)


def _n_arguments(cf) -> int:
    """How many of a ConcreteFunction's inputs are its arguments: the rest are its
    captures, by value and by reference (counted, never evaluated: a by-reference
    capture is a closure called at each call)."""
    captures = cf.graph.function_captures
    return len(cf.inputs) - len(captures.by_val_capture_tuples) - len(
        tf.nest.flatten(list(captures.by_ref_internal.values()), expand_composites=True))


_BACKWARDS: dict = {}            # (region function, outputs differentiated) -> function


def _backward_function(key, make, options=None):
    """The stitched backward of one kind of region (tf/passes/original.py asks, on a gradient
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

_BACKGROUND = set()              # threads of running background compiles
_BACKGROUND_LOCK = threading.Lock()
_BACKGROUND_STARTED = False      # whether run_in_background was ever called here
EXIT_WAIT_SECONDS = 5.0          # arbitrary: a cancelled compile stops within ~0.5 s


def run_in_background(target, *args) -> threading.Thread:
    """``target(*args)`` on a daemon thread, as a background compile
    (``compile.parallel.background``: its kernels compile in lower-priority worker
    processes); the interpreter's exit cancels it (``_stop_background_compiles``)."""
    from ..compile import parallel

    def run():
        try:
            with parallel.background():
                target(*args)
        finally:
            with _BACKGROUND_LOCK:
                _BACKGROUND.discard(thread)

    global _BACKGROUND_STARTED
    thread = threading.Thread(target=run, name="stitching-compile", daemon=True)
    with _BACKGROUND_LOCK:
        _BACKGROUND.add(thread)
        _BACKGROUND_STARTED = True
    thread.start()
    return thread


def _check_cancelled() -> None:
    """``parallel.check_cancelled`` where a background compile ever ran here (else
    nothing can be cancelled, and compile.parallel need not be imported: ~60 ms)."""
    if _BACKGROUND_STARTED:
        from ..compile.parallel import check_cancelled
        check_cancelled()


def seeded_reason(seeded, stitched: str) -> str:
    """Why a tiered signature (or Keras step) holding the seeded random ops
    ``seeded`` never switches to its ``stitched`` twin (``_stay_stock``)."""
    return (f"holds seeded random ops ({', '.join(seeded)}), whose numbers would start "
            f"again from the seed on a switch to the stitched {stitched}")


def wait_tier2(timeout: float | None = None) -> bool:
    """Wait for the tier-2 compiles behind this process's tier-1 kernels
    (``parallel.wait_upgrades``); True at once where compile.parallel was never
    imported (no kernel was compiled here, so none can be upgrading)."""
    parallel = sys.modules.get("stitching.compile.parallel")
    return True if parallel is None else parallel.wait_upgrades(timeout)


def seconds_left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


_calling = threading.local()    # .on: inside TF's __call__ (experimental_get_tracing_count)
_traces = threading.local()     # .n: traces this thread made (TF's retracing warning)


@atexit.register
def _stop_background_compiles():
    """A short job that ends while its kernels still compile exits promptly: each
    background compile stops at its next step (parallel.cancel: its workers are
    killed; kernels they finished are in the disk cache for the next process).  The
    threads are then waited for, briefly, so none is inside TF's graph building or
    Numba while the interpreter tears them down."""
    with _BACKGROUND_LOCK:
        threads = list(_BACKGROUND)
    if not threads:
        return
    from ..compile import parallel
    parallel.cancel()
    deadline = time.monotonic() + EXIT_WAIT_SECONDS
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


def _in_background() -> bool:
    """Whether this thread is a background compile's (run_in_background)."""
    return threading.current_thread() in _BACKGROUND


class _StockTier:
    """A tiered signature's fast-path entry (``_concrete[key]``) until its first
    stitched call: stock TF's ``tf.function``, counting the calls it serves, until
    the background compile sets ``stitched``; the call after that switches
    (``StitchedFunction._switched``) and replaces this entry by the stitched graph,
    called directly from then on.  A first call that raises (an argument the
    ``input_signature`` refuses, a failing assertion) leaves no entry and starts no
    compile: the next call is a first call again.

    The background compile starts (``start``) when the first stock call returned, not
    before: that call (TF's function instantiation, its Grappler pass, the run) then
    has the cores and the interpreter to itself.  With the compile started beside it
    (a trace, a plan, compile workers), ResNet50's first call took 9.2 s against stock
    TF's 3.1 s in one loaded run of the compile suite (BENCHMARKS.md); the kernels
    are ready that one call later.  Stock calls go through TF's call path (~0.1 ms
    more per call than the fast path): they are the few before the switch."""

    def __init__(self, owner, key, stock):
        # weakly: the function holds this entry (a cycle would outlive ``del f``)
        self._owner, self.key, self.stock = weakref.ref(owner), key, stock
        self.started = time.perf_counter()
        self.calls = 0
        self.stitched = self.report = self.start = None
        self.from_cache = False     # the background trace found its result cached
        self.args = None            # the first call's, for the warm-up run (_warm_up)

    def __call__(self, args):
        if self.stitched is None:
            if self.start is None:
                self.calls += 1
                return self.stock(*args)
            try:
                out = self.stock(*args)
            except BaseException:
                self._owner()._concrete.pop(self.key, None)
                raise
            start, self.start = self.start, None    # once, also where calls race
            self.calls += 1
            if start is not None:
                self.args = args
                start()
            return out
        owner = self._owner()
        flat = _flat(args, self.key)
        if not _flat_in(self.stitched, flat):     # a default tensor argument: TF's call
            owner._concrete[self.key] = False
            return owner(*args)
        owner._switched(self)
        return _call_concrete(self.stitched, flat)


# Stateful op types a run repeats without a trace: reading variables, the kernels
# themselves (profiling counters, autotune timings), asserts and no-ops
_REPEATABLE = frozenset({"ReadVariableOp", "VarHandleOp", "StitchedKernel",
                         "StitchedAttention", "StitchedMatMul", "StitchedBatchMatMul",
                         "Assert", "NoOp", "PartitionedCall", "StatefulPartitionedCall"})


def _side_effect_free(graph_def) -> bool:
    """Whether running ``graph_def`` (and the functions it calls) again changes
    nothing but its outputs: no variable update, random draw, print, queue..."""
    from tensorflow.python.framework import op_def_registry
    nodes = list(graph_def.node)
    for f in graph_def.library.function:
        nodes.extend(f.node_def)
    for n in nodes:
        if n.op in _REPEATABLE:
            continue
        op_def = op_def_registry.get(n.op)
        if op_def is None or op_def.is_stateful:
            return False                 # a function name called as an op, or stateful
    return True


def _warm_up(cf, tier) -> None:
    """Run the stitched graph once here, in the background, on the first call's
    arguments, where running it changes nothing but its outputs (an inference
    function): its first run (TF instantiating the function, first allocations) took
    4-14x a steady call, on the user's call that switched.  A graph with side effects
    (a training step's update) switches unrun."""
    args, tier.args = tier.args, None
    if args is None:
        return
    args = _flat(args, tier.key)
    if not _flat_in(cf, args):
        return
    try:
        if _side_effect_free(cf.graph.as_graph_def()):
            _call_concrete(cf, args)
    except Exception:  # noqa: BLE001 — the user's call would meet it and say so
        pass


def span_text(what: str, n: int) -> str:
    """'call 1', 'calls 1-3' (no 'calls 1-1'): the stock calls or steps of a tier."""
    return f"{what} 1" if n == 1 else f"{what}s 1-{n}"


def _signature_text(key) -> str:
    """``(float32[6,40], int32[3])`` for an exact-signature key (dtype, dims) pairs."""
    return "(" + ", ".join(f"{dtype.name}[{','.join(map(str, shape))}]"
                           for dtype, shape in key) + ")"


def _traced_signature_text(flat) -> str:
    """``(float32[?,40], int32[3])``: a trace's tensor arguments, an unknown (relaxed)
    dimension as ``?``; ``float32[*]`` for an unknown rank."""
    return _signature_text(
        (t.dtype, ("*",) if t.shape.rank is None else
         tuple("?" if d is None else d for d in t.shape.as_list()))
        for t in flat if isinstance(t, tf.Tensor))


_hinted = False


def _hint_background_compile(seconds: float) -> None:
    """Once per process: a slow synchronous first call says which calls are tiered."""
    global _hinted
    if _hinted or seconds < HINT_SECONDS or \
            os.environ.get("STITCHING_NO_HINTS", "") not in ("", "0"):
        return
    _hinted = True
    print(f"stitching: this call waited {seconds:.1f} s to plan and compile its kernels. "
          "Calls whose arguments are all tensors (or dicts and lists of them; not "
          "SparseTensor or RaggedTensor), by position or as named parameters, run stock TF "
          "while they compile (tiered execution; STITCHING_NO_HINTS=1 hides this "
          "line).", file=sys.stderr, flush=True)


def _relaxed(shapes_seen) -> list:
    """Per argument, its shape with every dim that differed between calls unknown."""
    return [tuple(d[0] if len(set(d)) == 1 else None for d in zip(*arg))
            for arg in zip(*shapes_seen)]


def _family(key) -> tuple:
    """The key's arguments' dtypes and ranks (and nesting): the signatures one relaxed
    trace can serve."""
    family = tuple((dtype, len(shape)) for dtype, shape in key)
    return family if key.structure is None else (key.structure, family)


def _fits(general, shape) -> bool:
    return all(g is None or g == d for g, d in zip(general, shape))


def tensor_specs(key, shapes=None) -> list:
    """The positional arguments of TensorSpecs for an exact-signature key
    (``_eager_key``'s), with ``shapes`` (relaxed ones) instead of the key's own where
    given: in the nesting of the call's arguments (a dict of specs for a dict)."""
    shapes = [shape for _, shape in key] if shapes is None else shapes
    specs = [tf.TensorSpec(shape, dtype) for (dtype, _), shape in zip(key, shapes)]
    return specs if key.template is None else list(
        tf.nest.pack_sequence_as(key.template, specs))


def _flat_in(cf, args):
    """``cf``, or False where its flat inputs are not exactly ``args`` (a default
    argument that is a tensor): that signature is never called the fast way.  A
    ``_StockTier`` calls through TF, and checks its stitched graph at the switch."""
    if type(cf) is _StockTier:
        return cf
    return cf if len(cf.inputs) - len(cf.captured_inputs) == len(args) else False


def _arrays_as_tensors(args):
    """``args`` with NumPy arrays of numbers or bools as eager tensors, as tf.function
    takes them (it traces an array by dtype and shape, as a tensor): so they take the
    fast path and its relaxed shapes too (a training step fed NumPy batches of 36 sizes
    made 36 stitched traces, each planned and compiled)."""
    if not any(isinstance(a, np.ndarray) for a in args) or not tf.executing_eagerly():
        return args
    return tuple(tf.convert_to_tensor(a) if isinstance(a, np.ndarray) and
                 a.dtype.kind in "biufc" else a for a in args)


class _Key(tuple):
    """An exact signature of the fast path: ((dtype, shape), ...) of the call's tensors
    in ``tf.nest.flatten`` order (a ConcreteFunction's flat inputs), and where the
    arguments nest (dicts, lists, tuples of tensors: HF transformers' inputs)
    ``structure``, a hashable description of the nesting, and ``template``, the
    arguments' nesting with None leaves (``tensor_specs``); both None for flat
    tensors."""

    structure = template = None

    def __eq__(self, other):
        return tuple.__eq__(self, other) and self.structure == getattr(
            other, "structure", None)

    def __ne__(self, other):
        return not self == other

    def __hash__(self):       # a flat key hashes as its tuple: _concrete[((dtype, shape),)]
        if self.structure is None:
            return tuple.__hash__(self)
        return hash((tuple(self), self.structure))


class _NotTensors(Exception):
    """An argument the fast path does not take (``_nesting``)."""


def _nesting(a):
    """A hashable description of ``a``'s nesting of eager tensors: None for a tensor,
    dicts (string keys, read sorted, as tf.nest flattens them), lists and tuples of
    such; _NotTensors for anything else (Python scalars, None, composite tensors,
    namedtuples: TF's call path)."""
    t = type(a)
    if t is EagerTensor:
        return None
    if t is dict:
        if not a or not all(type(k) is str for k in a):
            raise _NotTensors
        return ("dict",) + tuple((k, _nesting(a[k])) for k in sorted(a))
    if (t is list or t is tuple) and a:
        return (t.__name__,) + tuple(_nesting(x) for x in a)
    raise _NotTensors


def _eager_key(args):
    """The exact signature (``_Key``) of a call whose arguments are eager tensors (at
    least one), or dicts, lists and tuples of them; else None."""
    if not args or not tf.executing_eagerly():
        return None
    if all(type(a) is EagerTensor for a in args):
        return _Key((a.dtype, tuple(a.shape)) for a in args)
    try:
        structure = _nesting(tuple(args))
    except _NotTensors:
        return None
    key = _Key((a.dtype, tuple(a.shape)) for a in tf.nest.flatten(args))
    key.structure = structure
    key.template = tf.nest.map_structure(lambda _: None, tuple(args))
    return key


def _flat(args, key):
    """The call's tensors as ``key`` lists them (a ConcreteFunction's flat inputs)."""
    return args if key.structure is None else tf.nest.flatten(tuple(args))


def _call_concrete(cf, args):
    """``cf(*args)`` without re-checking the arguments (the exact-signature key did):
    TF 2.21's ConcreteFunction._call_flat, else the public call."""
    call_flat = getattr(cf, "_call_flat", None)
    if call_flat is None:
        return cf(*args)
    return call_flat(list(args), cf.captured_inputs)


def _unwrap(fn, input_signature, jit_compile):
    """The Python function to trace (the function inside a tf.function or a
    StitchedFunction given instead of one) and its input signature."""
    if jit_compile:
        raise ValueError(_JIT_MESSAGE)
    if isinstance(fn, tf_pf.Function):
        if fn._jit_compile:
            raise ValueError(_JIT_MESSAGE)
        return fn.python_function, input_signature or fn.input_signature
    return fn, input_signature          # TF refuses what is not callable


_JIT_MESSAGE = ("stitching.function cannot stitch a function compiled with "
                "jit_compile=True: XLA compiles the whole function itself and has no "
                "kernel for the StitchedKernel op. Use either XLA or stitching for it.")


def function(func=None, input_signature=None, autograph=True, jit_compile=None,
             reduce_retracing=None, experimental_implements=None,
             experimental_autograph_options=None, experimental_attributes=None,
             experimental_relax_shapes=None, experimental_compile=None,
             experimental_follow_type_hints=None, *, options: Options | None = None):
    """``tf.function``, with its memory-intensive ops stitched into generated kernels.

    The same parameters as ``tf.function`` (``jit_compile=True`` is refused: XLA has no
    kernel for the stitched op), plus ``options``; use as ``@stitching.function`` or
    ``@stitching.function(options=...)``.  The result is a ``tf.function``
    (``isinstance(f, tf.types.experimental.PolymorphicFunction)``).  A new input
    signature is traced, its kernels planned, compiled (those not in the disk cache)
    and put in the graph.  By default an eager call whose arguments are all tensors
    (or dicts, lists and tuples of them), by position or as named parameters, does
    not wait for that: it returns stock TF's result while the kernels compile in the
    background, and a later call runs them (tiered execution; ``f.wait()`` blocks
    until they are ready, and ``Options(background_compile=False)`` makes the first
    call wait).  ``f.report`` says what was fused and why.

    Args:
        func: The Python function to compile (any TF code: Keras layers, ``tf.nn``,
            raw ops, a whole training step with its ``GradientTape``).
        input_signature: A list of ``tf.TensorSpec``, as ``tf.function``'s.
        autograph: As ``tf.function``'s.
        jit_compile: Must be falsy: XLA has no kernel for the stitched op.
        reduce_retracing: None (default) relaxes input shapes after the second
            distinct shape of the same dtypes and ranks, so a new batch size costs no
            trace; True as ``tf.function``'s; False traces every shape exactly.
        experimental_implements: As ``tf.function``'s.
        experimental_autograph_options: As ``tf.function``'s.
        experimental_attributes: As ``tf.function``'s.
        experimental_relax_shapes: TF's deprecated spelling of ``reduce_retracing=True``.
        experimental_compile: TF's deprecated spelling of ``jit_compile``.
        experimental_follow_type_hints: Deprecated and ignored, as in TF.
        options: A ``stitching.Options``; default ``Options()``.

    Returns:
        A ``StitchedFunction`` (or, without ``func``, a decorator making one).

    Raises:
        ValueError: ``jit_compile=True``, or ``func`` is a ``tf.function`` compiled
            with XLA.
        TypeError: ``func`` is not callable.
    """
    del experimental_follow_type_hints          # deprecated and ignored, as in TF
    if experimental_relax_shapes:               # TF's deprecated spelling
        reduce_retracing = True
    jit_compile = jit_compile if jit_compile is not None else experimental_compile

    def decorated(inner):
        return StitchedFunction(
            inner, input_signature=input_signature, autograph=autograph,
            jit_compile=jit_compile, reduce_retracing=reduce_retracing,
            experimental_implements=experimental_implements,
            experimental_autograph_options=experimental_autograph_options,
            experimental_attributes=experimental_attributes, options=options)

    return decorated if func is None else decorated(func)
