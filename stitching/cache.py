"""``python -m stitching.cache``: what the cache holds, and what of it this installation
no longer uses; ``--prune`` removes that.

Every entry is named by what it was built from (cachedir.py), so an upgrade of
TensorFlow, Numba or stitching starts new entries beside the old ones and never reads
those again.  Nothing removes them by itself: several installations (two virtual
environments with different TF versions) may share one cache, and each uses its own
generation.  What this installation can tell is its own generation's:

- ``ops/``: the op libraries of this TF and stitching (``runtime/build.py``), and their
  size and lock files; any other is another TF's or stitching's;
- ``kernels/<toolchain>/``: this Numba, llvmlite, CPU and runtime's kernels; another
  toolchain folder is another's (``compile/kernel.py``);
- ``kernels/<toolchain>/results/<salt>/``: stitched results of this TF version and
  these sources (``tf/results.py``); other folders, and files of the layout before
  folders, are another version's;
- ``plans/``: stored plans named by the planner's sources and the device profile
  (``plan/cache.py``); others are another version's or another profile's.

Kernels inside this toolchain's folder are shared by every stitching version whose
generated code is the same, and are kept.  Prune while no process of another
installation uses the cache: an entry it still wanted is built again, not lost.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from pathlib import Path

from . import cachedir

_TOOLCHAIN_DIR = re.compile(r"[0-9a-f]{16}\Z")
_LIBRARY = re.compile(r"(stitching_\w+-tf[^-/]+-[0-9a-f]{16})[.]")


def _size(path: Path) -> int:
    if path.is_file() or path.is_symlink():
        try:
            return path.lstat().st_size
        except OSError:
            return 0
    return sum(_size(p) for p in path.iterdir()) if path.is_dir() else 0


def _libraries_in_use() -> set:
    """The stems of this installation's op libraries (built or not)."""
    from .runtime import build
    names = {build.library_path().name}
    try:
        names.add(build.blas_library_path().name)
    except ImportError:       # no OpenBLAS wheel: no library of that kind is ours
        pass
    return {n[:-len(".so")] for n in names}


def _plan_salt() -> str | None:
    """The stored plans' salt here, or None where it would take measuring the machine
    (no profile stored yet): plans are then left alone."""
    from .plan import cache, profiles
    if not (os.environ.get("STITCHING_DEVICE_PROFILE") or os.path.exists(
            profiles.cache_path()) or os.path.exists(profiles.default_cache_path())):
        return None
    return cache._salt()


def survey() -> tuple[list, list]:
    """(in use, unused): ``[(path, what)]`` of the cache's generations."""
    from .compile import kernel
    from .tf import results
    root = cachedir.root()
    used, unused = [], []
    ops = root / "ops"
    if ops.is_dir():
        ours = _libraries_in_use()
        for p in sorted(ops.iterdir()):
            m = _LIBRARY.match(p.name)
            if m is None:
                continue                   # not an op library's file: left alone
            if m.group(1) in ours:
                used.append((p, "this TensorFlow's and stitching's op library"))
            else:
                unused.append((p, "another TensorFlow's or stitching's op library"))
    here = kernel.kernel_dir()
    kernels = root / "kernels"
    if kernels.is_dir():
        for d in sorted(kernels.iterdir()):
            if not (d.is_dir() and _TOOLCHAIN_DIR.match(d.name)):
                continue                   # toolchain-memo and the like: tiny, kept
            if d.name != here.name:
                unused.append((d, "kernels of another Numba, llvmlite, CPU or runtime"))
                continue
            used.append((d, "this toolchain's kernels"))
    stored = here / "results"
    if stored.is_dir():
        mine = results._dir().name
        for p in sorted(stored.iterdir()):
            if p.name != mine:
                unused.append((p, "stitched results of another TensorFlow or stitching"))
    plans = root / "plans"
    salt = _plan_salt()
    if plans.is_dir() and salt is not None:
        old = [p for p in sorted(plans.glob("*.json")) if not p.name.endswith(f"_{salt}.json")]
        unused += [(p, "a plan of another planner or device profile") for p in old]
    return used, unused


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} KB"


def _group(entries) -> list:
    """[(what, count, bytes, first path)] per kind, in order of first appearance."""
    groups: dict = {}
    for path, what in entries:
        g = groups.setdefault(what, [0, 0, path])
        g[0] += 1
        g[1] += _size(path)
    return [(what, n, size, first) for what, (n, size, first) in groups.items()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m stitching.cache",
        description="Show what stitching's cache ($STITCHING_CACHE_DIR, default "
                    "~/.cache/stitching) holds, and what of it this installation (its "
                    "TensorFlow, Numba and stitching) no longer uses.")
    ap.add_argument("--prune", action="store_true",
                    help="remove what this installation does not use (another "
                         "installation sharing the cache builds its entries again)")
    args = ap.parse_args(argv)
    root = cachedir.root()
    if not root.is_dir():
        print(f"stitching cache: {root} does not exist (nothing built yet)")
        return 0
    used, unused = survey()
    print(f"stitching cache: {root} ({_mb(_size(root))})")
    for title, entries in (("used by this installation", used),
                           ("not used by this installation", unused)):
        print(f"  {title}:" + ("" if entries else " nothing"))
        for what, n, size, first in _group(entries):
            where = first.relative_to(root) if n == 1 else f"{n} entries"
            print(f"    {what}: {where}, {_mb(size)}")
    if not unused:
        return 0
    if not args.prune:
        print(f"  --prune removes the {_mb(sum(_size(p) for p, _ in unused))} not used "
              f"by this installation")
        return 0
    freed = 0
    for path, _ in unused:
        size = _size(path)
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            freed += size
        except OSError as e:
            print(f"  could not remove {path}: {e.strerror}", file=sys.stderr)
    print(f"  pruned: {_mb(freed)} freed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
