"""Device profiles: the numbers the cost model reads, and nothing else.

    DeviceProfile ── bandwidth, lanes, on-chip scratch, registers, launch overhead
      │
      ├── pinned "v100" / "a100" / "h100"   published specs (CUDA backend, deterministic tests)
      ├── pinned "cpu-reference"            this project's 2-core VM, written down once
      │                                     (deterministic cost-model tests)
      ├── machine models "intel-avx512",    the three CPU classes this project runs on, with
      │   "amd-avx2", "amd-avx512"          ISA, caches and TF's oneDNN fact: what tests pin
      │   (MACHINES)
      └── measured "cpu"                    the running machine: 7 trials per number (about a
                                            second), cached as JSON under $STITCHING_CACHE_DIR
                                            or ~/.cache/stitching (device-profile-cpu.json);
                                            provisional while measured on a busy machine
                                            (measured_cpu, settled)

Calibration.  The cost model prices an op left to TF as its memory traffic at the
profile's bandwidth.  TF's kernels do not all reach it (its column reductions measured
at about a quarter of it here), so a profile carries ``tf_time_scale``: per op class
(TF_CLASSES), measured TF time over the model's estimate: one factor, or a table of
factors by size ([[MiB, factor], ...], interpolated in log(size), flat beyond its ends),
since TF's error is not the same at every size (its softmax measured near the model at
1 MiB and at a third of it at 64 MiB).  ``kernel_time_scale`` does the same for the
model's estimate of a generated kernel (measured on kernels of one op of each class; a
kernel of several classes takes its members' factors weighted by their share of the
work, ``GraphCosts.kernel_factor``), so that both sides of a decision are calibrated
alike.  Those factors are fitted on kernels where memory dominates and scale a kernel's
memory-bound part only; its compute is priced per op (``kernel_op_cost``, ``tf_op_cost``:
each transcendental's cost per element relative to Exp, ours and TF's) and takes a
factor of its own (``kernel_compute_scale``), measured by ``tools/calibrate.py --ops``.
``tools/calibrate.py``
measures them on the running machine and writes a profile file; ``--ship`` writes the
package's default for the running CPU's class (``calibration-cpu-<class>.json`` beside
this file: ``intel-avx512``, ``amd-avx512``, ``amd-avx2``), which then applies to the
measured CPU profile of every machine of that class.  ``STITCHING_DEVICE_PROFILE=<file>``
plans with a profile file instead (one ``tools/calibrate.py`` wrote); the report names the
profile it planned with (``DeviceProfile.source``).  Which factors the measured CPU
profile gets, first found wins:

    $STITCHING_DEVICE_PROFILE=<file>        that file's profile, factors and all
    <cache root>/calibration-cpu.json       this machine's (calibrate.py --install), read
                                            only where its CPU fingerprint matches; a
                                            bad one is ignored with a warning
    stitching/plan/calibration-cpu-<class>.json
                                            the shipped default of the CPU's class
                                            (calibrate.py --ship)
    none                                    factors 1

A *lane* is the unit of parallelism that pulls memory bandwidth: a core on the CPU, a
resident thread on a GPU.  ``bw_at(active_lanes)`` is the bandwidth that many active lanes
reach: linear in lanes until the device saturates.  ``STITCHING_DEVICE_PROFILE=<name>``
pins the profile the pipeline plans with (e.g. ``v100`` to plan for the CUDA backend;
``STITCHING_PROFILE=<name>`` is its deprecated spelling, with a warning).

No TensorFlow here; NumPy only inside ``measure_cpu``.
"""
from __future__ import annotations

import functools
import json
import math
import os
import statistics
import threading
import time
import warnings
from dataclasses import MISSING as dataclasses_MISSING
from dataclasses import asdict, dataclass, field, fields, replace

from .. import cachedir

PROFILE_VERSION = 1     # profile files (tools/calibrate.py, shipped calibrations)
CACHE_VERSION = 2       # the measured profile's cache: 2 has trials, spread, provisional
CACHE_FILE = "device-profile-cpu.json"
# Op classes whose TF kernels the calibration times (cost.tf_class says which is which).
TF_CLASSES = ("elementwise", "transcendental", "row_reduction", "column_reduction",
              "softmax")
# The shipped calibration of each CPU class (tools/calibrate.py --ship), beside this file.
CALIBRATION_FILES = {c: os.path.join(os.path.dirname(__file__), f"calibration-cpu-{c}.json")
                     for c in ("intel-avx512", "amd-avx2", "amd-avx512")}
SCALE_RANGE = (0.05, 50.0)    # arbitrary sanity bounds on a measured factor
# The transcendental ops (ir/ops.py) whose per-element cost relative to Exp a profile
# may carry (DeviceProfile.kernel_op_cost, tf_op_cost); tools/calibrate.py --ops times
# them.  Not Pow: its cost depends on its exponent (a small integer constant is a few
# multiplies, codegen/lower/exprs.py _pow_const; else a pow call): one Exp, as before.
OP_COST_OPS = ("Exp", "Expm1", "Log", "Log1p", "Tanh", "Sigmoid", "Elu", "Selu",
               "Softplus", "Erf", "Erfc", "Sin", "Cos")
