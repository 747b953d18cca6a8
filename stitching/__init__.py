"""stitching: fuse the memory-intensive parts of TensorFlow graphs into generated kernels.

The TF-facing API (``function``, ``Options``, ``rewrite_graph_def``, ...) is loaded
lazily, so ``import stitching.ir`` / ``stitching.schedule`` / ``stitching.codegen``
work on machines without TensorFlow (the GPU machines).
"""
__version__ = "0.1.0"

_LAZY = {
    "function": ("stitching.tf.function", "function"),
    "Options": ("stitching.options", "Options"),
    "StitchedFunction": ("stitching.tf.function", "StitchedFunction"),
    "rewrite_graph_def": ("stitching.tf.rewrite", "rewrite_graph_def"),
    "load_saved_model": ("stitching.tf.saved_model", "load_saved_model"),
    "Report": ("stitching.report", "Report"),
    "keras": ("stitching.tf.keras", None),          # stitching.keras.stitch(model)
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        mod, attr = _LAZY[name]
        module = importlib.import_module(mod)
        return module if attr is None else getattr(module, attr)
    raise AttributeError(f"module 'stitching' has no attribute {name!r}")


__all__ = list(_LAZY)
