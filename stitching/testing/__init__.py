"""Shared zoo for tests and benchmarks: memory-intensive patterns from real models,
whole models, and kernel counting (TF graph ops, XLA HLO fusions).

This package imports TensorFlow (it is the TF-facing test zoo, not part of the
TF-free compiler core).
"""
from .counting import count_memory_intensive_ops, count_xla_kernels, tf_op_histogram
from .models import MODELS, ModelCase, all_models, transformer_encoder
from .patterns import PATTERNS, SIZES, Pattern, all_patterns

__all__ = [
    "PATTERNS", "SIZES", "Pattern", "all_patterns",
    "MODELS", "ModelCase", "all_models", "transformer_encoder",
    "count_memory_intensive_ops", "count_xla_kernels", "tf_op_histogram",
]
