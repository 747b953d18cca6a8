"""Readable text of a Schedule (for the report, `explain` and debugging).

First line: a one-line summary (the report shows only that line), e.g.

    row kernel over [?x768]: 2 reductions, 3 passes, unit = auto rows (~4096 elements)

then one line per pass / scalar stage and the non-trivial placements.
"""
from __future__ import annotations

from .passes import KernelKind, Placement


def _axes_text(sched) -> str:
    return "x".join(sched.domain.axis_size_text(a) for a in range(sched.rank)) or "scalar"


def _node(sched, k) -> str:
    if k < 0:
        return f"in{-k - 1}"
    return f"{sched.spec.nodes[k].op}#{k}"


def _unit_text(sched) -> str:
    rpt = sched.rows_per_task
    cb = sched.col_block
    if sched.kind == KernelKind.ROW:
        return f"{rpt} row(s)" if rpt else "auto rows (~4096 elements)"
    if sched.kind == KernelKind.COLUMN:
        return f"kept index x {cb or 'auto (64..2048)'} columns"
    rows = f"{rpt} row(s)" if rpt else "auto rows"
    return f"{rows} or blocks of {cb or 'auto (16384)'} elements"


def _packed_summary(sched) -> str:
    sizes = [n for _, n in sched.segments]
    shown = ", ".join(map(str, sizes[:6])) + (", …" if len(sizes) > 6 else "")
    shared = len(sched.scalars[0].compute) if sched.scalars else 0
    return (f"packed kernel over [{_axes_text(sched)}]: packed {len(sizes)} chains "
            f"({shown} elements), {shared} shared scalar(s); unit = blocks of "
            f"{sched.col_block or 'auto (16384)'} elements")


def summary(sched) -> str:
    if sched.kind == KernelKind.PACKED:
        return _packed_summary(sched)
    n_red = sum(len(p.accumulate) for p in sched.passes)
    parts = [f"{sched.kind.value} kernel over [{_axes_text(sched)}]"]
    if n_red:
        parts.append(f"{n_red} reduction(s) over axis {list(sched.reduce_axes)}")
    parts.append(f"{len(sched.passes)} pass(es)")
    if sched.scratch:
        parts.append(f"{len(sched.scratch)} in scratch")
    return ", ".join(parts[:1]) + ": " + ", ".join(parts[1:]) + \
        f"; unit = {_unit_text(sched)}"


def describe(sched) -> str:
    lines = [summary(sched)]
    scal = {s.index: s for s in sched.scalars}
    for p in sched.passes:
        if p.index in scal and scal[p.index].compute:
            lines.append(_scalar_line(sched, scal[p.index]))
        lines.append(_pass_line(sched, p))
    last = scal.get(len(sched.passes))
    if last is not None and last.compute:
        lines.append(_scalar_line(sched, last))
    special = [e for e in sched.edges
               if e.placement in (Placement.RECOMPUTE, Placement.SCRATCH,
                                  Placement.COLUMN_BLOCK)]
    for e in special:
        lines.append(f"  {_node(sched, e.src)} -> {_node(sched, e.dst)}: {e.placement.value}")
    _, front = sched.hoisted()
    if front:
        when = "per group of rows" if sched.hoist_per_group() else "per call"
        lines.append(f"  once {when}, per column (last-axis scratch): " +
                     " ".join(_node(sched, k) for k in front))
    products = sched.products()
    if products:
        how = "in a prologue phase" if sched.prologue_phase() else "in each unit's prologue"
        sizes = ", ".join(str(g.size) for g in sched.side_groups)
        lines.append(f"  products once per row group, {how}: " +
                     " ".join(_node(sched, k) for k in products) +
                     (f" (side loops over {sizes})" if sizes else ""))
    for k in sched.live:
        n = sched.spec.nodes[k]
        if n.op == "DepthwiseConv2D":
            kh, kw = sched.spec.type_of(n.args[1]).shape[:2]
            lines.append(f"  window {_node(sched, k)}: {kh}x{kw}, strides "
                         f"{n.attrs['strides']}, pads {n.attrs['pads']}, input "
                         f"{_node(sched, n.args[0])} read through it, taps summed per row")
    lines.extend(f"  note: {n}" for n in sched.notes)
    return "\n".join(lines)


def _pass_line(sched, p) -> str:
    what = " ".join(_node(sched, k) for k in p.compute) or "-"
    extra = []
    if p.recomputed:
        extra.append("recompute " + " ".join(_node(sched, k) for k in p.recomputed))
    if p.scratch_loads:
        extra.append("scratch in " + " ".join(_node(sched, k) for k in p.scratch_loads))
    if p.scratch_stores:
        extra.append("scratch out " + " ".join(_node(sched, k) for k in p.scratch_stores))
    if p.accumulate:
        extra.append("accumulate " + " ".join(_node(sched, k) for k in p.accumulate))
    if p.stores:
        extra.append("store " + " ".join(_node(sched, k) for k in p.stores))
    tail = f" ({'; '.join(extra)})" if extra else ""
    return f"  pass {p.index}: {what}{tail}"


def _scalar_line(sched, s) -> str:
    where = {KernelKind.ROW: "row scalars", KernelKind.PACKED: "shared scalars"}.get(
        sched.kind, "column block")
    what = " ".join(_node(sched, k) for k in s.compute)
    store = f" (store {' '.join(_node(sched, k) for k in s.stores)})" if s.stores else ""
    return f"  {where} {s.index}: {what}{store}"
