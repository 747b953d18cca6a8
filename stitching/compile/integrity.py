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

Files are opened as files (cachedir.read_file): a FIFO, a device, a directory or a
symlink in the place of an object or its sidecar is refused before a byte is read,
and the object is read only up to the size its sidecar records.

A kernel also says what it is: stitching appends an *identity* to every kernel
object it writes (``with_identity``: a JSON record after the ELF image, which the
loader ignores), at least ``{"code": <code name>}``.  ``check(path, code=...)``
refuses an object whose identity is not that code: a whole, sealed kernel copied
over another one's name (with its sidecar) is then a kernel that does not belong
there, rebuilt, not run on the other kernel's buffers.  A shipped kernel's identity
also carries the index entries of the specs it serves (tf/kernel_assets.py).

Hashing costs ~0.3 ms per 100 KB; a verified file is remembered by (path, size,
mtime, inode), so a process checks each object once.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from pathlib import Path

from .. import cachedir

SUFFIX = ".sha256"
MAX_OBJECT = 256 << 20        # arbitrary: a kernel object is ~15-100 KB, the op library ~2 MB
MAX_SIDECAR = 256
_ID_MAGIC = b"\0stitching-id-1\0"   # ends an object with an identity
_ID_MAX = 16 << 20
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
    cachedir.write_atomic(sidecar(path), digest(data).encode())


def check(path: Path, code: str | None = None, sha256: str | None = None) -> str | None:
    """None if ``path`` is a whole shared object matching its sidecar, else why not.
    ``code``: the code name its identity must carry; ``sha256``: the content hash it
    must have (a shipped kernel's, recorded by its model)."""
    path = Path(path)
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    key = (str(path), st.st_size, st.st_mtime_ns, st.st_ino, code, sha256)
    if key in _verified:
        return None
    try:
        want = cachedir.read_file(sidecar(path), MAX_SIDECAR).decode("ascii")
        recorded = int(want.split()[1])
    except (OSError, UnicodeDecodeError, IndexError, ValueError) as e:
        return f"{path}: no readable size/hash record ({getattr(e, 'strerror', None) or e})"
    try:        # never more than the record says: /dev/zero would not end
        data = cachedir.read_file(path, min(recorded, MAX_OBJECT))
    except OSError as e:
        return f"{path}: not the file its record describes ({getattr(e, 'strerror', None) or e})"
    if digest(data) != want:
        return (f"{path}: content ({len(data)} bytes) does not match the size and hash "
                f"recorded when it was written ({want.strip()})")
    if sha256 is not None and not want.startswith(sha256 + " "):
        return f"{path}: not the file its model recorded (content hash {want.split()[0]})"
    reason = elf_problem(data)
    if reason is None and code is not None:
        reason = identity_problem(data, code)
    if reason:
        return f"{path}: {reason}"
    with _lock:
        _verified.add(key)
    return None


def with_identity(data: bytes, ident: dict) -> bytes:
    """``data`` (an ELF object, any identity it had dropped) followed by ``ident``."""
    body = json.dumps(ident, sort_keys=True, separators=(",", ":")).encode()
    return split_identity(data)[0] + body + struct.pack("<Q", len(body)) + _ID_MAGIC


def split_identity(data: bytes) -> tuple:
    """(the ELF image, its identity dict or None)."""
    if not data.endswith(_ID_MAGIC) or len(data) < len(_ID_MAGIC) + 8:
        return data, None
    end = len(data) - len(_ID_MAGIC)
    n, = struct.unpack_from("<Q", data, end - 8)
    if n > min(_ID_MAX, end - 8):
        return data, None
    try:
        ident = json.loads(data[end - 8 - n:end - 8])
    except (ValueError, RecursionError):
        return data, None
    return data[:end - 8 - n], ident if isinstance(ident, dict) else None


def identity_problem(data: bytes, code: str) -> str | None:
    """None if ``data``'s identity names ``code``, else why not."""
    ident = split_identity(data)[1]
    if ident is None:
        return f"the object carries no identity (it should be {code})"
    if ident.get("code") != code:
        return (f"the object is kernel {str(ident.get('code'))[:40]}, not {code} "
                f"(a kernel file that does not belong to what loads it)")
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
