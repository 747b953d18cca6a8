"""The OpenBLAS product ops (``gemm.cc``): StitchedMatMul and StitchedBatchMatMul,
and ``attention.cc``'s StitchedAttention (tf/passes/attention.py).

Design
------
``gemm.cc`` is a second op library, built like the StitchedKernel one (build.py:
cached by a hash of TF, the source and the flags; ``build_blas``) and linked against
the OpenBLAS of the ``scipy-openblas32`` wheel.  It is apart from ``op.cc`` so that the
kernels run where the wheel is missing: then ``unavailable()`` says why, and the graph
pass (tf/passes/blas.py) leaves the products to TF with that reason in its report.

Importing this module imports neither TensorFlow nor the wheel; ``load()`` does.
"""
from __future__ import annotations

import threading

from . import build as _build

_lock = threading.Lock()
_module = None
_problem = None          # why the ops are unavailable, once a load failed


def load():
    """The loaded op module (``tf.load_op_library``), building it on first use.
    Raises RuntimeError with the reason when it cannot be had."""
    global _module, _problem
    if _module is not None:
        return _module
    if _problem is not None:
        raise RuntimeError(_problem)
    import tensorflow as tf
    with _lock:
        if _module is None and _problem is None:
            wheel = _build.BLAS_WHEEL
            try:
                _module = tf.load_op_library(str(_build.build_blas()))
            except ImportError:
                _problem = (f"the {wheel} package is not installed (pip install "
                            f"{wheel})")
            except (_build.BuildError, tf.errors.NotFoundError, OSError) as e:
                _problem = f"the OpenBLAS product ops did not build or load: {e}"
    if _module is None:
        raise RuntimeError(_problem)
    return _module


def unavailable() -> str | None:
    """None when the ops load, else why not (a sentence for the report)."""
    try:
        load()
    except RuntimeError as e:
        return str(e)
    return None