OP_COST_RANGE = (0.05, 500.0)   # arbitrary sanity bounds on a per-op cost (a scalar libm
#                                 call measured ~33-75 Exps; the dearest op now ~18)


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    backend: str                 # "cpu" | "cuda"
    bandwidth: float             # bytes/s, DRAM/HBM, whole device
    lanes: int                   # lanes needed to saturate ``bandwidth``
    bw_per_lane: float           # bytes/s one lane reaches alone
    units: int                   # cores (CPU) or SMs (GPU)
    cache_bandwidth: float       # bytes/s, on-chip scratch (L2 per-row buffers / shared memory)
    scratch_per_task: int        # bytes one task (CPU) / block (GPU) may keep on chip
    scratch_per_unit: int        # bytes per core / per SM
    registers_per_unit: int      # GPU: 32-bit registers per SM; CPU: vector registers per core
    max_threads_per_task: int    # GPU: threads per block; CPU: 1
    max_threads_per_unit: int    # GPU: resident threads per SM; CPU: 1
    vector_bytes: int            # GPU: warp (32 lanes x 4 B); CPU: SIMD register width
    launch_s: float              # one kernel / one TF op dispatch
    task_s: float                # one task (a CPU share of work, op.cc) or block
    transcendental_per_s: float  # exp/tanh/erf evaluations per second, whole device
    caches: dict = field(default_factory=dict)   # level -> bytes (informational)
    measured: bool = False
    tf_time_scale: dict = field(default_factory=dict)   # TF_CLASSES -> factor, or a table
    #                                                    [[MiB, factor], ...] (tf_factor)
    kernel_time_scale: dict = field(default_factory=dict)   # the same for the model's
    #                                   estimate of a generated kernel of one op of a class
    source: str = ""             # where the numbers came from (the report shows it)
    # CPU machine facts the decisions read (tf/passes/seqsplit.py, tf/passes/remapper.py, the
    # streaming-store line): never the live machine's in a test, which pins a model.
    isa: str = ""                # widest vector ISA: avx512f | avx2 | avx | sse2 | neon
    tf_onednn: bool | None = None   # TF runs oneDNN's kernels and remapper; None: ask the
    #                                 running TF (tf/passes/remapper.py: onednn_enabled)
    cpu_class: str = ""          # vendor-isa ("intel-avx512", "amd-avx2"): shipped numbers
    measured_at: str = ""        # UTC date and time of the measurement
    provisional: bool = False    # measured on a busy machine or with a wide spread:
    #                              measured again by a later process (measured_cpu)
    why_provisional: str = ""    # what made it provisional, in words
    spread: dict = field(default_factory=dict)   # measured number -> (max - min) / median
    #                                              of its trials
    # Compute, per op (calibration: tools/calibrate.py --ops): each transcendental op's
    # cost per element relative to Exp's, in the kernels this project generates
    # (``kernel_op_cost``) and in TF's (``tf_op_cost``; OP_COST_OPS, absent: 1), and
    # what a generated kernel's compute takes over the model's price of it at
    # ``transcendental_per_s`` (``kernel_compute_scale``, fitted on a compute-bound
    # kernel of Exps; 0: not calibrated, 1).  kernel_time_scale is fitted where memory
    # dominates and scales only a kernel's memory-bound part (cost.kernel_compute_s).
    kernel_op_cost: dict = field(default_factory=dict)
    tf_op_cost: dict = field(default_factory=dict)
    kernel_compute_scale: float = 0.0
    stream_min_bytes: int = 16 << 20   # CPU: outputs this large are written with
    #   non-temporal stores (codegen/cpu/emitter.py _stream_min_bytes has the measurement);
    #   measured on intel-avx512 only: the other classes take that figure until measured

    def bw_at(self, active_lanes: float) -> float:
        """Bandwidth with ``active_lanes`` lanes busy (at least one)."""
        return min(self.bandwidth, max(1.0, active_lanes) * self.bw_per_lane)

    def to_dict(self) -> dict:
        return asdict(self)

    # Fields that describe a profile rather than price anything: two profiles equal but
    # for these plan alike (stored plans are keyed without them: plan/cache.py).
    DESCRIPTIVE = ("name", "source", "measured_at", "provisional", "why_provisional",
                   "spread", "measured")

    def planning_key(self) -> str:
        """What the planner's decisions depend on, as text.  Read per trace (a
        stitching.function's key of its stitched graphs), so read off the fields:
        ``to_dict``'s deep copy made it 0.75 ms."""
        d = {f.name: getattr(self, f.name) for f in fields(self)
             if f.name not in self.DESCRIPTIVE}
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceProfile":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# ---- pinned GPU profiles --------------------------------------------------------------
# Datasheet / CUDA programming guide numbers: bandwidth, SM count, shared memory per SM
# and per block (opt-in maximum), 64 K registers per SM, 2048 resident threads per SM,
# 1024 threads per block, SFU throughput 16 per SM per clock at boost clock.
# Not datasheet numbers, labelled:
_GPU_SATURATING_THREADS_PER_SM = 1024  # arbitrary: half occupancy hides DRAM latency
                                       # (rule of thumb for Volta and later)
_GPU_LAUNCH_S = 5e-6                   # approximate: commonly measured launch + dispatch
_GPU_BLOCK_S = 0.0                     # block scheduling is free at this granularity


def _gpu(name, bw_gbs, sms, smem_sm_kb, smem_block_kb, clock_ghz, l2_mb):
    lanes = sms * _GPU_SATURATING_THREADS_PER_SM
    return DeviceProfile(
        name=name, backend="cuda", bandwidth=bw_gbs * 1e9, lanes=lanes,
        bw_per_lane=bw_gbs * 1e9 / lanes, units=sms,
        cache_bandwidth=sms * 128 * clock_ghz * 1e9,   # 32 banks x 4 B per clock per SM
        scratch_per_task=smem_block_kb * 1024, scratch_per_unit=smem_sm_kb * 1024,
        registers_per_unit=65536, max_threads_per_task=1024, max_threads_per_unit=2048,
        vector_bytes=128, launch_s=_GPU_LAUNCH_S, task_s=_GPU_BLOCK_S,
        transcendental_per_s=sms * 16 * clock_ghz * 1e9,
        caches={"l2": l2_mb << 20})


