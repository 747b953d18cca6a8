"""The kernel cache under stress: damaged entries, racing writers, a read-only, full
or missing cache directory.  Each case ends in a correct run (never a crash, never a
wrong kernel).

Each case is a fresh process (the damage is on disk, and what a process loads stays
loaded), TF-free: the cache and the dlopen live below TensorFlow.
"""
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One softmax kernel compiled (or loaded) and run on NumPy, against a float64 softmax.
RUN = textwrap.dedent("""
    import numpy as np
    from stitching.compile import compile_kernel
    from stitching.ir.builder import SpecBuilder
    b = SpecBuilder()
    x = b.input("float32", (-1, 37))
    m = b.Max(x, axes=[1], keep_dims=True)
    e = b.Exp(b.Sub(x, m))
    k = compile_kernel(b.build([b.Mul(b.Div(e, b.Sum(e, axes=[1], keep_dims=True)),
                                      b.const(2.0))]))
    xv = np.random.default_rng(0).standard_normal((5, 37)).astype(np.float32)
    x64 = xv.astype(np.float64)
    ref = np.exp(x64 - x64.max(1, keepdims=True))
    ref = 2 * ref / ref.sum(1, keepdims=True)
    np.testing.assert_allclose(k(xv)[0], ref, rtol=2e-6, atol=1e-7)
    print("ok", "hit" if k.cache_hits else "compiled")
""")


def _env(cache):
    return dict(os.environ, PYTHONPATH=ROOT, STITCHING_CACHE_DIR=str(cache),
                STITCHING_COMPILE_JOBS="1")


def _run(cache, wrap=(), preexec=None):
    return subprocess.run([*wrap, sys.executable, "-W", "always", "-c", RUN],
                          capture_output=True, text=True, timeout=240, env=_env(cache),
                          preexec_fn=preexec)


def _ok(r, how=None):
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert ("ok " + how if how else "ok") in r.stdout, r.stdout
    return r


def _kernel_objects(cache):
    return sorted(cache.glob("kernels/*/k_*.so"))


def test_a_truncated_or_replaced_kernel_object_is_rebuilt_not_loaded(tmp_path):
    """Regression: a cached .so cut to 1000 bytes killed the next process with SIGBUS
    (exit 135).  Now its recorded size and hash disagree and it is built again."""
    _ok(_run(tmp_path), "compiled")
    (so,) = _kernel_objects(tmp_path)
    good = so.read_bytes()
    so.write_bytes(good[:1000])
    r = _ok(_run(tmp_path), "compiled")
    assert "damaged kernel cache entry" in r.stderr and "does not match" in r.stderr
    assert so.read_bytes() == good                  # rebuilt in place, same code
    _ok(_run(tmp_path), "hit")
    # one byte changed: the same size, a different hash
    so.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    r = _ok(_run(tmp_path), "compiled")
    assert "damaged kernel cache entry" in r.stderr
    # the record itself lost: the entry counts as missing
    os.unlink(str(so) + ".sha256")
    _ok(_run(tmp_path), "compiled")


def test_a_damaged_kernel_source_in_the_cache_is_replaced(tmp_path):
    _ok(_run(tmp_path), "compiled")
    for f in list(tmp_path.glob("kernels/*/k_*")):
        if f.suffix == ".py":
            f.write_text(f.read_text()[:50])        # a syntax error if imported
        elif f.suffix == ".so":
            f.unlink()
    _ok(_run(tmp_path), "compiled")


