"""The GPU launcher (runtime/gpu/launcher.cc) from Python: build, load, feed, call.

    CudaKernel (compile/cuda.py) ──manifest──► stitching_gpu_register     (signature)
              ──kernel.plan(shapes)──► plan text ──► stitching_gpu_set_plan (per input dims)
              ──cuda.compile_ptx, per kernel a plan names──► stitching_gpu_add_kernel
    device pointers + a CUstream ──► stitching_gpu_launch (checks, then cuLaunchKernel)

The library is the same launcher the op library's GPU build compiles in (op.cc,
``StitchedKernelGpuOp``); here it is built on its own for ctypes, so the GPU machines,
which have no TensorFlow, run exactly the C++ that the op would run.  It needs
``cuda.h`` to build (nvcc's include folder) and the driver (``libcuda.so.1``, opened at
the first launch) to run.  Importing this module imports neither TF nor numba.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from .. import cachedir

SOURCE_DIR = Path(__file__).with_name("gpu")
SOURCES = (SOURCE_DIR / "launcher.cc",)
HEADERS = (SOURCE_DIR / "launcher.h",)
ABI_VERSION = 1
_ENTRY = re.compile(r"\.entry\s+([A-Za-z0-9_$.]+)\s*\(")


class LauncherError(RuntimeError):
    """The launcher refused a call (message from the C++ side) or could not be built."""


def cuda_home() -> Path | None:
    """The CUDA toolkit holding include/cuda.h: $CUDA_HOME, nvcc's, /usr/local/cuda."""
    cands = [os.environ.get("CUDA_HOME", "")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    cands.append("/usr/local/cuda")
    return next((Path(c) for c in cands if c and (Path(c) / "include" / "cuda.h").is_file()),
                None)


def compile_command(output: Path, sources=SOURCES, extra=(), quiet=False) -> list:
    """nvcc when present (the toolkit's own driver), else the C++ compiler with cuda.h.
    ``quiet``: silence the warnings TF's headers raise about themselves."""
    home = cuda_home()
    if home is None:
        raise LauncherError("building the GPU launcher needs the CUDA headers (cuda.h): "
                            "set CUDA_HOME or put nvcc on PATH")
    nvcc = shutil.which("nvcc") or (str(home / "bin" / "nvcc")
                                    if (home / "bin" / "nvcc").is_file() else None)
    flags = ["-std=c++17", "-O2", f"-I{home / 'include'}", *extra]
    host = ["-fPIC"] + (["-Wno-deprecated-declarations", "-Wno-interference-size"] if quiet
                        else ["-Wall"])
    if nvcc:
        return [nvcc, *flags, "-Xcompiler", ",".join(host), "-shared", "-o", str(output),
                *map(str, sources), "-ldl"]
    cxx = shlex.split(os.environ.get("CXX", "g++"))
    return [*cxx, *flags, *host, "-shared", "-o", str(output), *map(str, sources), "-ldl"]


def op_library_command(output: Path, include=None, libdir=None) -> list:
    """The op library's CUDA build: op.cc with GOOGLE_CUDA (its StitchedKernelGpuOp)
    and the launcher, against TF's headers and framework library.  ``include`` /
    ``libdir``: those of the GPU-enabled ``tensorflow`` wheel (its include folder
    unpacked), else $STITCHING_TF_GPU_INCLUDE / $STITCHING_TF_GPU_LIBDIR, else the
    installed TensorFlow's (the CPU wheel has the same framework headers)."""
    include = include or os.environ.get("STITCHING_TF_GPU_INCLUDE")
    libdir = libdir or os.environ.get("STITCHING_TF_GPU_LIBDIR")
    if not include or not libdir:
        import tensorflow as tf   # local: only this build needs TF
        include = include or tf.sysconfig.get_include()
        libdir = libdir or str(Path(tf.__file__).parent)
    tf_flags = [f"-I{include}", "-D_GLIBCXX_USE_CXX11_ABI=1", "-DEIGEN_MAX_ALIGN_BYTES=64",
                "-DGOOGLE_CUDA=1"]
    cmd = compile_command(output, (SOURCE_DIR.parent / "op.cc",) + SOURCES, tf_flags,
                          quiet=True)
    return cmd + [f"-L{libdir}", "-l:libtensorflow_framework.so.2"]


def library_path() -> Path:
    h = hashlib.sha256()
    for f in SOURCES + HEADERS:
        h.update(f.read_bytes())
    h.update(" ".join(compile_command(Path("x"))).encode())
    return cachedir.root() / "gpu" / f"stitching_gpu-{h.hexdigest()[:16]}.so"


def build() -> Path:
    """The launcher library, compiled on first use into the cache."""
    path = library_path()
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp.so", dir=path.parent)
    os.close(fd)
    try:
        proc = subprocess.run(compile_command(Path(tmp)), capture_output=True, text=True)
        if proc.returncode:
            raise LauncherError(f"building the GPU launcher failed:\n{proc.stderr[-3000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def manifest(kernel) -> str:
    """The signature the launcher checks every launch against."""
    lines = ["stitching-gpu 1"]
    for t in kernel.spec.inputs:
        lines.append(" ".join(["in", t.dtype, str(len(t.shape)),
                               *(str(d if d is not None and d >= 0 else -1)
                                 for d in t.shape)]))
    lines += [f"out {t.dtype} {len(t.shape)}" for t in kernel.spec.output_types]
    return "\n".join(lines) + "\n"


def kernel_args(kernel, name: str, launch) -> str:
    """The argument layout of kernel ``name``: i<j>, o<m>, w<n>, s; '!' where the
    kernel moves the array 16 bytes at a time."""
    ws = {w[0]: n for n, w in enumerate(launch.workspace)}
    wide = set(kernel.source.wide) if name.endswith("_v4") else set()
    out = []
    for a in kernel.source.kernels[name]:
        if a.startswith("p_i") or a.startswith("p_o"):
            out.append(("i" if a[2] == "i" else "o") + a[3:] + ("!" if a in wide else ""))
        elif a in ws:
            out.append(f"w{ws[a]}")
        else:
            out.append("s")
    return " ".join(out)


def plan_text(kernel, shapes) -> tuple:
    """(plan text, kernel names it launches) for input ``shapes``: output dims,
    workspaces, then per step the kernel, its scalar-access twin, grid, block, shared
    bytes and the scalar arguments in the kernel's order."""
    sizes, out_shapes = kernel.sizes(shapes)
    launch = kernel.plan(shapes)
    vals = dict(launch.args)
    vals.update({f"D{a}": d for a, d in enumerate(sizes.D)})
    lines = [" ".join(["out", *map(str, s)]) for s in out_shapes]
    lines += [f"ws {ws[1].itemsize} {ws[2]}" for ws in launch.workspace]
    names = []
    for name, grid, block, smem, extra in launch.steps:
        scal = [extra.get(a, vals.get(a)) for a in kernel.source.kernels[name]
                if not (a.startswith("p_") or a.startswith("ws") or a.startswith("wa"))]
        alt = name[:-3] if name.endswith("_v4") and name[:-3] in kernel.source.kernels else "-"
        names += [name] + ([alt] if alt != "-" else [])
        lines.append(" ".join(["step", name, alt, str(grid), str(block), str(smem),
                               *map(str, scal)]))
    return "\n".join(lines) + "\n", names, launch


def ptx(kernel, name: str, cc: tuple) -> tuple:
    """(PTX text, entry name) of kernel ``name`` for compute capability ``cc``."""
    from numba import cuda
    text, _ = cuda.compile_ptx(getattr(kernel._module, name).py_func, kernel.signature(name),
                               cc=cc)
    m = _ENTRY.search(text)
    if m is None:
        raise LauncherError(f"no .entry in the PTX of {name}")
    return text, m.group(1)


class Launcher:
    """The launcher library through ctypes; registers CudaKernels on demand."""

    def __init__(self, path=None, cc=(9, 0)):
        self.lib = lib = ctypes.CDLL(str(path or build()))
        if lib.stitching_gpu_abi_version() != ABI_VERSION:
            raise LauncherError("the GPU launcher library has another ABI version")
        self.cc = tuple(cc)
        i64p, vpp, cpp = (ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_void_p),
                          ctypes.POINTER(ctypes.c_char_p))
        lib.stitching_gpu_last_error.restype = ctypes.c_char_p
        lib.stitching_gpu_register.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        lib.stitching_gpu_add_kernel.argtypes = [ctypes.c_char_p, ctypes.c_char_p,
                                                 ctypes.c_char_p, ctypes.c_int64,
                                                 ctypes.c_char_p, ctypes.c_char_p]
        lib.stitching_gpu_set_plan.argtypes = [ctypes.c_char_p, i64p, ctypes.c_int64,
                                               ctypes.c_char_p]
        lib.stitching_gpu_plan_info.argtypes = [ctypes.c_char_p, i64p, ctypes.c_int64, i64p,
                                                ctypes.c_int64, i64p]
        lib.stitching_gpu_launch.argtypes = [
            ctypes.c_char_p, ctypes.c_int, cpp, ctypes.POINTER(ctypes.c_int), i64p, vpp,
            ctypes.c_int, cpp, vpp, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        lib.stitching_gpu_function_new.restype = ctypes.c_void_p
        lib.stitching_gpu_function_free.argtypes = [ctypes.c_void_p]
        lib.stitching_gpu_function_add.argtypes = [ctypes.c_void_p, ctypes.c_char_p, i64p,
                                                   ctypes.c_int64, vpp, vpp, ctypes.c_void_p]
        lib.stitching_gpu_function_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                                   ctypes.c_int]
        self._registered: set = set()
        self._kernels: set = set()
        self._plans: dict = {}

    def _check(self, rc) -> None:
        if rc:
            raise LauncherError(self.lib.stitching_gpu_last_error().decode())

    # -- registration (on demand, as the op's compiler and planner callbacks would) ------
    def register(self, kernel) -> None:
        h = kernel.spec.hash
        if h not in self._registered:
            self._check(self.lib.stitching_gpu_register(h.encode(), manifest(kernel).encode()))
            self._registered.add(h)

    def prepare(self, kernel, shapes) -> dict:
        """Registers the spec, the kernels its plan for ``shapes`` launches and the plan;
        returns {"out_shapes", "temp_bytes", "launch"}."""
        self.register(kernel)
        shapes = [tuple(int(d) for d in s) for s in shapes]
        key = (kernel.spec.hash, tuple(shapes))
        got = self._plans.get(key)
        if got is not None:
            return got
        text, names, launch = plan_text(kernel, shapes)
        for name in names:
            if (kernel.spec.hash, name) not in self._kernels:
                self.add_kernel(kernel, name, launch, *ptx(kernel, name, self.cc))
        self.set_plan(kernel.spec.hash, shapes, text)
        dims = self._dims(shapes)
        _, out_shapes = kernel.sizes(shapes)
        total = sum(len(s) for s in out_shapes)
        out = (ctypes.c_int64 * max(1, total))()
        temp = ctypes.c_int64(0)
        self._check(self.lib.stitching_gpu_plan_info(kernel.spec.hash.encode(), dims,
                                                     sum(len(s) for s in shapes), out, total,
                                                     ctypes.byref(temp)))
        got = self._plans[key] = {"out_shapes": out_shapes, "temp_bytes": temp.value,
                                  "launch": launch}
        return got

    def add_kernel(self, kernel, name, launch, image: str, entry: str) -> None:
        img = image.encode()
        self._check(self.lib.stitching_gpu_add_kernel(
            kernel.spec.hash.encode(), name.encode(), img, len(img), entry.encode(),
            kernel_args(kernel, name, launch).encode()))
        self._kernels.add((kernel.spec.hash, name))

    def set_plan(self, spec_hash: str, shapes, text: str) -> None:
        dims = self._dims(shapes)
        self._check(self.lib.stitching_gpu_set_plan(spec_hash.encode(), dims,
                                                    sum(len(s) for s in shapes), text.encode()))

    @staticmethod
    def _dims(shapes):
        flat = [int(d) for s in shapes for d in s]
        return (ctypes.c_int64 * max(1, len(flat)))(*flat)

    # -- launching -----------------------------------------------------------------------
    def launch(self, spec_hash: str, in_dtypes, in_shapes, ins, out_dtypes, outs, temp=0,
               temp_bytes=0, stream=0) -> None:
        """Launch a registered spec's plan: device pointers (ints), dtype names, shapes;
        the launcher checks them against the spec's signature first."""
        n_in, n_out = len(in_dtypes), len(out_dtypes)
        if len(ins) != n_in or len(outs) != n_out or len(in_shapes) != n_in:
            raise LauncherError("one pointer and one shape per dtype")
        dims = self._dims(in_shapes)
        self._check(self.lib.stitching_gpu_launch(
            spec_hash.encode(), n_in, (ctypes.c_char_p * max(1, n_in))(
                *[d.encode() for d in in_dtypes]),
            (ctypes.c_int * max(1, n_in))(*[len(s) for s in in_shapes]), dims,
            (ctypes.c_void_p * max(1, n_in))(*ins), n_out,
            (ctypes.c_char_p * max(1, n_out))(*[d.encode() for d in out_dtypes]),
            (ctypes.c_void_p * max(1, n_out))(*outs), temp or None, temp_bytes,
            stream or None))

    def function(self) -> "Function":
        return Function(self)


class Function:
    """A whole function's launches recorded once, then run directly or as one CUDA
    graph (launcher.cc, RunFunction); buffers stay fixed."""

    def __init__(self, launcher: Launcher):
        self.launcher = launcher
        self.handle = launcher.lib.stitching_gpu_function_new()

    def add(self, spec_hash: str, in_shapes, ins, outs, temp=0) -> None:
        dims = Launcher._dims(in_shapes)
        self.launcher._check(self.launcher.lib.stitching_gpu_function_add(
            self.handle, spec_hash.encode(), dims, sum(len(s) for s in in_shapes),
            (ctypes.c_void_p * max(1, len(ins)))(*ins),
            (ctypes.c_void_p * max(1, len(outs)))(*outs), temp or None))

    def run(self, stream, graph: bool) -> None:
        self.launcher._check(self.launcher.lib.stitching_gpu_function_run(
            self.handle, stream or None, int(graph)))

    def __del__(self):
        lib = getattr(getattr(self, "launcher", None), "lib", None)
        if lib is not None and self.handle:
            lib.stitching_gpu_function_free(self.handle)
            self.handle = None