PINNED = {
    # V100 SXM2: 900 GB/s HBM2, 80 SMs, 96 KB shared/SM (96 KB per block opt-in), 6 MB L2
    "v100": _gpu("v100", 900, 80, 96, 96, 1.53, 6),
    # A100 SXM4 40 GB: 1555 GB/s, 108 SMs, 164 KB shared/SM, 163 KB per block, 40 MB L2
    "a100": _gpu("a100", 1555, 108, 164, 163, 1.41, 40),
    # H100 SXM5: 3350 GB/s HBM3, 132 SMs, 228 KB shared/SM, 227 KB per block, 50 MB L2
    "h100": _gpu("h100", 3350, 132, 228, 227, 1.83, 50),
    # This project's 2-core AMD EPYC VM as measured once (2026-11); deterministic CPU tests.
    "cpu-reference": DeviceProfile(
        name="cpu-reference", backend="cpu", bandwidth=20e9, lanes=2, bw_per_lane=12e9,
        units=2, cache_bandwidth=150e9, scratch_per_task=512 << 10,
        scratch_per_unit=512 << 10, registers_per_unit=16, max_threads_per_task=1,
        max_threads_per_unit=1, vector_bytes=32, launch_s=5e-6, task_s=1e-6,
        transcendental_per_s=1.2e9,
        caches={"l1": 32 << 10, "l2": 512 << 10, "l3": 32 << 20}),
}

# ---- named CPU machine models -----------------------------------------------------------
# The three classes of machine this project has run on, as quiet measurements of them
# (tools/calibrate.py; the date is each model's ``measured_at``).  Tests that assert a
# planning decision pin one of these (tests/conftest.py: the ``machine`` fixture), so a
# plan never depends on the machine a test runs on; a measured profile whose CPU is of
# one of these classes plans with the model's numbers while its own measurement is
# provisional (measured_cpu).  ``get(name)`` adds the class's shipped calibration.
MACHINES = {
    # Intel Xeon (Emerald Rapids), 2 cores of a VM: AVX-512, 48 KiB L1d, 2 MiB L2,
    # TF's oneDNN on (IsMklEnabled: the CPU has AVX512_VNNI / AMX).  2026-11-25.
    "intel-avx512": DeviceProfile(
        name="intel-avx512", backend="cpu", bandwidth=18.6e9, lanes=2, bw_per_lane=18.6e9,
        units=2, cache_bandwidth=186e9, scratch_per_task=2 << 20, scratch_per_unit=2 << 20,
        registers_per_unit=32, max_threads_per_task=1, max_threads_per_unit=1,
        vector_bytes=64, launch_s=5e-6, task_s=1e-6, transcendental_per_s=3.24e9,
        caches={"l1": 48 << 10, "l2": 2 << 20, "l3": 480 << 20}, measured=True,
        isa="avx512f", tf_onednn=True, cpu_class="intel-avx512",
        measured_at="2026-11-25", source="intel-avx512 (named machine model)"),
    # AMD EPYC (Milan), 2 cores of a VM: AVX2, 32 KiB L1d, 512 KiB L2, TF's oneDNN off
    # (IsMklEnabled False: TF runs Eigen's kernels and remapper).  2026-11-28, quiet.
    "amd-avx2": DeviceProfile(
        name="amd-avx2", backend="cpu", bandwidth=8.9e9, lanes=2, bw_per_lane=7.0e9,
        units=2, cache_bandwidth=90e9, scratch_per_task=512 << 10,
        scratch_per_unit=512 << 10, registers_per_unit=16, max_threads_per_task=1,
        max_threads_per_unit=1, vector_bytes=32, launch_s=5e-6, task_s=1e-6,
        transcendental_per_s=0.87e9,
        caches={"l1": 32 << 10, "l2": 512 << 10, "l3": 32 << 20}, measured=True,
        isa="avx2", tf_onednn=False, cpu_class="amd-avx2",
        measured_at="2026-11-28", source="amd-avx2 (named machine model)"),
    # AMD EPYC (Zen 4, family 25 model 17), 2 cores of a VM: AVX-512 (its 512-bit ops
    # run as two 256-bit halves), 32 KiB L1d, 1 MiB L2, 32 MiB L3, TF's oneDNN on
    # (IsMklEnabled: the CPU has AVX512_VNNI / BF16).  2026-11-29, quiet: six
    # `python -m stitching.profile --remeasure` runs, each number their median.
    "amd-avx512": DeviceProfile(
        name="amd-avx512", backend="cpu", bandwidth=30e9, lanes=2, bw_per_lane=26.7e9,
        units=2, cache_bandwidth=185e9, scratch_per_task=1 << 20, scratch_per_unit=1 << 20,
        registers_per_unit=32, max_threads_per_task=1, max_threads_per_unit=1,
        vector_bytes=64, launch_s=5e-6, task_s=1e-6, transcendental_per_s=3.4e9,
        caches={"l1": 32 << 10, "l2": 1 << 20, "l3": 32 << 20}, measured=True,
        isa="avx512f", tf_onednn=True, cpu_class="amd-avx512",
        measured_at="2026-11-29", source="amd-avx512 (named machine model)"),
}

