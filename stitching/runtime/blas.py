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
(blas_util.h ``AllocateOutput`` says why); ``load()`` hands the library the pool, and
op.cc's autotuner (tune.h), which StitchedAttention nodes marked by the attention pass
measure with: one table of decisions (``stitching.runtime.autotune_decisions()``), one
disk cache.  ``tune_counts()`` has the attention nodes' own counters.

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
_path = None             # the library loaded


def load():
    """The loaded op module (``tf.load_op_library``), building it on first use.
    Raises RuntimeError with the reason when it cannot be had."""
    global _module, _problem, _path
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
                _share_op_library(path)
                _module, _path = module, path
            except ImportError:
                _problem = (f"the {wheel} package is not installed (pip install "
                            f"{wheel})")
            except (_build.BuildError, tf.errors.NotFoundError, OSError) as e:
                _problem = f"the OpenBLAS product ops did not build or load: {e}"
    if _module is None:
        raise RuntimeError(_problem)
    return _module


def _share_op_library(path: str) -> None:
    """Give the library op.cc's output pool (blas_util.h AllocateOutput: one pool for
    both libraries' large outputs) and its autotuner (tune.h).  Without op.cc's library
    the products' outputs stay on TF's allocator and attentions run fused, untimed."""
    import tensorflow as tf
    from . import registry
    try:
        ops = registry.library()
        pool_for = ctypes.cast(ops.stitching_pool_for, ctypes.c_void_p)
        ops.stitching_tune_api.restype = ctypes.c_void_p
        ops.stitching_tune_api.argtypes = []
        tuner = ops.stitching_tune_api()
    except (AttributeError, RuntimeError, OSError, tf.errors.OpError):
        return       # op.cc's library did not build or load: its own error says why
    lib = _image(path)
    lib.stitching_blas_set_pool.restype = None
    lib.stitching_blas_set_pool.argtypes = [ctypes.c_void_p]
    lib.stitching_blas_set_pool(pool_for)
    lib.stitching_blas_set_tuner.restype = None
    lib.stitching_blas_set_tuner.argtypes = [ctypes.c_void_p]
    lib.stitching_blas_set_tuner(tuner)
    registry.STATS.append(tune_counts)      # stitching.runtime.stats()


def _image(path: str):
    """The library image TF loaded (RTLD_NOLOAD: never a second copy of the ops)."""
    return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)


_TUNE_COUNTS = ("attention_autotune_cached", "attention_autotune_timed_calls",
                "attention_autotune_unfused_calls", "attention_autotune_untuned")


def tune_counts() -> dict:
    """StitchedAttention's autotune counters (attention.cc), zeros where the library is
    not loaded: "attention_autotune_cached" (node, shape class) decisions taken from the
    cache, "..._timed_calls" calls run while measuring, "..._unfused_calls" calls served
    by the unfused function because it measured faster, "..._untuned" nodes marked for
    autotuning that run fused untimed (their unfused function is not here, or op.cc's
    library gave no autotuner).  Decisions made by measuring count in op.cc's
    "autotune_measured"."""
    if _module is None:
        return dict.fromkeys(_TUNE_COUNTS, 0)
    lib = _image(_path)
    lib.stitching_attention_tune_counts.restype = None
    lib.stitching_attention_tune_counts.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    out = (ctypes.c_int64 * len(_TUNE_COUNTS))()
    lib.stitching_attention_tune_counts(out)
    return dict(zip(_TUNE_COUNTS, (int(v) for v in out)))


def unavailable() -> str | None:
    """None when the ops load, else why not (a sentence for the report)."""
    try:
        load()
    except RuntimeError as e:
        return str(e)
    return None
