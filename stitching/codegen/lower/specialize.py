"""Which spec is compiled for a region: the region's own, or a shape-generic twin.

A CNN repeats the same fused region at many channel counts and image sizes
(ResNet50: 50 kernels, 15 distinct specs, 6 distinct up to static dims; EfficientNetB0:
37 distinct, 7 up to static dims).  Each distinct spec costs a Numba compile (~0.7 s),
so cold compile time is dominated by copies that differ only in numbers.  Kernels are
already shape-generic in their unknown dims, so we compile the *generic twin* of a
spec -- every static dim greater than 1 made unknown -- and register that code under
the concrete spec string.  Size-1 dims stay static (they mean broadcasting), and so
do pins of a node's unknown dim to 1; a node pinned to a larger size keeps the spec
concrete; constants keep their shapes.

Launch parameters (rows per unit, column block) are not part of the code either: the
cost model picks them per concrete shape, and the op hands them to the shape function
at run time (cpu/emitter.py), so every target is stripped of them (``LAUNCH_PARAMS``).

Short rows keep their length: a row kernel whose reduced (last) axis is static and at
most ``STATIC_ROW_MAX`` long is compiled concrete, so its row loops have a known trip
count (no remainder loops, full unrolling).  Attention softmax over 128 keys measured
13% faster that way (p10 2.35 -> 2.04 ms, 32x12x128x128); models repeat such regions
at one shape (every layer's attention), so it costs few extra compiles.

Short element-wise rows keep their length too: an element-wise kernel over [rows, C]
with C static and under ``SHORT_ROW`` (an image's 3 channels) compiles a twin that
keeps every last dim of size C, so that it runs as one flat loop with its per-channel
values tiled at a known period (cpu/emitter.py, ``_short_rows``): EfficientNetB0's
input kernel, 3 elements a row, ran 7.5x faster.  Such kernels share code per row
length, not across lengths.  Rows of a vector or more stay generic: the flat loop ran
a BatchNorm + residual over [100352, 16] 2.4x faster, [25088, 24] 2.2x and [100352, 32]
1.2x, but with one code per channel count MobileNetV2 compiled 21 codes instead of 15
(its cold first call with the tier-2 builds 2.9 -> 3.7 s, EfficientNetB0's 4.7 -> 5.3
s) to save ~0.2 of its 26 ms at batch 8 (measured here, session 27).  Testing the row
length at run time instead, in the shape-generic code, kept the code count but put a
second loop nest in every element-wise kernel over two axes: the cold first calls took
2.9 -> 5.0 s (MobileNetV2), 4.8 -> 6.5 s (EfficientNetB0) and 2.3 -> 5.4 s (ResNet50).

The twin is used only when it is exactly as good: it must validate, and its schedule
must have the same structure as the concrete one (kind, reduced axes, passes, where
each value lives, scratch and column blocks).  Static sizes can change those
decisions (a scratch budget, a dim collapse), and then the concrete spec is compiled.
Safety does not depend on the twin: its shape function checks every input against the
others at run time (unknown dims broadcast together must agree); the served kernel
carries the concrete spec's static input dims, which the op (and
``CompiledKernel.shapes``) check before running it, with the same "input i dim d must
be n" error the concrete kernel would give; and the op checks outputs against the
graph's static shapes.
"""
from __future__ import annotations

from ...ir.ops import infer
from ...ir.spec import KernelSpec, SpecError, SpecNode, validate
from ...schedule import KernelKind, ScheduleError, build_schedule


LAUNCH_PARAMS = ("rows_per_task", "col_block")   # run-time data, not code
STATIC_ROW_MAX = 512     # tuned: row kernels over static rows this short stay concrete
SHORT_ROW = 16           # tuned: element-wise rows this short keep their length (above)


def _code_schedule(schedule: dict) -> dict:
    """The schedule parameters the generated code depends on."""
    return {k: v for k, v in schedule.items() if k not in LAUNCH_PARAMS}


def _generic_shape(shape, keep: int = 0):
    """``shape`` with its static dims > 1 unknown; a last dim of size ``keep`` stays."""
    return tuple(d if d <= 1 or (keep and i == len(shape) - 1 and d == keep) else -1
                 for i, d in enumerate(shape))


def generic_twin(spec: KernelSpec, keep: int = 0) -> KernelSpec | None:
    """``spec`` with static dims > 1 made unknown (validated), but last dims of size
    ``keep`` (short rows, above), or None if that changes nothing or does not
    validate."""
    inputs = tuple(type(t)(t.dtype, _generic_shape(t.shape, keep)) for t in spec.inputs)
    nodes = []
    for n in spec.nodes:
        # A node may claim a size its inputs leave unknown (a pin the shape function
        # checks): a pin to 1 is kept, a pin to a larger size keeps the spec concrete.
        implied = infer(n.op, n.attrs, [spec.type_of(a) for a in n.args]).shape
        if any(c > 1 and i < 0 for c, i in zip(n.type.shape, implied)):
            return None
        attrs = dict(n.attrs)
        if n.op == "Reshape":
            attrs["shape"] = _generic_shape(attrs["shape"], keep)
        args = [inputs[-a - 1] if a < 0 else nodes[a].type for a in n.args]
        try:
            t = infer(n.op, attrs, args)
        except ValueError:
            return None
        pinned = tuple(1 if c == 1 and d < 0 else d for c, d in zip(n.type.shape, t.shape))
        nodes.append(SpecNode(n.op, n.args, attrs, type(t)(t.dtype, pinned)))
    try:
        twin = validate(KernelSpec(inputs, tuple(nodes), spec.outputs,
                                   _code_schedule(spec.schedule), spec.same_dims))
    except SpecError:
        return None
    return None if twin.to_json() == spec.to_json() else twin


def _structure(sched) -> tuple:
    return (sched.kind, sched.reduce_axes, sched.domain.rank, len(sched.passes),
            tuple((e.src, e.dst, e.placement) for e in sched.edges),
            tuple(sched.scratch), tuple(sched.blocks), sched.live)


_targets: dict = {}   # spec hash -> its compile target (pure in the spec: memoized)


def compile_target(spec: KernelSpec) -> KernelSpec:
    """The spec whose code serves ``spec`` (validated): its generic twin when that
    schedules the same way, else ``spec`` itself.  The disk-cache probe, the parallel
    compiler and compile_kernel all ask, so the answer is remembered per spec."""
    target = _targets.get(spec.hash)
    if target is None:
        target = _targets[spec.hash] = _decide(spec)
    return target


def _decide(spec: KernelSpec) -> KernelSpec:
    own = spec
    if any(k in spec.schedule for k in LAUNCH_PARAMS):
        own = validate(KernelSpec(spec.inputs, spec.nodes, spec.outputs,
                                  _code_schedule(spec.schedule), spec.same_dims))
    twin = generic_twin(spec)
    if twin is None:
        return own
    try:
        mine = build_schedule(spec)
        if mine.kind == KernelKind.ROW and 0 <= mine.domain.axes[-1].size <= STATIC_ROW_MAX:
            return own                  # short static rows: no twin's schedule needed
        row = mine.domain.axes[-1].size if mine.domain.rank else 0
        if mine.kind == KernelKind.ELEMENTWISE and mine.domain.rank == 2 and \
                0 < row < SHORT_ROW:
            twin = generic_twin(spec, keep=row)
            if twin is None:
                return own
            theirs = build_schedule(twin)
            return twin if _structure(mine) == _structure(theirs) and \
                theirs.domain.axes[-1].size == row else own
        theirs = build_schedule(twin)
    except ScheduleError:
        return own
    return twin if _structure(mine) == _structure(theirs) else own