# CPU constants the measurement cannot see from NumPy (labelled):
_CPU_LAUNCH_S = 5e-6   # arbitrary: a few µs per TF op dispatch in graph mode
_CPU_TASK_S = 1e-6     # arbitrary: one share of work (wake-up + bookkeeping)
_CACHE_OVER_DRAM = 4   # arbitrary floor: on-chip bandwidth is at least 4x DRAM's on any
                       # recent CPU (a measurement under load may say otherwise)


def get(name: str) -> DeviceProfile:
    """A pinned profile by name (a GPU, ``cpu-reference``, or a CPU machine model with its
    class's shipped calibration), or ``"cpu"`` for the measured running machine."""
    key = name.lower()
    if key == "cpu":
        return measured_cpu()
    if key in MACHINES:
        return calibrated(MACHINES[key])
    if key not in PINNED:
        raise ValueError(f"unknown device profile {name!r}; choose one of "
                         f"{names()}")
    return PINNED[key]


def names() -> list:
    """Every name ``get`` takes."""
    return sorted(PINNED) + sorted(MACHINES) + ["cpu"]


def default() -> DeviceProfile:
    """What the pipeline plans with: $STITCHING_DEVICE_PROFILE (a pinned name, "cpu", or a
    profile file tools/calibrate.py wrote), else the measured CPU with the shipped
    calibration.  ``STITCHING_PROFILE`` is the op's per-kernel timing switch
    (runtime.set_profiling); a device name in it is the deprecated spelling of
    ``STITCHING_DEVICE_PROFILE``, still honoured, with a warning."""
    spec = os.environ.get("STITCHING_DEVICE_PROFILE") or _deprecated_device_name()
    if spec:
        key = spec.lower()
        if key in PINNED or key in MACHINES:
            return get(key)
        if key == "cpu":
            return calibrated(settled(get("cpu")))
        if not os.path.exists(spec):
            names = ", ".join(sorted(set(PINNED) | set(MACHINES) | {"cpu"}))
            raise ProfileFileError(f"STITCHING_DEVICE_PROFILE={spec}: neither a named "
                                   f"profile ({names}) nor a profile file")
        return load_file(spec)
    return calibrated(settled(get("cpu")))


_PROFILING_OFF = ("", "0", "false", "off", "no")
_warned_device_name = False


def _deprecated_device_name() -> str | None:
    """A device named in $STITCHING_PROFILE (before STITCHING_DEVICE_PROFILE existed, one
    variable meant both): returned with a once-per-process FutureWarning."""
    global _warned_device_name
    value = os.environ.get("STITCHING_PROFILE", "")
    if value.lower() in _PROFILING_ON or value.lower() in _PROFILING_OFF:
        return None
    if not _warned_device_name:
        import warnings
        _warned_device_name = True
        warnings.warn(f"STITCHING_PROFILE={value} names a device profile; that spelling is "
                      f"deprecated: set STITCHING_DEVICE_PROFILE={value} instead "
                      f"(STITCHING_PROFILE=1 turns on per-kernel timing)",
                      FutureWarning, stacklevel=3)
    return value


_PROFILING_ON = ("1", "true", "on", "yes")   # op.cc's ProfileFromEnv


# ---- calibration ---------------------------------------------------------------------------

class ProfileFileError(ValueError):
    """A device profile file that cannot be used (names the file and the problem)."""


CALIBRATED_FIELDS = ("tf_time_scale", "kernel_time_scale", "kernel_op_cost", "tf_op_cost",
                     "kernel_compute_scale")


def _factors(profile: DeviceProfile) -> dict:
    return {f: getattr(profile, f) for f in CALIBRATED_FIELDS if getattr(profile, f)}


def calibrated(profile: DeviceProfile) -> DeviceProfile:
    """``profile`` with this machine's factors (calibrate.py --install), else the
    shipped ones, where it has none of its own."""
    if _factors(profile) or profile.backend != "cpu":
        return profile
    # A named machine model takes its class's shipped factors only: it describes a kind
    # of machine, not this one (a test's plan must not depend on this machine's file).
    local = None if profile.name in MACHINES else _local_scale()
    if local is not None:
        return replace(profile, **local[0], source=(profile.source or profile.name)
                       + f" + this machine's calibration ({local[1]})")
    cls = shipped_class(profile)
    scale = _shipped_scale(cls) if cls else {}
    if not scale:
        return profile
    return replace(profile, **scale, source=(profile.source or profile.name)
                   + f" + shipped {cls} calibration")


def shipped_class(profile: DeviceProfile) -> str | None:
    """The CPU class whose shipped calibration ``profile`` takes: its own, else the
    class of the same vector width (a CPU of neither vendor), else none."""
    if profile.cpu_class in CALIBRATION_FILES:
        return profile.cpu_class
    if profile.isa == "avx512f":
        return "intel-avx512"
    return "amd-avx2" if profile.isa in ("avx2", "avx") else None


LOCAL_CALIBRATION = "calibration-cpu.json"
_LOCAL: dict = {}          # path -> (mtime, (factors, path) or None)


def local_calibration_path() -> str:
    """Where ``tools/calibrate.py --install`` puts this machine's factors."""
    return str(cachedir.root() / LOCAL_CALIBRATION)


def _local_scale():
    """(factors, path) of this machine's calibration file, or None: no file, a file
    measured on another CPU (its fingerprint differs), or a bad file (warned once)."""
    path = local_calibration_path()
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError:
        return None
    hit = _LOCAL.get(path)
    if hit is not None and hit[0] == mtime:
        return hit[1]
    found = None
    try:
        mine = json.loads(cachedir.read_file(path, MAX_PROFILE_BYTES)).get(
            "fingerprint") == _fingerprint()
        if mine:
            found = (_factors(load_file(path)), path)
    except (OSError, ValueError, AttributeError) as e:
        import warnings
        warnings.warn(f"stitching: ignoring this machine's calibration: {e}", RuntimeWarning,
                      stacklevel=3)
    _LOCAL[path] = (mtime, found)
    return found


