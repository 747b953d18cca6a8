"""Where stitching keeps what it builds: ``$STITCHING_CACHE_DIR``, else ``~/.cache/stitching``.

    <root>/ops/        the StitchedKernel op library (runtime/build.py)
    <root>/kernels/    compiled kernels, per toolchain (compile/kernel.py), and the
                       stitched graphs of traced functions (tf/results.py)
    <root>/plans/      stored plans of large graphs (plan/cache.py)
    <root>/autotune/   kernel-or-native-segment decisions, per device (runtime/autotune.py)
    <root>/device-profile-cpu.json   the measured device profile (plan/profiles.py)
    <root>/calibration-cpu.json      this machine's calibration, if installed
                                     (tools/calibrate.py --install)

A leaf module (it imports nothing of stitching), so every stage that caches something
finds the same root without importing a later stage.  The *default* root is also where
the install step (``python -m stitching.runtime.build``) puts what it prebuilds; a
process whose ``STITCHING_CACHE_DIR`` points elsewhere still reuses those files, whose
names hash every input of their build.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
import threading
import time
import zlib
from contextlib import contextmanager
from pathlib import Path

DEFAULT_ROOT = os.path.join("~", ".cache", "stitching")


def root() -> Path:
    """This process's cache root."""
    return Path(os.environ.get("STITCHING_CACHE_DIR") or DEFAULT_ROOT).expanduser()


def default_root() -> Path:
    """The install step's cache root, whatever ``STITCHING_CACHE_DIR`` says."""
    return Path(DEFAULT_ROOT).expanduser()


_PACKAGE = Path(__file__).parent
_DIGESTS: dict = {}


def sources_digest(parts=("",), exclude=()) -> str:
    """SHA-256 (hex) of the package's Python sources under ``parts`` (folders, searched
    recursively, or files, relative to the package; the default: all of it), less the
    paths starting with one of ``exclude``: each file's relative path and contents,
    read once per process (the whole package: ~1.6 MB, ~3 ms).  What names the code a
    cache entry was made by: contents, not sizes and times, which a store giving every
    file one time (Nix, reproducible image builds) keeps equal across releases."""
    key = (tuple(parts), tuple(exclude))
    digest = _DIGESTS.get(key)
    if digest is None:
        h = hashlib.sha256()
        for part in parts:
            p = _PACKAGE / part
            for f in sorted(p.rglob("*.py")) if p.is_dir() else [p]:
                rel = f.relative_to(_PACKAGE).as_posix()
                if not rel.startswith(tuple(exclude)):
                    h.update(rel.encode() + b"\0" + f.read_bytes())
        digest = _DIGESTS[key] = h.hexdigest()
    return digest


STALE_SECONDS = 3600     # arbitrary: a private directory this old whose process is gone


def private_dir(kind: str) -> Path:
    """A directory of this process's own under the system's temporary directory
    (``stitching-<kind>-<pid>-*``), removed at exit.  A process killed (SIGKILL, or
    SIGTERM's default: ``timeout``, ``docker stop``) never runs its exit handlers, so
    the leftovers of processes that are gone, older than STALE_SECONDS, are removed
    first."""
    import atexit
    import tempfile
    root = Path(tempfile.gettempdir())
    for d in root.glob(f"stitching-{kind}-*-*"):
        pid = d.name.split("-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            try:
                if time.time() - d.stat().st_mtime > STALE_SECONDS:
                    shutil.rmtree(d, ignore_errors=True)
            except OSError:
                pass
    d = Path(tempfile.mkdtemp(prefix=f"stitching-{kind}-{os.getpid()}-"))
    atexit.register(shutil.rmtree, d, True)
    return d


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True          # another user's (or not a pid): not ours to judge
    return True


def write_atomic(path, data: bytes) -> None:
    """Publish ``data`` at ``path`` so that no reader ever sees it half-written: a
    temporary file named for this process and thread, renamed over it (a directory or
    other non-file in its place, a damaged cache, is removed first).  Where anything
    fails (a full disk, a read-only cache) the temporary file is removed and the
    OSError raised: a failed write leaves nothing behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_bytes(data)
        clear_for_file(path)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


@contextmanager
def locked(path, waiting=None, timeout: float | None = None):
    """Hold an exclusive lock on the lock file ``path`` (made if missing), shared with
    every process and thread that locks it: one builds or measures what the others
    then read.  Yields whether another holder went first (what it made may be there
    now; look again before making it in any case: it may have finished just before).
    ``waiting()``: called once, before waiting, when the lock is held elsewhere;
    ``timeout``: seconds after which the caller goes on without the lock (a stopped
    or hung holder must not stop every process behind it).

    ``flock``: the lock goes with its holder, so a process killed while it holds one
    (SIGKILL mid-compile) leaves nothing held; a child forked meanwhile closes its
    copies (``_close_in_child``).  Where there can be no lock (a read-only cache, a
    file system without locks) it goes on without one: each maker then makes its
    own, as before the lock, which only costs time (writes are atomic)."""
    import fcntl
    key = os.path.abspath(path)
    held = _held.__dict__.setdefault("paths", set())
    f = None
    if key not in held:     # held by this thread (two keys sharing a slot, nested):
        f = _open_lock(path)  # a second flock of it would wait for itself
    if f is None:
        yield False
        return
    with f:
        waited, got = False, True
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            waited = True
            if waiting is not None:
                waiting()
            got = _wait_for(f, timeout)
        except OSError:     # no locks here (ENOLCK, EOPNOTSUPP...)
            got = False
        if got:
            held.add(key)
            _open_locks.add(f)
        try:
            yield waited    # released when the file closes
        finally:
            held.discard(key)
            _open_locks.discard(f)


def _open_lock(path):
    """The lock file opened (made if missing; read-only where another user made it:
    flock needs no write access), or None where it cannot be."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return open(path, "a")
    except OSError:
        try:
            return open(path)
        except OSError:
            return None


def _wait_for(f, timeout) -> bool:
    """Wait for ``f``'s lock (at most ``timeout`` seconds); whether it was taken."""
    import fcntl
    try:
        if timeout is None:
            fcntl.flock(f, fcntl.LOCK_EX)
            return True
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.05)
    except OSError:
        return False


