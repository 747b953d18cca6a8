"""User-facing options for stitching.function and stitching-rewrite."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Options:
    planner: str = "search"        # "search" | "greedy" | "baseline" (XLA-like); see plan/
    min_ops: int = 2               # a region must hold at least this many ops that do work
    progress: bool | None = None   # print compile progress; None: only when many kernels
    verify: bool = False           # run IR/plan/spec verifiers between stages (debug)
    gemm: bool = True              # BatchMatMul x[..., M, K] @ W[K, N] as one MatMul (tf/gemm.py)
    einsum: bool = True            # two-operand Einsum as BatchMatMulV2 + row gathers (tf/einsum.py)
    pad_fold: bool = True          # a zero Pad before a depthwise convolution becomes the
    #                                convolution's explicit padding (tf/padfold.py)
    seq_split: bool = True         # token-wise blocks whose products TF runs on one thread at
    #                                batch 1 run as two halves of the sequence (tf/seqsplit.py)
    background_compile: bool = False   # stitching.function: a new input signature runs the
    #                                    stock TF graph while its kernels compile in a
    #                                    background thread; later calls switch over (wait())
    dump_dir: str | None = None    # write a graph dump per traced function here (also
    #                                $STITCHING_DUMP_DIR); see stitching/tf/dump.py
    dump_passes: str | None = None  # with a dump: the graph after each pass whose name
    #                                this regular expression matches (re.search, like
    #                                XLA's --xla_dump_hlo_pass_re), e.g. "seqsplit|padfold"
    #                                or ".*"; see stitching/tf/passmanager.py
    fallback: bool = False         # each kernel node keeps its region's original nodes as a
    #                                function it runs where its kernel cannot be built
    #                                (tf/original.py); stitching-rewrite turns it on
    stitch_backward: bool = True   # a tape outside the function: each kernel's backward
    #                                (its original ops recomputed + TF's gradient) is
    #                                stitched as a function of its own; False: TF ops
    autotune: bool = False         # kernels the cost model predicts faster by less than
    #                                autotune_margin are timed against their original
    #                                ops on their first calls; the faster serves, and the
    #                                choice is cached (tf/autotune.py, runtime/autotune.py)
    autotune_margin: float = 1.3   # arbitrary: about the model's error on this machine
    #                                (tools/plan_audit.py); inf measures every kernel

    def __post_init__(self):
        from .plan import ALIASES, PLANNERS
        if self.planner not in PLANNERS and self.planner not in ALIASES:
            raise ValueError(f"unknown planner {self.planner!r}; choose one of "
                             f"{', '.join(PLANNERS)}")
        if not isinstance(self.min_ops, int) or self.min_ops < 1:
            raise ValueError("min_ops must be a positive int")
        if isinstance(self.autotune_margin, bool) or \
                not isinstance(self.autotune_margin, (int, float)) or \
                not self.autotune_margin >= 1.0:
            raise ValueError(f"autotune_margin must be a number >= 1 (a predicted "
                             f"speed-up), got {self.autotune_margin!r}")
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise TypeError(f"dump_dir must be a path, got {type(self.dump_dir).__name__}")
        if self.dump_passes is not None:
            if not isinstance(self.dump_passes, str):
                raise TypeError(f"dump_passes must be a regular expression (str), got "
                                f"{type(self.dump_passes).__name__}")
            try:
                re.compile(self.dump_passes)
            except re.error as e:
                raise ValueError(f"dump_passes {self.dump_passes!r} is not a regular "
                                 f"expression: {e}") from None