_SHIPPED: dict = {}       # class -> factors (empty: that class ships none)


def _shipped_scale(cls: str) -> dict:
    if cls not in _SHIPPED:
        try:
            _SHIPPED[cls] = _factors(load_file(CALIBRATION_FILES[cls]))
        except (OSError, ProfileFileError, KeyError):
            _SHIPPED[cls] = {}
    return _SHIPPED[cls]


def load_file(path: str) -> DeviceProfile:
    """A profile file written by ``save_file`` (tools/calibrate.py), checked field by
    field: numbers positive and finite, known fields only, factors for known classes."""
    try:
        doc = json.loads(cachedir.read_file(path, MAX_PROFILE_BYTES))
    except OSError as e:
        raise ProfileFileError(f"device profile {path}: cannot read it "
                               f"({e.strerror or e})") from None
    except ValueError as e:
        raise ProfileFileError(f"device profile {path}: not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("version") != PROFILE_VERSION:
        raise ProfileFileError(f"device profile {path}: expected version {PROFILE_VERSION}")
    prof = _checked(doc.get("profile"), path)
    return replace(prof, source=f"{prof.name} from {path}")


def _checked(d, path) -> DeviceProfile:
    """The profile the fields ``d`` (a profile file's or the measured profile's cache)
    describe, checked field by field (``load_file``); ProfileFileError names what is
    wrong."""
    known = {f.name for f in fields(DeviceProfile)}
    if not isinstance(d, dict) or set(d) - known:
        raise ProfileFileError(f"device profile {path}: unknown fields "
                               f"{sorted(set(d or {}) - known) if isinstance(d, dict) else d}")
    missing = {f.name for f in fields(DeviceProfile) if f.default is dataclasses_MISSING
               and f.default_factory is dataclasses_MISSING} - set(d)
    if missing:
        raise ProfileFileError(f"device profile {path}: missing fields {sorted(missing)}")
    for k, v in d.items():
        if k in ("name", "backend", "source", "isa", "cpu_class", "measured_at",
                 "why_provisional"):
            if not isinstance(v, str):
                raise ProfileFileError(f"device profile {path}: {k} must be a string")
        elif k in ("measured", "provisional"):
            if not isinstance(v, bool):
                raise ProfileFileError(f"device profile {path}: {k} must be true or false")
        elif k == "tf_onednn":
            if v is not None and not isinstance(v, bool):
                raise ProfileFileError(f"device profile {path}: tf_onednn must be true, "
                                       f"false or null (ask the running TF)")
        elif k == "spread":
            if not (isinstance(v, dict) and all(_number(x) and x >= 0 for x in v.values())):
                raise ProfileFileError(f"device profile {path}: spread must map numbers "
                                       f"to non-negative fractions")
        elif k == "caches":
            if not isinstance(v, dict):
                raise ProfileFileError(f"device profile {path}: caches must be an object")
        elif k in CALIBRATED_FIELDS:
            _check_scale(path, v, k)
        elif not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                      and math.isfinite(v) and v > 0):
            raise ProfileFileError(f"device profile {path}: {k} must be a positive number, "
                                   f"got {v!r}")
    if d["backend"] not in ("cpu", "cuda"):
        raise ProfileFileError(f"device profile {path}: backend must be cpu or cuda")
    return DeviceProfile.from_dict(d)


def _check_scale(path, scale, what: str = "tf_time_scale") -> None:
    if what == "kernel_compute_scale":
        if not (_number(scale) and (scale == 0 or
                                    SCALE_RANGE[0] <= scale <= SCALE_RANGE[1])):
            raise ProfileFileError(f"device profile {path}: {what} must be 0 (not "
                                   f"calibrated) or a factor in {list(SCALE_RANGE)}, "
                                   f"got {scale!r}")
        return
    if what in ("kernel_op_cost", "tf_op_cost"):
        if not (isinstance(scale, dict) and all(
                k in OP_COST_OPS and _number(v) and OP_COST_RANGE[0] <= v <= OP_COST_RANGE[1]
                for k, v in scale.items())):
            raise ProfileFileError(f"device profile {path}: {what} must map ops of "
                                   f"{', '.join(OP_COST_OPS)} to costs relative to Exp in "
                                   f"{list(OP_COST_RANGE)}, got {scale!r}")
        return
    if not isinstance(scale, dict):
        raise ProfileFileError(f"device profile {path}: {what} must be an object")
    for k, v in scale.items():
        if k not in TF_CLASSES:
            raise ProfileFileError(f"device profile {path}: {what} has unknown class "
                                   f"{k!r}; classes are {', '.join(TF_CLASSES)}")
        points = v if isinstance(v, list) else [[1, v]]
        if not points or len(points) > _MAX_POINTS:
            raise ProfileFileError(f"device profile {path}: {what}[{k!r}] must hold "
                                   f"1 to {_MAX_POINTS} [MiB, factor] points, got {v!r}")
        last = 0.0
        for pt in points:
            if not (isinstance(pt, (list, tuple)) and len(pt) == 2
                    and all(_number(x) for x in pt) and pt[0] > last
                    and SCALE_RANGE[0] <= pt[1] <= SCALE_RANGE[1]):
                raise ProfileFileError(
                    f"device profile {path}: {what}[{k!r}] = {v!r}: expected a factor "
                    f"in [{SCALE_RANGE[0]}, {SCALE_RANGE[1]}] or a list of [MiB, factor] "
                    f"points with MiB increasing and positive, factors in that range")
            last = pt[0]


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


