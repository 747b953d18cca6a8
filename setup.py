"""stitching: fuse TensorFlow's memory-intensive ops into generated kernels.

Dependencies
------------
Core (``install_requires``) is what the TF-free layers need (IR, plan, schedule, codegen,
compile): they run on the GPU machines, which have no TensorFlow.  TensorFlow is never a
core requirement: a user who has it already installs plain ``stitching`` (an extra naming
another TF package would install a second TensorFlow into the same ``tensorflow/``
folder).  One extra per TF package, each over the minors the suite passes on: ``tf``
(``tensorflow``) and ``tf-cpu`` (``tensorflow-cpu``).  The op library is built on the
user's machine against the installed TF's headers (``stitching-build``), so no ABI pin is
needed.  Everything else has a lower bound at the oldest version this project has run
with.  ``tests/test_packaging.py`` reads
this file (``ast``, so keep the lists literal) and fails when an import in ``stitching/``,
``tests/``, ``tools/`` or ``notebooks/`` is not declared here.
"""
import os

from setuptools import find_packages, setup

# The TF minors the suite has passed on (README "Install"; tools/tf_versions.py runs it).
TF_RANGE = ">=2.19,<2.22"
TF_DEPS = ["keras>=3.0", "ml_dtypes>=0.4", "protobuf>=4.21"]

setup(
    name="stitching",
    version="0.1.0",
    description="FusionStitching-style fusion of memory-intensive TensorFlow ops into "
                "Numba-generated kernels that run as a real TF op",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["stitching", "stitching.*"]),
    package_data={"stitching.runtime": ["*.cc", "*.h"],
                  "stitching.inspect": ["schema/*.json"],
                  "stitching.plan": ["calibration-cpu-*.json"]},
    python_requires=">=3.10",
    install_requires=[
        "numpy>=1.26",
        "numba>=0.60",
        "llvmlite>=0.43",        # imported directly (native.py); numba's own dependency
        "networkx>=3.0",         # graph algorithms of the planner
        # The GEMM library of the matrix products where TF's is Eigen's
        # (stitching/runtime/blas.py).  Core, not an extra: a user who keeps their own
        # TensorFlow installs plain ``stitching`` and should get the fast products, and a
        # SavedModel rewritten with them must load wherever stitching is installed.  A
        # self-contained binary wheel (no TF, no numpy), harmless where unused.
        "scipy-openblas32>=0.3.27",
    ],
    extras_require={
        # TF is optional for the TF-free layers (IR, schedule, codegen, CUDA harness).
        "tf": ["tensorflow" + TF_RANGE] + TF_DEPS,
        "tf-cpu": ["tensorflow-cpu" + TF_RANGE] + TF_DEPS,
        "cuda": ["numba-cuda>=0.20"],
        # the API reference (docs/api, Sphinx autodoc; tests/test_docs.py builds it)
        "docs": ["sphinx>=7"],
        # stitching.inspect: drawings and dump-schema validation (the notebooks use these)
        "inspect": ["matplotlib>=3.8", "jsonschema>=4.0"],
        # the test tools; TF comes from an extra above or the user's own install
        # pytest-xdist: the suite's time is mostly single-threaded compiling (Numba, LLVM),
        # so `-n auto` (workers capped in tests/conftest.py) runs it ~1.7x faster on 2 cores
        "test": TF_DEPS + ["pytest>=8.0", "pytest-xdist>=3.5", "hypothesis>=6.100",
                      "matplotlib>=3.8",
                      "numba-cuda>=0.20", "jsonschema>=4.0",
                      # notebooks/ are executed by tests/test_notebooks.py
                      "nbformat>=5.9", "nbclient>=0.9", "ipykernel>=6.0", "ipython>=8.0"],
        # tools/gpu_bench.py on the GPU machine: PyTorch eager and torch.compile as references.
        "gpu-bench": ["torch>=2.4", "numba-cuda>=0.20"],
        # codegen/cpu/fastmath_fit.py refits the polynomial coefficients (scipy's special functions
        # as the oracle); tests/test_fastmath.py uses it when present.
        "fit": ["scipy>=1.11"],
    },
    entry_points={"console_scripts": ["stitching-rewrite=stitching.cli:main",
                                      # the install step: builds the op library
                                      "stitching-build=stitching.runtime.build:main"]},
)
