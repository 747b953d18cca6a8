"""Data types the IR knows, and how each is stored and computed.

Storage dtype is what sits in a tensor buffer; compute dtype is what the generated
code does arithmetic in.  float16 and bfloat16 are stored as 16-bit patterns and
computed in float32 (TF's CPU kernels do the same per op; a fused kernel rounds
once at the end instead of after every op, which is within float16 rounding).
"""
from __future__ import annotations

import numpy as np

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
INT_DTYPES = ("int32", "int64")
ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES + ("bool",)

# numpy dtype used for the *buffer* (bfloat16 bits are carried as uint16).
STORAGE = {
    "float16": np.dtype(np.uint16),
    "bfloat16": np.dtype(np.uint16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "bool": np.dtype(np.bool_),
}

# dtype arithmetic happens in.
COMPUTE = {
    "float16": "float32",
    "bfloat16": "float32",
    "float32": "float32",
    "float64": "float64",
    "int32": "int32",
    "int64": "int64",
    "bool": "bool",
}

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
            "int32": 4, "int64": 8, "bool": 1}


def is_float(dtype: str) -> bool:
    return dtype in FLOAT_DTYPES


def is_int(dtype: str) -> bool:
    return dtype in INT_DTYPES


def check(dtype: str) -> str:
    if dtype not in ALL_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(ALL_DTYPES)}")
    return dtype
