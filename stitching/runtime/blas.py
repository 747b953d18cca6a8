"""The OpenBLAS product ops (``gemm.cc``): StitchedMatMul and StitchedBatchMatMul,
and ``attention.cc``'s StitchedAttention (tf/passes/attention.py).

Design
------
``gemm.cc`` is a second op library, built like the StitchedKernel one (build.py:
cached by a hash of TF, the source and the flags; ``build_blas``) and linked against
the OpenBLAS of the ``scipy-openblas32`` wheel.  It is apart from ``op.cc`` so that the
kernels run where the wheel is missing: then ``unavailable()`` says why, and the graph
pass (tf/passes/blas.py) leaves the products to TF with that reason in its report.

Large outputs come from op.cc's output pool, shared with StitchedKernel
(blas_util.h ``AllocateOutput`` says why); ``load()`` hands the library the pool.

Importing this module imports neither TensorFlow nor the wheel; ``load()`` does.
"""
from __future__ import annotations

import ctypes
import os
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
                path = str(_build.build_blas())
                module = tf.load_op_library(path)
                _share_pool(path)
                _module = module
            except ImportError:
                _problem = (f"the {wheel} package is not installed (pip install "
                            f"{wheel})")
            except (_build.BuildError, tf.errors.NotFoundError, OSError) as e:
                _problem = f"the OpenBLAS product ops did not build or load: {e}"
    if _module is None:
        raise RuntimeError(_problem)
    return _module


def _share_pool(path: str) -> None:
    """Give the library op.cc's output pool (blas_util.h AllocateOutput: one pool for
    both libraries' large outputs).  Without op.cc's library the products' outputs
    stay on TF's allocator."""
    import tensorflow as tf
    from . import registry
    try:
        pool_for = ctypes.cast(registry.library().stitching_pool_for, ctypes.c_void_p)
    except (AttributeError, RuntimeError, OSError, tf.errors.OpError):
        return       # op.cc's library did not build or load: its own error says why
    # the image TF loaded (RTLD_NOLOAD: never a second copy of the ops)
    lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    lib.stitching_blas_set_pool.restype = None
    lib.stitching_blas_set_pool.argtypes = [ctypes.c_void_p]
    lib.stitching_blas_set_pool(pool_for)


def unavailable() -> str | None:
    """None when the ops load, else why not (a sentence for the report)."""
    try:
        load()
    except RuntimeError as e:
        return str(e)
    return None
