"""``stitching.keras.stitch(model)``: Keras ``fit`` / ``evaluate`` / ``predict`` /
``train_on_batch`` run stitched graphs.

How Keras 3's TensorFlow trainer runs a step (keras/src/backend/tensorflow/trainer.py):

    fit ─▶ make_train_function ─▶ _make_function(self.train_step)
             one_step_on_data = tf.function(strategy.run(train_step, data))
             multi_step_on_iterator = tf.function(while loop over steps_per_execution)

``stitch`` replaces the model's ``train_step`` / ``test_step`` / ``predict_step`` (the
bound methods Keras reads when it builds those functions) by ``stitching.function``s of
the same methods and drops the functions Keras already built.  Keras's own
tf.function wrappers, iterator loop, callbacks, metrics and ``steps_per_execution``
are untouched; each trace of a step stitches that step's graph (forward, backward and
optimizer update) and imports it into Keras's trace.  ``reduce_retracing`` gives the
step unknown batch dims, so one stitched graph serves every batch size, the last
partial batch included.

Under a multi-replica strategy (MirroredStrategy, MultiWorkerMirroredStrategy) the
train step cannot be stitched on its own: Keras calls it inside ``strategy.run``,
where TF forbids a nested function holding the gradient all-reduce.  There ``stitch``
also replaces ``make_train_function``: the stitched function is Keras's
``one_step_on_data`` (``strategy.run`` of the step, then the per-replica reduction),
and ``steps_per_execution`` steps run as that many calls from Python rather than
Keras's in-graph while loop.  Evaluate and predict stay as above (their steps hold no
cross-replica synchronization).  (Stock Keras 3 on TF 2.21 itself fails evaluate
under MirroredStrategy with ``steps_per_execution > 1``: an unfed call-time capture
inside its while loop's cond.)

``model.export(path)`` (a SavedModel) exports the stitched ``serve`` endpoint.

Refused, with the reason: ``jit_compile=True`` (XLA has no kernel for the op),
``run_eagerly=True`` (no graph), a model not compiled yet, and
``Options(background_compile=True)`` (Keras calls the steps inside its own
tf.function: no eager first call could run stock TF while kernels compile).
"""
from __future__ import annotations

import tensorflow as tf

from .options import Options
from .tf.function import StitchedFunction

STEPS = ("train", "test", "predict")


class StitchingReports:
    """``model.stitching_report``: the latest report of each stitched step function
    (``["train"]``, ``.train``, ...; None until that step was traced), ``.all`` every
    trace's report, and ``summary()``."""

    def __init__(self, functions: dict):
        self._functions = functions

    def __getitem__(self, step):
        return self._functions[step].report

    def __getattr__(self, step):
        if step.startswith("_") or step not in self._functions:
            raise AttributeError(step)
        return self._functions[step].report

    @property
    def all(self) -> dict:
        """``{step: [Report per trace]}``."""
        return {k: list(f.reports) for k, f in self._functions.items()}

    def summary(self) -> str:
        """Each step's latest report as text."""
        parts = [f"[{k}_step] " + (f.report.summary() if f.report else "not traced yet")
                 for k, f in self._functions.items()]
        return "\n".join(parts)

    def __repr__(self):
        return self.summary()


def stitch(model, options: Options | None = None):
    """Make a compiled Keras model's ``fit`` / ``evaluate`` / ``predict`` /
    ``train_on_batch`` run stitched graphs (forward, backward and optimizer update).

    Call after ``model.compile(...)``, and again after a later ``compile`` (which
    rebuilds Keras's step functions).  The reports are ``model.stitching_report``
    (``.train``, ``.test``, ``.predict``, ``summary()``).

    Args:
        model: A compiled Keras 3 model (TensorFlow backend).
        options: A ``stitching.Options``; default ``Options()``.

    Returns:
        The same model.

    Raises:
        ValueError: the model is not compiled, or was compiled with
            ``jit_compile=True`` or ``run_eagerly=True``.
    """
    _check(model)
    if options is not None and options.background_compile:
        raise ValueError(
            "stitching.keras.stitch: Options(background_compile=True) cannot apply here: "
            "Keras calls each step inside its own tf.function, so there is no eager "
            "first call to serve with stock TF while the kernels compile (the first step "
            "waits for them). Pass Options without background_compile; background "
            "compilation works for a stitching.function called eagerly.")
    functions = {}
    for step in STEPS:
        method = getattr(model, f"{step}_step")
        if isinstance(method, StitchedFunction):      # stitched before: re-stitch
            method = method.python_function
        object.__setattr__(model, f"{step}_function", None)
        if step == "train" and _replicas(model) > 1:
            functions[step] = _ReplicatedStep(model, step, method, options)
            object.__setattr__(model, f"make_{step}_function", functions[step].make)
            continue
        functions[step] = StitchedFunction(method, options=options, autograph=False)
        # Keras's Layer.__setattr__ tracks attributes; these are plain callables
        object.__setattr__(model, f"{step}_step", functions[step])
    object.__setattr__(model, "export", _stitched_export(model, options))
    object.__setattr__(model, "stitching_report", StitchingReports(functions))
    return model


def _stitched_export(model, options):
    """``model.export(path)`` (a SavedModel) with the ``serve`` endpoint stitched: Keras's
    own export (ExportArchive, its variables and its tf.function over the endpoint)
    around a StitchedFunction of ``model.__call__``; other formats are Keras's."""
    keras_export = type(model).export

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


def _strategy(model):
    return getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()


def _replicas(model) -> int:
    return _strategy(model).num_replicas_in_sync


class _ReplicatedStep:
    """Keras's train (or test) function under a multi-replica strategy with the
    stitched function one level up: ``strategy.run(step)`` + the reduction."""

    def __init__(self, model, kind, step_fn, options):
        from keras.src.backend.tensorflow.trainer import reduce_per_replica
        strategy = _strategy(model)

        def one_step_on_data(data):
            outputs = strategy.run(step_fn, args=(data,))
            return reduce_per_replica(outputs, strategy, reduction="auto")

        self._model, self._kind = model, kind
        self._stitched = StitchedFunction(one_step_on_data, options=options,
                                          autograph=False, reduce_retracing=True)
        self._step = model._autoconvert_optionals(self._stitched)

    @property
    def report(self):
        return self._stitched.report

    @property
    def reports(self):
        return self._stitched.reports

    def make(self, force=False):
        model, attr = self._model, f"{self._kind}_function"
        if getattr(model, attr) is None or force:
            object.__setattr__(model, attr, self._run)
        return getattr(model, attr)

    def _run(self, iterator):
        """Keras's ``function(iterator)``: ``steps_per_execution`` steps, the last
        outputs returned; StopIteration when the iterator had nothing left."""
        steps = self._model.steps_per_execution
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


def _check(model):
    if not getattr(model, "compiled", False):
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
