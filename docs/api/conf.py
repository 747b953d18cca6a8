"""Sphinx configuration for stitching's API reference (docs/api/).

Built with warnings as errors by tests/test_docs.py (and so by CI):
    python -m sphinx -W --keep-going -b html docs/api docs/_build/api
The pages are generated from the docstrings (autodoc); Google-style sections
("Args:", "Returns:", "Raises:", "Attributes:") are read by napoleon, and read the
same way in help().
"""
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("STITCHING_NO_AUTOLOAD", "1")   # documenting needs no op library

project = "stitching"
author = "the stitching authors"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True          # dataclass fields: one description each, no duplicates
html_theme = "alabaster"
exclude_patterns = ["_build"]