def test_two_processes_compiling_the_same_kernel_at_once(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", RUN], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env(tmp_path))
             for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0 and "ok" in out, err[-3000:]
    assert len(_kernel_objects(tmp_path)) == 1
    _ok(_run(tmp_path), "hit")


def test_processes_compiling_the_same_kernel_at_once_build_it_once(tmp_path):
    """Processes sharing a cache that start together (a server's workers, pytest-xdist)
    each built every kernel (4 cold processes of an MLP: 15 builds of 4 codes).  One
    builds a code now; the others wait for it and load its object.  Three processes
    reach the compile together (a file they all wait for)."""
    go = tmp_path / "go"
    run = RUN.replace("k = compile_kernel(", f"import os, time\n"
                      f"open({str(tmp_path)!r} + f'/ready-{{os.getpid()}}', 'w').close()\n"
                      f"while not os.path.exists({str(go)!r}):\n"
                      f"    time.sleep(0.005)\n"
                      f"k = compile_kernel(")
    cache = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, "-c", run], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env(cache))
             for _ in range(3)]
    import time
    deadline = time.monotonic() + 200
    while len(list(tmp_path.glob("ready-*"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)    # until each process has imported and built its spec
    go.touch()
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0 and "ok" in out, err[-3000:]
        outs.append(out.split()[-1])
    assert sorted(outs) == ["compiled", "hit", "hit"], outs
    assert len(_kernel_objects(cache)) == 1


def test_a_cache_lock_makes_others_wait_and_lets_its_holder_take_it_again(tmp_path):
    """``cachedir.locked``: another holder (a thread here: flock conflicts between open
    files, in one process too) waits, says so once and learns it waited; the thread
    holding a lock takes it again without waiting for itself (two keys sharing a
    slot, nested); where no lock file can be made it goes on unlocked."""
    import threading
    import time
    from stitching import cachedir
    lock, events = tmp_path / "locks" / "001.lock", []

    def other():
        with cachedir.locked(lock, lambda: events.append("waiting")) as waited:
            events.append(("other", waited))
    with cachedir.locked(lock) as waited:
        assert waited is False
        with cachedir.locked(lock) as again:        # nested in this thread
            assert again is False
        t = threading.Thread(target=other)
        t.start()
        time.sleep(0.3)
        assert events == ["waiting"]                 # it waits while this one holds
    t.join(10)
    assert events == ["waiting", ("other", True)]
    # a child forked while a lock is held does not keep it held after its parent
    with cachedir.locked(lock):
        pid = os.fork()
        if pid == 0:                    # (its fork handlers have run by now)
            (tmp_path / "child-up").touch()
            time.sleep(5)
            os._exit(0)
    deadline = time.monotonic() + 10
    while not (tmp_path / "child-up").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    import fcntl
    try:
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)   # BlockingIOError if kept
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert cachedir.slot_lock(tmp_path, "k_1").parent == tmp_path / "locks"
    assert len({cachedir.slot_lock(tmp_path, f"k_{i}") for i in range(2000)}) \
        == cachedir.LOCK_SLOTS
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if not os.access(ro, os.W_OK):      # root writes anywhere: nothing to check
            with cachedir.locked(ro / "locks" / "x.lock") as waited:
                assert waited is False
    finally:
        ro.chmod(0o700)


def test_cache_dir_that_does_not_exist_is_created(tmp_path):
    _ok(_run(tmp_path / "not" / "there" / "yet"), "compiled")
    _ok(_run(tmp_path / "not" / "there" / "yet"), "hit")


def _read_only_wrap(path):
    """A command prefix that runs its command with ``path`` mounted read-only, or None
    (root ignores file modes, so chmod would not do: a private mount namespace)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return None
    script = (f'mount --bind "{path}" "{path}" && mount -o remount,bind,ro "{path}" '
              f'&& exec "$@"')
    probe = subprocess.run(["unshare", "--mount", "sh", "-c", script, "sh", "true"],
                           capture_output=True)
    return ["unshare", "--mount", "sh", "-c", script, "sh"] if probe.returncode == 0 \
        else None


def test_read_only_cache_dir(tmp_path):
    if os.geteuid() != 0:
        tmp_path.chmod(0o555)
        wrap = ()
    else:
        wrap = _read_only_wrap(tmp_path)
        if wrap is None:
            pytest.skip("running as root without mount namespaces: cannot make a "
                        "read-only directory")
    try:
        r = _ok(_run(tmp_path, wrap), "compiled")    # compiled in memory, with a warning
        assert f"the kernel cache {tmp_path}/kernels/" in r.stderr, r.stderr
        assert "cannot be written (Read-only file system)" in r.stderr, r.stderr
        assert r.stderr.count("kernels run from code compiled") == 1, r.stderr
        assert not any(tmp_path.iterdir())
    finally:
        tmp_path.chmod(0o755)


def _full_disk():
    """Every write of a regular file fails (EFBIG) as on a full disk; the signal a
    write past the limit would raise is ignored, as a long-running server would."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))


def test_full_cache_disk(tmp_path):
    """Compiled in memory, with one warning naming the cache directory and why; no
    write leaves its temporary file behind (they piled up run after run)."""
    r = _ok(_run(tmp_path, preexec=_full_disk), "compiled")
    assert r.stderr.count("kernels run from code compiled") == 1, r.stderr
    assert "cannot be written (File too large)" in r.stderr, r.stderr
    assert not _kernel_objects(tmp_path)
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name], \
        sorted(tmp_path.rglob("*"))


