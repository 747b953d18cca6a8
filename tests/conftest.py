"""The test session's environment: hermetic, whatever machine it runs on.

- No test reads or writes the user's ``~/.cache/stitching`` (kernels, the measured
  profile, stored plans, the op library): the session gets a HOME and a kernel cache of
  its own, in a temporary directory removed at exit, and subprocesses inherit both.
  The op library and the math helpers are built there on first use (about 20 s, once
  per session).  ``STITCHING_TEST_CACHE_DIR`` names a kernel cache to keep between
  runs instead (never the user's ``STITCHING_CACHE_DIR``: tests clear parts of it).
- No ``STITCHING_*`` setting of the user's shell reaches the tests (a dump directory
  turns the result cache off, strict mode changes what a fallback does...): all are
  removed but ``STITCHING_TEST_*``, then the session sets its own.
- The planner plans with a *named machine model*, never the measured profile of the
  machine the suite happens to run on: ``STITCHING_DEVICE_PROFILE`` is pinned for the
  session (``intel-avx512`` unless ``STITCHING_TEST_MACHINE`` names another model).
  Tests of a decision that depends on the machine take the ``machine`` fixture and run
  under each model (plan/profiles.py: MACHINES).
- Every first call waits for its kernels: tiered execution, the default a user gets
  (stock TF first, kernels compiled in the background), is off for the session
  (``STITCHING_BACKGROUND_COMPILE=0``, inherited by subprocesses), so a test that
  checks kernels, reports or numbers after one call is deterministic without sleeping.
  Tests of tiering take the ``tiered`` fixture, or pass ``Options(background_compile=
  True)``.
- ``pytest -n auto`` (pytest-xdist; the README's and CI's command) runs the test files
  in parallel workers, a file per worker at a time (``--dist loadfile``, pytest.ini).
  Each worker is a session of its own: its own HOME and kernel cache, so no test sees
  what a test of another worker cached or cleared.  ``auto`` means one worker per CPU
  this process may run on, at most ``MAX_WORKERS``: each worker holds a TensorFlow.
  The op libraries are built once for all workers, by the controller, while they
  start (``pytest_configure``).
- Kernels compile straight to their optimized code (tier 2): the tiered compile a
  synchronous caller gets by default (quick tier-1 code first, tier 2 swapped in behind
  it: compile/parallel.py, Tiers) is off for the session
  (``STITCHING_TIERED_COMPILE=0``), so tests comparing bits, kernel counts or machine
  code test the code every cache holds.  Tests of the tiered compile take the
  ``tiered_compile`` fixture.
- Kernels compile in the test's own process (``STITCHING_COMPILE_JOBS=1``): the
  xdist workers already keep every core busy, so the compile worker processes a
  user's first call starts (compile/parallel.py) only added their start-up (~1 s of
  CPU each, and 201 of them in a run of the suite, 51 never given a kernel): 15% of
  the suite's CPU.  Tests of the compile pool pass ``jobs`` or take the
  ``compile_workers`` fixture (a user's default pool); background compiles still
  go to a worker, as they must.
"""
import atexit
import os
import shutil
import tempfile

for _name in [k for k in os.environ if k.startswith("STITCHING_")
              and not k.startswith("STITCHING_TEST_")]:
    del os.environ[_name]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The CUDA tests run under Numba's simulator unless NUMBA_ENABLE_CUDASIM=0 (a GPU).
# Numba reads the flag once, when numba itself is first imported, so it is set here,
# before any test module imports numba.
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

_SESSION = tempfile.mkdtemp(prefix="stitching-test-")
atexit.register(shutil.rmtree, _SESSION, True)
os.makedirs(os.path.join(_SESSION, "home"))
os.environ["HOME"] = os.path.join(_SESSION, "home")
# The session's cache is the session HOME's default one (~/.cache/stitching), so that a
# test giving a child process a cache of its own (an empty STITCHING_CACHE_DIR) still
# finds the op libraries the install step would have left there (runtime/build.py:
# _prebuilt), as a user's process does: without it every such child compiled op.cc and
# gemm.cc again (~20 s each, a dozen tests).  STITCHING_TEST_CACHE_DIR points the kernel
# cache elsewhere on purpose (to reuse kernels between runs).
# Under pytest-xdist each worker keeps its own subdirectory of it.
_KEPT = os.environ.get("STITCHING_TEST_CACHE_DIR")
if _KEPT and os.environ.get("PYTEST_XDIST_WORKER"):
    _KEPT = os.path.join(_KEPT, os.environ["PYTEST_XDIST_WORKER"])
