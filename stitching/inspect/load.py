"""Reading a graph dump back (``load_dump``): dump.json as objects, files on demand.

A dump is data from outside (another process, another machine): its JSON is checked
for the schema name and version and the fields this module reads, file references
must stay inside the dump directory, and a spec is parsed by ``KernelSpec.from_json``
(the strict parser the op uses).  Nothing here is evaluated.  With ``jsonschema``
installed (``pip install stitching[inspect]``) ``validate_dump`` checks the whole
document against ``schema/dump-v1.schema.json``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from ..tf import dump as _dump
from ..tf import opnames

SCHEMA_FILE = os.path.join(os.path.dirname(__file__), "schema", "dump-v1.schema.json")


class DumpError(ValueError):
    """A path that is not a readable stitching dump (or a dump of another version)."""


@dataclass
class KernelDump:
    """One StitchedKernel of a dumped function."""
    name: str                 # node name in graph_after
    label: str                # the node's label attr (profile counters are keyed by it)
    spec_hash: str
    code_name: str | None
    ops: list                 # [(IR node, op)]
    inputs: list              # [{"ref", "dtype", "shape"}]
    outputs: list
    kind: str                 # "row" | "column" | "elementwise" | "packed" (schedule stage)
    schedule_summary: str
    estimate: dict            # cost model: fused_us, unfused_us, bytes_fused, ...
    measured: dict | None = None   # profile.json: calls, seconds, bytes (None: not run)
    files: dict = field(default_factory=dict, repr=False)
    _dir: str = field(default="", repr=False)

    @property
    def nodes(self) -> list:
        """The original graph's node names this kernel computes."""
        return [n for n, _ in self.ops]

    @property
    def source(self) -> str:
        """The generated Numba source."""
        return self._read("source")

    @property
    def schedule(self) -> str:
        """The schedule stage's description (passes, where each value lives)."""
        return self._read("schedule")

    def spec(self):
        """The KernelSpec, parsed and validated as the op would."""
        from ..ir import KernelSpec
        return KernelSpec.from_json(self._read("spec"))

    @property
    def estimated_us(self) -> float | None:
        """The cost model's predicted time per call, µs (None when not estimated)."""
        return self.estimate.get("fused_us")

    @property
    def measured_us(self) -> float | None:
        """Mean measured time per call, µs (None when not profiled).  One stalled call
        (another process on the machine) moves it: ``fastest_us`` is steadier."""
        m = self.measured
        if not m or not m.get("calls"):
            return None
        return m["seconds"] / m["calls"] * 1e6

    @property
    def fastest_us(self) -> float | None:
        """The fastest measured call, µs (None when not profiled, or a profile
        without it): what the kernel costs when nothing else gets in its way."""
        m = self.measured
        if not m or not m.get("calls") or not m.get("min_seconds"):
            return None
        return m["min_seconds"] * 1e6

    def _read(self, key) -> str:
        rel = self.files.get(key)
        if rel is None:
            return ""
        with open(_inside(self._dir, rel), encoding="utf-8") as f:
            return f.read()


@dataclass
class Dump:
    """One traced function's dump (``load_dump``)."""
    path: str
    function: str
    id: str
    created: str
    version: int
    options: dict
    device_profile: dict
    summary: dict
    ir_nodes: list            # [{"name", "op", "inputs", "outputs", "origin", ...}]
    ir_outputs: list
    kernels: list             # [KernelDump]
    unfused: list             # [{"node", "op", "reason"}]
    plan: dict                # planner_decisions, refused_merges, skipped, failed
    notes: list
    files: dict = field(default_factory=dict, repr=False)
    raw: dict = field(default_factory=dict, repr=False)

    def kernel(self, name: str) -> KernelDump:
        """The kernel named ``name`` (its node name or label); KeyError if none."""
        for k in self.kernels:
            if k.name == name or k.label == name:
                return k
        raise KeyError(f"{self.id}: no kernel named {name!r}; "
                       f"kernels: {[k.name for k in self.kernels]}")

    @property
    def ir_text(self) -> str:
        """The stitching IR of the function, as text."""
        with open(_inside(self.path, self.files["ir"]), encoding="utf-8") as f:
            return f.read()

    def graph_before(self):
        """The GraphDef handed to stitching (needs TensorFlow)."""
        return self._graph("graph_before")

    def graph_after(self):
        """The rewritten GraphDef (needs TensorFlow)."""
        return self._graph("graph_after")

    def _graph(self, key):
        return _dump.read_graph(_inside(self.path, self.files[key]["pb"]))

    def unfused_by_reason(self) -> dict:
        """reason -> [(node, op)], largest group first."""
        groups: dict = {}
        for u in self.unfused:
            groups.setdefault(u["reason"], []).append((u["node"], u["op"]))
        return dict(sorted(groups.items(), key=lambda kv: -len(kv[1])))

    def kernel_of(self) -> dict:
        """IR node -> the kernel it was fused into."""
        return {n: k.name for k in self.kernels for n in k.nodes}

    def kernel_rows(self) -> list:
        """One dict per kernel: the per-kernel table of the inspection notebook.
        ``ops`` counts its memory-intensive ops, as the report does; ``other_ops``
        names the rest (Identity, Reshape and other views, contractions)."""
        rows = []
        for k in self.kernels:
            e = k.estimate
            mem = [op for _, op in k.ops if opnames.is_memory_intensive(op)]
            rows.append({"kernel": k.name, "kind": k.kind, "ops": len(mem),
                         "op_types": ", ".join(mem),
                         "other_ops": ", ".join(op for _, op in k.ops
                                                if not opnames.is_memory_intensive(op)),
                         "inputs": len(k.inputs), "outputs": len(k.outputs),
                         "bytes_fused": e.get("bytes_fused"),
                         "bytes_unfused": e.get("bytes_unfused"),
                         "estimated_us": e.get("fused_us"),
                         "unfused_estimated_us": e.get("unfused_us"),
                         "measured_us": k.measured_us, "fastest_us": k.fastest_us,
                         "calls": (k.measured or {}).get("calls")})
        return rows


