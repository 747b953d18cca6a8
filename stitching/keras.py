"""Keras models with stitched steps: ``stitch(model)`` after ``model.compile(...)``.

Then ``fit``, ``evaluate``, ``predict``, ``train_on_batch`` and ``model.export`` run
stitched graphs of the model's steps (forward, backward and optimizer update), one
graph for every batch size.  By default the first steps run stock Keras while the
kernels compile in the background, and a later step switches (a line on stderr says
at which step); ``wait(model)`` blocks until they are ready.  ``model.stitching_report``
says what was fused.  A later ``compile`` stitches the new steps.  A stitched
model cannot be un-stitched: build or clone (``keras.models.clone_model``) a fresh
one for stock Keras.  docs/training.md is the guide.
"""

# How it works.
#
# How Keras 3's TensorFlow trainer runs a step (keras/src/backend/tensorflow/trainer.py):
#
#     fit ─▶ make_train_function ─▶ _make_function(self.train_step)
#              one_step_on_data = tf.function(strategy.run(train_step, data))
#              multi_step_on_iterator = tf.function(while loop over steps_per_execution)
#
# ``stitch`` replaces the model's ``train_step`` / ``test_step`` / ``predict_step`` (the
# bound methods Keras reads when it builds those functions) by ``stitching.function``s of
# the same methods and drops the functions Keras already built.  Keras's own
# tf.function wrappers, iterator loop, callbacks, metrics and ``steps_per_execution``
# are untouched; each trace of a step stitches that step's graph (forward, backward and
# optimizer update) and imports it into Keras's trace.  ``reduce_retracing`` gives the
# step unknown batch dims, so one stitched graph serves every batch size, the last
# partial batch included.
#
# Under a multi-replica strategy (MirroredStrategy, MultiWorkerMirroredStrategy) the
# train step cannot be stitched on its own: Keras calls it inside ``strategy.run``,
# where TF forbids a nested function holding the gradient all-reduce.  There ``stitch``
# also replaces ``make_train_function``: the stitched function is Keras's
# ``one_step_on_data`` (``strategy.run`` of the step, then the per-replica reduction),
# and ``steps_per_execution`` steps run as that many calls from Python rather than
# Keras's in-graph while loop.  Evaluate and predict stay as above (their steps hold no
# cross-replica synchronization).  (Stock Keras 3 on TF 2.21 itself fails evaluate
# under MirroredStrategy with ``steps_per_execution > 1``: an unfed call-time capture
# inside its while loop's cond.)
#
# ``model.export(path)`` (a SavedModel) exports the stitched ``serve`` endpoint.
#
# Tiered execution (the default: ``Options(background_compile=None)``, or ``True``;
# ``$STITCHING_BACKGROUND_COMPILE=0`` turns it off for a process):
# a step function's first calls run stock Keras; once they have run for
# ``tier_up_seconds()`` (1 s; the first call, Keras's trace, not counted) a background
# thread stitches the same step (plan, compile in lower-priority worker processes,
# load), and the next call after it is done switches to the stitched graph, at a step
# boundary:
#
#     model.train_function = _Tiered._run ──▶ stock Keras function   (until ready)
#                                         └─▶ stitched Keras function (from then on)
#     background: StitchedFunction(train_step).get_concrete_function(the step's
#                 input signature, batch dim unknown) after 1 s of stock steps
#
# Warm (the result cache, tf/results.py, stored a result for a step like this one:
# ``_hint``, no trace needed): the stock tier's trace goes through ``_Tiered.probe``, a ``cached_only`` StitchedFunction traced as the background
# compile traces (the step's signature, batch dim unknown), so it meets the graph an
# earlier run stored its stitched result under.  A hit makes that first tier stitched
# from step 1: nothing to compile, no background thread, ``switch == (1, 0.0)``; a miss
# imports the step's traced graph as it is, stock TF, and tiering goes on as above.
#
# Both are Keras's own functions (``make_train_function`` called twice), over the same
# variables, optimizer state and metrics, fed from the same iterator; the step they
# call (``_Tiered.step``) is the stock one or the stitched one by the tier being
# traced.  The stitched step equals stock TF's within float rounding, so the loss
# curve goes on across the switch as stock TF's would.  A progress line on stderr and
# the step's report (``Report.tiering``) say at which step the switch happened; a
# short job that ends first never waits for the kernels (tf/function.py stops
# background compiles at exit; the kernels finished are in the disk cache, and the
# next process's compile starts from there).
#
# Not tiered, the first step waiting for its kernels instead: ``Options(
# background_compile=False)`` (or ``$STITCHING_BACKGROUND_COMPILE=0``), and any model under a ``tf.distribute`` strategy (a
# step that Keras calls inside ``strategy.run`` cannot be traced on its own in another
# thread: its per-replica inputs and cross-replica reductions belong to the strategy's
# call).
#
# Refused, with the reason: ``jit_compile=True`` (XLA has no kernel for the op),
# ``run_eagerly=True`` (no graph) and a model not compiled yet.

