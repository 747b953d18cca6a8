"""The TensorFlow edge: frontend, rewrite, stitching.function, SavedModel/GraphDef tools."""
_READY = False


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
    from ..compile import compile_kernel
    from ..ir import KernelSpec

    runtime.load()
    from . import original  # noqa: F401 -- registers StitchedKernel's gradient
    runtime.set_compiler(lambda text: compile_kernel(KernelSpec.from_json(text)))
    _READY = True
