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

Importing this package imports nothing, not even its own modules: the names below are
loaded on first use (PEP 562).  So ``python -m stitching.runtime.build`` (the install step,
also the ``stitching-build`` script) runs ``build`` as ``__main__`` without runpy's
"found in sys.modules ... unpredictable behaviour" warning, and importing this package
never imports TensorFlow (``load()`` does).
"""
import importlib

_LAZY = {
    "stitched_kernel": "api",
    "BuildError": "build", "cache_dir": "build", "library_path": "build",
    "build_library": ("build", "build"),    # `build` itself stays the submodule
    **{name: "registry" for name in (
        "RegistrationError", "TF_DTYPE_ENUM", "autotune_decisions", "autotune_pending",
        "is_registered", "library", "load", "num_registered", "pool_stats", "pool_trim",
        "profile", "profile_reset", "profiling", "register", "registered_kernel",
        "set_compiler", "set_assets_installer", "set_profiling", "stats")},
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    where = _LAZY.get(name)
    if where is None:               # a submodule: stitching.runtime.registry, .build, ...
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    module, attr = where if isinstance(where, tuple) else (where, name)
    value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    globals()[name] = value         # the next lookup is a plain attribute
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
