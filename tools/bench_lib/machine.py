"""What the numbers were measured on, and the machine's copy bandwidth (the roofline
the memory-bound patterns are judged against)."""
from __future__ import annotations

import os
import platform
import subprocess
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cpu_model() -> str:
    """Model name plus the vector ISA (what Numba and XLA can vectorize with): on a VM
    the model name alone can be as vague as "AMD EPYC"."""
    from stitching.plan import profiles
    facts = profiles.cpu_facts()
    name = facts["model"] if facts["model"] != "?" else platform.processor() or "unknown"
    isa = [f for f in ("avx2", "fma", "avx512f") if f in facts["flags"]]
    return f"{name} ({', '.join(isa)})" if isa else name


def machine_line() -> str:
    """The three facts every table is read against: CPU model with its vector ISA and
    class, and whether TF runs oneDNN (its kernels and remapper differ from Eigen's)."""
    from stitching.plan import profiles
    from stitching.tf.passes import remapper
    facts = profiles.cpu_facts()
    onednn = "on" if remapper.onednn_enabled() else "off"
    return (f"{_cpu_model()}, class {facts['cpu_class']}, widest vector ISA "
            f"{facts['isa']}, TF oneDNN {onednn}")


def _git(*args) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except Exception:   # no git, not a checkout: metadata only
        return ""


def git_rev() -> str:
    """Short HEAD, with "+dirty" when stitching/ has uncommitted changes (engineers work
    in the same tree, so what ran may be newer than the commit)."""
    rev = _git("rev-parse", "--short", "HEAD") or "unknown"
    if _git("status", "--porcelain", "--", "stitching"):
        rev += "+dirty"
    return rev


def cores() -> int:
    """The cores this process may run on."""
    from stitching.plan.profiles import usable_cores
    return usable_cores()


def machine_info() -> dict:
    import numba
    import tensorflow as tf
    n_cores = cores()
    intra = tf.config.threading.get_intra_op_parallelism_threads()
    mem_gib = None
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    from stitching.plan import profiles
    from stitching.tf.passes import remapper
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu": machine_line(),
        # which BENCHMARKS.md section a run belongs to (output.section_key)
        "cpu_class": profiles.cpu_facts()["cpu_class"],
        "cpu_model": _cpu_model(),
        "tf_onednn": remapper.onednn_enabled(),
        "cores": n_cores,
        "memory_gib": mem_gib,
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "numba": numba.__version__,
        "numpy": np.__version__,
        "stitching_rev": git_rev(),
        # 0 means TF's default (one thread per core); all modes share it.
        "tf_intra_op_threads": intra if intra else f"default ({n_cores})",
        # Allocation of large outputs dominates memory-bound ops on some machines
        # (fresh mmap + page faults): say which allocators this run used.
        "allocators": allocators(),
        "load_avg_start": load_avg(),
    }


def allocators() -> str:
    """TF's CPU allocator (``TF_CPU_ALLOCATOR_USE_BFC=true`` selects TF's caching BFC
    allocator for every mode) and the StitchedKernel output pool's idle cap."""
    bfc = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() in ("1", "true")
    pool = os.environ.get("STITCHING_OUTPUT_POOL_MB", "1024")
    least = os.environ.get("STITCHING_OUTPUT_POOL_MIN_MB", "32")
    return (f"TF CPU allocator {'BFC' if bfc else 'default (malloc)'}, "
            f"stitching output pool {pool} MiB for outputs >= {least} MiB")


def load_avg():
    """1-minute load average: other engineers share this machine, and a busy start
    explains a noisy table."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


# ---- copy bandwidth

COPY_MIB = 256   # per buffer; far bigger than any cache


def _numba_copy_gbs(src, dst, threads, repeats):
    import numba

    @numba.njit(parallel=True, nogil=True, cache=False)
    def pcopy(a, b):
        n = a.shape[0]
        nchunks = numba.get_num_threads() * 8
        step = (n + nchunks - 1) // nchunks
        for c in numba.prange(nchunks):
            lo = c * step
            hi = min(n, lo + step)
            for i in range(lo, hi):
                b[i] = a[i]

    old = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        pcopy(src, dst)          # compile + first touch
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            pcopy(src, dst)
            times.append(time.perf_counter() - t0)
    finally:
        numba.set_num_threads(old)
    return 2 * src.nbytes / min(times) / 1e9


def _numpy_threads_copy_gbs(src, dst, threads, repeats):
    # np.copyto releases the GIL for contiguous copies, so threads copy in parallel.
    parts = np.array_split(np.arange(src.shape[0]), threads)
    bounds = [(p[0], p[-1] + 1) for p in parts if len(p)]

    def work(lo, hi):
        np.copyto(dst[lo:hi], src[lo:hi])

    def once():
        ts = [threading.Thread(target=work, args=b) for b in bounds]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    once()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return 2 * src.nbytes / min(times) / 1e9


_SPOT_BUFFERS = None


def spot_copy_gbs(threads: int, repeats: int = 3) -> float:
    """The threaded numpy copy again, quickly (buffers kept between calls): taken
    after each large pattern row, so the reference is the best the machine did at any
    point of the run, not at its two ends only (a shared machine's copy bandwidth
    measured 22-41 GB/s within one patterns run)."""
    global _SPOT_BUFFERS
    if _SPOT_BUFFERS is None:
        n = COPY_MIB * 2**20 // 4
        _SPOT_BUFFERS = np.ones(n, np.float32), np.empty(n, np.float32)
    return _numpy_threads_copy_gbs(*_SPOT_BUFFERS, threads, repeats)


def copy_bandwidth(threads: int, repeats: int = 10) -> dict:
    """Multi-threaded copy of a COPY_MIB buffer, bytes read + written per second (the
    STREAM "copy" convention; write-allocate traffic is not counted, as it is not for
    the kernels either).  Two methods; the higher is the reference, so the "% of copy"
    target is not made easier by a slow copy; and the best of the repeats, not the
    median, because other processes on a shared machine only ever slow a copy down
    (the harness measures again after the patterns and keeps the higher figure)."""
    n = COPY_MIB * 2**20 // 4
    src = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    dst = np.empty_like(src)
    out = {"buffer_mib": COPY_MIB, "threads": threads, "repeats": repeats}
    try:
        out["numba_prange_gbs"] = round(_numba_copy_gbs(src, dst, threads, repeats), 2)
    except Exception as e:   # numba missing / broken: the numpy method still works
        out["numba_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    out["numpy_threads_gbs"] = round(_numpy_threads_copy_gbs(src, dst, threads, repeats), 2)
    best = max(v for k, v in out.items() if k.endswith("_gbs"))
    out["gbs"] = best
    out["method"] = (f"max of numba prange copy and numpy.copyto in {threads} threads, "
                     f"{COPY_MIB} MiB float32 buffer, best of {repeats}, "
                     "bytes read + written")
    return out
