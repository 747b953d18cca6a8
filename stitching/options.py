"""User-facing options for ``stitching.function``, ``stitching.keras.stitch`` and
``stitching-rewrite``.

Every field is checked when an ``Options`` is made: a value of the wrong type or out of
range raises ``TypeError`` / ``ValueError`` naming the field.  (A dataclass alone
accepts anything, and ``Options(background_compile="no")`` once turned the option *on*:
a non-empty string is true.)  docs/tuning.md lists the fields beside the environment
variables.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Options:
    """How stitching plans, compiles and rewrites a function or a model.

    Immutable; make a new one with ``dataclasses.replace(opts, field=value)``.
    Pass it as ``stitching.function(fn, options=...)``,
    ``stitching.keras.stitch(model, options=...)`` or
    ``stitching.rewrite_saved_model(src, dst, options=...)``.

    Attributes:
        planner: How regions are chosen: ``"search"`` (default; candidate patterns,
            beam search and remote fusion over the cost model), ``"greedy"`` (grow
            regions along producer-consumer edges, no search) or ``"baseline"``
            (XLA-like: no reduction fused with its consumers; for comparisons).
        min_ops: A region becomes a kernel only if it holds at least this many ops
            that do work (default 2; 1 turns even a lone op into a kernel).
        progress: Print compile progress to stderr.  ``None`` (default): only when
            a graph has many kernels to compile.
        verify: Run the IR, plan and spec verifiers between stages (a debugging aid;
            slower planning).
        gemm: Rewrite ``BatchMatMul`` of ``x[..., M, K]`` by a 2-D weight ``[K, N]``
            as one ``MatMul`` (default on).
        einsum: Rewrite a two-operand ``Einsum`` as ``BatchMatMulV2`` with its
            transposes done as row gathers (default on).
        pad_fold: Fold a zero ``Pad`` before a convolution (``Conv2D``,
            ``DepthwiseConv2dNative``) into the convolution's explicit padding
            (default on).
        depthwise: Compute depthwise convolutions (NHWC, depth multiplier 1) inside
            the kernel of the BatchNorm and activation after them, where the cost
            model says it pays (default on; ``False`` leaves them to TF).
        seq_split: Run token-wise blocks (Dense, GELU, Dense, residual, LayerNorm)
            whose matrix products TF would run on one thread as two halves of the
            sequence side by side (default on; helps batch 1, costs ~4% at large
            batches with an unknown batch size).
        xla_gemm: Run the matrix products between kernels with XLA's dot (each a
            one-product function XLA compiles) where TF's GEMM is Eigen's (oneDNN
            off), which is slower there.  Off by default: XLA's dot sums in an order
            that measured ~3x TF's error against float64 on a [128, 1024] x
            [1024, 256] product, each new input shape compiles the products (~0.2 s
            for a 4-layer encoder), and it gained ~4% on a Transformer at batch 1
            (none shown at batch 8).
        blas_gemm: Run the matrix products between kernels (``MatMul``, with the
            ``BiasAdd`` after it, and ``BatchMatMulV2``) with OpenBLAS (the
            ``scipy-openblas32`` package) where TF's GEMM is Eigen's (oneDNN off),
            split over TF's intra-op threads (default on; without the package the
            products stay TF's and the report says why).
        conv1x1_gemm: Where the products run by OpenBLAS (``blas_gemm``), run each
            large 1x1 convolution (stride 1, NHWC) as one ``StitchedMatMul``, its
            output from the op's buffer pool (tf/passes/conv1x1.py says which).
        variable_updates: Compute a variable's ``assign_add``/``assign_sub``
            update as its new value, in the kernel of the math before it, and
            write it with ``AssignVariableOp``; a read of the variable after a
            write reads the value written, so an optimizer's update of one
            variable becomes one kernel (opt-in: default off).  Each new value is
            a new buffer while the old one is alive: a higher peak than TF's
            in-place adds (docs/training.md, "Optimizer updates").
        transposed_gemm: Run each float32 product against a large transposed 2-D
            weight (``MatMul(a, b, transpose_b=True)``: a Dense layer's input
            gradient) as ``BatchMatMulV2(a, b, adj_y=True)`` on the CPU classes where
            TF's oneDNN ``MatMul`` was measured to take a slow path for it (amd-avx512:
            1.2-3.4x from K >= 512; tf/passes/gemm.py).  Opt-in (default off): TF's
            ``BatchMatMulV2`` holds one more output-sized buffer while it runs, which
            raised the train suite's MLP step's peak over stock TF's.  The report says
            where it applies.
        fused_attention: Run each attention of an inference graph -- product,
            softmax kernel, product -- as one OpenBLAS op that keeps the scores of a
            block of query rows in cache (``StitchedAttention``; default on): where
            the products run by OpenBLAS (``blas_gemm``), every attention (1.06x the
            Llama decoder at batch 8, BENCHMARKS.md ``gemm@amd_avx2``); where TF's
            GEMM is oneDNN's, the masked ones, whose masked key blocks the op skips
            (BENCHMARKS.md ``attention@amd_avx512``).  Off with ``blas_gemm=False``.
        background_compile: Tiered execution: new work runs stock TF while its
            kernels compile in the background, then switches to them.  ``None``
            (default) and ``True``: tiered wherever that is safe --
            ``stitching.keras.stitch``'s ``fit``, ``evaluate`` and ``predict``
            (switching at a step boundary) and ``stitching.function`` called
            eagerly with tensors (or dicts and lists of them) as its positional
            arguments (a new input signature
            returns stock TF's result; a later call switches; ``f.wait()`` blocks
            until then, and so do ``f.report``, saving and
            ``get_concrete_function``, which ask for the stitched graph).
            Synchronous, the first call waiting for its kernels, where it is not
            safe: a call inside another ``tf.function`` or graph trace, under a
            ``tf.distribute`` strategy, a call with Python arguments or
            keywords TF binds (``*args``/``**kwargs`` functions), ``get_concrete_function`` and ``stitching-rewrite``
            (``background_compile_on`` and tf/function.py say why).  ``None``
            follows ``$STITCHING_BACKGROUND_COMPILE`` where set (``0`` turns
            tiering off for the process).  ``False``: every first call waits for
            its kernels.
        dump_dir: Write a graph dump per traced function into this directory
            (``stitching.load_dump`` reads it back); ``$STITCHING_DUMP_DIR`` does
            the same for a whole process.
        dump_passes: With a dump, also write the graph after each pass whose name
            this regular expression matches (``re.search``, like XLA's
            ``--xla_dump_hlo_pass_re``), e.g. ``"seqsplit|padfold"`` or ``".*"``.
        fallback: Each kernel node keeps its region's original ops as a function
            it runs where its kernel cannot be built (no Numba, no compiler).
            ``stitching-rewrite`` and ``rewrite_saved_model`` turn it on.
        stitch_backward: With a ``GradientTape`` outside the stitched function,
            stitch each kernel's backward (its original ops recomputed plus TF's
            gradient) as a function of its own (default on); ``False`` runs it as
            TF ops.
        autotune: Kernels the cost model predicts faster than their ops by less
            than ``autotune_margin`` are timed against those ops on their first
            calls; the faster serves, and the choice is cached on disk.
        autotune_margin: The predicted speed-up below which ``autotune`` measures
            (a number >= 1, default 1.3; ``math.inf`` measures every kernel).
        unroll_loops: Unroll each ``tf.while_loop`` whose trip count is a constant of
            the graph, up to this many iterations (default 64; 0 unrolls nothing):
            a Keras ``LSTM``/``GRU`` over a fixed sequence length becomes its steps
            in a row, as with the layer's ``unroll=True``, so TF's executor no longer
            runs the loop's control on every step and each step's cell math is one
            kernel (tf/passes/unroll.py says which loops qualify; the report names
            each loop and whether it was unrolled).
        exclude: TF ops kept out of stitching, to bisect a numerical difference or a
            slow kernel without turning stitching off (XLA's ``jit_scope`` and
            TF-TRT's exclusion lists do the same).  Each entry is an op type, matched
            exactly (``"Softmax"``), or a pattern of node names matched with
            ``fnmatch.fnmatchcase`` (``"model/block3*"``, ``"*/gelu/*"``), names as
            the report lists them (the graph after Grappler).  A matched node stays
            the TF op the graph has: it is in no kernel, no pass folds, removes or
            rewrites it, and the report lists it as not fused with the entry that
            matched; an entry that matches nothing gets a note in the report.  A
            ``str`` is one entry; a list becomes a tuple (default ``()``: none).
            ``$STITCHING_EXCLUDE`` (comma-separated entries) adds to it in every
            Options the process makes.

    Raises:
        TypeError: a field of the wrong type (``Options(background_compile="no")``).
        ValueError: a field out of range (``min_ops=0``, ``autotune_margin=0.5``,
            an unknown ``planner``).
    """

    # Described in the docstring above; the comments say where each is implemented.
    planner: str = "search"            # plan/__init__.py: PLANNERS
    min_ops: int = 2                   # plan/legality.py: work()
    progress: bool | None = None       # tf/pipeline.py
    verify: bool = False               # stage verifiers
    gemm: bool = True                  # tf/passes/gemm.py
    einsum: bool = True                # tf/passes/einsum.py
    pad_fold: bool = True              # tf/passes/padfold.py
    depthwise: bool = True             # tf/passes/lift.py, ir/ops.py DepthwiseConv2D
    seq_split: bool = True             # tf/passes/seqsplit.py
    xla_gemm: bool = False             # tf/passes/xladot.py (opt-in)
    blas_gemm: bool = True             # tf/passes/blas.py, runtime/gemm.cc
    fused_attention: bool = True       # tf/passes/attention.py, runtime/attention.cc
    conv1x1_gemm: bool = True          # tf/passes/conv1x1.py
    variable_updates: bool = False     # tf/passes/variables.py (opt-in)
    transposed_gemm: bool = False      # tf/passes/gemm.py (opt-in)
    background_compile: bool | None = None   # background_compile_on(); tf/function.py, keras.py
    dump_dir: str | None = None        # tf/dump.py
    dump_passes: str | None = None     # tf/passmanager.py
    fallback: bool = False             # tf/passes/original.py
    stitch_backward: bool = True       # tf/passes/original.py
    autotune: bool = False             # tf/passes/autotune.py, runtime/autotune.py
    autotune_margin: float = 1.3       # arbitrary: about the model's error on this machine
    #                                    (tools/plan_audit.py)
    unroll_loops: int = 64             # tf/passes/unroll.py
    exclude: tuple = ()                # tf/passes/exclude.py, and each pass that rewrites

    def __post_init__(self):
        # One pattern, or a list of them, is a tuple here: the dataclass is frozen and
        # hashed, and a list would make it unhashable (and mutable behind its back).
        if isinstance(self.exclude, str):
            object.__setattr__(self, "exclude", (self.exclude,))
        elif isinstance(self.exclude, list):
            object.__setattr__(self, "exclude", tuple(self.exclude))
        extra = [e.strip() for e in os.environ.get(EXCLUDE_ENV, "").split(",") if e.strip()]
        if extra and isinstance(self.exclude, tuple):
            # $STITCHING_EXCLUDE: entries for every Options the process makes, as
            # TF-TRT's TF_TRT_OP_DENYLIST (a bisect without a code change); once each
            object.__setattr__(self, "exclude", tuple(dict.fromkeys(self.exclude + tuple(extra))))
        for f in dataclasses.fields(self):
            _check(f.name, f.type, getattr(self, f.name))


def _check(name: str, annotation: str, value) -> None:
    """Raise TypeError/ValueError naming ``Options.<name>`` when ``value`` does not fit.
    Flags are checked by their annotation (so a new ``bool`` field is checked without a
    line here); the others by name (tests/test_options.py fails for a field that
    accepts any object)."""
    where = f"Options.{name}"
    if annotation in ("bool", "bool | None"):
        if not (isinstance(value, bool) or (value is None and annotation != "bool")):
            want = "True or False" + (" or None" if annotation != "bool" else "")
            raise TypeError(f"{where} must be {want}, got {value!r}")
    elif name == "planner":
        from .plan import ALIASES, PLANNERS
        if not isinstance(value, str) or (value not in PLANNERS and value not in ALIASES):
            raise ValueError(f"{where}: unknown planner {value!r}; choose one of "
                             f"{', '.join(PLANNERS)}")
    elif name == "min_ops":
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{where} must be an int, got {value!r}")
        if value < 1:
            raise ValueError(f"{where} must be >= 1, got {value}")
    elif name == "unroll_loops":
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{where} must be an int (a largest trip count), got {value!r}")
        if value < 0:
            raise ValueError(f"{where} must be >= 0 (0 unrolls no loop), got {value}")
    elif name == "autotune_margin":
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{where} must be a number (a predicted speed-up), got {value!r}")
        if math.isnan(value) or value < 1.0:
            raise ValueError(f"{where} must be >= 1 (a predicted speed-up; math.inf "
                             f"measures every kernel), got {value!r}")
    elif name == "dump_passes":
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{where} must be a regular expression (str) or None, "
                            f"got {type(value).__name__}")
        try:
            re.compile(value or "")
        except re.error as e:
            raise ValueError(f"{where}: {value!r} is not a regular expression: {e}") \
                from None
    elif name == "exclude":
        if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
            raise TypeError(f"{where} must be a str or a tuple or list of str (op types "
                            f"or node-name patterns), got {value!r}")
        if "" in value:
            raise ValueError(f"{where}: an empty entry matches no op type or node name, "
                             f"got {value!r}")
    elif name == "dump_dir":
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise TypeError(f"{where} must be a directory path or None, "
                            f"got {type(value).__name__}")


EXCLUDE_ENV = "STITCHING_EXCLUDE"
BACKGROUND_ENV = "STITCHING_BACKGROUND_COMPILE"
_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


# STITCHING_ATTENTION_AUTOTUNE=0 (or false, no, off): where TF's GEMM is oneDNN's, the
# attention pass marks no StitchedAttention for timing against its unfused products
# (tf/passes/attention.py autotuned); part of a stitched result's key (tf/results.py).
ATTENTION_AUTOTUNE_ENV = "STITCHING_ATTENTION_AUTOTUNE"


def attention_autotune_on() -> bool:
    return os.environ.get(ATTENTION_AUTOTUNE_ENV, "1").strip().lower() not in _OFF


DISABLE_ENV = "STITCHING_DISABLE"
DISABLED_NOTE = ("stitching is off ($STITCHING_DISABLE): this trace is stock TF's, "
                 "nothing was planned or compiled")


def disabled() -> bool:
    """Whether ``$STITCHING_DISABLE`` turns stitching off for the whole process (``1``,
    ``true``, ``yes``, ``on``): ``stitching.function`` then traces and runs as
    ``tf.function`` does (its report says so) and ``stitching.keras.stitch`` leaves the
    model as it is: a switch for operations, to rule stitching out without a code
    change.

    Raises:
        ValueError: the variable holds something else.
    """
    value = os.environ.get(DISABLE_ENV, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF or not value:
        return False
    raise ValueError(f"${DISABLE_ENV}={value!r}: use 1 (stitching off) or 0")


def background_compile_on(options: Options) -> bool:
    """Whether ``options`` asks for tiered execution (where it is safe: the callers
    decide that).  An explicit ``background_compile`` wins; ``None`` is on unless
    ``$STITCHING_BACKGROUND_COMPILE`` turns it off (``0``, ``false``, ``no``,
    ``off``), a switch for a whole process (a benchmark's steady state, a test
    session that expects kernels at the first call) without touching its code.

    Raises:
        ValueError: the variable holds something else (a typo must not silently
            pick one behaviour).
    """
    if options.background_compile is not None:
        return options.background_compile
    value = os.environ.get(BACKGROUND_ENV, "").strip().lower()
    if value in _OFF:
        return False
    if value in _ON or not value:
        return True
    raise ValueError(f"${BACKGROUND_ENV}={value!r}: use 0 (synchronous: first calls "
                     "wait for their kernels) or 1 (tiered, the default)")