def test_a_linker_killed_by_a_signal_says_so(monkeypatch, tmp_path):
    from stitching.compile import native
    monkeypatch.setattr(native.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, -signal.SIGXFSZ, "", ""))
    with pytest.raises(native.NativeError, match=r"failed \(killed by SIGXFSZ\)"):
        native._link(b"\x7fELF", "", tmp_path / "k_x", "stitching_body")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".link-")]


def test_integrity_check_names_what_is_wrong(tmp_path):
    """The check both kernel objects and the op library go through before dlopen."""
    from stitching.compile import integrity
    _ok(_run(tmp_path), "compiled")
    (so,) = _kernel_objects(tmp_path)
    data = so.read_bytes()
    assert integrity.check(so) is None
    cut = tmp_path / "cut.so"
    cut.write_bytes(data[:1000])
    assert "no readable size/hash record" in integrity.check(cut)
    # without a record (an op library built before records existed) a truncation
    # is still caught, from the ELF header alone
    assert "truncated ELF object (1000 bytes" in integrity.elf_problem(data[:64], 1000)
    assert integrity.elf_problem(data[:64], len(data)) is None
    assert "not an ELF" in integrity.elf_problem(b"#!/bin/sh\n" * 10)
    integrity.seal(cut, data)
    assert "does not match the size and hash" in integrity.check(cut)


def test_private_directories_of_killed_processes_are_swept(tmp_path, monkeypatch):
    """A process's tier-1 objects (and a read-only cache's shipped kernels) live in a
    directory of its own, removed at exit; a killed process (SIGKILL, SIGTERM's
    default) leaves it behind, ~150 KB each.  The next process removes those of
    processes that are gone and older than an hour, and nothing else."""
    import tempfile
    import time
    from stitching import cachedir
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    old = time.time() - 2 * cachedir.STALE_SECONDS
    gone = 4194305                      # above Linux's largest pid: never alive
    dirs = {"dead": f"stitching-tier1-{gone}-a", "dead_recent": f"stitching-tier1-{gone}-b",
            "alive": f"stitching-tier1-{os.getppid()}-c", "other": f"stitching-shipped-{gone}-d",
            "users": "stitching-tier1-notes"}
    for key, name in dirs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "k.so").write_bytes(b"x")
        if key != "dead_recent":
            os.utime(tmp_path / name, (old, old))
    mine = cachedir.private_dir("tier1")
    left = {p.name for p in tmp_path.iterdir()}
    assert left == set(dirs.values()) - {dirs["dead"]} | {mine.name}, left
    assert mine.name.startswith(f"stitching-tier1-{os.getpid()}-")