from __future__ import annotations

import dataclasses
import math
import os
import sys
import threading
import time

import tensorflow as tf

from .options import DISABLED_NOTE, Options, background_compile_on, disabled
from .tf.function import StitchedFunction, run_in_background, seeded_reason, span_text
from .tf.tfgraph import seeded_random_ops

STEPS = ("train", "test", "predict")


class StitchingReports:
    """``model.stitching_report``: the latest report of each stitched step function
    (``["train"]``, ``.train``, ...; None until that step was traced), ``.all`` every
    trace's report, and ``summary()``."""

    def __init__(self, functions: dict):
        self._functions = functions

    def __getitem__(self, step):
        if step in STEPS and not self._functions:     # $STITCHING_DISABLE: none stitched
            return None
        return self._functions[step].report

    def __getattr__(self, step):
        if step in STEPS and not self._functions:     # $STITCHING_DISABLE: none stitched
            return None
        if step.startswith("_") or step not in self._functions:
            raise AttributeError(step)
        return self._functions[step].report

    @property
    def all(self) -> dict:
        """``{step: [Report per trace]}``."""
        return {k: list(f.reports) for k, f in self._functions.items()}

    def summary(self) -> str:
        """Each step's latest report as text."""
        if not self._functions:
            return DISABLED_NOTE.replace("this trace is", "every step is")
        parts = [f"[{k}_step] " + (f.report.summary() if f.report else "not traced yet")
                 for k, f in self._functions.items()]
        return "\n".join(parts)

    def __repr__(self):
        return self.summary()


