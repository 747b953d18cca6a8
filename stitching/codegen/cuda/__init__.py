"""The CUDA backend: ``emit(schedule) -> CudaSource`` (emit.py); compiled and launched
by ``stitching.compile.cuda``."""
from .emitter import emit

__all__ = ["emit"]