@pytest.mark.parametrize("files, cores, jobs", [
    ({}, 8, 8),                                                     # nothing known
    ({"/proc/meminfo": "MemTotal: 64000000 kB\nMemAvailable: 1024000 kB\n"}, 8, 3),
    ({"/sys/fs/cgroup/memory.max": "2147483648\n",                  # a 2 GiB pod
      "/sys/fs/cgroup/memory.current": "1610612736\n"}, 8, 1),
    ({"/sys/fs/cgroup/memory.max": "max\n",
      "/sys/fs/cgroup/memory.current": "1610612736\n"}, 8, 8),
    ({"/sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",   # v1: none
      "/sys/fs/cgroup/memory/memory.usage_in_bytes": "2787880960\n"}, 8, 8),
    ({"/sys/fs/cgroup/cpu.max": "200000 100000\n"}, 8, 2),          # 2 CPUs of 8 seen
    ({"/sys/fs/cgroup/cpu.max": "max 100000\n"}, 8, 8),
    ({"/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "150000\n",            # v1: 1.5 CPUs
      "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"}, 8, 2),
    ({"/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n",
      "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"}, 16, 8),
])
def test_compile_workers_fit_the_containers_cpus_and_memory(monkeypatch, files, cores, jobs):
    """The compile pool was sized by the cores alone: a worker peaks at ~262 MiB, so
    eight of them (a host's cores, seen from a 2 GiB pod) are ~2 GiB, and a container
    past its memory limit is killed.  The pool fits the free memory at WORKER_MB a
    worker, and a CPU quota, as the machine facts given here say."""
    from stitching.compile import parallel
    monkeypatch.delenv("STITCHING_COMPILE_JOBS", raising=False)
    monkeypatch.setattr(parallel, "_read", files.get)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert parallel.default_jobs() == jobs
    monkeypatch.setenv("STITCHING_COMPILE_JOBS", "5")           # asked for: as asked
    assert parallel.default_jobs() == 5


def test_code_name_memo_follows_the_backend_and_the_text(monkeypatch):
    # code_name is memoized per (text, backend mark): a process that switches
    # STITCHING_CPU_BACKEND, or a translator whose sources changed (direct.tag), names
    # the code afresh, never with the name the memo holds for the other backend
    from stitching.compile import direct, kernel
    text = "def body(a):\n    v0 = a + 1\n    return v0\n"
    monkeypatch.setenv("STITCHING_CPU_BACKEND", "llvm")
    llvm = kernel.code_name(text)
    assert kernel.code_name(text) == llvm
    assert kernel.code_name(text.replace("v0", "v7")) == llvm      # same code up to naming
    assert kernel.code_name(text.replace("+ 1", "+ 2")) != llvm
    monkeypatch.setenv("STITCHING_CPU_BACKEND", "numba")
    numba = kernel.code_name(text)
    assert numba != llvm
    monkeypatch.setenv("STITCHING_CPU_BACKEND", "llvm")
    monkeypatch.setattr(direct, "_TAG", "0" * 12)
    assert kernel.code_name(text) not in (llvm, numba)


def test_specs_sharing_a_compile_target_are_emitted_once(tmp_path, monkeypatch):
    # uncached_code emits a generic twin's code once for every spec it serves, and
    # each of them gets the same (target, text, code name) as when emitted alone
    from stitching.codegen.cpu import emitter
    from stitching.compile import kernel
    from stitching.ir.builder import SpecBuilder
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path))

    def spec(rows):
        b = SpecBuilder()
        x = b.input("float32", (rows, 96))
        g = b.input("float32", (96,))
        return b.build([b.Mul(b.Sigmoid(b.Add(x, g)), b.const(2.0))])
    specs = [spec(r) for r in (64, 128, 256)]
    targets = {kernel.compile_target(s).hash for s in specs}
    assert len(targets) == 1 and specs[0].hash not in targets      # one shared twin
    alone = []
    for s in specs:
        kernel._emitted.clear()
        alone.append(kernel.uncached_code(s))
    kernel._emitted.clear()
    calls = []
    real = emitter.emit
    monkeypatch.setattr(emitter, "emit", lambda sched: calls.append(1) or real(sched))
    together = [kernel.uncached_code(s) for s in specs]
    kernel._emitted.clear()
    assert len(calls) == 1
    assert [(t.hash, text, name) for t, text, name in together] == \
        [(t.hash, text, name) for t, text, name in alone]