def stitch(model, options: Options | None = None):
    """Make a compiled Keras model's ``fit`` / ``evaluate`` / ``predict`` /
    ``train_on_batch`` run stitched graphs (forward, backward and optimizer update).

    Call after ``model.compile(...)``; a later ``compile`` (which rebuilds Keras's step
    functions) stitches the new steps with the same options.  The reports are
    ``model.stitching_report`` (``.train``, ``.test``, ``.predict``, ``summary()``).

    Args:
        model: A compiled Keras model: Keras 3 (TensorFlow backend) or tf_keras
            (Keras 2, ``TF_USE_LEGACY_KERAS=1``; HF transformers' TF models).
        options: A ``stitching.Options``; default ``Options()``.

    Returns:
        The same model.

    Raises:
        ValueError: the model is not compiled, or was compiled with
            ``jit_compile=True`` or ``run_eagerly=True``.
    """
    _check(model)
    if disabled():      # $STITCHING_DISABLE: the model as it is, reports that say so
        object.__setattr__(model, "stitching_report", StitchingReports({}))
        return model
    options = options or Options()
    tiered = background_compile_on(options) and not _distributed(model)
    # the steps compile in the caller's thread or, tiered, in _Tiered's background one,
    # where a kernel count printed over the user's progress bar would say nothing
    # useful: the switch gets its own line
    step_options = dataclasses.replace(
        options, background_compile=False,
        progress=bool(options.progress) if tiered else options.progress)
    functions = {}
    for step in STEPS:
        method = getattr(model, f"{step}_step")
        if isinstance(getattr(method, "stitched", None), StitchedFunction):  # re-stitch
            method = method.stitched.python_function
        elif isinstance(getattr(method, "__self__", None), _Tiered):
            method = method.__self__.stock_step
        object.__setattr__(model, f"{step}_function", None)
        vars(model).pop(f"make_{step}_function", None)     # a previous stitch's
        # Keras's Layer.__setattr__ tracks attributes; these are plain callables
        if step == "train" and _replicas(model) > 1:
            functions[step] = _ReplicatedStep(model, step, method, step_options)
            object.__setattr__(model, f"make_{step}_function", functions[step].make)
            continue
        stitched = StitchedFunction(method, options=step_options, autograph=False)
        if tiered:
            probe = StitchedFunction(method, options=step_options, autograph=False)
            probe.cached_only = True
            functions[step] = _Tiered(model, step, method, stitched, probe,
                                      options.progress)
            object.__setattr__(model, f"{step}_step", functions[step].step)
            object.__setattr__(model, f"make_{step}_function", functions[step].make)
            continue
        functions[step] = stitched
        object.__setattr__(model, f"{step}_step", _plain_step(model, stitched, step))
    object.__setattr__(model, "export", _stitched_export(model, options))
    object.__setattr__(model, "stitching_report", StitchingReports(functions))
    object.__setattr__(model, "_stitching_steps", functions)
    object.__setattr__(model, "compile", _restitching_compile(model, options))
    return model


def _restitching_compile(model, options):
    """``model.compile`` that stitches the model again after Keras's compile: a new
    compile (a new optimizer, loss or metrics) rebuilds Keras's step functions, and the
    stitched ones hold the old optimizer's and metrics' variables (TF then refused the
    next step: "a function referencing variables which have been deleted")."""
    base = getattr(vars(model).get("compile"), "stitching_base", None) or model.compile

    def compile(*args, **kwargs):
        base(*args, **kwargs)
        try:
            _check(model)
        except ValueError as e:
            raise ValueError(f"{e}; a stitched model cannot run that way: build a fresh "
                             f"model (or keras.models.clone_model) for it") from None
        stitch(model, options)
    compile.stitching_base = base
    compile.__doc__ = base.__doc__
    return compile


def _plain_step(model, stitched, kind):
    """``model.<kind>_step`` calling ``stitched``: a plain function, not the
    tf.function itself, which tf.saved_model.save would find among the model's
    attributes and try to save (its trace captures Keras's metric variables, which the
    SavedModel cannot reach: a KeyError after fit).  ``.stitched`` for a re-stitch.
    A later ``compile`` (a new optimizer) needs a new stitch: the train and test traces
    hold the old optimizer's and metrics' variables, which TF reports only as
    "variables which have been deleted"."""
    optimizer = getattr(model, "optimizer", None)

    def step(data):
        if kind != "predict" and getattr(model, "optimizer", None) is not optimizer:
            raise RuntimeError("stitching.keras: the model was compiled again without "
                               "its stitched compile (keras.Model.compile(model, ...)); "
                               "call stitch(model) again after it")
        return stitched(data)
    step.stitched = stitched
    return step


