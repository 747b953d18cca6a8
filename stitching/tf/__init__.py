"""The TensorFlow edge: frontend, the graph passes (passes/), the driver, stitching.function.

The front doors users import (``stitching.keras``, ``stitching.saved_model``,
``stitching.cli``) sit at the package's top, over this driver.
"""
import importlib
import importlib.abc
import importlib.util
import sys

_READY = False

# Modules that lived in this folder before the passes moved to passes/ and the front
# doors to the package's top: their old names still import, as the same module object
# (so a monkeypatch through either name patches the one module).
_MOVED = {f"{__name__}.{old}": new for old, new in {
    **{p: f"{__name__}.passes.{p}" for p in (
        "autotune", "bcast", "einsum", "forward", "gemm", "grappler", "original",
        "padfold", "prune", "remapper", "rewrite", "seqsplit", "shapes", "sparse_xent")},
    "keras": "stitching.keras", "saved_model": "stitching.saved_model",
    "cli": "stitching.cli"}.items()}


class _OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(_MOVED[spec.name])
        spec.loader_state = module.__spec__     # the import system sets __spec__ next
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state   # imported under its own name


if not any(isinstance(f, _OldNames) for f in sys.meta_path):
    sys.meta_path.append(_OldNames())


def ensure_runtime():
    """Load the op library and install the compile-on-miss hook (once per process).

    After this, any graph holding StitchedKernel nodes (a rewritten GraphDef or
    SavedModel) runs here: kernels missing from this process are compiled from
    their validated spec (or taken from the on-disk cache) the first time TF
    constructs the op.
    """
    global _READY
    if _READY:
        return
    from .. import runtime

    runtime.load()
    runtime.set_compiler(_compile_spec)
    runtime.set_assets_installer(_install_assets)
    from .kernel_assets import register_loader
    register_loader()          # tf.saved_model.load installs shipped kernels in Python
    from .passes import original  # noqa: F401 -- registers StitchedKernel's gradient
    # The OpenBLAS product ops (tf/passes/blas.py), for graphs that hold them (a stored
    # result, a SavedModel); without the wheel they are simply not registered, and the
    # pass, which asks again, says why.
    from ..runtime import blas
    from .passes import blas as _blas_pass  # noqa: F401 -- registers their gradients
    blas.unavailable()
    _READY = True


def _compile_spec(text: str):
    """The compile-on-miss hook; imports the compiler on its first miss only, so
    registering the op (on ``import stitching``) stays cheap."""
    from ..ir.spec import KernelSpec
    spec = KernelSpec.from_json(text)       # untrusted: parsed and validated (spec.py)
    from ..compile import shipped
    kernel = shipped.lookup(spec)   # a model's shipped index: no codegen (shipped.py)
    if kernel is not None:
        return kernel
    from ..compile import parallel
    try:
        return parallel.compile_bounded(spec)    # time and memory bounded (parallel.py)
    except ValueError:      # the spec itself: an error, never the fallback
        raise
    except parallel.CompileLimitError as e:
        _warn_limit(e)
        raise
    except Exception as e:
        _warn_fallback(e)
        raise


def _warn_limit(e) -> None:
    """Every kernel over the compile limits is named (not once per process, as
    _warn_fallback: each is a node of the graph that runs slowly or fails)."""
    import warnings
    warnings.warn(f"stitching: {e}; the node runs its original subgraph instead where it "
                  f"has one (see docs/serving-trust.md for the limits)", RuntimeWarning,
                  stacklevel=2)


def _install_assets(payload: str):
    """The StitchedKernelAssets op's hook: the kernel files a SavedModel ships
    (kernel_assets.py)."""
    from .kernel_assets import install
    install(payload)


_fallback_warned = False


def _warn_fallback(e) -> None:
    """One Python warning per process when kernels cannot be built here: the op then
    runs each node's original subgraph (op.cc logs every node through TF's log and
    counts it in ``stitching.runtime.stats()``), which a serving process should hear
    about once, where Python code looks (``warnings``), not only in TF's log."""
    global _fallback_warned
    import os
    if _fallback_warned or os.environ.get("STITCHING_STRICT", "") not in ("", "0"):
        return
    _fallback_warned = True
    import warnings
    warnings.warn(f"stitching: kernels cannot be built in this process "
                  f"({type(e).__name__}: {e}); StitchedKernel nodes that carry their "
                  f"original subgraph run it instead, at stock TensorFlow's speed "
                  f"(stitching.runtime.stats() counts them; STITCHING_STRICT=1 makes "
                  f"this an error)", RuntimeWarning, stacklevel=2)


# TensorFlow itself, last: importing any module of this package imports TF here, once
# ensure_runtime exists, so the import hook that registers the op (stitching/_autoload.py)
# runs before a submodule starts importing.  Otherwise the first ``import tensorflow``
# could come from a submodule half-way through its own import (``stitching.tf.passes.X``
# imported before TF: passmanager -> tfgraph -> tensorflow -> the hook -> ensure_runtime
# -> passes.original -> the half-imported passmanager), and the op would not register.
import tensorflow  # noqa: E402,F401
