"""Where stitching keeps what it builds: ``$STITCHING_CACHE_DIR``, else ``~/.cache/stitching``.

    <root>/ops/        the StitchedKernel op library (runtime/build.py)
    <root>/kernels/    compiled kernels, per toolchain (compile/kernel.py)
    <root>/plans/      stored plans of large graphs (plan/cache.py)
    <root>/autotune/   kernel-or-native-segment decisions, per device (runtime/autotune.py)
    <root>/cpu_profile.json   the measured device profile (plan/profiles.py)

A leaf module (it imports nothing of stitching), so every stage that caches something
finds the same root without importing a later stage.  The *default* root is also where
the install step (``python -m stitching.runtime.build``) puts what it prebuilds; a
process whose ``STITCHING_CACHE_DIR`` points elsewhere still reuses those files, whose
names hash every input of their build.
"""
from __future__ import annotations

import os
from pathlib import Path

DEFAULT_ROOT = os.path.join("~", ".cache", "stitching")


def root() -> Path:
    """This process's cache root."""
    return Path(os.environ.get("STITCHING_CACHE_DIR") or DEFAULT_ROOT).expanduser()


def default_root() -> Path:
    """The install step's cache root, whatever ``STITCHING_CACHE_DIR`` says."""
    return Path(DEFAULT_ROOT).expanduser()
