"""KernelSpec: one fused region as data.

The spec is what a ``StitchedKernel`` TF node carries in its ``spec`` attribute.
It is a tiny SSA program over the op table plus the schedule parameters the
cost model chose.  It must round-trip through JSON exactly, hash the same for
identical regions (so twelve identical LayerNorms compile once), and, because a
graph file is untrusted, ``KernelSpec.from_json`` re-validates *everything*:
schema, op names, attribute types and ranges, references, and it re-infers
every node's dtype and shape and checks them against what the file claims.
Code generation only ever sees a validated spec.

Reference encoding inside ``args``/``outputs``: ``k >= 0`` is node ``k``
(must be earlier than the node using it); ``-(j + 1)`` is kernel input ``j``.

JSON layout::

    {"version": 1,
     "inputs":  [{"dtype": "float32", "shape": [-1, 768]}, ...],
     "nodes":   [{"op": "Mean", "args": [-1], "attrs": {"axes": [1], "keep_dims": true},
                  "dtype": "float32", "shape": [-1, 1]}, ...],
     "outputs": [5, 9],
     "schedule": {"rows_per_task": 4},
     "same_dims": [[[0, 0], [1, 0]]]}

``schedule`` holds the cost model's launch parameters and ``held``: a bit mask of the
inputs TF never lets the op write over (a variable's value, a constant;
plan/region.py), which no in-place pair takes (schedule/inplace.py).  A false bit
only costs an in-place write; a missing one a pair TF refuses at run time.

``same_dims`` (optional, absent when empty) lists groups of unknown input dims
(``[input, dim]``) that the graph proves equal (ir/symdims.py): two independent chains
of a packed kernel may share a loop axis over them (schedule/domain.py).  It is a
claim a file could get wrong, and a harmless one: every dim in a group is checked
against the group's first at run time, as any two dims on one loop axis are, so a
false claim is an error naming the dims, never a read out of bounds.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from dataclasses import dataclass, field

from . import dtypes as dt
from .graph import TensorType
from .ops import OPS, arity_ok, arity_text, infer

VERSION = 1
MAX_INPUTS = 64
MAX_OUTPUTS = 32
# Limits on one spec (docs/serving-trust.md).  A spec over them is invalid: an error
# naming the node, before anything is parsed or compiled.
MAX_NODES = 4096             # 4x the planner's largest kernel (plan/search.py max_kernel,
                             # in IR nodes; composites expand); compile time and memory
                             # are bounded apart (compile/parallel.py compile_bounded)
MAX_RANK = 8
MAX_JSON_BYTES = 1 << 20     # arbitrary: ~40x the largest spec the planner makes
MAX_JSON_DEPTH = 16          # a spec nests 5 deep (spec, nodes, node, attrs, a list)
MAX_DIM = 1 << 40
MAX_SAME_DIMS = MAX_INPUTS * MAX_RANK   # every unknown input dim in some group, at most

# Schedule parameters: name -> (min, max).  Anything else is rejected.
SCHEDULE_PARAMS = {
    "rows_per_task": (1, 1 << 20),
    "col_block": (1, 1 << 24),
    "scratch": (0, 1),          # 1: keep values reused across passes in per-row scratch
    "split_rows": (0, 1),       # 1: a row may be split across units (row kind; phases)
    "held": (1, (1 << 63) - 1),  # bit j: TF never lets the op write over input j (a
    #                              variable's value, a constant): no
    #                              in-place pair takes it (schedule/inplace.py)
}


class SpecError(ValueError):
    """A spec that is malformed or inconsistent (message names the problem)."""


@dataclass(frozen=True)
class SpecNode:
    op: str
    args: tuple
    attrs: dict
    type: TensorType


@dataclass(frozen=True)
class KernelSpec:
    inputs: tuple            # tuple[TensorType]
    nodes: tuple             # tuple[SpecNode]
    outputs: tuple           # tuple[int], node indices
    schedule: dict = field(default_factory=dict)
    same_dims: tuple = ()    # tuple of groups, each a tuple of (input, dim) pairs

    # -- identity ---------------------------------------------------------
    def to_dict(self) -> dict:
        d = {
            "version": VERSION,
            "inputs": [{"dtype": t.dtype, "shape": list(t.shape)} for t in self.inputs],
            "nodes": [{"op": n.op, "args": list(n.args),
                       "attrs": {k: _jsonable(v) for k, v in sorted(n.attrs.items())},
                       "dtype": n.type.dtype, "shape": list(n.type.shape)}
                      for n in self.nodes],
            "outputs": list(self.outputs),
            "schedule": dict(sorted(self.schedule.items())),
        }
        if self.same_dims:      # absent when empty: every other spec keeps its hash
            d["same_dims"] = [[list(p) for p in g] for g in self.same_dims]
        return d

    def to_json(self) -> str:
        """``to_dict()`` as canonical JSON (sorted keys, no spaces): the text the hash
        is of.  Built here without to_dict's copies (its sorted dicts and lists, which
        the encoder's sort_keys and its encoding of tuples as arrays make anyway) and
        without the encoder's circularity check (a spec holds no cycle): the same text,
        ~25% sooner (the planner hashes every candidate region's spec)."""
        d = {
            "version": VERSION,
            "inputs": [{"dtype": t.dtype, "shape": t.shape} for t in self.inputs],
            "nodes": [{"op": n.op, "args": n.args,
                       "attrs": {k: _jsonable(v) for k, v in n.attrs.items()},
                       "dtype": n.type.dtype, "shape": n.type.shape}
                      for n in self.nodes],
            "outputs": self.outputs,
            "schedule": self.schedule,
        }
        if self.same_dims:
            d["same_dims"] = self.same_dims
        return _CANONICAL.encode(d)

    @functools.cached_property
    def hash(self) -> str:
        """Content hash (memoized: a spec is never changed after it is built)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:24]

    @property
    def output_types(self) -> list:
        return [self.nodes[i].type for i in self.outputs]

    def type_of(self, ref: int) -> TensorType:
        return self.inputs[-ref - 1] if ref < 0 else self.nodes[ref].type

    def with_schedule(self, **params) -> "KernelSpec":
        sched = dict(self.schedule)
        sched.update(params)
        return validate(KernelSpec(self.inputs, self.nodes, self.outputs, sched,
                                   self.same_dims))

    # -- parsing ----------------------------------------------------------
    @classmethod
    def from_json(cls, text) -> "KernelSpec":
        if isinstance(text, bytes):
            if len(text) > MAX_JSON_BYTES:
                raise SpecError(f"spec is {len(text)} bytes, limit {MAX_JSON_BYTES}")
            try:
                text = text.decode("utf-8", errors="strict")
            except UnicodeDecodeError as e:
                raise SpecError(f"spec is not utf-8 text: {e}") from None
        if not isinstance(text, str):
            raise SpecError("spec must be a JSON string")
        _check_text(text)
        try:
            d = json.loads(text, parse_constant=_reject_constant)
        except (json.JSONDecodeError, ValueError, RecursionError) as e:
            raise SpecError(f"spec is not valid JSON: {e}") from None
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d) -> "KernelSpec":
        _expect(isinstance(d, dict), "spec must be a JSON object")
        _expect(set(d) <= _KEYS, f"unknown spec keys {sorted(set(d) - _KEYS)}")
        _expect(_is_int(d.get("version")) and d["version"] == VERSION,
                f"unsupported spec version {str(d.get('version'))[:20]!r} (must be the "
                f"integer {VERSION})")
        inputs = d.get("inputs")
        _expect(isinstance(inputs, list) and len(inputs) <= MAX_INPUTS,
                f"inputs must be a list of at most {MAX_INPUTS}")
        in_types = tuple(_parse_type(t, f"inputs[{i}]") for i, t in enumerate(inputs))
        nodes = d.get("nodes")
        _expect(isinstance(nodes, list) and 0 < len(nodes) <= MAX_NODES,
                f"nodes must be a non-empty list of at most {MAX_NODES}")
        parsed = []
        for i, n in enumerate(nodes):
            where = f"nodes[{i}]"
            _expect(isinstance(n, dict) and set(n) == {"op", "args", "attrs", "dtype", "shape"},
                    f"{where} must have exactly op, args, attrs, dtype, shape")
            _expect(isinstance(n["op"], str) and n["op"] in OPS,
                    f"{where}: op {str(n['op'])[:40]!r} is not a known op")
            args = n["args"]
            _expect(isinstance(args, list) and all(_is_int(a) for a in args),
                    f"{where}: args must be a list of ints")
            _expect(isinstance(n["attrs"], dict), f"{where}: attrs must be an object")
            t = _parse_type({"dtype": n["dtype"], "shape": n["shape"]}, where)
            parsed.append(SpecNode(n["op"], tuple(args), dict(n["attrs"]), t))
        outs = d.get("outputs")
        _expect(isinstance(outs, list) and 0 < len(outs) <= MAX_OUTPUTS
                and all(_is_int(o) for o in outs),
                f"outputs must be a non-empty list of at most {MAX_OUTPUTS} ints")
        sched = d.get("schedule", {})
        _expect(isinstance(sched, dict), "schedule must be an object")
        same = d.get("same_dims", [])
        _expect(isinstance(same, list) and len(same) <= MAX_SAME_DIMS and all(
                isinstance(g, list) and len(g) <= MAX_SAME_DIMS and all(
                    isinstance(p, list) and len(p) == 2 and all(_is_int(x) for x in p)
                    for p in g) for g in same),
                f"same_dims must be a list of at most {MAX_SAME_DIMS} groups of "
                "[input, dim] pairs")
        return validate(cls(in_types, tuple(parsed), tuple(outs), dict(sched),
                            tuple(tuple(tuple(p) for p in g) for g in same)))


def validate(spec: KernelSpec) -> KernelSpec:
    """Check a spec built in memory or parsed from JSON; returns a canonical copy."""
    n_in = len(spec.inputs)
    nodes = []
    for i, n in enumerate(spec.nodes):
        where = f"nodes[{i}] ({n.op})"
        d = OPS.get(n.op)
        _expect(d is not None, f"{where}: unknown op")
        _expect(arity_ok(d, len(n.args)),
                f"{where}: takes {arity_text(d)} args, got {len(n.args)}")
        for a in n.args:
            _expect(-n_in <= a < i, f"{where}: reference {a} is out of range or not earlier")
        try:
            attrs = d.validate_attrs(n.attrs)
            t = infer(n.op, attrs, [spec.type_of(a) if a < 0 else nodes[a].type
                                    for a in n.args])
        except ValueError as e:
            raise SpecError(f"{where}: {e}") from None
        _expect(t.dtype == n.type.dtype, f"{where}: claims dtype {n.type.dtype}, "
                                         f"inferred {t.dtype}")
        _expect(_shapes_agree(t.shape, n.type.shape),
                f"{where}: claims shape {list(n.type.shape)}, inferred {list(t.shape)}")
        nodes.append(SpecNode(n.op, tuple(n.args), attrs, n.type))
    # a kernel with no outputs computes nothing (the emitter would write an empty
    # loop body: fetching a missing output 'y:7' once made such a region)
    _expect(len(spec.outputs) > 0, "a kernel needs at least one output")
    for o in spec.outputs:
        _expect(0 <= o < len(nodes), f"output reference {o} must name a node")
    _expect(len(set(spec.outputs)) == len(spec.outputs), "duplicate outputs")
    for k, v in spec.schedule.items():
        _expect(k in SCHEDULE_PARAMS, f"unknown schedule parameter {str(k)[:40]!r}")
        lo, hi = SCHEDULE_PARAMS[k]
        _expect(_is_int(v) and lo <= v <= hi, f"schedule.{k} must be an int in [{lo}, {hi}]")
    return KernelSpec(tuple(spec.inputs), tuple(nodes), tuple(spec.outputs),
                      dict(spec.schedule), _check_same_dims(spec))


def _check_same_dims(spec) -> tuple:
    """Groups of two or more distinct unknown input dims, each dim in one group."""
    seen = set()
    for g in spec.same_dims:
        _expect(len(g) >= 2, "same_dims: a group needs at least two dims")
        for j, i in g:
            _expect(0 <= j < len(spec.inputs) and 0 <= i < len(spec.inputs[j].shape)
                    and spec.inputs[j].shape[i] == -1,
                    f"same_dims: [{j}, {i}] is not an unknown input dim")
            _expect((j, i) not in seen, f"same_dims: [{j}, {i}] is in two groups")
            seen.add((j, i))
    return tuple(tuple(tuple(p) for p in g) for g in spec.same_dims)


_KEYS = frozenset({"version", "inputs", "nodes", "outputs", "schedule", "same_dims"})


def _shapes_agree(inferred, claimed) -> bool:
    """Claimed may be more specific than inferred (an unknown dim pinned to a size)."""
    if len(inferred) != len(claimed):
        return False
    return all(a == b or a == -1 for a, b in zip(inferred, claimed))


def _parse_type(t, where) -> TensorType:
    _expect(isinstance(t, dict) and set(t) == {"dtype", "shape"},
            f"{where} must have dtype and shape")
    _expect(t["dtype"] in dt.ALL_DTYPES, f"{where}: unsupported dtype {str(t['dtype'])[:20]!r}")
    s = t["shape"]
    _expect(isinstance(s, list) and len(s) <= MAX_RANK
            and all(_is_int(x) and -1 <= x <= MAX_DIM for x in s),
            f"{where}: shape must be a list of at most {MAX_RANK} ints >= -1")
    return TensorType(t["dtype"], tuple(s))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _expect(cond, msg):
    if not cond:
        raise SpecError(msg)


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def _check_text(text: str) -> None:
    """The limits json.loads itself does not keep, checked before it runs: size, a NUL
    (the op's C strings would end there: what runs must be all of what was checked)
    and nesting (Python's parser recurses: RecursionError, or worse, on deep input)."""
    if len(text) > MAX_JSON_BYTES:
        raise SpecError(f"spec is {len(text)} bytes, limit {MAX_JSON_BYTES}")
    if "\0" in text:
        raise SpecError(f"spec holds a NUL byte at offset {text.index(chr(0))}")
    depth = deepest = 0
    for c in _NOT_BRACKET.sub("", _STRING.sub("", text)):   # brackets outside strings
        depth += 1 if c in "[{" else -1
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_DEPTH:
            raise SpecError(f"spec nests deeper than {MAX_JSON_DEPTH} levels")


def _reject_constant(name):
    raise ValueError(f"non-standard JSON constant {name}")


# to_json's encoder: json.dumps(sort_keys=True, separators=(",", ":"), allow_nan=False)
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False,
                              check_circular=False)


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, tuple):
        return list(v)
    return v
