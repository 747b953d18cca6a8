"""User-facing options for stitching.function and stitching-rewrite."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Options:
    planner: str = "search"        # "search" | "greedy" | "baseline" (XLA-like); see plan/
    min_ops: int = 2               # a region must hold at least this many ops that do work
    progress: bool | None = None   # print compile progress; None: only when many kernels
    verify: bool = False           # run IR/plan/spec verifiers between stages (debug)
    gemm: bool = True              # BatchMatMul x[..., M, K] @ W[K, N] as one MatMul (tf/gemm.py)
    background_compile: bool = False   # stitching.function: a new input signature runs the
    #                                    stock TF graph while its kernels compile in a
    #                                    background thread; later calls switch over (wait())
    stitch_backward: bool = True   # a tape outside the function: each kernel's backward
    #                                (its original ops recomputed + TF's gradient) is
    #                                stitched as a function of its own; False: TF ops

    def __post_init__(self):
        from .plan import ALIASES, PLANNERS
        if self.planner not in PLANNERS and self.planner not in ALIASES:
            raise ValueError(f"unknown planner {self.planner!r}; choose one of "
                             f"{', '.join(PLANNERS)}")
        if not isinstance(self.min_ops, int) or self.min_ops < 1:
            raise ValueError("min_ops must be a positive int")
