"""The CPU backend: ``emit(schedule) -> KernelSource`` (emit.py; ABI in its docstring)."""
from .emitter import emit

__all__ = ["emit"]
