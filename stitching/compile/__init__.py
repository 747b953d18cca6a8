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

native.py builds shared objects through Numba's ahead-of-time code generator and
loads them without Numba; helper_cache.py keeps the math helpers kernels inline in
Numba's disk cache.  Where things live on disk: ``stitching.cachedir``.
"""
from .kernel import (CompiledKernel, cache_root, clear_memory_cache, compile_kernel,
                     is_cached, kernel_dir)
from .parallel import compile_kernels

__all__ = ["compile_kernel", "compile_kernels", "CompiledKernel", "cache_root",
           "kernel_dir", "clear_memory_cache", "is_cached"]