def _stitched_export(model, options):
    """``model.export(path)`` (a SavedModel) with the ``serve`` endpoint stitched: Keras's
    own export (ExportArchive, its variables and its tf.function over the endpoint)
    around a StitchedFunction of ``model.__call__``; other formats are Keras's."""
    keras_export = type(model).export
    if _tf_keras(model):
        return _stitched_tf_keras_export(model, options)

    def export(filepath, format="tf_saved_model", verbose=None, input_signature=None,
               **kwargs):
        if format != "tf_saved_model":
            return keras_export(model, filepath, format=format, verbose=verbose,
                                input_signature=input_signature, **kwargs)
        from keras.src.export.export_utils import get_input_signature
        from keras.src.export.saved_model import DEFAULT_ENDPOINT_NAME, ExportArchive
        archive = ExportArchive()
        archive.track(model)
        serve = StitchedFunction(model.__call__, options=options, autograph=False)
        endpoint = archive.add_endpoint(DEFAULT_ENDPOINT_NAME, serve,
                                        input_signature or get_input_signature(model),
                                        **kwargs)
        # the kernels' shared objects in assets/, as a saved StitchedFunction ships them
        # (the endpoint traced now: its tf.function's signature traces ``serve``)
        endpoint.get_concrete_function()
        assets = serve._kernel_assets(list(serve._list_all_concrete_functions()))
        if assets is not None:
            archive._tf_trackable.stitching_kernels = assets
        archive.write_out(filepath, verbose=True if verbose is None else verbose)
    return export


def _tf_keras(model) -> bool:
    """A tf_keras (Keras 2) model: ``TF_USE_LEGACY_KERAS=1``'s ``tf.keras``, HF
    transformers' TF models.  Its export is tf_keras's own (another ExportArchive,
    ``export(filepath)``), which Keras 3's refuses ("must be a `keras.Model`")."""
    return any(c.__module__.split(".")[0] == "tf_keras" for c in type(model).__mro__)


def _tf_keras_module(name: str):
    """The tf_keras module ``name`` (``tf_keras.src.engine.training``...), as the
    user's model loaded it: stitching never imports tf_keras itself.  It is not one of
    our dependencies, nor an extra: tf-keras requires the ``tensorflow`` wheel, which
    would install a second TensorFlow over a user's ``tensorflow-cpu``.  A model of
    its classes means the package is loaded; its submodules import as any module."""
    import importlib
    import sys
    if "tf_keras" not in sys.modules:
        raise RuntimeError(f"stitching.keras: {name} is needed for a tf_keras model, and "
                           f"tf_keras is not loaded in this process")
    return importlib.import_module(name)


def _stitched_tf_keras_export(model, options):
    """``model.export(filepath)`` of a tf_keras model with its ``serve`` endpoint
    stitched: tf_keras's ``export_model`` (its ExportArchive and input signature) over a
    StitchedFunction of ``model.__call__``, the kernels in ``assets/``."""

    def export(filepath):
        functional = _tf_keras_module("tf_keras.src.engine.functional")
        sequential = _tf_keras_module("tf_keras.src.engine.sequential")
        export_lib = _tf_keras_module("tf_keras.src.export.export_lib")
        archive = export_lib.ExportArchive()
        archive.track(model)
        if isinstance(model, (functional.Functional, sequential.Sequential)):
            signature = tf.nest.map_structure(export_lib._make_tensor_spec, model.inputs)
            if isinstance(signature, list) and len(signature) > 1:
                signature = [signature]
        else:
            spec = model._get_save_spec()
            if not spec:
                raise ValueError("The model provided has never called. It must be "
                                 "called at least once before export.")
            signature = [spec]
        serve = StitchedFunction(model.__call__, options=options, autograph=False)
        archive.add_endpoint("serve", serve, signature)
        archive.serve.get_concrete_function()
        assets = serve._kernel_assets(list(serve._list_all_concrete_functions()))
        if assets is not None:
            archive.stitching_kernels = assets
        archive.write_out(filepath)
    export.__doc__ = type(model).export.__doc__
    return export


def wait(model, timeout: float | None = None) -> bool:
    """Compile now the stitched steps of ``model`` (tiered by ``stitch``) that have
    run stock and are not compiled yet, and block until every one is ready, or
    ``timeout`` seconds passed; True when none is pending and none failed.  The
    next call of such a step runs stitched.  Steps that compiled at their first call
    (``background_compile=False``, tf.distribute) started on quick tier-1 code: this
    also waits for their optimized code (``StitchedFunction.wait``)."""
    from .tf.function import seconds_left, wait_tier2
    deadline = None if timeout is None else time.monotonic() + timeout
    ok = True
    for f in getattr(model, "_stitching_steps", {}).values():     # none: disabled
        if isinstance(f, _Tiered):
            ok = f.wait(seconds_left(deadline)) and ok
    return wait_tier2(seconds_left(deadline)) and ok