os.environ["STITCHING_CACHE_DIR"] = _KEPT or os.path.join(_SESSION, "home", ".cache",
                                                          "stitching")
# The op libraries are built once per run, not once per xdist worker (pytest_configure:
# the controller builds them into a directory its workers share): a worker's session
# cache reads them from there, as a user's process reads the install step's.
SHARED_OPS_ENV = "STITCHING_TEST_SHARED_OPS"
_SHARED_OPS = os.environ.get(SHARED_OPS_ENV)
if os.environ.get("PYTEST_XDIST_WORKER") and _SHARED_OPS and not _KEPT:
    os.makedirs(os.environ["STITCHING_CACHE_DIR"])
    os.symlink(_SHARED_OPS, os.path.join(os.environ["STITCHING_CACHE_DIR"], "ops"))
SESSION_MACHINE = os.environ.get("STITCHING_TEST_MACHINE", "intel-avx512")
os.environ["STITCHING_DEVICE_PROFILE"] = SESSION_MACHINE
os.environ.pop("STITCHING_PROFILE", None)      # the older spelling would name a device too
os.environ["STITCHING_BACKGROUND_COMPILE"] = "0"
os.environ["STITCHING_TIERED_COMPILE"] = "0"
os.environ["STITCHING_COMPILE_JOBS"] = "1"

# The planner's cost model sees schedules through a hook the schedule stage fills on
# import (plan/cost.py: use_scheduler), as every driver does; tests that plan without
# the pipeline get the same cost model.
import pytest  # noqa: E402

import stitching.schedule  # noqa: E402,F401
from stitching.plan import profiles  # noqa: E402

if SESSION_MACHINE not in profiles.MACHINES:
    raise RuntimeError(f"STITCHING_TEST_MACHINE={SESSION_MACHINE!r}: choose one of "
                       f"{sorted(profiles.MACHINES)}")


MAX_WORKERS = 4


_BUILD_OPS = """
import threading
from stitching.runtime import build
blas = threading.Thread(target=build.build_blas)   # two g++ at once: the two cores
blas.start()
build.build()
blas.join()
"""
_builder = None


def pytest_configure(config):
    """The xdist controller (``-n``, before its workers start) builds the op libraries
    (g++ against TF's headers: ~30 s of CPU on a Zen 5, more on a slower machine)
    in a process of its own, both at once, into a directory of this session that every
    worker's cache links as its ``ops``.  A worker that needs one before it is ready
    waits on the build's lock (runtime/build.py), and builds it itself if this build
    failed, so its tests report the compiler's error.  Each worker built both before,
    one after the other."""
    global _builder
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", 0) \
            or _KEPT:
        return
    import subprocess
    import sys
    root = os.path.join(_SESSION, "shared")
    os.environ[SHARED_OPS_ENV] = os.path.join(root, "ops")
    os.makedirs(os.environ[SHARED_OPS_ENV])
    _builder = subprocess.Popen([sys.executable, "-c", _BUILD_OPS],
                                env=dict(os.environ, STITCHING_CACHE_DIR=root),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pytest_unconfigure(config):
    if _builder is not None and _builder.poll() is None:
        _builder.kill()
        _builder.wait()


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: a worker per usable CPU, at most MAX_WORKERS (xdist's own default
    would start one per core of a large machine, each with its own TensorFlow)."""
    return max(1, min(profiles.usable_cores(), MAX_WORKERS))


@pytest.fixture(params=sorted(profiles.MACHINES))
def machine(request, monkeypatch):
    """Each named machine model in turn, pinned as the profile the pipeline plans with;
    the test gets its DeviceProfile (``machine.name``, ``machine.tf_onednn``...)."""
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", request.param)
    return profiles.get(request.param)


@pytest.fixture
def intel_plan(monkeypatch):
    """The intel-avx512 model pinned, for a test whose expected kernels, kernel names or
    passes are that model's plan, whichever model the session plans with
    (``STITCHING_TEST_MACHINE``)."""
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", "intel-avx512")


@pytest.fixture
def tiered(monkeypatch):
    """Tiered execution as a user gets it by default (the session turns it off)."""
    monkeypatch.delenv("STITCHING_BACKGROUND_COMPILE", raising=False)


@pytest.fixture
def compile_workers(monkeypatch):
    """The compile worker pool as a user gets it by default, sized by the machine (the
    session compiles in-process)."""
    monkeypatch.delenv("STITCHING_COMPILE_JOBS", raising=False)


@pytest.fixture
def tiered_compile(monkeypatch):
    """The tiered compile as a synchronous caller gets it by default (the session
    turns it off)."""
    monkeypatch.delenv("STITCHING_TIERED_COMPILE", raising=False)