_MAX_POINTS = 32       # arbitrary: a table, not a dump
MAX_PROFILE_BYTES = 1 << 20   # arbitrary: a profile file is a few KB (read as a file)


def tf_factor(scale: dict, cls: str, nbytes: int) -> float:
    """The factor of op class ``cls`` on a tensor of ``nbytes``: a class's flat factor,
    or its [MiB, factor] table interpolated in log(size), held flat beyond its ends
    (what TF's kernels do at sizes nobody measured is assumed to be what they do at the
    nearest measured one)."""
    v = scale.get(cls)
    if v is None:
        return 1.0
    if not isinstance(v, list):
        return float(v)
    mib = max(nbytes, 1) / (1 << 20)
    if mib <= v[0][0]:
        return float(v[0][1])
    for (m0, f0), (m1, f1) in zip(v, v[1:]):
        if mib <= m1:
            w = math.log(mib / m0) / math.log(m1 / m0)
            return float(f0 + w * (f1 - f0))
    return float(v[-1][1])


def save_file(profile: DeviceProfile, path: str, note: str = "",
              this_machine: bool = False) -> None:
    """Write ``profile`` as a profile file (atomically); ``this_machine``: bound to this
    CPU's fingerprint (this machine's calibration, read only here)."""
    for f in CALIBRATED_FIELDS:
        _check_scale(path, getattr(profile, f), f)
    doc = {"version": PROFILE_VERSION, "note": note, "profile": profile.to_dict()}
    if this_machine:
        doc["fingerprint"] = _fingerprint()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    cachedir.write_atomic(path, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())


# ---- the measured CPU profile -------------------------------------------------------------

_lock = threading.Lock()
_memo: dict = {}


_DEFAULT_ROOT = str(cachedir.default_root())     # tests move it


def cache_path() -> str:
    root = os.environ.get("STITCHING_CACHE_DIR") or _DEFAULT_ROOT
    return os.path.join(root, CACHE_FILE)


def default_cache_path() -> str:
    """Where the install step leaves the profile every cache falls back to."""
    return os.path.join(_DEFAULT_ROOT, CACHE_FILE)


def measured_cpu(remeasure: bool = False) -> DeviceProfile:
    """This machine's measured profile: measured once per machine, later calls read the
    cache (in memory, then disk).

    A *provisional* measurement (taken while other processes ran, or with a wide spread:
    ``measure_cpu``) is not final: the next process that asks measures again (at most
    ``MAX_ATTEMPTS`` times in all) and keeps, number by number, the highest median seen,
    since interference only ever lowers a throughput; the first quiet measurement
    replaces it.  While provisional, the planner uses the numbers of the machine's
    class where it is a known one (``default``, ``settled``).

    A profile in the *default* cache (``stitching-build`` measures one at install)
    serves when ``$STITCHING_CACHE_DIR`` points elsewhere and has none: it describes the
    machine, not a model (its fingerprint must still match)."""
    path = cache_path()
    fp = _fingerprint()
    with _lock:
        if not remeasure and path in _memo and _memo[path][0] == fp:
            return _memo[path][1]
        prof = None if remeasure else _stored(path, fp)
        if _to_measure(prof, remeasure):
            # Processes starting together (a server's workers) measure one at a time,
            # and one that waited takes the measurement made meanwhile: four cold
            # processes made 20 measurements (1-3.6 s each, every one provisional:
            # the others were the load), and lost each other's attempt counts.
            before, taken = prof, False
            with cachedir.locked(path + ".lock") as waited:
                if not remeasure:
                    prof = _stored(path, fp)
                    # measured by another process while this one waited, or just before
                    taken = prof is not None and (waited or prof != before)
                if remeasure or (_to_measure(prof, False) and not taken):
                    new = measure_cpu()
                    prof = new if prof is None or not new.provisional else _merge(prof, new)
                    _write_cache(path, fp, prof)
        _memo[path] = (fp, prof)
        return prof


# False in a compile worker (compile/worker.py): a provisional profile in the cache
# (its parent's, written before any kernel text the worker emits) is used as it is,
# not measured again while the worker's siblings load the cores.
remeasure_provisional = True


def _to_measure(prof, remeasure: bool) -> bool:
    return remeasure or prof is None or (
        remeasure_provisional and prof.provisional and _attempts(prof) < MAX_ATTEMPTS)


def _stored(path, fp):
    """The profile in this cache, else the install step's (default cache)."""
    prof = _read_cache(path, fp)
    default = default_cache_path()
    if prof is None and default != path:
        prof = _read_cache(default, fp)
    return prof


MAX_ATTEMPTS = 5        # arbitrary: provisional measurements before the best one stays
_ATTEMPTS = "attempts"  # key in ``spread``: how many measurements a provisional one merged


def _attempts(prof: DeviceProfile) -> int:
    return int(prof.spread.get(_ATTEMPTS, 1))


_THROUGHPUTS = ("bandwidth", "bw_per_lane", "cache_bandwidth", "transcendental_per_s")


def _merge(old: DeviceProfile, new: DeviceProfile) -> DeviceProfile:
    """Two provisional measurements as one: each throughput's higher median."""
    best = {k: max(getattr(old, k), getattr(new, k)) for k in _THROUGHPUTS}
    spread = dict(new.spread, **{_ATTEMPTS: _attempts(old) + 1})
    return replace(new, **best, spread=spread,
                   source=new.source + f" (best of {spread[_ATTEMPTS]} provisional "
                                       f"measurements)")


