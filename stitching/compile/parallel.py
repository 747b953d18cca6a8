"""Parallel cold compiles: kernels missing from the disk cache are compiled by worker
processes into that cache, then this process loads each from it (a dlopen, ~1 ms).

Numba compiles under the GIL (0.3-1.2 s per kernel here), so a model with 15
distinct kernels pays several seconds in one process.  Workers are fresh interpreters
started with ``python -m stitching.compile.worker`` -- not ``multiprocessing``: spawn
would re-import the user's ``__main__`` (re-running an unguarded script, importing TF)
and fork is unsafe once TF's threads exist.  A worker imports Numba and stitching's TF-free
codegen only, reads specs (one JSON line each on stdin, handed out largest first as
workers free up), validates and compiles each (``compile_kernel``, which writes the
shared cache), and answers each with one JSON line.  A spec a worker could not compile
is simply compiled again in this process, where its error surfaces the usual way; a
worker that dies costs time, never results.

``jobs``: ``STITCHING_COMPILE_JOBS`` if set, else the usable cores (at most 8, and
no more than a container's CPU quota), and no more workers than the free memory holds
at ``WORKER_MB`` each (a container's memory limit counted: eight workers are ~2 GiB,
and a 2 GiB pod running out of it is killed, not slowed); small
batches (fewer than ``MIN_PARALLEL`` uncached kernels) compile in-process, where the
~1 s start-up of a worker would not pay.

A worker's start-up (Python, Numba, its first compile: ~0.9 s) can be paid before the
specs exist: ``prestart`` launches warmed workers that wait on stdin while the caller
plans (pipeline.py does, for graphs it has not compiled before), and ``warm_cache``
feeds them, or closes them when nothing needs compiling.

Background compiles (tiered execution: stock TF serves a function while its kernels
compile; tf/function.py, keras.py) run inside ``background()``: there every kernel
to compile goes to workers, even one (LLVM running in a thread of this process would
keep a short job from exiting: a daemon thread inside LLVM while the interpreter
tears down can crash the exit), and the workers run at a lower CPU priority
(``BACKGROUND_NICE``), so the user's stock TF steps, which share the cores, come
first.  ``cancel()`` (at interpreter exit) makes every background compile stop at
its next kernel: the workers are killed, what they finished is in the disk cache,
and the compile raises ``Cancelled``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

from ..ir.spec import validate
from ..plan.profiles import usable_cores
from . import kernel
from .kernel import CompileLimitError, cache_root, uncached_code
from .worker import NICE_ENV

MIN_PARALLEL = 3
MAX_JOBS = 8
WORKER_MB = 300                   # a worker's peak RSS, rounded up: measured 262 MiB
                                  # compiling EfficientNetB0's kernels (Numba + LLVM)
WORKER_SECONDS_PER_KERNEL = 120   # ~0.7 s is typical; only a hung worker gets near it
# Limits on compiling one kernel of a graph loaded from a file (docs/serving-trust.md).
# Kernels whose generated code is larger than IN_PROCESS_CODE_BYTES compile in a worker
# that is killed after COMPILE_SECONDS and may use COMPILE_MEMORY_MB of address space.
IN_PROCESS_CODE_BYTES = 8 << 10   # measured: 6.5 KB (64 chained Exps) 3.8 s, the
                                  # worst per byte seen; typical kernels are 1-2 KB
COMPILE_SECONDS = 30              # arbitrary (5x the planner's largest kernel
                                  # here); STITCHING_COMPILE_SECONDS overrides
COMPILE_MEMORY_MB = 4096          # arbitrary; STITCHING_COMPILE_MEMORY_MB overrides
COMPILE_BUDGET_SECONDS = 600      # arbitrary: per process, for graph files' kernels
BACKGROUND_NICE = 10              # arbitrary: below the user's process, not idle-only


class Cancelled(RuntimeError):
    """A background compile stopped by ``cancel()`` (the process is exiting)."""


_background = threading.local()   # .on: this thread compiles behind stock TF
_shipping = threading.local()     # .on: this thread's kernels go into an artifact
_cancelled = threading.Event()


class _ThreadFlag:
    """A context manager setting ``_state.on`` for the calling thread (nests)."""
    _state: threading.local

    def __enter__(self):
        self._was = getattr(self._state, "on", False)
        self._state.on = True
        return self

    def __exit__(self, *exc):
        self._state.on = self._was


class background(_ThreadFlag):
    """``with background():`` the compiles this thread starts are background ones
    (module note): workers only, at a lower priority, stopped by ``cancel()``."""
    _state = _background


def in_background() -> bool:
    return getattr(_background, "on", False)


class shipping(_ThreadFlag):
    """``with shipping():`` the kernels this thread compiles are for an artifact that
    ships them (stitching-rewrite, its SavedModel export: tf/kernel_assets.py), so
    they compile straight to tier 2 (Tiers): a tier-1 build there would only be thrown
    away, the artifact holding tier-2 code only."""
    _state = _shipping


def cancel() -> None:
    """Stop every background compile at its next kernel (interpreter exit)."""
    _cancelled.set()


def check_cancelled() -> None:
    """Raise ``Cancelled`` in a background compile once ``cancel()`` was called."""
    if _cancelled.is_set() and in_background():
        raise Cancelled("background compile stopped: the process is exiting "
                        "(kernels finished so far are in the disk cache)")


def default_jobs() -> int:
    env = os.environ.get("STITCHING_COMPILE_JOBS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise ValueError(f"STITCHING_COMPILE_JOBS must be an integer, got {env!r}") \
                from None
    jobs = min(usable_cores(), MAX_JOBS)
    quota = _cpu_quota()
    if quota is not None:
        jobs = min(jobs, quota)
    free = _available_mb()
    if free is not None:
        jobs = min(jobs, free // WORKER_MB)
    return max(1, jobs)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _cpu_quota() -> int | None:
    """The cores a cgroup's CPU quota allows (a container's CPU limit: cgroup v2
    ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), rounded up; None
    where no quota is set.  ``sched_getaffinity`` sees the host's cores there."""
    v2 = _read("/sys/fs/cgroup/cpu.max")
    if v2 is not None:
        parts = v2.split()
        quota, period = (parts + ["", ""])[:2]
    else:
        quota = (_read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") or "").strip()
        period = (_read("/sys/fs/cgroup/cpu/cpu.cfs_period_us") or "").strip()
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None                      # "max", -1 or unreadable: no quota
    return -(-q // p) if q > 0 and p > 0 else None


def _available_mb() -> int | None:
    """MiB this process may still take: ``MemAvailable`` from /proc/meminfo, lowered
    to what a cgroup's memory limit leaves (a container's: v2 ``memory.max`` minus
    ``memory.current``, v1 ``limit_in_bytes`` minus ``usage_in_bytes``); None where
    neither is known."""
    free = None
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            try:
                free = int(line.split()[1]) // 1024
            except (IndexError, ValueError):
                pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            left = (int((_read(limit) or "").strip()) -
                    int((_read(usage) or "").strip())) >> 20
        except ValueError:
            continue                     # "max" or unreadable: no limit there
        if left < (1 << 30):             # v1 writes "no limit" as ~2**63
            free = left if free is None else min(free, left)
        break
    return free


def _limit(name: str, default: int) -> int:
    env = os.environ.get(name)
    try:
        return int(env) if env else default
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {env!r}") from None


def _spawn():
    env = dict(os.environ, STITCHING_CACHE_DIR=str(cache_root()),
               STITCHING_WORKER_PARENT=str(os.getpid()),    # it dies with us (worker.py)
               STITCHING_COMPILE_MEMORY_MB=str(_limit("STITCHING_COMPILE_MEMORY_MB",
                                                      COMPILE_MEMORY_MB)))
    if in_background():
        env[NICE_ENV] = str(BACKGROUND_NICE)     # worker.py lowers its own priority
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = pkg_root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen([sys.executable, "-m", "stitching.compile.worker"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)


class Workers:
    """Worker processes started ahead of their specs (they warm up, then wait on
    stdin).  Hand them to ``warm_cache``, which uses or closes them; ``close`` is
    idempotent and also runs when the object is collected."""

    def __init__(self, jobs: int):
        self.procs = []
        self.grow(jobs)

    def grow(self, jobs: int) -> None:
        """Start more workers, up to ``jobs`` in all."""
        self.procs += [_spawn() for _ in range(jobs - len(self.procs))]

    def take(self, n: int) -> list:
        """n workers for the caller; the others are closed."""
        got, rest = self.procs[:n], self.procs[n:]
        self.procs = []
        for p in rest:
            _close(p)               # no specs: the worker exits
        return got

    def close(self) -> None:
        self.take(0)

    __del__ = close


def prestart(jobs: int | None = None, workers: Workers | None = None) -> Workers | None:
    """Start ``jobs`` (default: default_jobs()) warmed workers now, or None where
    compiles run in this process (one job).  ``workers``: ones already started, to
    top up to ``jobs``."""
    jobs = default_jobs() if jobs is None else jobs
    if workers is not None:
        workers.grow(jobs)
        return workers
    return Workers(jobs) if jobs >= 2 else None


def warm_cache(specs, jobs: int | None = None, progress=None,
               workers: Workers | None = None) -> int:
    """Compile the specs that are not in the disk cache in ``jobs`` worker processes
    (``workers``' if given: any number of uncached specs goes to them).

    ``specs``: validated KernelSpecs, distinct.  ``progress(done, total)`` is called
    from this thread as workers finish kernels (total: the kernels to compile).
    Returns how many specs were sent to workers (0 when the batch was compiled
    in-process instead)."""
    try:
        return _warm_cache(specs, jobs, progress, workers)
    finally:
        if workers is not None:
            workers.close()


def _warm_cache(specs, jobs, progress, workers) -> int:
    batch = _start(specs, jobs, progress, workers)
    if batch is None:
        return 0
    batch.finish()
    return batch.size


def _start(specs, jobs, progress, workers, tiered: bool = False):
    """Hand the uncached codes of ``specs`` to workers (warm_cache); a _Batch under
    way, or None where they compile in-process.  ``tiered``: each code's tier-1 build
    is asked first, then its tier 2 (Tiers)."""
    jobs = default_jobs() if jobs is None else jobs
    bg = in_background()            # every compile to workers (module note)
    if workers is None and not bg and (jobs < 2 or len(specs) < MIN_PARALLEL):
        return None                 # in-process anyway: no need to probe the cache
    todo = {}
    for s in specs:                 # one compile per code: generic twins (specialize.py)
        code = uncached_code(s)     # and specs equal up to naming (kernel.code_name)
        if code is not None:
            todo.setdefault(code[2], code[:2])
    # Largest first (generated source length: compile time grows with it), handed out
    # as workers free up: one big kernel does not leave the others idle at the end.
    todo = [t for t, text in sorted(todo.values(), key=lambda c: -len(c[1]))]
    if workers is not None and workers.procs and todo:
        if len(todo) >= MIN_PARALLEL:
            # an early worker alone (pipeline.early_workers, and no prestart for a
            # small graph) would compile them one by one: the others start now and
            # join the queue once warm
            workers.grow(min(jobs, len(todo)))
        procs = workers.take(min(len(workers.procs), len(todo)))
    else:
        jobs = min(jobs, len(todo))
        if not todo or (not bg and (jobs < 2 or len(todo) < MIN_PARALLEL)):
            return None
        procs = [_spawn() for _ in range(jobs)]
    return _Batch(todo, procs, progress, bg, tiered)


class _Batch:
    """Codes being compiled by worker processes: each worker's driver thread hands it
    the next request as it answers the last (pop(): tier-1 requests first, largest
    first) and closes it when none is left."""

    def __init__(self, todo, procs, progress, bg, tiered):
        self.size, self.procs, self.progress, self.bg = len(todo), procs, progress, bg
        self.tiered = tiered
        self.queue = [(2, t) for t in reversed(todo)]
        if tiered:
            self.queue += [(1, t) for t in reversed(todo)]
        self.first_left = len(todo) if tiered else 0      # tier-1 answers awaited
        self.first = threading.Event()                    # every tier 1 answered
        if not tiered:
            self.first.set()
        self.done = 0
        self.lock = threading.Lock()
        # A worker that hangs must not hang the caller: past a generous budget it is
        # killed and whatever it did not finish compiles in this process.
        per_worker = -(-len(self.queue) // len(procs))
        self.deadline = time.monotonic() + WORKER_SECONDS_PER_KERNEL * per_worker
        self.drivers = [threading.Thread(target=self._drive, args=(p,), daemon=True)
                        for p in procs]
        for d in self.drivers:
            d.start()

    def _drive(self, p):
        lowered = False
        try:
            while True:
                with self.lock:
                    item = self.queue.pop() if self.queue and not (
                        self.bg and _cancelled.is_set()) else None
                if item is None:
                    break
                tier, spec = item
                if tier == 2 and self.tiered and not lowered:
                    _lower_priority(p)      # its tier-1 work is done: behind the user's
                    lowered = True
                # tier 1 goes to this process's own directory, named in the request
                # (a worker started while tiering is off never makes one)
                req = spec.to_json() if tier == 2 else {
                    "spec": spec.to_json(), "tier": 1, "dir": str(kernel._tier1_dir())}
                p.stdin.write(json.dumps(req) + "\n")
                p.stdin.flush()
                line = p.stdout.readline()
                while line and not line.startswith("{"):   # not an answer: skipped
                    line = p.stdout.readline()
                if not line:
                    break           # it died: what it did not finish compiles here
                with self.lock:
                    if tier == 1:
                        self.first_left -= 1
                        if not self.first_left:
                            self.first.set()
                    else:
                        self.done += 1
                        if self.progress is not None:
                            self.progress(self.done, self.size)
        except (BrokenPipeError, OSError, ValueError):
            pass                    # it died or was killed
        _close(p)                   # no more specs: it exits
        # Reaped on a thread of its own: the caller has no reason to wait for the
        # exit (4-9 ms; worker._exit_now skips Python's teardown).
        threading.Thread(target=p.wait, daemon=True).start()

    def wait_first(self) -> None:
        """Until every tier-1 request is answered, the workers died, or the deadline."""
        while not self.first.is_set() and any(d.is_alive() for d in self.drivers) and \
                time.monotonic() < self.deadline:
            self.first.wait(0.05)

    def finish(self) -> None:
        """Until every request is answered (or given up: hung workers are killed; a
        background compile also stops waiting, and kills its workers, at cancel())."""
        for p, d in zip(self.procs, self.drivers):
            while d.is_alive() and time.monotonic() < self.deadline and \
                    not (self.bg and _cancelled.is_set()):
                d.join(min(0.1, max(0.0, self.deadline - time.monotonic())))
            if d.is_alive():
                p.kill()
                d.join()
        check_cancelled()


def _lower_priority(p) -> None:
    """A worker's priority lowered to a background compile's (BACKGROUND_NICE)."""
    try:
        now = os.getpriority(os.PRIO_PROCESS, p.pid)
        os.setpriority(os.PRIO_PROCESS, p.pid, max(now, BACKGROUND_NICE))
    except OSError:
        pass                        # it exited, or may not be changed: same results


def _close(p):
    """No more specs for worker ``p``: it exits.  Both pipes are closed here (nothing
    reads its answers after this); an open one outlived the process as a
    ResourceWarning ("unclosed file") at exit."""
    for pipe in (p.stdin, p.stdout):
        try:
            pipe.close()
        except (BrokenPipeError, OSError):
            pass  # the worker died; its specs compile in-process afterwards


def tiered_default() -> bool:
    """Whether compile_kernels compiles tiered when not told: yes (Tiers), unless
    ``STITCHING_TIERED_COMPILE=0``, in a background compile or while ``shipping()``."""
    env = os.environ.get("STITCHING_TIERED_COMPILE", "").strip()
    if env not in ("", "0", "1"):
        raise ValueError(f"STITCHING_TIERED_COMPILE must be 0 or 1, got {env!r}")
    return env != "0" and not in_background() and not getattr(_shipping, "on", False)


def compile_kernels(specs, progress=None, jobs: int | None = None, on_error=None,
                    workers=None, tiered: bool | None = None) -> list:
    """Compile many specs, each distinct spec once.  Returns kernels aligned with
    ``specs``.

    Kernels missing from the disk cache are first compiled by ``jobs`` worker
    processes (parallel.py; default: the usable cores, ``STITCHING_COMPILE_JOBS``
    overrides, 1 compiles in this process only); this process then loads them.
    ``progress(i, n, spec)`` is called before each distinct kernel is taken in, and
    during the parallel phase as ``progress(done, total, None)`` (total: the compiles
    the workers do, one per distinct code).  ``workers``: pre-started workers
    (parallel.prestart) to use, or to close when nothing needs compiling.  ``on_error(spec, exc)``,
    if given, is called for a spec that fails and its slot is None; without it the
    first failure raises.  ``tiered`` (default tiered_default(): on, but for background
    compiles, where stock TF serves meanwhile, and ``shipping()``): kernels missing
    from the disk cache are built at tier 1 and run at once, their tier-2 code compiled
    behind them (module note, Tiers); ``wait_upgrades`` waits for it."""
    specs = [validate(s) for s in specs]
    distinct = {}
    for s in specs:
        distinct.setdefault(s.hash, s)
    n = len(distinct)
    # A background compile (stock TF serving meanwhile) has no one waiting for a
    # kernel: it compiles tier 2 in workers only, off this process's cores
    tiered = tiered_default() if tiered is None else tiered
    tier = 1 if tiered else 2
    batch = None
    if tier == 2:
        warm_cache(list(distinct.values()), jobs=jobs, workers=workers,
                   progress=None if progress is None else
                   (lambda done, total: progress(done, total, None)))
    else:           # workers build tier 1, then tier 2 behind it (Tiers)
        batch = _start(list(distinct.values()), jobs, None, workers, tiered=True)
        if workers is not None:
            workers.close()         # those the batch did not take
        if batch is not None:
            batch.wait_first()
    done = {}
    for i, (h, s) in enumerate(distinct.items()):
        check_cancelled()
        if progress is not None:
            progress(i, n, s)
        try:
            done[h] = kernel.compile_kernel(s, tier)   # through the module: tests patch it
        except Exception as e:
            if on_error is None:
                raise
            on_error(s, e)
            done[h] = None
    if tier == 1:
        _upgrade_later([k for k in done.values() if k is not None and k.tier == 1],
                       jobs, batch)
    return [done[s.hash] for s in specs]


# ---- Tiers -----------------------------------------------------------------------
# A tiered compile (JVMs' tiered compilation; XLA's autotuner compiles fast first too)
# puts each kernel to work after a quick, unoptimized build (direct.py, tier 1:
# ~5-10x less LLVM time, scalar loops) and builds its optimized code (tier 2, the
# code a plain compile makes) behind it; each kernel then switches to it
# (kernel._Code.upgrade; the op's registry switches the registered kernels between two
# calls, runtime/op.cc Registry::Upgrade).  Where a batch goes to workers, each worker
# is asked for tier-1 builds first (into this process's kernel._tier1_dir()), the
# caller goes on once all are answered, and the same workers go on to the tier-2
# builds at a background compile's priority; where a batch compiles in this process
# (a few kernels, no workers started), tier 1 is built here and tier 2 by background
# workers.  Only tier-2 code is ever written to the
# disk cache, so a warm process and the steady state run the same machine code as
# without tiers.  Tier-1 code is ~3x slower than tier 2 (BENCHMARKS.md, compile
# phases); where the cost model expects that to lose to TF's own ops
# (kernel.slow_at_tier1) the op runs the region's original ops until the upgrade
# (op.cc Entry::hold).  On by default wherever a caller waits for its kernels
# (STITCHING_TIERED_COMPILE=0 turns it off); not in background compiles (stock TF
# serves there) nor while ``shipping()`` (an artifact holds tier-2 code only).

_upgrades: list = []            # threads compiling tier 2 behind tier-1 kernels
_upgrades_lock = threading.Lock()


def _upgrade_later(kernels, jobs, batch) -> None:
    """Let ``batch`` finish its tier-2 requests (where there was none: compile
    ``kernels``' tier-2 code in background workers), then switch each kernel to it; a
    kernel whose tier 2 fails keeps running tier 1."""
    if not kernels and batch is None:
        return
    started = time.monotonic()

    def build(compile_them) -> bool:
        with background():
            try:
                compile_them()
            except Cancelled:
                return False
            except Exception as e:  # noqa: BLE001 - tier 1 keeps serving
                kernel._log.warning("tier-2 compile failed (%s: %s)", type(e).__name__, e)
        return True

    def run():
        if not build(batch.finish if batch is not None else
                     lambda: warm_cache([k.spec for k in kernels], jobs=jobs)):
            return
        t0 = time.monotonic()
        upgraded = sum(bool(k.upgrade()) for k in kernels)
        behind = [k for k in kernels if k.tier == 1]
        # a worker that died (killed, out of memory) answers nothing: once more, then
        # say so (tier 1 runs ~3x slower, for the life of the process)
        if behind and build(lambda: warm_cache([k.spec for k in behind], jobs=jobs)):
            upgraded += sum(bool(k.upgrade()) for k in behind)
            behind = [k for k in behind if k.tier == 1]
        if behind:
            kernel._log.warning("tier-2 code for %d of %d kernels could not be built; "
                                "they keep their quick tier-1 code (about 3x slower)",
                                len(behind), len(kernels))
        kernel._log.info("tier 2 in for %d of %d kernels, %.2f s after their tier 1",
                         upgraded, len(kernels), t0 - started)

    t = threading.Thread(target=run, name="stitching-tier2", daemon=True)
    with _upgrades_lock:
        _upgrades[:] = [u for u in _upgrades if u.is_alive()]   # a server's many batches
        _upgrades.append(t)
    t.start()


def wait_upgrades(timeout: float | None = None) -> bool:
    """Wait for the tier-2 compiles started so far (``StitchedFunction.wait``,
    ``stitching.keras.wait``, tests, tools); True if none is left running."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _upgrades_lock:
        threads = list(_upgrades)
    for t in threads:
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    with _upgrades_lock:
        _upgrades[:] = [u for u in _upgrades if u.is_alive()]
        return not _upgrades


def compile_bounded(spec):
    """``compile_kernel(spec)`` for a spec from a graph file (validated), within the
    limits: code over ``kernel.MAX_CODE_BYTES`` is refused; code over
    ``IN_PROCESS_CODE_BYTES`` is compiled into the disk cache by a worker killed past
    ``COMPILE_SECONDS`` and capped at ``COMPILE_MEMORY_MB`` of address space, then
    loaded; smaller code compiles here (seconds at most).  Once this process has spent
    ``COMPILE_BUDGET_SECONDS`` compiling kernels of graph files, it compiles no more.
    Raises CompileLimitError (``STITCHING_COMPILE_SECONDS``, ``..._MEMORY_MB``,
    ``..._BUDGET_SECONDS`` override the limits)."""
    global _spent
    code = uncached_code(spec)
    if code is None:            # in memory or on disk already, or not one kernel
        return kernel.compile_kernel(spec)
    target, text, name = code
    kernel.check_code_size(name, text)
    budget = _limit("STITCHING_COMPILE_BUDGET_SECONDS", COMPILE_BUDGET_SECONDS)
    if _spent > budget:
        raise CompileLimitError(f"kernel {name} not compiled: this process spent its "
                                f"{budget} s of compiling kernels of graph files "
                                f"(STITCHING_COMPILE_BUDGET_SECONDS)")
    t0 = time.monotonic()
    try:
        if len(text) > IN_PROCESS_CODE_BYTES:
            _compile_in_worker(target, name, len(text))
        return kernel.compile_kernel(spec)
    finally:
        with _spent_lock:
            _spent += time.monotonic() - t0


_spent = 0.0                   # seconds compile_bounded spent compiling
_spent_lock = threading.Lock()


def _compile_in_worker(target, name: str, size: int) -> None:
    seconds = _limit("STITCHING_COMPILE_SECONDS", COMPILE_SECONDS)
    p = _spawn()
    answer = []

    def ask():
        try:
            p.stdin.write(json.dumps(target.to_json()) + "\n")
            p.stdin.flush()
            line = p.stdout.readline()
            while line and not line.startswith("{"):
                line = p.stdout.readline()
            answer.append(json.loads(line) if line else None)
        except (OSError, ValueError):
            answer.append(None)
    t = threading.Thread(target=ask, daemon=True)
    t.start()
    t.join(seconds)
    timed_out = t.is_alive()
    if timed_out:
        p.kill()
    t.join()
    _close(p)
    threading.Thread(target=p.wait, daemon=True).start()
    got = answer[0] if answer else None
    if got is None or not got.get("ok"):
        why = f"it took more than {seconds} s (STITCHING_COMPILE_SECONDS)" if timed_out \
            else (got or {}).get("error") or "the compile worker died"
        raise CompileLimitError(f"compiling kernel {name} ({size} bytes of code) failed "
                                f"within the compile limits: {why}")
    if not kernel.native.built(kernel.kernel_dir() / name):
        # (code Numba could only JIT: the next compile would be this process's own)
        raise CompileLimitError(f"kernel {name} ({size} bytes of code) could not be built "
                                f"as a shared object by a compile worker")
