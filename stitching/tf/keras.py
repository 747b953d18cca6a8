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

Refused, with the reason: ``jit_compile=True`` (XLA has no kernel for the op) and a
multi-replica distribution strategy for training (Keras calls ``train_step`` inside
``strategy.run``, where TF forbids a nested function holding the gradient all-reduce;
stitch ``strategy.run`` inside a custom step with ``stitching.function`` instead).
"""
from __future__ import annotations

import tensorflow as tf

from ..options import Options
from .function import StitchedFunction

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
        return {k: list(f.reports) for k, f in self._functions.items()}

    def summary(self) -> str:
        parts = [f"[{k}_step] " + (f.report.summary() if f.report else "not traced yet")
                 for k, f in self._functions.items()]
        return "\n".join(parts)

    def __repr__(self):
        return self.summary()


def stitch(model, options: Options | None = None):
    """Make a compiled Keras model's fit/evaluate/predict/train_on_batch run stitched
    graphs; returns the model.  Call after ``model.compile(...)`` (and again after a
    later ``compile``, which rebuilds Keras's step functions)."""
    _check(model)
    functions = {}
    for step in STEPS:
        method = getattr(model, f"{step}_step")
        if isinstance(method, StitchedFunction):      # stitched before: re-stitch
            method = method._python_fn
        functions[step] = StitchedFunction(method, options=options, autograph=False)
        # Keras's Layer.__setattr__ tracks attributes; these are plain callables
        object.__setattr__(model, f"{step}_step", functions[step])
        object.__setattr__(model, f"{step}_function", None)
    object.__setattr__(model, "stitching_report", StitchingReports(functions))
    return model


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
    strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
    if strategy.num_replicas_in_sync > 1:
        raise NotImplementedError(
            f"stitching.keras.stitch: {type(strategy).__name__} with "
            f"{strategy.num_replicas_in_sync} replicas: Keras runs train_step inside "
            "strategy.run, where TF forbids a nested function holding the gradient "
            "all-reduce. Write the step with stitching.function around strategy.run.")