def settled(prof: DeviceProfile) -> DeviceProfile:
    """The profile to plan with: for a machine of a known class (MACHINES), that
    class's throughputs with this machine's own caches, cores and ISA; ``prof`` itself
    for a machine of no known class, or one with a calibration of its own
    (``tools/calibrate.py --install``, fitted against its own numbers).

    The class's throughputs whether this machine's measurement is provisional (taken
    under load: its numbers say little) or final.  The shipped calibration's factors
    were fitted against the class model's numbers, and a machine of the class that
    measures differently planned differently once its measurement came out final: a
    Zen 5 EPYC (class amd-avx512, whose model is a Zen 4's) measured exp at 4.9 G/s
    and 51 GB/s against the model's 3.4 G/s and 30 GB/s, and planned EfficientNetB0 in
    63 kernels against 67 -- which ran 9.4-9.6 ms against 8.4-8.6 ms at batch 1
    (BENCHMARKS.md, ``models@amd_avx512_zen5``) -- while its provisional measurements,
    most of them on that VM, planned 67.  Now every measurement of a machine plans
    alike."""
    model = MACHINES.get(prof.cpu_class)
    if model is None or all(getattr(prof, k) == getattr(model, k) for k in _THROUGHPUTS):
        return prof
    if prof.provisional:
        why = f"provisional ({prof.why_provisional})"
    elif _local_scale() is not None:
        return prof
    else:
        why = "a machine of a known class"
    return replace(prof, **{k: getattr(model, k) for k in _THROUGHPUTS},
                   source=f"{prof.source}; {why}, planning with the {model.name} model's "
                          f"throughputs (docs/machines.md: profiles of a known class)")


def _read_cache(path, fp):
    """The measured profile stored at ``path`` for this machine (``fp``), or None: no
    file, another version or machine, or damage (measured again).  Its numbers are
    checked as a profile file's: a 0 or NaN bandwidth (a damaged or edited file)
    failed every plan deep in the cost model."""
    try:
        d = json.loads(cachedir.read_file(path, MAX_PROFILE_BYTES))
        if d.get("version") != CACHE_VERSION or d.get("fingerprint") != fp:
            return None
        return _checked(d["profile"], path)
    except ProfileFileError as e:
        warnings.warn(f"stitching: {e}; measuring this machine again", RuntimeWarning,
                      stacklevel=2)
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_cache(path, fp, prof):
    # best effort: a read-only home measures again next process, no harm done
    cachedir.store(path, json.dumps({"version": CACHE_VERSION, "fingerprint": fp,
                                     "profile": prof.to_dict()}, indent=1,
                                    sort_keys=True).encode())


@functools.lru_cache(maxsize=None)   # the machine does not change under a process
def _fingerprint() -> str:
    return f"{cpu_facts()['model']}|{usable_cores()}|{sorted(_cache_sizes().items())}"


@functools.lru_cache(maxsize=None)   # the machine does not change under a process
def cpu_facts() -> dict:
    """What this CPU is, from /proc/cpuinfo: model, vendor, its feature flags (a
    frozenset), widest vector ISA, class."""
    import platform
    model, vendor, flags = "?", "?", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "model name" and model == "?":
                    model = val.strip()
                elif key == "vendor_id" and vendor == "?":
                    vendor = val.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(val.split())
    except OSError:
        pass
    arch = platform.machine().lower()
    if arch in ("aarch64", "arm64"):
        isa = "neon"
    else:
        isa = next((i for i in ("avx512f", "avx2", "avx") if i in flags), "sse2")
    short = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(vendor, vendor.lower())
    return {"model": model, "vendor": vendor, "arch": arch, "isa": isa,
            "flags": frozenset(flags),
            "cpu_class": f"{short}-{isa.replace('avx512f', 'avx512')}"}


VECTOR_BYTES = {"avx512f": 64, "avx2": 32, "avx": 32, "sse2": 16, "neon": 16}


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask; the CPU count elsewhere)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.lru_cache(maxsize=None)   # read per trace before: ~4 ms of every re-plan
def _cache_sizes() -> dict:
    """level -> bytes per core (L1 data, L2) or shared (L3), from sysfs."""
    out = {}
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for idx in sorted(os.listdir(base)):
            d = os.path.join(base, idx)
            with open(os.path.join(d, "type")) as f:
                kind = f.read().strip()
            if kind == "Instruction":
                continue
            with open(os.path.join(d, "level")) as f:
                level = int(f.read())
            with open(os.path.join(d, "size")) as f:
                s = f.read().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
            out[f"l{level}"] = int(s.rstrip("KMG")) * mult
    except (OSError, ValueError):
        pass
    return out or {"l1": 32 << 10, "l2": 512 << 10, "l3": 8 << 20}   # arbitrary fallback


# When a measurement is provisional (labelled, arbitrary):
BUSY_FRACTION = 0.2     # other processes used more than this share of all cores' time
WIDE_SPREAD = 0.3       # a number's trials spread over more than this share of its median
MIN_THREAD_GAIN = 1.4   # exp in all threads beat one thread by less: a core is busy
TRIALS = 7