class _StitchedStep:
    """A step function stitch() installs around a StitchedFunction ``stitched``:
    its reports, as StitchingReports reads them."""

    @property
    def report(self):
        return self.stitched.report

    @property
    def reports(self):
        return self.stitched.reports


class _Tiered(_StitchedStep):
    """One of Keras's step functions (``train``, ``test``, ``predict``) under tiered
    execution (module docstring): stock Keras until the stitched step is ready, then
    the stitched one -- from the first step where the result cache holds it.

    Attributes:
        stock_step: Keras's step method.
        stitched: The StitchedFunction of it.
        probe: The same, ``cached_only`` (tf/results.py): what the first tier's
            trace runs where the result cache stored a result for a step like this
            one, so a warm process's first step is already stitched; stock TF's
            graph where it misses.
        switch: ``(step, seconds)``: the step (counted from this function's first,
            across fits) that first ran stitched and the seconds since the first
            stock step (0 when stitched from the start); None before the switch.
        stock_steps, stitched_steps: Steps run each way so far.
        stock_only: The step holds seeded random ops: it never switches (their
            numbers would start again from the seed in the stitched step).
        error: The exception that ended the background compile (stock TF keeps
            serving), or None.
    """

    def __init__(self, model, kind, stock_step, stitched, probe, progress):
        self._model, self._kind = model, kind
        self.stock_step, self.stitched, self.probe = stock_step, stitched, probe
        self.stock_steps = self.stitched_steps = 0
        self._hint = None                    # results.hint of the step (_hint)
        self._progress = progress
        self._tier = threading.local()       # .stitched: the tier being traced here
        self._signature = None               # the step's inputs, from its stock trace
        self._exact = None                   # the same with the batch dim as traced
        self._thread = None
        self._ready = False
        # threads calling the model at once (a server's predict): the background
        # compile starts once and the switch happens once
        self._lock = threading.Lock()
        self.error = None
        self.switch = None
        self._steps = 0                      # steps run so far (all tiers)
        self._t0 = None                      # the first stock step's start
        self._stock_seconds = 0.0            # stock steps' time after the first
        self._tier_up = tier_up_seconds()
        self._stock_fn = self._stitched_fn = None
        self.stock_only = False              # seeded random ops: never switches

    @property
    def report(self):
        return self.probe.report if self.warm else self.stitched.report

    @property
    def reports(self):
        return self.probe.reports + self.stitched.reports

    @property
    def warm(self) -> bool:
        """Whether the first tier runs stitched: every trace of it was served by the
        result cache."""
        return bool(self.probe.cache_hits) and not self.probe.cache_misses

    def step(self, data):
        """``model.<kind>_step``, called by Keras's functions as they are traced."""
        if getattr(self._tier, "stitched", False):
            return self.stitched(data)
        self._signature = tf.nest.map_structure(_unknown_batch, data)
        self._exact = tf.nest.map_structure(_spec, data)
        if self._hint is None:           # the model as its first trace finds it
            self._hint = _hint(self._model, self._kind, self._signature,
                               self.stitched.options)
        if _probing(self._hint):
            # traced as the background compile traces (for every batch size, else
            # Keras's): the same graph, so the key it stored its result under
            for spec in (self._signature, self._exact):
                try:
                    self.probe.get_concrete_function(spec)
                    return self.probe(data)
                except Exception:  # noqa: BLE001 — as _compile: the next, or stock
                    continue
        return self.stock_step(data)

    def make(self, force=False):
        """``model.make_<kind>_function``: Keras's own function, built twice (one per
        tier, each with its own tf.function and traces), behind ``_run``."""
        model, attr = self._model, f"{self._kind}_function"
        if getattr(model, attr) is None or force:
            keras_make = getattr(type(model), f"make_{self._kind}_function")
            keras_make(model, force=True)
            self._stock_fn = getattr(model, attr)
            keras_make(model, force=True)
            self._stitched_fn = getattr(model, attr)
            object.__setattr__(model, attr, self._run)
        return getattr(model, attr)

    def _run(self, data):
        steps = _steps_per_execution(self._model) if self._kind != "predict" else 1
        stock = self._stock_fn      # read before _ready: let go only after it is set
        if self._ready:
            if self.switch is None and self._switched():
                # the stock tier never runs again (_ready stays): its Keras function
                # and the traces it holds (the whole step's graph) go with it
                self._stock_fn = None
            self._tier.stitched = True
            try:
                return self._stitched_fn(data)
            finally:
                self._tier.stitched = False
                self._steps += steps
                self.stitched_steps += steps
        start = time.perf_counter()
        out = stock(data)
        if self._t0 is None:
            self._t0 = start              # the first call: Keras's trace, not rent
        elif not self.warm:
            self._stock_seconds += time.perf_counter() - start
        self._steps += steps
        if self.warm:
            if self.switch is None:
                self._switched(warm=True)
            self.stitched_steps += steps
            return out
        self.stock_steps += steps
        if self._stock_seconds >= self._tier_up:
            self._start()
        return out

    def _start(self):
        """The background compile, once (after a stock step: its trace made every
        variable the step needs, and its inputs are known)."""
        with self._lock:
            if self._thread is not None or self._signature is None:
                return
            self._thread = run_in_background(self._compile, self._signature,
                                             self._exact)
        if self._progress is not False:     # a big model's compile takes minutes
            after = span_text("stock step", self.stock_steps)
            print(f"stitching: {self._kind} step: planning and compiling its kernels "
                  f"in the background after {after}; "
                  f"stock Keras runs the steps until they are ready",
                  file=sys.stderr, flush=True)

    def _compile(self, signature, exact):
        """In the background thread: trace and stitch the step for every batch size,
        or, where the step cannot be traced with its batch dim unknown, for the
        batch size Keras traced.  One step at a time (train, test and predict all
        started during a short fit would only share the same cores)."""
        from .compile.parallel import Cancelled
        with _ONE_AT_A_TIME:
            for spec in (signature, exact):
                try:
                    hits = self.stitched.cache_hits
                    reports = len(self.stitched._reports)   # (.report would settle first)
                    cf = self.stitched.get_concrete_function(spec)
                    seeded = seeded_random_ops(cf.graph.as_graph_def())
                    if seeded:      # as StitchedFunction._stay_stock: Keras's stays
                        self._stay_stock(seeded)
                        return
                    self._ready, self.error = True, None
                    from .tf import results
                    made = self.stitched._reports[reports:]
                    results.mark_if_held(self._hint, self.stitched.cache_hits > hits,
                                         made[-1] if made else None)
                    return
                except Cancelled as e:          # the process is exiting
                    self.error = e
                    return
                except Exception as e:  # noqa: BLE001 — stock TF keeps serving
                    self.error = e

    def _stay_stock(self, seeded):
        self.stock_only = True
        text = (f"stock Keras runs every step: the step {seeded_reason(seeded, 'step')} "
                f"(Options(background_compile=False) stitches from the first step)")
        if self.stitched.report is not None:
            self.stitched.report.tiering = text
        if self._progress is not False:
            print(f"stitching: {self._kind} step: {text}", file=sys.stderr, flush=True)

    def _switched(self, warm=False) -> bool:
        """Record the switch, once however many threads reach it: True for the one
        that did (the report and the progress line after the lock: the report may
        wait for compiles to settle, and the other threads' steps must not)."""
        with self._lock:
            if self.switch is not None:
                return False
            if warm:
                self.switch = (1, 0.0)
                text = ("stitched from step 1 (graph, plan and kernels from the cache; "
                        "nothing to compile)")
            else:
                seconds = time.perf_counter() - self._t0
                self.switch = (self._steps + 1, seconds)
                text = (f"stock TF ran {span_text('step', self._steps)} while the "
                        f"kernels compiled ({seconds:.1f} s); stitched from step "
                        f"{self._steps + 1}")
        if self.report is not None:
            self.report.tiering = text
        if self._progress is not False:
            print(f"stitching: {self._kind} step: {text}", file=sys.stderr, flush=True)
        return True

    def wait(self, timeout=None) -> bool:
        if self.warm:
            return True
        self._start()                     # asked for the kernels: no threshold
        if self._thread is not None:
            self._thread.join(timeout)
        ready = self._thread is None or self.stock_only or (self._ready and
                                                             self.error is None)
        if ready and self.switch is None and self.report is not None \
                and not self.report.tiering:
            # ready, not yet called: the report says so until the switch says where
            self.report.tiering = (f"stock TF ran {span_text('step', self._steps)}; the "
                                   f"stitched step is ready and runs from the next step")
        return ready


