"""Register the StitchedKernel op with TensorFlow when ``stitching`` is imported.

Design
------
Packages that ship TF custom ops (tensorflow_text, tensorflow_addons) load their op
library on import, so ``tf.saved_model.load`` of a model holding their ops works after
a plain ``import``.  ``stitching`` does the same, without making ``import stitching``
pay for importing TensorFlow (~2.5 s here) or require it (the GPU machines have none):

* TensorFlow already imported: register now (``tf.ensure_runtime``: the op library's
  ``tf.load_op_library`` and the compile-on-miss hook; ~10 ms once the library is built).
* TensorFlow importable but not imported yet: a ``sys.meta_path`` finder watches for
  the top-level ``tensorflow`` import and registers right after its module has
  executed, so ``import stitching; import tensorflow as tf; tf.saved_model.load(...)``
  works.  The finder only wraps that one module's loader, then takes itself off the
  path; every other import passes through untouched (it returns None).
* TensorFlow not installed: nothing (``importlib.util.find_spec`` looks at the path
  without importing anything).

A failure to register (no C++ compiler to build the op library, a TF the library does
not build against) must not break ``import tensorflow``: it is a warning naming the
reason, and graphs with StitchedKernel nodes then fail with TF's "Op type not
registered 'StitchedKernel'".  ``STITCHING_NO_AUTOLOAD=1`` turns all of this off.
"""
from __future__ import annotations

import _thread  # not threading: keep `import stitching` to the bare minimum
import importlib.util
import os
import sys

_TF = "tensorflow"
_lock = _thread.allocate_lock()
_done = False


def install() -> None:
    """Register now, or once TensorFlow is imported (see the module note)."""
    if os.environ.get("STITCHING_NO_AUTOLOAD", "") not in ("", "0"):
        return
    module = sys.modules.get(_TF)
    if module is not None:
        if _initialized(module):
            register()
        return                      # being imported right now: the caller is TF itself
    try:
        if importlib.util.find_spec(_TF) is None:
            return
    except (ImportError, ValueError):
        return
    if not any(isinstance(f, _TensorFlowWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _TensorFlowWatcher())


def _initialized(module) -> bool:
    spec = getattr(module, "__spec__", None)
    return not getattr(spec, "_initializing", False)


def register() -> None:
    """Load the op library and install the compile-on-miss hook; warn on failure."""
    global _done
    with _lock:
        if _done:
            return
        _done = True
    try:
        from .tf import ensure_runtime
        ensure_runtime()
    except Exception as e:  # noqa: BLE001 - never break the user's `import tensorflow`
        import warnings
        warnings.warn(f"stitching: could not register the StitchedKernel op with "
                      f"TensorFlow ({type(e).__name__}: {e}); graphs holding "
                      f"StitchedKernel nodes will not load in this process",
                      RuntimeWarning, stacklevel=2)


class _TensorFlowWatcher:
    """Meta path finder: wraps the top-level ``tensorflow`` loader, nothing else."""

    def find_spec(self, name, path=None, target=None):
        if name != _TF:
            return None
        self._remove()
        spec = importlib.util.find_spec(name)   # the finders after this one
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _RegisteringLoader(spec.loader)
        return spec

    def _remove(self):
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


class _RegisteringLoader:
    """Runs the real loader, then registers the op (TF's module has executed)."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self._loader    # what TF's code would see without us
        module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        register()

    def __getattr__(self, name):            # get_resource_reader, is_package, ...
        return getattr(self._loader, name)