def measure_cpu() -> DeviceProfile:
    """Copy bandwidth (one core, all cores), cache bandwidth, exp throughput (one core,
    all cores): ``TRIALS`` timed trials of each, the median kept with its spread
    ((max - min) / median), about a second in all.

    STREAM-style accounting: a copy moves 2 x its size.  The CPU time other processes
    used during the measurement is read from /proc/stat (minus this process's own).  The
    profile is *provisional* when they used more than ``BUSY_FRACTION`` of the machine,
    when a number's spread is over ``WIDE_SPREAD``, or when exp in all threads beats
    one thread by less than ``MIN_THREAD_GAIN`` (a core was not free): measured_cpu
    measures it again in a later process."""
    import numpy as np
    cores = usable_cores()
    caches = _cache_sizes()
    facts = cpu_facts()
    before = _cpu_times()
    big = 8 << 20                                   # 32 MB of float32 per lane
    one = _copy_bw(np, big, threads=1)
    allc = _copy_bw(np, big, threads=cores) if cores > 1 else one
    l2 = caches.get("l2", 512 << 10)
    cache_bw = [r * cores for r in _cache_bw(np, max(4096, l2 // 4))]   # a quarter of L2
    exp_one = _exp_rate(np, threads=1)
    exp_all = _exp_rate(np, threads=cores) if cores > 1 else exp_one
    others = _others_busy(before, _cpu_times(), cores)
    trials = {"bandwidth": allc, "bw_per_lane": one, "cache_bandwidth": cache_bw,
              "transcendental_per_s": exp_all, "exp1": exp_one}
    med = {k: statistics.median(v) for k, v in trials.items()}
    spread = {k: round((max(v) - min(v)) / med[k], 3) for k, v in trials.items()
              if k != "exp1"}
    gain = med["transcendental_per_s"] / med["exp1"]
    why = []
    if others > BUSY_FRACTION:
        why.append(f"other processes used {others:.0%} of the CPUs")
    wide = [k for k, v in spread.items() if v > WIDE_SPREAD]
    if wide:
        why.append(f"wide spread in {', '.join(wide)}")
    if cores > 1 and gain < MIN_THREAD_GAIN:
        why.append(f"{cores} threads ran exp only {gain:.2f}x faster than one")
    spread["others_busy"] = round(others, 3)
    bandwidth = max(med["bw_per_lane"], med["bandwidth"])
    # A loaded machine can measure anything; keep the profile physically sensible.
    cache_bandwidth = max(med["cache_bandwidth"], _CACHE_OVER_DRAM * bandwidth)
    return DeviceProfile(
        name="cpu", backend="cpu", bandwidth=bandwidth, lanes=cores,
        bw_per_lane=min(med["bw_per_lane"], bandwidth), units=cores,
        cache_bandwidth=cache_bandwidth, scratch_per_task=l2, scratch_per_unit=l2,
        registers_per_unit=32 if facts["isa"] == "avx512f" else 16,
        max_threads_per_task=1, max_threads_per_unit=1,
        vector_bytes=VECTOR_BYTES.get(facts["isa"], 16), launch_s=_CPU_LAUNCH_S,
        task_s=_CPU_TASK_S, transcendental_per_s=max(med["transcendental_per_s"],
                                                      med["exp1"]),
        caches=caches, measured=True, isa=facts["isa"], cpu_class=facts["cpu_class"],
        measured_at=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        provisional=bool(why), why_provisional="; ".join(why), spread=spread,
        source=f"cpu (measured on this {facts['model']}, {TRIALS} trials, medians)")


def _cpu_times():
    """(busy seconds of all CPUs from /proc/stat, this process's CPU seconds, wall)."""
    busy = None
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)      # idle + iowait
        busy = (sum(vals[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # steal counts as busy
    except (OSError, ValueError, IndexError):
        pass
    t = os.times()
    return busy, t.user + t.system, time.monotonic()


def _others_busy(before, after, cores) -> float:
    """Share of all cores' time that other processes used between two _cpu_times."""
    if before[0] is None or after[0] is None:
        return 0.0
    wall = max(after[2] - before[2], 1e-6)
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others) / (wall * cores)


def _trials(fn, reps=TRIALS) -> list:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(max(time.perf_counter() - t, 1e-9))
    return out


def _threaded(threads, work):
    """A function running ``work(i)`` for i in range(threads), in threads when > 1
    (NumPy releases the GIL in copies and ufunc loops)."""
    if threads == 1:
        return lambda: work(0)

    def run():
        ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    return run


def _copy_bw(np, n, threads) -> list:
    srcs = [np.ones(n, np.float32) for _ in range(threads)]
    dsts = [np.empty(n, np.float32) for _ in range(threads)]
    run = _threaded(threads, lambda i: np.copyto(dsts[i], srcs[i]))
    run()   # fault the pages in
    return [2 * 4 * n * threads / t for t in _trials(run)]


def _cache_bw(np, nbytes) -> list:
    """Re-read one cache-resident block ``reps`` times in a single NumPy call (a stride-0
    view summed over its first axis): a Python loop of small copies measures the
    interpreter, not the cache."""
    from numpy.lib.stride_tricks import as_strided
    n = nbytes // 4
    a, b = np.ones(n, np.float32), np.empty(n, np.float32)
    reps = 400
    view = as_strided(a, shape=(reps, n), strides=(0, 4))

    def run():
        np.add.reduce(view, axis=0, out=b)
    run()
    return [2 * 4 * n * reps / t for t in _trials(run)]


def _exp_rate(np, threads=1) -> list:
    """exp evaluations per second, whole machine, in ``threads`` threads."""
    a = [np.linspace(-4, 4, 1 << 22, dtype=np.float32) for _ in range(threads)]
    out = [np.empty_like(x) for x in a]
    run = _threaded(threads, lambda i: np.exp(a[i], out=out[i]))
    run()
    return [a[0].size * threads / t for t in _trials(run)]


def with_overrides(profile: DeviceProfile, **kw) -> DeviceProfile:
    """A copy with some fields changed (tests, what-if studies)."""
    return replace(profile, **kw)
