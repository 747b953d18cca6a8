#!/usr/bin/env python
"""Run the test suite against another TensorFlow release, in a virtual environment of its
own, as a user with that TF would install stitching.

    python tools/tf_versions.py 2.20.0                     # the whole default suite
    python tools/tf_versions.py 2.20.0 2.19.1 --package tensorflow
    python tools/tf_versions.py 2.20.0 -- tests/test_function.py tests/test_runtime.py

For each version: a fresh venv under ``--root`` (kept for reuse with ``--reuse``), TF
installed first (``<package>==<version>``), then ``pip install -e .[test]`` (no TF extra:
the user's TF stays, which is what the README tells a user who has TF), then
``stitching-build`` and pytest with an empty HOME, as ``.ci/run`` does.  The default CI
run covers one TF (the newest in setup.py's range); this is the job for the others.  It
prints one line per version: the TF that ran, pytest's summary line and the exit status.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd, env=None, log=None) -> int:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode


def one(version: str, package: str, root: str, reuse: bool, tests: list) -> tuple:
    venv = os.path.join(root, f"{package}-{version}")
    py = os.path.join(venv, "bin", "python")
    log_path = os.path.join(root, f"{package}-{version}.log")
    with open(log_path, "w") as log:
        if not (reuse and os.path.exists(py)):
            if _run([sys.executable, "-m", "venv", "--clear", venv], log=log):
                return version, "venv failed", 1, log_path
            steps = [[py, "-m", "pip", "install", "-q", "--upgrade", "pip"],
                     [py, "-m", "pip", "install", "-q", f"{package}=={version}"],
                     [py, "-m", "pip", "install", "-q", "-e", ".[test]"]]
            for cmd in steps:
                if _run(cmd, log=log):
                    return version, f"install failed: {' '.join(cmd[3:])}", 1, log_path
        env = dict(os.environ, HOME=tempfile.mkdtemp(prefix="tf-versions-home-"),
                   TF_CPP_MIN_LOG_LEVEL="2")
        env.pop("PYTHONPATH", None)
        env.pop("STITCHING_CACHE_DIR", None)
        if _run([py, "-m", "stitching.runtime.build"], env=env, log=log):
            return version, "the op library did not build", 1, log_path
        ran = subprocess.run([py, "-c", "import tensorflow as tf; print(tf.__version__)"],
                             env=env, capture_output=True, text=True).stdout.strip()
        code = _run([py, "-m", "pytest", "-q", "-n", "auto", "-p", "no:cacheprovider",
                     *tests], env=env, log=log)
    with open(log_path) as f:
        lines = [ln.strip() for ln in f if " passed" in ln or " failed" in ln]
    return f"{package} {ran or version}", (lines[-1] if lines else "no summary"), code, log_path


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    tests = ["tests"]
    if "--" in argv:
        i = argv.index("--")
        argv, tests = argv[:i], argv[i + 1:] or tests
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("versions", nargs="+", help="TF releases, e.g. 2.20.0")
    ap.add_argument("--package", default="tensorflow-cpu",
                    choices=("tensorflow", "tensorflow-cpu"))
    ap.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "stitching-tf"))
    ap.add_argument("--reuse", action="store_true", help="reuse a venv made before")
    args = ap.parse_args(argv)
    os.makedirs(args.root, exist_ok=True)
    worst = 0
    for v in args.versions:
        tf_ran, summary, code, log = one(v, args.package, args.root, args.reuse, tests)
        print(f"{tf_ran}: {summary} (exit {code}; log {log})", flush=True)
        worst = max(worst, code)
    return worst


if __name__ == "__main__":
    sys.exit(main())
