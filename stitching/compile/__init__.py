"""Compile, cache, farm out: KernelSpec -> native code the op can call (TF-free).

The XLA "compilation cache" layer, apart from code generation (codegen/ makes source
text; this package turns it into machine code and keeps it):

    compile_kernel(spec) -> CompiledKernel      kernel.py: validate, schedule, emit
                                                (codegen.cpu), build (native.py),
                                                cached in memory and on disk
    compile_kernels(specs, progress=None, jobs=None, on_error=None)
                                                parallel.py: many, each distinct spec
                                                once; kernels not in the disk cache are
                                                compiled by worker processes (worker.py)
    compile_cuda_kernel(spec) -> CudaKernel     cuda.py: the CUDA backend's source,
                                                compiled by numba-cuda (import it from
                                                stitching.compile.cuda: it loads numba.cuda)
    CompiledKernel: spec, schedule, body_address, shape_address, in_ranks,
        out_ranks, in_dtypes, out_dtypes, errors, source; __call__(*arrays)

direct.py builds a kernel's shared object from its generated text through the direct
LLVM backend (codegen/cpu/llvm.py; the default), native.py through Numba's
ahead-of-time code generator, and loads them without Numba; helper_cache.py keeps the math helpers kernels inline in
Numba's disk cache.  Where things live on disk: ``stitching.cachedir``.
"""
import importlib

# Lazy (PEP 562): ``import stitching`` loads the op library through runtime/build.py,
# which needs only native.py and integrity.py; kernel.py pulls in codegen and schedule
# (~50 ms), which a process serving a model with shipped kernels never needs.
_LAZY = {"CompiledKernel": "kernel", "cache_root": "kernel", "clear_memory_cache": "kernel",
         "compile_kernel": "kernel", "is_cached": "kernel", "kernel_dir": "kernel",
         "compile_kernels": "parallel"}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["compile_kernel", "compile_kernels", "CompiledKernel", "cache_root",
           "kernel_dir", "clear_memory_cache", "is_cached"]
