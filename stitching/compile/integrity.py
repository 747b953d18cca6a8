"""Check a shared object before it is dlopen'ed: size and SHA-256 recorded at write.

Design
------
A cached kernel ``.so`` cut short (a full disk, a killed copy, a tampered cache) is
not an error dlopen reports: the loader maps the file's segments past its end, and the
first touch of a missing page kills the process with SIGBUS (exit 135, measured with a
kernel truncated to 1000 bytes).  So whoever writes a shared object records its size
and SHA-256 in a sidecar ``<file>.sha256`` (``seal``), written before the object itself
is published (``os.replace``), and whoever loads one checks it first (``check``): a
missing, unreadable or disagreeing sidecar makes the object count as absent, and the
caller builds it again.  Two writers of the same object write the same bytes (the
build is deterministic); if they ever did not, a reader sees a mismatch and rebuilds,
which is slow but never wrong.

``check`` also reads the ELF header and asks that the section-header table it points
to lies inside the file: a truncation is then caught even for a file whose sidecar
was truncated with it in a consistent way (a copy of both cut at the same point).

Hashing costs ~0.3 ms per 100 KB; a verified file is remembered by (path, size,
mtime, inode), so a process checks each object once.
"""
from __future__ import annotations

import hashlib
import os
import struct
import threading
from pathlib import Path

SUFFIX = ".sha256"
_lock = threading.Lock()
_verified: set = set()          # (path, size, mtime_ns, inode) of checked files


def digest(data: bytes) -> str:
    """The sidecar's text for ``data``: ``<sha256 hex> <size>``."""
    return f"{hashlib.sha256(data).hexdigest()} {len(data)}\n"


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + SUFFIX)


def seal(path: Path, data: bytes) -> None:
    """Record ``data`` (the bytes about to be published at ``path``) in its sidecar,
    atomically; call before publishing the object itself."""
    side = sidecar(path)
    tmp = side.with_name(f".{side.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(digest(data))
    os.replace(tmp, side)


def check(path: Path) -> str | None:
    """None if ``path`` is a whole shared object matching its sidecar, else why not."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    key = (str(path), st.st_size, st.st_mtime_ns, st.st_ino)
    if key in _verified:
        return None
    try:
        want = sidecar(path).read_text()
        data = path.read_bytes()
    except OSError as e:
        return f"{path}: no readable size/hash record ({e.strerror or e})"
    if digest(data) != want:
        return (f"{path}: content ({len(data)} bytes) does not match the size and hash "
                f"recorded when it was written ({want.strip()})")
    reason = elf_problem(data)
    if reason:
        return f"{path}: {reason}"
    with _lock:
        _verified.add(key)
    return None


def elf_problem(data: bytes, size: int | None = None) -> str | None:
    """None if ``data`` starts with a 64-bit ELF header whose section-header table
    lies inside the file (the table sits at the end of a linked object).  ``size``:
    the file's size, where ``data`` is only its first 64 bytes."""
    size = len(data) if size is None else size
    if len(data) < 64 or data[:4] != b"\x7fELF":
        return "not an ELF shared object"
    if data[4] != 2:
        return "not a 64-bit ELF object"
    endian = "<" if data[5] == 1 else ">"
    shoff, = struct.unpack_from(endian + "Q", data, 0x28)
    shentsize, shnum = struct.unpack_from(endian + "HH", data, 0x3A)
    if shoff + shentsize * shnum > size:
        return (f"truncated ELF object ({size} bytes; its section headers end at "
                f"{shoff + shentsize * shnum})")
    return None
