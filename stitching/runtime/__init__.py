"""Runtime: the ``StitchedKernel`` TF op and the registry of compiled kernels.

Layers (each module starts with its own design note):

* ``op.cc``       the C++ op library: one generic op that runs a Numba-compiled kernel
                  (body + shape function, C ABI) over TF's intra-op thread pool, and a
                  process-wide registry spec string -> compiled kernel, with C exports.
* ``build.py``    compiles ``op.cc`` once per (TF version, source, flags) into a cache.
* ``registry.py`` loads the library (TF + ctypes on the same image), registers kernels,
                  installs the compile-on-miss callback.
* ``api.py``      ``stitched_kernel``: the Python entry that adds the op to a program.

Kernel ABI (what codegen produces; duck-typed object)::

    kernel.spec            KernelSpec; spec.to_json() is the registry key
    kernel.body_address    void  body(int64 begin, int64 end, void** ins, void** outs,
                                      const int64* params)
    kernel.shape_address   int64 shape_fn(const int64* in_dims, int64* params,
                                          int64* out_dims, int64* sched)
                           or, with kernel.shape_program (int64s), the interpreter
                           int64 interp(const int64* program, <the same four>)
    kernel.in_ranks, kernel.out_ranks, kernel.in_dtypes, kernel.out_dtypes
    kernel.errors          shape_fn returning k > 0 reports errors[k-1]
    optional: kernel.in_static_dims, kernel.launch (op.cc says what they mean)

Importing this package does not import TensorFlow; ``load()`` does.
"""
from .api import stitched_kernel
from .build import BuildError, cache_dir, library_path
from .build import build as build_library  # `build` itself stays the submodule
from .registry import (RegistrationError, TF_DTYPE_ENUM, autotune_decisions, is_registered,
                       library, load,
                       num_registered, pool_stats, pool_trim, profile, profile_reset, profiling,
                       register, registered_kernel, set_assets_installer, set_compiler,
                       set_profiling, stats)

__all__ = ["stitched_kernel", "load", "library", "register", "set_compiler", "set_assets_installer",
           "stats",
           "autotune_decisions",
           "is_registered", "num_registered", "pool_stats", "pool_trim", "registered_kernel", "build_library",
           "library_path", "cache_dir", "BuildError", "RegistrationError",
           "TF_DTYPE_ENUM", "profile", "profile_reset", "profiling", "set_profiling"]