_ONE_AT_A_TIME = threading.Lock()
TIER_UP_SECONDS = 1.0     # arbitrary: about a warm stitch of a small model's step, in
#                           CPU time the background takes from the stock steps


def tier_up_seconds() -> float:
    """When a step starts compiling in the background: once its stock calls after the
    first (Keras's trace) have run this long, ``STITCHING_TIER_UP_SECONDS`` or
    ``TIER_UP_SECONDS``.  The ski-rental rule JIT compilers follow (HotSpot compiles
    a method once it is hot, XLA's asynchronous compilation a cluster after a few
    runs): a job whose steps all run within it never pays for the compiler -- a
    2-epoch fit of a small MLP measured +0.37 s of CPU (+34%) for a stitch its steps
    never used -- and a long job gets its kernels this much later."""
    env = os.environ.get("STITCHING_TIER_UP_SECONDS")
    if not env:
        return TIER_UP_SECONDS
    try:
        value = float(env)
    except ValueError:
        value = math.nan
    if not value >= 0:
        raise ValueError("STITCHING_TIER_UP_SECONDS must be a number of seconds >= 0, "
                         f"got {env!r}")
    return value


def _probing(hint) -> bool:
    """Whether a first tier traces through the probe: where a result was stored for
    a step with this hint (else the probe would miss, its trace costing more than
    stock's: the graph's key, the graph out and back in)."""
    from .tf import results
    return results.probed(hint)