def list_dumps(root: str) -> list:
    """Dump directories under ``root`` (a dump root or one dump), oldest first."""
    root = os.fspath(root)
    if os.path.isfile(os.path.join(root, "dump.json")):
        return [root]
    if not os.path.isdir(root):
        raise DumpError(f"{root}: no such directory")
    found = [os.path.join(root, d) for d in sorted(os.listdir(root))
             if os.path.isfile(os.path.join(root, d, "dump.json"))]
    return found


def load_dump(path) -> Dump:
    """Read a graph dump (``Options(dump_dir=...)``) back as a ``Dump`` object.

    Args:
        path: A function's dump directory, or a dump root holding exactly one.

    Returns:
        A ``stitching.inspect.Dump``: graphs, kernels, plan, report, profile.

    Raises:
        DumpError: no dump there, several (``stitching.inspect.list_dumps`` lists
            them), or a file that does not match the dump schema.
    """
    path = os.fspath(path)
    dumps = list_dumps(path)
    if not dumps:
        raise DumpError(f"{path}: no stitching dump here (no dump.json in it or its "
                        f"subdirectories)")
    if len(dumps) > 1:
        names = ", ".join(os.path.basename(d) for d in dumps[:8])
        raise DumpError(f"{path} holds {len(dumps)} dumps ({names}{', ...' if len(dumps) > 8 else ''}); "
                        f"pass one of them (stitching.inspect.list_dumps lists them)")
    path = dumps[0]
    doc = _read_json(os.path.join(path, "dump.json"))
    _check(doc, path)
    measured = _read_profile(path)
    kernels = [KernelDump(
        name=k["name"], label=k["label"], spec_hash=k["spec_hash"],
        code_name=k.get("code_name"), ops=[(o["node"], o["op"]) for o in k["ops"]],
        inputs=k["inputs"], outputs=k["outputs"], kind=k.get("kind", ""),
        schedule_summary=k.get("schedule_summary", ""), estimate=k["estimate"],
        measured=measured.get(k["name"]), files=k["files"], _dir=path)
        for k in doc["kernels"]]
    return Dump(path=path, function=doc["function"], id=doc["id"], created=doc["created"],
                version=doc["version"], options=doc["options"],
                device_profile=doc["device_profile"], summary=doc["summary"],
                ir_nodes=doc["ir"]["nodes"], ir_outputs=doc["ir"]["outputs"],
                kernels=kernels, unfused=doc["unfused"], plan=doc["plan"],
                notes=doc.get("notes", []), files=doc["files"], raw=doc)


def validate_dump(path) -> None:
    """Check a dump's dump.json (and profile.json) against the JSON schema; raises
    ``jsonschema.ValidationError``.  Needs the ``jsonschema`` package."""
    import jsonschema
    path = list_dumps(os.fspath(path))
    for p in path:
        with open(SCHEMA_FILE, encoding="utf-8") as f:
            schema = json.load(f)
        jsonschema.validate(_read_json(os.path.join(p, "dump.json")), schema)
        prof = os.path.join(p, "profile.json")
        if os.path.exists(prof):
            jsonschema.validate(_read_json(prof), schema["$defs"]["profile_file"])


_REQUIRED = ("function", "id", "created", "options", "device_profile", "files", "summary",
             "ir", "kernels", "unfused", "plan")


def _check(doc, path):
    if not isinstance(doc, dict) or doc.get("schema") != _dump.SCHEMA:
        raise DumpError(f"{path}/dump.json is not a stitching dump")
    if doc.get("version") != _dump.VERSION:
        raise DumpError(f"{path}/dump.json is dump version {doc.get('version')!r}; this "
                        f"stitching reads version {_dump.VERSION}")
    missing = [k for k in _REQUIRED if k not in doc]
    if missing:
        raise DumpError(f"{path}/dump.json lacks {', '.join(missing)}")


def _read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise DumpError(f"{path}: cannot read: {e}") from None


def _read_profile(path) -> dict:
    p = os.path.join(path, "profile.json")
    if not os.path.exists(p):
        return {}
    doc = _read_json(p)
    if doc.get("schema") != _dump.PROFILE_SCHEMA:
        raise DumpError(f"{p} is not a stitching profile")
    return doc.get("kernels", {})


def _inside(root, rel) -> str:
    """``root/rel``, refusing references that leave the dump directory."""
    full = os.path.realpath(os.path.join(root, rel))
    if os.path.isabs(rel) or not full.startswith(os.path.realpath(root) + os.sep):
        raise DumpError(f"{root}: file reference {rel!r} leaves the dump directory")
    return full
