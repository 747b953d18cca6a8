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

    runtime.load()
    runtime.set_compiler(_compile_spec)
    from . import original  # noqa: F401 -- registers StitchedKernel's gradient
    _READY = True


def _compile_spec(text: str):
    """The compile-on-miss hook; imports the compiler on its first miss only, so
    registering the op (on ``import stitching``) stays cheap.  Also called by the
    StitchedKernelAssets op with the kernel files a model ships (kernel_assets.py)."""
    from .kernel_assets import MARKER
    if text.startswith(MARKER):
        from .kernel_assets import install
        install(text)
        return None
    from ..ir.spec import KernelSpec, validate
    spec = validate(KernelSpec.from_json(text))       # untrusted: always checked
    from ..compile import shipped
    kernel = shipped.lookup(spec)   # a model's shipped index: no codegen (shipped.py)
    if kernel is not None:
        return kernel
    from ..compile import compile_kernel
    return compile_kernel(spec)