def _hint(model, kind, signature, options) -> str:
    """The step's ``results.hint``: its kind and signature, the options, and the
    model's and optimizer's variables (name, shape, dtype) as the first trace finds
    them -- a script run again finds the same; another model, other names."""
    from .tf import results
    optimizer = getattr(model, "optimizer", None)
    variables = list(model.variables) + list(getattr(optimizer, "variables", []) or [])
    return results.hint(
        kind, model.name, repr(signature), repr(options),
        sorted((getattr(v, "path", v.name), tuple(v.shape), str(v.dtype))
               for v in variables))


def _spec(value):
    return tf.TensorSpec(value.shape, value.dtype) if isinstance(value, tf.Tensor) \
        else value


def _unknown_batch(value):
    """A traced step input's TensorSpec with its batch dim unknown (so the stitched
    trace serves every batch size, the last partial batch included); others as are."""
    if not isinstance(value, tf.Tensor):
        return value
    shape = value.shape
    if shape.rank:
        shape = tf.TensorShape([None]).concatenate(shape[1:])
    return tf.TensorSpec(shape, value.dtype)


def _distributed(model) -> bool:
    """Under a tf.distribute strategy (module docstring: not tiered there)."""
    strategy = getattr(model, "distribute_strategy", None)
    return tf.distribute.has_strategy() or (
        strategy is not None and strategy is not tf.distribute.get_strategy())


