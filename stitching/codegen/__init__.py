"""Code generation: Schedule -> native kernels (TF-free).

    compile_kernel(spec) -> CompiledKernel      cached in memory and on disk
    compile_kernels(specs, progress=None, jobs=None, on_error=None)
                                                many, each distinct spec once; kernels
                                                not in the disk cache are compiled by
                                                worker processes (parallel.py, worker.py)
    CompiledKernel: spec, schedule, body_address, shape_address, in_ranks,
        out_ranks, in_dtypes, out_dtypes, errors, source; __call__(*arrays)

One lowering, per-target emitters: lower.py (op -> expression, reductions) is
shared; cpu.py owns the CPU loop nests and cpu_rt.py its helper namespace.
"""
from .kernel import (CompiledKernel, cache_root, clear_memory_cache, compile_kernel,
                     compile_kernels, is_cached, kernel_dir)

__all__ = ["compile_kernel", "compile_kernels", "CompiledKernel", "cache_root",
           "kernel_dir", "clear_memory_cache", "is_cached"]
