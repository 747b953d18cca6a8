"""The OpenBLAS product ops (``gemm.cc``): StitchedMatMul and StitchedBatchMatMul.

Design
------
``gemm.cc`` is a second op library, built like the StitchedKernel one (build.py: cached
by a hash of TF, the source and the flags) and linked against the OpenBLAS of the
``scipy-openblas32`` wheel (the NumPy/SciPy project's build of OpenBLAS, with prefixed
symbols such as ``scipy_cblas_sgemm``, so it never clashes with another BLAS in the
process; its folder is the library's run path).  It is apart from ``op.cc`` so that the
kernels run where the wheel is missing: then ``unavailable()`` says why, and the graph
pass (tf/passes/blas.py) leaves the products to TF with that reason in its report.

Importing this module imports neither TensorFlow nor the wheel; ``load()`` does.
"""
from __future__ import annotations

import threading
from pathlib import Path

from . import build as _build

SOURCE = Path(__file__).with_name("gemm.cc")
LIB_PREFIX = "stitching_blas"
WHEEL = "scipy-openblas32"

_lock = threading.Lock()
_module = None
_problem = None          # why the ops are unavailable, once a load failed


def link_flags() -> tuple:
    """Compiler flags that find the wheel's header and library (ImportError without
    the wheel)."""
    import scipy_openblas32 as sob
    lib_dir = sob.get_lib_dir()
    return (f"-I{sob.get_include_dir()}", f"-L{lib_dir}", f"-l{sob.get_library()}",
            f"-Wl,-rpath,{lib_dir}", f"-DSTITCHING_OPENBLAS={sob.__version__}")


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
            try:
                flags = link_flags()
            except ImportError:
                _problem = (f"the {WHEEL} package is not installed (pip install "
                            f"{WHEEL}): products stay TF's")
                raise RuntimeError(_problem) from None
            try:
                path = _build.build(source=SOURCE, prefix=LIB_PREFIX, extra=flags)
                _module = tf.load_op_library(str(path))
            except (_build.BuildError, tf.errors.NotFoundError, OSError) as e:
                _problem = f"the OpenBLAS product ops did not build or load: {e}"
                raise RuntimeError(_problem) from None
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
