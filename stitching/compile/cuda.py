"""CUDA backend: KernelSpec -> numba-cuda kernels, from the same Schedule as the CPU.

    compile_cuda_kernel(spec) -> CudaKernel          cached in memory by spec hash
    CudaKernel(*arrays) -> [outputs]                 NumPy in: NumPy out; device in: device out

    spec ─validate─► build_schedule ─cuda_emit.emit─► source (kernels + shape program)
         └ written under the CPU kernel directory and imported (numba-cuda compiles each
           kernel lazily, once: dtypes are fixed by the spec, sizes are arguments)
    call ─shape program (the CPU kernel's checks, shape_interp.run)─► sizes, shapes
         ─cuda_launch.plan (latency evaluator, pinned GPU profile)─► grid/block/shared
         ─► allocate outputs (+ workspaces) ─► launch each step on ``stream``

Runs under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) with no GPU.  Nothing on this
path imports TensorFlow.  Profile: $STITCHING_GPU_PROFILE (v100 | a100 | h100), else
matched from the device name, else a100.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
import warnings

import numpy as np

from ..ir import dtypes as dt
from ..ir.spec import KernelSpec, validate
from ..plan import profiles
from ..schedule import KernelKind, build_schedule
from ..codegen.cuda import emitter as cuda_emit, launch as cuda_launch
from ..codegen.lower import shape_interp
from .kernel import _load_module, _module_name, _user_dtype

# numba-cuda 0.30 registers an overload for np.row_stack, which NumPy 2.5 removed (an
# alias of vstack since 2.0): without the alias its first kernel compile fails to import.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

_lock = threading.RLock()
_kernels: dict = {}           # (spec hash, profile name) -> CudaKernel

# Device-array dtype of each storage dtype (float16 as float16: numba-cuda converts it).
_DEVICE = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16),
           "bool": np.dtype(np.uint8)}


def _cuda():
    from numba import cuda
    return cuda


def _on_device(a) -> bool:
    """A device array: numba's (or the simulator's) or any __cuda_array_interface__ object."""
    return bool(getattr(a, "__cuda_ndarray__", False)) or \
        hasattr(a, "__cuda_array_interface__")


def _as_device(a):
    return a if getattr(a, "__cuda_ndarray__", False) else _cuda().as_cuda_array(a)


def _aligned16(a) -> bool:
    iface = getattr(a, "__cuda_array_interface__", None)
    return iface is None or iface["data"][0] % 16 == 0   # the simulator has no addresses


def simulated() -> bool:
    from ..codegen.cuda.rt import SIMULATOR
    return SIMULATOR


def device_profile() -> profiles.DeviceProfile:
    """$STITCHING_GPU_PROFILE, else the pinned profile matching the device name."""
    name = os.environ.get("STITCHING_GPU_PROFILE")
    if name:
        return profiles.get(name)
    if not simulated():
        dev = _cuda().get_current_device().name
        dev = (dev.decode() if isinstance(dev, bytes) else str(dev)).lower()
        for key, prof in (("v100", "v100"), ("a100", "a100"), ("h100", "h100"),
                          ("h200", "h100"), ("gh200", "h100")):
            if key in dev:
                return profiles.get(prof)
    return profiles.get("a100")


class _BlockTooLarge(Exception):
    """A planned block exceeds what a compiled kernel can launch with (registers)."""

    def __init__(self, launch, most):
        super().__init__(f"block of {max(b for _, _, b, _, _ in launch.steps)} threads; "
                         f"the kernel launches at most {most}")
        self.cap = max(cuda_launch.WARP, 1 << (int(most).bit_length() - 1))  # power of two


class CudaKernel:
    """One spec's CUDA kernels and the host code that checks shapes and launches them."""

    def __init__(self, spec, schedule, source, module, profile, seconds):
        self.spec, self.schedule, self.source = spec, schedule, source
        self.text = source.text
        self.errors = list(source.errors)
        self.profile = profile
        self.limits = cuda_launch.SIMULATOR_LIMITS if simulated() else cuda_launch.Limits()
        self.compile_seconds = seconds
        self._module = module
        self.in_dtypes = [t.dtype for t in spec.inputs]
        self.out_dtypes = [t.dtype for t in spec.output_types]
        self.in_ranks = [len(t.shape) for t in spec.inputs]
        self.out_ranks = [len(t.shape) for t in spec.output_types]
        self._sizes: dict = {}         # input shapes -> (Sizes, output shapes)
        self._plans: dict = {}         # input shapes -> CudaLaunch
        # (name, dtype, n) -> device array, reused by later calls: safe on one stream
        # (calls are ordered), not for concurrent calls on different streams
        self._workspaces: dict = {}
        self._specialized: dict = {}   # kernel name -> dispatcher specialized to its types
        self._max_threads: dict = {}   # kernel name -> largest block it launches with

    def __repr__(self):
        return f"<CudaKernel {self.spec.hash} {self.schedule.kind.value}>"

    # -- shapes and launch plan ---------------------------------------------------------
    def sizes(self, in_shapes) -> tuple:
        """(Sizes, output shapes) for input shapes; ValueError with the CPU's messages."""
        key = tuple(tuple(int(d) for d in s) for s in in_shapes)
        got = self._sizes.get(key)
        if got is None:
            got = self._sizes[key] = self._run_shape_fn(key)
        return got

    def _run_shape_fn(self, shapes) -> tuple:
        in_dims = np.array([d for s in shapes for d in s] + [0], np.int64)
        dims = np.zeros(64, np.int64)
        out_dims = np.zeros(sum(self.out_ranks) + 1, np.int64)
        rc = int(shape_interp.run(np.array(self.source.program, np.int64), in_dims, dims,
                                  out_dims, np.array([0, 0, 1, 0], np.int64)))
        if rc:
            what = self.errors[rc - 1] if 0 < rc <= len(self.errors) else f"error code {rc}"
            raise ValueError(f"{what}; input shapes: {', '.join(map(str, shapes))}")
        outs, o = [], 0
        for r in self.out_ranks:
            outs.append(tuple(int(d) for d in out_dims[o:o + r]))
            o += r
        return self._domain_sizes(dims), outs

    def _domain_sizes(self, dims) -> cuda_launch.Sizes:
        s, R = self.schedule, self.schedule.rank
        D = tuple(int(d) for d in dims[:R])
        kept = 1
        if s.kind == KernelKind.COLUMN:
            for a in s.parallel_axes:
                kept *= D[a] if a != R - 1 else 1
        return cuda_launch.Sizes(D, int(dims[R + 3]), D[-1] if R else 1, kept)

    def plan(self, in_shapes, **force) -> cuda_launch.CudaLaunch:
        """Launch for these input shapes; ``force`` pins threads / tpr / variant / tx /
        split (tests, experiments)."""
        key = tuple(tuple(int(d) for d in s) for s in in_shapes)
        if not force and key in self._plans:
            return self._plans[key]
        sizes, _ = self.sizes(key)
        lau = cuda_launch.plan(self.source, self.schedule.kind, sizes,
                               cuda_launch.evaluate(self.spec, key, self.profile),
                               self.profile, self.limits, force)
        if not force:
            self._plans[key] = lau
        return lau

    def signature(self, name: str) -> str:
        """numba type signature of kernel ``name`` (for ``cuda.compile_ptx`` without a GPU)."""
        arrays = {f"p_i{j}": self._device_dtype(d) for j, d in enumerate(self.in_dtypes)}
        arrays.update({f"p_o{m}": self._device_dtype(d) for m, d in enumerate(self.out_dtypes)})
        arrays.update({f"ws{k}": cuda_launch.np_dtype(cd) for k, cd in self.source.scratch})
        arrays.update({f"wa{k}": cuda_launch.np_dtype(a) for k, a in self.source.accumulators})
        args = [f"{np.dtype(arrays[a]).name}[::1]" if a in arrays else "int64"
                for a in self.source.kernels[name]]
        return f"void({', '.join(args)})"

    # -- running ------------------------------------------------------------------------
    def __call__(self, *arrays, launch=None, stream=0, out=None):
        """Run on NumPy arrays (copied to the device and back) or device arrays (any
        ``__cuda_array_interface__`` object; outputs stay on the device).  ``out``:
        preallocated C-contiguous device outputs (as a TF op is handed its outputs)."""
        if len(arrays) != len(self.in_dtypes):
            raise TypeError(f"kernel takes {len(self.in_dtypes)} inputs, got {len(arrays)}")
        on_host = not any(_on_device(a) for a in arrays)
        ins = [self._input(i, a) for i, a in enumerate(arrays)]
        shapes = [s for _, s in ins]
        sizes, out_shapes = self.sizes(shapes)
        planned = launch is None
        launch = launch or self.plan(shapes)
        outs = self._outputs(out_shapes, out, stream)
        while True:
            try:
                self._launch(launch, sizes, [a for a, _ in ins], outs, stream)
                break
            except _BlockTooLarge as e:
                if not planned:
                    raise ValueError(f"launch= does not fit the compiled kernel: {e}") \
                        from None
                # the compiled kernel holds too many registers for the block the plan
                # chose (its limit is known only once compiled): plan again under that
                # limit, which later plans keep; nothing was launched yet.  The cap only
                # falls, so this ends (at a warp, which every kernel launches).
                self.limits = dataclasses.replace(self.limits, max_threads=e.cap)
                self._plans.clear()
                launch = self.plan(shapes)
        if out is not None:
            return list(out)
        return [self._output(o, s, d, on_host, stream)
                for o, s, d in zip(outs, out_shapes, self.out_dtypes)]

    def _outputs(self, shapes, out, stream) -> list:
        """Flat device buffers for the outputs (never zero-length: a launch needs one)."""
        if out is None:
            return [_cuda().device_array(max(1, int(np.prod(s))), self._device_dtype(d),
                                         stream=stream)
                    for s, d in zip(shapes, self.out_dtypes)]
        if len(out) != len(shapes):
            raise TypeError(f"kernel has {len(shapes)} outputs, got {len(out)} in out=")
        flat = []
        for m, (o, s, d) in enumerate(zip(out, shapes, self.out_dtypes)):
            o = _as_device(o)
            if tuple(o.shape) != tuple(s) or not o.is_c_contiguous():
                raise ValueError(f"out[{m}] must be C-contiguous of shape {s}")
            n = int(np.prod(s))
            o = o.reshape(n) if n else _cuda().device_array(1, self._device_dtype(d))
            want = self._device_dtype(d)
            flat.append(o if o.dtype == want else o.view(want))
        return flat

    def _launch(self, launch, sizes, ins, outs, stream) -> None:
        vals = dict(launch.args)
        vals.update({f"p_i{j}": a for j, a in enumerate(ins)})
        vals.update({f"p_o{m}": o for m, o in enumerate(outs)})
        vals.update({f"D{a}": d for a, d in enumerate(sizes.D)})
        for name, dtype, n in launch.workspace:
            vals[name] = self._workspace(name, dtype, n)
        steps = []
        for name, grid, block, smem, extra in launch.steps:
            if name.endswith("_v4") and not all(_aligned16(vals[a]) for a in self.source.wide):
                name = name[:-3]  # a view at an odd offset: scalar accesses, same results
            args = [extra[a] if a in extra else vals[a] for a in self.source.kernels[name]]
            fn = self._kernel(name, args)
            most = self._max_threads.get(name)
            if most is None:
                most = self._max_threads[name] = (
                    cuda_emit.MAX_THREADS if simulated() else fn.get_max_threads_per_block())
            if block > most:
                raise _BlockTooLarge(launch, most)
            steps.append((fn, grid, block, smem, args))
        with warnings.catch_warnings():
            # the simulator evaluates in NumPy, which warns on overflow/NaN like C doesn't
            warnings.simplefilter("ignore", RuntimeWarning)
            for fn, grid, block, smem, args in steps:
                fn[grid, block, stream, smem](*args)

    def _kernel(self, name, args):
        """Kernel ``name`` specialized to its argument types on first use: the types
        never change (1-D C-contiguous arrays of the spec's dtypes, int64 sizes), so
        later launches skip numba-cuda's per-call type dispatch."""
        fn = self._specialized.get(name)
        if fn is None:
            fn = self._specialized[name] = getattr(self._module, name).specialize(*args)
        return fn

    def _workspace(self, name, dtype, n):
        key = (name, np.dtype(dtype).str, n)
        ws = self._workspaces.get(key)
        if ws is None:
            ws = self._workspaces[key] = _cuda().device_array(n, dtype)
        return ws

    def _device_dtype(self, name: str) -> np.dtype:
        return _DEVICE.get(name) or np.dtype(dt.STORAGE[name])

    def _input(self, i, a):
        """(flat device array in kernel storage, shape)."""
        cuda = _cuda()
        want = self._device_dtype(self.in_dtypes[i])
        if _on_device(a):
            d = _as_device(a)
            if not d.is_c_contiguous():
                raise ValueError(f"input {i} must be C-contiguous on the device")
            shape, flat = tuple(d.shape), d.reshape(int(np.prod(d.shape)) if d.size else 0)
            self._check(i, flat.dtype, len(shape))
            return (flat.view(want) if flat.dtype != want else flat), shape
        h = np.asarray(a) if isinstance(a, np.ndarray) else \
            np.asarray(a, dtype=_user_dtype(self.in_dtypes[i]))
        self._check(i, h.dtype, h.ndim)
        flat = np.ascontiguousarray(h).reshape(-1).view(want)
        return cuda.to_device(flat if flat.size else np.zeros(1, want)), h.shape

    def _check(self, i, dtype, ndim) -> None:
        name = self.in_dtypes[i]
        want = _user_dtype(name)
        if dtype != want and dtype.itemsize != want.itemsize:
            raise TypeError(f"input {i} has dtype {dtype}, kernel expects {name}")
        if dtype != want and dtype not in (self._device_dtype(name), dt.STORAGE[name]):
            raise TypeError(f"input {i} has dtype {dtype}, kernel expects {name}")
        if ndim != self.in_ranks[i]:
            raise ValueError(f"input {i} has rank {ndim}, kernel expects {self.in_ranks[i]}")

    def _output(self, o, shape, dtype, on_host, stream):
        n = int(np.prod(shape))
        if not on_host:
            return o[:n].reshape(shape) if n else o[:0].reshape(shape)
        h = o.copy_to_host(stream=stream)[:n].reshape(shape)
        return h.view(_user_dtype(dtype))


def compile_cuda_kernel(spec: KernelSpec, profile=None) -> CudaKernel:
    """CUDA kernels for a spec (ScheduleError if it is not one kernel).  ``profile``: a
    DeviceProfile or pinned name for the launch choice (default: device_profile())."""
    spec = validate(spec)
    prof = profiles.get(profile) if isinstance(profile, str) else (profile or
                                                                   device_profile())
    key = (spec.hash, prof.name)
    with _lock:
        k = _kernels.get(key)
        if k is None:
            t0 = time.perf_counter()
            sched = build_schedule(spec)
            src = cuda_emit.emit(sched)
            module = _load_module(src.text, _module_name(src.text, f"cuda_{spec.hash}"))
            k = _kernels[key] = CudaKernel(spec, sched, src, module, prof,
                                           time.perf_counter() - t0)
        return k


def clear_memory_cache() -> None:
    with _lock:
        _kernels.clear()