def _strategy(model):
    return getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()


def _replicas(model) -> int:
    return _strategy(model).num_replicas_in_sync


class _ReplicatedStep(_StitchedStep):
    """Keras's train (or test) function under a multi-replica strategy with the
    stitched function one level up: ``strategy.run(step)`` + the reduction."""

    def __init__(self, model, kind, step_fn, options):
        strategy = _strategy(model)
        if _tf_keras(model):
            # tf_keras's step_function: the step, then its counter, then the reduction
            training = _tf_keras_module("tf_keras.src.engine.training")
            _minimum_control_deps = training._minimum_control_deps
            reduce_per_replica = training.reduce_per_replica
            counter = getattr(model, f"_{kind}_counter")

            def run_step(data):
                outputs = step_fn(data)
                with tf.control_dependencies(_minimum_control_deps(outputs)):
                    counter.assign_add(1)
                return outputs

            def one_step_on_data(data):
                outputs = strategy.run(run_step, args=(data,))
                return reduce_per_replica(outputs, strategy,
                                          reduction=model.distribute_reduction_method)
        else:
            from keras.src.backend.tensorflow.trainer import reduce_per_replica

            def one_step_on_data(data):
                outputs = strategy.run(step_fn, args=(data,))
                return reduce_per_replica(outputs, strategy, reduction="auto")

        self._model, self._kind = model, kind
        self.stitched = StitchedFunction(one_step_on_data, options=options,
                                         autograph=False, reduce_retracing=True)
        self._step = model._autoconvert_optionals(self.stitched) \
            if hasattr(model, "_autoconvert_optionals") else self.stitched

    def make(self, force=False):
        model, attr = self._model, f"{self._kind}_function"
        if getattr(model, attr) is None or force:
            object.__setattr__(model, attr, self._run)
        return getattr(model, attr)

    def _run(self, iterator):
        """Keras's ``function(iterator)``: ``steps_per_execution`` steps, the last
        outputs returned; StopIteration when the iterator had nothing left."""
        steps = _steps_per_execution(self._model)
        outputs = None
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            for _ in range(steps):
                nxt = iterator.get_next_as_optional()
                if not nxt.has_value():
                    break
                outputs = self._step(nxt.get_value())
            if outputs is None:
                raise StopIteration
            return outputs
        for _, data in zip(range(steps), iterator):
            outputs = self._step(data)
        return outputs


def _steps_per_execution(model) -> int:
    """Keras 3's ``steps_per_execution`` is an int; tf_keras's (Keras 2) a tf.Variable
    (None before compile), which the step counts would have turned into tensors."""
    steps = getattr(model, "steps_per_execution", None)
    if steps is None:
        return 1
    # a MirroredVariable under a strategy has no __int__
    return int(steps.numpy() if hasattr(steps, "numpy") else steps)


def _compiled(model) -> bool:
    """Keras 3 says ``model.compiled``; tf_keras (Keras 2: ``TF_USE_LEGACY_KERAS=1``,
    HF transformers' TF models) says ``model._is_compiled``."""
    compiled = getattr(model, "compiled", None)
    if compiled is None:
        compiled = getattr(model, "_is_compiled", False)
    return bool(compiled)


def _check(model):
    if not _compiled(model):
        raise ValueError("stitching.keras.stitch: call model.compile(...) first; "
                         "stitch wraps the step functions compile configures")
    if getattr(model, "jit_compile", False) is True:
        raise ValueError(
            "stitching.keras.stitch: the model was compiled with jit_compile=True: XLA "
            "compiles each step itself and has no kernel for the StitchedKernel op. "
            "Use model.compile(..., jit_compile=False) to stitch, or XLA alone.")
    if getattr(model, "run_eagerly", False):
        raise ValueError("stitching.keras.stitch: the model runs eagerly "
                         "(run_eagerly=True): there is no graph to stitch")