_held = threading.local()   # .paths: the lock files this thread holds (locked)
_open_locks: set = set()    # every lock file held in this process, open


def _close_in_child() -> None:
    """In a child just forked: close its copies of the parent's held lock files.  A
    lock is shared by every copy of its open file and released when the last closes,
    so a server forking its workers while a background compile held one kept it held
    for the children's life, and every process behind it waiting."""
    for f in list(_open_locks):
        try:
            f.close()
        except OSError:
            pass
    _open_locks.clear()
    _held.__dict__.get("paths", set()).clear()   # the forking thread's, if it held one


os.register_at_fork(after_in_child=_close_in_child)


LOCK_SLOTS = 256    # arbitrary: lock files for the many keys of one directory


def slot_lock(directory, key: str) -> Path:
    """The lock file in ``directory``/locks that ``key`` shares with the keys hashing
    to the same of ``LOCK_SLOTS`` slots: a cache of thousands of kernels keeps 256
    small files, not one per kernel, and two keys sharing a slot only take turns."""
    return Path(directory) / "locks" / f"{zlib.crc32(key.encode()) % LOCK_SLOTS:03d}.lock"


def store(path, data: bytes) -> bool:
    """``write_atomic``, its directory made first; best effort: False where the cache
    cannot be written (read-only, full), which only costs a later process time."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)
    except OSError:
        return False
    return True


class NotAFile(OSError):
    """A path that is not a plain file to read (a FIFO, a device, a directory, a
    symlink leaving its directory, or over its size limit): never read."""


def read_file(path, limit: int, size: int | None = None, within=None) -> bytes:
    """The bytes of ``path``, read only if it is a regular file of at most ``limit``
    bytes (of exactly ``size``, when given).

    Cache and asset files are opened as files: ``O_NOFOLLOW`` (a symlink is refused;
    with ``within``, one that resolves inside that directory is followed), ``O_NONBLOCK``
    (opening a FIFO does not wait for a writer) and ``fstat`` on the open descriptor
    before a byte is read, so a FIFO, a device (``/dev/zero`` reads forever), a
    directory or a file swapped in between is refused with ``NotAFile`` instead of
    hanging or exhausting memory."""
    path = os.fspath(path)
    if within is not None and os.path.islink(path):
        real, base = os.path.realpath(path), os.path.realpath(within)
        if os.path.commonpath([real, base]) != base:
            raise NotAFile(f"{path}: a symlink that leaves {within}")
        path = real
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == getattr(os, "ELOOP", 40):
            raise NotAFile(f"{path}: a symlink, not a file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotAFile(f"{path}: not a regular file ({_kind(st.st_mode)})")
        if st.st_size > limit:
            raise NotAFile(f"{path}: {st.st_size} bytes, more than the {limit} expected")
        if size is not None and st.st_size != size:
            raise NotAFile(f"{path}: {st.st_size} bytes, {size} recorded")
        chunks, left = [], st.st_size
        while left > 0:
            b = os.read(fd, left)
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _kind(mode) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return "not a file"


def clear_for_file(path) -> None:
    """Make room for a file at ``path`` (about to be renamed there): a directory or
    other non-file in its place (a damaged cache) is removed; a file is left to the
    rename, which replaces it atomically."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    elif not stat.S_ISREG(st.st_mode):
        os.unlink(path)
