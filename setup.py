"""stitching: fuse TensorFlow's memory-intensive ops into generated kernels."""
from setuptools import find_packages, setup

setup(
    name="stitching",
    version="0.1.0",
    description="FusionStitching-style fusion of memory-intensive TensorFlow ops into "
                "Numba-generated kernels that run as a real TF op",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["stitching", "stitching.*"]),
    package_data={"stitching.runtime": ["*.cc", "*.h"],
                  "stitching.inspect": ["schema/*.json"]},
    python_requires=">=3.10",
    install_requires=[
        "numpy",
        "numba>=0.60",
    ],
    extras_require={
        # TF is optional for the TF-free layers (IR, schedule, codegen, CUDA harness).
        "tf": ["tensorflow-cpu==2.21.0"],
        "cuda": ["numba-cuda"],
        # stitching.inspect: drawings, schema validation (the notebooks use these)
        "inspect": ["networkx", "matplotlib", "jsonschema"],
        "test": ["tensorflow-cpu==2.21.0", "pytest", "hypothesis", "matplotlib",
                 "numba-cuda", "networkx", "jsonschema",
                 # notebooks/ are executed by tests/test_notebooks.py
                 "nbformat", "nbclient", "ipykernel"],
    },
    entry_points={"console_scripts": ["stitching-rewrite=stitching.tf.cli:main"]},
)
