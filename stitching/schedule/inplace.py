"""Which outputs of a kernel may be written over one of its inputs (in place).

Stock TF's element-wise kernels write their result over an input whose buffer nobody
else holds (``forward_input_or_allocate_output``): a ReluGrad reuses the incoming
gradient, a Mul the Sub before it.  A kernel that always allocated its outputs kept
input and output alive together, and a stitched train step peaked higher than TF's.

Safe pairs, by the structure of the code: in an ELEMENTWISE kernel, and in a column
kernel of a single pass over its data (a ReluGrad fused with the BiasAddGrad that
sums it), every element of the domain is handled once, loading its inputs before it
stores any output (codegen/cpu/emitter.py: _ew_body, the row and column passes), and
an input with the output's shape is read at that element only (broadcast inputs have
fewer elements, LAYOUT ops only add or drop size-1 dims).  So output o may overwrite
input i when their dtypes and static shapes are equal (the op also checks the run-time
shapes).  Kernels of several passes read their inputs again after the first pass has
stored: never an output stored before the last pass; nor, in a single pass, kernels
keeping values in column blocks; nor row kernels (not needed by the train steps
measured, so not audited).  In a column kernel split into phases, per-column outputs
are stored in the last phase by one unit per column block, after that unit's last read
of the column.

A column kernel of several passes (a BatchNorm's backward: the per-channel sums in the
first, the gradient in the second) may write an output its last pass stores, and no
earlier one, over an input: a unit runs its passes one after another over its own
columns (whole), or every unit runs pass p in phase p (split), so every earlier read
of an element precedes the last pass, whose loop loads the element before storing it;
column-block values are per column, never an element of an input.  The CNN train
step's two BatchNorm backward kernels wrote 4 MiB each next to a dead input of theirs,
one of them while Eigen's 32 MiB filter-gradient buffer was live: the step's peak.

The CPU backend compiles a second loop nest for the aliased case that stores through
the input's own pointer: LLVM then sees one base and the same index (a dependence of
distance 0) and vectorizes; through two unrelated pointers that alias, its run-time
overlap check sends the loop to the scalar remainder (an erf kernel: 4.0 -> 6.5 ms).
"""
from __future__ import annotations

from .passes import KernelKind


def pairs(spec, sched) -> list:
    """[(input index, output index)] the kernel may write in place, each at most once;
    ``sched``: its Schedule."""
    if sched.kind == KernelKind.ROW or sched.kind == KernelKind.COLUMN and (
            sched.scratch or len(sched.passes) == 1 and sched.blocks):
        return []
    last_only = _stored_last(sched) if sched.kind == KernelKind.COLUMN and \
        len(sched.passes) > 1 else None
    # inputs read through layout ops (schedule/layout.py) are read at other positions
    # than the one stored, and views are no inputs of the op at all.  The schedule's
    # spec has the views (callers may pass the original spec: tf/passes/forward.py)
    views = getattr(sched.spec, "views", ())
    n_real = len(sched.spec.inputs) - len(views)
    viewed = {v.source for v in views} | set(range(n_real, len(sched.spec.inputs)))
    # a depthwise convolution's input is read at the neighbours of each pixel stored
    viewed |= {-r - 1 for r in sched.domain.windows}
    # inputs another holder keeps (a variable's value, a constant: the
    # spec's ``held``, plan/region.py): TF would never grant them
    held = spec.schedule.get("held", 0)
    viewed |= {i for i in range(len(spec.inputs)) if held >> i & 1}
    out, used = [], set()
    for o, node in enumerate(spec.outputs):
        t = spec.type_of(node)
        if node in spec.outputs[:o]:          # the same value twice: one buffer each
            continue
        if last_only is not None and node not in last_only:
            continue
        # A packed kernel runs its segments' loops one after another: an output may
        # only take the buffer of an input its own segment reads and no other does
        # (element j is loaded before it is stored; another segment reading the input
        # later -- two chains of one gradient, m and v of Adam -- would see the output).
        mine = _segment_loads(sched, node)
        for i, ti in enumerate(spec.inputs):
            if mine is not None and i not in mine or i in viewed:
                continue
            if i not in used and ti.dtype == t.dtype and tuple(ti.shape) == tuple(t.shape):
                used.add(i)
                out.append((i, o))
                break
    return out


def _segment_loads(sched, node):
    """In a packed kernel, the inputs the pass that stores ``node`` may overwrite: those
    it loads and no other pass (nor the shared scalars) reads; else None (one loop for
    the whole kernel: every element's loads precede its stores)."""
    if sched.kind != KernelKind.PACKED:
        return None
    mine = next((p for p in sched.passes if node in p.stores), None)
    if mine is None:
        return set()
    others = [p for p in list(sched.passes) + list(sched.scalars) if p is not mine]
    return {i for i in mine.loads if not any(i in p.loads for p in others)}


def _stored_last(sched) -> set:
    """The outputs a column kernel of several passes stores in its last pass and in no
    earlier pass nor scalar stage."""
    earlier = {k for p in sched.passes[:-1] for k in p.stores}
    earlier |= {k for st in sched.scalars for k in st.stores}
    return set(sched.passes[-1].stores) - earlier
