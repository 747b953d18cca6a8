"""stitching: fuse the memory-intensive parts of TensorFlow graphs into generated kernels.

The TF-facing API (``function``, ``Options``, ``rewrite_graph_def``, ...) is loaded
lazily, so ``import stitching.ir`` / ``stitching.schedule`` / ``stitching.codegen``
work on machines without TensorFlow (the GPU machines).  Where TensorFlow is
installed, importing ``stitching`` registers the ``StitchedKernel`` op with it (when
TensorFlow is imported, not before), so rewritten SavedModels and GraphDefs load with
``tf.saved_model.load`` / ``import_graph_def``.
"""
__version__ = "0.1.0"

_LAZY = {
    "function": ("stitching.tf.function", "function"),
    "Options": ("stitching.options", "Options"),
    "StitchedFunction": ("stitching.tf.function", "StitchedFunction"),
    "rewrite_graph_def": ("stitching.cli", "rewrite_graph_def"),
    "rewrite_saved_model": ("stitching.saved_model", "rewrite_saved_model"),
    "load_saved_model": ("stitching.saved_model", "load_saved_model"),
    "Report": ("stitching.report", "Report"),
    "load_dump": ("stitching.inspect.load", "load_dump"),
    "write_tensorboard": ("stitching.inspect.tensorboard", "write_tensorboard"),
    "install_kernels": ("stitching.tf.kernel_assets", "install_dir"),
    "keras": ("stitching.keras", None),          # stitching.keras.stitch(model)
}


# Submodules reachable as attributes without importing them first
# (``stitching.runtime.stats()`` after a plain ``import stitching``).
_SUBMODULES = ("inspect", "runtime")


def __getattr__(name):
    if name in _SUBMODULES:
        import importlib
        return importlib.import_module(f"stitching.{name}")
    if name in _LAZY:
        import importlib
        mod, attr = _LAZY[name]
        module = importlib.import_module(mod)
        return module if attr is None else getattr(module, attr)
    raise AttributeError(f"module 'stitching' has no attribute {name!r}")


__all__ = list(_LAZY)


def __dir__():
    """The public API first-class in ``dir(stitching)`` and completion (the lazy names
    are not module globals until first used)."""
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))

# Register the StitchedKernel op with TensorFlow now if TF is imported, else when it
# is (an import hook); nothing where TF is not installed (_autoload.py).
from . import _autoload  # noqa: E402

_autoload.install()
